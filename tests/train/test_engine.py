"""ZeRO-3 (and stages 1, 2) against single-device training, both in float64 (the
parity tests' derived tolerance: tests/helpers.py, ``FLOAT64_RHO``)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT
from zeropp_jax.comm.partition import REST
from zeropp_jax.comm.placement import REPLICATED, SHARDED

from helpers import (
    FLOAT64,
    FLOAT64_RHO,
    SMALL,
    SMALL64,
    adam_sensitivity,
    as_float64,
    assert_far_below_updates,
    assert_leaves_within,
    assert_loss_and_grads_close,
    assert_training_close,
    float64_run,
    fresh_seed,
    init_params,
    make_step,
    reference_loss_and_grads,
    reference_train,
    seed_on_failure,
    tokens,
    trajectory_tolerances,
)


# 2x4 and 8x1 (one device per node) run in `make test`; 1x8 and 4x2 in test-all
# (test_mesh_optimizers covers the 1xL and Nx1 shapes with several optimizers).
@pytest.mark.parametrize("nodes,local", [pytest.param(1, 8, marks=pytest.mark.slow), (2, 4),
                                         pytest.param(4, 2, marks=pytest.mark.slow), (8, 1)])
def test_loss_and_grads_equal_single_device(nodes, local):
    model = GPT(SMALL64)
    seed = fresh_seed()
    params = as_float64(init_params(seed=seed))
    batch = tokens(16, seed=seed + 1)
    mesh = zpp.make_mesh(nodes, local)
    with float64_run():
        # units="children" (every direct child a unit): the root-level logit scale alone is
        # then the rest unit, a unit smaller than the device count.
        state = zpp.TrainState.create(
            model=model, params=params, tx=optax.sgd(0.1), mesh=mesh,
            config=zpp.ZeroPPConfig.zero3(**FLOAT64), units="children",
        )
        # The test model exercises padding and a unit smaller than the device count.
        layouts = state.engine.layouts
        assert any(lay.n_pad > lay.n for lay in layouts.values())
        assert layouts[REST].n < 8
        _, out = make_step(with_grads=True)(state, batch)
        ref_loss, ref_grads = reference_loss_and_grads(model, params, batch)
    # Only the summation order differs (8 partial means vs one mean): each within the
    # derived float64 rounding of the exact values.
    grads = state.engine.consolidate(out["grads"])
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads, FLOAT64_RHO)


# The stage-3 run of the Adam test below: its start state and step function (which counts
# its traces) are the no-recompile test's too, so that test runs a program already
# compiled (steps do not donate the state).
_TRACES: list = []
_STARTS: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_starts():
    yield
    _STARTS.clear()


@zpp.train_step
def _counted_step(state, batch):
    """``helpers.make_step()``'s step, counting its traces in ``_TRACES``."""
    from zeropp_demo.gpt import loss_fn

    _TRACES.append(1)

    def loss_of(p):
        return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


# eps=1e-3: some gradients are identically zero in exact arithmetic (attention's key bias:
# softmax is shift invariant) and come out as ~1e-10 rounding noise; Adam divides by
# sqrt(v)+eps, so with a tiny eps it turns that noise into full +-lr steps. With eps=1e-3
# an update changes by at most lr * |noise| / eps ~ 1e-10.
ADAM_LR, ADAM_EPS = 1e-2, 1e-3
_ADAM_SEED = fresh_seed()  # the Adam test's inputs, fresh each run


def _adam_start(stage):
    """The Adam test's 2x4 float64 state at ``stage`` (parameters at the module's fresh
    seed), one per stage."""
    if stage not in _STARTS:
        with float64_run():
            _STARTS[stage] = zpp.TrainState.create(
                model=GPT(SMALL64), params=as_float64(init_params(seed=_ADAM_SEED)),
                tx=optax.adam(ADAM_LR, eps=ADAM_EPS), mesh=zpp.make_mesh(2, 4),
                config=zpp.ZeroPPConfig(stage=stage, **FLOAT64))
    return _STARTS[stage]


