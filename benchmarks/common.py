"""Pieces the benchmarks share: the example GPT, its data, and a short ZeRO-3 training run."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax

import zeropp_jax as zpp
from zeropp_demo.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split
from zeropp_demo.gpt import GPT, GPTConfig, lm_train_step  # noqa: F401 (re-export)

EXAMPLE_GPT = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=128, layers=4, d_model=128, heads=4)


def example_model_and_data(seed: int, batch: int, config: GPTConfig = EXAMPLE_GPT
                           ) -> tuple[GPT, Any, np.ndarray, np.ndarray]:
    """(model, initial params, training corpus, first batch ``[batch, seq + 1]``) of the
    example GPT (``config``: another size of it)."""
    model = GPT(config)
    data, _ = train_val_split(stdlib_corpus())
    first = sample_batch(data, batch, config.seq_len, seed=seed, step=0)
    params = jax.jit(model.init)(jax.random.PRNGKey(seed), first[:, :-1])["params"]
    return model, params, data, first


def brief_training(model: GPT, params: Any, data: np.ndarray, mesh: Any, *, steps: int,
                   seed: int, batch: int = 32) -> tuple[Any, list[float]]:
    """``steps`` of fp32 ZeRO-3 Adam training; returns (plain params, losses)."""
    state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(3e-3), mesh=mesh,
                                  config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"))
    step = lm_train_step()
    losses = []
    for i in range(steps):
        state, m = step(state, sample_batch(data, batch, EXAMPLE_GPT.seq_len, seed=seed,
                                            step=i + 1))
        losses.append(float(m["loss"]))
    return state.consolidate(), losses
