"""Shared pieces of the tests: a small GPT, a single-device reference, comparisons."""

from __future__ import annotations

import functools
import os

import jax
import numpy as np
import optax

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT, GPTConfig, loss_fn

# d_model=20 makes every unit's size a non-multiple of 8 devices (padding needed), and
# logit_scale is a root-level scalar: a unit with fewer elements than devices.
SMALL = GPTConfig(vocab_size=64, seq_len=12, layers=2, d_model=20, heads=4, logit_scale=True)


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
    device count (the child simulates its own), keeping the suite's compile flags
    (conftest.COMPILE_FLAGS)."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    keep = [f for f in os.environ.get("XLA_FLAGS", "").split()
            if f.startswith("--xla_backend_optimization_level")]
    if keep:
        env["XLA_FLAGS"] = " ".join(keep)
    env.update(extra)
    return env


def tokens(batch: int, seq_len: int = SMALL.seq_len, *, seed: int) -> np.ndarray:
    """Fresh random tokens ``int32 [batch, seq_len + 1]``."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, SMALL.vocab_size, (batch, seq_len + 1)).astype(np.int32)


def init_params(cfg: GPTConfig = SMALL, seed: int = 0) -> dict:
    model = GPT(cfg)
    params = model.init(jax.random.PRNGKey(seed), tokens(2, cfg.seq_len, seed=seed)[:, :-1])
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


def reference_train(model, params, tx, batches):
    """Plain single-device training: params after ``len(batches)`` steps and the losses."""
    with jax.default_device(jax.devices()[0]):
        state = tx.init(params)
        losses = []
        for b in batches:
            loss, g = reference_loss_and_grads(model, params, b)
            u, state = tx.update(g, state, params)
            params = optax.apply_updates(params, u)
            losses.append(float(loss))
    return params, losses


def assert_trees_close(actual, expected, *, rtol: float, atol: float = 0.0) -> None:
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        np.testing.assert_allclose(
            np.asarray(a), np.asarray(e), rtol=rtol, atol=atol, err_msg=jax.tree_util.keystr(path)
        )


def assert_leaves_rel_close(actual, expected, rel: float) -> None:
    """Per leaf: max |a - e| <= rel * max |e| (a relative error that does not blow up on
    elements that happen to be near zero)."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_leaves(expected)
    assert len(flat_a) == len(flat_e)
    for (path, a), e in zip(flat_a, flat_e):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape, jax.tree_util.keystr(path)
        err, scale = np.max(np.abs(a - e)), np.max(np.abs(e))
        assert err <= rel * scale, f"{jax.tree_util.keystr(path)}: {err:.3g} > {rel} * {scale:.3g}"


def relative_error(actual, expected) -> float:
    """max |a - e| / max |e| over a whole tree (scale-free, robust to tiny elements)."""
    a = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(actual)])
    e = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(expected)])
    return float(np.max(np.abs(a - e)) / np.max(np.abs(e)))


def assert_updates_close(actual, expected, start, rel: float, steps: int = 3) -> None:
    """Per leaf: what training changed (``actual - start`` vs ``expected - start``) agrees to
    ``rel`` of the largest change, plus the fp32 rounding of the stored parameters
    themselves: each step rounds a parameter to half an ulp of its magnitude, so ``steps``
    steps in two runs may differ by up to ``steps`` ulps (2^-23 relative) of max |param|."""
    flat_a = jax.tree_util.tree_flatten_with_path(actual)[0]
    flat_e = jax.tree_util.tree_leaves(expected)
    flat_s = jax.tree_util.tree_leaves(start)
    assert len(flat_a) == len(flat_e) == len(flat_s)
    for (path, a), e, s in zip(flat_a, flat_e, flat_s):
        a, e, s = (np.asarray(x, np.float64) for x in (a, e, s))
        err = np.max(np.abs(a - e))
        limit = rel * np.max(np.abs(e - s)) + steps * 2.0**-23 * np.max(np.abs(e))
        assert err <= limit, f"{jax.tree_util.keystr(path)}: {err:.3g} > {limit:.3g}"


