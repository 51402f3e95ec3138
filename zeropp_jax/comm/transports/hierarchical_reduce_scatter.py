"""Two-hop reduce-scatter: inside the node first, then across nodes, unquantized."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zeropp_jax.comm.qgz import hierarchical_reduce_scatter
from zeropp_jax.comm.transports.base import GradientFacts


@dataclasses.dataclass(frozen=True)
class HierarchicalReduceScatter(GradientFacts):
    """qgZ's two all-to-all hops and slice order without quantization
    (``config.reduce_scatter="hierarchical"``): each byte crosses nodes once."""

    @classmethod
    def from_config(cls, config: Any) -> "HierarchicalReduceScatter":
        return cls()

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None,
                   step: jax.Array | None = None) -> jax.Array:
        return hierarchical_reduce_scatter(g_full)
