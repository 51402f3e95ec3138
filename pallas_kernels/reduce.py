"""qgZ's reductions, fused: dequantize G received chunks, sum them in fp32, and (for the
middle hop) requantize the sum.

Received chunks come stacked: ``values [G, M]`` (INT8, int8) or ``[G, M / 2]`` (INT4, packed
uint8), ``scales [G, M / block_size]`` fp32. The sum runs in fp32 over ``g = 0, 1, ..., G-1``
in that order (the order is part of the contract: float addition is not associative).
Quantization follows the contract in ``pallas_kernels/quantize.py`` exactly.

Each term is the correctly rounded fp32 product ``q * scale``, and it is rounded *before* it
is added. Written naively, ``total + q * scale`` is a product feeding a sum, which LLVM-based
backends may contract into one fused multiply-add, skipping that rounding: XLA:CPU does so
inside a fusion (its LLVM target allows FP-op fusion), which made the naive reference give
different bits eagerly and under ``jit``; XLA:GPU and Triton allow contraction too.
``_dequantize_product`` computes the product as ``q * hi + q * lo`` (``scale = hi + lo``
split so that both partial products are exact), which has the same value and no product
feeding the running sum, so no contraction can change the result on any backend. (A scale
below ``2**-103`` can put ``lo`` or ``q * lo`` in the subnormal range, which backends may
flush to zero: outside the contract, as in quantize.py.) ``_dequantize_product`` lives in
quantize.py, whose rotating dequantize uses it too.

With a Hadamard rotation (``signs``), qgZ's blocks travel rotated and are summed in the
rotated domain (the rotation is linear, the same on every device): the middle hop needs no
rotation at all, and the last one rotates the fp32 sum back (``dequantize_reduce(...,
signs=...)``), still in registers. ``seed`` rounds the middle hop's requantization
stochastically, drawn per position in its ``M``-element output (quantize.py's contract).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.hadamard import check_signs, join_halves as _join_halves, unrotate_rows
from pallas_kernels.quantize import (  # noqa: F401  (_dequantize_product: tested by name here)
    _TileRef,
    _check,
    _check_block_size_type,
    _dequantize_product,
    _per_platform,
    _quantize_kernel,
    check_seed,
    out_struct,
    quantize_reference,
    unpack_int4_reference,
)
from pallas_kernels.reorder import _rows_within, _tile_start

def _check_chunks(values: jax.Array, scales: jax.Array, *, bits: int, block_size: int
                  ) -> tuple[int, int]:
    """Validates stacked chunks; returns ``(G, blocks per chunk)``."""
    _check_block_size_type(block_size)
    if values.ndim != 2:
        raise ValueError(f"values must be 2-D [G, M] (or [G, M / 2] for INT4), got {values.shape}")
    groups, width_total = values.shape
    if groups == 0 or width_total == 0:
        raise ValueError(f"values is empty: nothing to reduce, got {values.shape}")
    m = width_total if bits != 4 else 2 * width_total
    _check(m, bits, block_size)  # bits, block_size, M a multiple of block_size
    value_dtype = jnp.dtype(jnp.int8 if bits == 8 else jnp.uint8)
    if values.dtype != value_dtype:
        raise TypeError(f"INT{bits} values must be {value_dtype}, got {values.dtype}")
    if scales.dtype != jnp.float32:
        raise TypeError(f"scales must be fp32, got {scales.dtype}")
    if scales.shape != (groups, m // block_size):
        raise ValueError(
            f"scales.shape={scales.shape} does not match values.shape={values.shape} of "
            f"INT{bits} blocks of {block_size=}: expected {(groups, m // block_size)}"
        )
    return groups, m // block_size


@functools.partial(jax.jit, static_argnames=("bits", "block_size"))  # see quantize_reference
def _dequantize_chunk_reference(
    values: jax.Array, scales: jax.Array, *, bits: int, block_size: int
) -> jax.Array:
    """``dequantize_reference(values, scales, dtype=fp32)`` (same value): fp32 ``[M]`` from
    one chunk's values and fp32 ``scales [M / block_size]``, via ``_dequantize_product``."""
    nb = scales.shape[0]
    if bits == 8:
        q = values.reshape(nb, block_size)
    else:
        q = unpack_int4_reference(values.reshape(nb, block_size // 2))
    scale = jnp.broadcast_to(scales[:, None], q.shape)
    return _dequantize_product(q.astype(jnp.float32), scale).reshape(nb * block_size)


@functools.partial(jax.jit, static_argnames=("bits", "block_size"))  # see quantize_reference
def dequantize_reduce_reference(
    values: jax.Array, scales: jax.Array, *, bits: int, block_size: int,
    signs: jax.Array | None = None,
) -> jax.Array:
    """``sum_g dequantize(values[g], scales[g])`` in fp32, ``[M]``; with ``signs``, each
    block of the sum rotated back (``hadamard.unrotate_rows``)."""
    groups, nb = _check_chunks(values, scales, bits=bits, block_size=block_size)
    kw = dict(bits=bits, block_size=block_size)
    total = _dequantize_chunk_reference(values[0], scales[0], **kw)
    for g in range(1, groups):
        total = total + _dequantize_chunk_reference(values[g], scales[g], **kw)
    if signs is None:
        return total
    rows = unrotate_rows(total.reshape(nb, block_size), check_signs(signs, block_size))
    return rows.reshape(nb * block_size)


def dequantize_reduce_requantize_reference(
    values: jax.Array, scales: jax.Array, *, bits: int, block_size: int,
    out_bits: int | None = None, seed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """The middle hop: dequantize, sum in fp32, requantize with ``out_bits`` (default
    ``bits``; ``seed``: stochastic rounding). Returns ``(values, scales)`` of ``M``
    elements."""
    total = dequantize_reduce_reference(values, scales, bits=bits, block_size=block_size)
    return quantize_reference(total, bits=bits if out_bits is None else out_bits,
                              block_size=block_size, seed=seed)


# ----------------------------------------------------------------------------------------
# Pallas kernels. One program per tile of ``rows`` blocks; it reads that tile of all G
# chunks (``values [G, rows, width]``, ``scales [G, rows, 1]``), sums their dequantized
# values in registers in g order, and writes the fp32 sum or its requantization. A tile is
# kept either whole (``[rows, block_size]``) or as its two half-blocks (``[rows, bs/2]`` each,
# INT4's packing layout), whichever the input and output formats need, since Triton cannot
# concatenate or interleave along the last axis.
# ----------------------------------------------------------------------------------------


def _load_chunk(values_ref: Any, scales_ref: Any, g: int, *, bits: int, block_size: int,
                halves: bool) -> list[jax.Array]:
    """Chunk ``g`` of the tile, dequantized: fp32 parts (whole, or two half-blocks)."""
    scale = scales_ref[g]  # [rows, 1]
    half = block_size // 2
    if bits == 4:
        packed = values_ref[g].astype(jnp.int32)  # [rows, half]
        # Sign-extend each 4-bit two's complement nibble: (v ^ 8) - 8.
        qs = [((packed & 0x0F) ^ 8) - 8, ((packed >> 4) ^ 8) - 8]
    elif halves:
        qs = [values_ref[g, :, :half], values_ref[g, :, half:]]
    else:
        qs = [values_ref[g]]
    return [
        _dequantize_product(q.astype(jnp.float32), jnp.broadcast_to(scale, q.shape))
        for q in qs
    ]


def _reduce_tile(values_ref: Any, scales_ref: Any, *, bits: int, block_size: int,
                 halves: bool) -> list[jax.Array]:
    """``sum_g dequantize(chunk g)`` over the tile, in g order, as fp32 parts."""
    load = functools.partial(_load_chunk, values_ref, scales_ref, bits=bits,
                             block_size=block_size, halves=halves)
    total = load(0)
    for g in range(1, values_ref.shape[0]):
        total = [t + p for t, p in zip(total, load(g))]
    return total


def _store_parts(out_ref: Any, parts: Sequence[jax.Array], block_size: int) -> None:
    """Writes fp32 parts (whole, or two half-blocks) to ``out_ref [rows, block_size]``."""
    if len(parts) == 1:
        out_ref[...] = parts[0]
        return
    half = block_size // 2
    out_ref[:, :half] = parts[0]
    out_ref[:, half:] = parts[1]


def _dequantize_reduce_kernel(
    values_ref: Any, scales_ref: Any, *refs: Any, bits: int, block_size: int, rotate: bool
) -> None:
    """values ``[G, rows, width]`` (int8, or packed uint8 of width ``bs/2``), scales fp32
    ``[G, rows, 1]`` (then, with ``rotate``, signs fp32 ``[1, bs]``) -> out fp32 ``[rows,
    block_size]``: the sum over g, rotated back with ``rotate``."""
    *signs_ref, out_ref = refs
    parts = _reduce_tile(values_ref, scales_ref, bits=bits, block_size=block_size,
                         halves=bits == 4 and not rotate)
    if rotate:
        parts = [unrotate_rows(parts[0] if len(parts) == 1 else _join_halves(*parts),
                               signs_ref[0][...])]
    _store_parts(out_ref, parts, block_size)


def _dequantize_reduce_requantize_kernel(
    values_ref: Any, scales_ref: Any, *refs: Any, bits: int, out_bits: int, block_size: int,
    ptx_div: bool, stochastic: bool, rows: int, nb: int,
) -> None:
    """As ``_dequantize_reduce_kernel``, then the sum (still in registers) is quantized with
    ``out_bits`` -> out values (int8 ``[rows, bs]`` or uint8 ``[rows, bs/2]``), out scales
    fp32 ``[rows, 1]``. With ``stochastic``, a uint32 seed ref ``[1, 1]`` comes before the
    outputs."""
    *seed_ref, out_values_ref, out_scales_ref = refs
    seed = first_block = None
    if stochastic:
        seed = seed_ref[0][...]
        first_block = _tile_start(pl.program_id(0), rows=rows, nb=nb)
    # Halves whenever either side is INT4: the INT4 unpack yields them, and the INT4 quantize
    # reads them; only INT4 in -> INT8 out has to join them.
    parts = _reduce_tile(values_ref, scales_ref, bits=bits, block_size=block_size,
                         halves=4 in (bits, out_bits))
    _quantize_kernel(_TileRef(parts, block_size), out_values_ref, out_scales_ref,
                     bits=out_bits, block_size=block_size, ptx_div=ptx_div, seed=seed,
                     first_block=first_block)


def _value_width(bits: int, block_size: int) -> int:
    return block_size if bits == 8 else block_size // 2


def _reduce_call(
    kernel: Callable[..., None],
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    block_size: int,
    outs: Sequence[tuple[int, Any]],
    interpret: bool,
    compiler_params: Any,
    name: str,
    extra: Sequence[jax.Array] = (),
) -> list[jax.Array]:
    """``pallas_call`` over tiles of blocks: ``values [G, nb * width]``, ``scales [G, nb]``
    (and each 2-D array of ``extra``, read whole by every program) -> one ``[nb, w]``
    array of dtype ``dt`` per ``(w, dt)`` in ``outs``."""
    groups, nb = scales.shape
    width = _value_width(bits, block_size)
    rows = _rows_within(nb)
    start = functools.partial(_tile_start, rows=rows, nb=nb)
    # All G chunks of a tile in one program (the G axis is one full block); rows by element
    # offset so the last tile can overlap its neighbour instead of running past the end.
    def in_spec(w: int) -> pl.BlockSpec:
        return pl.BlockSpec((groups, pl.Element(rows), w), lambda t: (0, start(t), 0))

    def out_spec(w: int) -> pl.BlockSpec:
        return pl.BlockSpec((pl.Element(rows), w), lambda t: (start(t), 0))

    return pl.pallas_call(
        kernel,
        out_shape=[out_struct((nb, w), dt, values) for w, dt in outs],
        grid=(pl.cdiv(nb, rows),),
        in_specs=[in_spec(width), in_spec(1),
                  *[pl.BlockSpec(a.shape, lambda t: (0, 0)) for a in extra]],
        out_specs=[out_spec(w) for w, _ in outs],
        interpret=interpret,
        compiler_params=compiler_params,
        name=name,
    )(values.reshape(groups, nb, width), scales.reshape(groups, nb, 1), *extra)


def dequantize_reduce(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    block_size: int,
    signs: jax.Array | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> jax.Array:
    """Fused dequantize + sum over chunks; bit for bit ``dequantize_reduce_reference``.

    Args:
      values: ``G`` stacked chunks: int8 ``[G, M]`` (bits=8) or packed uint8 ``[G, M / 2]``
        (bits=4).
      scales: fp32 ``[G, M / block_size]``.
      bits: 8 or 4. block_size: elements per block (even for INT4; a power of 2 for Triton).
      signs: fp32 ±1 ``[block_size]``: rotate each block of the sum back (the chunks are
        rotated blocks; ``pallas_kernels/hadamard.py``), fused: the sum stays in registers.
      interpret: run in Pallas interpret mode (any backend, e.g. CPU).
      compiler_params: given to ``pallas_call``; ``None`` means Triton's defaults on GPU.

    Returns:
      fp32 ``[M]``: ``sum_g dequantize(values[g], scales[g])``, summed in g order (then
      rotated back with ``signs``).
    """
    values, scales = jnp.asarray(values), jnp.asarray(scales)
    _, nb = _check_chunks(values, scales, bits=bits, block_size=block_size)
    extra = () if signs is None else (check_signs(signs, block_size),)

    def impl(values: jax.Array, scales: jax.Array, *extra: jax.Array, compiler_params: Any,
             ptx_div: bool) -> jax.Array:
        del ptx_div  # Nothing is divided.
        [out] = _reduce_call(
            functools.partial(_dequantize_reduce_kernel, bits=bits, block_size=block_size,
                              rotate=bool(extra)),
            values, scales, bits=bits, block_size=block_size,
            outs=[(block_size, jnp.float32)], interpret=interpret,
            compiler_params=compiler_params,
            name=f"dequantize_reduce_int{bits}" + ("_rotated" if extra else ""), extra=extra,
        )
        return out.reshape(nb * block_size)

    return _per_platform(impl, (values, scales, *extra), interpret=interpret,
                         compiler_params=compiler_params)


def dequantize_reduce_requantize(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    block_size: int,
    out_bits: int | None = None,
    seed: jax.Array | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Fused dequantize + sum + requantize; bit for bit
    ``dequantize_reduce_requantize_reference``. The fp32 sum never leaves registers.

    Args:
      values, scales, bits, block_size, interpret, compiler_params: as for
        ``dequantize_reduce``.
      out_bits: 8 or 4 for the output; ``None`` means ``bits``.
      seed: uint32: round the requantization stochastically (``quantize.py``'s contract,
        positions ``0 .. M-1``); None: half away from zero.

    Returns:
      ``(values, scales)`` of the ``M``-element sum: int8 ``[M]`` (out_bits=8) or packed
      uint8 ``[M / 2]`` (out_bits=4), and fp32 ``[M / block_size]``.
    """
    values, scales = jnp.asarray(values), jnp.asarray(scales)
    out_bits = bits if out_bits is None else out_bits
    _, nb = _check_chunks(values, scales, bits=bits, block_size=block_size)
    _check(nb * block_size, out_bits, block_size)
    out_width = _value_width(out_bits, block_size)
    extra = () if seed is None else (check_seed(seed),)

    def impl(values: jax.Array, scales: jax.Array, *extra: jax.Array, compiler_params: Any,
             ptx_div: bool) -> tuple[jax.Array, jax.Array]:
        kernel = functools.partial(_dequantize_reduce_requantize_kernel, bits=bits,
                                   out_bits=out_bits, block_size=block_size, ptx_div=ptx_div,
                                   stochastic=bool(extra), rows=_rows_within(nb), nb=nb)
        out_values, out_scales = _reduce_call(
            kernel, values, scales, bits=bits, block_size=block_size,
            outs=[(out_width, jnp.int8 if out_bits == 8 else jnp.uint8), (1, jnp.float32)],
            interpret=interpret, compiler_params=compiler_params,
            name=f"dequantize_reduce_requantize_int{bits}_int{out_bits}"
                 + ("_stochastic" if extra else ""), extra=extra,
        )
        return out_values.reshape(nb * out_width), out_scales.reshape(nb)

    return _per_platform(impl, (values, scales, *extra), interpret=interpret,
                         compiler_params=compiler_params)
