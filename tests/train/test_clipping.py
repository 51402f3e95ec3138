"""Global-norm clipping on shards, schedules and elementwise chains, non-finite steps. The
parity tests run both sides in float64 (the derived tolerance: tests/helpers.py,
``FLOAT64_RHO``)."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT, loss_fn

from helpers import (
    FLOAT64,
    FLOAT64_RHO,
    GUARDED,
    SMALL,
    SMALL64,
    adam_sensitivity,
    as_float64,
    assert_training_close,
    clipped,
    float64_run,
    fresh_seed,
    global_norm_rtol,
    init_params,
    make_step,
    reference_loss_and_grads,
    reference_train,
    seed_on_failure,
    tokens,
    trajectory_tolerances,
)


def _train(state, step, batches, *extra):
    losses = []
    for b in batches:
        state, out = step(state, b, *extra)
        losses.append(float(out["loss"]))
    return state, losses


# The clipping test's states (Adam, max_norm 0.3, by stage) and their step serve the
# global-norm and non-finite tests too (steps do not donate the state): at stage 3 the
# three tests run one step program, traced and compiled once.
MAX_NORM = 0.3
# eps: see test_engine.test_three_adam_steps...
ADAM = lambda: optax.adam(1e-2, eps=1e-3)  # noqa: E731
_STATES: dict = {}
_SEED = fresh_seed()  # the clipped states' parameters and the tests' batches, fresh each run


@pytest.fixture(scope="module", autouse=True)
def _forget_states():
    yield
    _STATES.clear()


def _clipped_state(stage):
    """The float64 params (at ``_SEED``) and their float64 state at ``stage`` with ``ADAM``,
    clipping at ``MAX_NORM``. Steps on it run inside ``float64_run()``."""
    if stage not in _STATES:
        params = as_float64(init_params(seed=_SEED))
        with float64_run():
            cfg = zpp.ZeroPPConfig(stage=stage, gradient_clipping=MAX_NORM, **FLOAT64)
            _STATES[stage] = params, zpp.TrainState.create(
                model=GPT(SMALL64), params=params, tx=ADAM(),
                mesh=zpp.make_mesh(2, 4), config=cfg)
    return _STATES[stage]


@zpp.train_step
def _scaled_step(state, batch, scale):
    """A step on ``scale`` times the loss (1: the loss itself, exactly; NaN: non-finite
    gradients). At stage 3 it also returns the gradient's ``zpp.global_norm`` (stages 1 and
    2 differentiate each device's full weights, which global_norm refuses)."""
    def loss_of(p):
        return scale * loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

    loss, grads = jax.value_and_grad(loss_of)(state.params)
    out = {"loss": loss}
    if grads.sharded:
        out["norm"] = zpp.global_norm(grads)
    return state.apply_gradients(grads=grads), out


ONE = np.float32(1.0)


@pytest.mark.parametrize("stage", [3, 2])
def test_clipping_equals_optax_clip_by_global_norm(stage):
    model = GPT(SMALL64)
    params, start = _clipped_state(stage)
    batches = [tokens(16, seed=_SEED + 1 + i) for i in range(3)]
    # The unclipped gradient norm of this model and data is ~1-3; 0.3 clips every step
    # (checked below), so the test cannot pass by never clipping.
    max_norm = MAX_NORM
    inner = ADAM()  # the state's optimizer
    with float64_run():
        state, losses = _train(start, _scaled_step, batches, ONE)
        ref_params, ref_losses, ref_grads = reference_train(
            model, params, optax.chain(optax.clip_by_global_norm(max_norm), inner), batches,
            with_grads=True, jit_optimizer=True)
        unclipped = reference_train(model, params, inner, batches, jit_optimizer=True)[0]
    # As test_engine's Adam steps, with Adam seeing clipped gradients: each run scales by
    # its own norm, so the norms' difference adds to the gradients' (helpers.clipped).
    rho, g = FLOAT64_RHO, ref_grads[0]
    g_clipped, rho_clipped = clipped(g, rho, max_norm)
    tols = trajectory_tolerances(ref_params, g_clipped, rho=rho_clipped, lr=1e-2, steps=3,
                                 sensitivity=adam_sensitivity(1e-3))
    with seed_on_failure(_SEED):
        assert_training_close(losses, state.consolidate(), ref_losses, ref_params, ref_grads,
                              tols, rho, start=params)
        # ... and clipping mattered: without it the parameters end elsewhere, far outside
        # the bound (the test cannot pass by never clipping).
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
                   for a, b in zip(jax.tree_util.tree_leaves(unclipped),
                                   jax.tree_util.tree_leaves(ref_params)))
        assert diff > 100 * max(tols[-1])


