"""``nn.scan`` layer stacks (the MaxText way of writing deep models): each layer is a unit,
and each scan iteration gathers only its own layer. The parity tests run both sides in
float64 (the derived tolerance of tests/helpers.py, ``FLOAT64_RHO``)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp

from helpers import (
    FLOAT64,
    FLOAT64_RHO,
    U64,
    as_float64,
    assert_loss_and_grads_close,
    float64_run,
    fresh_seed,
    seed_on_failure,
)

D = 16


class _Layer(nn.Module):
    d: int = D

    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(self.d)(jax.nn.gelu(nn.Dense(2 * self.d)(h))), None


class _Scanned(nn.Module):
    layers: int = 4
    d: int = D

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(self.d, name="inp")(x)
        stack = nn.scan(_Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=self.layers)
        x, _ = stack(self.d, name="layers")(x, None)
        return nn.Dense(4, name="out")(x)


class _Unrolled(nn.Module):
    """The same computation with the layers written out (``layers_i``)."""

    layers: int = 4

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="inp")(x)
        for i in range(self.layers):
            x, _ = _Layer(name=f"layers_{i}")(x, None)
        return nn.Dense(4, name="out")(x)


def _unrolled_params(scanned: dict, layers: int) -> dict:
    out = {k: v for k, v in scanned.items() if k != "layers"}
    for i in range(layers):
        out[f"layers_{i}"] = jax.tree_util.tree_map(lambda x: x[i], scanned["layers"])
    return out


def _step():
    @zpp.train_step
    def step(state, batch):
        def loss_of(p):
            return jnp.mean((state.apply_fn({"params": p}, batch["x"]) - batch["y"]) ** 2)

        loss, g = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=g), {"loss": loss, "grads": g}

    return step


def _mse(model):
    """The loss of ``_step`` as ``loss_of(params, batch)``, for the one-device references."""
    return lambda p, b: jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)


@functools.partial(jax.jit, static_argnums=0)
def _ref_loss_and_grads(model, params, batch):
    """``jax.value_and_grad`` of ``_mse(model)`` on one device, jitted."""
    return jax.value_and_grad(_mse(model))(params, batch)


@functools.partial(jax.jit, static_argnums=0)
def _init(model, key, x):
    """``model.init(key, x)`` as one program: run eagerly, flax's init compiles a program
    per operation and shape (~50 for these models). One program per model and shapes."""
    return model.init(key, x)


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((16, 8)).astype(np.float32),
            "y": rng.standard_normal((16, 4)).astype(np.float32)}


@pytest.mark.parametrize("remat", ["minimal", "full"])
def test_scanned_stack_equals_single_device_and_unrolled(remat):
    seed = fresh_seed()
    batch = as_float64(_batch(seed))
    params = as_float64(_init(_Scanned(), jax.random.PRNGKey(seed + 1), batch["x"][:2])["params"])
    with float64_run():
        state = zpp.TrainState.create(
            model=_Scanned(), params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
            config=zpp.ZeroPPConfig(remat=remat, **FLOAT64), stacked=["layers"])
        assert sorted(n for n in state.engine.layouts if n.startswith("layers")) == [
            f"layers[{i}]" for i in range(4)]
        new, out = _step()(state, batch)

        # One-device references, jitted (one program each instead of op by op).
        loss, grads = _ref_loss_and_grads(_Scanned(), params, batch)
        unrolled = _unrolled_params(params, 4)
        u_loss, u_grads = _ref_loss_and_grads(_Unrolled(), unrolled, batch)
    # float64: the three runs (sharded, scanned, unrolled) differ only in summation order;
    # each is within the derived float64 rounding of the exact values.
    rho = FLOAT64_RHO
    got = state.engine.consolidate(out["grads"])
    assert jax.tree_util.tree_map(np.shape, got) == jax.tree_util.tree_map(np.shape, grads)
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], got, loss, grads, rho)
        assert_loss_and_grads_close(u_loss, _unrolled_params(got, 4), loss, u_grads, rho)
    # The update lands on the stacked parameters: consolidate gives the layer axis back.
    # p - 0.1 g in float64 in both, from gradients 2 rho apart: 0.1 * 2 rho max|g| per
    # leaf, plus each run's two roundings (of 0.1 g, and of the new parameter: U64 of
    # each); a missing or misplaced layer's update moves it by a whole 0.1 g.
    # (in float64 numpy: the same two roundings as jnp, without a program per leaf shape)
    expected = jax.tree_util.tree_map(
        lambda p, g: np.asarray(p) - 0.1 * np.asarray(g, np.float64), params, grads)
    for g, e, a in zip(*map(jax.tree_util.tree_leaves, (grads, expected, new.consolidate()))):
        step = 0.1 * np.max(np.abs(g))
        tol = 2 * rho * step + 2 * U64 * (step + np.max(np.abs(e)))
        assert tol < 1e-2 * step
        with seed_on_failure(seed):
            assert np.max(np.abs(np.asarray(a, np.float64) - e)) <= tol


def _compiled(layers):
    # Wide layers and 1 row per device: weights dominate activations.
    x = np.zeros((8, 8), np.float32)
    model = _Scanned(layers, d=128)
    # Zeros of the parameters' shapes: the compiled program and its buffer sizes depend on
    # shapes and dtypes only (no init program to run).
    shapes = jax.eval_shape(model.init, jax.random.PRNGKey(0), x[:2])["params"]
    params = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=zpp.ZeroPPConfig(),
                                  stacked=["layers"])
    return state, _step().lower(state, {"x": x, "y": np.zeros((8, 4), np.float32)}).compile()


def test_one_gather_per_iteration_and_memory_flat_in_depth():
    """The scan body gathers one layer: the program text has the same gathers at 4 and 8
    layers, and temp memory does not grow by a layer's weights per added layer."""
    s4, c4 = _compiled(4)
    s8, c8 = _compiled(8)
    gathers = lambda c: c.as_text().count(" all-gather(")  # noqa: E731
    assert gathers(c4) == gathers(c8)
    layer_bytes = s4.engine.layouts["layers[0]"].n_pad * 2  # bf16 gathered weights
    growth = (c8.memory_analysis().temp_size_in_bytes
              - c4.memory_analysis().temp_size_in_bytes) / 4
    assert growth <= 0.5 * layer_bytes, (growth, layer_bytes)


