"""Gradient accumulation: k micro-batches equal one large-batch step, with every switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.train.accumulate import accumulate_gradients
from zeropp_demo.gpt import GPT, loss_fn

from helpers import (SMALL, U32, adam_sensitivity, assert_leaves_within, assert_training_close,
                     fp32_gradient_rounding, gpt_losses, init_params, jitted,
                     momentum_sensitivity, reference_train,
                     tokens, trajectory_tolerances, value_and_grad_of)

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
def setup():
    return GPT(SMALL), init_params(seed=11), tokens(32, seed=12)


def test_fp32_zero3_accumulation_equals_one_large_batch(setup):
    """Two Adam steps of 4 accumulated micro-batches under ZeRO-3 equal two steps on the
    whole batches: one device's plain training on them (the large-batch step itself, one
    program fewer than a second ZeRO-3 run of the large batch on the mesh, whose equality
    with one device test_engine holds)."""
    model, params, batch = setup
    mesh = zpp.make_mesh(2, 4)
    cfg = zpp.ZeroPPConfig.zero3(**FP32)
    lr, eps = 1e-2, 1e-3  # eps: see test_engine.test_three_adam_steps_equal...
    tx = optax.adam(lr, eps=eps)
    batches = [tokens(32, seed=40 + i) for i in range(2)]
    state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=cfg)
    step = _step(4)
    losses = []
    for b in batches:
        state, m = step(state, b)
        losses.append(float(m["loss"]))
    # The mean of k equal micro-batch means is the large-batch mean; only the fp32 summation
    # order differs (the rounding measured in the one-device order and in the micro-batch
    # order: 32 one-row slices, 8 slices as the devices hold them), carried through two
    # Adam steps as in test_engine (helpers): each run's gradients within rho of the exact
    # ones, the reference's in the one-device order.
    ref_params, ref_losses, ref_grads = reference_train(model, params, tx, batches,
                                                        with_grads=True, jit_optimizer=True)
    rho, (_, g) = fp32_gradient_rounding(model, params, batches[0], shards=(8, 32))
    tols = trajectory_tolerances(params, g, rho=rho, lr=lr, steps=2,
                                 sensitivity=adam_sensitivity(eps))
    assert_training_close(losses, _after(state), ref_losses, ref_params, ref_grads, tols, rho,
                          start=params)


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
    float64 gradient ``fp32_gradient_rounding`` computes anyway: the accumulated step is
    compared with it, no one-micro-batch program compiled."""
    model, params, batch = setup
    mesh = zpp.make_mesh(2, 4)
    if mode.startswith("stage"):
        cfg = zpp.ZeroPPConfig(stage=int(mode[-1]), **FP32)
    else:
        cfg = zpp.ZeroPPConfig.from_mode(mode, **FP32)
    tx = optax.sgd(1.0)
    k = 4

    # One state for every run (steps do not donate it): one engine, so each step function
    # compiles once per batch shape instead of once per fresh state.
    start = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=cfg)

    acc_state, m = _step(k)(start, batch)
    acc = _after(acc_state)
    rho, (loss, g) = fp32_gradient_rounding(model, params, batch, shards=(8, 32))
    if cfg.qwz or cfg.qgz:
        # Quantized: the same step on each micro-batch alone, and the mean of the results.
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
        want = jax.tree_util.tree_map(lambda p, x: np.asarray(p, np.float64) - x, params, g)
        want_loss = float(loss)
    # fp32 paths (including qwZ/hpZ, whose weights are the same dequantized values in both)
    # agree to summation order: losses to 2 rho, and one SGD step (lr 1: the update is the
    # gradient) to 2 rho of the gradient plus each run's rounding of the stored parameters
    # (helpers.trajectory_tolerances; rho measured also in the micro-batch order, 32 one-row
    # slices). Against the exact step (stages 1 and 2) one run's share of that bound is
    # enough; the whole of it is allowed. A micro-batch missing or counted twice moves the
    # update by a quarter of it.
    # qgZ quantizes each micro-batch's gradient in both runs; the inputs to its quantizer
    # differ only by fp32 rounding, so its output agrees as well unless a value sits on a
    # rounding boundary, which these seeds do not hit.
    assert abs(float(m["loss"]) - want_loss) <= 2 * rho * abs(want_loss)
    tols = trajectory_tolerances(want, g, rho=rho, lr=1.0, steps=1,
                                 sensitivity=momentum_sensitivity())[1]
    assert all(tol < 1e-3 * np.max(np.abs(x)) / k
               for tol, x in zip(tols, jax.tree_util.tree_leaves(g)))
    assert_leaves_within(acc, want, tols)
    # Without qgZ the mean of the micro-batch steps is the large-batch step itself, as
    # above; test_fp32_zero3_accumulation_equals_one_large_batch steps the large batch
    # directly under Adam, on one device.


