"""A zoo of small models we did not write, each with a one-device loss and reference.

Every factory returns a :class:`ZooEntry`: the object a user passes as
``TrainState.create(model=...)`` (a linen Module, an ``nnx.Module`` or a transformers
``FlaxPreTrainedModel``), its parameters, any other variable collections, a batch maker and
a loss written the way a user writes it for one device. :func:`reference_trajectory` trains
an entry with plain ``jax.jit`` + optax on one device: the ground truth for the parity tests
in ``test_zoo.py`` (run on the entry's float64 twin, :func:`float64_twin`). Everything is
tiny (d_model <= 32, 2 layers, vocab 64, seq 8, images 8x8) so that compiles stay fast on
two CPU cores.

The loss convention, for every entry::

    loss(apply, params_or_vars, batch, train, rng=None)

``apply`` is the entry's one-device ``apply`` (``entry.apply``) or, inside a zeropp step,
``state.apply_fn``; the loss calls it the way the model family is called:

* linen / NNX: ``apply({"params": params}, *inputs, ...)``. Entries with other collections
  (``batch_stats``) take the whole variables dict and return ``(loss, new_collections)``.
* transformers: ``apply(**inputs, params=params, dropout_rng=rng, train=train)`` (the call
  of transformers' ``examples/flax/*/run_*_flax.py``: ``state.apply_fn(**batch,
  params=params, dropout_rng=dropout_rng, train=True)`` with ``apply_fn=model.__call__``).

How a ``FlaxPreTrainedModel.__call__`` maps onto its linen module (transformers 4.57.6; read
from the installed ``modeling_flax_*.py``). In every case ``params=None`` means
``self.params`` (literally ``{"params": params or self.params}``, so ``params`` is tested for
truth), ``dropout_rng`` becomes ``rngs={"dropout": dropout_rng}`` (``{}`` when None),
``train`` becomes ``deterministic=not train``, every id/mask array is cast with
``jnp.array(x, dtype="i4")``, and ``output_attentions`` / ``output_hidden_states`` /
``return_dict`` default to the config's values. ``model.module`` is the linen module:

* ``FlaxGPT2LMHeadModel.__call__(input_ids, attention_mask=None, position_ids=None,
  encoder_hidden_states=None, encoder_attention_mask=None, params=None,
  past_key_values=None, dropout_rng=None, train=False, output_attentions=None,
  output_hidden_states=None, return_dict=None)``::

      module.apply({"params": params}, input_ids, attention_mask, position_ids,
                   encoder_hidden_states, encoder_attention_mask,
                   not train,            # deterministic
                   False,                # init_cache
                   output_attentions, output_hidden_states, return_dict,
                   rngs=rngs, mutable=False)

  (all positional; ``attention_mask`` defaults to ``jnp.ones((B, S))``, ``position_ids`` to
  ``broadcast_to(arange(S), (B, S))``; with ``past_key_values`` the dict gets
  ``"cache"`` and ``mutable=["cache"]``).
* ``FlaxBertForMaskedLM.__call__(input_ids, attention_mask=None, token_type_ids=None,
  position_ids=None, head_mask=None, encoder_hidden_states=None,
  encoder_attention_mask=None, params=None, dropout_rng=None, train=False,
  output_attentions=None, output_hidden_states=None, return_dict=None,
  past_key_values=None)``; with ``config.add_cross_attention`` False (the MLM case)::

      module.apply({"params": params}, input_ids, attention_mask,      # 2 positional
                   token_type_ids=..., position_ids=..., head_mask=...,
                   deterministic=not train, output_attentions=...,
                   output_hidden_states=..., return_dict=..., rngs=rngs)

  Defaults built inside: ``token_type_ids = zeros_like(input_ids)``, ``position_ids =
  broadcast_to(arange(S), input_ids.shape)``, ``attention_mask = ones_like(input_ids)``,
  ``head_mask = jnp.ones((num_hidden_layers, num_attention_heads))`` (float) then cast to
  ``"i4"``; it is multiplied into every layer's attention weights.
* ``FlaxT5ForConditionalGeneration.__call__(input_ids, attention_mask=None,
  decoder_input_ids=None, decoder_attention_mask=None, output_attentions=None,
  output_hidden_states=None, return_dict=None, train=False, params=None,
  dropout_rng=None)``: ``decoder_input_ids`` is required (ValueError otherwise)::

      module.apply({"params": params}, input_ids=..., attention_mask=...,
                   decoder_input_ids=..., decoder_attention_mask=...,
                   output_attentions=..., output_hidden_states=..., return_dict=...,
                   deterministic=not train, rngs=rngs)          # all by keyword

  Masks default to ``ones_like`` of their ids.
* ``FlaxLlamaForCausalLM.__call__(input_ids, attention_mask=None, position_ids=None,
  params=None, past_key_values=None, dropout_rng=None, train=False,
  output_attentions=None, output_hidden_states=None, return_dict=None)``::

      module.apply({"params": params}, input_ids, attention_mask, position_ids,
                   not train,            # deterministic
                   False,                # init_cache
                   output_attentions, output_hidden_states, return_dict,
                   rngs=rngs, mutable=False)                    # all positional

Each returns a ``ModelOutput`` (``return_dict`` defaults to True); ``[0]`` is the logits.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any

VOCAB = 64
SEQ = 8
D = 16
LAYERS = 2
HEADS = 2
IMAGE = 8
CLASSES = 10


@dataclasses.dataclass(frozen=True, eq=False)
class ZooEntry:
    """One model of the zoo.

    Attributes:
      name: short id (the pytest parameter).
      kind: ``"linen"``, ``"nnx"`` or ``"hf"`` (a transformers ``FlaxPreTrainedModel``).
      model: what a user passes as ``TrainState.create(model=...)``.
      params: the ``"params"`` collection (linen, hf: a nested dict; nnx: the
        ``nnx.State`` of ``nnx.Param`` variables, ``nnx.state(model, nnx.Param)``).
      collections: the other variable collections (``{"batch_stats": ...}``), else ``{}``.
      make_batch: ``make_batch(rng: np.random.Generator, global_batch) -> dict`` of numpy
        arrays, every leaf with the batch on its leading axis.
      loss: ``loss(apply, params_or_vars, batch, train, rng=None)`` (module docstring).
        With collections: ``params_or_vars`` is the whole variables dict and the loss
        returns ``(loss, new_collections)``.
      apply: the one-device ``apply`` the loss is written against (``model.apply``,
        ``model.__call__``, or :func:`nnx_apply`).
      notes: what makes the model interesting for ZeRO.
    """

    name: str
    kind: str
    model: Any
    params: PyTree
    collections: Mapping[str, PyTree]
    make_batch: Callable[[np.random.Generator, int], dict]
    loss: Callable[..., Any]
    apply: Callable[..., Any]
    notes: str = ""

    @property
    def variables(self) -> dict:
        return {"params": self.params, **self.collections}


def _xent(logits: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _lm_batch(rng: np.random.Generator, global_batch: int) -> dict:
    return {"tokens": rng.integers(0, VOCAB, (global_batch, SEQ + 1)).astype(np.int32)}


def _lm_loss(apply, params, batch, train, rng=None):
    """Next-token loss of a linen/NNX LM ``apply({"params": p}, tokens[:, :-1])``."""
    tok = batch["tokens"]
    logits = apply({"params": params}, tok[:, :-1])
    return _xent(logits, tok[:, 1:])


# XLA:CPU's default backend optimization spends seconds on code that runs for
# microseconds here (the tiny ResNet's init: 10 s at the default level, 1 s at 0). The
# reference and the inits are compiled at level 0: the same fp32 operations, less
# optimized machine code.
_FAST_COMPILE = {"xla_backend_optimization_level": 0}


def fast_jit(fn: Callable[..., Any], *args: Any) -> Callable[..., Any]:
    """``jax.jit(fn)`` compiled for ``args`` with XLA's backend optimization off."""
    return fast_compile(jax.jit(fn).lower(*args))


