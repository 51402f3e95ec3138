"""``zpp.eval_step``: metrics and per-example outputs of a sharded state, for linen and NNX
models, on several meshes and configs; what fails outside a step says what to use."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zeropp_demo.gpt as gpt
import zeropp_jax as zpp
from zeropp_demo.gpt import GPT, loss_fn

from helpers import SMALL, dequantized_params, init_params, jitted, rounding_of, tokens

FP32 = zpp.ZeroPPConfig(compute_dtype="float32")


def _seed() -> int:
    return int(np.random.default_rng().integers(1 << 30))


@zpp.eval_step
def gpt_eval(state, batch):
    logits = state.apply_fn({"params": state.params}, batch[:, :-1])
    per_row = jax.vmap(loss_fn)(logits[:, None], batch[:, None, 1:])
    return {"loss": loss_fn(logits, batch[:, 1:]),
            "logits": zpp.per_example(logits), "per_row": zpp.per_example(per_row)}


@functools.lru_cache(maxsize=None)
def _outputs(m):
    """The loss and logits of model ``m`` on one device; one function per model (flax modules
    hash by their fields), so each parametrization reuses the references' compiled programs
    (the parameters are arguments, drawn afresh by each)."""
    def run(p, b):
        logits = m.apply({"params": p}, b[:, :-1])
        return loss_fn(logits, b[:, 1:]), logits
    return run


@functools.lru_cache(maxsize=None)
def _logits_of(m):
    return lambda p, b: m.apply({"params": p}, b[:, :-1])


@pytest.mark.parametrize("shape, config", [
    ((2, 4), FP32),
    ((8, 1), FP32),
    ((2, 4), zpp.ZeroPPConfig(stage=1, compute_dtype="float32")),
])
def test_eval_step_equals_one_device(shape, config):
    """The mean loss and the per-example logits of the global batch, in batch order, equal
    one device's within fp32 rounding (measured against float64 for these outputs)."""
    model, params = GPT(SMALL), init_params(seed=_seed() % 1000)
    batch = tokens(16, seed=_seed())
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(*shape), config=config)
    out = gpt_eval(state, batch)
    assert out["logits"].shape == (16, SMALL.seq_len, SMALL.vocab_size)
    assert out["per_row"].shape == (16,)

    run = jitted(_outputs(model))

    def sliced():  # the order the step sums in: 8 slices of 2 rows, then their mean
        parts = [run(params, batch[2 * i:2 * i + 2]) for i in range(8)]
        return (np.mean(np.stack([p[0] for p in parts]), dtype=np.float32),
                np.concatenate([p[1] for p in parts]))

    # The demo GPT's float64 twin, with its explicit fp32 casts widened, is the reference;
    # rho covers both summation orders.
    rounding = rounding_of(_outputs(model), params, batch,
                           fn64=_outputs(GPT(dataclasses.replace(SMALL, dtype="float64"))),
                           widen=(gpt,), orders=[sliced])
    loss, logits = rounding.exact
    tol = 2 * rounding.rho
    np.testing.assert_allclose(out["loss"], loss, rtol=tol)
    np.testing.assert_allclose(out["logits"], logits, atol=tol * np.max(np.abs(logits)))
    # The mean of the 16 per-row losses: their rounding, plus 16 unit roundoffs of the sum.
    unit = float(jnp.finfo(jnp.float32).eps) / 2
    np.testing.assert_allclose(np.mean(out["per_row"]), loss, rtol=tol + 2 * 16 * unit)


def test_eval_step_under_zeropp_reads_the_quantized_weights():
    """With qwZ + hpZ the forward sees the INT8-dequantized weights, as a training step
    does: the per-example logits are those at the dequantized weights (within fp32
    rounding), and far from those at the fp32 master weights (the loss of a fresh model is
    too flat in the weights to tell them apart; its logits are not)."""
    model, params = GPT(SMALL), init_params(seed=_seed() % 1000)
    batch = tokens(16, seed=_seed())
    config = zpp.ZeroPPConfig.zeropp(compute_dtype="float32")
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=config)
    deq = dequantized_params(state, config.block_size, config.weight_bits)
    run = jitted(_logits_of(model))

    def sliced():  # the order the step computes in: 8 devices of 2 rows each
        return np.concatenate([run(deq, batch[2 * i:2 * i + 2]) for i in range(8)])

    # rho covers both orders: the whole batch's alone once missed the sharded step's
    # rounding by 1% (a maximum over 16 x seq x vocab logits is a noisy statistic).
    rounding = rounding_of(_logits_of(model), deq, batch,
                           fn64=_logits_of(GPT(dataclasses.replace(SMALL, dtype="float64"))),
                           widen=(gpt,), orders=[sliced])
    got = np.asarray(gpt_eval(state, batch)["logits"], np.float64)
    tol = 2 * rounding.rho * np.max(np.abs(rounding.exact))
    assert np.max(np.abs(got - rounding.exact)) <= tol
    # Jitted: the program rounding_of compiled for the dequantized weights (same shapes).
    master = np.asarray(run(params, batch), np.float64)
    assert np.max(np.abs(got - master)) > 100 * tol


