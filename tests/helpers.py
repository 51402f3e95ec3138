"""Shared pieces of the tests: a small GPT, a single-device reference, comparisons."""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT, GPTConfig, loss_fn

# d_model=20 makes every unit's size a non-multiple of 8 devices (padding needed), and
# logit_scale is a root-level scalar: a unit with fewer elements than devices.
SMALL = GPTConfig(vocab_size=64, seq_len=12, layers=2, d_model=20, heads=4, logit_scale=True)
# Its float64 twin, for the parity tests' float64 runs (``float64_run``).
SMALL64 = GPTConfig(vocab_size=64, seq_len=12, layers=2, d_model=20, heads=4, logit_scale=True,
                    dtype="float64")


def all_pairs(*factors: list) -> list:
    """Every combination of ``factors`` as ``pytest.param`` cases, those outside an
    all-pairs cover marked slow (``make test-all`` runs them).

    The cover keeps, for every two factors, every pair of their levels in some case
    (pairwise testing): a bug that needs two settings together still shows in
    ``make test``. Level ``i`` of each factor after the first two is taken at the sum of
    the first two levels' indices, mod its size (with two factors, all cases are kept;
    check the returned cover with ``pairs_covered``).
    """
    import itertools

    import pytest

    cases = []
    for idx in itertools.product(*(range(len(f)) for f in factors)):
        values = tuple(f[i] for f, i in zip(factors, idx))
        in_cover = all(i == (idx[0] + idx[1]) % len(f)
                       for f, i in zip(factors[2:], idx[2:]))
        cases.append(pytest.param(*values, marks=() if in_cover else pytest.mark.slow))
    return cases


def pairs_covered(cases: list, factors: list) -> bool:
    """True if the cases not marked slow contain every pair of levels of every two
    factors."""
    import itertools

    kept = [c.values for c in cases if not c.marks]
    return all({(v[a], v[b]) for v in kept} == set(itertools.product(factors[a], factors[b]))
               for a, b in itertools.combinations(range(len(factors)), 2))


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment for a Python subprocess of a test: this one's, less what fixes the
    device count (the child simulates its own), with the suite's compile flags
    (conftest.COMPILE_FLAGS, passed on in ZEROPP_TEST_XLA_FLAGS) as its XLA_FLAGS and the
    run's compile cache."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    if os.environ.get("ZEROPP_TEST_XLA_FLAGS"):
        env["XLA_FLAGS"] = os.environ["ZEROPP_TEST_XLA_FLAGS"]
    if os.environ.get("ZEROPP_TEST_COMPILE_CACHE"):
        # The run's compile cache (conftest), through JAX's own environment variables: the
        # processes of a multi-process test compile the same programs, and reruns of an
        # example the programs an earlier test compiled.
        env.update(JAX_COMPILATION_CACHE_DIR=os.environ["ZEROPP_TEST_COMPILE_CACHE"],
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                   JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.update(extra)
    return env


# The seeds the running test has drawn (tests/conftest.py empties it before each test and
# names them in a failed test's report).
DRAWN: list[int] = []


def fresh_seed() -> int:
    """A seed for a test's random inputs: fresh on every run, or ``ZPP_TEST_SEED`` to
    replay the one a failure named (``seed_on_failure``, or the report's "seeds" section)."""
    given = os.environ.get("ZPP_TEST_SEED")
    seed = int(given) if given else secrets.randbelow(1 << 30)
    DRAWN.append(seed)
    log = os.environ.get("ZPP_SEED_LOG")  # make test-seeds: which test drew which seed
    if log:
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?').split(' ')[0]}\t{seed}\n")
    return seed


@contextlib.contextmanager
def seed_on_failure(seed: int):
    """Inside, a failed assertion names the seed its inputs came from."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(
            f"{e}\n(inputs from seed {seed}: rerun with ZPP_TEST_SEED={seed})") from e


def tokens(batch: int, seq_len: int = SMALL.seq_len, *, seed: int) -> np.ndarray:
    """Fresh random tokens ``int32 [batch, seq_len + 1]``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, SMALL.vocab_size, (batch, seq_len + 1)).astype(np.int32)


