"""An abstract train state (``TrainState.create`` on ``jax.eval_shape`` params): every array
a ``ShapeDtypeStruct`` with the sharding the real state's array has, and a step lowered from
it is the program a real state's step lowers to, so it can be compiled ahead of time for a
model or a mesh this host cannot hold."""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

import zeropp_jax as zpp
import zoo
from helpers import fresh_seed, SMALL, init_params, make_step, tokens
from zeropp_demo.gpt import GPT

STEP = make_step()

CONFIGS = {
    "zero3": zpp.ZeroPPConfig(),
    # qgZ's error feedback keeps per-unit state in the params; hpZ a secondary group.
    "zeropp_feedback": zpp.ZeroPPConfig(qwz=True, hpz=True, qgz=True, qgz_error_feedback=True),
    "stage2": zpp.ZeroPPConfig(stage=2),
    "offload": zpp.ZeroPPConfig(offload_optimizer=True, offload_ratio=0.5),
}


def _abstract(tree):
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _described(tree):
    return [(jax.tree_util.keystr(p), tuple(x.shape), np.dtype(x.dtype), x.sharding)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_abstract_state_lowers_to_the_real_states_program(name):
    config, mesh = CONFIGS[name], zpp.make_mesh(2, 4)
    params = init_params(seed=fresh_seed())
    tx = optax.adamw(1e-3, weight_decay=0.1)
    real = zpp.TrainState.create(model=GPT(SMALL), params=params, tx=tx, mesh=mesh,
                                 config=config)
    abstract = zpp.TrainState.create(model=GPT(SMALL), params=_abstract(params), tx=tx,
                                     mesh=mesh, config=config)
    leaves = jax.tree_util.tree_leaves(abstract)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert all(isinstance(x.sharding, NamedSharding) for x in leaves)
    # Same tree, shapes, dtypes, shardings (memory kinds included) and layouts.
    assert _described(abstract) == _described(real)
    assert abstract.engine.layouts == real.engine.layouts
    batch = tokens(16, seed=1)
    lowered_real = STEP.lower(real, batch).as_text()
    lowered_abstract = STEP.lower(abstract, _abstract(batch)).as_text()
    assert lowered_abstract == lowered_real


def test_abstract_state_refuses_what_it_cannot_build():
    params = init_params()
    mesh = zpp.make_mesh(2, 4)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    mixed = jax.tree_util.tree_unflatten(
        treedef, [_abstract(leaves[0]), *leaves[1:]])
    with pytest.raises(TypeError, match="mixes jax.ShapeDtypeStruct"):
        zpp.TrainState.create(model=GPT(SMALL), params=mixed, tx=optax.sgd(0.1), mesh=mesh)
    with pytest.raises(NotImplementedError, match="frozen="):
        zpp.TrainState.create(model=GPT(SMALL), params=_abstract(params), tx=optax.sgd(0.1),
                              mesh=mesh, frozen=lambda path: "wte" in path)


def test_abstract_scan_stack_lowers_to_the_real_states_program():
    # A scanned stack (each layer its own unit, cut from the leading layer axis).
    entry = zoo.scan_stack()
    mesh, tx = zpp.make_mesh(2, 4), optax.adam(1e-3)

    @zpp.train_step
    def step(state, batch):
        loss, grads = jax.value_and_grad(
            lambda p: entry.loss(state.apply_fn, p, batch, True))(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    real = zpp.TrainState.create(model=entry.model, params=entry.params, tx=tx, mesh=mesh)
    abstract = zpp.TrainState.create(model=entry.model, params=_abstract(entry.params),
                                      tx=tx, mesh=mesh)
    assert len(real.engine.layouts) > 2  # one unit per layer, and the rest
    assert _described(abstract) == _described(real)
    batch = entry.make_batch(np.random.default_rng(fresh_seed()), 8)
    assert (step.lower(abstract, _abstract(batch)).as_text()
            == step.lower(real, batch).as_text())
