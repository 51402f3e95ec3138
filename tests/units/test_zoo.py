"""Models we did not write, trained with zeropp_jax against one-device training, both in
float64 (the parity tests' derived tolerance: tests/helpers.py, ``FLOAT64_RHO``).

Every entry of ``tests/zoo.py`` is trained for 3 steps on a 2x4 mesh with the DEFAULT units
(no ``units=``/``stacked=``), through the contract a user writes:
``zpp.TrainState.create(model=entry.model, params=entry.params, tx=tx, mesh=mesh,
config=cfg)`` and the ``train_step`` of ``_zero_step`` below. Its per-step losses and
``state.consolidate()`` are compared with ``zoo.reference_trajectory`` (plain ``jax.jit`` +
optax on one device, the same loss function applied with ``entry.apply``). The entry runs as
its float64 twin (``zoo.float64_twin``, inside ``zoo.float64_context``: the same model
computing in float64 throughout, the reference's program checked to hold no fp32 value but
exact ones), from its weights moved off the fp32 grid at a fresh seed, on fresh batches.
Dropout is off for parity (HF configs use p=0.0, so ``train=True`` still exercises the
``dropout_rng`` path); one GPT-2 test trains in fp32 with dropout on and only checks that
the loss goes down.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
import zoo

from helpers import (FLOAT64, FLOAT64_RHO, adam_sensitivity, assert_far_below_updates,
                     assert_leaves_within, assert_rounding_close, assert_training_close,
                     fresh_seed, leaf_scales, seed_on_failure, trajectory_tolerances)

CFG32 = zpp.ZeroPPConfig.zero3(compute_dtype="float32")  # the dropout test's
STEPS = 3
GLOBAL_BATCH = 16  # 2 examples per device on the 2x4 mesh
LR, EPS = 1e-2, 1e-3

# Tolerances (derived; both runs in float64, only the order of summation differs: each
# device averages its 2 examples and the reduce-scatter averages the 8 device gradients,
# where the reference takes one mean over 16):
# * Each run's loss and gradients lie within FLOAT64_RHO of their leaf's scale of the exact
#   values: FLOAT64_RHO covers a first-order rounding bound of up to kappa ~9e6 unit
#   roundoffs (helpers), and tests/running_error.py's ``running_error_bound`` derives kappa
#   for these models' losses and gradients (16 examples, the weights as here) between 8e3
#   (nnx_bridge) and 6e4 (nnx_transformer; T5 5e4, lm1b 5e4, wmt 4e4, GPT-2 3e4; ResNet's,
#   with its batch statistics: RESNET_KAPPA), 150x or more below. The scale is the leaf's
#   largest gradient, or the tree's for a leaf whose gradient cancels exactly
#   (``leaf_scales``: attention key biases, softmax being shift invariant, get rounding
#   noise only), as ``assert_rounding_close`` takes it. The first step's gradients are
#   compared directly too: Adam normalizes a gradient's relative error away (its first
#   update is lr * g / (|g| + eps)), so the trajectory alone would not see one rounded to
#   fp32 on the way.
# * Carried through the 3 Adam steps by ``trajectory_tolerances``: Adam's update moves by at
#   most 1.25 / (|g_1| / sqrt(t) + eps) lr per unit of gradient (``adam_sensitivity``),
#   plus each run's rounding of the update and of the stored parameter; the losses by
#   ``loss_trajectory_tolerance`` (their own rounding plus the parameters' drift times the
#   gradient). ``assert_training_close`` also checks the bound is 100x below every leaf's
#   update, which a real bug (a missing or extra gradient term, a wrong 1/8) moves whole.
# * eps=1e-3 (not the default 1e-8) keeps that sensitivity at <= 1.25e3: an element whose
#   gradient is zero in exact arithmetic comes out as rounding noise, and with eps=1e-8
#   Adam would turn a difference in that noise into up to 1.25e8 times as much update,
#   a bound as large as the updates (the same reasoning as tests/train/test_engine.py).


def _tx() -> optax.GradientTransformation:
    return optax.adam(LR, eps=EPS)


# The mechanisms of seven entries are pinned by faster tests (test_model_patterns.py: a
# tied head through .variables, a module called twice, a tied NNX attend, a shared
# embedding passed as an attribute, an NNX model's blocks in an nnx.List as units trained
# as NNX trains them; test_wrap.py: lm1b's nested block names, whose nesting the HF
# entries share; test_scan.py: an nn.scan stack found by the default policy, a unit per
# layer, equal to one device): their zoo runs go to `make test-all` to keep `make test`
# under ten minutes. (The attention masks nnx_transformer passes to its blocks: the HF
# entries pass theirs too.)
_ALSO_PINNED = pytest.mark.slow
PARITY = [
    pytest.param("lm1b", marks=_ALSO_PINNED),
    pytest.param("wmt", marks=_ALSO_PINNED),
    pytest.param("tied_variables", marks=_ALSO_PINNED),
    pytest.param("called_twice", marks=_ALSO_PINNED),
    pytest.param("scan_stack", marks=_ALSO_PINNED),
    pytest.param("nnx_transformer", marks=_ALSO_PINNED),
    pytest.param("nnx_tied", marks=_ALSO_PINNED),
    "nnx_bridge",
    "hf_gpt2",
    # An encoder with the same nested block names and dense layers as GPT-2's (and T5's
    # encoder's); GPT-2 stays in `make test`.
    pytest.param("hf_bert", marks=pytest.mark.slow),
    # transformers' encoder-decoder (T5's shared embedding passed to both stacks, its first
    # layer's position bias an argument of the later layers) stays in `make test`. Llama's
    # RoPE table of constants passed to its blocks is pinned by test_units.py's
    # test_constant_float_arguments_work_and_match_single_device, and transformers' Llama
    # trains in `make test` elsewhere (test_error_feedback.py, test_tensor_parallel.py).
    "hf_t5",
    pytest.param("hf_llama", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module", autouse=True)
def _fast_compiles():
    """XLA:CPU's backend optimizations cost seconds per program here and buy nothing for
    models this small (the tiny ResNet's init compiles in 10 s at the default level, 1 s
    without). ``jax_disable_most_optimizations`` (a global flag, read at compile time, not
    part of the jit cache key) is switched on for this module only and restored after;
    this file sorts last, so no later test reuses a program compiled here. The arithmetic
    is unchanged: only machine-code quality, and at most the order of a reduction, which
    the derived tolerances above cover (they hold for sums in any order)."""
    old = jax.config.read("jax_disable_most_optimizations")
    jax.config.update("jax_disable_most_optimizations", True)
    yield
    jax.config.update("jax_disable_most_optimizations", old)


@pytest.fixture(scope="module")
def mesh():
    return zpp.make_mesh(nodes=2, local=4)


def _entry(name: str) -> zoo.ZooEntry:
    if name.startswith("hf_"):
        transformers = pytest.importorskip("transformers")
        if not hasattr(transformers, "FlaxPreTrainedModel"):  # 5.0 removed the Flax models
            pytest.skip(f"transformers {transformers.__version__} has no Flax models "
                        "(the test extra pins transformers<5)")
    if name.startswith("nnx"):
        pytest.importorskip("flax.nnx")
    with _compat(name):
        return zoo.get(name)


def _compat(name: str):
    """transformers' Flax models need ``zoo.hf_compat()`` (``jnp.clip(a_max=)`` for T5,
    rank promotion allowed despite tests/conftest.py) at construction and at every trace."""
    return zoo.hf_compat() if name.startswith("hf_") else contextlib.nullcontext()


# The fp32 values a float64 reference may hold (``zoo.reference_trajectory(exact_f32=)``):
# exact ones only. Attention masks, booleans made 0/1 fp32 ``[batch, 1, q, k]`` and compared
# with 0; and T5's relative-position buckets, integer positions through an fp32 log to
# integer bucket ids (``[q, k]``, fp32 scalar constants): a function of the positions alone,
# the same ids in every run.
EXACT_F32 = (f"x1x{zoo.SEQ}x{zoo.SEQ}xf32", "dense<0.000000e+00> : tensor<f32>")
T5_BUCKETS = (f"tensor<{zoo.SEQ}x{zoo.SEQ}xf32>", "e+00> : tensor<f32>",
              "(tensor<f64>) -> tensor<f32>", "(tensor<i64>) -> tensor<f32>")


def _exact_f32(name: str) -> tuple:
    return EXACT_F32 + (T5_BUCKETS if name == "hf_t5" else ())


def _params64(entry: zoo.ZooEntry, seed: int):
    """The entry's weights (a pure dict) moved by a float64 perturbation drawn at ``seed``:
    fresh weights each run, off the fp32 grid (a silent cast of a weight to fp32 in the
    library would change it, and fail the comparison)."""
    params = entry.params
    if entry.kind == "nnx":
        from flax import nnx

        params = nnx.to_pure_dict(params)
    rng = np.random.default_rng(seed)
    return jax.tree_util.tree_map(
        lambda x: np.asarray(x, np.float64) + 1e-2 * rng.standard_normal(np.shape(x)), params)


def _batches(entry: zoo.ZooEntry, seed: int, n: int = STEPS, *, wide: bool = True
             ) -> list[dict]:
    rng = np.random.default_rng(seed)
    batches = [entry.make_batch(rng, GLOBAL_BATCH) for _ in range(n)]
    return [zoo.float64_batch(b) for b in batches] if wide else batches


def _keys(seed: int, n: int = STEPS) -> list[jax.Array]:
    return [jax.random.PRNGKey(seed + i) for i in range(n)]


def _zero_step(entry: zoo.ZooEntry):
    """The step a user writes for one device, as in the module docstring (returning its
    gradients too, for ``_assert_trained_alike``)."""

    @zpp.train_step
    def step(state, batch, rng):
        def loss_of(params):
            # linen / NNX:  state.apply_fn({"params": params}, *inputs)
            # HF:           state.apply_fn(**inputs, params=params, dropout_rng=rng, train=True)
            return entry.loss(state.apply_fn, params, batch, True, rng=rng)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "grads": grads}

    return step


def _consolidated(state, grads):
    """A step's sharded gradients as one tree of numpy arrays, as the user's model names
    its parameters."""
    return state.engine.adapter.to_pure_dict(state.engine.consolidate(grads))


def _tolerances(params: dict, grads: dict) -> list[list[float]]:
    """``trajectory_tolerances`` of the runs (``params``: the reference's final parameters,
    ``grads``: its first gradients, flat dicts by path) for Adam(LR, EPS), each run's
    gradient within FLOAT64_RHO of its leaf's scale (``leaf_scales``)."""
    scales = {k: np.full(1, s) for k, s in zip(grads, leaf_scales(grads))}
    return trajectory_tolerances(params, scales, seen=grads, rho=FLOAT64_RHO, lr=LR,
                                 steps=STEPS, sensitivity=adam_sensitivity(EPS))


