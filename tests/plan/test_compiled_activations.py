"""The planner prices a real state's activations from its compiled step.

A ``TrainState`` alone tells the planner its units, not what the model keeps for backward:
``plan(state, ...)`` reads that from a lowered step of the state (``lowered=``, or the one a
train step recorded on the state), compiled once (``zeropp_jax.plan.measured``). What is
compared is what ``tests/plan/test_memory_model.py`` compares: XLA CPU's
``memory_analysis()`` of a step that donates its state, arguments + temporaries.

The bound, 10% of the compiled bytes, is the memory model's own (the module docstring of
test_memory_model.py): the calibration makes the plan of the compiled step itself exact up
to float rounding, and what it predicts for another batch or another configuration rests
on the model's terms (the per-token figure scaled, hpZ's, qwZ's and qgZ's buffers added),
which that file holds to 10% of compiled steps.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from helpers import fresh_seed, zoo_train_step
from zeropp_jax.plan import auto, measured
from zeropp_jax.plan.auto import plan
from zeropp_jax.plan.cost_model import Hardware, Link
from zeropp_jax.plan.workload import config_workload

CONFIGS = {"zero3": zpp.ZeroPPConfig(), "zeropp": zpp.ZeroPPConfig.zeropp()}
# A slow network and free compute: ZeRO++ moves fewer bytes, so it is the faster
# candidate and only the memory budget can rule it out.
SLOW = Hardware(2, 4, Link(1e10, 1e-5), Link.gbps(0.1, 1e-4), flops_per_s=1e15)
# Batches of 16 and 32 sequences of zoo.SEQ = 8 tokens over 8 devices: 16 and 32 tokens a
# device.
ROWS = (16, 32)


# Traced transports shared by every plan of this module (each ``plan`` call keeps its own
# memo otherwise): the keys name all a trace depends on (transport, padded length, dtype,
# mesh), so every candidate is costed as before, each transport traced once.
_MEMO: dict = {}


@pytest.fixture(autouse=True)
def _shared_traces(monkeypatch):
    monkeypatch.setattr(auto, "config_workload",
                        lambda *a, memo=None, **k: config_workload(*a, memo=_MEMO, **k))


def _compiled_bytes(compiled) -> float:
    stats = compiled.memory_analysis()
    return stats.argument_size_in_bytes + stats.temp_size_in_bytes


def _wide_gpt2():
    """transformers' GPT-2 with weights a larger share of the step than the zoo's (vocab
    2048, d 64, 4 layers, 4 heads) and sequences of 32: where the memory model is furthest
    under ZeRO++'s compiled step (``plan.auto.MEMORY_MARGIN``)."""
    import transformers as T
    import zoo

    cfg = T.GPT2Config(vocab_size=2048, n_positions=64, n_embd=64, n_layer=4, n_head=4)

    def batch(rng, rows):
        ids = rng.integers(0, 2048, (rows, 32)).astype(np.int32)
        return {"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids}

    entry = zoo._hf_entry("hf_gpt2_wide", T.FlaxGPT2LMHeadModel, cfg, batch,
                          zoo._hf_clm_loss, "", 100)
    return entry, 32


@pytest.fixture(scope="module")
def compiled_steps():
    """``get(model, config, rows)``: ``(state, compiled step, tokens per device, seed)``,
    each built the first time a test asks for it. The batch's values are drawn afresh
    each run (memory does not depend on them; the seed is in the failure messages)."""
    import zoo

    out, seed = {}, fresh_seed()

    def get(model: str, config: str, rows: int):
        key = (model, config, rows)
        if key not in out:
            entry, seq = _wide_gpt2() if model == "hf_gpt2_wide" else (zoo.get(model), zoo.SEQ)
            batch = entry.make_batch(np.random.default_rng(seed), rows)
            with zoo.hf_compat():
                state = zpp.TrainState.create(model=entry.model, params=entry.params,
                                              tx=optax.adam(1e-3), mesh=zpp.make_mesh(2, 4),
                                              config=CONFIGS[config])
                lowered = zoo_train_step(entry).lower(state, batch)
                # train_step's .lower leaves the step on the engine, where plan() finds it.
                assert state.engine.memo[measured.LOWERED_KEY] is lowered
                compiled = lowered.compile()
            out[key] = (state, compiled, rows * seq / 8, seed)
        return out[key]

    return get


def _predicted(state, step, config: str, tokens: float, **kw) -> float:
    p = plan(state, nodes=2, local=4, configs=[CONFIGS[config]], tokens_per_device=tokens,
             lowered=step, **kw)
    return p.chosen.prediction.memory_bytes


def test_a_lowered_state_is_planned_at_its_compiled_memory(compiled_steps):
    """The contract, on transformers' Llama with ZeRO-3 and ZeRO++: after a step of the
    state has been lowered (recorded on its engine, as ``train_step`` records it:
    ``measured.LOWERED_KEY``), ``plan(state, ...)`` with no ``lowered=`` predicts that
    step's compiled memory; without one the plan's last line says the activations were
    not counted, and how to count them. GPT-2 and the NNX model: the slow tests below."""
    for config in CONFIGS:
        state, step, tokens, seed = compiled_steps("hf_llama", config, ROWS[0])
        # Planned first as if no step had been lowered, then with the step recorded.
        state.engine.memo.pop(measured.LOWERED_KEY, None)
        blind = plan(state, nodes=2, local=4, configs=[CONFIGS[config]],
                     tokens_per_device=tokens)
        assert "activations not counted" in blind.why and "lowered=" in blind.why
        # Without activations the plan was 0.3x of the compiled step.
        assert blind.chosen.prediction.memory_bytes < 0.5 * _compiled_bytes(step), seed
        state.engine.memo[measured.LOWERED_KEY] = step
        p = plan(state, nodes=2, local=4, configs=[CONFIGS[config]], tokens_per_device=tokens)
        assert "activations measured" in p.why
        # The compiled step itself: the calibration's fixed point (float rounding only).
        assert p.chosen.prediction.memory_bytes == pytest.approx(_compiled_bytes(step),
                                                                rel=1e-9), (config, seed)
        # tokens_per_device not given: memory at the compiled step's tokens, no compute.
        own = plan(state, nodes=2, local=4, configs=[CONFIGS[config]])
        assert own.chosen.prediction.memory_bytes == pytest.approx(_compiled_bytes(step),
                                                                  rel=1e-9)
        assert "compute is not counted" in own.why
    with pytest.raises(TypeError, match="lowered= needs a TrainState"):
        plan(measured.ModelShape((("a", 10),)), lowered=step, hardware=SLOW)


# Twice the tokens of the compiled step: the activations per token scaled, the rest the
# model's terms (at most 1.08x on these models when written). A second compile per case:
# test-all only. `make test` keeps the compiled step's own tokens
# (test_a_lowered_state_is_planned_at_its_compiled_memory) and another configuration at
# them (the budget test below), on the Llama.
@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("model", ["hf_llama", "hf_gpt2", "nnx_transformer"])
def test_the_plan_of_more_tokens_is_within_the_memory_models_bound(model, config,
                                                                   compiled_steps):
    state, small, tokens, seed = compiled_steps(model, config, ROWS[0])
    _, large, more, _ = compiled_steps(model, config, ROWS[1])
    assert more == 2 * tokens
    assert _predicted(state, small, config, tokens) == pytest.approx(
        _compiled_bytes(small), rel=1e-9), seed
    predicted = _predicted(state, small, config, more)
    assert predicted == pytest.approx(_compiled_bytes(large), rel=0.10), (seed, predicted)


# `make test` keeps the Llama; GPT-2, the NNX model and the wider GPT-2 (where ZeRO++'s
# step is furthest over the model: 1.125x) run the same path in test-all.
@pytest.mark.parametrize("model", ["hf_llama",
                                   pytest.param("hf_gpt2", marks=pytest.mark.slow),
                                   pytest.param("nnx_transformer", marks=pytest.mark.slow),
                                   pytest.param("hf_gpt2_wide", marks=pytest.mark.slow)])
def test_auto_config_never_returns_a_config_whose_compiled_step_is_over_the_budget(
        model, compiled_steps):
    """ZeRO-3 and ZeRO++ of the model, each compiled; a budget between their compiled
    memories. On a slow network ZeRO++ is the faster: without activations both fit by the
    model and ZeRO++ would be chosen (its compiled step over the budget); with the
    activations of ZeRO-3's compiled step, ZeRO++ is over and ZeRO-3 is chosen."""
    rows = 8 if model == "hf_gpt2_wide" else ROWS[0]  # 8 sequences of 32 over 8 devices
    zero3_state, zero3, tokens, seed = compiled_steps(model, "zero3", rows)
    zeropp_state, zeropp, _, _ = compiled_steps(model, "zeropp", rows)
    low, high = sorted((_compiled_bytes(zero3), _compiled_bytes(zeropp)))
    assert high > 1.05 * low, (low, high)  # ZeRO++'s buffers: room for a budget between
    # The contract for ZeRO++'s own state and step.
    assert _predicted(zeropp_state, zeropp, "zeropp", tokens) == pytest.approx(
        _compiled_bytes(zeropp), rel=1e-9)
    budget = (low + high) / 2
    kwargs = dict(nodes=2, local=4, hardware=SLOW, tokens_per_device=tokens,
                  configs=list(CONFIGS.values()), verbose=False)
    compiled_of = {CONFIGS["zero3"]: _compiled_bytes(zero3),
                   CONFIGS["zeropp"]: _compiled_bytes(zeropp)}
    fastest = zpp.auto_config(zero3_state, lowered=zero3, **kwargs)
    assert fastest == CONFIGS["zeropp"]  # no budget: the faster
    chosen = zpp.auto_config(zero3_state, lowered=zero3, memory_budget_bytes=budget, **kwargs)
    assert compiled_of[chosen] <= budget, (seed, chosen, compiled_of, budget)
    # Any budget, planned from either compiled step: what is returned fits when compiled,
    # or nothing does and the plan says so. Budgets drawn from 0.8x the smaller to 1.2x
    # the larger compiled memory, and the hardest: a byte under each compiled memory.
    rng = np.random.default_rng(seed)
    budgets = [*rng.uniform(0.8 * low, 1.2 * high, 20), low - 1, high - 1]
    for state, step in ((zero3_state, zero3), (zeropp_state, zeropp)):
        for b in budgets:
            try:
                chosen = zpp.auto_config(state, lowered=step, memory_budget_bytes=b, **kwargs)
            except ValueError as e:
                assert "no configuration fits" in str(e)
                # The compiled configuration is priced at its compiled bytes: it fits any
                # budget that holds them.
                assert b < compiled_of[state.engine.config], (seed, b, compiled_of)
                continue
            assert compiled_of[chosen] <= b, (seed, chosen, compiled_of, b)
    # The test can fail: without the activations ZeRO++ fits by the model.
    zero3_state.engine.memo.pop(measured.LOWERED_KEY, None)
    blind = zpp.auto_config(zero3_state, memory_budget_bytes=budget, **kwargs)
    assert compiled_of[blind] > budget
