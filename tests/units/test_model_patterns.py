"""Mechanisms real models need: weights read outside their unit's call, modules passed to
units as attributes, mutable collections in checkpoints, exact token-weighted losses, fp32
metrics, and the errors that replace silent wrong training.

Models are tiny; parity is against a one-device step with SGD, both in float64 (exact
arithmetic path: only the order of the sum over devices differs, so the runs agree to the
derived float64 rounding ``FLOAT64_RHO``, carried through the SGD steps: tests/helpers.py).
The BatchNorm test stays in fp32, within a bound derived from its operations
(tests/running_error.py)."""

from __future__ import annotations

import functools
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeropp_jax as zpp

from helpers import (FLOAT64, FLOAT64_RHO, U64, as_float64, assert_far_below_updates,
                     assert_rounding_close, assert_training_close, float64_run, fresh_seed,
                     jitted, leaf_scales, momentum_sensitivity, seed_on_failure,
                     trajectory_tolerances, value_and_grad_of)
from running_error import assert_within, running_error_bound

FP32 = zpp.ZeroPPConfig(compute_dtype="float32")


@pytest.fixture(scope="module")
def mesh():
    return zpp.make_mesh(nodes=2, local=4)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x + nn.Dense(16)(jnp.tanh(nn.Dense(16)(x)))


class TiedLM(nn.Module):
    """HF-style tied head: the root reads the embedding through ``.variables``."""

    def setup(self):
        self.wte = nn.Embed(48, 16)
        self.blocks = [Block(name=f"block_{i}") for i in range(2)]

    def __call__(self, ids):
        x = self.wte(ids)
        for b in self.blocks:
            x = b(x)
        return x @ self.wte.variables["params"]["embedding"].T


class Encoder(nn.Module):
    embed: nn.Module

    @nn.compact
    def __call__(self, ids):
        return Block()(self.embed(ids))


class Decoder(nn.Module):
    embed: nn.Module

    @nn.compact
    def __call__(self, ids, memory):
        x = Block()(self.embed(ids) + memory.mean(1, keepdims=True))
        return self.embed.attend(x)


class Seq2Seq(nn.Module):
    """Flax wmt-style: one Embed, passed to encoder and decoder as an attribute."""

    def setup(self):
        self.shared = nn.Embed(48, 16)
        self.encoder = Encoder(self.shared)
        self.decoder = Decoder(self.shared)

    def __call__(self, ids):
        return self.decoder(ids[:, ::-1], self.encoder(ids))


def _ids(seed, shape=(8, 7)):
    return np.random.default_rng(seed).integers(0, 48, shape).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("method", "train"))
def _init(model, key, *args, **kwargs):
    """``model.init(key, *args, **kwargs)`` as one program: flax's init run eagerly compiles
    a program per operation and shape. One program per model and argument shapes (linen
    modules hash by their fields), whatever the key."""
    return model.init(key, *args, **kwargs)


def _tied_params(seed):
    """TiedLM's parameters from ``PRNGKey(seed)``. Initialized on ``[8, 6]`` tokens for
    every test (one init program): its parameters do not depend on the sequence length."""
    return _init(TiedLM(), jax.random.PRNGKey(seed), _ids(0)[:, :-1])["params"]


