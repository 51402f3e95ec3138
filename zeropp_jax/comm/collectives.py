"""Collectives of the ZeRO data path. Every function here runs inside ``jax.shard_map``.

16-bit data moves as 16-bit integers where the collective does no arithmetic (all-gather,
all-to-all): XLA's CPU backend widens bf16/fp16 collectives to f32 when it compiles, which
would double the bytes on the wire. A bitcast to ``uint16`` keeps them at 2 bytes everywhere.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

# all_gather's result is typed device-varying under shard_map's check_vma; the invariant
# variant (typed replicated) is what an output with PartitionSpec() needs.
from zeropp_jax.core.compat import all_gather_invariant as _all_gather_invariant
from zeropp_jax.core.mesh import AXES

AxisNames = str | Sequence[str]


def _as_tuple(axis_names: AxisNames) -> tuple[str, ...]:
    return (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)


def axis_size(axis_names: AxisNames) -> int:
    """Number of devices spanned by ``axis_names`` (inside ``shard_map``)."""
    size = 1
    for a in _as_tuple(axis_names):
        size *= jax.lax.axis_size(a)
    return size


def axis_index(axis_names: AxisNames) -> jax.Array:
    """Row-major index of this device over ``axis_names`` (inside ``shard_map``).

    For ``("node", "local")`` that is ``node * L + local``, the owner index of flat slices.
    """
    idx = jnp.zeros((), jnp.int32)
    for a in _as_tuple(axis_names):
        idx = idx * jax.lax.axis_size(a) + jax.lax.axis_index(a)
    return idx


_UNSIGNED = {2: jnp.uint16, 4: jnp.uint32}
_SIGNED = {2: jnp.int16, 4: jnp.int32}


def _wire_dtype(dtype: jnp.dtype, distinct: bool) -> jnp.dtype | None:
    """Integer dtype of the same width used to move ``dtype`` untouched, if one is needed.

    ``distinct=True`` picks a signed integer (and bitcasts 4-byte floats too), so the
    gather differs from an otherwise identical unsigned one: XLA's CSE cannot merge the
    backward regather of a unit with its forward gather (the CPU pipeline drops
    optimization barriers early, and a merged gather would keep the full weights alive from
    forward to backward).
    """
    dtype = jnp.dtype(dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        return None
    if distinct:
        return jnp.dtype(_SIGNED[dtype.itemsize]) if dtype.itemsize in _SIGNED else None
    if dtype.itemsize == 2:
        return jnp.dtype(_UNSIGNED[2])
    return None


def to_wire(x: jax.Array, *, distinct: bool = False) -> jax.Array:
    """``x`` as the integer type it travels under (itself if none is needed)."""
    wire = _wire_dtype(x.dtype, distinct)
    return x if wire is None else jax.lax.bitcast_convert_type(x, wire)


def from_wire(x: jax.Array, dtype: Any) -> jax.Array:
    """Inverse of ``to_wire``."""
    return x if x.dtype == jnp.dtype(dtype) else jax.lax.bitcast_convert_type(x, dtype)


def gather_tiled(x: jax.Array, axis_names: AxisNames = AXES, *,
                 hierarchical: bool = False) -> jax.Array:
    """``jax.lax.all_gather(x, axis_names, axis=0, tiled=True)`` of a flat ``x``; with
    ``hierarchical`` and ``axis_names == ("node", "local")``, in two hops (inside
    ``shard_map``):

    1. over ``"node"``: each device receives the shards of its counterparts (same local
       index) on the other nodes — every remote byte crosses into a node exactly once,
       ``(N-1)/N`` of the buffer per node, the lower bound;
    2. over ``"local"``: the node's devices share what they received (inside the node);

    then a transpose puts the pieces in row-major device order (``node * L + local``).
    A flat ring over all ``P`` devices instead moves ``(P-1)/P`` of the buffer into each
    node (0.75 against 0.5 on 2 nodes of 2). Same result, bit for bit.
    """
    axes = _as_tuple(axis_names)
    if hierarchical and axes == tuple(AXES):
        nodes, local = jax.lax.axis_size(axes[0]), jax.lax.axis_size(axes[1])
        if nodes > 1 and local > 1:
            g = jax.lax.all_gather(x, axes[0], axis=0, tiled=True)  # [N k]: (node)
            g = jax.lax.all_gather(g, axes[1], axis=0, tiled=True)  # [L N k]: (local, node)
            return g.reshape(local, nodes, -1).swapaxes(0, 1).reshape(-1)
    return jax.lax.all_gather(x, axes, axis=0, tiled=True)


def all_gather_flat(
    shard: jax.Array,
    axis_names: AxisNames = AXES,
    *,
    invariant: bool = False,
    distinct: bool = False,
    hierarchical: bool = False,
) -> jax.Array:
    """Tiled all-gather of flat shards, in the shard's own dtype on the wire.

    Runs inside ``shard_map``; communicates over ``axis_names`` (default both mesh axes).

    Args:
      shard: ``[k]`` local slice, any dtype.
    Returns:
      ``[k * size]`` with device ``i``'s slice (row-major index over ``axis_names``) at
      ``[i*k:(i+1)*k]``, same dtype as ``shard``. With ``invariant=True`` the result is
      typed replicated over ``axis_names`` (its transpose is a slice, not a reduce-scatter).
      ``distinct=True`` moves the bits as a different integer type, so XLA never merges this
      gather with another of the same data (see ``_wire_dtype``). ``hierarchical=True``
      gathers over the two mesh axes in two hops (``gather_tiled``).
    """
    axes = _as_tuple(axis_names)
    if not invariant and axis_size(axes) == 1:
        return shard  # one device (a 1x1 mesh): the gather is the identity; XLA would copy
    if invariant:
        gathered = _all_gather_invariant(to_wire(shard, distinct=distinct), axes, axis=0,
                                         tiled=True)
    else:
        gathered = gather_tiled(to_wire(shard, distinct=distinct), axes,
                                hierarchical=hierarchical)
    return from_wire(gathered, shard.dtype)


def reduce_scatter_flat(x: jax.Array, axis_names: AxisNames = AXES) -> jax.Array:
    """Sum over devices, then keep this device's slice: ``psum_scatter(tiled=True)``.

    Runs inside ``shard_map``; communicates over ``axis_names``. The reduction runs in
    ``x.dtype`` (bf16 for a bf16 model, as DeepSpeed's ZeRO-3 does).

    Args:
      x: ``[n]`` full local buffer, ``n`` divisible by the number of devices.
    Returns:
      ``[n / size]``: slice ``i`` of the sum over devices, ``i`` this device's index.
    """
    if axis_size(axis_names) == 1:
        return x  # one device: the sum over one device is the identity
    return jax.lax.psum_scatter(x, _as_tuple(axis_names), scatter_dimension=0, tiled=True)


def own_slice(x: jax.Array, axis_names: AxisNames = AXES) -> jax.Array:
    """This device's ``[n / size]`` slice of a replicated ``[n]`` buffer (no communication)."""
    size = axis_size(axis_names)
    k = x.shape[0] // size
    return jax.lax.dynamic_slice_in_dim(x, axis_index(axis_names) * k, k)


def pack_rows(values: jax.Array, scales: jax.Array, rows: int) -> jax.Array:
    """Quantized ``values`` (1-byte ints, ``[rows * a]``) and fp32 ``scales``
    (``[rows * b]``) -> one uint8 ``[rows, a + 4 b]`` buffer: each row's values, then its
    scales' bytes. One collective then moves both: every collective has a fixed cost
    (measured 2.5-3 ms per cross-process collective with gloo), so the scales must not
    travel in a collective of their own."""
    v = jax.lax.bitcast_convert_type(values, jnp.uint8).reshape(rows, -1)
    s = jax.lax.bitcast_convert_type(scales.astype(jnp.float32), jnp.uint8).reshape(rows, -1)
    return jnp.concatenate([v, s], axis=1)


def unpack_rows(buf: jax.Array, value_bytes: int, value_dtype: Any
                ) -> tuple[jax.Array, jax.Array]:
    """Inverse of ``pack_rows``: ``[rows, a + 4 b]`` (any 1-byte type) -> (values
    ``[rows, a]`` of ``value_dtype``, fp32 scales ``[rows, b]``)."""
    buf = jax.lax.bitcast_convert_type(buf, jnp.uint8)
    rows = buf.shape[0]
    values = jax.lax.bitcast_convert_type(buf[:, :value_bytes], value_dtype)
    scales = jax.lax.bitcast_convert_type(buf[:, value_bytes:].reshape(rows, -1, 4),
                                          jnp.float32)
    return values, scales


def gather_packed(values: jax.Array, scales: jax.Array, axes: tuple[str, ...], *,
                  distinct: bool, hierarchical: bool) -> tuple[jax.Array, jax.Array]:
    """All-gathers 1-byte ``values [a]`` and fp32 ``scales [b]`` in one byte buffer
    (``pack_rows``): uint8 on the wire, int8 for ``distinct`` (same bytes, a type XLA
    cannot merge with the forward's). Returns ``[size * a]`` values and ``[size * b]``
    scales in row-major device order."""
    buf = pack_rows(values, scales, 1).reshape(-1)
    if distinct:
        buf = jax.lax.bitcast_convert_type(buf, jnp.int8)
    gathered = gather_tiled(buf, axes, hierarchical=hierarchical)
    v, sc = unpack_rows(gathered.reshape(axis_size(axes), -1), values.shape[0], values.dtype)
    return v.reshape(-1), sc.reshape(-1)


def qwz_all_gather(
    shard: jax.Array,
    *,
    axis_names: AxisNames = AXES,
    bits: int = 8,
    block_size: int = 256,
    out_dtype: Any = None,
    implementation: str | None = None,
    distinct: bool = False,
    hierarchical: bool = False,
    hadamard: bool = False,
    key: jax.Array | None = None,
) -> jax.Array:
    """qwZ: quantize the local shard in blocks, all-gather values and scales, dequantize.

    Runs inside ``shard_map``; communicates over ``axis_names`` (default both mesh axes):
    int8 values (or INT4 packed two per byte) plus one fp32 scale per block, in one uint8
    buffer per device (``pack_rows``; int8 for ``distinct``).

    Args:
      shard: ``[k]`` local slice, bf16/fp16/fp32, ``k`` a multiple of ``block_size``, so
        every device's blocks stay whole and the gathered blocks line up.
      bits: 8 or 4.
      block_size: elements per quantization block.
      out_dtype: dtype of the result; default ``shard.dtype``.
      distinct: move the bits under other integer types so XLA cannot merge this gather
        with an identical one (used for backward regathers; see ``_wire_dtype``).
      hierarchical: gather over the two mesh axes in two hops (``gather_tiled``).
      hadamard: rotate each block by a randomized Walsh–Hadamard transform before
        quantizing it and back after dequantizing (``pallas_kernels/hadamard.py``; fused
        into both kernels with ``implementation="pallas"``; ``block_size`` a power of 2):
        outliers no longer set a block's scale alone, which is what makes INT4 usable.
        Same bytes on the wire.
      key: PRNG key the rotation's signs come from, the same on every device; None: the
        fixed key (``quant.rotation.fixed_key``). Quantization stays deterministic for a
        key, so a regather sees the forward's weights bit for bit.
    Returns:
      ``[k * size]``: the dequantized shards of all devices in row-major device order —
      exactly ``all_gather`` of each device's dequantized shard.
    """
    from zeropp_jax.quant.quantization import check_settings, dequantize_flat, quantize_flat
    from zeropp_jax.quant.rotation import hadamard_signs

    check_settings(bits, block_size, hadamard=hadamard)
    (k,) = shard.shape
    if k % block_size:
        raise ValueError(f"qwz_all_gather: shard length {k=} must be a multiple of {block_size=}")
    out_dtype = shard.dtype if out_dtype is None else out_dtype
    signs = hadamard_signs(key, block_size) if hadamard else None
    kw = dict(bits=bits, block_size=block_size, implementation=implementation, signs=signs)
    values, scales = quantize_flat(shard, **kw)
    # Values and scales in one buffer, one gather.
    values, scales = gather_packed(values, scales, _as_tuple(axis_names), distinct=distinct,
                                   hierarchical=hierarchical)
    return dequantize_flat(values, scales, dtype=out_dtype, **kw)


def fp8_all_gather(
    shard: jax.Array,
    *,
    axis_names: AxisNames = AXES,
    block_size: int = 256,
    fmt: str = "e4m3",
    out_dtype: Any = None,
    distinct: bool = False,
    hierarchical: bool = False,
    hadamard: bool = False,
    key: jax.Array | None = None,
) -> jax.Array:
    """qwZ with FP8 values: block-scaled e4m3 (or e5m2) plus one fp32 scale per block.

    Runs inside ``shard_map``; communicates over ``axis_names``: one byte per value and 4
    per block, in one uint8 buffer per device, as INT8 qwZ (``quant/fp8.py`` for the
    numerics). The dequantize is plain jnp, which XLA may fuse into the consumer of the
    weights. Arguments as ``qwz_all_gather``; ``hadamard`` rotates each block (in jnp)
    before it is quantized.

    Returns:
      ``[k * size]`` of ``out_dtype`` (default ``shard.dtype``): all devices' dequantized
      shards in row-major device order.
    """
    from pallas_kernels.hadamard import rotate_reference, unrotate_reference
    from zeropp_jax.quant.fp8 import dequantize_fp8_flat, quantize_fp8_flat
    from zeropp_jax.quant.rotation import hadamard_signs

    (k,) = shard.shape
    if not isinstance(block_size, int) or block_size <= 0 or k % block_size:
        raise ValueError(f"fp8_all_gather: shard length {k=} must be a multiple of a "
                         f"positive {block_size=}")
    out_dtype = shard.dtype if out_dtype is None else out_dtype
    x = shard
    signs = hadamard_signs(key, block_size) if hadamard else None
    if hadamard:
        x = rotate_reference(x, signs, block_size=block_size)
    values, scales = quantize_fp8_flat(x, block_size=block_size, fmt=fmt)
    values, scales = gather_packed(values, scales, _as_tuple(axis_names), distinct=distinct,
                                   hierarchical=hierarchical)
    if not hadamard:
        return dequantize_fp8_flat(values, scales, block_size=block_size, dtype=out_dtype)
    full = dequantize_fp8_flat(values, scales, block_size=block_size, dtype=jnp.float32)
    return unrotate_reference(full, signs, block_size=block_size).astype(out_dtype)
