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


def quantize_reference(
    x: jax.Array, *, bits: int, block_size: int
) -> tuple[jax.Array, jax.Array]:
    """Plain-jnp block quantization. ``x [n]`` -> (values, scales fp32 ``[n / block_size]``).

    ``values`` is int8 ``[n]`` (bits=8) or packed uint8 ``[n / 2]`` (bits=4).
    """
    (n,) = x.shape
    _check(n, bits, block_size)
    xf = x.astype(jnp.float32).reshape(n // block_size, block_size)
    finite = jnp.all(jnp.isfinite(xf), axis=1, keepdims=True)
    absmax = jnp.max(jnp.where(finite, jnp.abs(xf), 0.0), axis=1, keepdims=True)
    # absmax * fp32(1/qmax), spelled out: XLA rewrites ``absmax / qmax`` into this product
    # anyway, and a Triton kernel's true division would differ from it (see the docstring).
    scale = jnp.where(finite, absmax * _inv_qmax(bits), jnp.float32(jnp.nan))
    safe = jnp.where(finite & (scale > 0), scale, jnp.float32(1.0))
    y = jnp.where(finite, xf, 0.0) * (jnp.float32(1.0) / safe)
    q = jnp.clip(_round_half_away(y), -qmax(bits), qmax(bits)).astype(jnp.int8)
    values = q.reshape(n) if bits == 8 else pack_int4_reference(q, block_size).reshape(n // 2)
    return values, scale.reshape(n // block_size)


def dequantize_reference(
    values: jax.Array, scales: jax.Array, *, bits: int, block_size: int, dtype: jnp.dtype
) -> jax.Array:
    """Plain-jnp inverse of ``quantize_reference``: -> ``[n]`` of ``dtype``."""
    nb = scales.shape[0]
    n = nb * block_size
    _check(n, bits, block_size)
    if bits == 8:
        q = values.reshape(nb, block_size)
    else:
        q = unpack_int4_reference(values.reshape(nb, block_size // 2))
    out = q.astype(jnp.float32) * scales.astype(jnp.float32)[:, None]
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
    x_ref: Any, values_ref: Any, scales_ref: Any, *, bits: int, block_size: int, ptx_div: bool
) -> None:
    """One tile of blocks: x ``[r, block_size]`` (bf16/fp16/fp32) -> values, scales ``[r, 1]`` fp32.

    ``values`` is int8 ``[r, block_size]`` (INT8) or uint8 ``[r, block_size / 2]`` (INT4).
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
    for p in parts:
        y = jnp.where(finite, p, 0.0) * jnp.broadcast_to(inv, p.shape)
        qs.append(jnp.clip(_round_half_away(y), -qmax(bits), qmax(bits)).astype(jnp.int32))

    if bits == 8:
        values_ref[...] = qs[0].astype(jnp.int8)
    else:
        lo, hi = qs
        # 4-bit two's complement nibbles: low nibble = first half, high nibble = second half.
        values_ref[...] = ((lo & 0x0F) | ((hi & 0x0F) << 4)).astype(jnp.uint8)
    scales_ref[...] = scale


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

    Returns:
      ``(values, scales)``: int8 ``[n]`` (bits=8) or packed uint8 ``[n / 2]`` (bits=4), and
      fp32 ``[n / block_size]``.
    """
    x = jnp.asarray(x)
    _check_float_input(x, "x")
    (n,) = x.shape
    _check_block_size_type(block_size)
    _check(n, bits, block_size)
    nb = n // block_size
    rows = _tile_rows(nb, blocks_per_program)
    nb_pad = pl.cdiv(nb, rows) * rows
    width = block_size if bits == 8 else block_size // 2
    value_dtype = jnp.int8 if bits == 8 else jnp.uint8

    def impl(x: jax.Array, *, compiler_params: Any, ptx_div: bool) -> tuple[jax.Array, jax.Array]:
        blocks = _pad_rows(x.reshape(nb, block_size), nb_pad)
        values, scales = pl.pallas_call(
            functools.partial(_quantize_kernel, bits=bits, block_size=block_size, ptx_div=ptx_div),
            out_shape=(
                out_struct((nb_pad, width), value_dtype, x),
                out_struct((nb_pad, 1), jnp.float32, x),
            ),
            grid=(nb_pad // rows,),
            in_specs=[pl.BlockSpec((rows, block_size), lambda i: (i, 0))],
            out_specs=(
                pl.BlockSpec((rows, width), lambda i: (i, 0)),
                pl.BlockSpec((rows, 1), lambda i: (i, 0)),
            ),
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"quantize_int{bits}",
        )(blocks)
        return values[:nb].reshape(nb * width), scales[:nb].reshape(nb)

    return _per_platform(impl, (x,), interpret=interpret, compiler_params=compiler_params)


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
) -> jax.Array:
    """Pallas inverse of ``quantize``; bit for bit ``dequantize_reference``.

    Args:
      values: int8 ``[n]`` (bits=8) or packed uint8 ``[n / 2]`` (bits=4).
      scales: fp32 ``[n / block_size]``.
      dtype: output dtype: bf16, fp16 or fp32.
      bits, block_size, interpret, blocks_per_program, compiler_params: as for ``quantize``.

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

    def impl(
        values: jax.Array, scales: jax.Array, *, compiler_params: Any, ptx_div: bool
    ) -> jax.Array:
        del ptx_div  # Dequantization divides nothing.
        # Padding blocks get scale 0 (not NaN), so they stay finite; they are dropped anyway.
        out = pl.pallas_call(
            functools.partial(_dequantize_kernel, bits=bits, block_size=block_size),
            out_shape=out_struct((nb_pad, block_size), dtype, values),
            grid=(nb_pad // rows,),
            in_specs=[
                pl.BlockSpec((rows, width), lambda i: (i, 0)),
                pl.BlockSpec((rows, 1), lambda i: (i, 0)),
            ],
            out_specs=pl.BlockSpec((rows, block_size), lambda i: (i, 0)),
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"dequantize_int{bits}",
        )(_pad_rows(values.reshape(nb, width), nb_pad), _pad_rows(scales.reshape(nb, 1), nb_pad))
        return out[:nb].reshape(nb * block_size)

    return _per_platform(
        impl, (values, scales), interpret=interpret, compiler_params=compiler_params
    )
