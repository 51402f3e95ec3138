"""The dtype sums and accumulators use: the operand's own dtype, at least fp32."""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp


def accumulation_dtype(dtype: Any) -> jnp.dtype:
    """``dtype`` widened to fp32 at least: bf16 and fp16 gradients sum in fp32 (their own
    8 or 11 bits would lose a small device's share), fp32 stays fp32, and a float64 run
    (``jax_enable_x64``, an exactness test's reference precision) keeps float64 instead of
    being rounded to fp32."""
    return jnp.promote_types(dtype, jnp.float32)
