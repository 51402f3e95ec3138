"""Models we did not write, trained with zeropp_jax against one-device fp32 training.

Every entry of ``tests/zoo.py`` is trained for 3 steps on a 2x4 mesh with fp32 compute and
the DEFAULT units (no ``units=``/``stacked=``), through the contract a user writes:
``zpp.TrainState.create(model=entry.model, params=entry.params, tx=tx, mesh=mesh,
config=cfg)`` and the ``train_step`` of ``_zero_step`` below. Its per-step losses and
``state.consolidate()`` are compared with ``zoo.reference_train`` (plain ``jax.jit`` + optax
on one device, the same loss function applied with ``entry.apply``). Dropout is off for parity (HF configs use p=0.0, so
``train=True`` still exercises the ``dropout_rng`` path); one GPT-2 test trains with dropout
on and only checks that the loss goes down.
"""

from __future__ import annotations

import contextlib

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
import zoo

CFG = zpp.ZeroPPConfig.zero3(compute_dtype="float32")
STEPS = 3
GLOBAL_BATCH = 16  # 2 examples per device on the 2x4 mesh

# Tolerances (fp32 compute everywhere; only the order of summation differs: each device
# averages its 2 examples and the reduce-scatter averages the 8 device gradients, where the
# reference takes one mean over 16).
# * Losses: the first step sees identical parameters, so its loss differs by rounding only
#   (~1e-7 relative); later steps see parameters that differ by the update error below,
#   which moves a loss of ~4 by far less than 1e-5 of itself. rtol=1e-5.
# * Parameters, compared as updates (``actual - start`` vs ``expected - start`` per leaf,
#   against the largest change of that leaf, about 3 lr): Adam's step-1 update is
#   lr * g / (|g| + eps), whose derivative in g is at most lr / eps, so a gradient that
#   differs by rounding dg moves the update by <= lr * dg / eps. With eps = 1e-3 (not the
#   default 1e-8: see below) and dg of a few fp32 ulps of an O(1) gradient sum (~1e-7), that
#   is <= 1e-4 * lr per step, ~3e-5 of the 3-step change. Measured spread between two valid
#   fp32 orders (the reference with the batch as 1 shard vs 8 shards): <= 8e-6 (Llama's
#   RMSNorm weights). RTOL_UPDATE = 5e-5. A real bug (a missing or extra gradient term, a
#   wrong 1/8) moves updates by >= 1e-2 of their size. The scale is the larger of the leaf's
#   own change and Adam's nominal 3-step move 3 * lr: a leaf whose exact gradient is zero
#   (below) changes by rounding noise only, and relative to that noise any two runs differ
#   by O(1); a bug there would move it by ~lr. Plus 3 fp32 ulps (2^-23 relative) of the
#   parameter itself: each step rounds the stored parameter, independently in both runs.
# * eps=1e-3: some gradients are exactly zero in exact arithmetic (attention key biases:
#   softmax is shift invariant) and come out as ~1e-10 rounding noise. Adam with eps=1e-8
#   turns that noise into +-lr steps of random sign, which no tolerance can compare (the
#   same reasoning as tests/train/test_engine.py); with eps=1e-3 they move by ~1e-9.
RTOL_LOSS = 1e-5
RTOL_UPDATE = 5e-5
LR = 1e-2


