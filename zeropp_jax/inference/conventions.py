"""How a model decodes one token at a time with a KV cache: the two conventions we run.

Both keep the keys and values of past tokens in a linen ``"cache"`` collection, made by
``module.init`` on a ``[batch, max_len]`` input and updated by
``module.apply({"params": ..., "cache": cache}, ..., mutable=["cache"])``:

* ``FlaxCache``: Flax's own convention (``nn.MultiHeadDotProductAttention(decode=True)``,
  Flax's lm1b and wmt example models, the demo GPT with ``GPTConfig(decode=True)``): the
  decode-mode module is called on the next token ``[batch, 1]`` (or, where the module allows,
  the next ``t`` tokens) and keeps its own position.
* ``TransformersCache``: transformers' Flax causal LMs (GPT-2, Llama, Bloom, ...): their
  module is called with ``init_cache=True`` to make the cache, then on ``input_ids [batch,
  t]`` with ``attention_mask= [batch, max_len]`` and ``position_ids= [batch, t]``, each
  passed by name and only where the module's ``__call__`` takes it (Bloom's ALiBi takes no
  position ids).

A convention says which arguments make the cache and which run one step; the decoding loop
(``decode_loop``) and the sharded weights (``generate``) know nothing else of the model.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

PyTree = Any
Args = tuple[tuple, dict]


@dataclasses.dataclass(frozen=True, eq=False)
class FlaxCache:
    """A linen module in Flax's decode mode (compared by identity).

    Attributes:
      module: the decode-mode module (e.g. ``TransformerLM(config.replace(decode=True))``),
        whose params tree is the trained model's.
    """

    module: nn.Module

    def init_args(self, batch: int, length: int) -> Args:
        return (jnp.zeros((batch, length), jnp.int32),), {}

    def step_args(self, tokens: jax.Array, position: jax.Array, length: int) -> Args:
        return (tokens,), {}

    def logits(self, out: Any) -> jax.Array:
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class TransformersCache:
    """A transformers Flax causal LM's module (``model.module``; compared by identity).

    Every position is valid (rows are right-padded and stop being read after their end),
    so the attention mask is all ones; the module's cache masks positions not yet written.
    """

    module: nn.Module

    def init_args(self, batch: int, length: int) -> Args:
        ids = jnp.ones((batch, length), jnp.int32)
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        return (ids,), {**self._inputs(jnp.ones_like(ids), positions),
                        "init_cache": True, "return_dict": False}

    def step_args(self, tokens: jax.Array, position: jax.Array, length: int) -> Args:
        b = tokens.shape[0]
        mask = jnp.ones((b, length), jnp.int32)
        positions = jnp.broadcast_to(position + jnp.arange(tokens.shape[1], dtype=jnp.int32),
                                     tokens.shape)
        return (tokens,), {**self._inputs(mask, positions), "return_dict": False}

    def _inputs(self, mask: jax.Array, positions: jax.Array) -> dict[str, jax.Array]:
        """``attention_mask`` (int32 ``[batch, max_len]``) and ``position_ids`` (int32
        ``[batch, t]``) by name, each only if the module takes it: passed by position, the
        position ids of a model without them (Bloom) would land on its ``deterministic``."""
        accepted = _call_parameters(type(self.module))
        given = {"attention_mask": mask, "position_ids": positions}
        return {k: v for k, v in given.items() if accepted is None or k in accepted}

    def logits(self, out: Any) -> jax.Array:
        return out[0]


Convention = FlaxCache | TransformersCache


def _call_parameters(module_class: type) -> frozenset[str] | None:
    """The parameter names of ``module_class.__call__``, or None when
    it takes ``**kwargs`` (then every name is accepted)."""
    params = inspect.signature(module_class.__call__).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params)


def convention_of(adapter: Any, model: Any = None) -> Convention:
    """The decoding convention for a train state's model (its ``adapter``), or for
    ``model``, its decode-mode twin (a linen module sharing its params tree)."""
    if model is not None:
        if getattr(adapter, "kind", None) == "transformers" and model is getattr(
                adapter, "wrapper", None):
            return TransformersCache(adapter.module)
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model= must be a linen module in decode mode (Flax's convention, e.g. "
                f"TransformerLM(config.replace(decode=True))), got {type(model).__name__}")
        return FlaxCache(model)
    kind = getattr(adapter, "kind", None)
    if kind == "transformers":
        return TransformersCache(adapter.module)
    if kind == "linen":
        return FlaxCache(adapter.module)
    raise NotImplementedError(
        f"KV-cached generation runs linen modules and transformers Flax models; this state's "
        f"model is {kind!r}. Consolidate its parameters (state.consolidate()) and decode "
        "with the model itself, or pass model= a linen decode-mode twin with the same "
        "params tree.")


def cache_shapes(convention: Convention, batch: int, length: int) -> PyTree:
    """The ``"cache"`` collection's shapes for ``batch`` rows of ``length`` tokens.

    Raises ValueError naming the fix if the module makes no cache (a linen model not in
    decode mode)."""
    args, kwargs = convention.init_args(batch, length)
    variables = jax.eval_shape(
        lambda: convention.module.init(jax.random.PRNGKey(0), *args, **kwargs))
    if "cache" not in variables:
        raise ValueError(
            f"{type(convention.module).__name__}.init made no 'cache' collection, so it cannot "
            "decode incrementally. Pass generate(..., model=<its decode-mode twin>), e.g. "
            "TransformerLM(config.replace(decode=True)) or GPT(dataclasses.replace(cfg, "
            "decode=True)): the same module with decode=True, sharing the params tree.")
    return variables["cache"]


def takes_several_tokens(convention: Convention, batch: int, length: int) -> bool:
    """Whether one step can feed several tokens (a prompt's prefix at once, "prefill"):
    traced abstractly with two tokens. Flax's ``nn.MultiHeadDotProductAttention`` in decode
    mode takes one token per call and raises; transformers' models and the demo GPT take
    several."""
    cache = cache_shapes(convention, batch, length)
    args, kwargs = convention.step_args(jnp.zeros((batch, 2), jnp.int32), jnp.int32(0),
                                        length)

    def step(cache: PyTree) -> Any:
        variables = convention.module.init(jax.random.PRNGKey(0), *convention.init_args(
            batch, length)[0], **convention.init_args(batch, length)[1])
        return convention.module.apply({"params": variables["params"], "cache": cache},
                                       *args, mutable=["cache"], **kwargs)

    try:
        jax.eval_shape(step, cache)
    except Exception:  # noqa: BLE001 - any refusal of a 2-token step means one at a time
        return False
    return True


def init_cache(convention: Convention, batch: int, length: int) -> PyTree:
    """The initial ``"cache"`` collection (the module's own init; under ``jax.jit`` the
    parameters it also makes are dead code)."""
    args, kwargs = convention.init_args(batch, length)
    return convention.module.init(jax.random.PRNGKey(0), *args, **kwargs)["cache"]
