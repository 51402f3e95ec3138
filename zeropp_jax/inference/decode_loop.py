"""The token loop of incremental decoding: one model step per position, on device.

Rows are right-padded: row ``r``'s prompt is its first ``lengths[r]`` tokens. Step ``i``
feeds every row's token at position ``i`` (one token, so the model's cache grows by one)
and decides position ``i + 1``: the prompt's token while ``i + 1 < lengths[r]``, else a
new token chosen from the logits, for ``max_new_tokens`` positions or until the row emits
a stop token (kept in the output); after that, ``pad_token``. Every row keeps its own
positions (a short prompt starts generating earlier), so no padding is ever attended to.

The loop is a ``jax.lax.fori_loop`` over a fixed count, ``prompt_len + max_new_tokens - 1``
steps: one compiled program per (batch, length), and no device waits on another to decide
whether to stop (rows that stopped produce padding until the end). With ``prefill``, the
first ``prefill`` positions (a prefix every row's prompt covers) go through the model in one
step before the loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.inference.sampling import Sampling, next_tokens

PyTree = Any
# step(cache, tokens [b, 1] int32, position int32 scalar) -> (logits [b, 1, V], cache)
Step = Callable[[PyTree, jax.Array, jax.Array], tuple[jax.Array, PyTree]]


@dataclasses.dataclass(frozen=True)
class Rollout:
    """The static settings of one generation (part of the compiled program's identity).

    Attributes:
      max_new_tokens: tokens generated per row after its prompt (>= 1).
      sampling: how each new token is chosen.
      stop_tokens: a row ends after emitting any of these.
      pad_token: fills a row after it ends.
    """

    max_new_tokens: int
    sampling: Sampling = Sampling()
    stop_tokens: tuple[int, ...] = ()
    pad_token: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


def decode_loop(step: Step, cache: PyTree, prompts: jax.Array, lengths: jax.Array,
                rows: jax.Array, key: jax.Array | None, rollout: Rollout,
                prefill: int = 0) -> jax.Array:
    """Generates after each row's prompt. Runs wherever ``step`` runs (one device, or inside
    ``shard_map`` on this device's rows).

    Args:
      step: one model step on the cache (see ``Step``).
      cache: the model's empty cache for these rows and ``prompt_len + max_new_tokens``
        positions.
      prompts: int32 ``[b, prompt_len]``, right-padded.
      lengths: int32 ``[b]``, each row's prompt length, in ``[1, prompt_len]``.
      rows: int32 ``[b]``, each row's index in the global batch (sampling keys).
      key: PRNG key for sampling (None when greedy).
      prefill: feed the first ``prefill`` positions in one step (every row's prompt must
        be longer than ``prefill``; the model must take several tokens per step); 0: one
        token per step from the start.
    Returns:
      int32 ``[b, prompt_len + max_new_tokens]``.
    """
    b, t0 = prompts.shape
    total = t0 + rollout.max_new_tokens
    pad = jnp.int32(rollout.pad_token)
    filled = jnp.arange(t0)[None, :] < lengths[:, None]
    buf = jnp.full((b, total), pad, jnp.int32).at[:, :t0].set(
        jnp.where(filled, prompts.astype(jnp.int32), pad))
    stops = jnp.asarray(rollout.stop_tokens, jnp.int32)

    def body(i: jax.Array, carry: tuple) -> tuple:
        buf, cache, done = carry
        current = jax.lax.dynamic_slice_in_dim(buf, i, 1, axis=1)  # [b, 1]
        logits, cache = step(cache, current, i)
        p = i + 1
        new = next_tokens(logits[:, -1], rollout.sampling, key, p, rows)
        in_prompt = p < lengths
        active = ~done & ~in_prompt & (p < lengths + rollout.max_new_tokens)
        prompt_token = jax.lax.dynamic_index_in_dim(buf, p, axis=1, keepdims=False)
        token = jnp.where(in_prompt, prompt_token, jnp.where(active, new, pad))
        if rollout.stop_tokens:
            done = done | (active & jnp.isin(new, stops))
        buf = jax.lax.dynamic_update_slice_in_dim(buf, token[:, None], p, axis=1)
        return buf, cache, done

    if prefill:
        # Positions < prefill are prompt tokens of every row: their logits are not needed.
        _, cache = step(cache, buf[:, :prefill], jnp.int32(0))
    buf, _, _ = jax.lax.fori_loop(prefill, total - 1, body,
                                  (buf, cache, jnp.zeros((b,), bool)))
    return buf
