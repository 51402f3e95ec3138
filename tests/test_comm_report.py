"""The communication report on hand-built shard_map programs with known volumes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.analysis import comm_report
from zeropp_jax.models.gpt import GPT

from helpers import SMALL, init_params, make_step, tokens

AXES = ("node", "local")


def _programs(mesh, per_device: int, fn):
    num = mesh.devices.size
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(num * per_device),
                                   jnp.float32), NamedSharding(mesh, P(AXES)))
    lowered = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))).lower(x)
    return lowered, lowered.compile()


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
def test_all_gather_over_local_never_crosses_nodes(nodes, local):
    mesh = zpp.make_mesh(nodes, local)
    for program in _programs(mesh, 64, lambda v: jax.lax.all_gather(v, "local", tiled=True)):
        r = comm_report(program, mesh)
        assert [row.kind for row in r.rows] == ["all-gather"]
        assert r.cross_node_bytes == 0
        # Each device receives (L - 1) chunks of 64 fp32 from its node's peers.
        assert r.intra_node_bytes == nodes * local * (local - 1) * 64 * 4


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
def test_all_to_all_over_node_counts_the_crossing_chunks(nodes, local):
    mesh = zpp.make_mesh(nodes, local)

    def a2a(v):
        return jax.lax.all_to_all(v.reshape(nodes, -1), "node", 0, 0, tiled=True).reshape(-1)

    for program in _programs(mesh, 64 * nodes, a2a):
        r = comm_report(program, mesh)
        # Every device keeps 1 of its `nodes` chunks (64 fp32 each) and sends the rest
        # across nodes.
        assert r.cross_node_bytes == nodes * local * (nodes - 1) * 64 * 4
        assert r.intra_node_bytes == 0


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (8, 1)])
def test_all_gather_over_both_axes_matches_the_formula(nodes, local):
    mesh = zpp.make_mesh(nodes, local)
    num = nodes * local
    total = num * 64 * 4  # gathered bytes T
    for program in _programs(mesh, 64, lambda v: jax.lax.all_gather(v, AXES, tiled=True)):
        r = comm_report(program, mesh)
        assert r.cross_node_bytes_per_node == pytest.approx((nodes - 1) / nodes * total)


def test_reduce_scatter_and_permute():
    mesh = zpp.make_mesh(2, 4)
    rs = lambda v: jax.lax.psum_scatter(v, AXES, tiled=True)  # noqa: E731
    lowered, compiled = _programs(mesh, 64, rs)
    for r in (comm_report(lowered, mesh), comm_report(compiled, mesh)):
        assert r.cross_node_bytes_per_node == pytest.approx(0.5 * 64 * 4)
    perm = [(0, 4), (4, 0), (1, 2), (2, 1)] + [(d, d) for d in (3, 5, 6, 7)]
    pp = lambda v: jax.lax.ppermute(v, AXES, perm)  # noqa: E731
    for program in _programs(mesh, 64, pp):
        r = comm_report(program, mesh)
        assert r.cross_node_bytes == 2 * 256 and r.intra_node_bytes == 2 * 256


def test_train_step_report_flags_widened_reduce_scatters():
    mesh = zpp.make_mesh(2, 4)
    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                                  mesh=mesh)  # bf16 compute
    lowered = make_step().lower(state, tokens(16, seed=0))
    asked, moved = comm_report(lowered, mesh), comm_report(lowered.compile(), mesh)
    rs_asked = [r for r in asked.rows if r.kind == "reduce-scatter"]
    rs_moved = [r for r in moved.rows if r.kind == "reduce-scatter"]
    assert {r.dtype for r in rs_asked} == {"bf16"} and not any(r.widened for r in rs_asked)
    assert all(r.dtype == "f32" and r.widened for r in rs_moved)  # XLA CPU widens them
    # All-gathers move 16-bit either way; the widened reduce-scatters double their bytes.
    ag = lambda rep: sum(r.cross_node_bytes for r in rep.rows if r.kind == "all-gather")  # noqa: E731
    assert ag(asked) == ag(moved)
    rs = lambda rep: sum(r.cross_node_bytes for r in rep.rows if r.kind == "reduce-scatter")  # noqa: E731
    assert rs(moved) == 2 * rs(asked)
    assert "cross-node bytes per node" in asked.table()
    assert asked.to_json()["cross_node_bytes"] == asked.cross_node_bytes