def _assert_trained_alike(losses, grads, params, ref: zoo.Trajectory) -> list[list[float]]:
    """The run's first gradients ``grads``, per-step ``losses`` and final ``params`` against
    the reference's, within the derived tolerances (module comment); returns the
    parameters', per step and leaf (sorted paths)."""
    got, want, start = (zoo.flat(t) for t in (params, ref.params[-1], ref.params[0]))
    assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
    grads, ref_grads = zoo.flat(grads), [zoo.flat(g) for g in ref.grads]
    assert sorted(grads) == sorted(want), sorted(set(grads) ^ set(want))
    # The first step's gradients, before Adam normalizes them (module comment).
    assert_rounding_close(grads, ref_grads[0], FLOAT64_RHO)
    tols = _tolerances(want, ref_grads[0])
    # Flat dicts: every tree below has the same sorted keys, so their leaves line up.
    assert_training_close(losses, got, ref.losses, want, ref_grads, tols, FLOAT64_RHO,
                          start=start)
    return tols


@pytest.mark.parametrize("name", PARITY)
def test_zoo_parity(name, mesh):
    entry = _entry(name)
    seed = fresh_seed()
    batches, keys = _batches(entry, seed + 1), _keys(seed + 2)
    with zoo.float64_context(name):
        e64 = zoo.float64_twin(entry, _params64(entry, seed))
        ref = zoo.reference_trajectory(e64, batches, _tx(), rngs=keys,
                                       exact_f32=_exact_f32(name))
        state = zpp.TrainState.create(model=e64.model, params=e64.params, tx=_tx(),
                                      mesh=mesh, config=zpp.ZeroPPConfig.zero3(**FLOAT64))
        step = _zero_step(e64)
        losses, grads = [], None
        for b, k in zip(batches, keys):
            state, out = step(state, b, k)
            losses.append(float(out["loss"]))
            grads = _consolidated(state, out["grads"]) if grads is None else grads
        params = state.consolidate()
    with seed_on_failure(seed):
        _assert_trained_alike(losses, grads, params, ref)
        assert int(state.step) == STEPS