class Net(nnx.Module):
    def __init__(self, rngs):
        self.a = nnx.Linear(4, 16, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.b = nnx.Linear(16, 3, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(jax.nn.relu(self.a(x))))


def test_eval_step_for_an_nnx_model_in_eval_mode():
    model = Net(nnx.Rngs(_seed()))
    ref = nnx.clone(model)
    ref.eval()
    state = zpp.TrainState.create(model=model, params=None, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=FP32)
    x = np.random.default_rng(_seed()).standard_normal((16, 4)).astype(np.float32)

    @zpp.eval_step
    def evaluate(state, x):
        def run(m, x):
            m.eval()  # no dropout
            return m(x)

        y = state.apply_fn({"params": state.params, **state.collections}, x, method=run)
        return state, {"out": zpp.per_example(y), "mean": jnp.mean(y)}

    same, out = evaluate(state, x)
    assert int(same.step) == int(state.step)
    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)

    def outputs(p, x):
        y = nnx.merge(graphdef, p, rest)(x)
        return y, jnp.mean(y)

    # One device in eval mode (no dropout), each output within its fp32 rounding.
    rounding = rounding_of(outputs, params, x)
    expected, mean = rounding.exact
    tol = 2 * rounding.rho
    np.testing.assert_allclose(out["out"], expected, atol=tol * np.max(np.abs(expected)))
    # The mean sums n = 16 x 3 outputs in another order (per device, then over devices):
    # each evaluation's summation rounds by at most n unit roundoffs of the largest term,
    # on top of the terms' own rounding.
    n, unit = expected.size, float(jnp.finfo(jnp.float32).eps) / 2
    np.testing.assert_allclose(out["mean"], mean,
                               atol=(tol + 2 * n * unit) * np.max(np.abs(expected)))


def test_eval_step_refuses_an_update_and_apply_fn_outside_a_step_names_it():
    model, params = GPT(SMALL), init_params(seed=0)
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4))
    batch = tokens(8, seed=0)

    @zpp.eval_step
    def updates(state, batch):
        def loss(p):
            return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        return state.apply_gradients(grads=jax.grad(loss)(state.params)), {}

    with pytest.raises(ValueError, match="train_step to train"):
        updates(state, batch)
    with pytest.raises(RuntimeError, match="eval_step"):
        state.apply_fn({"params": state.params}, batch[:, :-1])


def test_eval_step_for_a_transformers_model():
    """transformers' Flax GPT-2 called in its own style (``apply_fn(**inputs, params=...,
    train=False)``): the eval loss equals one device's. Tolerance: the zoo's (transformers'
    Flax models fix their dtype to fp32, so there is no float64 reference; the two orders of
    summing 16 rows' losses differ by ~1e-7 of a loss of ~4; 1e-5 as in test_zoo)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxPreTrainedModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    import zoo

    with zoo.hf_compat():
        entry = zoo.get("hf_gpt2")
        batch = entry.make_batch(np.random.default_rng(_seed()), 16)
        state = zpp.TrainState.create(model=entry.model, params=entry.params,
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
                                      config=FP32)

        @zpp.eval_step
        def evaluate(state, batch):
            return entry.loss(state.apply_fn, state.params, batch, False)

        # One device's loss, jitted (op by op it compiles ~170 small programs).
        ref = jax.jit(lambda p, b: entry.loss(entry.apply, p, b, False))(entry.params, batch)
        np.testing.assert_allclose(evaluate(state, batch), ref, rtol=1e-5)


class _Tiny(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(3)(x)


@pytest.mark.filterwarnings("ignore:unit 'Dense_0' holds 100%")  # one unit is enough here
def test_integer_and_bool_metrics_are_averaged_in_float32_by_both_steps():
    """A count (int32) and a flag (bool) differ from device to device: both steps return
    each as the float32 mean over devices, as ``lax.pmean`` does to an int, not one
    device's value. Exact: the means of counts below 2**24 over 8 devices are exact in
    float32 (a sum of small ints, divided by a power of 2)."""
    rng = np.random.default_rng(_seed())
    x = rng.standard_normal((16, 4)).astype(np.float32)
    mask = rng.random((16, 5)) < 0.5  # e.g. which tokens are real: 0 to 10 per device
    model = _Tiny()
    params = model.init(jax.random.PRNGKey(0), x[:1])["params"]
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=FP32)

    def metrics(state, batch):
        logits = state.apply_fn({"params": state.params}, batch["x"])
        return {"loss": jnp.mean(logits ** 2),
                "tokens": jnp.sum(batch["mask"], dtype=jnp.int32),
                "all_real": jnp.all(batch["mask"])}

    # Device d holds rows 2d and 2d + 1 (the batch split over 8 devices, in order).
    per_device = mask.reshape(8, -1)
    expected = {"tokens": per_device.sum(1).mean(), "all_real": per_device.all(1).mean()}
    got = {"eval_step": zpp.eval_step(metrics)(state, {"x": x, "mask": mask}),
           "train_step": zpp.train_step(lambda s, b: (s, metrics(s, b)))(
               state, {"x": x, "mask": mask})[1]}
    for step, out in got.items():
        for name, want in expected.items():
            assert float(out[name]) == want, (step, name, out[name], want)
            assert out[name].dtype == jnp.float32, (step, name, out[name].dtype)
        assert out["loss"].dtype == jnp.float32