def fast_compile(lowered: Any) -> Callable[..., Any]:
    """``lowered.compile()`` with XLA's backend optimization off."""
    try:
        return lowered.compile(compiler_options=_FAST_COMPILE)
    except Exception:  # an XLA that does not know the option: default compile
        return lowered.compile()


def _perturb(params: PyTree, seed: int, scale: float = 0.05) -> PyTree:
    """Adds small noise so that no parameter sits at a special value (LayerNorm's ones and
    zeros, zero biases): parity tests should not pass because an update happens to be 0."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x) + scale * rng.standard_normal(np.shape(x)).astype(np.float32),
        params,
    )


# --------------------------------------------------------------------------------------
# Linen re-creations of common patterns
# --------------------------------------------------------------------------------------


class MlpBlock(nn.Module):
    """Pre-LN residual MLP (the unit a lot of the zoo repeats)."""

    d: int = D

    @nn.compact
    def __call__(self, x):
        y = nn.LayerNorm()(x)
        y = nn.Dense(2 * self.d)(y)
        return x + nn.Dense(self.d)(nn.gelu(y))


class AttnBlock(nn.Module):
    """Pre-LN causal self-attention + MLP (flax examples' EncoderDecoder1DBlock shape)."""

    d: int = D
    heads: int = HEADS
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x, mask, deterministic: bool = True):
        y = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(
            num_heads=self.heads, qkv_features=self.d, dropout_rate=self.dropout_rate,
            deterministic=deterministic,
        )(y, y, mask=mask)
        x = x + nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        return MlpBlock(self.d)(x)


class AddPositionEmbs(nn.Module):
    """lm1b's learned position embedding: a param ``pos_embedding`` ``[1, max_len, d]``."""

    max_len: int = SEQ

    @nn.compact
    def __call__(self, x):
        pe = self.param("pos_embedding", nn.initializers.normal(0.02),
                        (1, self.max_len, x.shape[-1]))
        return x + pe[:, : x.shape[1]]


def _shift_right(x: jax.Array) -> jax.Array:
    return jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]


class Lm1bDecoder(nn.Module):
    layers: int = LAYERS
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, inputs, deterministic: bool):
        y = nn.Embed(VOCAB, D, name="embed")(_shift_right(inputs))
        y = AddPositionEmbs(name="posembed_output")(y)
        y = nn.Dropout(self.dropout_rate)(y, deterministic=deterministic)
        mask = nn.make_causal_mask(inputs)
        for i in range(self.layers):
            y = AttnBlock(dropout_rate=self.dropout_rate, name=f"encoderdecoderblock_{i}")(
                y, mask, deterministic)
        y = nn.LayerNorm(name="encoderdecoder_norm")(y)
        return nn.Dense(VOCAB, name="logitdense")(y)


