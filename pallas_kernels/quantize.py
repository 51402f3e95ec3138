"""Block-wise symmetric quantization: plain-jnp references (and Pallas kernels beside them).

Numerics contract, shared bit for bit by the reference and the kernels:

* Input ``x``: 1-D, length ``n`` a multiple of ``block_size``; bf16, fp16 or fp32. All
  arithmetic is in fp32 (``xf = x.astype(float32)``).
* Per block of ``block_size`` consecutive elements: ``absmax = max |xf|``,
  ``qmax = 2**(bits-1) - 1`` (127 for INT8, 7 for INT4), ``scale = absmax * fp32(1/qmax)``
  (a product with the fp32-rounded reciprocal, not ``absmax / qmax``: XLA already rewrites a
  division by a constant into exactly this product, and Triton's fp32 division is
  approximate, so spelling it out is what keeps every backend bit-identical).
* Non-finite blocks: if any element of a block is inf or NaN, its scale is NaN, its values
  are 0, and the whole block dequantizes to NaN — loud, never finite garbage.
* All-zero blocks: scale 0, values 0, dequantize to exact zeros (no division by zero).
* ``y = xf * inv`` with ``inv = 1 / scale`` per block (scale 0 replaced by 1; an IEEE,
  correctly rounded fp32 division: on CUDA the kernels use PTX ``div.rn.f32`` because
  Triton lowers ``/`` to ``div.full.f32``, which is off by up to 2 ulp). A product with the
  reciprocal, not ``xf / scale``: XLA rewrites a division by a broadcast block scale into
  exactly this product on every backend (measured on jax 0.10.2 CPU and 0.11.2 GPU: the
  jnp reference computed ``63.499996`` as ``63.5``), so only the spelled-out product is
  one computation everywhere. Then rounded half away from zero:
  ``q = sign(y) * floor(|y| + 0.5)``, clipped to ``[-qmax, qmax]``. (Not ``jnp.round``:
  Pallas's Triton lowering rejects it, and half-to-even would differ anyway.)
* INT8: ``values`` int8 ``[n]``. INT4: ``values`` uint8 ``[n / 2]``, two per byte, packed
  within each block: element ``j`` of the block's first half in the low nibble and element
  ``j + block_size/2`` in the high nibble, both as 4-bit two's complement. (A half-block
  split keeps the kernel free of interleaving reshapes.) ``block_size`` must be even.
* ``scales``: fp32 ``[n / block_size]``.
* Dequantize: ``values (as fp32) * scale``, then cast to the requested dtype.
* Stochastic rounding (``seed`` given; the gradient quantizers of qgZ): instead of rounding
  half away from zero, ``|y|`` rounds up with probability ``frac(|y|)`` and down otherwise,
  ``q = sign(y) * (floor(|y|) + [u < |y| - floor(|y|)])``, clipped as above, so ``E[q] = y``.
  ``u`` in ``[0, 1)`` (a multiple of ``2**-23``) is a counter-based hash of the seed and the
  element's position in the quantized output (``stochastic_uniform``), so the kernels and
  the reference draw the same ``u`` without moving random bits through memory. ``u``'s
  grid makes ``P(round up) = ceil(frac * 2**23) / 2**23``: a bias below ``2**-23`` of a
  step. (Working on ``|y|`` keeps ``y = x * inv`` from feeding a subtraction, which an
  LLVM backend could contract into an FMA and round differently.)
* Hadamard rotation (``signs`` given, ``pallas_kernels/hadamard.py``): ``quantize``
  rotates each fp32 block before the steps above and ``dequantize`` rotates back after
  the products, which it computes as ``_dequantize_product`` (the qgZ reductions' form,
  below) so that no product feeds the rotation's sums.

Round-trip error: for a finite block, ``|x - dequantize(quantize(x))| <= scale / 2``
elementwise, up to fp32 rounding (of ``1 / scale`` and ``xf * inv``, of ``q * scale``, and of ``|y| + 0.5``,
which sends ``y = 0.5 - 2**-25`` to 1: together at most ``2**-22 * qmax * scale``) and the
output dtype's own rounding, since ``|y| <= qmax`` and rounding moves ``y`` by at most 1/2.
fp32 subnormals are outside the contract: backends may flush them to zero (XLA:CPU does, so
in interpret mode the kernels do too), which adds up to ``2**-126`` of absolute error, and a
block whose scale would be subnormal (``absmax < qmax * 2**-126``) may come back as zeros.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.hadamard import check_signs, join_halves, rotate_rows, unrotate_rows

VALID_BITS = (4, 8)


def qmax(bits: int) -> int:
    """Largest quantized magnitude: 127 for INT8, 7 for INT4."""
    return 2 ** (bits - 1) - 1


def _inv_qmax(bits: int) -> jax.Array:
    """``1 / qmax`` rounded once to fp32 (Python's float64 quotient rounds to the same fp32)."""
    return jnp.float32(1.0 / qmax(bits))


def out_struct(shape: tuple[int, ...], dtype: Any, like: jax.Array) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output type that varies over mesh axes as ``like`` does.

    Inside ``shard_map`` (with its default ``check_vma=True``) every ``pallas_call`` output
    must say how it varies across the mesh; a kernel's outputs vary as its input does.
    Outside ``shard_map`` this is the plain type.
    """
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.typeof(like).manual_axis_type)


def _check(n: int, bits: int, block_size: int) -> None:
    if bits not in VALID_BITS:
        raise ValueError(f"bits={bits} is invalid; valid values are {VALID_BITS}")
    if block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    if n % block_size:
        raise ValueError(f"{n=} must be a multiple of {block_size=}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"INT4 packs two values per byte: {block_size=} must be even")


def _round_half_away(y: jax.Array) -> jax.Array:
    return jnp.sign(y) * jnp.floor(jnp.abs(y) + 0.5)


def _mix32(h: jax.Array) -> jax.Array:
    """An avalanching uint32 permutation (the "lowbias32" integer hash)."""
    h = h ^ (h >> jnp.uint32(16))
    h = h * jnp.uint32(0x7FEB352D)
    h = h ^ (h >> jnp.uint32(15))
    h = h * jnp.uint32(0x846CA68B)
    return h ^ (h >> jnp.uint32(16))


def stochastic_uniform(seed: jax.Array, index: jax.Array) -> jax.Array:
    """fp32 ``u`` in ``[0, 1)``, a multiple of ``2**-23``, for uint32 ``seed`` and element
    ``index`` (broadcast together): the top 23 bits of a hash of ``index + hash(seed)``.

    Counter-based, so the kernels draw it in registers from the element's position. A
    seed picks an offset into one stream ``hash(0), hash(1), ...``; hashing the seed first
    puts even consecutive seeds' offsets far apart, so two calls of ``n`` elements share
    draws only with probability about ``2 n / 2**32``.
    """
    h = _mix32(index.astype(jnp.uint32) + _mix32(seed.astype(jnp.uint32)))
    # 23 bits fit an int32 exactly; converting from int32 is what every backend has.
    return (h >> jnp.uint32(9)).astype(jnp.int32).astype(jnp.float32) * jnp.float32(2.0**-23)


def _round_stochastic(y: jax.Array, u: jax.Array) -> jax.Array:
    """``sign(y) * (floor(|y|) + 1)`` with probability ``frac(|y|)``, else ``sign(y) *
    floor(|y|)``: unbiased up to ``u``'s ``2**-23`` grid. ``|y| - floor(|y|)`` is exact."""
    m = jnp.abs(y)
    f = jnp.floor(m)
    return jnp.sign(y) * (f + jnp.where(u < m - f, jnp.float32(1.0), jnp.float32(0.0)))


def _element_index(first_block: jax.Array, shape: tuple[int, int], block_size: int,
                   column0: int = 0) -> jax.Array:
    """uint32 position ``(first_block + row) * block_size + column0 + column`` of each
    element of an ``[r, w]`` tile whose row ``i`` is block ``first_block + i``."""
    rows = first_block + jax.lax.broadcasted_iota(jnp.int32, shape, 0)
    cols = jax.lax.broadcasted_iota(jnp.int32, shape, 1) + column0
    return (rows * block_size + cols).astype(jnp.uint32)


# Keeps the sign, the exponent and the top 11 of the 23 stored mantissa bits of an fp32.
_HI_MASK = 0xFFFFF000


def _dequantize_product(q: jax.Array, scale: jax.Array) -> jax.Array:
    """``fl(q * scale)`` for fp32 ``q`` holding 8-bit integers and fp32 ``scale`` of the same
    shape or broadcastable to it, in a form no FMA contraction can alter.

    ``hi`` is ``scale`` cut to 12 significant bits and ``lo = scale - hi`` (exact) holds the
    other 12, so ``q * hi`` and ``q * lo`` are exact (at most 8 + 12 bits) and their rounded
    sum is exactly ``fl(q * scale)``; contracting either product into that sum gives the same
    bits. Non-finite scales pass through as ``hi`` (with ``lo = 0``), so ``q * inf`` and NaN
    scales behave as in ``q * scale``. (Only the sign of a zero product may differ, and only
    for a negative scale, which quantization never produces.)
    """
    finite = jnp.isfinite(scale)
    bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(_HI_MASK)
    hi = jnp.where(finite, jax.lax.bitcast_convert_type(bits, jnp.float32), scale)
    lo = jnp.where(finite, scale - hi, jnp.float32(0.0))
    return q * hi + q * lo


class _TileRef:
    """Read-only stand-in for ``_quantize_kernel``'s input ref, over an fp32 tile held in
    registers as parts (whole, or two half-blocks).

    It lets a fused kernel (a rotation, a reduction) reuse the quantize kernel body
    unchanged without writing its tile to memory (Pallas on Triton has no scratch buffers).
    Serves exactly the reads that body makes: ``[...]`` (the whole tile) and ``[:, :half]``
    / ``[:, half:]`` (tile in halves).
    """

    def __init__(self, parts: Sequence[jax.Array], block_size: int):
        self._parts = list(parts)
        half = block_size // 2
        # A list, not a dict: slices are unhashable before Python 3.12.
        self._half_indices = [(slice(None), slice(None, half)), (slice(None), slice(half, None))]

    def __getitem__(self, idx: Any) -> jax.Array:
        if idx is Ellipsis:
            return self._parts[0] if len(self._parts) == 1 else join_halves(*self._parts)
        if isinstance(idx, tuple) and idx in self._half_indices:
            if len(self._parts) == 1:  # a whole tile read in halves (INT4 output)
                return jnp.split(self._parts[0], 2, axis=1)[self._half_indices.index(idx)]
            return self._parts[self._half_indices.index(idx)]
        raise NotImplementedError(f"_TileRef does not serve index {idx!r}")


def pack_int4_reference(q: jax.Array, block_size: int) -> jax.Array:
    """int8 ``[nb, block_size]`` in [-8, 7] -> uint8 ``[nb, block_size / 2]`` (half-block packing)."""
    half = block_size // 2
    lo = q[:, :half].astype(jnp.uint8) & jnp.uint8(0x0F)
    hi = q[:, half:].astype(jnp.uint8) & jnp.uint8(0x0F)
    return lo | (hi << jnp.uint8(4))


def unpack_int4_reference(packed: jax.Array) -> jax.Array:
    """uint8 ``[nb, block_size / 2]`` -> int8 ``[nb, block_size]`` (sign-extended nibbles)."""
    lo = (packed & jnp.uint8(0x0F)).astype(jnp.int8)
    hi = (packed >> jnp.uint8(4)).astype(jnp.int8)
    # Sign-extend 4-bit two's complement: (v ^ 8) - 8.
    lo = (lo ^ jnp.int8(8)) - jnp.int8(8)
    hi = (hi ^ jnp.int8(8)) - jnp.int8(8)
    return jnp.concatenate([lo, hi], axis=1)


def check_seed(seed: Any) -> jax.Array:
    """A stochastic-rounding seed as uint32 ``[1, 1]`` (given as a uint32 scalar or one
    element array; e.g. ``jax.random.bits(key, (), jnp.uint32)``)."""
    seed = jnp.asarray(seed)
    if seed.size != 1 or seed.dtype != jnp.uint32:
        raise TypeError(f"seed must be one uint32 value (jax.random.bits(key, (), "
                        f"jnp.uint32)), got {seed.dtype}{seed.shape}")
    return seed.reshape(1, 1)


# The plain-jnp references are jitted: a step calls them once per unit, hop and stage with
# few distinct shapes (a model's layers share theirs), and a jitted function is traced and
# lowered once per shape and reused after (XLA inlines the call, so the program is the
# same). Tracing them again at every call was a tenth of the trace time of a qgZ step.
@functools.partial(jax.jit, static_argnames=("bits", "block_size"))
def quantize_reference(
    x: jax.Array, *, bits: int, block_size: int, seed: jax.Array | None = None,
    signs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp block quantization. ``x [n]`` -> (values, scales fp32 ``[n / block_size]``).

    ``values`` is int8 ``[n]`` (bits=8) or packed uint8 ``[n / 2]`` (bits=4). ``seed``
    (uint32): stochastic rounding, drawn per element position ``0 .. n-1``; None: half away
    from zero. ``signs`` (fp32 ±1 ``[block_size]``): rotate each block first
    (``hadamard.rotate_rows``; ``block_size`` a power of 2).
    """
    (n,) = x.shape
    _check(n, bits, block_size)
    xf = x.astype(jnp.float32).reshape(n // block_size, block_size)
    if signs is not None:
        xf = rotate_rows(xf, check_signs(signs, block_size))
    # Two reductions of the same rows, neither reading the other, so XLA computes them in
    # one pass over ``xf`` (a multi-output reduction); a non-finite row's max is not used.
    finite = jnp.all(jnp.isfinite(xf), axis=1, keepdims=True)
    absmax = jnp.where(finite, jnp.max(jnp.abs(xf), axis=1, keepdims=True), 0.0)
    # absmax * fp32(1/qmax), spelled out: XLA rewrites ``absmax / qmax`` into this product
    # anyway, and a Triton kernel's true division would differ from it (see the docstring).
    scale = jnp.where(finite, absmax * _inv_qmax(bits), jnp.float32(jnp.nan))
    safe = jnp.where(finite & (scale > 0), scale, jnp.float32(1.0))
    y = jnp.where(finite, xf, 0.0) * (jnp.float32(1.0) / safe)
    if seed is None:
        rounded = _round_half_away(y)
    else:
        index = _element_index(jnp.int32(0), y.shape, block_size)
        rounded = _round_stochastic(y, stochastic_uniform(check_seed(seed), index))
    q = jnp.clip(rounded, -qmax(bits), qmax(bits)).astype(jnp.int8)
    values = q.reshape(n) if bits == 8 else pack_int4_reference(q, block_size).reshape(n // 2)
    return values, scale.reshape(n // block_size)


@functools.partial(jax.jit, static_argnames=("bits", "block_size", "dtype"))
def dequantize_reference(
    values: jax.Array, scales: jax.Array, *, bits: int, block_size: int, dtype: jnp.dtype,
    signs: jax.Array | None = None,
) -> jax.Array:
    """Plain-jnp inverse of ``quantize_reference``: -> ``[n]`` of ``dtype``. ``signs``:
    rotate each fp32 block back (``hadamard.unrotate_rows``) before the cast."""
    nb = scales.shape[0]
    n = nb * block_size
    _check(n, bits, block_size)
    if bits == 8:
        q = values.reshape(nb, block_size)
    else:
        q = unpack_int4_reference(values.reshape(nb, block_size // 2))
    if signs is None:
        out = q.astype(jnp.float32) * scales.astype(jnp.float32)[:, None]
    else:
        # hi and lo per block, broadcast by the products: no full-size scale array (a
        # compiler may hoist such a broadcast out of a scanned stack's loop and hold it).
        out = unrotate_rows(_dequantize_product(q.astype(jnp.float32),
                                                scales.astype(jnp.float32)[:, None]),
                            check_signs(signs, block_size))
    return out.astype(dtype).reshape(n)


# ----------------------------------------------------------------------------------------
# Pallas kernels. Each program handles a tile of ``blocks_per_program`` whole blocks, viewed
# as a 2-D ``[blocks_per_program, block_size]`` array, so every per-block reduction is a
# row reduction inside one program. The arithmetic below mirrors the reference op for op;
# no product feeds a sum, so FMA contraction (on by default in Triton) cannot change a result.
# ----------------------------------------------------------------------------------------

_FLOAT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))


def _div_rn(a: jax.Array, b: jax.Array, *, ptx: bool) -> jax.Array:
    """IEEE round-to-nearest fp32 ``a / b`` (same shapes).

    With ``ptx`` (Triton on CUDA only) this is inline ``div.rn.f32``: Triton lowers ``/`` to
    ``div.full.f32``, which may differ from XLA's division by up to 2 ulp and so would break
    the bit-for-bit contract. Elsewhere ``/`` stays: interpret mode runs XLA's IEEE division,
    and ROCm's Triton lowers it to LLVM ``fdiv``, which is IEEE there.
    """
    if not ptx:
        return a / b
    [out] = pltriton.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[a, b],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)],
    )
    return out


def _quantize_kernel(
    x_ref: Any, values_ref: Any, scales_ref: Any, *, bits: int, block_size: int, ptx_div: bool,
    seed: jax.Array | None = None, first_block: jax.Array | None = None,
) -> None:
    """One tile of blocks: x ``[r, block_size]`` (bf16/fp16/fp32) -> values, scales ``[r, 1]`` fp32.

    ``values`` is int8 ``[r, block_size]`` (INT8) or uint8 ``[r, block_size / 2]`` (INT4).
    ``seed`` (uint32 ``[1, 1]``): stochastic rounding, with row ``i`` of the tile at block
    ``first_block + i`` of the output (the positions the reference hashes).
    """
    half = block_size // 2
    # INT4 works on the two half-blocks separately, so that packing element j with element
    # j + half is plain elementwise arithmetic (no interleaving reshape, which Triton lacks).
    if bits == 8:
        parts = [x_ref[...].astype(jnp.float32)]
    else:
        parts = [x_ref[:, :half].astype(jnp.float32), x_ref[:, half:].astype(jnp.float32)]

    # Block is finite iff every element is. Triton has no reduce_and, so take the row minimum
    # of an int32 indicator instead.
    all_finite = functools.reduce(
        jnp.minimum,
        [jnp.min(jnp.isfinite(p).astype(jnp.int32), axis=1, keepdims=True) for p in parts],
    )
    finite = all_finite == 1  # [r, 1]
    # Non-finite entries are masked before the max (Triton's max ignores NaN, XLA's doesn't).
    absmax = functools.reduce(
        jnp.maximum,
        [jnp.max(jnp.where(finite, jnp.abs(p), 0.0), axis=1, keepdims=True) for p in parts],
    )
    scale = jnp.where(finite, absmax * _inv_qmax(bits), jnp.float32(jnp.nan))
    safe = jnp.where(finite & (scale > 0), scale, jnp.float32(1.0))
    inv = _div_rn(jnp.ones_like(safe), safe, ptx=ptx_div)  # [r, 1]
    qs = []
    for k, p in enumerate(parts):
        y = jnp.where(finite, p, 0.0) * jnp.broadcast_to(inv, p.shape)
        if seed is None:
            rounded = _round_half_away(y)
        else:
            index = _element_index(first_block, p.shape, block_size, k * half)
            rounded = _round_stochastic(y, stochastic_uniform(seed, index))
        qs.append(jnp.clip(rounded, -qmax(bits), qmax(bits)).astype(jnp.int32))

    if bits == 8:
        values_ref[...] = qs[0].astype(jnp.int8)
    else:
        lo, hi = qs
        # 4-bit two's complement nibbles: low nibble = first half, high nibble = second half.
        values_ref[...] = ((lo & 0x0F) | ((hi & 0x0F) << 4)).astype(jnp.uint8)
    scales_ref[...] = scale


def rotated_tile(x_ref: Any, signs_ref: Any, bits: int, block_size: int) -> _TileRef:
    """``x_ref``'s tile rotated (``hadamard.rotate_rows``), as a ref ``_quantize_kernel``
    reads: whole for INT8, in half-blocks for INT4."""
    y = rotate_rows(x_ref[...].astype(jnp.float32), signs_ref[...])
    return _TileRef([y] if bits == 8 else jnp.split(y, 2, axis=1), block_size)


def _rotating_quantize_kernel(x_ref: Any, signs_ref: Any, values_ref: Any, scales_ref: Any,
                              *, bits: int, block_size: int, ptx_div: bool) -> None:
    """``_quantize_kernel`` of the rotated tile (signs fp32 ``[1, block_size]``)."""
    _quantize_kernel(rotated_tile(x_ref, signs_ref, bits, block_size), values_ref, scales_ref,
                     bits=bits, block_size=block_size, ptx_div=ptx_div)


def _dequantize_kernel(
    values_ref: Any, scales_ref: Any, out_ref: Any, *, bits: int, block_size: int
) -> None:
    """One tile: values (int8 ``[r, block_size]`` or uint8 ``[r, block_size/2]``) and scales
    fp32 ``[r, 1]`` -> out ``[r, block_size]`` of the output dtype."""
    scale = scales_ref[...]
    if bits == 8:
        q = values_ref[...].astype(jnp.float32)
        out_ref[...] = (q * jnp.broadcast_to(scale, q.shape)).astype(out_ref.dtype)
        return
    half = block_size // 2
    packed = values_ref[...].astype(jnp.int32)
    # Sign-extend each 4-bit two's complement nibble: (v ^ 8) - 8. The halves are stored
    # separately, mirroring the half-block packing (no interleave).
    halves = ((packed & 0x0F, slice(None, half)), (packed >> 4, slice(half, None)))
    for nibble, window in halves:
        q = ((nibble ^ 8) - 8).astype(jnp.float32)
        out_ref[:, window] = (q * jnp.broadcast_to(scale, q.shape)).astype(out_ref.dtype)


def _unrotating_dequantize_kernel(values_ref: Any, scales_ref: Any, signs_ref: Any,
                                  out_ref: Any, *, bits: int, block_size: int) -> None:
    """As ``_dequantize_kernel``, then each fp32 block rotated back before the cast. The
    products are ``_dequantize_product``'s, so none feeds the rotation's sums."""
    scale = scales_ref[...]
    if bits == 8:
        qs = [values_ref[...].astype(jnp.float32)]
    else:
        packed = values_ref[...].astype(jnp.int32)
        qs = [(((packed & 0x0F) ^ 8) - 8).astype(jnp.float32),
              (((packed >> 4) ^ 8) - 8).astype(jnp.float32)]
    parts = [_dequantize_product(q, jnp.broadcast_to(scale, q.shape)) for q in qs]
    tile = parts[0] if bits == 8 else join_halves(*parts)
    out_ref[...] = unrotate_rows(tile, signs_ref[...]).astype(out_ref.dtype)


def _tile_rows(nb: int, blocks_per_program: int) -> int:
    """Blocks per program: ``blocks_per_program``, shrunk (to a power of 2, as Triton needs)
    when there are fewer blocks than that, so tiny inputs aren't padded 8-fold."""
    if not isinstance(blocks_per_program, int) or blocks_per_program <= 0:
        raise ValueError(f"blocks_per_program must be a positive int, got {blocks_per_program!r}")
    return min(blocks_per_program, pl.next_power_of_2(nb))


def _pad_rows(a: jax.Array, rows: int) -> jax.Array:
    """Appends zero rows to 2-D ``a`` until it has ``rows`` rows."""
    extra = rows - a.shape[0]
    return jnp.pad(a, ((0, extra), (0, 0))) if extra else a


def _per_platform(
    impl: Callable[..., Any], args: Sequence[jax.Array], *, interpret: bool, compiler_params: Any
) -> Any:
    """Runs ``impl(*args, compiler_params=..., ptx_div=...)`` with per-platform settings.

    On GPU, JAX 0.10 lowers ``pallas_call`` without compiler params to Mosaic GPU, which
    these Triton-style kernels are not written for, so ``None`` becomes Triton's defaults
    there. Exact PTX division only on CUDA + Triton (see ``_div_rn``).
    """
    if interpret:
        return impl(*args, compiler_params=compiler_params, ptx_div=False)
    gpu_params = pltriton.CompilerParams() if compiler_params is None else compiler_params
    is_triton = isinstance(gpu_params, pltriton.CompilerParams)
    return jax.lax.platform_dependent(
        *args,
        cuda=functools.partial(impl, compiler_params=gpu_params, ptx_div=is_triton),
        rocm=functools.partial(impl, compiler_params=gpu_params, ptx_div=False),
        default=functools.partial(impl, compiler_params=compiler_params, ptx_div=False),
    )


def _check_block_size_type(block_size: int) -> None:
    # Block shapes are static: a float or traced block_size would fail obscurely later.
    if not isinstance(block_size, int):
        raise TypeError(f"block_size must be a Python int, got {block_size!r}")


def _check_float_input(x: jax.Array, name: str) -> None:
    if x.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {x.shape}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty: nothing to quantize")


def quantize(
    x: jax.Array,
    *,
    bits: int,
    block_size: int,
    interpret: bool = False,
    blocks_per_program: int = 8,
    compiler_params: Any = None,
    signs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Pallas block quantization; bit for bit ``quantize_reference``.

    Args:
      x: bf16, fp16 or fp32 ``[n]``, ``n`` a positive multiple of ``block_size``.
      bits: 8 or 4.
      block_size: elements per block (even for INT4). For the Triton lowering it must be a
        power of 2, as must ``blocks_per_program``.
      interpret: run the kernel in Pallas interpret mode (any backend, e.g. CPU).
      blocks_per_program: blocks handled by one program (grid step); shrunk to the next
        power of 2 >= nb when there are fewer blocks. A block count that isn't a multiple of
        it is padded with zero blocks, whose outputs are dropped.
      compiler_params: given to ``pallas_call``, e.g.
        ``jax.experimental.pallas.triton.CompilerParams(num_warps=4, num_stages=1)``.
        ``None`` means Triton's defaults on GPU.
      signs: fp32 ±1 ``[block_size]``: rotate each block first (``hadamard.rotate_rows``,
        fused: the rotated tile stays in registers); ``block_size`` a power of 2.

    Returns:
      ``(values, scales)``: int8 ``[n]`` (bits=8) or packed uint8 ``[n / 2]`` (bits=4), and
      fp32 ``[n / block_size]``.
    """
    x = jnp.asarray(x)
    _check_float_input(x, "x")
    (n,) = x.shape
    _check_block_size_type(block_size)
    _check(n, bits, block_size)
    extra = () if signs is None else (check_signs(signs, block_size),)
    nb = n // block_size
    rows = _tile_rows(nb, blocks_per_program)
    nb_pad = pl.cdiv(nb, rows) * rows
    width = block_size if bits == 8 else block_size // 2
    value_dtype = jnp.int8 if bits == 8 else jnp.uint8

    kernel = _quantize_kernel if signs is None else _rotating_quantize_kernel

    def impl(x: jax.Array, *signs: jax.Array, compiler_params: Any, ptx_div: bool
             ) -> tuple[jax.Array, jax.Array]:
        blocks = _pad_rows(x.reshape(nb, block_size), nb_pad)
        values, scales = pl.pallas_call(
            functools.partial(kernel, bits=bits, block_size=block_size, ptx_div=ptx_div),
            out_shape=(
                out_struct((nb_pad, width), value_dtype, x),
                out_struct((nb_pad, 1), jnp.float32, x),
            ),
            grid=(nb_pad // rows,),
            in_specs=[pl.BlockSpec((rows, block_size), lambda i: (i, 0)),
                      *[pl.BlockSpec((1, block_size), lambda i: (0, 0)) for _ in signs]],
            out_specs=(
                pl.BlockSpec((rows, width), lambda i: (i, 0)),
                pl.BlockSpec((rows, 1), lambda i: (i, 0)),
            ),
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"quantize_int{bits}" + ("_rotated" if signs else ""),
        )(blocks, *signs)
        return values[:nb].reshape(nb * width), scales[:nb].reshape(nb)

    return _per_platform(impl, (x, *extra), interpret=interpret,
                         compiler_params=compiler_params)


def dequantize(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    block_size: int,
    dtype: Any,
    interpret: bool = False,
    blocks_per_program: int = 8,
    compiler_params: Any = None,
    signs: jax.Array | None = None,
) -> jax.Array:
    """Pallas inverse of ``quantize``; bit for bit ``dequantize_reference``.

    Args:
      values: int8 ``[n]`` (bits=8) or packed uint8 ``[n / 2]`` (bits=4).
      scales: fp32 ``[n / block_size]``.
      dtype: output dtype: bf16, fp16 or fp32.
      bits, block_size, interpret, blocks_per_program, compiler_params: as for ``quantize``.
      signs: fp32 ±1 ``[block_size]``: rotate each fp32 block back before the cast (fused).

    Returns:
      ``[n]`` of ``dtype``; blocks with a NaN scale are all NaN.
    """
    values, scales = jnp.asarray(values), jnp.asarray(scales)
    dtype = jnp.dtype(dtype)
    if dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtype must be bf16, fp16 or fp32, got {dtype}")
    if scales.ndim != 1 or scales.dtype != jnp.float32:
        raise TypeError(f"scales must be fp32 [nb], got {scales.dtype} {scales.shape}")
    nb = scales.shape[0]
    if nb == 0:
        raise ValueError("scales is empty: nothing to dequantize")
    _check_block_size_type(block_size)
    _check(nb * block_size, bits, block_size)
    width = block_size if bits == 8 else block_size // 2
    value_dtype = jnp.dtype(jnp.int8 if bits == 8 else jnp.uint8)
    if values.dtype != value_dtype:
        raise TypeError(f"INT{bits} values must be {value_dtype}, got {values.dtype}")
    if values.shape != (nb * width,):
        raise ValueError(
            f"values.shape={values.shape} does not match {nb} scales of INT{bits} blocks of "
            f"{block_size=}: expected ({nb * width},)"
        )
    rows = _tile_rows(nb, blocks_per_program)
    nb_pad = pl.cdiv(nb, rows) * rows
    extra = () if signs is None else (check_signs(signs, block_size),)
    kernel = _dequantize_kernel if signs is None else _unrotating_dequantize_kernel

    def impl(
        values: jax.Array, scales: jax.Array, *signs: jax.Array, compiler_params: Any,
        ptx_div: bool
    ) -> jax.Array:
        del ptx_div  # Dequantization divides nothing.
        # Padding blocks get scale 0 (not NaN), so they stay finite; they are dropped anyway.
        out = pl.pallas_call(
            functools.partial(kernel, bits=bits, block_size=block_size),
            out_shape=out_struct((nb_pad, block_size), dtype, values),
            grid=(nb_pad // rows,),
            in_specs=[
                pl.BlockSpec((rows, width), lambda i: (i, 0)),
                pl.BlockSpec((rows, 1), lambda i: (i, 0)),
                *[pl.BlockSpec((1, block_size), lambda i: (0, 0)) for _ in signs],
            ],
            out_specs=pl.BlockSpec((rows, block_size), lambda i: (i, 0)),
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"dequantize_int{bits}" + ("_rotated" if signs else ""),
        )(_pad_rows(values.reshape(nb, width), nb_pad), _pad_rows(scales.reshape(nb, 1), nb_pad),
          *signs)
        return out[:nb].reshape(nb * block_size)

    return _per_platform(
        impl, (values, scales, *extra), interpret=interpret, compiler_params=compiler_params
    )
