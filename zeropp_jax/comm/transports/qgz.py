"""qgZ: the gradient block-quantized to INT4/INT8 for two all-to-all hops."""

from __future__ import annotations

import dataclasses

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
    """

    bits: int
    block_size: int | None
    stages: int
    implementation: str
    fallback: GradientTransport

    def quantized(self, g: jax.Array) -> jax.Array:
        num_devices = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])
        block = self.block_size or g.shape[0] // num_devices // self.stages
        return qgz_reduce_scatter(g, bits=self.bits, block_size=block, stages=self.stages,
                                  implementation=self.implementation)

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None) -> jax.Array:
        if on is None:
            return self.quantized(g_full)
        return jax.lax.cond(on, self.quantized, self.fallback.reduce_sum, g_full)
