"""The memory model against the paper's example and the compiled program."""

import jax
import numpy as np
import pytest

from zeropp_jax.measure.analysis import memory_model

from default_step import default_step


def test_paper_example():
    mm = memory_model(100 * 10**9, 1024, alpha=16, param_bytes=2, grad_bytes=2,
                      optimizer_bytes=12)
    assert mm.data_parallel == 16 * 100 * 10**9
    assert mm.zero3 == pytest.approx(16 * 100 * 10**9 / 1024)  # to float64 rounding
    # Paper: hpZ costs ~8.9x ZeRO-3's model-state memory, still 114x less than DP. The
    # model's ratio is 1 + (2 / alpha) / (16 / N) = 9 (the bf16 secondary copy over the
    # 16 bytes per parameter), to float64 rounding.
    assert mm.hpz / mm.zero3 == pytest.approx(1 + (2 / 16) / (16 / 1024))
    assert round(mm.data_parallel / mm.hpz) == 114
    with pytest.raises(ValueError, match="alpha"):
        memory_model(10, 2).hpz


def test_persistent_state_matches_compiled_arguments():
    # Adam on the default config (default_step.py: the step test_comm_report reads too).
    state, batch, _, compiled = default_step()
    stats = compiled.memory_analysis()
    # The model counts parameters; the state holds each unit padded to whole shards (the
    # small test model pads a lot relatively: 5 units of a few hundred elements) and three
    # replicated int32 scalars (the step, skipped steps, Adam's count). With those counted,
    # the compiled program's argument bytes are the model's exactly.
    padded = sum(lay.n_pad for lay in state.engine.layouts.values())
    scalars = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(state)
                  if np.ndim(x) == 0)
    predicted = memory_model(padded, 8).zero3_persistent + batch.nbytes / 8 + scalars
    assert stats.argument_size_in_bytes == predicted
