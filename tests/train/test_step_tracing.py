"""The step is traced as under ``jax.jit``: constants in loop carries, pmap-era axis names,
collectives on the gradients, and the NNX step of the docs. Values are checked against one
device's ``jax.jit``, both run in float64 (the parity tests' derived tolerance:
tests/helpers.py, ``FLOAT64_RHO``)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import optax.losses._classification as optax_ctc

import zeropp_jax as zpp
from helpers import (FLOAT64, FLOAT64_RHO, as_float64, assert_loss_and_grads_close,
                     float64_run, fresh_seed, seed_on_failure)

AXES = ("node", "local")
FP32 = zpp.ZeroPPConfig(compute_dtype="float32")


@pytest.fixture(scope="module")
def mesh():
    return zpp.make_mesh(nodes=2, local=4)


class Frames(nn.Module):
    """Per-frame logits over 5 labels (blank = 0), as a CTC acoustic model emits."""

    @nn.compact
    def __call__(self, x):
        return nn.Dense(5)(jnp.tanh(nn.Dense(16)(x)))


def _ctc(logits, labels):
    # optax.ctc_loss runs a lax.scan whose carry starts from constants.
    pad = jnp.zeros(logits.shape[:2], logits.dtype)
    return optax.ctc_loss(logits, pad, labels, jnp.zeros(labels.shape, logits.dtype)).mean()


@pytest.mark.parametrize("stage", [3, 1])
def test_scan_with_a_constant_carry_trains_as_under_jit(mesh, stage):
    """``optax.ctc_loss`` (a scan whose carry starts from constants) inside the step: under
    shard_map's replication typing it raised "carry input and carry output must have equal
    types"; here it runs, and loss and gradients equal one device's ``jax.jit``."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    batch = {"x": rng.standard_normal((16, 6, 4)),
             "y": rng.integers(1, 5, (16, 3)).astype(np.int32)}
    model = Frames()
    params = as_float64(model.init(jax.random.key(seed + 1), batch["x"][:1])["params"])

    @zpp.train_step
    def step(state, batch):
        def loss(p):
            return _ctc(state.apply_fn({"params": p}, batch["x"]), batch["y"])

        value, g = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=g), {"loss": value, "grads": g}

    def loss_of(p, b):
        return _ctc(model.apply({"params": p}, b["x"]), b["y"])

    # Both sides in float64; only the summation order differs (8 row slices vs one batch).
    # optax's CTC casts a mask to fp32 itself: read as float64 too (float64_run).
    with float64_run(optax_ctc):
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1), mesh=mesh,
                                      config=zpp.ZeroPPConfig(stage=stage, **FLOAT64))
        _, out = step(state, batch)
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_of))(params, batch)
    with seed_on_failure(seed):
        if stage == 3:  # primary shards of the mean gradient
            grads = state.engine.consolidate(out["grads"])
            assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads, FLOAT64_RHO)
        else:  # stage 1's in-step gradients are each device's own: the loss is the check
            np.testing.assert_allclose(out["loss"], ref_loss, rtol=2 * FLOAT64_RHO)


class SyncBN(nn.Module):
    axis: object = "batch"

    @nn.compact
    def __call__(self, x):
        x = nn.BatchNorm(use_running_average=False, axis_name=self.axis)(nn.Dense(8)(x))
        return nn.Dense(2)(nn.relu(x))


def _bn_step(axis_name=None, reduce_grads=None):
    @zpp.train_step(axis_name=axis_name)
    def step(state, x):
        def loss(p):
            y, upd = state.apply_fn({"params": p, **state.collections}, x,
                                    mutable=["batch_stats"])
            return jnp.mean(y ** 2), upd

        (value, upd), g = jax.value_and_grad(loss, has_aux=True)(state.params)
        if reduce_grads is not None:
            g = reduce_grads(g)
        # pmap-era metrics: a pmean over the step's own name.
        return (state.apply_gradients(grads=g, **upd),
                {"loss": jax.lax.pmean(value, axis_name or AXES)})

    return step


def test_pmap_era_axis_name_binds_to_the_data_parallel_axes(mesh):
    """``nn.BatchNorm(axis_name="batch")`` (Flax's ImageNet example) under
    ``train_step(axis_name="batch")`` is the same program as the model written with the
    data-parallel axes: bit-identical parameters, statistics and loss."""
    seed = fresh_seed()
    x = np.random.default_rng(seed).standard_normal((16, 3)).astype(np.float32)
    variables = SyncBN().init(jax.random.key(seed + 1), x)

    def run(model, axis_name):
        state = zpp.TrainState.create(model=model, params=variables, tx=optax.sgd(0.1),
                                      mesh=mesh, config=FP32)
        new, out = _bn_step(axis_name)(state, x)
        return jax.device_get((new.consolidate(), new.collections, out))

    bound = run(SyncBN("batch"), "batch")
    named = run(SyncBN(AXES), None)
    local = run(SyncBN(None), None)
    with seed_on_failure(seed):
        jax.tree_util.tree_map(np.testing.assert_array_equal, bound, named)
        # A per-device BatchNorm (no axis) differs: the binding is not a no-op.
        assert abs(float(bound[2]["loss"]) - float(local[2]["loss"])) > 1e-3 * abs(
            float(bound[2]["loss"]))


