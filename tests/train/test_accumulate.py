"""Gradient accumulation: k micro-batches equal one large-batch step, with every switch. The
parity tests run both sides in float64 (the derived tolerance: tests/helpers.py,
``FLOAT64_RHO``); the bf16 test's bound is derived from bf16 and fp32 unit roundoffs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.train.accumulate import accumulate_gradients
from zeropp_demo.gpt import GPT, loss_fn

from helpers import (FLOAT64, FLOAT64_RHO, SMALL, SMALL64, U32, adam_sensitivity, as_float64,
                     assert_leaves_within, assert_training_close, float64_run, fresh_seed,
                     gpt_losses, init_params, jitted, momentum_sensitivity,
                     reference_loss_and_grads, reference_train, seed_on_failure, tokens,
                     trajectory_tolerances, value_and_grad_of)

FP32 = dict(compute_dtype="float32")
U_BF16 = 2.0**-8  # bf16's unit roundoff (8 significand bits)


def _step(micro_batches: int):
    @zpp.train_step
    def step(state, batch):
        def loss_of(p, b):
            return loss_fn(state.apply_fn({"params": p}, b[:, :-1]), b[:, 1:])

        loss, grads = accumulate_gradients(loss_of, state.params, batch,
                                           micro_batches=micro_batches)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return step


def _after(state):
    """Parameters after the step, in float64 (so averaging runs adds no rounding)."""
    return jax.tree_util.tree_map(lambda a: np.asarray(a, np.float64), state.consolidate())


def _micro(batch: np.ndarray, devices: int, k: int, j: int) -> np.ndarray:
    """The global micro-batch j: piece j of every device's local batch, in device order."""
    return batch.reshape(devices, k, -1, batch.shape[-1])[:, j].reshape(-1, batch.shape[-1])


@pytest.fixture(scope="module")
def setup(_seed_round):
    """A fresh seed (again each ``--seed-rounds`` round), the fp32 parameters and a batch of
    32 rows drawn from it."""
    seed = fresh_seed()
    return seed, init_params(seed=seed), tokens(32, seed=seed + 1)


def test_zero3_accumulation_equals_one_large_batch(setup):
    """Two Adam steps of 4 accumulated micro-batches under ZeRO-3 equal two steps on the
    whole batches: one device's plain training on them (the large-batch step itself, one
    program fewer than a second ZeRO-3 run of the large batch on the mesh, whose equality
    with one device test_engine holds)."""
    seed, params, _ = setup
    model, params = GPT(SMALL64), as_float64(params)
    mesh = zpp.make_mesh(2, 4)
    lr, eps = 1e-2, 1e-3  # eps: see test_engine.test_three_adam_steps_equal...
    tx = optax.adam(lr, eps=eps)
    batches = [tokens(32, seed=seed + 2 + i) for i in range(2)]
    with float64_run():
        cfg = zpp.ZeroPPConfig.zero3(**FLOAT64)
        state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=cfg)
        step = _step(4)
        losses = []
        for b in batches:
            state, m = step(state, b)
            losses.append(float(m["loss"]))
        ref_params, ref_losses, ref_grads = reference_train(model, params, tx, batches,
                                                            with_grads=True, jit_optimizer=True)
    # The mean of k equal micro-batch means is the large-batch mean; only the summation
    # order differs (micro-batches, devices, or one device), each run within the derived
    # float64 rounding of the exact gradients, carried through two Adam steps as in
    # test_engine (helpers).
    rho, g = FLOAT64_RHO, ref_grads[0]
    tols = trajectory_tolerances(params, g, rho=rho, lr=lr, steps=2,
                                 sensitivity=adam_sensitivity(eps))
    with seed_on_failure(seed):
        assert_training_close(losses, _after(state), ref_losses, ref_params, ref_grads, tols,
                              rho, start=params)


# zeropp turns on qwZ, hpZ and qgZ at once; stages 1 and 2 take the other gradient path.
# zeropp (37 s) runs under `make test-all`, to keep `make test` under ten minutes; stage 1,
# stage 2 and the CLI's ZeRO-3 --accum runs (test_resume.py) stay in `make test`.
@pytest.mark.parametrize("mode", ["stage1", "stage2",
                                  pytest.param("zeropp", marks=pytest.mark.slow)])
