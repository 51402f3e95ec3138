"""What the compiled and lowered train step communicates, and in which dtype."""

from __future__ import annotations

import re

import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.models.gpt import GPT
from zeropp_jax.partition import REST

from helpers import SMALL, init_params, make_step, tokens

# stablehlo.all_gather / reduce_scatter ops in lowered MLIR: the op's type signature ends
# in its result type, e.g. `: (tensor<40xui16>) -> tensor<320xui16>`; a reduce_scatter's
# reduction region comes first (and holds no `->`).
_MLIR_OP = re.compile(
    r'"stablehlo\.(all_gather|reduce_scatter)".*?-> tensor<[0-9x]*x(\w+)>', re.S
)
# Compiled HLO: `%name = u16[320]{0} all-gather(...)`.
_HLO_OP = re.compile(r"= (\w+)\[[0-9,]*\](?:\{[0-9,]*\})? (all-gather|reduce-scatter)\(")


def _lowered_and_compiled(compute_dtype: str, stage: int = 3):
    model = GPT(SMALL)
    state = zpp.TrainState.create(
        model=model, params=init_params(), tx=optax.adam(1e-3), mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig(stage=stage, compute_dtype=compute_dtype),
    )
    lowered = make_step().lower(state, tokens(16, seed=0))
    return state, lowered.as_text(), lowered.compile().as_text()


def _mlir_ops(text: str) -> list[tuple[str, str]]:
    """(kind, result element type) of every all_gather / reduce_scatter."""
    return _MLIR_OP.findall(text)


def test_bf16_step_moves_16_bit_data():
    state, lowered, compiled = _lowered_and_compiled("bfloat16")
    ops = _mlir_ops(lowered)
    gathers = [t for k, t in ops if k == "all_gather"]
    scatters = [t for k, t in ops if k == "reduce_scatter"]
    assert gathers and scatters
    # All-gathers move bf16 bit patterns as 16-bit integers (forward ui16, backward i16);
    # reduce-scatters sum in bf16 as DeepSpeed's ZeRO-3 does.
    assert set(gathers) <= {"ui16", "i16"}, gathers
    assert set(scatters) == {"bf16"}, scatters
    assert len(scatters) == len(state.engine.layouts)  # one per unit
    hlo = _HLO_OP.findall(compiled)
    compiled_gathers = [t for t, k in hlo if k == "all-gather"]
    assert compiled_gathers and set(compiled_gathers) <= {"u16", "s16"}, compiled_gathers
    # XLA's CPU backend widens reduce-scatters (they do arithmetic) to f32; documented.
    assert {t for t, k in hlo if k == "reduce-scatter"} <= {"f32", "bf16"}


def test_backward_regathers_instead_of_keeping_weights():
    """Each unit whose backward needs its weights gathers them again: the compiled program
    has a forward gather (u16) and a separate backward gather (s16) for those units, so the
    full weights are not kept alive from forward to backward."""
    state, _, compiled = _lowered_and_compiled("bfloat16")
    hlo = _HLO_OP.findall(compiled)
    forward = [t for t, k in hlo if k == "all-gather" and t == "u16"]
    backward = [t for t, k in hlo if k == "all-gather" and t == "s16"]
    units = len(state.engine.layouts)
    assert len(forward) == units
    # Embedding lookups need no weights in backward (wte, wpe); the rest unit's vjp is the
    # identity. Blocks, ln_f and the head regather.
    no_weights_in_bwd = {"wte", "wpe", REST}
    assert len(backward) == units - len(no_weights_in_bwd & set(state.engine.layouts))


@pytest.mark.parametrize("stage", [1, 2])
def test_stage_1_2_collectives(stage):
    state, lowered, _ = _lowered_and_compiled("bfloat16", stage=stage)
    ops = _mlir_ops(lowered)
    kinds = [k for k, _ in ops]
    units = len(state.engine.layouts)
    # No weight gathers in forward: one all-gather per unit rebuilds the replicated weights
    # after the optimizer step.
    assert kinds.count("all_gather") == units
    if stage == 2:
        assert kinds.count("reduce_scatter") == units
    else:
        assert kinds.count("reduce_scatter") == 0
        assert lowered.count("stablehlo.all_reduce") >= units
