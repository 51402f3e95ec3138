"""Losses that are exact over the global batch when each device sees only its shard.

``train_step`` averages what a step returns over devices, and ZeRO's gradient
reduce-scatter averages gradients over devices: right for a loss that is a mean over
equally many examples on every device. A token-weighted loss (padding masked out, a
different number of real tokens per device) is not: the mean of per-device means differs
from the global token mean (by 3e-3 relative on a padded batch). ``token_mean`` fixes it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeropp_jax.comm import collectives
from zeropp_jax.core.dtypes import accumulation_dtype
from zeropp_jax.core.mesh import AXES


def token_mean(values: jax.Array, weights: jax.Array | None = None) -> jax.Array:
    """The mean of ``values`` over every real token of the global batch. Inside a step.

    Args:
      values: per-token losses of this device's batch shard, any shape, floating.
      weights: same shape (or broadcastable): 1 for real tokens, 0 for padding (or any
        non-negative weights). None: every token counts.

    Returns a scalar (fp32 at least: float64 values stay float64). Its value on device
    ``d`` is ``P * sum_d(w * v) / W`` with ``W = sum of weights over all devices`` (a
    ``psum`` over ``("node", "local")``) and ``P`` devices, so that the mean over devices,
    which is what ``train_step`` returns and what the gradient reduce-scatter computes, is
    the exact global token mean ``sum(w * v) / W`` and its exact gradient. Returns 0 if no
    token has weight.
    """
    values = jnp.asarray(values)
    values = values.astype(accumulation_dtype(values.dtype))
    weights = (jnp.ones_like(values) if weights is None
               else jnp.broadcast_to(jnp.asarray(weights, values.dtype), values.shape))
    local = jnp.sum(values * weights)
    total = jax.lax.stop_gradient(jax.lax.psum(jnp.sum(weights), AXES))
    devices = collectives.axis_size(AXES)
    return jnp.where(total > 0, local * devices / jnp.maximum(total, 1e-30), 0.0)