def test_default_policy_finds_the_stack_and_other_policies_name_the_fix():
    batch = _batch(1)
    params = _init(_Scanned(), jax.random.PRNGKey(0), batch["x"][:2])["params"]
    state = zpp.TrainState.create(model=_Scanned(), params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4))
    assert [n for n in state.engine.layouts if n.startswith("layers")] == [
        f"layers[{i}]" for i in range(_Scanned.layers)]
    state = zpp.TrainState.create(model=_Scanned(), params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), units="children")
    with pytest.raises(ValueError, match=r"stacked=\['layers'\]"):
        _step()(state, batch)


def test_stacked_path_must_be_a_stack():
    # Zeros of the parameters' shapes: the check reads the tree's structure only.
    shapes = jax.eval_shape(_Unrolled().init, jax.random.PRNGKey(0),
                            np.zeros((2, 8), np.float32))["params"]
    params = jax.tree_util.tree_map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    with pytest.raises(ValueError, match="not an nn.scan stack"):
        zpp.TrainState.create(model=_Unrolled(), params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4), stacked=["inp"])


class _BoxedLayer(nn.Module):
    """``_Layer`` with MaxText's logically partitioned kernels (boxed parameters)."""

    @nn.compact
    def __call__(self, x, _):
        boxed = lambda names: nn.with_logical_partitioning(  # noqa: E731
            nn.initializers.lecun_normal(), names)
        h = nn.LayerNorm(scale_init=nn.with_logical_partitioning(nn.initializers.ones,
                                                                 ("embed",)))(x)
        h = nn.Dense(2 * D, kernel_init=boxed(("embed", "mlp")))(h)
        return x + nn.Dense(D, kernel_init=boxed(("mlp", "embed")))(jax.nn.gelu(h)), None


class _BoxedScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(D, name="inp")(x)
        stack = nn.scan(_BoxedLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=4, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(4, name="out")(x)


def test_boxed_scan_stack_is_found_on_defaults_and_exact():
    """Parameters passed with their boxes (``init(...)["params"]`` of a model using
    ``nn.with_logical_partitioning`` under ``nn.scan(metadata_params=...)``): the default
    policy sees through the boxes, makes each layer a unit, and the step equals one device."""
    seed = fresh_seed()
    batch = as_float64(_batch(seed))
    model = _BoxedScanned()
    # The boxes stay (as_float64 maps their values).
    boxed = as_float64(_init(model, jax.random.PRNGKey(seed + 1), batch["x"][:2])["params"])
    assert any(isinstance(x, nn.Partitioned) for x in jax.tree_util.tree_leaves(
        boxed, is_leaf=lambda x: isinstance(x, nn.Partitioned)))
    with float64_run():
        state = zpp.TrainState.create(model=model, params=boxed, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig(**FLOAT64))
        assert sorted(n for n in state.engine.layouts if n.startswith("layers")) == [
            f"layers[{i}]" for i in range(4)]
        _, out = _step()(state, batch)
        params = nn.meta.unbox(boxed)
        loss, grads = _ref_loss_and_grads(model, params, batch)
    # float64; the runs differ only in summation order (8 row slices vs one batch): each
    # within the derived float64 rounding of the exact values.
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], state.engine.consolidate(out["grads"]),
                                    loss, grads, FLOAT64_RHO)
