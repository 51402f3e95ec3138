"""ZeRO's gradient reduce-scatter over ``("node", "local")``, in the compute dtype."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zeropp_jax.comm.collectives import reduce_scatter_flat
from zeropp_jax.comm.transports.base import GradientFacts
from zeropp_jax.core.dtypes import accumulation_dtype
from zeropp_jax.core.mesh import AXES


@dataclasses.dataclass(frozen=True)
class FlatReduceScatter(GradientFacts):
    """One reduce-scatter over all devices in the gradient's dtype, summed to fp32 at least."""

    @classmethod
    def from_config(cls, config: Any) -> "FlatReduceScatter":
        return cls()

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None,
                   step: jax.Array | None = None) -> jax.Array:
        return reduce_scatter_flat(g_full, AXES).astype(accumulation_dtype(g_full.dtype))