def test_global_norm_inside_the_step_equals_the_unsharded_norm():
    model = GPT(SMALL64)
    # ZeRO-3: the step's gradients are primary shards; _scaled_step returns their
    # zpp.global_norm (before clipping: the norm of what jax.grad returned).
    params, state = _clipped_state(3)
    batch = tokens(16, seed=_SEED + 4)

    with float64_run():
        # The single-device gradient and its norm, jitted (op by op, they compiled ~200
        # small programs): the same float64 arithmetic, each a program of its own.
        g = reference_loss_and_grads(model, params, batch)[1]
        ref = jax.jit(optax.tree.norm)(g)
        norm = float(_scaled_step(state, batch, ONE)[1]["norm"])
    # Two float64 norms of gradients that differ by rounding (helpers.global_norm_rtol); a
    # norm missing a device's share (or summing replicas) is off by 1/8 or more.
    rtol = global_norm_rtol(g, FLOAT64_RHO)
    assert rtol < 1e-3 * GUARDED
    with seed_on_failure(_SEED):
        assert abs(norm - float(ref)) <= rtol * float(ref), (norm, float(ref), rtol)


def test_schedules_and_elementwise_chains_equal_single_device():
    model = GPT(SMALL64)
    seed = fresh_seed()
    params = as_float64(init_params(seed=seed))
    batches = [tokens(16, seed=seed + 1 + i) for i in range(3)]
    peak, clip = 2e-2, 0.05
    schedule = optax.warmup_cosine_decay_schedule(0.0, peak, 2, 10)
    tx = optax.chain(
        optax.clip(clip),  # elementwise clipping, active on these gradients
        optax.scale_by_adam(eps=1e-3),
        optax.add_decayed_weights(1e-2),
        optax.scale_by_schedule(lambda c: -schedule(c)),
    )
    with float64_run():
        state = zpp.TrainState.create(model=model, params=params, tx=tx,
                                      mesh=zpp.make_mesh(4, 2),
                                      config=zpp.ZeroPPConfig.zero3(**FLOAT64))
        state, losses = _train(state, make_step(), batches)
        ref_params, ref_losses, ref_grads = reference_train(model, params, tx, batches,
                                                            with_grads=True, jit_optimizer=True)
    # As test_engine's Adam steps, at the schedule's peak lr, Adam seeing the clipped first
    # gradient (clipping moves no element more than its input; decoupled decay contracts).
    rho, g = FLOAT64_RHO, ref_grads[0]
    seen = jax.tree_util.tree_map(lambda x: np.clip(x, -clip, clip), g)
    tols = trajectory_tolerances(ref_params, g, rho=rho, lr=peak, steps=3, seen=seen,
                                 sensitivity=adam_sensitivity(1e-3))
    with seed_on_failure(seed):
        assert_training_close(losses, state.consolidate(), ref_losses, ref_params, ref_grads,
                              tols, rho, start=params)


def test_deepspeed_gradient_clipping_key():
    assert zpp.ZeroPPConfig.from_deepspeed(
        {"gradient_clipping": 1.0, "zero_optimization": {"stage": 3}}).gradient_clipping == 1.0
    assert zpp.ZeroPPConfig.from_deepspeed(
        {"gradient_clipping": 0.0, "zero_optimization": {"stage": 3}}).gradient_clipping is None
    with pytest.raises(ValueError, match="gradient_clipping must be a positive"):
        zpp.ZeroPPConfig(gradient_clipping=-1.0)


def test_optax_global_norm_clipping_is_rejected_naming_the_config():
    model = GPT(SMALL)
    with pytest.raises(ValueError, match="gradient_clipping=max_norm"):
        zpp.TrainState.create(model=model, params=init_params(),
                              tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
                              mesh=zpp.make_mesh(2, 4))


@pytest.mark.parametrize("stage", [3, 1])
def test_nonfinite_gradient_skips_the_update(stage):
    # Clipping is on, so the NaN gradients pass through the clipping's norm too. The
    # clipping test's states and step (at stage 3 its very program); a loss scale of NaN
    # makes every gradient NaN.
    params, state = _clipped_state(stage)
    step = _scaled_step
    b = tokens(16, seed=_SEED + 5)
    with float64_run(), seed_on_failure(_SEED):
        s1, m1 = step(state, b, np.float32(np.nan))
        assert not np.isfinite(float(m1["loss"]))
        assert int(s1.skipped_steps) == 1 and int(s1.step) == 1
        # Nothing changed: parameters and the optimizer state (Adam's count and moments).
        for a, e in zip(jax.tree_util.tree_leaves(s1.consolidate()),
                        jax.tree_util.tree_leaves(params)):
            np.testing.assert_array_equal(a, e)
        for a, e in zip(jax.tree_util.tree_leaves(s1.opt_state),
                        jax.tree_util.tree_leaves(state.opt_state)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
        # The next finite step trains as if the bad one had never happened.
        s2, m2 = step(s1, b, ONE)
        s_ref, m_ref = step(state, b, ONE)
        assert int(s2.skipped_steps) == 1 and np.isfinite(float(m2["loss"]))
        for a, e in zip(jax.tree_util.tree_leaves(s2.consolidate()),
                        jax.tree_util.tree_leaves(s_ref.consolidate())):
            np.testing.assert_array_equal(a, e)