# fp32's unit roundoff: half an ulp of 1.0.
U32 = 2.0**-24


def fp32_gradient_rounding(model, params, batch) -> float:
    """How far an fp32 gradient of this model lies from the exact one, on this CPU.

    Returns ``(rho, g64)``: ``rho = max over leaves of max|g32 - g64| / max|g64|``, the
    single-device fp32 gradient against the same gradient in float64 (exact to fp32's
    resolution), and the float64 gradients. It is measured rather than assumed because it
    depends on the CPU's kernels (FMA, vector width, the blocking of XLA's dot and reduce
    emitters): a fixed ``1e-6`` that held on one x86 CPU failed on an AMD EPYC without
    AVX-512 (rho ~7.5e-7 there on the small test GPT). A sharded gradient is another fp32
    evaluation of the same sums in another order (plus one more level: the mean of the
    device partials), so its error has the same size; tolerances use ``rho`` for each run.
    """
    _, g32 = reference_loss_and_grads(model, params, batch)
    with jax.enable_x64(True):
        p64 = jax.tree_util.tree_map(lambda x: np.asarray(x, np.float64), params)
        _, g64 = reference_loss_and_grads(model, p64, batch)
        g64 = jax.tree_util.tree_map(np.asarray, g64)
    rho = max(
        float(np.max(np.abs(np.asarray(a, np.float64) - e)) / np.max(np.abs(e)))
        for a, e in zip(jax.tree_util.tree_leaves(g32), jax.tree_util.tree_leaves(g64))
    )
    # Floor at a few roundoffs: a CPU that happens to round this batch exactly must not
    # make the bound tighter than fp32 can promise for another summation order.
    return max(rho, 4 * U32), g64


def adam_trajectory_tolerance(params, grads, *, lr: float, eps: float, steps: int,
                              rho: float) -> list:
    """Per leaf: how far two fp32 Adam trajectories of ``steps`` steps may drift apart when
    their gradients differ only by fp32 rounding (each within ``rho * max|g|`` of the exact
    gradient, see ``fp32_gradient_rounding``). ``grads`` are the first step's exact
    gradients, ``params`` the parameters (for their storage rounding).

    Derivation, per element and step ``t``:
    - Adam's update ``u = m_hat / (sqrt(v_hat) + eps)`` moves by at most
      ``1.25 d / (sqrt(v_hat) + eps)`` when every gradient moves by ``d``: ``m_hat`` is a
      weighted mean of the gradients (weights summing to 1), ``sqrt(v_hat)`` a weighted L2
      norm (1-Lipschitz), and ``|m_hat| <= sqrt(v_hat)`` (Cauchy-Schwarz; beta1^2 <= beta2)
      bounds the second term by a quarter of the first.
    - ``sqrt(v_hat_t) >= |g_1| / sqrt(t)``: the first gradient's weight in ``v_hat_t`` is
      ``beta2^(t-1) (1-beta2) / (1-beta2^t) >= 1/t`` to within 1e-3 for beta2 = 0.999.
    - The two runs' gradients differ by at most ``d = 2 rho max|g|`` (each is that close
      to the exact one); the parameter moves by ``lr * du``.
    - Each run rounds the stored parameter once per step: half an ulp of ``max|p|`` each.
    - A difference carried from earlier steps changes later gradients through the loss's
      curvature; weighting step ``t``'s term by ``t`` bounds that growth (the terms are ~1e-6
      of the parameters, far inside the quadratic region).
    Per leaf: ``tol = sum_t t * (max_i 1.25 lr d / (|g_1,i|/sqrt(t) + eps) + 2 U32 max|p|)``.
    """
    tols = []
    for p, g in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(grads)):
        g = np.abs(np.asarray(g, np.float64))
        d = 2 * rho * float(np.max(g))
        tol = 0.0
        for t in range(1, steps + 1):
            du = float(np.max(1.25 * d / (g / np.sqrt(t) + eps)))
            tol += t * (lr * du + 2 * U32 * float(np.max(np.abs(p))))
        tols.append(tol)
    return tols


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
