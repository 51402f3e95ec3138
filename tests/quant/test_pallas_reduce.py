"""Fused dequantize-reduce(-requantize) kernels vs. their plain-jnp references
(``pallas_kernels.reduce``).

On this CPU-only machine the kernels run in Pallas interpret mode, where they must equal the
references bit for bit, and are lowered (not run) for CUDA through the Triton backend. The
references themselves are pinned to an independent numpy computation, eagerly and under
``jit`` (where XLA would contract a product feeding a sum into an FMA).
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import reduce as D
from pallas_kernels.quantize import quantize_reference

from kernel_testing import (TRITON_CALL, TRITON_PARAMS, assert_bitwise_equal, call_with,
                            lower_for_cuda, sample_blocks, seed_of, strip_kernel_ir, to_np)

BITS = (8, 4)
GROUPS = (1, 2, 3, 4, 8)
BLOCK = 32
# Blocks per chunk (M / BLOCK), cycled over the cases. Programs take min(8, largest power of
# 2 <= count) blocks, the last tile pulled back to end at M: 13 -> two tiles overlapping by
# three blocks; 21 -> three tiles; 8 -> one exact tile; 3 -> tiles of 2 overlapping; 1.
BLOCKS = (13, 21, 8, 3, 1)


def _chunks(rng: np.random.Generator, groups: int, nb: int, bits: int
            ) -> tuple[jax.Array, jax.Array]:
    """``G`` chunks as qgZ receives them: ``values [G, M]`` (or ``[G, M/2]``), ``scales
    [G, nb]``, each chunk the quantization of a fresh heavy-tailed gradient whose blocks have
    scales 1e-3..1e1 apart."""
    x = sample_blocks(rng, groups * nb, BLOCK, jnp.float32)
    values, scales = _quantize(bits)(x)
    return values.reshape(groups, -1), scales.reshape(groups, nb)


# One jitted function per static setting, shared by all the cases: a case whose shapes an
# earlier case already had reuses its compiled program (a fresh lambda per call would trace
# and compile it again).
@functools.lru_cache(maxsize=None)
def _quantize(bits: int):
    return jax.jit(lambda x: quantize_reference(x, bits=bits, block_size=BLOCK))


@functools.lru_cache(maxsize=None)
def _kernels_fn(bits: int, out_bits: int):
    kw = dict(bits=bits, block_size=BLOCK, interpret=True)
    return jax.jit(lambda v, s: (
        D.dequantize_reduce(v, s, **kw),
        D.dequantize_reduce_requantize(v, s, **kw, out_bits=out_bits),
    ))


@functools.lru_cache(maxsize=None)
def _references_fn(bits: int, out_bits: int):
    kw = dict(bits=bits, block_size=BLOCK)
    return jax.jit(lambda v, s: (
        D.dequantize_reduce_reference(v, s, **kw),
        D.dequantize_reduce_requantize_reference(v, s, **kw, out_bits=out_bits),
    ))


def _kernels(values, scales, *, bits: int, out_bits: int):
    """Both kernels (interpret mode) in one ``jit``: compiling dominates their runtime."""
    return _kernels_fn(bits, out_bits)(values, scales)


def _references(values, scales, *, bits: int, out_bits: int):
    return _references_fn(bits, out_bits)(values, scales)


def _check_case(values, scales, *, bits: int, out_bits: int) -> tuple[jax.Array, jax.Array]:
    """Kernels == references bit for bit, with the documented shapes and dtypes. Returns the
    kernel's fp32 sum and requantized scales."""
    groups, nb = scales.shape
    m = nb * BLOCK
    total, (out_values, out_scales) = _kernels(values, scales, bits=bits, out_bits=out_bits)
    ref_total, (ref_values, ref_scales) = _references(values, scales, bits=bits,
                                                      out_bits=out_bits)
    assert total.shape == (m,) and total.dtype == jnp.float32
    assert out_values.shape == ((m,) if out_bits == 8 else (m // 2,))
    assert out_values.dtype == (jnp.int8 if out_bits == 8 else jnp.uint8)
    assert out_scales.shape == (nb,) and out_scales.dtype == jnp.float32
    assert_bitwise_equal(total, ref_total)
    assert_bitwise_equal(out_values, ref_values)
    assert_bitwise_equal(out_scales, ref_scales)
    return total, out_scales


def _numpy_sum(values: jax.Array, scales: jax.Array, *, bits: int) -> np.ndarray:
    """Independent spec: unpack, multiply (one fp32 rounding), add in g order (one rounding
    each). numpy runs each ufunc separately, so nothing is contracted into an FMA."""
    v, s = to_np(values), to_np(scales)
    groups, nb = s.shape
    if bits == 8:
        q = v.reshape(groups, nb, BLOCK).astype(np.float32)
    else:
        packed = v.reshape(groups, nb, BLOCK // 2)
        nibbles = [(packed & 0x0F).astype(np.int8), (packed >> 4).astype(np.int8)]
        # Half-block layout: low nibbles are the first half, high nibbles the second.
        q = np.concatenate([np.where(n > 7, n - 16, n) for n in nibbles], axis=2)
        q = q.astype(np.float32)
    terms = q * s[:, :, None]
    total = terms[0]
    for g in range(1, groups):
        total = total + terms[g]
    return total.reshape(nb * BLOCK)


# ------------------------------------------------------------------ 1. bit-for-bit parity


# (groups, bits) kept in `make test`: INT8 at every group count (1: nothing to add; 3: not
# a power of 2), which through the cycle above is also every tiling of BLOCKS once, and INT4
# at two counts (tiles of 2 overlapping, one exact tile). Every case compiles its own
# program; the other three run in test-all, their code paths (the group count, the bit
# width, the tiling) each covered by a kept case. INT4 with 13 blocks: the tests below.
_KEPT = {(1, 8), (2, 8), (3, 8), (4, 8), (8, 8), (2, 4), (4, 4)}


@pytest.mark.parametrize("groups,bits", [
    pytest.param(g, b, marks=() if (g, b) in _KEPT else pytest.mark.slow)
    for g in GROUPS for b in BITS])
def test_kernels_match_reference_bit_for_bit(groups, bits):
    case = GROUPS.index(groups) * len(BITS) + BITS.index(bits)
    nb = BLOCKS[case % len(BLOCKS)]
    rng = np.random.default_rng(seed_of("reduce", groups, bits))
    values, scales = _chunks(rng, groups, nb, bits)
    total, out_scales = _check_case(values, scales, bits=bits, out_bits=bits)
    # Random data: no zero or NaN blocks hiding in the comparison.
    assert np.all(np.isfinite(to_np(total))) and np.all(to_np(out_scales) > 0)


# Each direction once in `make test`, each group count once (3 chunks: not a power of 2);
# the other two pairings (a program each) in test-all. The group count's own code path is
# the sum, which test_kernels_match_reference_bit_for_bit runs for every count.
@pytest.mark.parametrize("groups,bits,out_bits", [
    (3, 4, 8), pytest.param(3, 8, 4, marks=pytest.mark.slow),
    pytest.param(4, 4, 8, marks=pytest.mark.slow), (4, 8, 4)])
def test_requantize_to_the_other_width(groups, bits, out_bits):
    # INT4 in -> INT8 out joins the half-block tile in registers; INT8 -> INT4 splits it.
    rng = np.random.default_rng(seed_of("cross", groups, bits, out_bits))
    values, scales = _chunks(rng, groups, 13, bits)
    _check_case(values, scales, bits=bits, out_bits=out_bits)


@pytest.mark.parametrize("bits", BITS)
def test_full_int_range_inputs(bits):
    """Values quantize never makes (-128; the INT4 nibble 0b1000 = -8) still reduce exactly."""
    rng = np.random.default_rng(seed_of("range", bits))
    groups, nb = 3, 13
    width = BLOCK if bits == 8 else BLOCK // 2
    values = rng.integers(0, 256, size=(groups, nb * width), dtype=np.uint8)
    values = jnp.asarray(values.view(np.int8) if bits == 8 else values)
    scales = jnp.asarray((10.0 ** rng.uniform(-3, 1, (groups, nb))).astype(np.float32))
    total, _ = _check_case(values, scales, bits=bits, out_bits=bits)
    assert_bitwise_equal(total, _numpy_sum(values, scales, bits=bits))


# --------------------------------------------------- 2. the references pinned to numpy


@pytest.mark.parametrize("bits", BITS)
def test_sum_matches_independent_numpy_eager_and_under_jit(bits):
    """Each term is rounded to fp32 before it is added, on every path.

    Regression: the reference used to add ``q * scale`` directly, and under ``jit`` XLA:CPU
    (LLVM ``AllowFPOpFusion=Fast``) fused each product into the running sum as an FMA,
    changing hundreds of elements of a 2048-element sum relative to the eager reference.
    """
    rng = np.random.default_rng(seed_of("numpy", bits))
    values, scales = _chunks(rng, 4, 64, bits)
    expected = _numpy_sum(values, scales, bits=bits)
    kw = dict(bits=bits, block_size=BLOCK)
    assert_bitwise_equal(D.dequantize_reduce_reference(values, scales, **kw), expected)
    jitted = jax.jit(lambda v, s: D.dequantize_reduce_reference(v, s, **kw))
    assert_bitwise_equal(jitted(values, scales), expected)
    assert_bitwise_equal(D.dequantize_reduce(values, scales, **kw, interpret=True), expected)


def test_dequantize_product_is_the_rounded_product():
    """``_dequantize_product(q, s) == fl(q * s)`` bit for bit for every int8 ``q`` and scales
    from 2**-100 to 2**100, zero, the largest fp32 (overflowing to inf), inf and NaNs."""
    rng = np.random.default_rng(seed_of("product"))
    q = np.arange(-128, 128, dtype=np.float32)[:, None]
    random_scales = rng.uniform(1.0, 2.0, 500) * 2.0 ** rng.integers(-100, 101, 500)
    special = np.array([0.0, 1.0, 2.0**-100, np.finfo(np.float32).max, np.inf, np.nan],
                       np.float32)
    payload_nan = np.array([0x7F800001, 0xFFC00001], np.uint32).view(np.float32)
    s = np.concatenate([random_scales.astype(np.float32), special, payload_nan])[None, :]
    q_b, s_b = np.broadcast_arrays(q, s)
    with np.errstate(over="ignore", invalid="ignore"):  # max * 128 -> inf; 0 * inf -> NaN
        expected = q_b * s_b
    for fn in (D._dequantize_product, jax.jit(D._dequantize_product)):
        assert_bitwise_equal(fn(jnp.asarray(q_b), jnp.asarray(s_b)), expected)


# ---------------------------------------------------------------------- 3. special blocks


@pytest.mark.parametrize("bits", BITS)
def test_zero_and_nan_blocks(bits):
    """A block that is zero in every chunk sums to +0 (requantized: scale 0, values 0); a
    NaN scale in any one chunk makes its block NaN (requantized: NaN scale, values 0)."""
    rng = np.random.default_rng(seed_of("special", bits))
    groups, nb = 3, 13
    values, scales = _chunks(rng, groups, nb, bits)
    width = BLOCK if bits == 8 else BLOCK // 2
    values = to_np(values).reshape(groups, nb, width).copy()
    scales = to_np(scales).copy()
    values[:, 2], scales[:, 2] = 0, 0.0
    scales[1, 9] = np.nan
    values = jnp.asarray(values.reshape(groups, nb * width))
    total, out_scales = _check_case(values, jnp.asarray(scales), bits=bits, out_bits=bits)
    total = to_np(total).reshape(nb, BLOCK)
    assert np.all(total[2].view(np.uint32) == 0)  # +0.0
    assert np.all(np.isnan(total[9]))
    others = [b for b in range(nb) if b not in (2, 9)]
    assert np.all(np.isfinite(total[others]))
    out_scales = to_np(out_scales)
    assert out_scales[2] == 0.0 and np.isnan(out_scales[9])
    assert np.all(out_scales[others] > 0)


# -------------------------------------------------------------- 4. Triton lowering for CUDA

_CASES = [(8, None), (4, None), (8, 8), (4, 4), (4, 8), (8, 4)]  # (bits, out_bits|None=reduce)


def _lower_case(bits: int, out_bits: int | None, compiler_params=TRITON_PARAMS) -> str:
    groups, nb, block = 3, 13, 64  # G not a power of 2; 13 blocks: overlapping last tile
    width = block if bits == 8 else block // 2
    args = (
        jax.ShapeDtypeStruct((groups, nb * width), jnp.int8 if bits == 8 else jnp.uint8),
        jax.ShapeDtypeStruct((groups, nb), jnp.float32),
    )
    kw = dict(bits=bits, block_size=block, compiler_params=compiler_params)
    if out_bits is None:
        return lower_for_cuda(lambda v, s: D.dequantize_reduce(v, s, **kw), *args)
    return lower_for_cuda(
        lambda v, s: D.dequantize_reduce_requantize(v, s, **kw, out_bits=out_bits), *args
    )


@pytest.mark.parametrize("bits,out_bits", _CASES)
def test_lowers_for_cuda_via_triton(bits, out_bits):
    text = _lower_case(bits, out_bits)
    # One kernel reads all G chunks of a tile: a single Triton call on the [G, nb, w] view.
    assert len(TRITON_CALL.findall(text)) == 1, text[:2000]
    assert "num_warps = 4" in text and "num_stages = 1" in text
    assert "mosaic" not in text.lower()
    # No padded or sliced copies around the kernel: just free reshapes.
    ops = set(re.findall(r"stablehlo\.(\w+)", strip_kernel_ir(text)))
    assert ops <= {"constant", "case", "return", "reshape", "custom_call"}, ops
    [call] = [line for line in text.splitlines() if TRITON_CALL.search(line)]
    results = re.findall(r"tensor<([\dx]+)x(\w+)>", call.rsplit(") -> ", 1)[1])
    if out_bits is None:
        assert results == [("13x64", "f32")]
    else:
        # The fp32 sum is never written: only the requantized values and scales come out.
        width = 64 if out_bits == 8 else 32
        assert results == [(f"13x{width}", "i8" if out_bits == 8 else "ui8"), ("13x1", "f32")]
        assert "div.rn.f32" in text  # the requantize's exact division survived


def test_default_compiler_params_use_triton_on_cuda():
    for out_bits in (None, 4):
        text = _lower_case(4, out_bits, compiler_params=None)
        assert len(TRITON_CALL.findall(text)) == 1 and "mosaic" not in text.lower()


# ---------------------------------------------------------------------- 5. bad input errors

_V8, _V4 = jnp.zeros((2, 64), jnp.int8), jnp.zeros((2, 32), jnp.uint8)
_S = jnp.ones((2, 2), jnp.float32)


_KW = dict(values=_V8, scales=_S, bits=8, block_size=32)
_dr = call_with(D.dequantize_reduce, **_KW, interpret=True)
_drr = call_with(D.dequantize_reduce_requantize, **_KW, interpret=True)
_ref = call_with(D.dequantize_reduce_reference, **_KW)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (_dr(bits=5), ValueError, r"bits=5 is invalid"),
        (_drr(bits=16), ValueError, r"bits=16 is invalid"),
        (_drr(out_bits=3), ValueError, r"bits=3 is invalid"),
        (_dr(block_size=0), ValueError, r"block_size=0 must be positive"),
        (_dr(block_size=-32), ValueError, r"must be positive"),
        (_dr(block_size=32.0), TypeError, r"block_size must be a Python int"),
        (_dr(values=jnp.zeros((2, 7), jnp.uint8), bits=4, block_size=7), ValueError,
         r"block_size=7 must be even"),
        (_drr(values=jnp.zeros((2, 14), jnp.int8), out_bits=4, block_size=7), ValueError,
         r"INT4 packs two values per byte: block_size=7 must be even"),
        (_dr(values=jnp.zeros((2, 100), jnp.int8)), ValueError,
         r"n=100 must be a multiple of block_size=32"),
        (_dr(values=jnp.zeros((2, 50), jnp.uint8), bits=4), ValueError,
         r"n=100 must be a multiple of block_size=32"),
        (_dr(values=jnp.zeros(64, jnp.int8)), ValueError, r"values must be 2-D"),
        (_dr(values=jnp.zeros((0, 64), jnp.int8)), ValueError, r"empty"),
        (_dr(values=jnp.zeros((2, 0), jnp.int8)), ValueError, r"empty"),
        (_dr(values=_V4), TypeError, r"INT8 values must be int8, got uint8"),
        (_dr(values=_V8, bits=4), TypeError, r"INT4 values must be uint8, got int8"),
        (_drr(values=_V8, bits=4, out_bits=8), TypeError, r"INT4 values must be uint8"),
        (_dr(scales=jnp.ones((2, 2), jnp.bfloat16)), TypeError, r"scales must be fp32"),
        (_dr(scales=jnp.ones((3, 2), jnp.float32)), ValueError, r"expected \(2, 2\)"),
        (_dr(scales=jnp.ones(4, jnp.float32)), ValueError, r"expected \(2, 2\)"),
        (_drr(values=_V4, bits=4, block_size=16), ValueError, r"expected \(2, 4\)"),
        # The references validate the same way (they used to fail in a reshape, or not at all).
        (_ref(scales=jnp.ones((3, 2), jnp.float32)), ValueError, r"expected \(2, 2\)"),
        (_ref(values=_V8, bits=4), TypeError, r"INT4 values must be uint8"),
    ],
)
def test_bad_input_raises(call, error, match):
    with pytest.raises(error, match=match):
        call()