@functools.lru_cache(maxsize=None)
def _jitted_init(cfg: GPTConfig):
    """``GPT(cfg).init`` as one program per configuration (op by op it compiles ~90 small
    programs the first time a process sees them)."""
    return jax.jit(GPT(cfg).init)


def init_params(cfg: GPTConfig = SMALL, seed: int = 0) -> dict:
    """The test GPT's fp32 parameters at ``seed``, the same values inside ``float64_run``
    as outside (x64 off here: under it flax would draw some leaves in float64, and the
    perturbation below would not round to fp32; ``as_float64`` widens the result)."""
    with jax.enable_x64(False):
        params = _jitted_init(cfg)(jax.random.PRNGKey(seed),
                                   tokens(2, cfg.seq_len, seed=seed)[:, :-1])
        params = params["params"]
        # Perturb the init so no parameter sits at a special value (ones/zeros of LayerNorm).
        leaves, treedef = jax.tree_util.tree_flatten(params)
        rng = np.random.default_rng(seed + 1)
        leaves = [np.asarray(x) + 0.1 * rng.standard_normal(np.shape(x)).astype(np.float32)
                  for x in leaves]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def make_step(with_grads: bool = False):
    """A train step written as for one device; optionally also returns the gradients."""

    @zpp.train_step
    def step(state, batch):
        def loss_of(p):
            return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        out = {"loss": loss}
        if with_grads:
            out["grads"] = grads
        return state.apply_gradients(grads=grads), out

    return step


@functools.partial(jax.jit, static_argnums=0)
def _loss_and_grads(model, params, batch):
    def loss_of(p):
        return loss_fn(model.apply({"params": p}, batch[:, :-1]), batch[:, 1:])

    return jax.value_and_grad(loss_of)(params)


def reference_loss_and_grads(model, params, batch):
    """Single-device loss and gradients, jitted: one compile per model and shapes instead of
    one per primitive (op-by-op execution compiled ~10 s of small programs per process)."""
    with jax.default_device(jax.devices()[0]):
        return _loss_and_grads(model, params, batch)


_jit_apply_updates = jax.jit(optax.apply_updates)


def reference_train(model, params, tx, batches, *, with_grads: bool = False,
                    jit_optimizer: bool = False):
    """Plain single-device training: params after ``len(batches)`` steps and the losses (and,
    with ``with_grads``, each step's gradients, for ``loss_trajectory_tolerance``).
    ``jit_optimizer``: the optimizer's init and update run as one program each; op by op,
    every optax op compiles a small program of its own the first time a process sees its
    shapes (Adam: ~100, about 2 s), which pays off only where a file's other tests have not
    already compiled them."""
    init, update, apply = tx.init, tx.update, optax.apply_updates
    if jit_optimizer:
        # apply_updates too: op by op it compiles an add (and a cast) per leaf shape.
        init, update, apply = jax.jit(tx.init), jax.jit(tx.update), _jit_apply_updates
    with jax.default_device(jax.devices()[0]):
        state = init(params)
        losses, grads = [], []
        for b in batches:
            loss, g = reference_loss_and_grads(model, params, b)
            u, state = update(g, state, params)
            params = apply(params, u)
            losses.append(float(loss))
            grads.append(g)
    return (params, losses, grads) if with_grads else (params, losses)


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def _int_round_trip(flat, *, bits: int, block: int):
    """INT``bits`` blocks of ``block``: Q then Q^-1 to fp32, one program per unit size (the
    step runs the same reference jitted; ``quantize_reference`` rounds alike either way)."""
    from pallas_kernels.quantize import dequantize_reference, quantize_reference

    v, s = quantize_reference(flat, bits=bits, block_size=block)
    return dequantize_reference(v, s, bits=bits, block_size=block, dtype=jnp.float32)