def _token_losses(apply, params, ids):
    """Next-token cross entropy of every position, ``[batch, seq]``."""
    logits = apply({"params": params}, ids[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, ids[:, 1:])


def _lm_loss(apply, params, ids):
    return _token_losses(apply, params, ids).mean()


@functools.lru_cache(maxsize=None)
def _reference_loss(model, loss):
    """``loss`` of the one-device ``model.apply`` as ``(params, batch) -> scalar``, one
    function object per model and loss: the reference gradients (helpers.jitted and
    value_and_grad_of, keyed by the function) then share their traced and compiled
    programs, within a call and across calls."""
    return lambda p, b: loss(model.apply, p, b)


def _train_both(model, params, mesh, loss, batches, units=None, lr=0.1):
    """Losses and final params of zeropp (SGD) and of one device, side by side, both in
    float64 (``params`` widened; the linen models here compute in their parameters' dtype);
    checks that they agree to the derived float64 rounding (``FLOAT64_RHO``), carried
    through the SGD steps (helpers.trajectory_tolerances)."""
    params = as_float64(params)

    @zpp.train_step
    def step(state, batch):
        value, grads = jax.value_and_grad(lambda p: loss(state.apply_fn, p, batch))(
            state.params)
        return state.apply_gradients(grads=grads), value

    ref_grad = jitted(value_and_grad_of(_reference_loss(model, loss)))
    ours, theirs, grads, p = [], [], [], params
    with float64_run():
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(lr),
                                      mesh=mesh, config=zpp.ZeroPPConfig(**FLOAT64),
                                      units=units)
        for batch in batches:
            state, value = step(state, batch)
            ours.append(float(value))
            value, g = ref_grad(p, batch)
            theirs.append(float(value))
            grads.append(g)
            # float64 numpy: optax.sgd's roundings (p + (-lr g)), without an eager program
            # per leaf shape
            p = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - lr * np.asarray(b), p, g)
    rho = FLOAT64_RHO
    tols = trajectory_tolerances(p, grads[0], rho=rho, lr=lr, steps=len(batches),
                                 sensitivity=momentum_sensitivity())
    assert_training_close(ours, state.consolidate(), theirs, p, grads, tols, rho, start=params)
    return state, ours, theirs, p


def _max_diff(a, b):
    return max(float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
               for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def _with_fresh_seed(body):
    """``body(mesh, seed)`` as a test on inputs drawn from a fresh seed, named in any
    failure (the body alone, for a run over many seeds)."""

    def test(mesh):
        seed = fresh_seed()
        with seed_on_failure(seed):
            body(mesh, seed)

    # (not functools.wraps: pytest would read the body's signature and look for a fixture
    # named seed)
    test.__name__, test.__qualname__, test.__doc__ = body.__name__, body.__qualname__, body.__doc__
    test.body = body
    return test


@_with_fresh_seed
def test_weights_read_through_variables_stay_gathered_and_are_exact(mesh, seed):
    model = TiedLM()
    params = _tied_params(seed)
    # wte as its own unit: the root reads it outside wte's call, so it must be resident.
    with pytest.warns(UserWarning, match=r"\['wte'\] are read outside their own calls"):
        _train_both(model, params, mesh, _lm_loss, [_ids(seed + 1), _ids(seed + 2)],
                    units=["wte", "block_*"])


@_with_fresh_seed
def test_module_passed_to_units_as_attribute(mesh, seed):
    model = Seq2Seq()
    ids = _ids(seed)
    params = _init(model, jax.random.PRNGKey(seed), ids)["params"]

    def loss(apply, p, batch):
        logits = apply({"params": p}, batch)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch).mean()

    # encoder and decoder are units that use `shared` (owned by the root): the shared
    # weights come in as arguments, their gradient is the sum of three uses.
    with pytest.warns(UserWarning, match=r"\['shared'\] are read outside"):
        _train_both(model, params, mesh, loss, [ids, _ids(seed + 1)],
                    units=["encoder", "decoder", "shared"])
    # The default policy: the Embed is its own unit, called (and attend-ed) from inside
    # the encoder and decoder; no warning, same result.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _train_both(model, params, mesh, loss, [ids])


def test_parameters_never_reached_is_an_error(mesh):
    class Unused(nn.Module):
        def setup(self):
            self.dense = nn.Dense(4)

        def project(self, x):
            return self.dense(x)

        def __call__(self, x):
            return x * 2.0  # never touches its weights

    model = Unused()
    x = np.ones((8, 3), np.float32)
    params = _init(model, jax.random.PRNGKey(0), x, method=Unused.project)["params"]
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1), mesh=mesh,
                                  config=FP32)

    @zpp.train_step
    def step(state, x):
        g = jax.grad(lambda p: state.apply_fn({"params": p}, x).sum())(state.params)
        return state.apply_gradients(grads=g)

    with pytest.raises(ValueError, match="used none of its parameters"):
        step(state, x)