class TransformerLM(nn.Module):
    """flax examples/lm1b: every block sits under the one ``decoder`` child of the root
    (``decoder/encoderdecoderblock_{i}``), so "direct children of the root" is one unit."""

    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, inputs, train: bool = False):
        return Lm1bDecoder(dropout_rate=self.dropout_rate, name="decoder")(
            inputs, deterministic=not train)


def _lm1b_loss(apply, params, batch, train, rng=None):
    # lm1b trains the decoder on the inputs themselves (it shifts right internally).
    tok = batch["tokens"][:, :-1]
    kw = {"rngs": {"dropout": rng}} if rng is not None else {}
    return _xent(apply({"params": params}, tok, train, **kw), tok)


class WmtEncoder(nn.Module):
    shared_embedding: nn.Module
    layers: int = LAYERS

    @nn.compact
    def __call__(self, inputs):
        x = self.shared_embedding(inputs)
        x = AddPositionEmbs(name="posembed_input")(x)
        for i in range(self.layers):
            x = AttnBlock(name=f"encoderblock_{i}")(x, None)
        return nn.LayerNorm(name="encoder_norm")(x)


class WmtDecoderBlock(nn.Module):
    @nn.compact
    def __call__(self, y, encoded, mask):
        z = nn.LayerNorm()(y)
        z = nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(z, z, mask=mask)
        y = y + z
        z = nn.LayerNorm()(y)
        y = y + nn.MultiHeadDotProductAttention(num_heads=HEADS, qkv_features=D)(z, encoded)
        return MlpBlock()(y)


class WmtDecoder(nn.Module):
    shared_embedding: nn.Module
    layers: int = LAYERS

    @nn.compact
    def __call__(self, encoded, targets):
        y = self.shared_embedding(_shift_right(targets))
        y = AddPositionEmbs(name="posembed_output")(y)
        mask = nn.make_causal_mask(targets)
        for i in range(self.layers):
            y = WmtDecoderBlock(name=f"encoderdecoderblock_{i}")(y, encoded, mask)
        y = nn.LayerNorm(name="encoderdecoder_norm")(y)
        logits = self.shared_embedding.attend(y)  # logits_via_embedding
        return logits / jnp.sqrt(y.shape[-1])


class WmtTransformer(nn.Module):
    """flax examples/wmt: one ``nn.Embed`` made in the root's setup and handed to encoder
    and decoder as an attribute; called via ``__call__`` in both, via ``.attend`` for the
    decoder's logits. Its params live at the root (``shared_embedding``)."""

    def setup(self):
        self.shared_embedding = nn.Embed(VOCAB, D, embedding_init=nn.initializers.normal(1.0))
        self.encoder = WmtEncoder(shared_embedding=self.shared_embedding)
        self.decoder = WmtDecoder(shared_embedding=self.shared_embedding)

    def __call__(self, inputs, targets):
        return self.decoder(self.encoder(inputs), targets)


def _seq2seq_batch(rng: np.random.Generator, global_batch: int) -> dict:
    return {
        "inputs": rng.integers(1, VOCAB, (global_batch, SEQ)).astype(np.int32),
        "targets": rng.integers(1, VOCAB, (global_batch, SEQ)).astype(np.int32),
    }


def _wmt_loss(apply, params, batch, train, rng=None):
    logits = apply({"params": params}, batch["inputs"], batch["targets"])
    return _xent(logits, batch["targets"])


class TiedVariablesLM(nn.Module):
    """GPT-2/BERT-style tied head: the root reads the embedding table straight out of the
    child's variables (``self.embed.variables['params']['embedding']``), not through a
    method call of ``embed``."""

    def setup(self):
        self.embed = nn.Embed(VOCAB, D)
        self.blocks = [MlpBlock() for _ in range(LAYERS)]
        self.norm = nn.LayerNorm()

    def __call__(self, tokens):
        x = self.embed(tokens)
        for b in self.blocks:
            x = b(x)
        x = self.norm(x)
        return x @ self.embed.variables["params"]["embedding"].T


class CalledTwice(nn.Module):
    """One block instance called twice in one forward (shared weights, two call sites)."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embed")(tokens)
        shared = MlpBlock(name="shared_block")
        x = shared(x)
        x = MlpBlock(name="block")(x)
        x = shared(x)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="norm")(x))


class ResBlock(nn.Module):
    features: int
    strides: int = 1

    @nn.compact
    def __call__(self, x, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.Conv(self.features, (3, 3), (self.strides, self.strides), use_bias=False)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), (self.strides, self.strides), use_bias=False,
                        name="conv_proj")(x)
            x = norm(name="norm_proj")(x)
        return nn.relu(x + y)


class ResNetTiny(nn.Module):
    """flax examples/imagenet ResNet shape: BatchNorm with ``use_running_average=not
    train``, a ``batch_stats`` collection updated with ``mutable=["batch_stats"]``."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(8, (3, 3), use_bias=False, name="conv_init")(x)
        x = nn.BatchNorm(use_running_average=not train, momentum=0.9, name="bn_init")(x)
        x = nn.relu(x)
        x = ResBlock(8, name="block_0")(x, train)
        x = ResBlock(16, strides=2, name="block_1")(x, train)
        x = jnp.mean(x, axis=(1, 2))
        return nn.Dense(CLASSES, name="head")(x)