def _path(path) -> str:
    """A tree path as ``zoo.flat`` names it."""
    return "/".join(zoo._key_str(k) for k in path)


def _stats_tolerances(ref: zoo.Trajectory, start: dict, batches, tols) -> list[float]:
    """How far the two runs' running statistics (``batch_stats``) may differ after the
    last step, per leaf (sorted paths), derived: step t's statistics are
    ``f(p_{t-1}, s_{t-1}, batch_t)`` (the EMA of the batch statistics of the forward at the
    step's parameters), each run's within FLOAT64_RHO of their leaf's scale of the exact
    ones at its own inputs (as the gradients: the same kappa bound), and the inputs differ
    by at most ``tols[t-1]`` (parameters) and the previous step's bound (statistics), which
    move an element to first order by ``sum |df / dinput| * that difference`` (the
    Jacobian at the reference's inputs; second order, ~tol^2 times the curvature with tol
    ~1e-9 of the values, is far below). Call inside ``zoo.float64_context``."""
    from jax.flatten_util import ravel_pytree

    def spread(tree, per_leaf):  # ``tree`` raveled, each element its leaf's bound
        return ravel_pytree(jax.tree_util.tree_map_with_path(
            lambda path, x: np.full(np.shape(x), per_leaf[_path(path)]), tree))[0]

    keys = sorted(zoo.flat(start))
    bound = dict.fromkeys(keys, 0.0)  # the same start
    stats = start
    for t, batch in enumerate(batches):
        params = ref.params[t]
        p_vec, unravel_p = ravel_pytree(params)
        s_vec, unravel_s = ravel_pytree(stats)

        def f(p, s, batch=batch):
            new = ref.loss_fn(unravel_p(p), {"batch_stats": unravel_s(s)}, batch, None)[1]
            return ravel_pytree(new["batch_stats"])[0]

        j_p, j_s = jax.jacrev(f, argnums=(0, 1))(p_vec, s_vec)
        p_tol = dict(zip(sorted(zoo.flat(params)), tols[t]))
        moved = zoo.flat(unravel_s(np.abs(np.asarray(j_p)) @ spread(params, p_tol)
                                   + np.abs(np.asarray(j_s)) @ spread(stats, bound)))
        stats = ref.collections[t]["batch_stats"]
        new = zoo.flat(stats)
        bound = {k: float(np.max(moved[k])) + 2 * FLOAT64_RHO * scale
                 for k, scale in zip(keys, leaf_scales(new))}
    return [bound[k] for k in keys]


