"""Choosing the next token from logits: greedy, temperature, top-k, top-p. Pure functions.

Every row draws from its own key, ``fold_in(fold_in(key, position), global row)``, so a
row's tokens depend on the key, its position and its place in the global batch only, never
on how the batch is split over devices: the same key gives the same tokens on every mesh.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. Checked on construction (the one place the settings
    are): a ValueError or TypeError naming the argument otherwise.

    Attributes:
      temperature: a finite float; 0 picks the most likely token (greedy, no key needed);
        above 0 samples from ``softmax(logits / temperature)``.
      top_k: an int >= 1: sample among the ``top_k`` most likely tokens only (None: all).
      top_p: a finite float in (0, 1]: sample among the smallest set of most likely tokens
        whose probability adds up to at least ``top_p`` (nucleus sampling; None: all).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self) -> None:
        # The one check of the sampling settings (generate builds a Sampling before it traces
        # anything). NaN passes every comparison as False, so finiteness is checked first:
        # temperature=nan would turn every logit into nan and every sampled token into 0.
        temperature = checked_float("temperature", self.temperature, "0.0 for greedy decoding")
        if temperature < 0:
            raise ValueError(f"temperature={temperature} must be >= 0 (0: greedy)")
        object.__setattr__(self, "temperature", temperature)
        if self.top_k is not None:
            top_k = checked_int("top_k", self.top_k)
            if top_k < 1:
                raise ValueError(f"top_k={top_k} must be >= 1, or None for all tokens")
            object.__setattr__(self, "top_k", top_k)
        if self.top_p is not None:
            top_p = checked_float("top_p", self.top_p, "None for all tokens")
            if not 0 < top_p <= 1:
                raise ValueError(f"top_p={top_p} must be in (0, 1], or None for all tokens")
            object.__setattr__(self, "top_p", top_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def checked_float(name: str, value: Any, default: str) -> float:
    """``value`` (a Python, numpy or 0-d jax number) as a Python float; TypeError if it is
    not a number, ValueError if it is nan or infinite."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {value!r} "
                        f"({type(value).__name__})") from None
    if not math.isfinite(value):
        raise ValueError(f"{name}={value} must be a finite number (or {default})")
    return value


def checked_int(name: str, value: Any) -> int:
    """``value`` (a Python, numpy or 0-d jax integer) as a Python int; TypeError for
    anything else (a float such as 2.5 or 3.0 is refused, not rounded, and so is a bool)."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__}); "
                        f"pass {name}=int(...) if you meant a whole number") from None


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
