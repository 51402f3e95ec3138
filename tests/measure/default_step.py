"""The step tests/measure reads compiled: the demo GPT (tests/helpers.SMALL) with Adam on
2 x 4 devices under the default config (bf16 compute), on 16 sequences. One trace, lowering
and compile per process, shared by the tests that read it (none runs or changes it)."""

from __future__ import annotations

import functools

import optax

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT

from helpers import SMALL, init_params, make_step, tokens


@functools.cache
def default_step():
    """``(state, batch, lowered, compiled)``."""
    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.adam(1e-3),
                                  mesh=zpp.make_mesh(2, 4))
    batch = tokens(16, seed=0)
    lowered = make_step().lower(state, batch)
    return state, batch, lowered, lowered.compile()
