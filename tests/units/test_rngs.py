"""Units that draw randomness (dropout): forward and backward must see the same mask."""

from __future__ import annotations

import flax.linen as nn
import jax
import numpy as np
import optax

import zeropp_jax as zpp


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool):
        return nn.Dropout(0.5, deterministic=not train)(nn.Dense(8)(x))


class _Model(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        return _Block(name="b1")(jax.nn.tanh(_Block(name="b0")(x, train)), train)


def _loss_and_grads(params, x, key):
    model = _Model()
    state = zpp.TrainState.create(
        model=model, params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"),
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


def test_dropout_keys_reach_units_and_backward_reuses_them():
    seed = int(np.random.default_rng().integers(1 << 16))  # fresh inputs each run
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    params = _Model().init(jax.random.PRNGKey(seed), x, False)["params"]
    key = jax.random.PRNGKey(1)
    loss, grads = _loss_and_grads(params, x, key)
    assert _loss_and_grads(params, x, key)[0] == loss  # deterministic in the key
    assert _loss_and_grads(params, x, jax.random.PRNGKey(2))[0] != loss  # masks change
    # Directional derivative by central differences with the same key (same masks). If
    # backward recomputed the units with other masks, <g, d> would be off by O(1).
    d = jax.tree_util.tree_map(
        lambda p: rng.standard_normal(np.shape(p)).astype(np.float32), params
    )
    eps = 1e-3
    plus = jax.tree_util.tree_map(lambda p, v: p + eps * v, params, d)
    minus = jax.tree_util.tree_map(lambda p, v: p - eps * v, params, d)
    fd = (_loss_and_grads(plus, x, key)[0] - _loss_and_grads(minus, x, key)[0]) / (2 * eps)
    analytic = sum(
        float(np.sum(g * v))
        for g, v in zip(jax.tree_util.tree_leaves(grads), jax.tree_util.tree_leaves(d))
    )
    # fp32 loss ~1 has rounding ~1e-7; divided by 2*eps that is ~1e-4 absolute, and the
    # O(eps^2) truncation term of a degree-4 polynomial is smaller still.
    np.testing.assert_allclose(fd, analytic, rtol=2e-3, atol=5e-4, err_msg=f"seed {seed}")


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
