"""transformers Flax models as users load them."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.units.adapters.transformers import is_hf_model

from helpers import assert_leaves_equal
from zoo import hf_compat


def test_a_model_built_without_its_weights_is_recognised():
    """``_do_init=False`` (how large checkpoints are loaded: weights kept apart from the
    model) makes ``model.params`` raise ValueError. Such a model is still a transformers
    model: a state builds from it with the weights passed, and holds them unchanged."""
    from transformers import FlaxGPT2LMHeadModel, GPT2Config

    cfg = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    with hf_compat():
        model = FlaxGPT2LMHeadModel(cfg, input_shape=(1, 8), _do_init=False)
    with pytest.raises(ValueError):
        model.params  # noqa: B018
    assert is_hf_model(model)
    with hf_compat():
        params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(0), (1, 8))
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 4))
    assert_leaves_equal(state.consolidate(), jax.tree_util.tree_map(np.asarray, params))
