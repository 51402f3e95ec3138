"""Pieces the benchmarks share: the example GPT, its data, and a short ZeRO-3 training run."""

from __future__ import annotations

import time
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


def bf16_gpt_run(args: Any) -> tuple[Any, Any, list[np.ndarray], Any, Any]:
    """``(model, params, batches, mesh, step)`` for a timing benchmark's ``args``
    (``cli.timed_gpt_parser``): the example GPT at that size computing in bf16, four
    batches of the standard-library corpus, the ``--nodes x --local`` mesh, the examples'
    train step."""
    import jax.numpy as jnp

    cfg = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=args.heads, dtype=jnp.bfloat16)
    model = GPT(cfg)
    data, _ = train_val_split(stdlib_corpus())
    batches = [sample_batch(data, args.batch, args.seq_len, seed=0, step=i) for i in range(4)]
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batches[0][:, :-1])["params"]
    return model, params, batches, zpp.make_mesh(args.nodes, args.local), lm_train_step()


def timed_rounds(states: dict[str, Any], step: Any, batches: list[np.ndarray], rounds: int,
                 steps_per_round: int) -> dict[str, list[float]]:
    """Seconds per step of each variant's state (already compiled and warmed up): ``rounds``
    rounds, each running ``steps_per_round`` steps of every variant in turn on
    ``batches[2:4]``, so a slow moment of the machine touches all variants alike.
    ``states`` ends holding each variant's last state."""
    times: dict[str, list[float]] = {name: [] for name in states}
    for _ in range(rounds):
        for name in states:
            state = states[name]
            t0 = time.perf_counter()
            for i in range(steps_per_round):
                state, _ = step(state, batches[2 + i % 2])
            jax.block_until_ready(state)
            times[name].append((time.perf_counter() - t0) / steps_per_round)
            states[name] = state
    return times