def _tx() -> optax.GradientTransformation:
    return optax.adam(LR, eps=1e-3)


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
    this file sorts last, so no later test reuses a program compiled here. fp32 semantics
    are unchanged: only machine-code quality, and at most the order of a reduction, which
    the tolerances above already cover."""
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


def _batches(entry: zoo.ZooEntry, seed: int, n: int = STEPS) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [entry.make_batch(rng, GLOBAL_BATCH) for _ in range(n)]


def _keys(n: int = STEPS) -> list[jax.Array]:
    return [jax.random.PRNGKey(1000 + i) for i in range(n)]


def _zero_step(entry: zoo.ZooEntry):
    """The step a user writes for one device, as in the module docstring."""

    @zpp.train_step
    def step(state, batch, rng):
        def loss_of(params):
            # linen / NNX:  state.apply_fn({"params": params}, *inputs)
            # HF:           state.apply_fn(**inputs, params=params, dropout_rng=rng, train=True)
            return entry.loss(state.apply_fn, params, batch, True, rng=rng)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    return step


def assert_updates_close(actual, expected, start, *, rel: float, steps: int = STEPS) -> None:
    """Per leaf (matched by path): max |a - e| <= rel * max(max |e - s|, steps * LR) plus
    ``steps`` fp32 ulps of max |e| (see the tolerances above)."""
    fa, fe, fs = zoo.flat(actual), zoo.flat(expected), zoo.flat(start)
    assert sorted(fa) == sorted(fe), (sorted(set(fa) ^ set(fe)))
    for k, e in fe.items():
        a, e, s = (np.asarray(x, np.float64) for x in (fa[k], e, fs[k]))
        assert a.shape == e.shape, f"{k}: shape {a.shape} != {e.shape}"
        err = np.max(np.abs(a - e))
        scale = max(np.max(np.abs(e - s)), steps * LR)
        limit = rel * scale + steps * 2.0**-23 * np.max(np.abs(e))
        assert err <= limit, f"{k}: |actual - expected| {err:.3g} > {limit:.3g}"


@pytest.mark.parametrize("name", PARITY)
def test_zoo_parity(name, mesh):
    entry = _entry(name)
    batches, keys = _batches(entry, seed=7), _keys()
    with _compat(name):
        ref = zoo.reference_train(entry, batches, _tx(), rngs=keys)
        state = zpp.TrainState.create(model=entry.model, params=entry.params, tx=_tx(),
                                      mesh=mesh, config=CFG)
        step = _zero_step(entry)
        losses = []
        for b, k in zip(batches, keys):
            state, out = step(state, b, k)
            losses.append(float(out["loss"]))
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL_LOSS)
    assert_updates_close(state.consolidate(), ref.params, entry.params, rel=RTOL_UPDATE)
    assert int(state.step) == STEPS


def test_resnet_batchnorm_parity(mesh):
    """BatchNorm: params train, ``batch_stats`` are carried and averaged over devices.

    Semantics checked: data parallelism WITHOUT SyncBatchNorm (what each rank of DDP or
    DeepSpeed does): every device normalizes with its own 2-example batch statistics, the
    gradient is the mean of the device gradients, and the new running statistics are the
    mean of the devices' updates. ``reference_train(data_shards=8)`` computes exactly that
    on one device.
    """
    entry = _entry("resnet_bn")
    batches = _batches(entry, seed=8)
    ref = zoo.reference_train(entry, batches, _tx(), data_shards=8)
    # The whole variables dict: params are sharded, batch_stats kept replicated.
    state = zpp.TrainState.create(model=entry.model, params=entry.variables,
                                  tx=_tx(), mesh=mesh, config=CFG)
    assert set(state.collections) == {"batch_stats"}

    @zpp.train_step
    def step(state, batch):
        def loss_of(params):
            variables = {"params": params, "batch_stats": state.batch_stats}
            return entry.loss(state.apply_fn, variables, batch, True)

        (loss, new), grads = jax.value_and_grad(loss_of, has_aux=True)(state.params)
        state = state.apply_gradients(grads=grads, batch_stats=new["batch_stats"])
        return state, {"loss": loss}

    losses = []
    for b in batches:
        state, out = step(state, b)
        losses.append(float(out["loss"]))
    np.testing.assert_allclose(losses, ref.losses, rtol=RTOL_LOSS)
    assert_updates_close(state.consolidate(), ref.params, entry.params, rel=RTOL_UPDATE)
    # Running statistics: mean of 8 per-device EMA updates; only summation order differs.
    assert_updates_close(jax.device_get(state.batch_stats), ref.collections["batch_stats"],
                         entry.collections["batch_stats"], rel=RTOL_UPDATE)


def test_hf_gpt2_dropout_trains(mesh):
    """GPT-2 with dropout 0.1 through ``state.apply_fn(**inputs, params=...,
    dropout_rng=rng, train=True)``: 5 steps on one batch, the loss goes down. (No parity:
    each device draws its own dropout masks.)"""
    entry = _entry("hf_gpt2_dropout")
    batch = _batches(entry, seed=9, n=1)[0]

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
                                      mesh=mesh, config=CFG)
        losses = []
        for k in _keys(5):
            state, out = step(state, batch, k)
            losses.append(float(out["loss"]))
    assert np.all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.05, losses
