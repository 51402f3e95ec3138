"""The GPU path, checked from this CPU machine: the whole ZeRO++ train step with the Pallas
kernels (implementation="pallas") lowers for CUDA through Triton."""

from __future__ import annotations

import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.comm.transports import plan_of
from zeropp_jax.core import compat
from zeropp_demo.gpt import GPT
from zeropp_jax.quant.quantization import compiled_kernels

from helpers import SMALL, init_params, make_step, tokens


def _step_lowered_for_cuda(cfg: zpp.ZeroPPConfig) -> tuple[str, zpp.TrainState]:
    """The test GPT's train step with ``cfg`` on a 2x4 mesh, lowered for CUDA inside
    ``compiled_kernels()``: its StableHLO text, and the state it was lowered for."""
    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=cfg)
    batch = state.engine.shard_batch(tokens(16, seed=0))
    with compiled_kernels():
        return compat.lower_for_cuda(make_step().jitted, state, batch).as_text(), state


# Each case traces and lowers a whole step (seconds). INT4 weights without smoothing run in
# test-all: (4, True) lowers the step with INT4 weights, (8, False) the unrotated kernels
# inside a step (qgZ's INT4 gradients among them), and tests/quant/test_pallas_quantize.py
# lowers the unrotated INT4 quantize and dequantize kernels for CUDA one by one.
@pytest.mark.parametrize("weight_bits,smooth", [
    (8, False), pytest.param(4, False, marks=pytest.mark.slow), (4, True)])
def test_zeropp_step_with_pallas_kernels_lowers_for_cuda(weight_bits, smooth):
    """``smooth``: Hadamard-rotated INT4 weights and gradients, stochastically rounded
    gradients: the fused rotating / stochastic kernels lower inside the step too."""
    cfg = zpp.ZeroPPConfig.zeropp(block_size=32, weight_bits=weight_bits,
                                  qgz_pipeline_stages=2, quantization_impl="pallas",
                                  qwz_hadamard=smooth, qgz_hadamard=smooth,
                                  stochastic_rounding=smooth)
    text, state = _step_lowered_for_cuda(cfg)
    kernels = text.count(compat.TRITON_CALL_TARGET)
    # Units moved by collectives of their own: the rest unit rides in the first unit's
    # unless a Hadamard sign pattern or a rounding seed depends on its place (bucket).
    units = len(state.engine.layouts) - plan_of(cfg).buckets()
    # At least: per unit a forward quantize and dequantize (qwZ), and per unit and stage
    # the reorder+quantize, the fused middle hop and the final reduction (qgZ).
    assert kernels >= units * 2 + units * 2 * 3, kernels
    assert "div.rn.f32" in text  # exact division on CUDA (see pallas_kernels/quantize.py)
    if smooth:  # the kernels' names say which options they were built with
        for name in ("quantize_int4_rotated", "dequantize_int4_rotated",
                     "reorder_quantize_int4_rotated_stochastic",
                     "dequantize_reduce_requantize_int4_int4_stochastic",
                     "dequantize_reduce_int4_rotated"):
            assert f'"{name}"' in text, name


def test_default_implementation_lowers_kernels_only_for_rotated_blocks():
    """``quantization_impl=None`` as a GPU resolves it (``compiled_kernels``): INT4 weights
    with Hadamard smoothing go through the rotating kernels; qgZ's unrotated gradient
    blocks, through XLA's fusions (no kernel of theirs in the program)."""
    cfg = zpp.ZeroPPConfig.zeropp(block_size=32, weight_bits=4, qwz_hadamard=True)
    assert cfg.quantization_impl is None
    text, _ = _step_lowered_for_cuda(cfg)
    for name in ("quantize_int4_rotated", "dequantize_int4_rotated"):
        assert f'"{name}"' in text, name
    for name in ("reorder_quantize", "dequantize_reduce"):
        assert f'"{name}' not in text, name