def test_an_unbound_axis_name_says_what_the_axes_are(mesh):
    x = np.ones((16, 3), np.float32)
    state = zpp.TrainState.create(model=SyncBN("batch"),
                                  params=SyncBN("batch").init(jax.random.key(0), x),
                                  tx=optax.sgd(0.1), mesh=mesh)
    with pytest.raises(ValueError, match=r"\('node', 'local'\).*axis_name='batch'"):
        _bn_step()(state, x)
    with pytest.raises(ValueError, match="strings other than"):
        _bn_step(axis_name="node")(state, x)


@pytest.mark.parametrize("axis_name, reduce", [
    (None, lambda g: jax.lax.pmean(g, AXES)),
    ("batch", lambda g: jax.lax.pmean(g, "batch")),
    (None, lambda g: jax.tree_util.tree_map(lambda s: jax.lax.psum(2.0 * s, "local"), g)),
])
def test_a_collective_on_zero3_gradients_is_refused(bn_states, axis_name, reduce):
    """The gradients of a ZeRO-3 step are already averaged shards: a pmap-era
    ``lax.pmean(grads, ...)`` (or any collective over devices on values computed from
    them) would mix shards; the step refuses it. The library's own (``global_norm``,
    ``apply_gradients``) pass, and stage 1's local gradients may be averaged."""
    state, stage1, x = bn_states
    with pytest.raises(ValueError, match="already the mean over all devices"):
        _bn_step(axis_name, reduce)(state, x)
    _global_norm_step(axis_name)(state, x)
    _bn_step(axis_name, reduce)(stage1, x)


@pytest.fixture(scope="module")
def bn_states(mesh):
    """A ZeRO-3 and a stage-1 state of ``SyncBN(AXES)``, shared by the parametrizations
    above (the steps never donate them), and the input."""
    x = np.ones((16, 3), np.float32)
    variables = SyncBN(AXES).init(jax.random.key(0), x)
    state = zpp.TrainState.create(model=SyncBN(AXES), params=variables, tx=optax.sgd(0.1),
                                  mesh=mesh)
    stage1 = zpp.TrainState.create(model=SyncBN(AXES), params=variables, tx=optax.sgd(0.1),
                                   mesh=mesh, config=zpp.ZeroPPConfig(stage=1))
    return state, stage1, x


@functools.lru_cache(maxsize=None)
def _global_norm_step(axis_name):
    """The step that calls the library's own global_norm on the gradients: one per axis
    name, so parametrizations with the same name reuse its compiled program."""
    return _bn_step(axis_name, lambda g: (zpp.global_norm(g), g)[1])


class ParamsOnly(nnx.Module):
    def __init__(self, rngs, param_dtype=jnp.float32):
        self.a = nnx.Linear(3, 8, param_dtype=param_dtype, rngs=rngs)
        self.b = nnx.Linear(8, 2, param_dtype=param_dtype, rngs=rngs)

    def __call__(self, x):
        return self.b(jax.nn.relu(self.a(x)))


def test_the_documented_nnx_step_runs_for_a_model_with_only_parameters(mesh):
    """The docs' NNX step spreads ``**state.collections`` and asks ``mutable=True``: with
    nothing but parameters, ``state.collections`` is an empty dict, not None."""
    seed = fresh_seed()
    x = np.random.default_rng(seed).standard_normal((16, 3))

    @zpp.train_step
    def step(state, x):
        def loss(p):
            y, updates = state.apply_fn({"params": p, **state.collections}, x, mutable=True)
            return jnp.mean(y ** 2), updates

        (value, updates), g = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=g, **updates), value

    def loss_of(p, x):
        return jnp.mean(nnx.merge(graphdef, p)(x) ** 2)

    # The value against one device's, both in float64 (NNX makes float64 parameters only
    # with x64 on: the model is built inside).
    with float64_run():
        model = ParamsOnly(nnx.Rngs(seed + 1), param_dtype=jnp.float64)
        ref = nnx.clone(model)
        state = zpp.TrainState.create(model=model, params=None, tx=optax.sgd(0.1), mesh=mesh,
                                      config=zpp.ZeroPPConfig(**FLOAT64))
        assert state.collections == {}
        _, value = step(state, x)
        graphdef, params = nnx.split(ref, nnx.Param)
        ref_value = jax.jit(loss_of)(params, x)
    with seed_on_failure(seed):
        np.testing.assert_allclose(value, ref_value, rtol=2 * FLOAT64_RHO)