def test_resnet_batchnorm_parity(mesh):
    """BatchNorm: params train, ``batch_stats`` are carried and averaged over devices.

    Semantics checked: data parallelism WITHOUT SyncBatchNorm (what each rank of DDP or
    DeepSpeed does): every device normalizes with its own 2-example batch statistics, the
    gradient is the mean of the device gradients, and the new running statistics are the
    mean of the devices' updates. ``reference_trajectory(data_shards=8)`` computes exactly
    that on one device.
    """
    entry = _entry("resnet_bn")
    seed = fresh_seed()
    batches = _batches(entry, seed + 1)
    with zoo.float64_context(entry.name):
        e64 = zoo.float64_twin(entry, _params64(entry, seed))
        ref = zoo.reference_trajectory(e64, batches, _tx(), data_shards=8,
                                       exact_f32=_exact_f32(entry.name))
        # The whole variables dict: params are sharded, batch_stats kept replicated.
        state = zpp.TrainState.create(model=e64.model, params=e64.variables, tx=_tx(),
                                      mesh=mesh, config=zpp.ZeroPPConfig.zero3(**FLOAT64))
        assert set(state.collections) == {"batch_stats"}

        @zpp.train_step
        def step(state, batch):
            def loss_of(params):
                variables = {"params": params, "batch_stats": state.batch_stats}
                return e64.loss(state.apply_fn, variables, batch, True)

            (loss, new), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
            state = state.apply_gradients(grads=grads, batch_stats=new["batch_stats"])
            return state, {"loss": loss, "grads": grads}

        losses, grads = [], None
        for b in batches:
            state, out = step(state, b)
            losses.append(float(out["loss"]))
            grads = _consolidated(state, out["grads"]) if grads is None else grads
        params = state.consolidate()
        stats = jax.device_get(state.batch_stats)
        with seed_on_failure(seed):
            tols = _assert_trained_alike(losses, grads, params, ref)
        start = e64.collections["batch_stats"]
        stats_tols = _stats_tolerances(ref, start, batches, tols)
    # Running statistics: the mean of 8 per-device EMA updates, only the summation order
    # differs; within the derived bound, itself far below how far they moved.
    want = zoo.flat(ref.collections[-1]["batch_stats"])
    with seed_on_failure(seed):
        assert_far_below_updates(stats_tols, want, zoo.flat(start))
        assert_leaves_within(zoo.flat(stats), want, stats_tols)


def test_hf_gpt2_dropout_trains(mesh):
    """GPT-2 with dropout 0.1 through ``state.apply_fn(**inputs, params=...,
    dropout_rng=rng, train=True)``: 5 steps on one batch, the loss goes down. (No parity:
    each device draws its own dropout masks.)"""
    entry = _entry("hf_gpt2_dropout")
    batch = _batches(entry, seed=9, n=1, wide=False)[0]

    @zpp.train_step
    def step(state, batch, rng):
        inputs = {k: v for k, v in batch.items() if k != "labels"}

        def loss_of(params):
            logits = state.apply_fn(**inputs, params=params, dropout_rng=rng, train=True)[0]
            return optax.softmax_cross_entropy_with_integer_labels(
                logits[:, :-1], batch["labels"][:, 1:]).mean()

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with _compat(entry.name):
        state = zpp.TrainState.create(model=entry.model, params=entry.params, tx=_tx(),
                                      mesh=mesh, config=CFG32)
        losses = []
        for k in _keys(1000, 5):
            state, out = step(state, batch, k)
            losses.append(float(out["loss"]))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.05, losses
