"""Bytes on the wire: one counting model, for programs and for transports.

The counting model (``count_bytes``), bytes summed over all devices for one run of a
collective whose per-device result is ``nbytes``, on a node-major ``("node", "local")`` mesh
(device ``node * L + local``):

* all-to-all: exactly the chunks whose sender and receiver sit on different nodes (cross)
  or on the same node (intra).
* all-gather / reduce-scatter of total size ``T`` over a group: a node holding ``c`` of the
  group's ``g`` devices must receive (all-gather) or send (reduce-scatter) ``(g - c) / g * T``
  across nodes -- the lower bound a hierarchical algorithm meets. Intra-node:
  ``(c - 1) / g * T`` per device of the node.
* all-reduce: a reduce-scatter plus an all-gather of its size.
* collective-permute: each (source, target) pair moves the whole operand.

``measure.comm_report`` applies it to the collectives of a lowered or compiled program;
``traced_bytes`` applies it to the collectives of a function traced on an abstract mesh of
any size (no devices needed), which is how every transport reports what it moves
(``transports.base.weight_bytes`` / ``gradient_bytes``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.sharding import AbstractMesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.core import compat
from zeropp_jax.core.mesh import AXES, NODE, MeshInfo

# jaxpr primitive -> collective kind (the names comm_report reads from program text).
_KINDS = {
    "all_gather": "all-gather",
    "all_gather_invariant": "all-gather",
    "psum_scatter": "reduce-scatter",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "ppermute": "collective-permute",
}


@dataclasses.dataclass(frozen=True)
class WireBytes:
    """Bytes moved, summed over all devices: inside nodes and across node boundaries."""

    intra: float = 0.0
    cross: float = 0.0

    def __add__(self, other: "WireBytes") -> "WireBytes":
        return WireBytes(self.intra + other.intra, self.cross + other.cross)

    def __sub__(self, other: "WireBytes") -> "WireBytes":
        return WireBytes(self.intra - other.intra, self.cross - other.cross)


def count_bytes(kind: str, nbytes: float, groups: Sequence[Sequence[int]], local: int
                ) -> tuple[float, float]:
    """(intra, cross) bytes of one collective whose per-device result is ``nbytes``.

    ``groups``: replica groups of device ids, or (source, target) pairs for a
    collective-permute; ``local``: devices per node."""
    node_of = lambda d: d // local  # noqa: E731
    intra = cross = 0.0
    if kind == "collective-permute":
        for src, dst in groups:
            if src == dst:
                continue
            if node_of(src) == node_of(dst):
                intra += nbytes
            else:
                cross += nbytes
        return intra, cross
    for group in groups:
        g = len(group)
        if g <= 1:
            continue
        per_node: dict[int, int] = {}
        for d in group:
            per_node[node_of(d)] = per_node.get(node_of(d), 0) + 1
        if kind == "all-to-all":
            chunk = nbytes / g
            for d in group:
                c = per_node[node_of(d)]
                intra += (c - 1) * chunk
                cross += (g - c) * chunk
            continue
        # all-gather / reduce-scatter / all-reduce: T is the full (gathered) size.
        total = {"all-gather": nbytes, "reduce-scatter": nbytes * g, "all-reduce": nbytes}[kind]
        factor = 2 if kind == "all-reduce" else 1
        for c in per_node.values():
            cross += factor * (g - c) / g * total
            intra += factor * c * (c - 1) / g * total
    return intra, cross


def axis_groups(axes: Any, mesh: MeshInfo) -> list[list[int]]:
    """Replica groups of a collective over ``axes`` (a name or a tuple of names of
    ``("node", "local")``) on ``mesh``'s node-major data axes, device ids in the order the
    axes are given."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    ids = np.arange(mesh.data).reshape(mesh.shape)
    dims = [AXES.index(a) for a in axes]
    other = [d for d in range(2) if d not in dims]
    size = int(np.prod([ids.shape[d] for d in dims]))
    return ids.transpose(other + dims).reshape(-1, size).tolist()


