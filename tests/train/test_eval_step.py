"""``zpp.eval_step``: metrics and per-example outputs of a sharded state, for linen and NNX
models, on several meshes and configs; what fails outside a step says what to use. The
parity tests run both sides in float64 (the derived tolerance: tests/helpers.py,
``FLOAT64_RHO``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT, loss_fn

from helpers import (FLOAT64, FLOAT64_RHO, SMALL, SMALL64, U64, as_float64, dequantized_params,
                     float64_run, fresh_seed, init_params, jitted, seed_on_failure, tokens)

FP32 = zpp.ZeroPPConfig(compute_dtype="float32")


@zpp.eval_step
def gpt_eval(state, batch):
    logits = state.apply_fn({"params": state.params}, batch[:, :-1])
    per_row = jax.vmap(loss_fn)(logits[:, None], batch[:, None, 1:])
    return {"loss": loss_fn(logits, batch[:, 1:]),
            "logits": zpp.per_example(logits), "per_row": zpp.per_example(per_row)}


def _off_fp32_grid(params, seed: int):
    """``params`` in float64, moved off the fp32 grid by a float64 perturbation of ~1e-3:
    an evaluation updates nothing, so weights that are fp32 values would pass through a
    silent cast to fp32 in the library unchanged."""
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(lambda x: x + 1e-3 * rng.standard_normal(x.shape),
                                  as_float64(params))


def _params64(seed: int) -> dict:
    """The test GPT's parameters at ``seed``, in float64 off the fp32 grid."""
    return _off_fp32_grid(init_params(seed=seed), seed + 2)


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


# The configs as keyword arguments: a float64 config is built inside ``float64_run()``.
@pytest.mark.parametrize("shape, config", [
    ((2, 4), {}),
    ((8, 1), {}),
    ((2, 4), {"stage": 1}),
])
def test_eval_step_equals_one_device(shape, config):
    """The mean loss and the per-example logits of the global batch, in batch order, equal
    one device's within the derived float64 rounding of both (``FLOAT64_RHO`` each)."""
    seed = fresh_seed()
    model, params = GPT(SMALL64), _params64(seed)
    batch = tokens(16, seed=seed + 1)
    with float64_run():
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(*shape),
                                      config=zpp.ZeroPPConfig(**config, **FLOAT64))
        out = gpt_eval(state, batch)
        loss, logits = jitted(_outputs(model))(params, batch)
    assert out["logits"].shape == (16, SMALL.seq_len, SMALL.vocab_size)
    assert out["per_row"].shape == (16,)
    loss, logits = float(loss), np.asarray(logits)
    tol = 2 * FLOAT64_RHO
    with seed_on_failure(seed):
        np.testing.assert_allclose(out["loss"], loss, rtol=tol)
        np.testing.assert_allclose(out["logits"], logits, atol=tol * np.max(np.abs(logits)))
        # The mean of the 16 per-row losses: their rounding, plus 16 unit roundoffs of the
        # sum.
        np.testing.assert_allclose(np.mean(np.asarray(out["per_row"])), loss,
                                   rtol=tol + 2 * 16 * U64)


def test_eval_step_under_zeropp_reads_the_quantized_weights():
    """With qwZ + hpZ the forward sees the INT8-dequantized weights, as a training step
    does: the per-example logits are those at the dequantized weights (within the derived
    float64 rounding of both runs), and far from those at the master weights (the loss of a
    fresh model is too flat in the weights to tell them apart; its logits are not). Float64
    master weights quantize to INT8 with fp32 scales as fp32 ones do; the dequantized
    weights (INT8 times an fp32 scale, computed in fp32) are float64 values, and the
    forward at them runs in float64 on both sides."""
    seed = fresh_seed()
    model, params = GPT(SMALL64), _params64(seed)
    batch = tokens(16, seed=seed + 1)
    with float64_run():
        config = zpp.ZeroPPConfig.zeropp(**FLOAT64)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 4), config=config)
        # The float64 master shards through the same INT8 round trip the step makes.
        deq = as_float64(dequantized_params(state, config.block_size, config.weight_bits))
        run = jitted(_logits_of(model))
        exact = np.asarray(run(deq, batch))
        got = np.asarray(gpt_eval(state, batch)["logits"], np.float64)
        master = np.asarray(run(params, batch), np.float64)
    tol = 2 * FLOAT64_RHO * np.max(np.abs(exact))
    with seed_on_failure(seed):
        assert np.max(np.abs(got - exact)) <= tol
        assert np.max(np.abs(got - master)) > 100 * tol


