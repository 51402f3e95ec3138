"""hpZ: secondary weight partition inside a node (group), carried into backward."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.core import compat
from zeropp_jax.measure.analysis import secondary_bytes
from zeropp_jax.measure.comm_report import collectives
from zeropp_demo.gpt import GPT, loss_fn

from helpers import (FLOAT64, FLOAT64_RHO, SMALL, SMALL64, as_float64, assert_leaves_equal,
                     assert_loss_and_grads_close, dequantized_params, float64_run, fresh_seed,
                     init_params, make_step, reference_loss_and_grads, seed_on_failure,
                     tokens)

FP32 = dict(compute_dtype="float32")


def _loss_and_grads(config, mesh_shape, params, batch, model=GPT(SMALL)):
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(*mesh_shape), config=config)
    _, out = make_step(with_grads=True)(state, batch)
    return state, float(out["loss"]), state.engine.consolidate(out["grads"])


# fp32 SGD(0.1) steps (returning their gradients) at init_params(seed=31), built once per
# module and mesh: a step compiles once per engine (compared by identity) and step function,
# and steps do not donate the state, so the untrained state serves every test that shares
# it. test_hpz_alone_equals_zero3 runs them (ZeRO-3's two steps on a mesh are run once and
# compared with each hpZ group size there); test_backward_gathers_stay_inside_the_group
# reads the hpZ steps' lowered programs (the same trace: it compiles nothing).
_BUILT: dict = {}
_SEED = 31


@pytest.fixture(scope="module", autouse=True)
def _forget_built():
    yield
    _BUILT.clear()


def _built(mesh_shape, group, hpz: bool):
    """(untrained state, step) of the shared fp32 step: hpZ with ``group`` or ZeRO-3."""
    key = (mesh_shape, group, hpz)
    if key not in _BUILT:
        cfg = (zpp.ZeroPPConfig(hpz=True, hpz_group_size=group, **FP32) if hpz
               else zpp.ZeroPPConfig(**FP32))
        state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=_SEED),
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(*mesh_shape),
                                      config=cfg)
        _BUILT[key] = (state, make_step(with_grads=True))
    return _BUILT[key]


def _two_steps(state, step):
    """(loss, gradients) of two training steps on fresh batches, the second at the weights
    the first step updated."""
    out = []
    for seed in (32, 33):
        state, metrics = step(state, tokens(16, seed=seed))
        out.append((float(metrics["loss"]), state.engine.consolidate(metrics["grads"])))
    return out


# Each mesh compiles a ZeRO-3 step, and each case an hpZ step, with XLA's MLIR fusion
# emitters (bitwise_programs: seconds each). `make test` keeps the case whose backward
# takes the most of hpZ's path: a group of two 2-device nodes, the secondary gathered over
# "local" and then exchanged by ppermutes over "node". A group of one node stops after the
# "local" gather (hpz_all_gather with k = 1): in a step bit for bit in `make test-all`,
# and in `make test` on its own (test_transports.py::test_hpz_rebuilds_forward_weights_from_
# the_secondary[plain-None], bit for bit) and in a step within rounding
# (test_qwz_hpz_gradient_is_exact_at_dequantized_weights). The other groups (a whole 2x4
# mesh, 4 one-device nodes) take the kept case's path on other shapes.
@pytest.mark.parametrize(
    "mesh_shape,group",
    [pytest.param((2, 4), None, marks=pytest.mark.slow),
     pytest.param((4, 2), None, marks=pytest.mark.slow), ((4, 2), 4),
     pytest.param((2, 4), 8, marks=pytest.mark.slow), pytest.param((8, 1), 4, marks=pytest.mark.slow)],
)
@pytest.mark.bitwise_programs
def test_hpz_alone_equals_zero3(mesh_shape, group):
    """hpZ's steps equal ZeRO-3's bit for bit, and the secondary partition is rebuilt every
    step: the second step runs at parameters the first changed (SGD(0.1) moves every weight
    by 0.1 of its gradient, which changes the second gradient), and a backward that used a
    stale secondary would give the first step's weights' gradient there."""
    if ("zero3 steps", mesh_shape) not in _BUILT:
        _BUILT["zero3 steps", mesh_shape] = _two_steps(*_built(mesh_shape, None, hpz=False))
    zero3 = _BUILT["zero3 steps", mesh_shape]
    hpz = _two_steps(*_built(mesh_shape, group, hpz=True))
    # Same fp32 weights, same arithmetic: only the gather path differs, and gathers move the
    # same bits (test_qgz: the hierarchical gather is the flat one bit for bit). Exact.
    for (l3, g3), (lh, gh) in zip(zero3, hpz):
        assert lh == l3
        assert_leaves_equal(gh, g3)


# INT4 in `make test-all`: the secondary is a slice of the gathered byte buffer (values
# and scales) whatever the width, and backward decodes it as forward did, so INT8 takes the
# same path (INT4's packing and its decode in a step: test_qwz.py's step tests).
@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_qwz_hpz_gradient_is_exact_at_dequantized_weights(bits):
    """Backward rebuilds the weights from the secondary slices of the *dequantized* forward
    weights, so the gradient is the exact gradient at the dequantized weights."""
    block = 64
    seed = fresh_seed()
    params, batch = as_float64(init_params(seed=seed)), tokens(16, seed=seed + 1)
    with float64_run():
        cfg = zpp.ZeroPPConfig(qwz=True, hpz=True, weight_bits=bits, block_size=block,
                               **FLOAT64)
        state, loss, grads = _loss_and_grads(cfg, (2, 4), params, batch, GPT(SMALL64))
        # The INT blocks dequantize to fp32 values (fp32 scales), which the float64 step
        # then computes with: the same values as this round trip's.
        deq = as_float64(dequantized_params(state, block, bits))
        ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), deq, batch)
    # Both float64 at the same weights; only the summation order differs.
    with seed_on_failure(seed):
        assert_loss_and_grads_close(loss, grads, ref_loss, ref_grads, FLOAT64_RHO)


@pytest.mark.parametrize("mesh_shape,group", [((2, 4), None), ((4, 2), 4)])
def test_backward_gathers_stay_inside_the_group(mesh_shape, group):
    nodes, local = mesh_shape
    group_devices = group or local
    # The fp32 hpZ step test_hpz_alone_equals_zero3 runs: forward gathers move f32, backward
    # regathers the same bits as i32 (bf16 steps move u16 and i16 alike).
    state, step = _built(mesh_shape, group, hpz=True)
    text = step.lower(state, tokens(16, seed=0)).as_text()
    ops = collectives(text)
    gathers = [([list(g) for g in c.groups], c.dtype) for c in ops if c.kind == "all-gather"]
    forward = [g for g, t in gathers if t == "f32"]
    backward = [g for g, t in gathers if t == "i32"]
    assert len(forward) + len(backward) == len(gathers), gathers
    assert len(forward) == len(state.engine.layouts) - 1  # the rest unit's in the first's
    assert backward, "no backward regathers found"
    node_of = lambda d: d // local  # noqa: E731
    for groups in forward:  # forward: one group spanning every node
        assert groups == [list(range(nodes * local))]
    for groups in backward:  # backward: inside a node, over "local"
        for grp in groups:
            assert len({node_of(d) for d in grp}) == 1, groups
    permutes = [c.groups for c in ops if c.kind == "collective-permute"]
    if group is None:
        assert not permutes
    else:  # k > 1 nodes per group: exchanges only between nodes of the same group
        assert permutes
        for pairs in permutes:
            for src, dst in pairs:
                assert src // group_devices == dst // group_devices, pairs


def _residuals(state, batch):
    engine = state.engine

    def per_device(units, batch):
        sp = zpp.ShardedParams(units, True)
        loss = loss_fn(engine.apply({"params": sp}, batch[:, :-1]), batch[:, 1:])
        return jax.lax.pmean(loss, ("node", "local"))

    axes = P(("node", "local"))
    f = jax.shard_map(per_device, mesh=engine.mesh, in_specs=(axes, axes), out_specs=P())
    b = engine.shard_batch(batch)
    return [aval for aval, _ in compat.saved_residuals(lambda u: f(u, b), state.params.units)]


def test_residuals_hold_secondary_slices_not_full_weights():
    """Saved residuals of the step, as seen from outside shard_map: a per-device residual
    of m elements shows up stacked, as [P * m]. A kept full weight would be [P * n_pad]."""
    nodes, local = 2, 4
    num = nodes * local
    batch = tokens(16, seed=0)
    # keep_last_unit (the ZeRO-3 default): the unit called last in forward, the head, keeps
    # its full weights, and only it; without it no unit does.
    for cfg in (zpp.ZeroPPConfig(hpz=True, keep_last_unit=False, **FP32),
                zpp.ZeroPPConfig(**FP32)):
        state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(),
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(nodes, local),
                                      config=cfg)
        sizes = [int(np.prod(a.shape)) for a in _residuals(state, batch) if a.ndim == 1]
        full = {name for name, lay in state.engine.layouts.items() if num * lay.n_pad in sizes}
        assert full == ({"head"} if cfg.keep_last_unit else set()), full
        for name, lay in state.engine.layouts.items():
            if cfg.hpz and name != "<rest>":  # the rest unit stays gathered for the step
                assert num * lay.n_pad // local in sizes, f"no secondary slice for {name}"
                assert lay.n_pad not in sizes  # primary shards not needed
    # The model: each unit keeps n_pad / L compute-dtype elements per device.
    assert secondary_bytes(state.engine) == 0  # ZeRO-3 state from the last loop iteration
    hpz_state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(nodes, local),
                                      config=zpp.ZeroPPConfig(hpz=True))
    expected = sum(lay.n_pad // local * 2 for name, lay in hpz_state.engine.layouts.items()
                   if name != "<rest>")
    assert secondary_bytes(hpz_state.engine) == expected


@pytest.mark.parametrize("group", [3, 12, 2])
def test_invalid_group_size(group):
    cfg = zpp.ZeroPPConfig(hpz=True, hpz_group_size=group)
    with pytest.raises(ValueError, match=r"valid sizes are \[4, 8\]"):
        zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4), config=cfg)