class BNNet(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        for i in range(2):
            y = nn.Dense(8, name=f"dense_{i}")(x)
            x = nn.relu(nn.BatchNorm(use_running_average=not train,
                                     axis_name=("node", "local"), name=f"bn_{i}")(y))
        return nn.Dense(3)(x)


def test_batch_stats_sync_batchnorm_parity_and_checkpoint(mesh, tmp_path):
    """BatchNorm with axis_name over the mesh computes global batch statistics, so
    training equals one device on the whole batch; batch_stats ride in the checkpoint."""
    seed = fresh_seed()  # fresh inputs
    with seed_on_failure(seed):
        _batchnorm_parity(mesh, tmp_path, seed)


def _batchnorm_parity(mesh, tmp_path, seed) -> float:
    """The test above on inputs drawn from ``seed``; returns the largest error of the
    8-device run over its derived rounding bound."""
    model = BNNet()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 5)).astype(np.float32)
    y = rng.integers(0, 3, (16,)).astype(np.int32)
    # (init with train=False: no cross-device statistics are needed outside shard_map)
    variables = _init(model, jax.random.PRNGKey(seed), x, train=False)
    state = zpp.TrainState.create(model=model, params=variables, tx=optax.sgd(0.1),
                                  mesh=mesh, config=FP32)
    assert set(state.collections) == {"batch_stats"}

    def loss(apply, p, stats, train, x=x, y=y):
        out, upd = apply({"params": p, "batch_stats": stats}, x, train=True,
                         mutable=["batch_stats"]) if train else (
            apply({"params": p, "batch_stats": stats}, x, train=False), None)
        return optax.softmax_cross_entropy_with_integer_labels(out, y).mean(), upd

    @zpp.train_step
    def step(state, batch):
        (value, upd), g = jax.value_and_grad(
            lambda p: loss(state.apply_fn, p, state.batch_stats, True), has_aux=True)(
                state.params)
        return state.apply_gradients(grads=g, batch_stats=upd["batch_stats"]), value

    class Plain(nn.Module):  # the same network without the cross-device axis
        @nn.compact
        def __call__(self, x, train):
            for i in range(2):
                y = nn.Dense(8, name=f"dense_{i}")(x)
                x = nn.relu(nn.BatchNorm(use_running_average=not train,
                                         name=f"bn_{i}")(y))
            return nn.Dense(3)(x)

    plain = Plain()

    def sgd_step(p, stats, x, y):
        """One SGD step on one device (in the dtype of the arguments)."""
        (value, upd), g = jax.value_and_grad(
            lambda p: loss(plain.apply, p, stats, True, x, y), has_aux=True)(p)
        return value, jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, p, g), upd["batch_stats"]

    values = []
    for _ in range(2):
        state, value = step(state, {"x": x})
        values.append(value)
    # The 8-device run within a rounding bound derived from the reference's operations
    # (tests/running_error.py): per element, from the magnitudes of the terms each sum
    # adds, not of the result. A rho measured on one device's order was no
    # bound here: the first BatchNorm's bias is a sum of gradient terms that cancel to ~1e-2
    # of them, and the sharded step's order rounded it 1.56x beyond 2 rho on a fresh seed.
    # The step does the reference's operations with its sums split over devices
    # (BatchNorm's statistics: means over 2 rows, then over 8 devices; a gradient: partial
    # sums reduce-scattered), exact scalings by powers of 2 apart, so the bound holds for
    # it. Step 2 starts from step 1's exact result, with step 1's bound carried through.
    exact, bound = [], []
    at, at_bound = (variables["params"], variables["batch_stats"]), None
    for i in range(2):
        out, err, flips = running_error_bound(sgd_step, *at, x, y, arg_bounds=at_bound)
        assert not flips, f"step {i + 1}: comparisons rounding could flip: {flips}"
        exact.append(out)
        bound.append(err)
        at, at_bound = out[1:], err[1:]
    # (values, params, stats) after the two steps, as the step's
    exact = ([e[0] for e in exact], *exact[-1][1:])
    bound = ([b[0] for b in bound], *bound[-1][1:])
    worst = assert_within((values, state.consolidate(), state.batch_stats), exact, bound)
    _, ref_params, ref_stats = exact
    # ... far below what a wrong gradient would move the parameters by.
    tols = [float(np.max(b)) for b in jax.tree_util.tree_leaves(bound[1])]
    assert_far_below_updates(tols, ref_params, variables["params"])
    # Running statistics moved away from their init (mean 0), by far more than the bound:
    # the update was kept.
    moved = _max_diff(state.batch_stats, variables["batch_stats"])
    assert moved > 100 * max(float(np.max(b)) for b in jax.tree_util.tree_leaves(bound[2]))

    zpp.checkpoint.save(tmp_path, state)
    fresh = zpp.TrainState.create(model=model, params=variables, tx=optax.sgd(0.1),
                                  mesh=mesh, config=FP32)
    restored = zpp.checkpoint.restore(tmp_path, fresh)
    assert _max_diff(restored.batch_stats, state.batch_stats) == 0.0
    return worst