def dequantized_params(state, block: int, bits: int, roundtrip=None) -> dict:
    """The weights a qwZ step computes with: every unit's flat buffer through Q and Q^-1
    (``roundtrip(flat) -> fp32 flat``; default INT``bits`` blocks of ``block``)."""
    from zeropp_jax.comm.partition import REST, merge_units

    if roundtrip is None:
        roundtrip = functools.partial(_int_round_trip, bits=bits, block=block)

    units, rest = {}, {}
    for name, lay in state.engine.layouts.items():
        flat = jnp.asarray(np.asarray(state.params.units[name]))
        tree = jax.tree_util.tree_map(np.asarray, lay.unflatten(roundtrip(flat)))
        if name == REST:
            rest = tree
        else:
            units[lay.path] = tree
    return merge_units(rest, units)


def leaf_scales(tree) -> list[float]:
    """Per leaf, the magnitude a relative error is taken against: its largest element, or,
    for a leaf that vanishes next to the rest (below 1e-6 of the tree's largest element:
    the gradient of a bias before a normalization, which cancels exactly, and that bias),
    the tree's largest element, the size of the values its rounding comes from."""
    sizes = [float(np.max(np.abs(np.asarray(x, np.float64)), initial=0.0))
             for x in jax.tree_util.tree_leaves(tree)]
    top = max(sizes, default=0.0)
    return [size if size > 1e-6 * top else top for size in sizes]


def assert_leaves_rel_close(actual, expected, rel: float) -> None:
    """Per leaf: max |a - e| <= rel * max |e| (a relative error that does not blow up on
    elements that happen to be near zero; ``leaf_scales`` for a leaf that vanishes)."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e, scale in zip(flat_a, flat_e, leaf_scales(expected)):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, jax.tree_util.keystr(path)
        err = np.max(np.abs(a - e), initial=0.0)
        assert err <= rel * scale, (
            f"{jax.tree_util.keystr(path)}: {err:.3g} > {rel:.3g} * {scale:.3g}")


def assert_leaves_equal(actual, expected) -> None:
    """Bit for bit, leaf by leaf (for runs that do the same arithmetic and only move data
    differently)."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e),
                                      err_msg=jax.tree_util.keystr(path))


