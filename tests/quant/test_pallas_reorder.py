"""Fused reorder + quantize kernel vs. its plain-jnp reference (``pallas_kernels.reorder``).

On this CPU-only machine the kernel runs in Pallas interpret mode, where it must equal the
reference bit for bit, and is lowered (not run) for CUDA through the Triton backend.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reorder as R

from kernel_testing import (DTYPES, TRITON_CALL, TRITON_PARAMS, assert_bitwise_equal,
                            lower_for_cuda, sample_blocks, seed_of, strip_kernel_ir, to_np)

BITS = (8, 4)
LAYOUTS = [(2, 4), (4, 2), (3, 2), (1, 8), (8, 1)]  # (nodes, local)
STAGES = (1, 2, 4)
BLOCK = 32
# Blocks per sub-slice (= per output slot), cycled over the cases. The kernel tiles a slot in
# programs of min(8, largest power of 2 <= count) blocks, the last tile pulled back to end
# at the slot's end: 1 -> one tile of 1; 3 -> tiles of 2 overlapping by one block; 8 -> one
# full tile; 13 -> two tiles of 8 overlapping by three; 21 -> three tiles of 8.
BLOCKS_PER_SLOT = (13, 3, 8, 1, 21)
# Every (bits, dtype) pair, cycled over the calls.
FORMATS = list(itertools.product(BITS, DTYPES))


def _x(rng: np.random.Generator, nodes: int, local: int, stages: int, nb_sub: int,
       dtype) -> jax.Array:
    """A fresh heavy-tailed gradient ``[P * stages * nb_sub * BLOCK]`` with mixed block scales."""
    return sample_blocks(rng, nodes * local * stages * nb_sub, BLOCK, dtype)


def _check_stages(x: jax.Array, stages_to_check: Sequence[int], **kw) -> list[np.ndarray]:
    """Kernel (interpret) == reference, bit for bit, for each stage in ``stages_to_check``,
    with the documented shapes and dtypes. Returns the kernel's scales per stage.

    One ``jit`` per side covers all the stages: compiling dominates interpret-mode runtime.
    """
    kernel = jax.jit(lambda x: [R.reorder_quantize(x, **kw, stage=s, interpret=True)
                                for s in stages_to_check])
    reference = jax.jit(lambda x: [R.reorder_quantize_reference(x, **kw, stage=s)
                                   for s in stages_to_check])
    outs = kernel(x)
    n_out = x.shape[0] // kw["stages"]
    for (values, scales), (ref_values, ref_scales) in zip(outs, reference(x), strict=True):
        assert values.shape == ((n_out,) if kw["bits"] == 8 else (n_out // 2,))
        assert values.dtype == (jnp.int8 if kw["bits"] == 8 else jnp.uint8)
        assert scales.shape == (n_out // BLOCK,) and scales.dtype == jnp.float32
        assert_bitwise_equal(values, ref_values)
        assert_bitwise_equal(scales, ref_scales)
    return [to_np(scales) for _, scales in outs]


# ------------------------------------------------------------------ 1. bit-for-bit parity


# (layout, stages) kept in `make test`: every layout, every stage count with two layouts or
# more, and (through the cycles above) every tiling of BLOCKS_PER_SLOT and every format;
# each case compiles its own kernel program. The other eight run in test-all: the index
# arithmetic they exercise is the kept cases' (slot j * nodes + i of input slice
# i * local + j, sub-slice ``stage``), which the reference's placement test below checks
# for all fifteen against numpy.
_KEPT = {((2, 4), 1), ((2, 4), 4), ((4, 2), 1), ((4, 2), 2), ((3, 2), 2), ((1, 8), 4),
         ((8, 1), 4)}


@pytest.mark.parametrize("nodes,local,stages", [
    pytest.param(*layout, stages, marks=() if (layout, stages) in _KEPT else pytest.mark.slow)
    for layout in LAYOUTS for stages in STAGES])
def test_kernel_matches_reference_every_stage(nodes, local, stages):
    case = LAYOUTS.index((nodes, local)) * len(STAGES) + STAGES.index(stages)
    nb_sub = BLOCKS_PER_SLOT[case % len(BLOCKS_PER_SLOT)]
    bits, dtype_name = FORMATS[case % len(FORMATS)]
    rng = np.random.default_rng(seed_of("reorder", nodes, local, stages))
    x = _x(rng, nodes, local, stages, nb_sub, DTYPES[dtype_name])
    scales = _check_stages(x, range(stages), nodes=nodes, local=local, bits=bits,
                           block_size=BLOCK, stages=stages)
    # Random data: no zero or NaN blocks hiding in the comparison.
    assert all(np.all(s > 0) for s in scales)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype_name", DTYPES)
def test_kernel_matches_reference_every_format(dtype_name, bits):
    rng = np.random.default_rng(seed_of("format", dtype_name, bits))
    x = _x(rng, 3, 2, 2, 13, DTYPES[dtype_name])
    [scales] = _check_stages(x, [1], nodes=3, local=2, bits=bits, block_size=BLOCK, stages=2)
    assert np.all(scales > 0)


@pytest.mark.parametrize("bits", BITS)
def test_zero_and_non_finite_blocks_keep_their_slots(bits):
    """A zero block and NaN/inf blocks come out in their slots, as quantize would make them."""
    nodes, local, stages, nb_sub = 2, 2, 2, 3
    rng = np.random.default_rng(seed_of("special", bits))
    x = to_np(_x(rng, nodes, local, stages, nb_sub, jnp.float32)).reshape(-1, BLOCK).copy()
    x[1] = 0.0
    x[4, 7] = np.nan
    x[9, 0] = np.inf
    x[16, 31] = -np.inf
    x = jnp.asarray(x.reshape(-1))
    kw = dict(nodes=nodes, local=local, bits=bits, block_size=BLOCK, stages=stages)
    # Over both stages every input block shows up once: one zero scale and three NaN ones.
    all_scales = np.concatenate(_check_stages(x, range(stages), **kw))
    assert np.sum(all_scales == 0) == 1 and np.sum(np.isnan(all_scales)) == 3


def test_tiles_stay_in_bounds_and_cover_every_block():
    """The tiling shared with the reduce kernels. Interpret mode pads blocks that run past
    the end of an array, so the kernel tests cannot see an out-of-bounds tile; Triton does
    not mask them and would read and write past the end. Check the tiling directly."""
    for nb in [*range(1, 40), 64, 100, 1000]:
        rows = R._rows_within(nb)
        assert rows & (rows - 1) == 0 and rows <= min(nb, R.BLOCKS_PER_PROGRAM)  # power of 2
        tiles = -(-nb // rows)
        starts = [int(R._tile_start(jnp.int32(t), rows=rows, nb=nb)) for t in range(tiles)]
        assert all(0 <= s and s + rows <= nb for s in starts), (nb, starts)
        covered = np.zeros(nb, bool)
        for s in starts:
            covered[s:s + rows] = True
        assert covered.all(), nb
        # Only the last tile is pulled back; the others are disjoint and `rows` apart.
        assert starts[:-1] == [t * rows for t in range(tiles - 1)]
    assert R._rows_within(1000) == R.BLOCKS_PER_PROGRAM == 8


# --------------------------------------------------------- 2. the reference's placement


@pytest.mark.parametrize("stages", STAGES)
@pytest.mark.parametrize("nodes,local", LAYOUTS)
def test_reference_places_slice_i_local_plus_j_in_slot_j_nodes_plus_i(nodes, local, stages):
    """Independent numpy construction of the generalized Algorithm 2 placement."""
    num, sub = nodes * local, 6
    m = stages * sub
    # Every element distinct and traceable: the value is its own input index.
    x = np.arange(num * m, dtype=np.float32)
    for stage in range(stages):
        out = to_np(R.reorder_reference(jnp.asarray(x), nodes=nodes, local=local,
                                         stages=stages, stage=stage))
        assert out.shape == (num * sub,)
        expected = np.empty(num * sub, np.float32)
        for i in range(nodes):
            for j in range(local):
                slot, src = j * nodes + i, i * local + j
                start = src * m + stage * sub  # sub-slice `stage` of input slice `src`
                expected[slot * sub:(slot + 1) * sub] = x[start:start + sub]
        np.testing.assert_array_equal(out, expected)


def test_reference_reorder_then_quantize_is_quantize_of_the_placement():
    rng = np.random.default_rng(seed_of("compose"))
    x = _x(rng, 4, 2, 2, 3, jnp.bfloat16)
    kw = dict(nodes=4, local=2, stages=2, stage=1)
    values, scales = jax.jit(
        lambda x: R.reorder_quantize_reference(x, **kw, bits=4, block_size=BLOCK)
    )(x)
    reordered = R.reorder_reference(x, **kw)
    ref_values, ref_scales = jax.jit(
        lambda y: R.quantize_reference(y, bits=4, block_size=BLOCK)
    )(reordered)
    assert_bitwise_equal(values, ref_values)
    assert_bitwise_equal(scales, ref_scales)


# -------------------------------------------------------------- 3. Triton lowering for CUDA


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_lowers_for_cuda_via_triton(dtype_name, bits):
    nodes, local, stages, nb_sub = 2, 4, 2, 13  # 13 blocks per slot: overlapping last tile
    n = nodes * local * stages * nb_sub * 64
    text = lower_for_cuda(
        lambda x: R.reorder_quantize(x, nodes=nodes, local=local, bits=bits, block_size=64,
                                     stages=stages, stage=1, compiler_params=TRITON_PARAMS),
        jax.ShapeDtypeStruct((n,), DTYPES[dtype_name]),
    )
    assert len(TRITON_CALL.findall(text)) == 1, text[:2000]
    assert "num_warps = 4" in text and "num_stages = 1" in text
    assert "div.rn.f32" in text  # quantize's exact division survived into the kernel
    assert "mosaic" not in text.lower()
    # The reorder happens inside the kernel (index maps): around it there are only free
    # reshapes, no transpose/slice/gather/pad materializing a reordered copy.
    ops = set(re.findall(r"stablehlo\.(\w+)", strip_kernel_ir(text)))
    assert ops <= {"constant", "case", "return", "reshape", "custom_call"}, ops


def test_default_compiler_params_use_triton_on_cuda():
    text = lower_for_cuda(
        lambda x: R.reorder_quantize(x, nodes=2, local=2, bits=4, block_size=64),
        jax.ShapeDtypeStruct((4 * 64,), jnp.bfloat16),
    )
    assert len(TRITON_CALL.findall(text)) == 1 and "mosaic" not in text.lower()


# ---------------------------------------------------------------------- 4. bad input errors

_X = jnp.ones(8 * 64, jnp.float32)  # 8 slices of 64 = 2 blocks of 32


def _rq(x=_X, **kw):
    kw = {"nodes": 2, "local": 4, "bits": 8, "block_size": 32, "interpret": True, **kw}
    return lambda: R.reorder_quantize(x, **kw)


def _ref(x=_X, **kw):
    kw = {"nodes": 2, "local": 4, "bits": 8, "block_size": 32, **kw}
    return lambda: R.reorder_quantize_reference(x, **kw)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (_rq(bits=3), ValueError, r"bits=3 is invalid"),
        (_rq(block_size=0), ValueError, r"block_size=0 must be positive"),
        (_rq(block_size=32.0), TypeError, r"block_size must be a Python int"),
        (_rq(x=jnp.ones(100)), ValueError, r"n=100 must be a multiple of devices \* stages = 8"),
        (_rq(stages=3), ValueError, r"n=512 must be a multiple of devices \* stages = 24"),
        (_rq(block_size=48), ValueError,
         r"slice length / stages = 64 must be a multiple of block_size=48"),
        (_rq(stages=4), ValueError, r"slice length / stages = 16 must be a multiple of"),
        (_rq(stages=2, stage=2), ValueError, r"stage=2 must be in \[0, 2\)"),
        (_rq(stage=-1), ValueError, r"stage=-1 must be in \[0, 1\)"),
        (_rq(nodes=0), ValueError, r"nodes must be a positive int, got 0"),
        (_rq(local=2.0), ValueError, r"local must be a positive int"),
        (_rq(stages=0), ValueError, r"stages must be a positive int"),
        (_rq(bits=4, block_size=1), ValueError, r"block_size=1 must be even"),
        (_rq(x=jnp.ones(8 * 64, jnp.int32)), TypeError, r"bf16, fp16 or fp32, got int32"),
        (_rq(x=jnp.ones((8, 64))), ValueError, r"must be 1-D"),
        (_rq(x=jnp.ones(0)), ValueError, r"empty"),
        # The reference reports the same problems (it used to divide by block_size first).
        (_ref(block_size=0), ValueError, r"block_size=0 must be positive"),
        (_ref(x=jnp.ones(484), block_size=8), ValueError, r"n=484 must be a multiple"),
        (_ref(stage=1), ValueError, r"stage=1 must be in \[0, 1\)"),
        (_ref(bits=16), ValueError, r"bits=16 is invalid"),
    ],
)
def test_bad_input_raises(call, error, match):
    with pytest.raises(error, match=match):
        call()