def _image_batch(rng: np.random.Generator, global_batch: int) -> dict:
    return {
        "image": rng.standard_normal((global_batch, IMAGE, IMAGE, 3)).astype(np.float32),
        "label": rng.integers(0, CLASSES, (global_batch,)).astype(np.int32),
    }


def _resnet_loss(apply, variables, batch, train, rng=None):
    if train:
        logits, new = apply(variables, batch["image"], True, mutable=["batch_stats"])
    else:
        logits, new = apply(variables, batch["image"], False), {
            k: v for k, v in variables.items() if k != "params"}
    return _xent(logits, batch["label"]), dict(new)


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return MlpBlock()(x), None


class ScanLM(nn.Module):
    """MaxText-style ``nn.scan`` stack: ``layers`` params carry a leading layer axis."""

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D, name="embed")(tokens)
        stack = nn.scan(ScanBody, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=LAYERS)
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(VOCAB, name="head")(nn.LayerNorm(name="norm")(x))


def _linen_entry(name, model, init_args, loss, make_batch, seed, notes, collections=()):
    key = jax.random.PRNGKey(seed)
    variables = fast_jit(lambda k: model.init(k, *init_args), key)(key)
    params = _perturb(variables["params"], seed + 1)
    colls = {c: jax.tree_util.tree_map(np.asarray, variables[c]) for c in collections}
    return ZooEntry(name, "linen", model, params, colls, make_batch, loss, model.apply, notes)


_TOK = np.zeros((2, SEQ), np.int32)


def lm1b() -> ZooEntry:
    return _linen_entry("lm1b", TransformerLM(), (_TOK, False), _lm1b_loss, _lm_batch, 10,
                        "blocks nested one level down: decoder/encoderdecoderblock_i")


def wmt() -> ZooEntry:
    return _linen_entry("wmt", WmtTransformer(), (_TOK, _TOK), _wmt_loss, _seq2seq_batch, 20,
                        "shared nn.Embed passed as attribute; __call__ in enc+dec, .attend")


def tied_variables() -> ZooEntry:
    return _linen_entry("tied_variables", TiedVariablesLM(), (_TOK,), _lm_loss, _lm_batch, 30,
                        "root reads self.embed.variables['params']['embedding']")


def called_twice() -> ZooEntry:
    return _linen_entry("called_twice", CalledTwice(), (_TOK,), _lm_loss, _lm_batch, 40,
                        "shared_block called twice per forward")


def resnet_bn() -> ZooEntry:
    img = np.zeros((2, IMAGE, IMAGE, 3), np.float32)
    return _linen_entry("resnet_bn", ResNetTiny(), (img, False), _resnet_loss, _image_batch,
                        50, "BatchNorm, batch_stats collection", collections=("batch_stats",))


def scan_stack() -> ZooEntry:
    return _linen_entry("scan_stack", ScanLM(), (_TOK,), _lm_loss, _lm_batch, 60,
                        "nn.scan over blocks: layers/* has a leading [LAYERS] axis")


# --------------------------------------------------------------------------------------
# Flax NNX
# --------------------------------------------------------------------------------------


def nnx_apply(model) -> Callable[..., Any]:
    """The one-device ``apply`` of an NNX model, in linen's calling convention:
    ``apply({"params": params}, *args, **kwargs)`` merges ``params`` (an ``nnx.State`` of
    ``nnx.Param`` or its pure dict) into a copy of the model's graph and calls it.
    Functional: the model object itself is not modified."""
    from flax import nnx

    graphdef, template, rest = nnx.split(model, nnx.Param, ...)

    def apply(variables, *args, **kwargs):
        params = variables["params"]
        if not isinstance(params, nnx.State):
            state = jax.tree_util.tree_map(lambda x: x, template)
            nnx.replace_by_pure_dict(state, params)
            params = state
        return nnx.merge(graphdef, params, rest)(*args, **kwargs)

    return apply


