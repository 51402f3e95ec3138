"""Measuring a ZeRO run: memory held for hpZ's secondary partition.

(The communication report and the memory model extend this module.)
"""

from __future__ import annotations

from zeropp_jax.engine import Engine
from zeropp_jax.hpz import group_nodes
from zeropp_jax.mesh import mesh_shape


def secondary_bytes(engine: Engine) -> int:
    """Bytes of hpZ secondary weights one device holds during a step (0 without hpZ).

    Each unit keeps ``n_pad / G`` elements in the compute dtype from its forward to its
    backward (``G`` = hpZ group size in devices). They are rebuilt in every forward and
    live only until that unit's backward, so the peak is all units at once (the end of
    the forward pass), which is what this returns.
    """
    config = engine.config
    if not config.hpz:
        return 0
    nodes, local = mesh_shape(engine.mesh)
    group = group_nodes(config.hpz_group_size, nodes, local) * local
    itemsize = config.compute_jnp_dtype.itemsize
    return sum(lay.n_pad // group * itemsize for lay in engine.layouts.values())


from zeropp_jax.comm_report import CollectiveRow, CommReport, comm_report  # noqa: E402,F401
