"""Bad input gets a clear error naming the fix."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT

from helpers import SMALL, init_params, make_step, tokens


@pytest.fixture(scope="module")
def state():
    return zpp.TrainState.create(
        model=GPT(SMALL), params=init_params(), tx=optax.adam(1e-3), mesh=zpp.make_mesh(2, 4)
    )


def test_batch_not_divisible_by_devices(state):
    with pytest.raises(ValueError, match="not divisible by the 8 devices"):
        make_step()(state, tokens(12, seed=0))


def test_batch_leaves_must_agree_and_not_be_empty(state):
    @zpp.train_step
    def step(state, batch):
        return state, {}

    x = tokens(16, seed=0)
    with pytest.raises(ValueError, match=r"disagree on their leading.*'x'.*16.*'y'.*8"):
        step(state, {"x": x, "y": x[:8]})  # 8 rows each would divide: still refused
    with pytest.raises(ValueError, match="empty"):
        step(state, {"x": x[:0], "y": x[:0]})


def test_scalar_batch_leaf(state):
    @zpp.train_step
    def step(state, batch):
        return state, {}

    with pytest.raises(ValueError, match="not divisible"):
        step(state, {"x": tokens(8, seed=0), "lr": np.float32(1.0)})


def test_model_without_parameters():
    class NoParams(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(x)

    model = NoParams()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 3))).get("params", {})
    with pytest.raises(ValueError, match="no parameters"):
        zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4))


def test_whole_variables_dict_is_split_into_params_and_collections():
    model = GPT(SMALL)
    params = init_params()
    extra = {"scale": np.full((3,), 2.0, np.float32)}
    state = zpp.TrainState.create(model=model, params={"params": params, "stats": extra},
                                  tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4))
    plain = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4))
    assert state.engine.layouts.keys() == plain.engine.layouts.keys()
    np.testing.assert_array_equal(np.asarray(state.collections["stats"]["scale"]),
                                  extra["scale"])
    assert plain.collections == {}  # none: an empty dict, so **state.collections works


def test_non_elementwise_optimizer():
    with pytest.raises(ValueError, match="not elementwise"):
        zpp.TrainState.create(
            model=GPT(SMALL), params=init_params(),
            tx=optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
            mesh=zpp.make_mesh(2, 4),
        )


def test_wrong_mesh_axes():
    from jax.sharding import Mesh

    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    with pytest.raises(ValueError, match="make_mesh"):
        zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                              mesh=mesh)


def test_first_argument_must_be_train_state():
    with pytest.raises(TypeError, match="TrainState"):
        make_step()({"params": init_params()}, tokens(8, seed=0))


def test_apply_fn_with_a_plain_params_dict(state):
    plain = init_params()

    @zpp.train_step
    def step(state, batch):
        return state, {"y": state.apply_fn({"params": plain}, batch).sum()}

    with pytest.raises(TypeError, match="state.params"):
        step(state, tokens(8, seed=0)[:, :-1])


def test_donated_state_cannot_be_used_again():
    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4))

    @zpp.train_step(donate_state=True)
    def step(state, batch):
        return state, {}

    batch = tokens(8, seed=1)
    new, _ = step(state, batch)
    with pytest.raises(ValueError, match="donate_state=True"):
        step(state, batch)
    step(new, batch)  # the returned state works