def assert_leaves_within(actual, expected, tols) -> None:
    """Per leaf: max |a - e| <= tol (one absolute tolerance per leaf, in leaf order)."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_leaves(expected)
    assert len(flat_a) == len(flat_e) == len(tols)
    for (path, a), e, tol in zip(flat_a, flat_e, tols):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, jax.tree_util.keystr(path)
        err = np.max(np.abs(a - e))
        assert err <= tol, f"{jax.tree_util.keystr(path)}: {err:.3g} > {tol:.3g}"


# -- Tolerances derived from rounding -------------------------------------------------------
#
# Two evaluations of one quantity in different summation orders (sharded vs one device,
# stage 1 vs 3, micro-batches vs one batch) differ by their rounding. The parity tests bound
# that rounding by derivation, not by measuring it on this CPU (a measured allowance was
# exceeded 2x by an order it had not sampled): see "Float64 parity runs" below. The bound
# is carried through what a test computes: one evaluation (``assert_loss_and_grads_close``),
# or an optimizer's steps (``trajectory_tolerances``, ``loss_trajectory_tolerance``).

U32 = 2.0**-24  # fp32's unit roundoff: half an ulp of 1.0

# What the parity tests guard against: a wrong reduction (a device's share missing or counted
# twice, a mean taken twice, a slice sent to the wrong device) moves a gradient by at least
# one device's share, 1/8 of it on 8 devices. A derived bound is checked to stay 1000x below.
GUARDED = 1 / 8


# -- Float64 parity runs: a derived tolerance -------------------------------------------------
#
# A sharded step and the one-device step compute the same operations up to the order of
# their sums (and exact scalings by powers of two), so each lies within the first-order
# rounding bound of those operations, whatever the order: ``kappa * U`` of each leaf's
# scale, ``kappa`` derived by tests/running_error.py (``running_error_bound``: the signed
# derivatives of every output with respect to every rounding, Higham ch. 2-3). For the test
# GPT's loss and gradients kappa is ~7e4 (4.4e-3 and 4.1e-3 of the leaf scales in fp32 at
# two seeds): in fp32 that bound is 28x below a wrong reduction's error (GUARDED) and far
# above what the runs round by (~6e-7), too loose to catch a lost digit. So the parity
# tests run both sides in float64 (``float64_run``; the library takes ``FLOAT64`` dtypes
# under x64), where the same kappa is ~8e-12 of the values, and allow ``FLOAT64_RHO`` per
# run:
# - 120x above the derived bound on the test GPT (kappa up to 9e6 allowed: deeper or wider
#   test models, other inputs; ``test_float64_tolerance_covers_the_derived_bound`` derives
#   kappa again at a fresh seed, in ``make test-all``);
# - 1e8 below a wrong reduction's error (GUARDED), and 30x below the error of a single fp32
#   rounding of a leaf's largest elements (U32 = 6e-8: a silent cast to fp32 anywhere in the
#   library's path fails the test, which a tolerance set from fp32 rounding cannot see).
FLOAT64 = dict(compute_dtype="float64", param_dtype="float64", output_dtype="float64")
U64 = 2.0**-53
FLOAT64_RHO = 1e-9


@contextlib.contextmanager
def float64_run(*modules):
    """Inside: JAX's 64-bit mode, and the explicit ``jnp.float32`` casts of ``modules``
    (default: the demo GPT's logits and softmax) read as float64, so a model built with a
    float64 dtype computes in float64 throughout."""
    import zeropp_demo.gpt as gpt

    with jax.enable_x64(True), _float32_reads_as_float64(modules or (gpt,)):
        yield


class WideFloat32:
    """``lib`` (numpy or jax.numpy) whose ``float32`` is ``float64``: set as a module's
    ``np``/``jnp`` so that its explicit fp32 casts stay float64 in a float64 run."""

    def __init__(self, lib: Any):
        self._lib = lib

    def __getattr__(self, name: str) -> Any:
        return self._lib.float64 if name == "float32" else getattr(self._lib, name)


def as_float64(tree):
    """``tree`` with its floating leaves float64 numpy arrays (the same values: fp32 and
    bf16 values are float64 values), other leaves as they are."""
    def wide(x):
        x = np.asarray(x)
        return x.astype(np.float64) if np.issubdtype(x.dtype, np.floating) or \
            x.dtype == jnp.bfloat16 else x

    return jax.tree_util.tree_map(wide, tree)


@contextlib.contextmanager
def _float32_reads_as_float64(modules):
    """Inside, ``jnp.float32`` in ``modules`` is float64, so the explicit casts to fp32 they
    make (the demo GPT's logits, attention's fp32 softmax) stay float64 in a reference."""
    saved = [m.jnp for m in modules]
    try:
        for m in modules:
            m.jnp = WideFloat32(jnp)
        yield
    finally:
        for m, j in zip(modules, saved):
            m.jnp = j


# Compiled float64 references, by function and argument shapes: a test's fresh random inputs
# of the same shapes reuse the program (checked for fp32 once, when it was compiled).
_FLOAT64_PROGRAMS: dict = {}


def float64_outputs(fn, *args, widen=(), exact_f32=()):
    """``fn(*args)`` in float64: every floating leaf of ``args`` widened, x64 on, the explicit
    fp32 casts of the modules in ``widen`` kept float64. Fails if the program still holds an
    fp32 value (a model that fixes its dtype would round the reference as well)."""
    def wide(x):
        x = np.asarray(x)
        return x.astype(np.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x

    with jax.enable_x64(True), _float32_reads_as_float64(widen):
        args = jax.tree_util.tree_map(wide, args)
        leaves, treedef = jax.tree_util.tree_flatten(args)
        key = (fn, tuple(widen), treedef, tuple((x.shape, x.dtype) for x in leaves))
        if key not in _FLOAT64_PROGRAMS:
            if len(_FLOAT64_PROGRAMS) >= 256:  # functions made anew per call never hit
                _FLOAT64_PROGRAMS.clear()
            lowered = jax.jit(fn).lower(*args)
            # exact_f32: lines that hold fp32 values exactly (a boolean mask made a 0/1
            # float and compared, as flax's attention masks do) may stay.
            left = [line for line in lowered.as_text().splitlines()
                    if "f32" in line and not any(a in line for a in exact_f32)]
            assert not left, f"the float64 reference still computes in fp32: {left[:3]}"
            _FLOAT64_PROGRAMS[key] = lowered.compile()
        return jax.tree_util.tree_map(np.asarray, _FLOAT64_PROGRAMS[key](*args))


@functools.lru_cache(maxsize=256)
def jitted(fn):
    """``jax.jit(fn)``, one per function: a helper called again with the same function
    (a model's loss, ``value_and_grad_of``) reuses its compiled programs."""
    return jax.jit(fn)


@functools.lru_cache(maxsize=256)
def value_and_grad_of(fn):
    """``jax.value_and_grad(fn)``, one per function (so ``jitted`` of it is reused)."""
    return jax.value_and_grad(fn)


@functools.lru_cache(maxsize=None)
def gpt_losses(model):
    """The demo GPT's loss ``(params, tokens [b, T + 1]) -> scalar`` for ``model`` and for its
    float64 twin; one pair per model configuration (flax modules hash by their fields), so
    every test of the same model reuses the references' compiled programs."""
    import dataclasses

    def loss_with(m):
        return lambda p, b: loss_fn(m.apply({"params": p}, b[:, :-1]), b[:, 1:])

    return loss_with(model), loss_with(GPT(dataclasses.replace(model.config, dtype="float64")))


def assert_rounding_close(actual, expected, rho: float) -> None:
    """Two evaluations of the same outputs that round differently (summation order): each
    within ``rho`` (``FLOAT64_RHO``) of the exact values, so per leaf they differ by at most
    ``2 rho`` of the leaf's largest element (a scalar: of itself). The bound stays 1000x
    below a wrong reduction's error (``GUARDED``)."""
    assert 2 * rho < 1e-3 * GUARDED, rho
    assert_leaves_rel_close(actual, expected, 2 * rho)


def assert_loss_and_grads_close(loss, grads, ref_loss, ref_grads, rho: float) -> None:
    """``assert_rounding_close`` of a loss and its gradients: two evaluations that sum in
    different orders (``rho``: ``FLOAT64_RHO`` for float64 runs)."""
    assert_rounding_close((loss, grads), (ref_loss, ref_grads), rho)


def global_norm_rtol(grads, rho: float, *, unit: float = U64) -> float:
    """Relative tolerance between two runs' global gradient norms, ``grads`` the exact
    gradients, ``unit`` the runs' unit roundoff. The gradients differ by at most
    ``2 rho max|g|`` per leaf (each within rho of the exact ones), which moves the norm by
    at most that difference's own L2 norm (triangle inequality). Each run also rounds the
    norm itself: ``n`` squares (one rounding each) summed in any order (``(n - 1) U`` of
    the sum: the terms are positive, so of the result) and a square root (half the relative
    error, and one rounding): ``(n / 2 + 1) U`` relative, derived, allowed for each run."""
    leaves = [np.asarray(g, np.float64) for g in jax.tree_util.tree_leaves(grads)]
    norm = float(np.sqrt(sum(np.sum(g**2) for g in leaves)))
    moved = 2 * rho * float(np.sqrt(sum(g.size * np.max(np.abs(g))**2 for g in leaves)))
    n = sum(g.size for g in leaves)
    return moved / norm + 2 * (n / 2 + 1) * unit


def clipped(grads, rho: float, max_norm: float, *, unit: float = U64):
    """The exact first gradients after ``clip_by_global_norm(max_norm)`` and the rho that
    bounds the clipped gradients' rounding, for ``trajectory_tolerances``. Clipping scales
    the gradient by ``s = max_norm / ||g||`` (when below 1), from each run's own norm: the
    clipped element moves by ``s (d + |g| delta)`` for a gradient difference ``d = 2 rho
    max|g|`` and a relative norm difference ``delta`` (``global_norm_rtol``), i.e. by
    ``2 (rho + delta / 2) max|s g|``."""
    norm = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64)**2)
                             for g in jax.tree_util.tree_leaves(grads))))
    s = min(1.0, max_norm / norm)
    scaled = jax.tree_util.tree_map(lambda g: s * np.asarray(g, np.float64), grads)
    return scaled, rho + global_norm_rtol(grads, rho, unit=unit) / 2


