"""hpZ: the secondary weight partition, kept inside a group of nodes. Runs inside ``shard_map``.

After a unit's forward gather every device keeps ``secondary = full[slice of its position in
its hpZ group]`` — ``n_pad / G`` elements for a group of ``G = k * L`` devices (``k`` whole
nodes; default ``k = 1``: the node's own ``L`` devices). Backward rebuilds the full weights
from the group's secondaries: an all-gather over ``"local"`` (inside a node), then, for
``k > 1``, ``k - 1`` ring exchanges over ``"node"`` between the group's nodes only. No byte
leaves the group; with ``k = 1`` none leaves the node.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from zeropp_jax.comm.collectives import all_gather_flat, to_wire, from_wire
from zeropp_jax.core.mesh import LOCAL, NODE, MeshInfo


def group_nodes(hpz_group_size: int | None, mesh: MeshInfo) -> int:
    """Nodes per hpZ group, ``k``, checked against the mesh. ``None`` means one node."""
    if hpz_group_size is None:
        return 1
    nodes, local = mesh.shape
    valid = [k * local for k in range(1, nodes + 1) if nodes % k == 0]
    if hpz_group_size not in valid:
        raise ValueError(
            f"hpz_group_size={hpz_group_size} is invalid for a {nodes}x{local} mesh: a "
            f"secondary group is k whole nodes (k dividing {nodes}); valid sizes are {valid} "
            f"(None = {local}, the local axis). From a DeepSpeed config this is "
            "zero_optimization.zero_hpz_partition_size"
        )
    return hpz_group_size // local


def secondary_slice(full: jax.Array, k: int) -> jax.Array:
    """``full [n]`` -> this device's ``[n / (k * L)]`` slice of its hpZ group's copy.

    The device's position in its group is ``(node % k) * L + local``.
    """
    local = jax.lax.axis_size(LOCAL)
    size = full.shape[0] // (k * local)
    pos = (jax.lax.axis_index(NODE) % k) * local + jax.lax.axis_index(LOCAL)
    return jax.lax.dynamic_slice_in_dim(full, pos * size, size)


def hpz_all_gather(secondary: jax.Array, k: int) -> jax.Array:
    """Rebuilds ``full [n]`` from the group's secondaries, without leaving the group.

    Communicates over ``"local"`` (an all-gather inside the node) and, for ``k > 1``, over
    ``"node"`` only between the ``k`` nodes of this device's group (``k - 1`` ppermutes).
    16-bit data moves as 16-bit integers, under types distinct from the forward gather's.
    """
    piece = all_gather_flat(secondary, LOCAL, distinct=True)  # [n / k]: this node's part
    if k == 1:
        return piece
    nodes = jax.lax.axis_size(NODE)
    m = piece.shape[0]
    pos = jax.lax.axis_index(NODE) % k
    out = jnp.zeros((k * m,), piece.dtype)
    out = jax.lax.dynamic_update_slice_in_dim(out, piece, pos * m, 0)
    wire = to_wire(piece, distinct=True)
    for s in range(1, k):
        # Node dst receives the part of the group member s positions ahead of it.
        perm = [((dst // k) * k + (dst % k + s) % k, dst) for dst in range(nodes)]
        recv = from_wire(jax.lax.ppermute(wire, NODE, perm), piece.dtype)
        out = jax.lax.dynamic_update_slice_in_dim(out, recv, ((pos + s) % k) * m, 0)
    return out
