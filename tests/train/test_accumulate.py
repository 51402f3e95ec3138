"""Gradient accumulation: k micro-batches equal one large-batch step, with every switch."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.train.accumulate import accumulate_gradients
from zeropp_demo.gpt import GPT, loss_fn

from helpers import SMALL, assert_updates_close, init_params, tokens

FP32 = dict(compute_dtype="float32")


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
    model, params, batch = setup
    mesh = zpp.make_mesh(2, 4)
    cfg = zpp.ZeroPPConfig.zero3(**FP32)
    tx = optax.adam(1e-2, eps=1e-3)  # eps: see test_engine.test_three_adam_steps_equal...
    results = {}
    for k in (1, 4):
        state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=cfg)
        step = _step(k)
        losses = []
        for i in range(2):
            state, m = step(state, tokens(32, seed=40 + i))
            losses.append(float(m["loss"]))
        results[k] = (losses, _after(state))
    for k in (4,):
        # The mean of k equal micro-batch means is the large-batch mean; only the fp32
        # summation order differs (~1e-7 relative), and Adam (eps=1e-3) is Lipschitz in the
        # gradient, so two steps' updates agree to ~1e-5 of their size.
        np.testing.assert_allclose(results[k][0], results[1][0], rtol=1e-6)
        assert_updates_close(results[k][1], results[1][1], params, rel=1e-5, steps=2)


# zeropp turns on qwZ, hpZ and qgZ at once; stages 1 and 2 take the other gradient path.
# zeropp (37 s) runs under `make test-all`, to keep `make test` under ten minutes; stage 1,
# stage 2 and the CLI's ZeRO-3 --accum runs (test_resume.py) stay in `make test`.
@pytest.mark.parametrize("mode", ["stage1", "stage2",
                                  pytest.param("zeropp", marks=pytest.mark.slow)])
def test_accumulation_is_the_mean_of_micro_batch_steps(setup, mode):
    """With every switch, the accumulated step equals the mean of the same step run on each
    micro-batch alone (SGD with lr=1 makes a step's update minus its gradient, so the
    average of the parameters after each is the parameters after the averaged gradient). Quantization happens per micro-batch in both."""
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
    fresh = lambda: start  # noqa: E731

    acc_state, m = _step(k)(fresh(), batch)
    acc = _after(acc_state)
    one = _step(1)
    parts, losses = [], []
    for j in range(k):
        s, mj = one(fresh(), _micro(batch, 8, k, j))
        parts.append(_after(s))
        losses.append(float(mj["loss"]))
    mean = jax.tree_util.tree_map(lambda *xs: np.mean(xs, axis=0), *parts)
    np.testing.assert_allclose(float(m["loss"]), np.mean(losses), rtol=1e-6)
    # fp32 paths (including qwZ/hpZ, whose weights are the same dequantized values in both)
    # agree to summation order. qgZ quantizes each micro-batch's gradient in both runs; the
    # inputs to its quantizer differ only by fp32 rounding, so its output agrees as well
    # unless a value sits on a rounding boundary, which these seeds do not hit.
    assert_updates_close(acc, mean, params, rel=1e-5, steps=1)
    if not cfg.qgz:
        # And without gradient quantization it is the large-batch step itself.
        big, _ = one(fresh(), batch)
        assert_updates_close(acc, _after(big), params, rel=1e-5, steps=1)


def test_bf16_accumulates_in_fp32(setup):
    model, params, batch = setup
    cfg = zpp.ZeroPPConfig.zero3()  # bf16 compute
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(1.0),
                                  mesh=zpp.make_mesh(2, 4), config=cfg)
    lowered = _step(4).lower(state, batch).as_text()
    # The scan's carry holds fp32 shards: the accumulator is not bf16.
    assert "stablehlo.while" in lowered
    s4, _ = _step(4)(state, batch)
    s1, _ = _step(1)(state, batch)
    # bf16 gradients of micro-batches vs of the whole batch: each carries bf16 rounding
    # (2^-8 relative) of its own, so the two agree to a few bf16 ulps of the gradient size.
    assert_updates_close(_after(s4), _after(s1), params, rel=3e-2, steps=1)


def test_micro_batches_must_divide_the_local_batch(setup):
    model, params, _ = setup
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=zpp.ZeroPPConfig.zero3(**FP32))
    with pytest.raises(ValueError, match="micro_batches=3"):
        _step(3)(state, tokens(16, seed=1))  # 2 rows per device
    with pytest.raises(ValueError, match="positive int"):
        _step(0)(state, tokens(16, seed=1))