def adam_sensitivity(eps: float):
    """For ``trajectory_tolerances``: how far Adam's update ``m_hat / (sqrt(v_hat) + eps)``
    moves (in units of lr) per unit change of every gradient, at step ``t``, given the first
    step's exact gradient ``g`` (elementwise magnitudes).

    It moves by at most ``1.25 / (sqrt(v_hat) + eps)``: ``m_hat`` is a weighted mean of the
    gradients (weights summing to 1), ``sqrt(v_hat)`` a weighted L2 norm (1-Lipschitz), and
    ``|m_hat| <= sqrt(v_hat)`` (Cauchy-Schwarz; beta1^2 <= beta2) bounds the second term by a
    quarter of the first. And ``sqrt(v_hat_t) >= |g_1| / sqrt(t)``: the first gradient's
    weight in ``v_hat_t`` is ``beta2^(t-1) (1-beta2) / (1-beta2^t) >= 1/t`` to within 1e-3
    for beta2 = 0.999. Decoupled weight decay (AdamW) only contracts a difference of the
    parameters, so the bound holds for it too."""
    return lambda t, g: 1.25 / (g / np.sqrt(t) + eps)


def momentum_sensitivity(beta: float = 0.0):
    """For ``trajectory_tolerances``: SGD with momentum ``beta`` (0: plain SGD) steps by lr
    times a sum of the gradients so far weighted ``beta^k``, so its update at step ``t``
    moves by at most ``(1 - beta^t) / (1 - beta)`` per unit change of every gradient."""
    return lambda t, g: np.full(np.shape(g), (1 - beta**t) / (1 - beta))