@_with_fresh_seed
def test_token_mean_is_the_global_token_mean_and_its_gradient(mesh, seed):
    """A padded batch with different real-token counts per device: the mean of per-device
    means is off; token_mean is exact in value and in gradient."""
    model = TiedLM()
    ids = _ids(seed, (8, 9))
    params = as_float64(_tied_params(seed + 1))
    mask = np.zeros((8, 8))
    for row, n in enumerate([8, 1, 3, 8, 2, 5, 8, 4]):  # real tokens per sequence
        mask[row, :n] = 1.0

    def masked_mean(apply, p, batch):
        return jnp.sum(_token_losses(apply, p, batch["ids"]) * batch["mask"]) / jnp.sum(
            batch["mask"])

    @zpp.train_step
    def step(state, batch):
        def loss(p):
            return zpp.token_mean(_token_losses(state.apply_fn, p, batch["ids"]), batch["mask"])

        value, g = jax.value_and_grad(loss)(state.params)
        # The two reductions on known values: row r's tokens all r (the step pmeans metrics).
        rows, mask = batch["rows"], batch["mask"]
        return state.apply_gradients(grads=g), {
            "loss": value, "rows": zpp.token_mean(rows, mask),
            "rows_naive": jnp.sum(rows * mask) / jnp.sum(mask)}  # each device's own mean

    def reference_loss(p, b):
        return masked_mean(model.apply, p, b)

    rows = np.broadcast_to(np.arange(8, dtype=np.float64)[:, None], (8, 8))
    batch = {"ids": ids, "mask": mask, "rows": rows}
    with float64_run():
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                      mesh=mesh, config=zpp.ZeroPPConfig(**FLOAT64))
        new, metrics = step(state, batch)
        # One device, jitted (one program instead of op by op); the update in numpy.
        want, g = jitted(value_and_grad_of(reference_loss))(params, batch)
    ref = jax.tree_util.tree_map(lambda a, b: np.asarray(a) - 0.1 * np.asarray(b), params, g)
    # One SGD step, both in float64: agreeing to the derived float64 rounding of the masked
    # mean and its gradient.
    rho = FLOAT64_RHO
    tols = trajectory_tolerances(ref, g, rho=rho, lr=0.1, steps=1,
                                 sensitivity=momentum_sensitivity())
    assert_training_close([metrics["loss"]], new.consolidate(), [want], ref, [g], tols, rho,
                          start=params)
    # The check can fail: on values r in row r (one row per device), the global token mean
    # is sum_r r n_r / sum_r n_r = 140 / 39 = 3.59 and the mean of per-device means 3.5
    # (exact: r n_r / n_r = r, their sum 28, halved thrice). token_mean's device d returns
    # 8 r n_r / 39 (one rounding) and the pmean sums 8 of them (7 more, of nonnegative
    # terms; its division by 8 is exact): within 9 U (8 to first order), U of float64 (a
    # token_mean that rounded to fp32 would miss it). 0.09 apart: far more than the
    # tolerance, on every seed.
    counts = mask.sum(axis=1)
    exact = float(np.sum(np.arange(8) * counts) / np.sum(counts))
    assert abs(float(metrics["rows"]) - exact) <= 9 * U64 * exact, float(metrics["rows"])
    assert float(metrics["rows_naive"]) == 3.5
    assert abs(exact - 3.5) > 100 * 2 * rho * abs(exact)


