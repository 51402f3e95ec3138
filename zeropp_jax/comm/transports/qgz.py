"""qgZ: the gradient block-quantized to INT4/INT8 for two all-to-all hops (optionally
Hadamard-smoothed, optionally rounded stochastically)."""

from __future__ import annotations

import dataclasses
import functools

import jax

from zeropp_jax.comm.qgz import qgz_reduce_scatter
from zeropp_jax.comm.transports.base import GradientTransport
from zeropp_jax.core.mesh import AXES


@dataclasses.dataclass(frozen=True)
class QgzReduceScatter:
    """qgZ's hierarchical all-to-all (``"local"``, then ``"node"``) carrying quantized
    blocks, dequantized and summed in fp32 at each hop.

    Attributes:
      bits: 4 or 8.
      block_size: elements per scale; None: one scale per stage of a destination slice.
      stages: pipeline stages (``config.qgz_pipeline_stages``).
      implementation: ``"xla"`` or ``"pallas"``.
      fallback: what ``reduce_sum(g, on=False)`` runs (``config.qgz_until_step``): the
        unquantized reduce-scatter, chosen by ``lax.cond`` at run time.
      hadamard: Hadamard smoothing of every block (``config.qgz_hadamard``).
      stochastic_rounding: unbiased rounding of both quantizations
        (``config.stochastic_rounding``).
    """

    bits: int
    block_size: int | None
    stages: int
    implementation: str
    fallback: GradientTransport
    hadamard: bool = False
    stochastic_rounding: bool = False

    def quantized(self, g: jax.Array, key: jax.Array | None = None) -> jax.Array:
        num_devices = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])
        block = self.block_size or g.shape[0] // num_devices // self.stages
        return qgz_reduce_scatter(g, bits=self.bits, block_size=block, stages=self.stages,
                                  implementation=self.implementation, hadamard=self.hadamard,
                                  stochastic_rounding=self.stochastic_rounding, key=key)

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None,
                   key: jax.Array | None = None) -> jax.Array:
        """``key``: the step's PRNG key, the same on every device (Hadamard signs and
        rounding seeds: ``comm.qgz.qgz_reduce_scatter``). The unit transform passes none
        today, so the signs are the fixed key's and the rounding seeds come from each
        device's gradient."""
        quantized = functools.partial(self.quantized, key=key)
        if on is None:
            return quantized(g_full)
        return jax.lax.cond(on, quantized, self.fallback.reduce_sum, g_full)