class Net(nnx.Module):
    def __init__(self, rngs, param_dtype=jnp.float32):
        self.a = nnx.Linear(4, 16, param_dtype=param_dtype, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.b = nnx.Linear(16, 3, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.b(self.drop(jax.nn.relu(self.a(x))))


def test_eval_step_for_an_nnx_model_in_eval_mode():
    seed = fresh_seed()
    x = np.random.default_rng(seed + 1).standard_normal((16, 4))  # float64
    with float64_run():
        model = Net(nnx.Rngs(seed), param_dtype=jnp.float64)
        ref = nnx.clone(model)
        ref.eval()
        state = zpp.TrainState.create(model=model, params=None, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig(**FLOAT64))

    @zpp.eval_step
    def evaluate(state, x):
        def run(m, x):
            m.eval()  # no dropout
            return m(x)

        y = state.apply_fn({"params": state.params, **state.collections}, x, method=run)
        return state, {"out": zpp.per_example(y), "mean": jnp.mean(y)}

    graphdef, params, rest = nnx.split(ref, nnx.Param, ...)

    def outputs(p, x):
        y = nnx.merge(graphdef, p, rest)(x)
        return y, jnp.mean(y)

    with float64_run():
        same, out = evaluate(state, x)
        # One device in eval mode (no dropout), float64 as the step.
        expected, mean = jax.jit(outputs)(params, x)
    assert int(same.step) == int(state.step)
    expected, mean = np.asarray(expected), float(mean)
    # Each output within the derived float64 rounding of both runs (running_error_bound:
    # kappa ~1e3 unit roundoffs for this net, FLOAT64_RHO allows 9e6).
    tol = 2 * FLOAT64_RHO
    with seed_on_failure(seed):
        np.testing.assert_allclose(out["out"], expected, atol=tol * np.max(np.abs(expected)))
        # The mean sums n = 16 x 3 outputs in another order (per device, then over
        # devices): each evaluation's summation rounds by at most n unit roundoffs of the
        # largest term, on top of the terms' own rounding.
        n = expected.size
        np.testing.assert_allclose(out["mean"], mean,
                                   atol=(tol + 2 * n * U64) * np.max(np.abs(expected)))


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
    train=False)``): the eval loss equals one device's, both in float64 (the zoo's GPT-2
    rebuilt with ``dtype=jnp.float64``, its parameters float64 values), within the derived
    float64 rounding of both (``FLOAT64_RHO`` each)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "FlaxPreTrainedModel"):
        pytest.skip(f"transformers {transformers.__version__} has no Flax models")
    import zoo

    seed = fresh_seed()
    with zoo.hf_compat():
        entry = zoo.get("hf_gpt2")
        batch = entry.make_batch(np.random.default_rng(seed), 16)
        params = _off_fp32_grid(entry.params, seed + 1)
        with float64_run():
            # As zoo._hf_entry builds it, in float64, its parameters given (no init).
            model = type(entry.model)(entry.model.config, input_shape=(1, zoo.SEQ),
                                      dtype=jnp.float64, _do_init=False)
            model._is_initialized = True
            model.params = params
            state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                          mesh=zpp.make_mesh(2, 4),
                                          config=zpp.ZeroPPConfig(**FLOAT64))

            @zpp.eval_step
            def evaluate(state, batch):
                return entry.loss(state.apply_fn, state.params, batch, False)

            got = float(evaluate(state, batch))
            # One device's loss, jitted (op by op it compiles ~170 small programs).
            ref = float(jax.jit(lambda p, b: entry.loss(model.__call__, p, b, False))(
                params, batch))
    with seed_on_failure(seed):
        np.testing.assert_allclose(got, ref, rtol=2 * FLOAT64_RHO)


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
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
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
    with seed_on_failure(seed):
        for step, out in got.items():
            for name, want in expected.items():
                assert float(out[name]) == want, (step, name, out[name], want)
                assert out[name].dtype == jnp.float32, (step, name, out[name].dtype)
            assert out["loss"].dtype == jnp.float32