def test_accumulation_is_the_mean_of_micro_batch_steps(setup, mode):
    """With every switch, the accumulated step equals the mean of the same step run on each
    micro-batch alone (SGD with lr=1 makes a step's update minus its gradient, so the
    average of the parameters after each is the parameters after the averaged gradient).
    Quantization happens per micro-batch in both. Without quantization (stages 1 and 2)
    SGD with lr 1 is linear in the gradient and the large batch's gradient is the mean of
    the micro-batches', so that mean is the exact large-batch step, ``params - g`` with the
    float64 reference gradient: the accumulated step is compared with it, no
    one-micro-batch program compiled."""
    seed, params, batch = setup
    model, params = GPT(SMALL64), as_float64(params)
    mesh = zpp.make_mesh(2, 4)
    tx = optax.sgd(1.0)
    k = 4

    with float64_run():
        if mode.startswith("stage"):
            cfg = zpp.ZeroPPConfig(stage=int(mode[-1]), **FLOAT64)
        else:
            cfg = zpp.ZeroPPConfig.from_mode(mode, **FLOAT64)
        # One state for every run (steps do not donate it): one engine, so each step
        # function compiles once per batch shape instead of once per fresh state.
        start = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh,
                                      config=cfg)
        acc_state, m = _step(k)(start, batch)
        acc = _after(acc_state)
        loss, g = reference_loss_and_grads(model, params, batch)
        if cfg.qwz or cfg.qgz:
            # Quantized: the same step on each micro-batch alone, and the mean of the
            # results.
            one = _step(1)
            parts, losses = [], []
            for j in range(k):
                s, mj = one(start, _micro(batch, 8, k, j))
                parts.append(_after(s))
                losses.append(float(mj["loss"]))
            want = jax.tree_util.tree_map(lambda *xs: np.mean(xs, axis=0), *parts)
            want_loss = np.mean(losses)
        else:
            # The mean of those steps, exactly: one SGD step (lr 1) by the exact gradient.
            want = jax.tree_util.tree_map(lambda p, x: np.asarray(p) - np.asarray(x),
                                          params, g)
            want_loss = float(loss)
    # Float64 paths (including qwZ/hpZ, whose weights are the same dequantized values in
    # both) agree to summation order, each run within the derived float64 rounding rho:
    # losses to 2 rho, and one SGD step (lr 1: the update is the gradient) to 2 rho of the
    # gradient plus each run's rounding of the stored parameters
    # (helpers.trajectory_tolerances). Against the exact step (stages 1 and 2) one run's
    # share of that bound is enough; the whole of it is allowed. A micro-batch missing or
    # counted twice moves the update by a quarter of it.
    # qgZ quantizes each micro-batch's gradient in both runs; the inputs to its quantizer
    # differ only by float64 rounding, so its output agrees as well unless a value sits
    # within that rounding of a quantization boundary.
    rho = FLOAT64_RHO
    with seed_on_failure(seed):
        assert abs(float(m["loss"]) - want_loss) <= 2 * rho * abs(want_loss)
        tols = trajectory_tolerances(want, g, rho=rho, lr=1.0, steps=1,
                                     sensitivity=momentum_sensitivity())[1]
        assert all(tol < 1e-3 * np.max(np.abs(x)) / k
                   for tol, x in zip(tols, jax.tree_util.tree_leaves(g)))
        assert_leaves_within(acc, want, tols)
    # Without qgZ the mean of the micro-batch steps is the large-batch step itself, as
    # above; test_zero3_accumulation_equals_one_large_batch steps the large batch
    # directly under Adam, on one device.


