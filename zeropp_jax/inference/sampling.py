"""Choosing the next token from logits: greedy, temperature, top-k, top-p. Pure functions.

Every row draws from its own key, ``fold_in(fold_in(key, position), global row)``, so a
row's tokens depend on the key, its position and its place in the global batch only, never
on how the batch is split over devices: the same key gives the same tokens on every mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
      temperature: 0 picks the most likely token (greedy, no key needed); above 0 samples
        from ``softmax(logits / temperature)``.
      top_k: sample among the ``top_k`` most likely tokens only (None: all).
      top_p: sample among the smallest set of most likely tokens whose probability adds up
        to at least ``top_p`` (nucleus sampling; None: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0 (0: greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1, or None for all tokens")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1], or None for all tokens")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def filtered_logits(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """``[b, V]`` fp32 logits divided by the temperature, with the tokens top-k and top-p
    exclude set to ``-inf``. The most likely token always stays."""
    x = logits.astype(jnp.float32) / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < x.shape[-1]:
        kth = jax.lax.top_k(x, sampling.top_k)[0][:, -1:]
        x = jnp.where(x < kth, -jnp.inf, x)
    if sampling.top_p is not None and sampling.top_p < 1:
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        probs = jax.nn.softmax(sorted_x, axis=-1)
        # Keep a token if the tokens more likely than it add up to less than top_p.
        before = jnp.cumsum(probs, axis=-1) - probs
        keep_sorted = before < sampling.top_p
        keep = jnp.zeros_like(keep_sorted).at[
            jnp.arange(x.shape[0])[:, None], order].set(keep_sorted)
        x = jnp.where(keep, x, -jnp.inf)
    return x


def next_tokens(logits: jax.Array, sampling: Sampling, key: jax.Array | None,
                position: jax.Array, rows: jax.Array) -> jax.Array:
    """The token after ``position`` for each row: int32 ``[b]``.

    ``logits``: ``[b, V]``; ``key``: a PRNG key (ignored when greedy); ``position``: int32
    scalar, the position being predicted; ``rows``: int32 ``[b]``, each row's index in the
    global batch.
    """
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    x = filtered_logits(logits, sampling)
    step_key = jax.random.fold_in(key, position)
    keys = jax.vmap(lambda r: jax.random.fold_in(step_key, r))(rows)
    return jax.vmap(jax.random.categorical)(keys, x).astype(jnp.int32)
