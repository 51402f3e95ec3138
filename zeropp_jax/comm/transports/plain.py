"""ZeRO-3's weight gather: the primary shard cast to the compute dtype, all-gathered."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zeropp_jax.comm.collectives import all_gather_flat
from zeropp_jax.comm.transports.base import Buffers, DirectGather
from zeropp_jax.core.mesh import AXES


@dataclasses.dataclass(frozen=True)
class PlainGather(DirectGather):
    """Stored ``(shard,)`` in the param dtype; on the wire in the compute dtype (16-bit
    weights as same-width integers, see ``collectives.to_wire``).

    Attributes:
      dtype: the compute dtype of the full weights.
      hierarchical: two hops, over ``"node"`` then ``"local"``, instead of one.
    """

    dtype: Any
    hierarchical: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "PlainGather":
        return cls(config.compute_jnp_dtype, config.all_gather == "hierarchical")

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        full = all_gather_flat(stored[0].astype(self.dtype), AXES, distinct=backward,
                               hierarchical=self.hierarchical)
        return full, (full,)

    def decode(self, moved: Buffers) -> jax.Array:
        return moved[0]
