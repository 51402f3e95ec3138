"""Generation with hpZ: weights cross nodes once, then every decode step stays in the node."""

from __future__ import annotations

import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.measure.analysis import comm_report
from zeropp_jax.inference.generate import (
    gather_secondary,
    generate_without_cache,
    greedy_reference,
    lower_decode_step,
)
from zeropp_demo.gpt import GPT

from helpers import SMALL, init_params, tokens


def _frozen(path):
    return path[-1] == "kernel"


@pytest.mark.parametrize("mesh_shape,quantize_frozen", [((2, 4), False), ((4, 2), True)])
def test_greedy_tokens_equal_single_device_and_decode_stays_in_node(mesh_shape, quantize_frozen):
    """fp32 compute, so the sharded model computes the reference's logits up to reduction
    order (~1e-6 relative); greedy tokens must be identical. Quantized frozen weights: the
    reference runs at the dequantized weights (state.consolidate())."""
    params = init_params(seed=101)
    cfg = zpp.ZeroPPConfig(compute_dtype="float32", quantize_frozen=quantize_frozen,
                           block_size=64)
    mesh = zpp.make_mesh(*mesh_shape)
    state = zpp.TrainState.create(model=GPT(SMALL), params=params, tx=optax.sgd(0.1),
                                  mesh=mesh, config=cfg,
                                  frozen=_frozen if quantize_frozen else None)
    prompts = tokens(8, 3, seed=102)[:, :3]
    out = generate_without_cache(state, prompts, SMALL.seq_len)
    ref = greedy_reference(GPT(SMALL), state.consolidate(), prompts, SMALL.seq_len)
    np.testing.assert_array_equal(out[:, :3], prompts)
    np.testing.assert_array_equal(out, ref)
    assert len(np.unique(out[:, 3:])) > 1  # not a degenerate constant continuation

    gather = comm_report(gather_secondary.lower(state), mesh)
    assert gather.cross_node_bytes > 0  # the weights cross nodes once, here
    secondary = gather_secondary(state)
    nodes, local = mesh_shape
    for name, lay in state.engine.layouts.items():  # n_pad / L per device, compute dtype
        (w,) = secondary["params/" + name]
        assert w.shape == (nodes * local * lay.n_pad // local,)
    buf = np.zeros((8, SMALL.seq_len), np.int32)
    decode = comm_report(lower_decode_step(state, secondary, buf, 5), mesh)
    assert decode.rows and decode.intra_node_bytes > 0
    assert decode.cross_node_bytes == 0, decode.table()
