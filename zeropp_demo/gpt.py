"""A small GPT-style decoder in plain Flax linen (nothing ZeRO-specific in it).

Each block, the token embedding, the position embedding and the LM head are direct children
of the root, so zeropp_jax makes each of them one unit by default.

Sequence parallelism (DeepSpeed-Ulysses): with ``GPTConfig(sequence_axis="local")`` the model
runs inside ``shard_map`` on this device's slice of every sequence (``[batch, seq / P]``
tokens, ``P`` the size of that mesh axis, device ``r`` holding tokens ``[r seq/P, (r+1)
seq/P)``); positions are global and attention goes through
``zeropp_jax.parallel.ulysses.ulysses_attention``. The parameters are the same as without it, and
``model.init`` runs outside ``shard_map`` as usual (it takes the plain path).
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from zeropp_jax.parallel.ulysses import ulysses_attention


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    layers: int = 4
    d_model: int = 128
    heads: int = 4
    mlp_ratio: int = 4
    dtype: str = "float32"  # computation dtype of activations
    logit_scale: bool = False  # a learnable scalar on the root module (CLIP-style)
    # Mesh axis the sequence is split over (Ulysses sequence parallelism), or None: every
    # device holds whole sequences. Only inside shard_map; init ignores it.
    sequence_axis: str | None = None
    # Incremental decoding (Flax's decode convention): keys and values of the tokens seen so
    # far live in the "cache" collection, created by ``init`` on a ``[batch, max_len]``
    # input; each call then takes the next ``[batch, t]`` tokens (t >= 1) and appends them.
    decode: bool = False
    # Annotate the weights with Flax logical axis names (``nn.with_logical_partitioning``:
    # "embed", "qkv", "heads", "mlp", "vocab", "length"), for tensor parallelism with rules
    # such as ``MEGATRON_RULES``. The values ``init`` draws are the same either way.
    logical_axes: bool = False


# Megatron-LM's split: attention's qkv and the MLP's first layer by output (column
# parallel), their second layers by input (row parallel), the vocabulary of the embedding
# and the head; everything else whole.
MEGATRON_RULES = (("qkv", "model"), ("heads", "model"), ("mlp", "model"), ("vocab", "model"),
                  ("embed", None), ("length", None))


def _named(cfg: GPTConfig, init, names: tuple[str, ...]):
    """``init`` with logical axis ``names`` when ``cfg.logical_axes``, else as it is."""
    return nn.with_logical_partitioning(init, names) if cfg.logical_axes else init


def _dense(cfg: GPTConfig, features: int, names: tuple[str, str], name: str) -> nn.Dense:
    return nn.Dense(features, dtype=cfg.dtype, name=name,
                    kernel_init=_named(cfg, nn.linear.default_kernel_init, names),
                    bias_init=_named(cfg, nn.initializers.zeros_init(), names[1:]))


def _embed(cfg: GPTConfig, num: int, names: tuple[str, str], name: str) -> nn.Embed:
    return nn.Embed(num, cfg.d_model, dtype=cfg.dtype, name=name,
                    embedding_init=_named(cfg, nn.linear.default_embed_init, names))


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal softmax attention on whole sequences. ``q, k, v [b, t, heads, hd]`` ->
    ``[b, t, heads, hd]`` (softmax in fp32, result in ``v``'s dtype)."""
    t = q.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    mask = jnp.tril(jnp.ones((t, t), bool))
    logits = jnp.where(mask[None, None], logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def cached_attention(module: nn.Module, q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Causal attention of ``t`` new tokens against every token cached so far.

    ``q, k, v [b, t, heads, hd]``. The first call (``init``, no cache yet) sees the whole
    ``[b, max_len]`` input, makes the cache (``cached_key``, ``cached_value``
    ``[b, max_len, heads, hd]``, ``cache_index`` int32 scalar) and attends as
    ``causal_attention``. Later calls write the new keys and values at ``cache_index`` and
    attend to positions ``<= cache_index + j`` for new token ``j``.
    """
    initialized = module.has_variable("cache", "cached_key")
    b, t, h, hd = k.shape
    ck = module.variable("cache", "cached_key", jnp.zeros, (b, t, h, hd), k.dtype)
    cv = module.variable("cache", "cached_value", jnp.zeros, (b, t, h, hd), v.dtype)
    index = module.variable("cache", "cache_index", lambda: jnp.zeros((), jnp.int32))
    if not initialized:
        return causal_attention(q, k, v)
    i = index.value
    ck.value = jax.lax.dynamic_update_slice(ck.value, k, (0, i, 0, 0))
    cv.value = jax.lax.dynamic_update_slice(cv.value, v, (0, i, 0, 0))
    index.value = i + t
    max_len = ck.value.shape[1]
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, ck.value) / jnp.sqrt(hd).astype(q.dtype)
    mask = jnp.arange(max_len)[None, :] <= i + jnp.arange(t)[:, None]  # [t, max_len]
    logits = jnp.where(mask[None, None], logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, cv.value)


def cached_positions(module: nn.Module, t: int) -> jax.Array:
    """Positions ``[t]`` of the next ``t`` tokens in decode mode: ``0..t-1`` at ``init``
    (which makes the cache's ``position`` counter), then continuing from the counter, which
    each call advances by ``t``."""
    initialized = module.has_variable("cache", "position")
    start = module.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
    if not initialized:
        return jnp.arange(t)
    positions = jnp.arange(t) + start.value
    start.value = start.value + t
    return positions


def _sequence_parallel(module: nn.Module) -> bool:
    # init runs outside shard_map (no mesh axis to split over); the parameters do not depend
    # on the sequence layout, so it takes the plain path.
    return module.config.sequence_axis is not None and not module.is_initializing()


class CausalSelfAttention(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        b, t, d = x.shape
        if d % cfg.heads:
            raise ValueError(f"d_model={d} must be a multiple of heads={cfg.heads}")
        hd = d // cfg.heads
        qkv = _dense(cfg, 3 * d, ("embed", "qkv"), "qkv")(x)
        q, k, v = jnp.split(qkv.reshape(b, t, 3, cfg.heads, hd), 3, axis=2)
        q, k, v = (a[:, :, 0] for a in (q, k, v))  # [b, t, heads, hd]
        if cfg.decode:
            out = cached_attention(self, q, k, v)
        elif _sequence_parallel(self):
            # t is this device's share of the sequence; two all-to-alls over the axis.
            out = ulysses_attention(
                q, k, v, attention_fn=causal_attention, axis_name=cfg.sequence_axis
            )
        else:
            out = causal_attention(q, k, v)
        out = out.reshape(b, t, d)
        return _dense(cfg, d, ("heads", "embed"), "proj")(out)


class Block(nn.Module):
    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = x + CausalSelfAttention(cfg, name="attn")(nn.LayerNorm(dtype=cfg.dtype, name="ln1")(x))
        h = nn.LayerNorm(dtype=cfg.dtype, name="ln2")(x)
        h = _dense(cfg, cfg.mlp_ratio * cfg.d_model, ("embed", "mlp"), "fc")(h)
        h = _dense(cfg, cfg.d_model, ("mlp", "embed"), "out")(jax.nn.gelu(h))
        return x + h


class GPT(nn.Module):
    """Tokens ``[batch, seq]`` int32 -> logits ``[batch, seq, vocab]`` float32.

    With ``config.sequence_axis`` (inside ``shard_map``): tokens ``[batch, seq / P]``, this
    device's consecutive slice of each sequence, and logits for those tokens.

    With ``config.decode``: ``init`` on ``[batch, max_len]`` makes the "cache" collection;
    ``apply({"params": p, "cache": c}, tokens [batch, t], mutable=["cache"])`` then gives
    the logits of the next ``t`` tokens, at positions continuing from the cache's.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        cfg = self.config
        t = tokens.shape[1]
        x = _embed(cfg, cfg.vocab_size, ("vocab", "embed"), "wte")(tokens)
        positions = jnp.arange(t)
        if cfg.decode:
            positions = cached_positions(self, t)
        elif _sequence_parallel(self):
            sp = jax.lax.axis_size(cfg.sequence_axis)
            if t * sp > cfg.seq_len:
                raise ValueError(
                    f"sequence length {t} x {sp} devices of {cfg.sequence_axis!r} = {t * sp} "
                    f"exceeds GPTConfig.seq_len={cfg.seq_len} (the position table); raise "
                    "seq_len or use shorter sequences"
                )
            # Device r holds tokens [r t, (r+1) t) of each sequence: global positions.
            positions = positions + jax.lax.axis_index(cfg.sequence_axis) * t
        pos = _embed(cfg, cfg.seq_len, ("length", "embed"), "wpe")(positions)
        x = x + pos[None]
        for i in range(cfg.layers):
            x = Block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
        logits = _dense(cfg, cfg.vocab_size, ("embed", "vocab"), "head")(x)
        if cfg.logit_scale:
            logits = logits * self.param("logit_scale", nn.initializers.ones, ())
        return logits.astype(jnp.float32)


def loss_fn(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross entropy (nats). ``logits [b, t, v]``, ``targets [b, t]``."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], axis=-1))


def lm_train_step(donate_state: bool = False):
    """The examples' language-model step on ``int32 [batch, seq + 1]`` token windows
    (inputs ``[:, :-1]``, targets ``[:, 1:]``), decorated with ``zeropp_jax.train_step``
    (``donate_state`` passed on). Returns ``(state, {"loss": mean next-byte cross
    entropy})``."""
    import zeropp_jax as zpp  # the model itself stays free of zeropp_jax

    @zpp.train_step(donate_state=donate_state)
    def step(state, batch):
        def loss_of(p):
            return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return step
