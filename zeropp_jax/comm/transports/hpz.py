"""hpZ: backward rebuilds a unit's weights from a secondary slice inside the node group."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zeropp_jax.comm.hpz import group_nodes, hpz_all_gather, secondary_slice
from zeropp_jax.comm.transports.base import Buffers, WeightTransport
from zeropp_jax.comm.transports.sliced import SlicedWeights
from zeropp_jax.core.mesh import MeshInfo


@dataclasses.dataclass(frozen=True)
class SecondaryRegather:
    """Wraps a value transport (plain, qwZ, stored quantized): forward gathers as it does;
    each device then keeps the slice ``[n_pad / (k L)]`` of what moved at its position in
    its group of ``k`` nodes (the secondary partition), and backward rebuilds the weights
    from the group's slices: an all-gather over ``"local"``, plus ppermutes over ``"node"``
    for ``k > 1``. No byte of a backward gather leaves the group.

    Attributes:
      inner: how the weights travel in forward, and how what moved decodes.
      group_size: devices per group (``config.hpz_group_size``); None: one node.
    """

    inner: WeightTransport
    group_size: int | None = None

    def nodes(self) -> int:
        """Nodes per group, from the mesh's axis sizes (inside ``shard_map``)."""
        return group_nodes(self.group_size, MeshInfo.inside())

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        return self.inner.gather(stored, backward=backward)

    def decode(self, moved: Buffers) -> jax.Array:
        return self.inner.decode(moved)

    def stored_specs(self, n_pad: int, param_dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        return self.inner.stored_specs(n_pad, param_dtype)

    def store(self, flat: Any) -> tuple[Any, ...]:
        return self.inner.store(flat)

    def unstore(self, stored: tuple[Any, ...]) -> Any:
        return self.inner.unstore(stored)

    def keep(self, stored: Buffers, moved: Buffers) -> Buffers:
        k = self.nodes()
        return tuple(secondary_slice(m, k) for m in moved)

    def regather(self, kept: Buffers) -> jax.Array:
        k = self.nodes()
        return self.inner.decode(tuple(hpz_all_gather(w, k) for w in kept))

    def label(self) -> str:
        own = "hpz" if self.group_size is None else f"hpz[{self.group_size}]"
        return "+".join(p for p in (self.inner.label(), own) if p)

    def quantized_elems(self, n: int) -> float:
        return self.inner.quantized_elems(n)

    def moved_bytes(self, n_pad: int) -> float:
        return self.inner.moved_bytes(n_pad)

    def bucketable(self) -> bool:
        return self.inner.bucketable()

    def secondary_devices(self, mesh: MeshInfo) -> int:
        """``k * local``: the devices of ``k`` whole nodes (``group_size``; one node if
        None), checked against the mesh (raises naming the valid sizes)."""
        return group_nodes(self.group_size, mesh) * mesh.local


def wrap(inner: Any, config: Any) -> SecondaryRegather:
    return SecondaryRegather(inner, config.hpz_group_size)


def secondary_of(transport: Any) -> SecondaryRegather:
    """``transport`` if it already rebuilds from a secondary (hpZ on: its configured
    group), else ``transport`` wrapped to rebuild from one inside the node. Generation
    reads every unit from a secondary this way, whether training used hpZ or not."""
    if isinstance(transport, SlicedWeights):  # per tensor-parallel slice, as in training
        return SlicedWeights(secondary_of(transport.inner))
    return transport if isinstance(transport, SecondaryRegather) else SecondaryRegather(transport)
