"""qgZ's first step, fused: reorder gradient slices (paper Algorithm 2) and quantize them.

A device's full gradient ``x [P * m]`` (``P = nodes * local``) holds slice ``p = i * L + j``
for the device on node ``i``, local index ``j``, at ``x[p*m:(p+1)*m]``. Before qgZ's intra-node
all-to-all, slice ``i * L + j`` moves to slot ``j * nodes + i``: the ``nodes`` slices bound
for local peer ``j`` (one per node) become contiguous and ordered by node, so after both
all-to-all hops every device ends with its own slice, as ``psum_scatter`` would place it.

With ``stages = S`` pipeline stages each slice is cut into ``S`` sub-slices of ``m / S``
elements; stage ``s`` reorders and quantizes sub-slice ``s`` of every slice (the generalized
Algorithm 2), so stage chunks can be sent independently.

Quantization follows the contract in ``pallas_kernels/quantize.py`` exactly, including its
two options: a Hadamard rotation of every block before it is quantized (``signs``) and
stochastic rounding (``seed``, drawn per position in the reordered output).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels.quantize import (
    out_struct,
    _check,
    _check_block_size_type,
    _check_float_input,
    _per_platform,
    _quantize_kernel,
    _tile_rows,
    check_seed,
    quantize_reference,
    rotated_tile,
)
from pallas_kernels.hadamard import check_signs


def _check_layout(n: int, *, nodes: int, local: int, stages: int, stage: int) -> None:
    """``x [n]`` splits into ``nodes * local`` slices of ``stages`` sub-slices each."""
    for name, value in (("nodes", nodes), ("local", local), ("stages", stages)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    num = nodes * local
    if n % (num * stages):
        raise ValueError(f"{n=} must be a multiple of devices * stages = {num * stages}")
    if not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage={stage} must be in [0, {stages})")


def _check_reorder_blocks(n: int, *, nodes: int, local: int, stages: int, stage: int,
                          block_size: int) -> None:
    """The layout checks, then: every sub-slice is whole blocks (no block straddles slots)."""
    _check_layout(n, nodes=nodes, local=local, stages=stages, stage=stage)
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size={block_size} must be positive")
    sub_len = n // (nodes * local * stages)
    if sub_len % block_size:
        raise ValueError(
            f"slice length / stages = {sub_len} must be a multiple of {block_size=}"
        )


def reorder_reference(x: jax.Array, *, nodes: int, local: int, stages: int = 1,
                      stage: int = 0) -> jax.Array:
    """``x [P * m]`` -> stage ``stage``'s sub-slices in slot order, ``[P * m / stages]``.

    Output slot ``j * nodes + i`` holds sub-slice ``stage`` of input slice ``i * local + j``.
    """
    num = nodes * local
    (n,) = x.shape
    _check_layout(n, nodes=nodes, local=local, stages=stages, stage=stage)
    m = n // num
    sub = x.reshape(num, stages, m // stages)[:, stage, :]  # [P, m / S]
    return sub.reshape(nodes, local, m // stages).transpose(1, 0, 2).reshape(-1)


@functools.partial(jax.jit, static_argnames=("nodes", "local", "bits", "block_size", "stages",
                                             "stage"))  # see quantize.quantize_reference
def reorder_quantize_reference(
    x: jax.Array, *, nodes: int, local: int, bits: int, block_size: int, stages: int = 1,
    stage: int = 0, signs: jax.Array | None = None, seed: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Reorder (and pick the stage), then block-quantize: ``(values, scales)`` of
    ``[P * m / stages]`` elements in slot order. ``m / stages`` must be a multiple of
    ``block_size`` so no block straddles two slots. ``signs``: rotate each block first;
    ``seed``: stochastic rounding (``quantize_reference``)."""
    _check_reorder_blocks(x.shape[0], nodes=nodes, local=local, stages=stages, stage=stage,
                          block_size=block_size)
    return quantize_reference(
        reorder_reference(x, nodes=nodes, local=local, stages=stages, stage=stage),
        bits=bits, block_size=block_size, signs=signs, seed=seed,
    )


# ----------------------------------------------------------------------------------------
# Pallas kernel. The reorder lives entirely in the BlockSpec index maps: the grid runs over
# (output slot, tile of blocks within the slot), and the input index map sends output slot
# ``o = j * nodes + i`` to sub-slice ``stage`` of input slice ``i * local + j``. Each program
# then runs quantize.py's kernel body unchanged on its tile, so no reordered copy of ``x`` is
# ever written and the numerics are quantize's by construction.
# ----------------------------------------------------------------------------------------

BLOCKS_PER_PROGRAM = 8  # Blocks per program (grid step); a power of 2, as Triton needs.


def _rows_within(nb: int) -> int:
    """Blocks per program: ``BLOCKS_PER_PROGRAM``, or the largest power of 2 <= ``nb`` when
    there are fewer blocks, so that a tile never extends past the end of its row range."""
    rows = _tile_rows(nb, BLOCKS_PER_PROGRAM)  # min(8, next power of 2 >= nb)
    return rows if rows <= nb else rows // 2


def _tile_start(t: jax.Array, *, rows: int, nb: int) -> jax.Array:
    """First block (row) of tile ``t`` among ``nb`` blocks: tiles are ``rows`` apart, but the
    last one is pulled back to end exactly at ``nb``.

    When ``nb`` is not a multiple of ``rows`` the last tile thus overlaps its neighbour; the
    overlapping blocks are recomputed from the same inputs and written twice with identical
    bytes. That keeps every tile in bounds without a padded copy of the input (the Triton
    lowering does not mask partial blocks) and without masked loads.
    """
    return jnp.minimum(t * rows, nb - rows)