def _nnx_classes():
    from flax import nnx

    class NnxMlp(nnx.Module):
        def __init__(self, d, *, rngs):
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.fc1 = nnx.Linear(d, 2 * d, rngs=rngs)
            self.fc2 = nnx.Linear(2 * d, d, rngs=rngs)

        def __call__(self, x):
            return x + self.fc2(nnx.gelu(self.fc1(self.norm(x))))

    class NnxBlock(nnx.Module):
        def __init__(self, d, heads, *, rngs):
            self.norm = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, qkv_features=d,
                                               decode=False, rngs=rngs)
            self.mlp = NnxMlp(d, rngs=rngs)

        def __call__(self, x, mask):
            y = self.norm(x)
            return self.mlp(x + self.attn(y, mask=mask))

    class NnxTransformer(nnx.Module):
        """Several identical blocks in an ``nnx.List`` (a plain python list of Modules is
        an error in flax 0.12: "use nnx.List or nnx.data")."""

        def __init__(self, layers=3, *, rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
            self.blocks = nnx.List([NnxBlock(D, HEADS, rngs=rngs) for _ in range(layers)])
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.head = nnx.Linear(D, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            mask = nnx.make_causal_mask(tokens)
            for b in self.blocks:
                x = b(x, mask)
            return self.head(self.norm(x))

    class NnxTied(nnx.Module):
        """Tied head through ``self.embed.attend``."""

        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
            self.blocks = nnx.List([NnxMlp(D, rngs=rngs) for _ in range(LAYERS)])
            self.norm = nnx.LayerNorm(D, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.embed.attend(self.norm(x))

    class NnxMlpLM(nnx.Module):
        """Embed + 2 MLP blocks + head, for wrapping with ``nnx.bridge.to_linen``."""

        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
            self.blocks = nnx.List([NnxMlp(D, rngs=rngs) for _ in range(LAYERS)])
            self.head = nnx.Linear(D, VOCAB, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    return NnxTransformer, NnxTied, NnxMlpLM


def _nnx_entry(name, cls, seed, notes):
    from flax import nnx

    model = cls(rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    nnx.replace_by_pure_dict(state, _perturb(nnx.to_pure_dict(state), seed + 1))
    nnx.update(model, state)
    params = nnx.state(model, nnx.Param)
    return ZooEntry(name, "nnx", model, params, {}, _lm_batch, _lm_loss, nnx_apply(model), notes)


def nnx_transformer() -> ZooEntry:
    return _nnx_entry("nnx_transformer", _nnx_classes()[0], 70,
                      "nnx.List of 3 identical blocks (MultiHeadAttention + MLP)")


def nnx_tied() -> ZooEntry:
    return _nnx_entry("nnx_tied", _nnx_classes()[1], 80, "tied head via self.embed.attend")


def nnx_bridge() -> ZooEntry:
    """``nnx.bridge.to_linen(NnxMlpLM)``: a linen module whose params tree mirrors the NNX
    state as a plain dict, ``{'embed': {'embedding'}, 'blocks': {0: {...}, 1: {...}},
    'head': {...}}`` with *int* keys 0, 1 under ``blocks`` (nnx.List indices; no
    ``NNXMeta`` boxes with the default ``metadata_fn``). ``embed``, ``blocks``, ``head`` are
    NOT linen submodules: the only linen module is the root ``ToLinen``. Each apply builds
    a fresh NNX module from ``rngs`` (new random weights), ``nnx.update``-s it from
    ``self.variables`` (all collections of the root scope, unknown paths only *warn*) and
    calls it. So if a library hands the root only part of the params (e.g. expects units
    ``embed``/``blocks``/``head`` to be gathered by intercepting linen child modules, which
    never run), the missing leaves silently stay at the fresh random init: the output no
    longer depends on them and their gradient is exactly zero."""
    from flax.nnx import bridge

    model = bridge.to_linen(_nnx_classes()[2])
    return _linen_entry("nnx_bridge", model, (_TOK,), _lm_loss, _lm_batch, 90,
                        "nnx.bridge.to_linen: root-only linen module, int keys in params")


# --------------------------------------------------------------------------------------
# transformers (Flax), random init from tiny configs
# --------------------------------------------------------------------------------------

_jnp_clip = jnp.clip


def _clip_compat(a=None, /, min=None, max=None, *, a_min=None, a_max=None, **kw):
    """``jnp.clip`` accepting the ``a_min``/``a_max`` keywords JAX removed (transformers
    4.57's Flax T5 relative-position buckets call ``jnp.clip(x, a_max=...)``)."""
    return _jnp_clip(a, a_min if a_min is not None else min, a_max if a_max is not None else max,
                     **kw)


@contextlib.contextmanager
def jnp_clip_compat():
    """Within: ``jax.numpy.clip`` takes ``a_min``/``a_max`` (for transformers' Flax T5).
    Patches the module attribute, which T5 looks up at call (trace) time."""
    saved = jnp.clip
    jnp.clip = _clip_compat
    try:
        yield
    finally:
        jnp.clip = saved


@contextlib.contextmanager
def hf_compat():
    """What transformers' Flax models need under this test suite: ``jnp.clip`` with
    ``a_min``/``a_max`` (T5), and implicit rank promotion, which ``tests/conftest.py`` sets
    to ``"raise"`` globally while e.g. GPT-2's ``FlaxConv1D`` adds a ``[3d]`` bias to a
    ``[B, S, 3d]`` output. Wrap both the model's construction and every trace of a step."""
    with jnp_clip_compat(), jax.numpy_rank_promotion("allow"):
        yield


def _hf_clm_batch(rng: np.random.Generator, global_batch: int) -> dict:
    ids = rng.integers(0, VOCAB, (global_batch, SEQ)).astype(np.int32)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}


def _hf_clm_loss(apply, params, batch, train, rng=None):
    """run_clm_flax.py's loss: logits[:, :-1] against labels[:, 1:]."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = apply(**inputs, params=params, dropout_rng=rng, train=train)[0]
    return _xent(logits[:, :-1], batch["labels"][:, 1:])


MASK_ID = 3
MASKED_PER_ROW = 2


def _hf_mlm_batch(rng: np.random.Generator, global_batch: int) -> dict:
    """Exactly MASKED_PER_ROW masked positions per row, so every device's weighted mean
    covers the same count and the mean of device means is the global mean."""
    ids = rng.integers(4, VOCAB, (global_batch, SEQ)).astype(np.int32)
    pos = np.argsort(rng.random((global_batch, SEQ)), axis=1)[:, :MASKED_PER_ROW]
    weight = np.zeros((global_batch, SEQ), np.float32)
    np.put_along_axis(weight, pos, 1.0, axis=1)
    masked = np.where(weight > 0, MASK_ID, ids).astype(np.int32)
    return {"input_ids": masked, "attention_mask": np.ones_like(ids),
            "token_type_ids": np.zeros_like(ids), "labels": ids, "label_weight": weight}


def _hf_mlm_loss(apply, params, batch, train, rng=None):
    inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "token_type_ids")}
    logits = apply(**inputs, params=params, dropout_rng=rng, train=train)[0]
    xe = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
    w = batch["label_weight"]
    return jnp.sum(xe * w) / jnp.sum(w)


def _hf_s2s_batch(rng: np.random.Generator, global_batch: int) -> dict:
    ids = rng.integers(1, VOCAB, (global_batch, SEQ)).astype(np.int32)
    labels = rng.integers(1, VOCAB, (global_batch, SEQ)).astype(np.int32)
    dec = np.concatenate([np.zeros((global_batch, 1), np.int32), labels[:, :-1]], axis=1)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids),
            "decoder_input_ids": dec, "decoder_attention_mask": np.ones_like(dec),
            "labels": labels}


def _hf_s2s_loss(apply, params, batch, train, rng=None):
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = apply(**inputs, params=params, dropout_rng=rng, train=train)[0]
    return _xent(logits, batch["labels"])


def _hf_entry(name, cls, config, make_batch, loss, notes, seed):
    with hf_compat():
        # _do_init=True would run init_weights op by op (hf_llama: ~135 small compiles, 9 s
        # on a 2-core Xeon); the same call compiled as one program draws the same weights
        # from the same key.
        model = cls(config, input_shape=(1, SEQ), seed=seed, dtype=jnp.float32, _do_init=False)
        key = jax.random.PRNGKey(seed)
        model._is_initialized = True  # what _do_init=True sets, without its eager init
        model.params = fast_jit(lambda k: model.init_weights(k, (1, SEQ)), key)(key)
    params = _perturb(model.params, seed + 1)
    return ZooEntry(name, "hf", model, params, {}, make_batch, loss, model.__call__, notes)


def hf_gpt2(dropout: float = 0.0) -> ZooEntry:
    import transformers as T

    cfg = T.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=D, n_layer=LAYERS,
                       n_head=HEADS, resid_pdrop=dropout, embd_pdrop=dropout,
                       attn_pdrop=dropout)
    name = "hf_gpt2" if dropout == 0 else "hf_gpt2_dropout"
    return _hf_entry(name, T.FlaxGPT2LMHeadModel, cfg, _hf_clm_batch, _hf_clm_loss,
                     "tied head: lm_head.apply with transformer.variables['params']['wte']",
                     100)


def hf_bert() -> ZooEntry:
    import transformers as T

    cfg = T.BertConfig(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS,
                       num_attention_heads=HEADS, intermediate_size=2 * D,
                       max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    return _hf_entry("hf_bert", T.FlaxBertForMaskedLM, cfg, _hf_mlm_batch, _hf_mlm_loss,
                     "tied MLM head; head_mask array built inside __call__", 110)


def hf_t5() -> ZooEntry:
    import transformers as T

    cfg = T.T5Config(vocab_size=VOCAB, d_model=D, d_kv=D // HEADS, d_ff=2 * D,
                     num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=HEADS,
                     relative_attention_num_buckets=8, relative_attention_max_distance=16,
                     dropout_rate=0.0, decoder_start_token_id=0)
    return _hf_entry("hf_t5", T.FlaxT5ForConditionalGeneration, cfg, _hf_s2s_batch,
                     _hf_s2s_loss, "shared Embed passed to both stacks; tied lm_head", 120)


def hf_llama() -> ZooEntry:
    import transformers as T

    # max_position_embeddings >= 2 * head_dim: 4.57's create_sinusoidal_positions slices
    # the table's last axis to num_pos ([..., :num_pos]), so a smaller value breaks RoPE.
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=2 * D,
                        num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                        num_key_value_heads=1, max_position_embeddings=2 * SEQ)
    return _hf_entry("hf_llama", T.FlaxLlamaForCausalLM, cfg, _hf_clm_batch, _hf_clm_loss,
                     "RoPE sin/cos table and causal mask built in setup", 130)


# Tensor parallelism for transformers' Llama: MaxText's logical names of its parameters
# (``TrainState.create(param_axes=...)``) and the rules that split them over "model".
LLAMA_AXES = (  # MaxText's logical names for transformers' Llama parameters
    (r"(q|k|v)_proj/kernel", ("embed", "heads")),
    (r"o_proj/kernel", ("heads", "embed")),
    (r"(gate|up)_proj/kernel", ("embed", "mlp")),
    (r"down_proj/kernel", ("mlp", "embed")),
    (r"embed_tokens/embedding", ("vocab", "embed")),
    (r"lm_head/kernel", ("embed", "vocab")),
)
MAXTEXT_RULES = (("batch", ("node", "local")), ("heads", "model"), ("mlp", "model"),
                 ("vocab", "model"), ("embed", None))


FACTORIES: dict[str, Callable[[], ZooEntry]] = {
    "lm1b": lm1b,
    "wmt": wmt,
    "tied_variables": tied_variables,
    "called_twice": called_twice,
    "resnet_bn": resnet_bn,
    "scan_stack": scan_stack,
    "nnx_transformer": nnx_transformer,
    "nnx_tied": nnx_tied,
    "nnx_bridge": nnx_bridge,
    "hf_gpt2": hf_gpt2,
    "hf_gpt2_dropout": functools.partial(hf_gpt2, dropout=0.1),
    "hf_bert": hf_bert,
    "hf_t5": hf_t5,
    "hf_llama": hf_llama,
}


@functools.cache
def get(name: str) -> ZooEntry:
    """The entry ``name``, built once per process."""
    return FACTORIES[name]()


# --------------------------------------------------------------------------------------
# Single-device reference
# --------------------------------------------------------------------------------------


class Trajectory(NamedTuple):
    losses: list[float]  # per step, before its update
    params: list  # before each step, then the final ones: steps + 1 trees
    grads: list  # per step
    collections: list  # the other collections after each step
    loss_fn: Callable[..., Any]  # (params, colls, batch, rng) -> (loss, new colls)


def reference_trajectory(entry: ZooEntry, batches, tx: optax.GradientTransformation, *,
                         train: bool = True, rngs=None, data_shards: int = 1,
                         exact_f32: tuple | None = None) -> Trajectory:
    """Plain one-device training (``jax.jit`` + optax) of ``entry`` on ``batches``, in the
    entry's own dtype, keeping every step's loss (before its update), parameters and
    gradients (for a derived tolerance carried through the steps), the other collections
    and the loss function of a step. ``rngs``: one key per step (passed as the loss's
    ``rng``) or None.

    ``data_shards`` > 1 (for models with ``batch_stats``) reproduces data parallelism
    without SyncBatchNorm: the batch is cut into that many equal shards, each shard's loss
    and batch statistics are computed on the shard alone, and the step's loss, gradient and
    new statistics are their means over shards (what a per-device step averaged over
    devices computes). Without batch statistics it changes only summation order.

    ``exact_f32`` (for a float64 twin, inside :func:`float64_context`): fails if the step's
    program holds an fp32 value on a line that contains none of these strings (those mark
    fp32 values that are exact, such as a 0/1 mask); None: no check."""
    has_colls = bool(entry.collections)

    def shard_loss(params, colls, batch, rng):
        if has_colls:
            return entry.loss(entry.apply, {"params": params, **colls}, batch, train, rng=rng)
        return entry.loss(entry.apply, params, batch, train, rng=rng), colls

    def loss_fn(params, colls, batch, rng):
        if data_shards == 1:
            return shard_loss(params, colls, batch, rng)
        split = jax.tree_util.tree_map(
            lambda x: x.reshape(data_shards, x.shape[0] // data_shards, *x.shape[1:]), batch)
        losses, new = jax.vmap(shard_loss, in_axes=(None, None, 0, None))(
            params, colls, split, rng)
        return losses.mean(), jax.tree_util.tree_map(lambda x: x.mean(0), new)

    def step(params, opt_state, colls, batch, rng):
        (loss, new_colls), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            params, colls, batch, rng)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, new_colls, loss, grads

    with jax.default_device(jax.devices()[0]):
        params = entry.params
        colls = dict(entry.collections)
        opt_state = tx.init(params)
        out = Trajectory([], [jax.device_get(params)], [], [], loss_fn)
        compiled = None
        for i, b in enumerate(batches):
            rng = None if rngs is None else rngs[i]
            if compiled is None:  # every batch has the same shapes: one compile
                lowered = jax.jit(step).lower(params, opt_state, colls, b, rng)
                if exact_f32 is not None:
                    left = [line for line in lowered.as_text().splitlines()
                            if "f32" in line and not any(a in line for a in exact_f32)]
                    assert not left, f"the float64 reference computes in fp32: {left[:3]}"
                compiled = fast_compile(lowered)
            params, opt_state, colls, loss, grads = compiled(params, opt_state, colls, b, rng)
            out.losses.append(float(loss))
            out.params.append(jax.device_get(params))
            out.grads.append(jax.device_get(grads))
            out.collections.append(jax.device_get(colls))
    return out


# --------------------------------------------------------------------------------------
# Comparing trees whose containers differ (nnx.State vs dict, int vs str keys)
# --------------------------------------------------------------------------------------


def _key_str(k) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def flat(tree: PyTree) -> dict[str, np.ndarray]:
    """``{"a/b/c": array}`` of a params tree: dicts, FrozenDicts, ``nnx.State`` (as its
    pure dict), int or str keys alike."""
    try:
        from flax import nnx

        if isinstance(tree, nnx.State):
            tree = nnx.to_pure_dict(tree)
    except ImportError:  # pragma: no cover
        pass
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {"/".join(_key_str(k) for k in path): np.asarray(v) for path, v in leaves}


# --------------------------------------------------------------------------------------
# Float64 twins, for parity tests run in float64 (tests/helpers.py, "Float64 parity runs")
# --------------------------------------------------------------------------------------


def _rope64(num_pos, dim):
    """transformers' Llama RoPE table (``create_sinusoidal_positions``: fp32 numpy), its same
    values in float64."""
    inv_freq = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    freqs = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq).astype("float32")
    emb = np.concatenate((freqs, freqs), axis=-1)
    out = np.concatenate((np.sin(emb)[:, None, :], np.cos(emb)[:, None, :]), axis=-1)
    return jnp.asarray(out[:, :, :num_pos].astype(np.float64))


def _t5_layer_norm64(base):
    """transformers' T5 layer norm (``FlaxT5LayerNorm``), its variance in the input's dtype
    (at least fp32) instead of ``.astype("f4")``: a float64 input's stays float64."""

    class FlaxT5LayerNorm(base):
        def __call__(self, hidden_states):
            wide = jnp.promote_types(hidden_states.dtype, jnp.float32)
            variance = jnp.power(hidden_states.astype(wide), 2).mean(axis=-1, keepdims=True)
            return self.weight * (hidden_states / jnp.sqrt(variance + self.eps))

    FlaxT5LayerNorm.__qualname__ = base.__qualname__
    return FlaxT5LayerNorm


@contextlib.contextmanager
def float64_context(name: str):
    """Inside: JAX's 64-bit mode (``helpers.float64_run``) and what entry ``name``'s float64
    twin (:func:`float64_twin`) needs to compute in float64 throughout: the softmax of
    ``jax.nn.dot_product_attention`` (which NNX's attention calls) in float64, not in its
    ``np.float32``; transformers' Llama with its explicit ``jnp.float32`` casts read as
    float64 and its RoPE table in float64; T5's layer norm without its ``"f4"`` cast; and
    ``hf_compat()`` for every transformers model. Build the twin, run its steps and its
    reference inside."""
    from jax._src.nn import functions as jax_nn

    from helpers import WideFloat32, float64_run

    patches, modules = [(jax_nn, "np", WideFloat32(np))], ()
    if name == "hf_llama":
        import transformers.models.llama.modeling_flax_llama as llama

        modules = (llama,)
        patches.append((llama, "create_sinusoidal_positions", _rope64))
    if name == "hf_t5":
        import transformers.models.t5.modeling_flax_t5 as t5

        patches.append((t5, "FlaxT5LayerNorm", _t5_layer_norm64(t5.FlaxT5LayerNorm)))
    saved = [(m, a, getattr(m, a)) for m, a, _ in patches]
    try:
        for m, a, v in patches:
            setattr(m, a, v)
        with contextlib.ExitStack() as stack:
            stack.enter_context(float64_run(*modules))
            if name.startswith("hf_"):
                stack.enter_context(hf_compat())
            yield
    finally:
        for m, a, v in saved:
            setattr(m, a, v)


def _nnx_float64(model):
    """``model`` (an NNX module) with every submodule that fixed its compute dtype to fp32
    (``nnx.Embed`` takes its embedding's dtype at construction) set to float64: what it
    would be built with ``dtype=param_dtype=jnp.float64``. Returns ``model``."""
    from flax import nnx

    for _, m in nnx.iter_modules(model):
        for attr in ("dtype", "param_dtype"):
            if getattr(m, attr, None) == jnp.float32:
                setattr(m, attr, jnp.float64)
    return model


def float64_batch(batch: dict) -> dict:
    """``batch`` with its floating leaves float64 (the same values)."""
    from helpers import as_float64

    return as_float64(batch)


def float64_twin(entry: ZooEntry, params: PyTree | None = None,
                 collections: Mapping[str, PyTree] | None = None) -> ZooEntry:
    """``entry``'s model computing in float64, with ``params`` (a pure dict of float64
    values; default ``entry.params`` widened) and ``collections`` (default ``entry``'s,
    widened). Call inside :func:`float64_context` (``entry.name``). The linen models here
    have no dtype of their own (they compute in their parameters' dtype) and are shared;
    an NNX model is cloned and given the float64 values; a transformers model is built
    again from its config with ``dtype=jnp.float64`` (and ``_do_init=False``: no weights of
    its own)."""
    if params is None:
        params = entry.params
        if entry.kind == "nnx":
            from flax import nnx

            params = nnx.to_pure_dict(params)
    from helpers import as_float64

    params = as_float64(params)
    colls = as_float64(dict(entry.collections if collections is None else collections))
    model, apply = entry.model, entry.apply
    if entry.kind == "nnx":
        from flax import nnx

        model = _nnx_float64(nnx.clone(entry.model))
        state = nnx.state(model, nnx.Param)
        nnx.replace_by_pure_dict(state, params)
        nnx.update(model, state)
        params, apply = nnx.state(model, nnx.Param), nnx_apply(model)
    elif _is_to_linen(model):
        # nnx.bridge.to_linen: each apply builds the NNX module anew; build it in float64.
        nnx_class = model.nnx_class
        model = model.clone(nnx_class=lambda *a, **kw: _nnx_float64(nnx_class(*a, **kw)))
        apply = model.apply
    elif entry.kind == "hf":
        model = type(entry.model)(entry.model.config, input_shape=(1, SEQ), dtype=jnp.float64,
                                  _do_init=False)
        apply = model.__call__
    return dataclasses.replace(entry, model=model, params=params, collections=colls,
                               apply=apply, notes=entry.notes + " (float64)")


def _is_to_linen(model) -> bool:
    try:
        from flax.nnx import bridge
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, bridge.ToLinen)