def test_bf16_accumulates_in_fp32(setup):
    model, params, batch = setup
    cfg = zpp.ZeroPPConfig.zero3()  # bf16 compute
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(1.0),
                                  mesh=zpp.make_mesh(2, 4), config=cfg)
    step4 = _step(4)  # lowered and run: one trace
    lowered = step4.lower(state, batch).as_text()
    # The scan's carry holds fp32 shards: the accumulator is not bf16. Every unit's shard
    # rides in the carry as f32 twice (the parameters and their accumulator), none as bf16.
    [carry] = [line.split(" : ", 1)[1] for line in lowered.splitlines()
               if "stablehlo.while(" in line]
    assert "bf16" not in carry, carry
    for lay in state.engine.layouts.values():
        assert carry.count(f"tensor<{lay.shard_len}xf32>") >= 2, (lay.shard_len, carry)
    s4, _ = step4(state, batch)
    s1, _ = _step(1)(state, batch)
    # bf16 gradients of micro-batches vs of the whole batch. Both compute in fp32 at the
    # same bf16 weights; each device's gradient (of a one-row micro-batch, or of its 4 rows)
    # is rounded to bf16 once and reduce-scattered in bf16 (at most 7 more roundings, each
    # of a partial sum over 8 devices), then averaged in fp32. Each rounding is at most
    # U_BF16 of the magnitudes summed: the micro-batch run is within 8 U_BF16 A of the
    # exact gradient, A the mean over the 32 rows of |row gradient|, the other within
    # 8 U_BF16 B, B the mean over devices of |device gradient|. Plus the fp32 rounding of
    # both (2 rho max|g|) and of the stored parameters (2 U32 |p|).
    after4, after1 = _after(s4), _after(s1)
    weights = jax.tree_util.tree_map(lambda p: np.asarray(p, jnp.bfloat16).astype(np.float32),
                                     params)
    # Each row's gradient by the program fp32_gradient_rounding runs on one-row slices below
    # (the same jitted single-device loss and gradients; one compile for both).
    row_grads = jitted(value_and_grad_of(gpt_losses(model)[0]))
    rows = [row_grads(weights, batch[i:i + 1])[1] for i in range(32)]
    rows = [np.stack([np.asarray(x, np.float64) for x in leaf])
            for leaf in zip(*map(jax.tree_util.tree_leaves, rows))]  # per leaf [32, ...]
    rho, (_, g) = fp32_gradient_rounding(model, weights, batch, shards=(8, 32))
    for a, b, r, g_leaf in zip(jax.tree_util.tree_leaves(after4),
                               jax.tree_util.tree_leaves(after1), rows,
                               jax.tree_util.tree_leaves(g)):
        row_mean = np.mean(np.abs(r), axis=0)
        device_mean = np.mean(np.abs(r.reshape(8, 4, *r.shape[1:]).mean(axis=1)), axis=0)
        tol = (8 * U_BF16 * (row_mean + device_mean) + 2 * rho * np.max(np.abs(g_leaf))
               + 2 * U32 * np.abs(b))
        assert np.all(np.abs(a - b) <= tol)
        # 16 bf16 roundings of the contributions can reach a good part of what a micro-batch
        # missing or counted twice moves (a quarter of the update): bf16 admits no bound
        # far below it (0.25-0.7 of it here, the measured error 10% of the bound). It
        # still fails that bug in every leaf.
        assert np.max(tol) < np.max(np.abs(g_leaf)) / 4


def test_micro_batches_must_divide_the_local_batch(setup):
    model, params, _ = setup
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=zpp.ZeroPPConfig.zero3(**FP32))
    with pytest.raises(ValueError, match="micro_batches=3"):
        _step(3)(state, tokens(16, seed=1))  # 2 rows per device
    with pytest.raises(ValueError, match="positive int"):
        _step(0)(state, tokens(16, seed=1))