def test_metrics_and_outputs_are_fp32_under_bf16_compute(mesh):
    model = TiedLM()
    params = _tied_params(0)
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1), mesh=mesh,
                                  config=zpp.ZeroPPConfig(compute_dtype="bfloat16"))

    @zpp.train_step
    def step(state, ids):
        logits = state.apply_fn({"params": state.params}, ids[:, :-1])
        raw = jnp.mean(logits.astype(jnp.bfloat16))
        return {"logits_dtype": jnp.zeros((), logits.dtype), "raw": raw}

    out = step(state, _ids(1))
    assert out["logits_dtype"].dtype == jnp.float32
    assert out["raw"].dtype == jnp.float32  # a bf16 metric comes back widened


class NNXBlock(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32):
        self.lin = nnx.Linear(8, 8, param_dtype=dtype, rngs=rngs)
        self.bn = nnx.BatchNorm(8, axis_name=("node", "local"), param_dtype=dtype, rngs=rngs)
        # (nnx.BatchNorm makes its running statistics fp32 whatever param_dtype is)
        self.bn.mean = nnx.BatchStat(jnp.zeros((8,), dtype))
        self.bn.var = nnx.BatchStat(jnp.ones((8,), dtype))

    def __call__(self, x):
        return x + nnx.relu(self.bn(self.lin(x)))


class NNXNet(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32):
        self.embed = nnx.Embed(48, 8, param_dtype=dtype, rngs=rngs)
        self.blocks = nnx.List([NNXBlock(rngs, dtype) for _ in range(2)])

    def __call__(self, ids):
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.embed.attend(x)


@_with_fresh_seed
def test_nnx_state_updates_must_be_asked_for_and_match_nnx_training(mesh, seed):
    ids = _ids(seed + 1)

    @zpp.train_step
    def step(state, ids):
        def loss(p):
            logits, upd = state.apply_fn({"params": p, **state.collections}, ids[:, :-1],
                                         mutable=True)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits, ids[:, 1:]).mean(), upd

        (value, upd), g = jax.value_and_grad(loss, has_aux=True)(state.params)
        return state.apply_gradients(grads=g, **upd), value

    @zpp.train_step
    def forgets(state, ids):
        return state.apply_fn({"params": state.params, **state.collections}, ids).mean()

    @nnx.jit
    def ref_step(m, opt, ids):
        def loss(m):
            return optax.softmax_cross_entropy_with_integer_labels(
                m(ids[:, :-1]), ids[:, 1:]).mean()

        value, g = nnx.value_and_grad(loss)(m)
        opt.update(m, g)
        return value

    # Both runs in float64 (NNX makes float64 variables only with x64 on: built inside).
    with float64_run():
        model = NNXNet(nnx.Rngs(seed), jnp.float64)
        ref = nnx.clone(model)
        state = zpp.TrainState.create(model=model, params=None, tx=optax.sgd(0.1), mesh=mesh,
                                      config=zpp.ZeroPPConfig(**FLOAT64))
        assert "blocks/0" in state.describe()
        with pytest.raises(ValueError, match="updated its state"):
            forgets(state, ids)

        # One device, NNX's own way, with the cross-device BatchNorm axis made local.
        for b in ref.blocks:
            b.bn.axis_name = None
        start = nnx.state(nnx.clone(ref), nnx.Param)  # the parameters before training
        opt = nnx.Optimizer(ref, optax.sgd(0.1), wrt=nnx.Param)
        values, ref_values = [], []
        for _ in range(2):
            state, value = step(state, ids)
            values.append(value)
            ref_values.append(ref_step(ref, opt, ids))
    pure = state.consolidate()
    assert list(pure["blocks"]) == [0, 1]  # NNX's own keys: list indices are ints
    nnx.replace_by_pure_dict(nnx.state(ref, nnx.Param), pure)  # the structure NNX expects
    ours = state.engine.model.merge(pure, jax.device_get(state.collections))
    # Both runs within the derived float64 rounding of the two steps (losses, the whole NNX
    # state: parameters and running statistics) ...
    rho = FLOAT64_RHO
    assert_rounding_close((values, nnx.state(ours)), (ref_values, nnx.state(ref)), rho)
    # ... far below what a wrong gradient would move the parameters by.
    ref_params = nnx.state(ref, nnx.Param)
    assert_far_below_updates([2 * rho * s for s in leaf_scales(ref_params)], ref_params, start)