def test_three_adam_steps_of_stages_1_2_3_equal_single_device():
    """Three Adam steps under ZeRO stages 1, 2 and 3 (one program each, on the same
    batches) against plain single-device training: stage 3's losses and parameters, and
    every stage's parameters, and the stages against each other. (Formerly two tests, one
    for stage 3 alone and one for the three stages on other batches: the stage-3 run here
    serves both, one train-step compile fewer.)"""
    model = GPT(SMALL64)
    params = as_float64(init_params(seed=_ADAM_SEED))
    batches = [tokens(16, seed=_ADAM_SEED + 1 + i) for i in range(3)]
    lr, eps = ADAM_LR, ADAM_EPS  # eps: see ADAM_EPS
    tx = optax.adam(lr, eps=eps)
    results, losses = {}, []
    with float64_run():
        for stage in (3, 1, 2):
            state = _adam_start(stage)
            step = _counted_step if stage == 3 else make_step()
            for b in batches:
                state, out = step(state, b)
                if stage == 3:
                    losses.append(float(out["loss"]))
            assert int(state.step) == 3
            results[stage] = state.consolidate()
        ref_params, ref_losses, ref_grads = reference_train(model, params, tx, batches,
                                                            with_grads=True)
    # The runs differ only in summation order (8 partial means vs one mean); the bound on
    # how far that moves 3 Adam steps and their losses is carried from the derived float64
    # rounding through Adam's sensitivity (helpers), and stays far below the update itself
    # (about 3 lr), which a wrong reduction (a missing device, a double mean) would move
    # whole.
    rho, g = FLOAT64_RHO, ref_grads[0]
    tols = trajectory_tolerances(ref_params, g, rho=rho, lr=lr, steps=len(batches),
                                 sensitivity=adam_sensitivity(eps))
    with seed_on_failure(_ADAM_SEED):
        assert_training_close(losses, results[3], ref_losses, ref_params, ref_grads,
                              tols, rho, start=params)
        final = tols[-1]
        assert_far_below_updates(final, ref_params, params)
        for stage in (1, 2, 3):
            assert_leaves_within(results[stage], ref_params, final)
        assert_leaves_within(results[1], results[3], final)
        assert_leaves_within(results[2], results[3], final)


def test_stage_3_shards_and_stage_1_2_replicate():
    model = GPT(SMALL)
    params = init_params()
    mesh = zpp.make_mesh(2, 4)
    s3 = zpp.TrainState.create(model=model, params=params, tx=optax.adam(1e-3), mesh=mesh)
    for arr in s3.params.units.values():
        assert arr.sharding.spec == SHARDED
        shard_lens = {s.data.shape for s in arr.addressable_shards}
        assert shard_lens == {(arr.shape[0] // 8,)}
    # Adam's moments are sharded like the params; its step count is replicated.
    mu = s3.opt_state[0].mu
    assert all(x.sharding.spec == SHARDED for x in mu.values())
    assert s3.opt_state[0].count.sharding.spec == REPLICATED
    s2 = zpp.TrainState.create(
        model=model, params=params, tx=optax.adam(1e-3), mesh=mesh,
        config=zpp.ZeroPPConfig(stage=2),
    )
    for name, arr in s2.params.units.items():
        assert arr.sharding.spec == REPLICATED
        assert arr.dtype == np.dtype("bfloat16")
        assert s2.master.units[name].sharding.spec == SHARDED


def test_device_d_owns_flat_slice_d():
    model = GPT(SMALL)
    params = init_params()
    mesh = zpp.make_mesh(2, 4)
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1), mesh=mesh)
    for name, lay in state.engine.layouts.items():
        arr = state.params.units[name]
        full = np.asarray(arr)
        for node in range(2):
            for local in range(4):
                d = node * 4 + local
                dev = mesh.devices[node, local]
                (shard,) = [s for s in arr.addressable_shards if s.device == dev]
                np.testing.assert_array_equal(
                    np.asarray(shard.data), full[d * lay.shard_len:(d + 1) * lay.shard_len]
                )


def test_no_recompile_and_stable_shardings():
    """Steps after the first neither trace the step again nor change a sharding, shape or
    dtype of the state. The Adam test's stage-3 state and counted step: when that test ran
    first, this one's first call runs its compiled program too (the trace count is then
    that test's)."""
    state = _adam_start(3)

    def shardings(s):
        return jax.tree_util.tree_map(lambda x: (x.sharding, x.shape, x.dtype), s)

    before = shardings(state)
    with float64_run():
        state, _ = _counted_step(state, tokens(16, seed=1))
        n_traces = len(_TRACES)
        assert n_traces > 0
        assert shardings(state) == before
        for i in range(2):
            state, _ = _counted_step(state, tokens(16, seed=2 + i))
            assert shardings(state) == before
    assert _counted_step.jitted._cache_size() == 1