def test_bf16_accumulates_in_fp32(setup):
    """bf16 compute: the accumulator is fp32, and 4 accumulated micro-batches step as the
    whole batch does, within a bound derived from the bf16 and fp32 roundings the two runs
    make. The model computes in float64 at the bf16 weights the step gathers (the demo GPT
    with ``dtype="float64"``, under ``float64_run``): what this test is about (the bf16
    gradients, their bf16 reduce-scatter, the fp32 accumulator and master weights) rounds
    as with an fp32 model, and the model's own arithmetic rounds by the derived float64
    ``FLOAT64_RHO`` instead of an fp32 rounding that only a measurement would bound."""
    seed, params, batch = setup
    model = GPT(SMALL64)
    with float64_run():
        cfg = zpp.ZeroPPConfig.zero3()  # bf16 compute, fp32 master weights
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(1.0),
                                      mesh=zpp.make_mesh(2, 4), config=cfg)
        step4 = _step(4)  # lowered and run: one trace
        lowered = step4.lower(state, batch).as_text()
        s4, _ = step4(state, batch)
        s1, _ = _step(1)(state, batch)
        # Each row's gradient at the bf16 weights, in float64 (one jitted program).
        weights = jax.tree_util.tree_map(
            lambda p: np.asarray(p, jnp.bfloat16).astype(np.float64), params)
        row_grads = jitted(value_and_grad_of(gpt_losses(model)[0]))
        rows = [row_grads(weights, batch[i:i + 1])[1] for i in range(32)]
    # The scan's carry holds fp32 shards: the accumulator is not bf16. Every unit's shard
    # rides in the carry as f32 twice (the parameters and their accumulator), none as bf16.
    [carry] = [line.split(" : ", 1)[1] for line in lowered.splitlines()
               if "stablehlo.while(" in line]
    assert "bf16" not in carry, carry
    for lay in state.engine.layouts.values():
        assert carry.count(f"tensor<{lay.shard_len}xf32>") >= 2, (lay.shard_len, carry)
    # bf16 gradients of micro-batches vs of the whole batch, at the same bf16 weights.
    # - Each device's gradient (of a one-row micro-batch, or of its 4 rows) is computed in
    #   float64: within FLOAT64_RHO of its leaf's scale, at most T = max |row gradient|.
    # - It is rounded to bf16 once and reduce-scattered in bf16 (at most 7 more roundings,
    #   each of a partial sum over 8 devices), then made fp32 and divided by 8 (exact).
    #   Each rounding is at most U_BF16 of the magnitudes summed: the micro-batch run is
    #   within 8 U_BF16 A of the exact gradient, A the mean over the 32 rows of |row
    #   gradient|, the other within 8 U_BF16 B, B the mean over devices of |device
    #   gradient|.
    # - The micro-batch run adds its 4 reduced gradients in the fp32 accumulator: 3
    #   roundings, each at most U32 of a partial sum, which is at most 4 (1 + 8 U_BF16) A
    #   before the exact division by 4: under 4 U32 A.
    # - Each run rounds the stored fp32 parameter once (SGD, lr 1): 2 U32 |p|.
    # The float64 rounding of the reference rows (A, B, the gradient g) is ~1e-16 of them.
    after4, after1 = _after(s4), _after(s1)
    rows = [np.stack([np.asarray(x, np.float64) for x in leaf])
            for leaf in zip(*map(jax.tree_util.tree_leaves, rows))]  # per leaf [32, ...]
    with seed_on_failure(seed):
        for a, b, r in zip(jax.tree_util.tree_leaves(after4),
                           jax.tree_util.tree_leaves(after1), rows):
            g_leaf = np.mean(r, axis=0)  # the whole batch's gradient: the mean over rows
            row_mean = np.mean(np.abs(r), axis=0)
            device_mean = np.mean(np.abs(r.reshape(8, 4, *r.shape[1:]).mean(axis=1)), axis=0)
            tol = (8 * U_BF16 * (row_mean + device_mean) + 4 * U32 * row_mean
                   + 2 * FLOAT64_RHO * np.max(np.abs(r)) + 2 * U32 * np.abs(b))
            assert np.all(np.abs(a - b) <= tol)
            # 16 bf16 roundings of the contributions can reach a good part of what a
            # micro-batch missing or counted twice moves (a quarter of the update): bf16
            # admits no bound far below it (0.25-0.7 of it here, the measured error 10% of
            # the bound). It still fails that bug in every leaf.
            assert np.max(tol) < np.max(np.abs(g_leaf)) / 4


def test_micro_batches_must_divide_the_local_batch(setup):
    _, params, _ = setup
    state = zpp.TrainState.create(model=GPT(SMALL), params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=zpp.ZeroPPConfig.zero3(**FP32))
    with pytest.raises(ValueError, match="micro_batches=3"):
        _step(3)(state, tokens(16, seed=1))  # 2 rows per device
    with pytest.raises(ValueError, match="positive int"):
        _step(0)(state, tokens(16, seed=1))
