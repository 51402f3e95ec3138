"""Pallas quantize/dequantize kernels vs. their plain-jnp references (``pallas_kernels.quantize``).

On this CPU-only machine the kernels run in Pallas interpret mode, where they must equal the
references bit for bit, and are lowered (not run) for CUDA through the Triton backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import quantize as Q

from helpers import all_pairs, pairs_covered
from kernel_testing import (DTYPES, TRITON_CALL, TRITON_PARAMS, assert_bitwise_equal, call_with,
                            lower_for_cuda, sample_blocks, seed_of, to_np)

BITS = (8, 4)
# (block_size, nb, blocks_per_program): nb a multiple of blocks_per_program or not, one tile
# or several, and nb below blocks_per_program (the tile shrinks to a power of 2 >= nb).
SIZES = [(32, 13, 8), (64, 3, 8), (256, 1, 8), (64, 16, 8), (32, 7, 2)]


# ------------------------------------------------------------------------------ helpers


@functools.lru_cache(maxsize=None)
def _program(dtype_name: str, bits: int, block_size: int, bpp: int = 8):
    """``x -> (kernel outputs, reference outputs)``, each ``(values, scales, dequantized)``:
    the kernels (interpret mode) and the references in one ``jit`` per static setting, so a
    case costs one compile instead of dozens of op-by-op ones. The two sides stay separate
    computations in that program (the reference dequantizes the reference's values)."""
    dtype = DTYPES[dtype_name]
    kw = dict(bits=bits, block_size=block_size)

    def kernels_and_references(x):
        values, scales = Q.quantize(x, **kw, interpret=True, blocks_per_program=bpp)
        out = Q.dequantize(values, scales, **kw, dtype=dtype, interpret=True,
                           blocks_per_program=bpp)
        ref_values, ref_scales = Q.quantize_reference(x, **kw)
        ref_out = Q.dequantize_reference(ref_values, ref_scales, **kw, dtype=dtype)
        return (values, scales, out), (ref_values, ref_scales, ref_out)

    return jax.jit(kernels_and_references)


@functools.lru_cache(maxsize=None)
def _run(dtype_name: str, bits: int, block_size: int, nb: int, bpp: int):
    """Kernel (interpret) and reference outputs for one case; shared by several tests."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(seed_of(dtype_name, bits, block_size, nb))
    x = sample_blocks(rng, nb, block_size, dtype)
    return x, *_program(dtype_name, bits, block_size, bpp)(x)


# ------------------------------------------------------------------ 1. bit-for-bit parity


# Sizes x dtypes x widths: an all-pairs cover runs in `make test`, the rest in test-all.
FACTORS = [SIZES, list(DTYPES), list(BITS)]
CASES = all_pairs(*FACTORS)
assert pairs_covered(CASES, FACTORS)


@pytest.mark.parametrize("size,dtype_name,bits", CASES)
def test_kernels_match_reference_bit_for_bit(size, dtype_name, bits):
    block_size, nb, bpp = size
    x, (values, scales, out), (ref_values, ref_scales, ref_out) = _run(
        dtype_name, bits, block_size, nb, bpp
    )
    n = nb * block_size
    assert values.shape == ((n,) if bits == 8 else (n // 2,))
    assert values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert scales.shape == (nb,) and scales.dtype == jnp.float32
    assert out.shape == (n,) and out.dtype == x.dtype
    assert np.all(to_np(scales) > 0)  # random data: no degenerate blocks hiding in the check
    assert_bitwise_equal(values, ref_values)
    assert_bitwise_equal(scales, ref_scales)
    assert_bitwise_equal(out, ref_out)


@pytest.mark.parametrize("bits", BITS)
def test_kernels_match_reference_at_extreme_magnitudes(bits):
    """fp32 blocks near the top of the range, tiny normal blocks and subnormal blocks.

    Subnormals follow the backend's denormal mode (XLA:CPU flushes them to zero); interpret
    mode runs on the same backend as the reference, so they still agree bit for bit.
    """
    rng = np.random.default_rng(seed_of("extreme", bits))
    block_size, nb = 32, 6
    exponents = np.array([127, 100, -100, -126, -140, -149], np.float64)[:, None]
    x = rng.uniform(-1.5, 1.5, size=(nb, block_size)) * 2.0**exponents
    x = jnp.asarray(x.astype(np.float32).reshape(-1))
    (values, scales, out), (ref_values, ref_scales, ref_out) = _program("fp32", bits,
                                                                        block_size)(x)
    assert_bitwise_equal(values, ref_values)
    assert_bitwise_equal(scales, ref_scales)
    # values == ref_values (just checked): ref_out is dequantize_reference of these values.
    assert_bitwise_equal(out, ref_out)


# --------------------------------------------------------------------- 2. round-trip bound


def _half_ulp(v: np.ndarray, dtype) -> np.ndarray:
    """Half the spacing of ``dtype`` at magnitude ``v >= 0`` (float64 in, float64 out)."""
    if jnp.dtype(dtype) == jnp.float32:
        return np.zeros_like(v)  # dequantize computes in fp32: no output rounding
    info = jnp.finfo(dtype)
    _, e = np.frexp(v)  # v = m * 2**e, m in [0.5, 1): binade exponent is e - 1
    exponent = np.maximum(e - 1, info.minexp)  # subnormals share the smallest binade spacing
    return 0.5 * np.ldexp(1.0, exponent - info.nmant)


# The cases below read the programs of the bit-for-bit cases (``_run`` keeps them). Those in
# the all-pairs cover above run in `make test`: for the round trip's three sizes they are
# themselves an all-pairs cover of (size, dtype, width), so every dtype's half ulp meets
# every width's scale; the others would each compile a program of their own (test-all).
_COVER = {c.values for c in CASES if not c.marks}


def _in_cover(cases):
    """``(dtype_name, bits, size)`` cases as params, those outside ``_COVER`` slow."""
    return [pytest.param(d, b, *size, marks=() if (size, d, b) in _COVER else pytest.mark.slow)
            for d, b, size in cases]


_ROUND_TRIP = _in_cover([(d, b, size) for d in DTYPES for b in BITS for size in SIZES[:3]])
assert pairs_covered([pytest.param(tuple(p.values[2:]), *p.values[:2], marks=p.marks)
                      for p in _ROUND_TRIP], [SIZES[:3], list(DTYPES), list(BITS)])


@pytest.mark.parametrize("dtype_name,bits,block_size,nb,bpp", _ROUND_TRIP)
def test_round_trip_error_bounded_by_scale(dtype_name, bits, block_size, nb, bpp):
    # Derivation, per finite block with a normal fp32 scale s > 0 (u = 2**-24, fp32 unit
    # roundoff; Q = qmax). s = fl(absmax * fl(1/Q)) is within (1+u)**2 of absmax / Q, so
    # |x| / s <= Q (1 + 3u). y = fl(x / s) = (x / s)(1 + e), |e| <= u. q = clip(sign(y) *
    # floor(|y| + 0.5)) is within 1/2 of y, except that fl(|y| + 0.5) rounds y = 0.5 - 2**-25
    # up to 1 (|y - q| = 1/2 + 2**-25) and that clipping y in (Q, Q(1 + 3u)] moves it < 3uQ:
    # |y - q| <= 1/2 + 2**-25. So |x / s - q| <= uQ(1 + 3u) + 1/2 + 2**-25, and the fp32
    # product d = fl(q * s) adds u|q|s <= uQs:
    #     |x - d| <= s/2 + s (2uQ + 3u**2 Q + 2**-25) <= s/2 + 2**-22 * Q * s   (Q >= 1).
    # Casting d to bf16/fp16 moves it by at most half an ulp of that dtype at |d|, and
    # |d| <= |x| + (the fp32 bound), so half an ulp at |x| + bound covers it (ulp grows
    # with magnitude; taking it at |x| alone would be wrong just below a power of 2).
    x, (values, scales, out), _ = _run(dtype_name, bits, block_size, nb, bpp)
    x64 = to_np(x).astype(np.float64).reshape(nb, block_size)
    out64 = to_np(out).astype(np.float64).reshape(nb, block_size)
    s = to_np(scales).astype(np.float64)[:, None]
    assert np.all(np.isfinite(s)) and np.all(s >= 2.0**-126)  # the derivation's premise
    fp32_bound = s / 2 + 2.0**-22 * Q.qmax(bits) * s
    bound = fp32_bound + _half_ulp(np.abs(x64) + fp32_bound, x.dtype)
    err = np.abs(x64 - out64)
    worst = np.unravel_index(np.argmax(err - bound), err.shape)
    within = bool(np.all(err <= bound))
    assert within, f"error {err[worst]} > bound {bound[worst]} at block {worst[0]}"
    # The bound is not vacuous: rounding does use up most of the half step somewhere.
    assert np.max(err / s) > 0.4


# ---------------------------------------------------------------------- 3. special blocks


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
def test_zero_and_non_finite_blocks(dtype_name, bits):
    dtype = DTYPES[dtype_name]
    block_size, nb = 32, 7
    rng = np.random.default_rng(seed_of("special", dtype_name, bits))
    clean = to_np(sample_blocks(rng, nb, block_size, jnp.float32)).reshape(nb, block_size)
    x = clean.copy()
    x[1] = 0.0
    x[2, rng.integers(block_size)] = np.inf
    x[3, rng.integers(block_size)] = np.nan
    x[5, rng.integers(block_size)] = -np.inf
    x = jnp.asarray(x.reshape(-1)).astype(dtype)

    (values, scales, out), (ref_values, ref_scales, _) = _program(dtype_name, bits,
                                                                  block_size)(x)
    assert_bitwise_equal(values, ref_values)
    assert_bitwise_equal(scales, ref_scales)

    s = to_np(scales)
    v = to_np(values).reshape(nb, -1)
    o = to_np(out).astype(np.float32).reshape(nb, block_size)
    # All-zero block: scale exactly 0, values 0, exact (+)zeros back.
    assert s[1] == 0.0 and np.all(v[1] == 0)
    assert_bitwise_equal(out.reshape(nb, block_size)[1], jnp.zeros(block_size, dtype))
    # Blocks holding inf, NaN, -inf: NaN scale, zero values, all NaN back.
    for b in (2, 3, 5):
        assert np.isnan(s[b]) and np.all(v[b] == 0) and np.all(np.isnan(o[b])), b
    # Neighbours: finite, and exactly what they quantize to on their own.
    for b in (0, 4, 6):
        alone = jnp.asarray(clean[b]).astype(dtype)
        alone_values, alone_scales = _quantize_reference(bits, block_size)(alone)
        assert s[b] == to_np(alone_scales)[0] and np.array_equal(v[b], to_np(alone_values))
        assert np.all(np.isfinite(o[b]))


@functools.lru_cache(maxsize=None)
def _quantize_reference(bits: int, block_size: int):
    return jax.jit(functools.partial(Q.quantize_reference, bits=bits, block_size=block_size))


# ------------------------------------------------------------------------ 4. INT4 packing


# Packing is per block, whatever the tiling: the cases on programs the cover compiled run in
# `make test` (both dtypes at 64 x 3 blocks), the others in test-all.
@pytest.mark.parametrize("dtype_name,bits,block_size,nb,bpp",
                         _in_cover([(d, 4, size) for d in ("bf16", "fp32") for size in SIZES[:2]]))
def test_int4_layout_and_nibble_range(dtype_name, bits, block_size, nb, bpp):
    x, (values, scales, _), _ = _run(dtype_name, bits, block_size, nb, bpp)
    packed = to_np(values).reshape(nb, block_size // 2)
    lo, hi = packed & 0x0F, packed >> 4
    # Quantized values lie in [-7, 7]: the nibble 0b1000 (-8) never occurs.
    assert not np.any(lo == 8) and not np.any(hi == 8)
    # Independent numpy recomputation of q from the kernel's scales, then the documented
    # layout: byte j of a block = q[j] (low nibble) | q[j + block_size/2] (high nibble).
    xf = to_np(x).astype(np.float32).reshape(nb, block_size)
    y = xf / to_np(scales)[:, None]  # numpy fp32 division is IEEE, like the kernel's
    q = np.clip(np.sign(y) * np.floor(np.abs(y) + np.float32(0.5)), -7, 7).astype(np.int8)
    half = block_size // 2
    expected = (q[:, :half].view(np.uint8) & 0x0F) | ((q[:, half:].view(np.uint8) & 0x0F) << 4)
    np.testing.assert_array_equal(packed, expected)


def test_int4_pack_unpack_round_trip():
    rng = np.random.default_rng(seed_of("pack"))
    nb, block_size = 5, 64
    q = rng.integers(-8, 8, size=(nb, block_size), dtype=np.int8)  # the full nibble range
    packed = Q.pack_int4_reference(jnp.asarray(q), block_size)
    assert packed.dtype == jnp.uint8 and packed.shape == (nb, block_size // 2)
    np.testing.assert_array_equal(to_np(Q.unpack_int4_reference(packed)), q)
    # The dequantize kernel unpacks every byte the same way (scale 1: out == q exactly).
    out = Q.dequantize(
        packed.reshape(-1), jnp.ones(nb, jnp.float32), bits=4, block_size=block_size,
        dtype=jnp.float32, interpret=True,
    )
    np.testing.assert_array_equal(to_np(out).reshape(nb, block_size), q.astype(np.float32))


# -------------------------------------------------------------- 5. Triton lowering for CUDA

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype_name", ["bf16", "fp32"])
@pytest.mark.parametrize("kernel", ["quantize", "dequantize"])
def test_lowers_for_cuda_via_triton(kernel, dtype_name, bits):
    dtype = DTYPES[dtype_name]
    block_size, nb = 64, 13  # nb not a multiple of the 8-block tile: exercises the padding
    kw = dict(bits=bits, block_size=block_size, compiler_params=TRITON_PARAMS)
    if kernel == "quantize":
        text = lower_for_cuda(
            lambda x: Q.quantize(x, **kw), jax.ShapeDtypeStruct((nb * block_size,), dtype)
        )
        # The IEEE division survived into the Triton module (see the module docstring).
        assert "div.rn.f32" in text
    else:
        width = block_size if bits == 8 else block_size // 2
        text = lower_for_cuda(
            lambda v, s: Q.dequantize(v, s, **kw, dtype=dtype),
            jax.ShapeDtypeStruct((nb * width,), jnp.int8 if bits == 8 else jnp.uint8),
            jax.ShapeDtypeStruct((nb,), jnp.float32),
        )
    assert len(TRITON_CALL.findall(text)) == 1, text[:2000]
    assert "num_warps = 4" in text and "num_stages = 1" in text
    assert "mosaic" not in text.lower()


def test_default_compiler_params_use_triton_on_cuda():
    # JAX 0.10 would pick Mosaic GPU for a pallas_call without params; the wrapper doesn't.
    text = lower_for_cuda(
        lambda x: Q.quantize(x, bits=8, block_size=64), jax.ShapeDtypeStruct((128,), jnp.bfloat16)
    )
    assert len(TRITON_CALL.findall(text)) == 1 and "mosaic" not in text.lower()


# ---------------------------------------------------------------------- 6. bad input errors

_X = jnp.ones(64, jnp.float32)
_V8, _V4, _S = jnp.zeros(64, jnp.int8), jnp.zeros(32, jnp.uint8), jnp.ones(2, jnp.float32)


_q = call_with(Q.quantize, x=_X, bits=8, block_size=32, interpret=True)
_dq = call_with(Q.dequantize, values=_V8, scales=_S, bits=8, block_size=32, dtype=jnp.float32,
                interpret=True)


@pytest.mark.parametrize(
    "call,error,match",
    [
        (_q(bits=3), ValueError, r"bits=3 is invalid"),
        (_q(bits=16), ValueError, r"bits=16 is invalid"),
        (_q(block_size=0), ValueError, r"block_size=0 must be positive"),
        (_q(block_size=-32), ValueError, r"must be positive"),
        (_q(block_size=32.0), TypeError, r"block_size must be a Python int"),
        (_q(x=jnp.ones(100)), ValueError, r"n=100 must be a multiple of block_size=32"),
        (_q(x=jnp.ones(62), bits=4, block_size=31), ValueError, r"block_size=31 must be even"),
        (_q(x=jnp.ones(64, jnp.int32)), TypeError, r"bf16, fp16 or fp32, got int32"),
        (_q(x=jnp.ones(64, jnp.int8)), TypeError, r"got int8"),
        (_q(x=jnp.ones(64, bool)), TypeError, r"got bool"),
        (_q(x=jnp.ones(0, jnp.float32)), ValueError, r"empty"),
        (_q(x=jnp.ones((2, 32), jnp.float32)), ValueError, r"must be 1-D"),
        (_q(blocks_per_program=0), ValueError, r"blocks_per_program must be a positive int"),
        (_dq(bits=5), ValueError, r"bits=5 is invalid"),
        (_dq(block_size=0), ValueError, r"must be positive"),
        (_dq(values=_V4, bits=4, block_size=31), ValueError, r"must be even"),
        (_dq(dtype=jnp.int32), TypeError, r"dtype must be bf16, fp16 or fp32"),
        (_dq(scales=jnp.ones(2, jnp.int32)), TypeError, r"scales must be fp32"),
        (_dq(scales=jnp.ones(0, jnp.float32)), ValueError, r"empty"),
        (_dq(values=_V4), TypeError, r"INT8 values must be int8, got uint8"),
        (_dq(values=_V8, bits=4), TypeError, r"INT4 values must be uint8, got int8"),
        (_dq(values=jnp.zeros(60, jnp.int8)), ValueError, r"expected \(64,\)"),
        (_dq(values=_V4, bits=4, block_size=16), ValueError, r"expected \(16,\)"),
    ],
)
def test_bad_input_raises(call, error, match):
    with pytest.raises(error, match=match):
        call()