def _source_slice(slot: jax.Array, *, nodes: int, local: int) -> jax.Array:
    """Input slice ``i * local + j`` feeding output slot ``slot = j * nodes + i``."""
    return (slot % nodes) * local + slot // nodes


def _reorder_quantize_kernel(x_ref: Any, *refs: Any, bits: int, block_size: int,
                             ptx_div: bool, rotate: bool, stochastic: bool, rows: int,
                             nb_sub: int) -> None:
    """``_quantize_kernel`` on one tile of one output slot, its block rotated first
    (``rotate``: a signs ref follows ``x_ref``) and rounded stochastically (``stochastic``:
    a seed ref follows), then the values and scales refs."""
    refs = list(refs)
    tile = rotated_tile(x_ref, refs.pop(0), bits, block_size) if rotate else x_ref
    seed = first_block = None
    if stochastic:
        seed = refs.pop(0)[...]
        slot, t = pl.program_id(0), pl.program_id(1)
        first_block = slot * nb_sub + _tile_start(t, rows=rows, nb=nb_sub)
    values_ref, scales_ref = refs
    _quantize_kernel(tile, values_ref, scales_ref, bits=bits, block_size=block_size,
                     ptx_div=ptx_div, seed=seed, first_block=first_block)


def reorder_quantize(
    x: jax.Array,
    *,
    nodes: int,
    local: int,
    bits: int,
    block_size: int,
    stages: int = 1,
    stage: int = 0,
    signs: jax.Array | None = None,
    seed: jax.Array | None = None,
    interpret: bool = False,
    compiler_params: Any = None,
) -> tuple[jax.Array, jax.Array]:
    """Fused reorder + block quantization; bit for bit ``reorder_quantize_reference``.

    Args:
      x: bf16, fp16 or fp32 ``[n]``: ``P = nodes * local`` slices of ``m = n / P`` elements,
        ``m / stages`` a multiple of ``block_size``.
      nodes, local: the device mesh (slice ``i * local + j`` belongs to node ``i``, local
        index ``j``).
      bits: 8 or 4. block_size: elements per block (even for INT4; a power of 2 for Triton).
      stages, stage: quantize sub-slice ``stage`` of ``stages`` of every slice.
      signs: fp32 ±1 ``[block_size]``: rotate each block before quantizing it (fused;
        ``pallas_kernels/hadamard.py``; ``block_size`` a power of 2).
      seed: uint32: stochastic rounding (``quantize.stochastic_uniform``), else half away
        from zero.
      interpret: run in Pallas interpret mode (any backend, e.g. CPU).
      compiler_params: given to ``pallas_call``; ``None`` means Triton's defaults on GPU.

    Returns:
      ``(values, scales)`` for the ``n / stages`` selected elements in slot order: int8
      ``[n / stages]`` (bits=8) or packed uint8 ``[n / (2 * stages)]`` (bits=4), and fp32
      ``[n / (stages * block_size)]``.
    """
    x = jnp.asarray(x)
    _check_float_input(x, "x")
    _check_block_size_type(block_size)
    (n,) = x.shape
    _check_reorder_blocks(n, nodes=nodes, local=local, stages=stages, stage=stage,
                          block_size=block_size)
    _check(n // stages, bits, block_size)  # bits, and even blocks for INT4
    num = nodes * local
    nb_sub = n // (num * stages * block_size)  # blocks per sub-slice (per output slot)
    rows = _rows_within(nb_sub)
    width = block_size if bits == 8 else block_size // 2
    value_dtype = jnp.int8 if bits == 8 else jnp.uint8
    start = functools.partial(_tile_start, rows=rows, nb=nb_sub)
    source = functools.partial(_source_slice, nodes=nodes, local=local)
    extra = (*(() if signs is None else (check_signs(signs, block_size),)),
             *(() if seed is None else (check_seed(seed),)))
    extra_specs = [pl.BlockSpec(a.shape, lambda o, t: (0, 0)) for a in extra]
    kernel = functools.partial(_reorder_quantize_kernel, bits=bits, block_size=block_size,
                               rotate=signs is not None, stochastic=seed is not None,
                               rows=rows, nb_sub=nb_sub)

    def impl(x: jax.Array, *extra: jax.Array, compiler_params: Any, ptx_div: bool
             ) -> tuple[jax.Array, jax.Array]:
        # Free (row-major) view: [input slice, stage, block, element].
        x4 = x.reshape(num, stages, nb_sub, block_size)
        # Blocks are indexed by element offset (pl.Element) so the last tile can start
        # anywhere (see _tile_start); slot and stage axes are squeezed out of the kernel.
        def out_spec(w: int) -> pl.BlockSpec:
            return pl.BlockSpec((None, pl.Element(rows), w), lambda o, t: (o, start(t), 0))

        values, scales = pl.pallas_call(
            functools.partial(kernel, ptx_div=ptx_div),
            out_shape=(
                out_struct((num, nb_sub, width), value_dtype, x),
                out_struct((num, nb_sub, 1), jnp.float32, x),
            ),
            grid=(num, pl.cdiv(nb_sub, rows)),
            in_specs=[
                pl.BlockSpec(
                    (None, None, pl.Element(rows), block_size),
                    lambda o, t: (source(o), stage, start(t), 0),
                ),
                *extra_specs,
            ],
            out_specs=(out_spec(width), out_spec(1)),
            interpret=interpret,
            compiler_params=compiler_params,
            name=f"reorder_quantize_int{bits}" + ("_rotated" if signs is not None else "")
                 + ("_stochastic" if seed is not None else ""),
        )(x4, *extra)
        return values.reshape(num * nb_sub * width), scales.reshape(num * nb_sub)

    return _per_platform(impl, (x, *extra), interpret=interpret,
                         compiler_params=compiler_params)
