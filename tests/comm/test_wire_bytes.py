"""What each transport says it moves, against what its lowered program moves; the plan's
transports are the ones a step runs.

``weight_bytes`` / ``gradient_bytes`` count a transport's collectives from its jaxpr on an
abstract mesh; ``comm_report`` parses the lowered StableHLO of the same operation on real
(simulated) devices. The two share only the counting model, so equality checks the jaxpr
walk (axis names -> replica groups, permutes -> device pairs, element sizes) against the
program XLA is given. Closed forms on a 64 x 8 mesh (no devices needed) pin the model itself.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.comm.transports import plan_of
from zeropp_jax.comm.transports.base import gradient_bytes, weight_bytes
from zeropp_jax.comm.transports.fp8 import Fp8Gather
from zeropp_jax.comm.transports.hierarchical_reduce_scatter import HierarchicalReduceScatter
from zeropp_jax.comm.transports.hpz import SecondaryRegather
from zeropp_jax.comm.transports.plain import PlainGather
from zeropp_jax.comm.transports.qgz import QgzReduceScatter
from zeropp_jax.comm.transports.qwz import QwzGather
from zeropp_jax.comm.transports.reduce_scatter import FlatReduceScatter
from zeropp_jax.comm.transports.stored_quantized import StoredQuantizedGather
from zeropp_jax.core.mesh import AXES
from zeropp_jax.measure.comm_report import comm_report

BLOCK = 256
F32, BF16 = jnp.float32, jnp.bfloat16


def _weight_transports():
    return {
        "plain": PlainGather(BF16),
        "plain_two_hop": PlainGather(BF16, hierarchical=True),
        "qwz8": QwzGather(8, BLOCK, BF16, "xla"),
        "qwz4": QwzGather(4, BLOCK, BF16, "xla"),
        "qwz4_hadamard": QwzGather(4, BLOCK, BF16, "xla", hadamard=True),
        "fp8": Fp8Gather(BLOCK, BF16),
        "fp8_hadamard_two_hop": Fp8Gather(BLOCK, BF16, hierarchical=True, hadamard=True),
        "stored8": StoredQuantizedGather(8, BLOCK, BF16, "xla"),
        "stored4_two_hop": StoredQuantizedGather(4, BLOCK, BF16, "xla", hierarchical=True),
        "hpz_plain": SecondaryRegather(PlainGather(BF16)),
        "hpz2_qwz8": SecondaryRegather(QwzGather(8, BLOCK, BF16, "xla"), group_size=4),
    }


def _gradient_transports():
    return {
        "flat": FlatReduceScatter(),
        "hierarchical": HierarchicalReduceScatter(),
        "qgz4": QgzReduceScatter(4, BLOCK, 1, "xla", FlatReduceScatter()),
        "qgz8_two_stages": QgzReduceScatter(8, BLOCK, 2, "xla", FlatReduceScatter()),
        "qgz4_hadamard_stochastic": QgzReduceScatter(4, BLOCK, 2, "xla", FlatReduceScatter(),
                                                     hadamard=True, stochastic_rounding=True),
    }


def _lowered(mesh, fn, specs):
    spec = P(AXES)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(specs), out_specs=spec)
    return jax.jit(mapped).lower(*specs)


def _report_bytes(mesh, fn, specs):
    report = comm_report(_lowered(mesh, fn, specs), mesh)
    return report.intra_node_bytes, report.cross_node_bytes


@pytest.mark.parametrize("name", sorted(_weight_transports()))
def test_weight_transport_bytes_are_its_lowered_programs(name):
    mesh = zpp.make_mesh(4, 2)  # 4 nodes: hpZ groups of 2 nodes cross a node boundary
    t = _weight_transports()[name]
    n_pad = 8 * 4 * BLOCK
    specs = t.stored_specs(n_pad, F32)
    said = weight_bytes(t, n_pad, F32, MeshInfo(4, 2))

    def forward(*stored):
        return t.gather(stored)[0]

    def both(*stored):  # uses both results: lowering drops a gather nothing reads
        full, moved = t.gather(stored)
        return full + t.regather(t.keep(stored, moved))

    fwd = _report_bytes(mesh, forward, specs)
    total = _report_bytes(mesh, both, specs)
    assert (said["forward"].intra, said["forward"].cross) == pytest.approx(fwd, rel=1e-12)
    back = (total[0] - fwd[0], total[1] - fwd[1])
    assert (said["backward"].intra, said["backward"].cross) == pytest.approx(back, rel=1e-12)
    assert said["forward"].cross > 0  # a 4-node mesh: the forward gather crosses nodes


@pytest.mark.parametrize("name", sorted(_gradient_transports()))
def test_gradient_transport_bytes_are_its_lowered_program(name):
    mesh = zpp.make_mesh(2, 4)
    t = _gradient_transports()[name]
    n_pad = 8 * 2 * BLOCK
    said = gradient_bytes(t, n_pad, F32, MeshInfo(2, 4))
    full = jax.ShapeDtypeStruct((n_pad * 8,), F32)  # each device's full [n_pad] gradient
    got = _report_bytes(mesh, lambda g: t.reduce_sum(g), (full,))
    assert (said.intra, said.cross) == pytest.approx(got, rel=1e-12)
    assert said.cross > 0


def test_closed_forms_on_a_64_node_mesh():
    """On 64 nodes x 8 devices (traced only), a unit of ``n`` elements, ``T`` its bytes:
    a flat bf16 gather moves ``(N - 1) T`` across nodes and ``(L - 1) T`` inside; hpZ's
    regather inside the node moves nothing across; qwZ INT8 moves ``(N - 1) n (1 + 4 / B)``
    bytes (one byte per value plus an fp32 scale per block of B) across; a flat fp32
    reduce-scatter ``(N - 1) T`` across; qgZ INT4 crosses nodes once, with half a byte per
    value plus scales: ``(N - 1) / N`` of ``n (1/2 + 4 / B)`` per node."""
    nodes, local, n = 64, 8, 64 * 8 * 4 * BLOCK
    mesh = MeshInfo(nodes, local)
    plain = weight_bytes(PlainGather(BF16), n, F32, mesh)
    assert plain["forward"].cross == (nodes - 1) * 2 * n
    assert plain["forward"].intra == (local - 1) * 2 * n
    assert plain["backward"] == plain["forward"]  # ZeRO-3 regathers the same way
    hpz = weight_bytes(SecondaryRegather(PlainGather(BF16)), n, F32, mesh)
    assert hpz["forward"] == plain["forward"] and hpz["backward"].cross == 0
    qwz = weight_bytes(QwzGather(8, BLOCK, BF16, "xla"), n, F32, mesh)
    assert qwz["forward"].cross == pytest.approx((nodes - 1) * n * (1 + 4 / BLOCK), rel=1e-12)
    flat = gradient_bytes(FlatReduceScatter(), n, F32, mesh)
    assert flat.cross == (nodes - 1) * 4 * n
    qgz = gradient_bytes(QgzReduceScatter(4, BLOCK, 1, "xla", FlatReduceScatter()), n, F32,
                         mesh)
    assert qgz.cross == pytest.approx((nodes - 1) * n * (0.5 + 4 / BLOCK), rel=1e-12)


def test_smoothing_and_fp8_move_the_same_bytes():
    """Hadamard smoothing and stochastic rounding change values, not bytes: qgZ and qwZ
    move exactly what they move without them; FP8 weights move INT8 qwZ's bytes (one per
    value, four per block)."""
    nodes, local, n = 64, 8, 64 * 8 * 4 * BLOCK
    mesh = MeshInfo(nodes, local)
    flat = FlatReduceScatter()
    qwz_by_bits = {}
    for bits in (4, 8):
        plain = gradient_bytes(QgzReduceScatter(bits, BLOCK, 2, "xla", flat), n, F32,
                               mesh)
        for kw in ({"hadamard": True}, {"stochastic_rounding": True},
                   {"hadamard": True, "stochastic_rounding": True}):
            smooth = QgzReduceScatter(bits, BLOCK, 2, "xla", flat, **kw)
            assert gradient_bytes(smooth, n, F32, mesh) == plain
        qwz = qwz_by_bits[bits] = weight_bytes(QwzGather(bits, BLOCK, BF16, "xla"), n, F32,
                                               mesh)
        rotated = QwzGather(bits, BLOCK, BF16, "xla", hadamard=True)
        assert weight_bytes(rotated, n, F32, mesh) == qwz
    qwz8 = qwz_by_bits[8]  # traced once, in the loop
    assert weight_bytes(Fp8Gather(BLOCK, BF16), n, F32, mesh) == qwz8
    assert weight_bytes(Fp8Gather(BLOCK, BF16, hadamard=True), n, F32, mesh) == qwz8


class _TwoLayers(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(64, name="up")(x))
        return nn.Dense(8, name="down")(x)


def _state(config, frozen=None):
    model = _TwoLayers()
    x = jnp.ones((8, 32))
    # Zeros of the parameters' shapes: the tests below read the plan, the byte counts and
    # lowered programs, which depend on shapes and dtypes only (an eager init compiles a
    # program per operation).
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)["params"]
    params = jax.tree_util.tree_map(lambda a: np.zeros(a.shape, a.dtype), shapes)
    mesh = zpp.make_mesh(2, 4)
    return zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1), mesh=mesh,
                                 config=config, units=["up", "down"], frozen=frozen), x


def test_the_plan_resolves_each_units_transports_once():
    cfg = zpp.ZeroPPConfig.zeropp(quantize_frozen=True)
    state, _ = _state(cfg, frozen=[("up",)])
    t = state.engine.transports
    assert set(t) == {"up", "down"}
    assert t["up"].weights is None  # wholly frozen: stored quantized, hpZ's regather
    assert isinstance(t["up"].frozen, SecondaryRegather)
    assert isinstance(t["up"].frozen.inner, StoredQuantizedGather)
    assert isinstance(t["down"].weights, SecondaryRegather) and t["down"].frozen is None
    assert t["down"] == plan_of(cfg).unit(state.engine.layouts["down"])
    rows = state.engine.wire_bytes()
    assert "gradient" not in rows["up"] and rows["down"]["backward"].cross == 0
    # At 64 nodes the same plan's forward bytes grow with the nodes; hpZ's backward doesn't.
    big = state.engine.wire_bytes(64, 4)
    assert big["down"]["forward"].cross > rows["down"]["forward"].cross
    assert big["down"]["backward"].cross == 0


def test_a_step_runs_the_plans_transports_not_the_configs():
    """A plan whose transports say plain gathers runs plain gathers, though its config
    asks for qwZ: nothing in the step reads the config's technique flags again."""
    state, x = _state(zpp.ZeroPPConfig(qwz=True))

    def loss(state, x):
        def f(params):
            return jnp.mean(state.apply_fn({"params": params}, x) ** 2)
        return jax.grad(f)(state.params)

    def gathered_dtypes(state):
        report = comm_report(zpp.train_step(loss).lower(state, x), state.mesh)
        return {r.dtype for r in report.rows if r.kind == "all-gather"}

    assert gathered_dtypes(state) & {"ui8", "u8", "i8"}  # qwZ: bytes on the wire
    plain = {n: dataclasses.replace(t, weights=PlainGather(state.config.compute_jnp_dtype))
             for n, t in state.engine.transports.items()}
    engine = dataclasses.replace(state.engine, transports=plain, memo={})
    forced = state.replace(engine=engine)
    assert not gathered_dtypes(forced) & {"ui8", "u8", "i8"}