def sign_sensitivity():
    """For ``trajectory_tolerances``: Lion steps by ``sign()`` of a moment, which rounding
    cannot flip unless the moment is within rounding of zero (elements that are zero in
    exact arithmetic: see tests/train/test_mesh_optimizers.py); elsewhere the update does
    not move at all, and weight decay only contracts a difference of the parameters."""
    return lambda t, g: np.zeros(np.shape(g))


def trajectory_tolerances(params, grads, *, rho: float, lr: float, steps: int,
                          sensitivity, seen=None, unit: float = U64) -> list[list[float]]:
    """How far two training runs may drift apart, per leaf, after ``s`` steps
    (``tols[s]``, ``s = 0 .. steps``), when their gradients differ only by rounding
    (each within ``rho * max|g|`` of the exact gradient, see ``FLOAT64_RHO``). ``grads``
    are the first step's exact gradients, ``params`` the parameters (for their storage
    rounding), ``lr`` the largest learning rate of the schedule, ``sensitivity(t, |g|)`` how
    far the optimizer's update moves per unit change of every gradient (``adam_sensitivity``,
    ``momentum_sensitivity``, ``sign_sensitivity``), evaluated at ``seen`` (default
    ``grads``): the first gradients as the optimizer sees them, after an elementwise
    transform such as ``optax.clip``, which moves no element by more than its input moved.

    Per element and step ``t``:
    - The two runs' gradients differ by at most ``d = 2 rho max|g|`` (each is that close
      to the exact one); the parameter moves by ``lr * sensitivity * d``.
    - Each run computes the new parameter ``p - lr u`` in its precision (unit roundoff
      ``unit``, U): the update's own arithmetic (Adam: moments, bias corrections, square
      root, eps, division) and the scaling by lr round ``lr u`` by at most 6 U of itself,
      the store by U of the new parameter, and ``|lr u| <= |p| + |p_new|``: at most
      ``13 U max|p|`` per run and step (``max|p|``
      over the leaf's final values, which stand for every step's: parameters move by a few
      lr).
    - A difference carried from earlier steps changes later gradients through the loss's
      curvature; weighting step ``t``'s term by ``t`` bounds that growth (the terms are ~1e-6
      of the parameters, far inside the quadratic region).
    Per leaf: ``tols[s] = sum_{t <= s} t * (lr d max_i sensitivity(t, |g_i|) + 26 U max|p|)``.
    """
    per_leaf = []
    seen = grads if seen is None else seen
    for p, g, g_seen in zip(*map(jax.tree_util.tree_leaves, (params, grads, seen))):
        d = 2 * rho * float(np.max(np.abs(np.asarray(g, np.float64))))
        g_seen = np.abs(np.asarray(g_seen, np.float64))
        storage = 2 * 13 * unit * float(np.max(np.abs(np.asarray(p, np.float64))))
        tol, tols = 0.0, [0.0]
        for t in range(1, steps + 1):
            tol += t * (lr * d * float(np.max(sensitivity(t, g_seen))) + storage)
            tols.append(tol)
        per_leaf.append(tols)
    return [list(step) for step in zip(*per_leaf)]


