"""What the compiled and lowered train step communicates, and in which dtype."""

from __future__ import annotations

import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.measure.comm_report import collectives
from zeropp_demo.gpt import GPT

from helpers import SMALL, init_params, make_step, tokens



def _lowered(compute_dtype: str, stage: int = 3):
    """The state and the lowered step (compiled only where a test reads the compiled
    program: compiling is most of a step's cost)."""
    model = GPT(SMALL)
    state = zpp.TrainState.create(
        model=model, params=init_params(), tx=optax.adam(1e-3), mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig(stage=stage, compute_dtype=compute_dtype),
    )
    return state, make_step().lower(state, tokens(16, seed=0))


def _ops(text: str) -> list[tuple[str, str]]:
    """(kind, result element type) of every all-gather / reduce-scatter, lowered or compiled."""
    return [(c.kind, c.dtype) for c in collectives(text)
            if c.kind in ("all-gather", "reduce-scatter")]


def test_bf16_step_moves_16_bit_data():
    state, low = _lowered("bfloat16")
    lowered, compiled = low.as_text(), low.compile().as_text()
    ops = _ops(lowered)
    gathers = [t for k, t in ops if k == "all-gather"]
    scatters = [t for k, t in ops if k == "reduce-scatter"]
    assert gathers and scatters
    # All-gathers move bf16 bit patterns as 16-bit integers (forward ui16, backward i16);
    # reduce-scatters sum in bf16 as DeepSpeed's ZeRO-3 does.
    assert set(gathers) <= {"ui16", "i16"}, gathers
    assert set(scatters) == {"bf16"}, scatters
    # One per unit, the rest unit's inside the first unit's (config.bucket).
    assert len(scatters) == len(state.engine.layouts) - 1
    hlo = _ops(compiled)
    compiled_gathers = [t for k, t in hlo if k == "all-gather"]
    assert compiled_gathers and set(compiled_gathers) <= {"u16", "s16"}, compiled_gathers
    # XLA's CPU backend widens reduce-scatters (they do arithmetic) to f32; documented.
    assert {t for k, t in hlo if k == "reduce-scatter"} <= {"f32", "bf16"}


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_2_collectives(stage):
    state, low = _lowered("bfloat16", stage=stage)
    lowered = low.as_text()
    ops = _ops(lowered)
    kinds = [k for k, _ in ops]
    units = len(state.engine.layouts)
    # No weight gathers in forward: one all-gather per unit rebuilds the replicated weights
    # after the optimizer step.
    assert kinds.count("all-gather") == units
    if stage == 2:
        assert kinds.count("reduce-scatter") == units
    else:
        assert kinds.count("reduce-scatter") == 0
        assert lowered.count("stablehlo.all_reduce") >= units
