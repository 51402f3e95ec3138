"""Units that draw randomness (dropout): forward and backward must see the same mask."""

from __future__ import annotations

from fractions import Fraction

import flax.linen as nn
import jax
import numpy as np
import optax

import zeropp_jax as zpp

from helpers import (FLOAT64, FLOAT64_RHO, U64, as_float64, float64_run, fresh_seed,
                     seed_on_failure)


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(8)(x))


class _Model(nn.Module):
    """Two units, no activation between them: at fixed masks the loss ``mean(y^2)`` is a
    polynomial of degree 4 along any line in parameter space (each Dense is linear in its
    kernel and bias, the second one's input linear in the first's), which the finite
    differences below differentiate exactly."""

    @nn.compact
    def __call__(self, x, train: bool = True):
        return _Block(name="b1")(_Block(name="b0")(x, train), train)


def _loss_and_grads(params, x, key):
    """The float64 ZeRO-3 step's loss and gradients at ``params`` (float64)."""
    with float64_run():
        state = zpp.TrainState.create(
            model=_Model(), params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
            config=zpp.ZeroPPConfig.zero3(**FLOAT64),
        )

        @zpp.train_step
        def step(state, batch, key):
            def loss_of(p):
                y = state.apply_fn({"params": p}, batch, True, rngs={"dropout": key})
                return (y**2).mean()

            loss, g = jax.value_and_grad(loss_of)(state.params)
            return state, {"loss": loss, "grads": g}

        _, out = step(state, x, key)
        return float(out["loss"]), state.engine.consolidate(out["grads"])


def _gamma(n: int) -> float:
    """Higham's gamma_n = n U / (1 - n U) (float64): the relative error of n roundings."""
    return n * U64 / (1 - n * U64)


def test_dropout_keys_reach_units_and_backward_reuses_them():
    seed = fresh_seed()  # fresh inputs each run
    with seed_on_failure(seed):
        _check_dropout_keys(seed)


def _check_dropout_keys(seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 8))  # float64
    params = as_float64(_Model().init(jax.random.PRNGKey(seed), x.astype(np.float32),
                                      False)["params"])
    key = jax.random.PRNGKey(1)
    loss, grads = _loss_and_grads(params, x, key)
    assert _loss_and_grads(params, x, key)[0] == loss  # deterministic in the key
    assert _loss_and_grads(params, x, jax.random.PRNGKey(2))[0] != loss  # masks change
    # The directional derivative <g, d> against finite differences of the step's losses
    # with the same key (same masks). If backward recomputed the units with other masks,
    # <g, d> would be off by a sizable fraction of sum |g_i d_i|.
    # The points params + t d, t = k eps: eps a power of two and d on a grid of 2^-12
    # make t d exact, and params + t d is checked to be exact (so f(t) is the loss on the
    # line, not near it).
    eps = 2.0**-3
    d = jax.tree_util.tree_map(
        lambda p: np.round(rng.standard_normal(np.shape(p)) * 4096) / 4096, params)
    f = {}
    for k in (-2, -1, 1, 2):
        point = jax.tree_util.tree_map(lambda p, v: p + k * eps * v, params, d)
        for a, p, v in zip(*map(jax.tree_util.tree_leaves, (point, params, d))):
            assert all(Fraction(float(ai)) == Fraction(float(pi)) + k * Fraction(eps)
                       * Fraction(float(vi)) for ai, pi, vi in zip(a.flat, p.flat, v.flat))
        f[k] = _loss_and_grads(point, x, key)[0]
    # Five points: exact for a polynomial of degree <= 4 (its error term is
    # eps^4 f^(5) / 30 = 0), so fd differs from f'(0) by rounding only: each loss within
    # FLOAT64_RHO of itself (the float64 runs' derived allowance, tests/helpers.py: this
    # model's sums hold at most 128 terms, the test GPT's more), times the stencil's
    # coefficients (1 + 8 + 8 + 1), plus the stencil's own 3 additions and division
    # (gamma_4 of the same sum of magnitudes), over 12 eps.
    fd = (f[-2] - 8 * f[-1] + 8 * f[1] - f[2]) / (12 * eps)
    f_max = max(abs(v) for v in f.values())
    fd_tol = (18 * FLOAT64_RHO + 18 * _gamma(4)) * f_max / (12 * eps)
    gd = [(np.asarray(g, np.float64), v) for g, v in
          zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(d))]
    analytic = sum(float(np.sum(g * v)) for g, v in gd)
    # Each gradient leaf within FLOAT64_RHO of its largest element (its own largest
    # element is that far from the exact one's too: the factor 1 + 2 rho), plus the
    # float64 dot product here (n products and sums: gamma_(n+1) of sum |g_i d_i|).
    terms = sum(float(np.sum(np.abs(g * v))) for g, v in gd)
    n = sum(g.size for g, _ in gd)
    an_tol = (FLOAT64_RHO * (1 + 2 * FLOAT64_RHO) * sum(
        float(np.max(np.abs(g))) * float(np.sum(np.abs(v))) for g, v in gd)
        + _gamma(n + 1) * terms)
    tol = fd_tol + an_tol
    # The bound is far below what a mask mismatch moves <g, d> by.
    assert tol < 1e-4 * terms, (tol, terms)
    assert abs(fd - analytic) <= tol, (
        f"finite differences {fd!r}, <g, d> {analytic!r}: {abs(fd - analytic):.3g} > "
        f"{tol:.3g}")


def test_dropout_masks_differ_per_device():
    """Data parallelism: each device's batch shard draws its own masks. Every device gets
    the same rows here, so identical masks would give identical per-device losses."""
    x = np.tile(np.random.default_rng(3).standard_normal((1, 8)).astype(np.float32), (8, 1))
    params = _Model().init(jax.random.PRNGKey(0), x, False)["params"]
    state = zpp.TrainState.create(
        model=_Model(), params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"),
    )

    @zpp.train_step
    def step(state, batch, key):
        y = state.apply_fn({"params": state.params}, batch, True, rngs={"dropout": key})
        return state, {"per_device": jax.lax.all_gather((y**2).mean(), ("node", "local"))}

    _, out = step(state, x, jax.random.PRNGKey(5))
    per_device = np.asarray(out["per_device"])
    assert per_device.shape == (8,)
    assert len(np.unique(per_device)) == 8, per_device