def loss_trajectory_tolerance(ref_losses, ref_grads, tols, rho: float) -> np.ndarray:
    """Per step ``t``: how far two fp32 runs' losses may differ, when their parameters
    before the step differ by at most ``tols[t]`` per leaf (``trajectory_tolerances``) and
    ``ref_grads[t]`` is the reference gradient there (``reference_train(with_grads=True)``).
    Each loss lies within ``rho`` of the exact loss at its own parameters (``2 rho |L_t|``),
    and the parameters move it by ``sum_leaf ||g_t||_1 tols[t]`` to first order (the second
    order, ~``tol^2`` times the curvature with tol ~1e-7, is far below)."""
    out = []
    for t, (loss, g) in enumerate(zip(ref_losses, ref_grads)):
        moved = sum(float(np.sum(np.abs(np.asarray(x, np.float64)))) * tol
                    for x, tol in zip(jax.tree_util.tree_leaves(g), tols[t]))
        out.append(2 * rho * abs(float(loss)) + moved)
    return np.asarray(out)


def assert_far_below_updates(tols, ref_params, start) -> None:
    """A wrong reduction moves parameters by a whole update (Adam normalizes a wrong or
    missing share into any direction): each leaf's trajectory bound must stay 100x below
    that leaf's update (Adam's eps-limited elements put it near 1e-3 of the update on the
    test GPT; 100x leaves room for CPUs that round more). A leaf that does not move (its
    gradient cancels exactly: a bias before a normalization) has no update to guard."""
    updates = [np.asarray(e, np.float64) - np.asarray(s, np.float64)
               for e, s in zip(*map(jax.tree_util.tree_leaves, (ref_params, start)))]
    for tol, update, scale in zip(tols, updates, leaf_scales(updates)):
        update = float(np.max(np.abs(update)))
        if update < scale:  # it vanishes next to the others: its gradient cancels exactly
            continue
        assert tol < 1e-2 * update, (tol, update)


def assert_training_close(losses, params, ref_losses, ref_params, ref_grads, tols,
                          rho: float, *, start) -> None:
    """Two fp32 training runs from ``start``: the losses of every step within
    ``loss_trajectory_tolerance``, the final parameters within ``tols[-1]`` per leaf
    (``trajectory_tolerances``), a bound far below a wrong update
    (``assert_far_below_updates``)."""
    assert_far_below_updates(tols[-1], ref_params, start)
    bound = loss_trajectory_tolerance(ref_losses, ref_grads, tols, rho)
    err = np.abs(np.asarray(losses, np.float64) - np.asarray(ref_losses, np.float64))
    assert np.all(err <= bound), (err, bound)
    assert_leaves_within(params, ref_params, tols[-1])


def zoo_train_step(entry):
    """A zoo entry's train step written as its user writes it (the entry's loss, plain
    ``jax.value_and_grad``), its state donated: the step whose compiled memory the planner
    tests read."""

    @zpp.train_step(donate_state=True)
    def step(state, batch):
        loss, g = jax.value_and_grad(
            lambda p: entry.loss(state.apply_fn, p, batch, False))(state.params)
        return state.apply_gradients(grads=g), {"loss": loss}

    return step
