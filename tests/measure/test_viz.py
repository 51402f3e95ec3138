"""zeropp_jax.measure.viz: the pictured layouts agree with the code that moves the data."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import matplotlib
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from pallas_kernels.reorder import reorder_reference
from zeropp_jax.measure import viz
from zeropp_jax.measure.comm_report import collectives
from zeropp_jax.comm.hpz import hpz_all_gather, secondary_slice

matplotlib.use("Agg")
AXES = ("node", "local")
MESHES = [(2, 4), (4, 2), (1, 8), (8, 1)]


@pytest.mark.parametrize("nodes,local,k", [(2, 4, 1), (4, 2, 1), (4, 2, 2), (8, 1, 4)])
def test_secondary_owners_match_secondary_slice(nodes, local, k):
    mesh = zpp.make_mesh(nodes, local)
    g = k * local
    full = jnp.arange(g * 3, dtype=jnp.float32)  # slice s holds values [3s, 3s + 3)
    fn = jax.shard_map(lambda: secondary_slice(full, k), mesh=mesh, in_specs=(),
                       out_specs=P(AXES))
    held = np.asarray(jax.jit(fn)()).reshape(nodes * local, 3)[:, 0] // 3  # per device
    owners = viz.secondary_owners(nodes, local, k)
    assert len(owners) == g
    for s, devs in enumerate(owners):
        assert sorted(devs) == sorted(np.flatnonzero(held == s).tolist())


@pytest.mark.parametrize("nodes,local", MESHES)
def test_qgz_slot_matches_the_reorder_kernel_reference(nodes, local):
    p = nodes * local
    out = np.asarray(reorder_reference(jnp.arange(p, dtype=jnp.float32), nodes=nodes,
                                       local=local))
    slots = viz.qgz_slot(nodes, local)
    for src in range(p):
        assert out[slots[src]] == src


def test_hpz_gather_groups_match_the_lowered_collective():
    nodes, local = 2, 4
    mesh = zpp.make_mesh(nodes, local)
    fn = jax.shard_map(lambda x: hpz_all_gather(x, 1), mesh=mesh, in_specs=P(AXES),
                       out_specs=P(AXES))
    x = jax.device_put(jnp.ones(8 * 4), NamedSharding(mesh, P(AXES)))
    text = jax.jit(fn).lower(x).as_text()
    [gather] = [c for c in collectives(text) if c.kind == "all-gather"]
    lowered = [list(g) for g in gather.groups]
    assert lowered == viz.collective_groups(nodes, local, "hpz_gather")
    assert viz.link_counts(nodes, local, "hpz_gather") == (2 * 6, 0)
    assert viz.link_counts(nodes, local, "all_gather") == (12, 16)


@pytest.mark.parametrize("nodes,local", MESHES)
def test_plots_draw_one_link_per_device_pair(nodes, local):
    for collective in viz.COLLECTIVES:
        fig = viz.plot_links((nodes, local), collective)
        arrows = [a for a in fig.axes[0].texts if getattr(a, "arrow_patch", None) is not None]
        assert len(arrows) == sum(viz.link_counts(nodes, local, collective))
        matplotlib.pyplot.close(fig)
    cfg = zpp.ZeroPPConfig(hpz=True)
    fig = viz.plot_overview((nodes, local), cfg)
    assert len(fig.axes) == 4
    matplotlib.pyplot.close(fig)
    with pytest.raises(ValueError, match="valid values"):
        viz.collective_groups(nodes, local, "broadcast")
