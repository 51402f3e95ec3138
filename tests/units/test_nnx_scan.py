"""Flax NNX's scan-over-layers idiom under ZeRO-3: one unit per layer on defaults.

The stack is built as Flax's docs show (``nnx.split_rngs`` + ``nnx.vmap`` create it,
``nnx.scan(in_axes=(0, nnx.Carry))`` runs it, ``nnx.remat`` inside), in both of Flax's
forms: a scanned function that takes the stack, and the NNX guide's decorated methods
(``__init__`` under ``nnx.vmap``, ``__call__`` under ``nnx.scan``). The default policy
finds the stack by its parameters' common leading layer axis; each layer's primary shard
rides the scan beside the layer's weights, so every iteration gathers only its own layer.
"""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeropp_jax as zpp
from helpers import assert_loss_and_grads_close, loss_and_grads_rounding

FP32 = zpp.ZeroPPConfig(compute_dtype="float32")
LAYERS, WIDTH = 4, 16


class Block(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
        self.lin = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x):
        return x + jax.nn.gelu(self.lin(self.norm(x)))


class ScanNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(3, WIDTH, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return Block(rngs)

        self.stack = make(rngs)
        self.head = nnx.Linear(WIDTH, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def run(block, x):
            return block(x)

        return self.head(run(self.stack, self.embed(x)))


@pytest.fixture(scope="module")
def mesh():
    return zpp.make_mesh(nodes=2, local=4)


def _loss(graphdef, params, x):
    return jnp.mean(nnx.merge(graphdef, params)(x) ** 2)


def test_nnx_scan_stack_is_a_unit_per_layer_and_exact(mesh):
    model = ScanNet(nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    graphdef, params = nnx.split(model, nnx.Param)
    state = zpp.TrainState.create(model=model, params=None, tx=optax.sgd(0.1), mesh=mesh,
                                  config=FP32)
    assert sorted(n for n in state.engine.layouts if n.startswith("stack")) == [
        f"stack[{i}]" for i in range(LAYERS)]
    x = jax.random.normal(jax.random.key(int(np.random.default_rng().integers(1 << 30))),
                          (16, 3))

    @zpp.train_step
    def step(state, x):
        def loss(p):
            return jnp.mean(state.apply_fn({"params": p, **state.collections}, x) ** 2)

        value, g = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=g), {"loss": value, "grads": g}

    _, out = step(state, x)
    grads = state.engine.adapter.to_pure_dict(state.engine.consolidate(out["grads"]))
    loss_of = functools.partial(_loss, graphdef)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_of))(params, x)
    # fp32 on both sides; only the summation order differs (8 row slices vs one batch).
    rho = loss_and_grads_rounding(loss_of, params, x).rho
    assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads.to_pure_dict(), rho)


def test_whole_nnx_stack_as_one_unit_names_the_fix(mesh):
    state = zpp.TrainState.create(model=ScanNet(nnx.Rngs(0)), params=None,
                                  tx=optax.sgd(0.1), mesh=mesh, config=FP32,
                                  units=["stack", "embed", "head"])

    @zpp.train_step
    def step(state, x):
        return jnp.mean(state.apply_fn({"params": state.params}, x))

    with pytest.raises(ValueError, match="stacked="):
        step(state, jnp.ones((8, 3)))


class GuideStack(nnx.Module):
    """Flax's NNX guide form: the transforms decorate the stack's own methods."""

    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=(0, 0))
    def __init__(self, rngs):
        self.block = Block(rngs)

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    @nnx.remat
    def __call__(self, x):
        return self.block(x)


class GuideNet(nnx.Module):
    def __init__(self, rngs):
        self.embed = nnx.Linear(3, WIDTH, rngs=rngs)
        self.stack = GuideStack(rngs)
        self.head = nnx.Linear(WIDTH, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.stack(self.embed(x)))


def test_nnx_guide_form_decorated_methods_is_a_unit_per_layer_and_exact(mesh):
    seeds = np.random.default_rng()
    model = GuideNet(nnx.Rngs(int(seeds.integers(1 << 30))))
    graphdef, params = nnx.split(model, nnx.Param)
    state = zpp.TrainState.create(model=model, params=None, tx=optax.sgd(0.1), mesh=mesh,
                                  config=FP32)
    assert sorted(n for n in state.engine.layouts if n.startswith("stack")) == [
        f"stack[{i}]" for i in range(LAYERS)]
    x = jax.random.normal(jax.random.key(int(seeds.integers(1 << 30))), (16, 3))

    @zpp.train_step
    def step(state, x):
        def loss(p):
            return jnp.mean(state.apply_fn({"params": p, **state.collections}, x) ** 2)

        value, g = jax.value_and_grad(loss)(state.params)
        return state.apply_gradients(grads=g), {"loss": value, "grads": g}

    _, out = step(state, x)
    grads = state.engine.adapter.to_pure_dict(state.engine.consolidate(out["grads"]))
    loss_of = functools.partial(_loss, graphdef)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss_of))(params, x)
    rho = loss_and_grads_rounding(loss_of, params, x).rho
    assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads.to_pure_dict(), rho)
    # Gathered inside the scan body, one layer at a time: the program has gathers of one
    # layer's buffer [n_pad], fewer than the layers (the loop body's forward and backward),
    # and none of the whole stack. (Lowering is cached from the call: ~0.2 s.)
    text = step.lower(state, x).as_text()
    moved = [int(n) for n in re.findall(r"all_gather.*-> tensor<(\d+)xf32>", text)]
    layer = state.engine.layouts["stack[0]"].n_pad
    assert 1 <= moved.count(layer) < LAYERS and LAYERS * layer not in moved, moved