def _permute_pairs(axis: Any, perm: Sequence[tuple[int, int]], mesh: MeshInfo
                   ) -> list[tuple[int, int]]:
    """Device (source, target) pairs of a ``ppermute`` over one axis of the mesh."""
    (name,) = (axis,) if isinstance(axis, str) else tuple(axis)
    nodes, local = mesh.shape
    if name == NODE:
        return [(s * local + j, d * local + j) for s, d in perm for j in range(local)]
    return [(i * local + s, i * local + d) for s, d in perm for i in range(nodes)]


def jaxpr_collectives(jaxpr: Any, mesh: MeshInfo) -> list[tuple[str, float, list]]:
    """(kind, per-device result bytes, groups or pairs) of every collective in ``jaxpr``
    and the jaxprs inside it (each branch of a ``cond`` counted, as a program's text is)."""
    rows = []
    for eqn in jaxpr.eqns:
        kind = _KINDS.get(eqn.primitive.name)
        if kind is not None:
            nbytes = sum(float(np.prod(v.aval.shape)) * v.aval.dtype.itemsize
                         for v in eqn.outvars)
            axis = eqn.params.get("axis_name", eqn.params.get("axes"))
            if kind == "collective-permute":
                groups = _permute_pairs(axis, eqn.params["perm"], mesh)
            else:
                groups = axis_groups(axis, mesh)
            rows.append((kind, nbytes, groups))
        for _, _, sub in compat.sub_jaxprs(eqn.params):
            rows += jaxpr_collectives(sub, mesh)
    return rows


@dataclasses.dataclass(frozen=True)
class TracedCollective:
    """One collective a traced function runs: its kind, the bytes it moves (summed over all
    devices, ``count_bytes``) and whether any of its groups spans nodes (on a cluster: a
    collective between processes, which pays the network's fixed cost)."""

    kind: str
    bytes: WireBytes
    spans_nodes: bool


def traced_collectives(fn: Callable[..., Any], specs: Sequence[jax.ShapeDtypeStruct],
                       mesh: MeshInfo) -> tuple[TracedCollective, ...]:
    """The collectives ``fn`` runs inside ``shard_map`` on ``mesh``'s data axes, in
    program order.

    ``fn`` takes one local block per spec (``specs``: the global shapes, each split on its
    first dimension over ``("node", "local")``). Traced only (``jax.make_jaxpr`` on an
    ``AbstractMesh``), so any mesh size works without devices."""
    abstract = AbstractMesh(mesh.shape, AXES)
    mapped = jax.shard_map(fn, mesh=abstract, in_specs=tuple(P(AXES) for _ in specs),
                           out_specs=P(AXES), check_vma=False)
    # The inputs carry the sharding the in_specs say: jax >= 0.11 checks them against it
    # (a spec without one reads as replicated there and is refused).
    sharding = NamedSharding(abstract, P(AXES))
    closed = jax.make_jaxpr(mapped)(*[jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
                                      for s in specs])
    out = []
    for kind, nbytes, groups in jaxpr_collectives(closed.jaxpr, mesh):
        spans = any(len({mesh.node_of(d) for d in g}) > 1 for g in groups)
        out.append(TracedCollective(
            kind, WireBytes(*count_bytes(kind, nbytes, groups, mesh.local)), spans))
    return tuple(out)


def traced_bytes(fn: Callable[..., Any], specs: Sequence[jax.ShapeDtypeStruct],
                 mesh: MeshInfo) -> WireBytes:
    """Bytes ``fn`` moves, run inside ``shard_map`` on ``mesh``'s data axes (the sum of
    ``traced_collectives``)."""
    total = WireBytes()
    for c in traced_collectives(fn, specs, mesh):
        total = total + c.bytes
    return total


__all__ = ["TracedCollective", "WireBytes", "axis_groups", "count_bytes", "jaxpr_collectives",
           "traced_bytes", "traced_collectives"]
