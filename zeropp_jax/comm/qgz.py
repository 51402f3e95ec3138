"""qgZ: hierarchical all-to-all gradient reduce-scatter with INT4 blocks. Inside ``shard_map``.

One quantization per hop, full-precision sums in between (paper section 3.3):

1. reorder + quantize: slice ``i*L + j`` of the local gradient moves to slot ``j*N + i``
   (paper Algorithm 2), so the ``N`` slices bound for local peer ``j`` are contiguous;
2. all-to-all over ``"local"`` (inside the node): device ``(i, j)`` receives, from each of
   its node's ``L`` devices, the slices ``i'*L + j`` for every node ``i'``;
3. dequantize, sum the ``L`` contributions in fp32, requantize;
4. all-to-all over ``"node"``: slice ``i'*L + j`` goes to node ``i'``;
5. dequantize, sum the ``N`` contributions in fp32: this device's own slice of the total.

Bytes crossing nodes per device: ``(N-1)/N * n/L`` INT4 values (+ scales) instead of
``(N-1)/N * n`` bf16 for a hierarchical bf16 reduce-scatter of the same ``n`` — 4x fewer.

With ``stages = S`` each slice is cut into ``S`` sub-slices handled independently (generalized
Algorithm 2), so stage ``s``'s node hop can overlap stage ``s+1``'s local hop where the
backend overlaps collectives. Sub-slices are whole quantization blocks, so every stage count
quantizes the same blocks and gives bit-identical results.

Only the cross-node hop quantized (``hops="cross"``): step 1 reorders without quantizing,
step 2 moves the gradient's own dtype (16-bit for a bf16 gradient) and step 3 sums in fp32
and quantizes the partial sums for the first time. The cross-node bytes are qgZ's; the
intra-node ones are a 16-bit reduce-scatter's, and each element is quantized once instead
of twice. Where NVLink is many times faster than the network between nodes, those intra
bytes cost little time, and the smaller error of one quantization is what they buy.

One node (``N = 1``): there is no cross-node hop to save, and quantizing the node-local hop
only adds error, so by default qgZ falls back to a full-precision reduce-scatter, as
DeepSpeed does (``single_node="quantize"`` keeps the quantized path).

Hadamard smoothing (``hadamard=True``): step 1 rotates every block before quantizing it
(``pallas_kernels/hadamard.py``: random ±1 signs, a Walsh–Hadamard transform within the
block), with signs every device derives from the same key. The rotation is linear, so the
sums of steps 3 and 5 add rotated blocks and give the rotation of the sum: the middle hop
requantizes in the rotated domain as it is (its blocks are the rotated partial sums, as
smooth as the inputs), and step 5 rotates the final sum back. The reordering is unchanged
and so are the bytes on the wire (same values, same scales). Stochastic rounding
(``stochastic_rounding=True``) rounds the quantizations of steps 1 and 3 up or down at
random with the probabilities that make them unbiased (``pallas_kernels/quantize.py``),
with seeds per device, stage and hop (``quant/rotation.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import reduce as _reduce
from pallas_kernels import reorder as _reorder
from pallas_kernels.reorder import reorder_reference
from zeropp_jax.comm.collectives import from_wire, pack_rows, to_wire, unpack_rows
from zeropp_jax.core.dtypes import accumulation_dtype
from zeropp_jax.quant.quantization import _interpret, _resolve, check_settings
from zeropp_jax.quant.rotation import hadamard_signs, rounding_key, rounding_seed

SINGLE_NODE_MODES = ("reduce_scatter", "quantize")
# Which hops qgZ quantizes: "both" (the paper's qgZ), or "cross" (only the node hop; the
# hop inside the node carries the gradient's own dtype, as hierarchical_reduce_scatter's).
HOPS = ("both", "cross")


def _reorder_quantize(x, impl, **kw):
    if impl == "pallas":
        return _reorder.reorder_quantize(x, interpret=_interpret(x), **kw)
    return _reorder.reorder_quantize_reference(x, **kw)


def _dequantize_reduce_requantize(values, scales, impl, **kw):
    if impl == "pallas":
        return _reduce.dequantize_reduce_requantize(values, scales,
                                                    interpret=_interpret(values), **kw)
    return _reduce.dequantize_reduce_requantize_reference(values, scales, **kw)


def _dequantize_reduce(values, scales, impl, **kw):
    if impl == "pallas":
        return _reduce.dequantize_reduce(values, scales, interpret=_interpret(values), **kw)
    return _reduce.dequantize_reduce_reference(values, scales, **kw)


def _all_to_all(x: jax.Array, axis: str) -> jax.Array:
    """``x [G, c]``: row ``g`` goes to device ``g`` of ``axis``; row ``g`` of the result came
    from device ``g``."""
    return jax.lax.all_to_all(x, axis, split_axis=0, concat_axis=0, tiled=True)


def hierarchical_reduce_scatter(
    x: jax.Array, *, node_axis: str = "node", local_axis: str = "local"
) -> jax.Array:
    """qgZ's two-hop algorithm without quantization: ``psum_scatter``'s placement and value.

    Runs inside ``shard_map``. Reorder (Algorithm 2), all-to-all over ``local_axis``, sum
    the ``L`` contributions in fp32 (float64 for a float64 ``x``), round the partial sums
    back to ``x``'s dtype, all-to-all over ``node_axis``, sum in fp32 again. Both hops move
    ``x``'s dtype as same-width integers (an all-to-all does no arithmetic), so a bf16
    gradient puts bf16 bytes on the wire even where XLA's CPU backend would widen a bf16
    reduce-scatter to f32. Cross-node bytes per device: ``(N-1)/N * n / L`` elements, a
    bandwidth-optimal reduce-scatter's.

    Returns fp32 ``[n / P]`` (float64 for a float64 ``x``).
    """
    nodes = jax.lax.axis_size(node_axis)
    local = jax.lax.axis_size(local_axis)
    (n,) = x.shape
    if n % (nodes * local):
        raise ValueError(f"{n=} must be divisible by the {nodes * local} devices")
    dtype = x.dtype
    y = reorder_reference(x, nodes=nodes, local=local)
    if local > 1:
        y = from_wire(_all_to_all(to_wire(y).reshape(local, -1), local_axis), dtype)
        y = _sum_rows(y)
        if nodes == 1:
            return y
        y = y.astype(dtype)
    y = from_wire(_all_to_all(to_wire(y).reshape(nodes, -1), node_axis), dtype)
    return _sum_rows(y)


def _sum_rows(y: jax.Array) -> jax.Array:
    """``[g, m]`` -> ``[m]`` in fp32 at least (``accumulation_dtype``), the rows added in
    order (as qgZ's dequantize-reduce adds its chunks). Not ``jnp.sum(axis=0)``: XLA's CPU
    backend reduces a short leading axis with a fused convert about 25x slower than these
    adds (measured: 53 ms against 2 ms for a [2, 1.6M] bf16 array on 4 simulated devices
    of a 2-core Xeon, jax 0.10.2), which made the unquantized two-hop reduce-scatter slower
    than qgZ's."""
    wide = accumulation_dtype(y.dtype)
    total = y[0].astype(wide)
    for row in range(1, y.shape[0]):
        total = total + y[row].astype(wide)
    return total


def _one_stage(x, *, nodes, local, bits, block_size, stages, stage, impl, node_axis,
               local_axis, signs=None, rkey=None, hops="both"):
    """One pipeline stage: ``signs`` (or None) rotate the blocks, ``rkey`` (or None) seeds
    stochastic rounding of this stage's two quantizations (hop 0, hop 1). ``hops="cross"``
    with both hops present: hop 1 unquantized (``_cross_only_stage``)."""
    kw = dict(bits=bits, block_size=block_size)

    def seed(hop: int):
        return None if rkey is None else rounding_seed(rkey, stage, hop)

    if hops == "cross" and local > 1 and nodes > 1:
        return _cross_only_stage(x, nodes=nodes, local=local, stages=stages, stage=stage,
                                 impl=impl, node_axis=node_axis, local_axis=local_axis,
                                 signs=signs, seed=seed(1), **kw)
    values, scales = _reorder_quantize(x, impl, nodes=nodes, local=local, stages=stages,
                                       stage=stage, signs=signs, seed=seed(0), **kw)
    if local > 1:
        # Hop 1, inside the node: chunk j (the N slots bound for local peer j) goes to j.
        values, scales = _exchange(values, scales, local, local_axis)
        if nodes == 1:
            return _dequantize_reduce(values, scales, impl, signs=signs, **kw)
        # The partial sums stay rotated: the next hop quantizes rotated blocks too.
        values, scales = _dequantize_reduce_requantize(values, scales, impl, seed=seed(1),
                                                       **kw)
    # Hop 2, across nodes: the partial sum of slice i'*L + j goes to node i'.
    values, scales = _exchange(values, scales, nodes, node_axis)
    return _dequantize_reduce(values, scales, impl, signs=signs, **kw)


def _cross_only_stage(x, *, nodes, local, stages, stage, impl, node_axis, local_axis, signs,
                      seed, bits, block_size):
    """One stage of qgZ with only the node hop quantized: sub-slice ``stage`` of every
    slice, reordered (Algorithm 2) and sent inside the node in ``x``'s dtype, the ``L``
    contributions summed in fp32 (this device's partial sums ``[N * sub]``, row ``i'`` of
    slice ``i' * L + j``), then quantized (rotated first with ``signs``) for the node hop,
    received, dequantized, summed and rotated back. Returns fp32 ``[sub]``."""
    num = nodes * local
    sub = x.shape[0] // num // stages
    part = x.reshape(num, stages, sub)[:, stage].reshape(-1)
    y = reorder_reference(part, nodes=nodes, local=local)
    y = from_wire(_all_to_all(to_wire(y).reshape(local, -1), local_axis), x.dtype)
    partial = _sum_rows(y)
    kw = dict(bits=bits, block_size=block_size)
    values, scales = _reorder_quantize(partial, impl, nodes=1, local=1, signs=signs,
                                       seed=seed, **kw)
    values, scales = _exchange(values, scales, nodes, node_axis)
    return _dequantize_reduce(values, scales, impl, signs=signs, **kw)


def _exchange(values: jax.Array, scales: jax.Array, rows: int, axis: str
              ) -> tuple[jax.Array, jax.Array]:
    """One all-to-all over ``axis`` of row ``g`` of ``values`` with row ``g`` of ``scales``
    (packed into one byte buffer: a collective has a fixed cost, so the scales do not get
    their own). Returns ``[rows, .]`` values and scales as received."""
    value_bytes = values.size // rows * values.dtype.itemsize
    buf = _all_to_all(pack_rows(values, scales, rows), axis)
    return unpack_rows(buf, value_bytes, values.dtype)


def _padded_slice(m: int, block_size: int, stages: int) -> int:
    """A device's slice of ``m`` elements padded to whole blocks in every stage."""
    quantum = stages * block_size
    return -(-m // quantum) * quantum


def _prepare(x: jax.Array, *, nodes: int, local: int, block_size: int, stages: int,
             implementation: str | None, hadamard: bool, stochastic_rounding: bool,
             key: jax.Array | None, node_axis: str, local_axis: str) -> tuple:
    """``(x padded, m, impl, signs, rkey)``: every slice of ``x`` padded to whole blocks
    per stage (slice boundaries stay where ``psum_scatter`` puts them), the slice length
    ``m`` before padding, the implementation, the Hadamard signs (or None) and the
    stochastic rounding key (or None)."""
    num = nodes * local
    m = x.shape[0] // num
    m_pad = _padded_slice(m, block_size, stages)
    if m_pad != m:
        x = jnp.pad(x.reshape(num, m), ((0, 0), (0, m_pad - m))).reshape(-1)
    impl = _resolve(implementation, hadamard)
    signs = hadamard_signs(key, block_size) if hadamard else None
    rkey = None
    if stochastic_rounding:
        device = jax.lax.axis_index(node_axis) * local + jax.lax.axis_index(local_axis)
        rkey = rounding_key(key, x, device)
    return x, m, impl, signs, rkey


def qgz_reduce_scatter(
    x: jax.Array,
    *,
    node_axis: str = "node",
    local_axis: str = "local",
    bits: int = 4,
    block_size: int = 256,
    stages: int = 1,
    single_node: str = "reduce_scatter",
    implementation: str | None = None,
    hadamard: bool = False,
    stochastic_rounding: bool = False,
    key: jax.Array | None = None,
    feedback: tuple[jax.Array, jax.Array] | None = None,
    hops: str = "both",
) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """Quantized hierarchical reduce-scatter; same placement as
    ``psum_scatter(x, (node_axis, local_axis), tiled=True)``.

    Runs inside ``shard_map``; communicates over ``local_axis`` (intra-node all-to-all) and
    then ``node_axis`` (cross-node all-to-all), carrying block-quantized values (INT4 packed
    two per byte, or INT8) plus fp32 block scales.

    Args:
      x: ``[n]`` this device's full gradient (bf16, fp16 or fp32), ``n`` divisible by the
        device count. Slices that are not whole blocks per stage are zero padded internally.
      bits: 4 or 8. block_size: elements per quantization block.
      stages: pipeline stages (each slice cut into this many independent chunks).
      single_node: with one node, ``"reduce_scatter"`` (default) uses an unquantized
        reduce-scatter in ``x``'s dtype; ``"quantize"`` runs the quantized local hop.
      hadamard: rotate every block by a randomized Walsh–Hadamard transform before it is
        quantized and the sum back after (``block_size`` a power of 2). Same bytes on the
        wire.
      stochastic_rounding: round both quantizations stochastically (unbiased) instead of
        to nearest.
      key: PRNG key, the same on every device (e.g. ``jax.random.fold_in(key, step)``):
        the Hadamard signs come from it, and the rounding seeds from it folded with the
        device index. None: a fixed key (``quant.rotation.fixed_key``; the same signs
        every call), and for rounding that key folded with a checksum of the device's
        ``x``, so the dither still changes with the gradient.
      feedback: error feedback: fp32 ``(e1 [h1], e2 [h2])``, this device's kept errors
        (``feedback_lengths``; zeros at the first call), added before the quantizations
        (see "Error feedback" below). None: no feedback.
      hops: ``"both"`` quantizes both hops (the paper's qgZ); ``"cross"`` only the one
        across nodes: the hop inside the node moves ``x``'s dtype and the partial sums are
        quantized once, for the node hop (with one node, nothing is quantized; with
        ``local_axis`` of size 1 the two are the same). Not with ``feedback``.
    Returns:
      fp32 ``[n / P]``: the sum over all devices of this device's slice (within the
      quantization error). With ``feedback``: ``(that slice, (e1', e2') the new errors)``,
      from the same collectives and bytes.
    """
    check_settings(bits, block_size, hadamard=hadamard)
    if hops not in HOPS:
        raise ValueError(f"hops={hops!r}; valid values are {HOPS}")
    if hops == "cross" and feedback is not None:
        raise ValueError("error feedback keeps the errors of both of qgZ's quantizations: "
                         "use hops='both' with feedback")
    if single_node not in SINGLE_NODE_MODES:
        raise ValueError(f"single_node={single_node!r}; valid values are {SINGLE_NODE_MODES}")
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if not jnp.issubdtype(x.dtype, jnp.floating) or x.ndim != 1:
        raise TypeError(f"qgz_reduce_scatter takes a 1-D float gradient, got {x.dtype}{x.shape}")
    nodes = jax.lax.axis_size(node_axis)
    local = jax.lax.axis_size(local_axis)
    num = nodes * local
    (n,) = x.shape
    if n % num:
        raise ValueError(f"{n=} must be divisible by the {num} devices (as for psum_scatter)")
    if feedback is not None:
        return _with_feedback(
            x, feedback, nodes=nodes, local=local, bits=bits, block_size=block_size,
            stages=stages, single_node=single_node, impl=_resolve(implementation, hadamard),
            hadamard=hadamard, stochastic_rounding=stochastic_rounding, key=key,
            node_axis=node_axis, local_axis=local_axis)
    if nodes == 1 and (single_node == "reduce_scatter" or hops == "cross"):
        summed = jax.lax.psum_scatter(x, (node_axis, local_axis), scatter_dimension=0,
                                      tiled=True)
        return summed.astype(jnp.float32)
    x, m, impl, signs, rkey = _prepare(
        x, nodes=nodes, local=local, block_size=block_size, stages=stages,
        implementation=implementation, hadamard=hadamard,
        stochastic_rounding=stochastic_rounding, key=key, node_axis=node_axis,
        local_axis=local_axis)
    parts = [
        _one_stage(x, nodes=nodes, local=local, bits=bits, block_size=block_size,
                   stages=stages, stage=s, impl=impl, node_axis=node_axis,
                   local_axis=local_axis, signs=signs, rkey=rkey, hops=hops)
        for s in range(stages)
    ]
    out = parts[0] if stages == 1 else jnp.concatenate(parts)
    return out[:m]


# -- In three phases -----------------------------------------------------------------------
# Both hops quantized, on several nodes of several devices: qgZ as three separate steps, so a
# caller can run them at different times (``config.qgz_defer``): the quantization (no
# communication), the hop inside the node with its requantization, and the hop across nodes
# with the last dequantization. Composed, they compute what ``qgz_reduce_scatter`` does, bit
# for bit; it keeps its own order of collectives (stage by stage, each stage's two hops).


def staged(nodes: int, local: int, hops: str = "both") -> bool:
    """Whether qgZ on ``nodes x local`` devices runs as ``qgz_quantize`` -> ``qgz_hop_local``
    -> ``qgz_hop_nodes``: both hops present and quantized."""
    return nodes > 1 and local > 1 and hops == "both"


def qgz_quantize(x: jax.Array, *, bits: int = 4, block_size: int = 256, stages: int = 1,
                 implementation: str | None = None, hadamard: bool = False,
                 stochastic_rounding: bool = False, key: jax.Array | None = None,
                 node_axis: str = "node", local_axis: str = "local") -> dict:
    """Phase 1 of staged qgZ (``staged``): this device's ``[n]`` gradient reordered and
    block-quantized for the hop inside the node, stage by stage. No communication.
    Returns ``{"values": per stage, "scales": per stage, "seeds": per stage (the hop-2
    requantization's rounding seed; uint32 0 without stochastic rounding)}``."""
    check_settings(bits, block_size, hadamard=hadamard)
    nodes, local = jax.lax.axis_size(node_axis), jax.lax.axis_size(local_axis)
    x, _, impl, signs, rkey = _prepare(
        x, nodes=nodes, local=local, block_size=block_size, stages=stages,
        implementation=implementation, hadamard=hadamard,
        stochastic_rounding=stochastic_rounding, key=key, node_axis=node_axis,
        local_axis=local_axis)
    out: dict = {"values": [], "scales": [], "seeds": []}
    for stage in range(stages):
        seed0 = None if rkey is None else rounding_seed(rkey, stage, 0)
        values, scales = _reorder_quantize(x, impl, nodes=nodes, local=local, stages=stages,
                                           stage=stage, signs=signs, seed=seed0, bits=bits,
                                           block_size=block_size)
        out["values"].append(values)
        out["scales"].append(scales)
        out["seeds"].append(jnp.uint32(0) if rkey is None else rounding_seed(rkey, stage, 1))
    return {k: tuple(v) for k, v in out.items()}


def qgz_hop_local(q: dict, *, bits: int = 4, block_size: int = 256, stages: int = 1,
                  implementation: str | None = None, hadamard: bool = False,
                  stochastic_rounding: bool = False, key: jax.Array | None = None,
                  node_axis: str = "node", local_axis: str = "local") -> dict:
    """Phase 2 of staged qgZ: ``qgz_quantize``'s blocks sent inside the node (one
    all-to-all over ``local_axis`` per stage), the ``L`` received summed in fp32 and
    requantized for the node hop (still rotated). Returns ``{"values", "scales"}`` per
    stage."""
    local = jax.lax.axis_size(local_axis)
    impl = _resolve(implementation, hadamard)
    out: dict = {"values": [], "scales": []}
    for values, scales, seed in zip(q["values"], q["scales"], q["seeds"]):
        values, scales = _exchange(values, scales, local, local_axis)
        values, scales = _dequantize_reduce_requantize(
            values, scales, impl, seed=seed if stochastic_rounding else None, bits=bits,
            block_size=block_size)
        out["values"].append(values)
        out["scales"].append(scales)
    return {k: tuple(v) for k, v in out.items()}


def qgz_hop_nodes(r: dict, n: int, *, bits: int = 4, block_size: int = 256, stages: int = 1,
                  implementation: str | None = None, hadamard: bool = False,
                  stochastic_rounding: bool = False, key: jax.Array | None = None,
                  node_axis: str = "node", local_axis: str = "local") -> jax.Array:
    """Phase 3 of staged qgZ: ``qgz_hop_local``'s partial sums sent across nodes (one
    all-to-all over ``node_axis`` per stage), dequantized, summed in fp32 and rotated back.
    ``n``: the gradient's length. Returns fp32 ``[n / P]``, as ``qgz_reduce_scatter``."""
    nodes, local = jax.lax.axis_size(node_axis), jax.lax.axis_size(local_axis)
    m = n // (nodes * local)
    impl = _resolve(implementation, hadamard)
    signs = hadamard_signs(key, block_size) if hadamard else None
    parts = []
    for values, scales in zip(r["values"], r["scales"]):
        values, scales = _exchange(values, scales, nodes, node_axis)
        parts.append(_dequantize_reduce(values, scales, impl, signs=signs, bits=bits,
                                        block_size=block_size))
    out = parts[0] if stages == 1 else jnp.concatenate(parts)
    return out[:m]


# -- Error feedback ------------------------------------------------------------------------
# Each device keeps what its quantizations dropped and adds it back before the next call's
# (LoCo, arXiv 2407.04480). Kept in the original (unrotated) domain, so the Hadamard signs
# may change from call to call:
#   hop 1: e1 [n], in the layout of this device's gradient x: y = x + e1 is quantized,
#          e1' = y - (what the quantized blocks decode to, rotated back, un-reordered);
#   hop 2 (nodes > 1 and local > 1): e2 [nodes * m_pad], the partial sums this device
#          requantizes for the node hop, stage by stage ([stages, nodes, m_pad / stages],
#          row i' the partial sum of slice i'*L + j): z = partial + e2 is quantized,
#          e2' = z - (its blocks decoded, rotated back).
# What the devices send plus what they keep equals what they were given plus what they
# kept before: sum(sent) + sum(e1' + e2') = sum(x) + sum(e1 + e2) (up to fp32 rounding).


def feedback_lengths(n: int, *, nodes: int, local: int, block_size: int, stages: int = 1,
                     single_node: str = "reduce_scatter") -> tuple[int, int]:
    """Per-device lengths ``(h1, h2)`` of the errors ``qgz_reduce_scatter_feedback`` keeps
    for an ``[n]`` gradient on a ``nodes x local`` mesh: ``(0, 0)`` when nothing is
    quantized (one node with ``single_node="reduce_scatter"``), ``h2 = 0`` with one hop."""
    if nodes == 1 and single_node == "reduce_scatter":
        return 0, 0
    m = n // (nodes * local)
    m_pad = _padded_slice(m, block_size, stages)
    return n, (nodes * m_pad if nodes > 1 and local > 1 else 0)


def hop2_to_flat(e2: jax.Array, *, nodes: int, local: int, stages: int, m: int,
                 local_index: jax.Array | int) -> jax.Array:
    """A device's hop-2 error ``[nodes * m_pad]`` -> ``[nodes * local * m]`` in the layout
    of its gradient (zeros where it keeps nothing): row ``i'`` of stage ``s`` belongs to
    sub-slice ``s`` of slice ``i' * local + local_index``. Works on traced and numpy
    inputs alike (``local_index`` traced: a one-hot product, no dynamic indexing)."""
    xp = np if isinstance(e2, np.ndarray) else jnp
    m_pad = e2.shape[0] // nodes
    sub = m_pad // stages
    rows = e2.reshape(stages, nodes, sub).transpose(1, 0, 2).reshape(nodes, m_pad)[:, :m]
    onehot = (xp.arange(local) == local_index).astype(e2.dtype)  # [local]
    full = rows[:, None, :] * onehot[None, :, None]  # [nodes, local, m]
    return full.reshape(-1)


def _unreorder(parts: list[jax.Array], *, nodes: int, local: int, m: int) -> jax.Array:
    """Stage outputs in slot order (``[P * m_pad / S]`` each) -> ``[P * m]`` in slice
    order: inverse of ``reorder_reference`` over all stages, padding dropped."""
    num = nodes * local
    rows = [p.reshape(local, nodes, -1).transpose(1, 0, 2).reshape(num, -1) for p in parts]
    return jnp.concatenate(rows, axis=1)[:, :m].reshape(-1)


def _decode(values, scales, impl, signs, **kw):
    """One quantized buffer -> fp32, rotated back with ``signs``."""
    return _dequantize_reduce(values[None], scales[None], impl, signs=signs, **kw)


def qgz_reduce_scatter_feedback(x: jax.Array, feedback: tuple[jax.Array, jax.Array],
                                **kwargs) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``qgz_reduce_scatter(x, feedback=feedback, **kwargs)``: the reduce-scatter with
    error feedback, ``(this device's fp32 [n / P] slice, (e1', e2') its new errors)``."""
    return qgz_reduce_scatter(x, feedback=feedback, **kwargs)


def _with_feedback(x, feedback, *, nodes, local, bits, block_size, stages, single_node, impl,
                   hadamard, stochastic_rounding, key, node_axis, local_axis):
    """``qgz_reduce_scatter`` with ``feedback``, its arguments checked."""
    num = nodes * local
    (n,) = x.shape
    h1, h2 = feedback_lengths(n, nodes=nodes, local=local, block_size=block_size,
                              stages=stages, single_node=single_node)
    e1, e2 = feedback
    if e1.shape != (h1,) or e2.shape != (h2,):
        raise ValueError(f"feedback shapes {e1.shape}, {e2.shape} do not match this mesh "
                         f"and gradient: expected ({h1},), ({h2},)")
    if h1 == 0:  # nothing is quantized (one node): the plain reduce-scatter
        summed = jax.lax.psum_scatter(x, (node_axis, local_axis), scatter_dimension=0,
                                      tiled=True)
        return summed.astype(jnp.float32), (e1, e2)
    m = n // num
    m_pad = _padded_slice(m, block_size, stages)
    y = x.astype(jnp.float32) + e1
    y_pad = y if m_pad == m else jnp.pad(y.reshape(num, m), ((0, 0), (0, m_pad - m))
                                         ).reshape(-1)
    kw = dict(bits=bits, block_size=block_size)
    signs = hadamard_signs(key, block_size) if hadamard else None
    rkey = None
    if stochastic_rounding:
        device = jax.lax.axis_index(node_axis) * local + jax.lax.axis_index(local_axis)
        rkey = rounding_key(key, x, device)

    def seed(stage: int, hop: int):
        return None if rkey is None else rounding_seed(rkey, stage, hop)

    sent1, parts, new_e2 = [], [], []
    sub = m_pad // stages
    for s in range(stages):
        values, scales = _reorder_quantize(y_pad, impl, nodes=nodes, local=local,
                                           stages=stages, stage=s, signs=signs,
                                           seed=seed(s, 0), **kw)
        sent1.append(_decode(values, scales, impl, signs, **kw))
        if local > 1:
            values, scales = _exchange(values, scales, local, local_axis)
            if nodes == 1:
                parts.append(_dequantize_reduce(values, scales, impl, signs=signs, **kw))
                continue
            z = _dequantize_reduce(values, scales, impl, signs=signs, **kw)
            z = z + e2[s * nodes * sub:(s + 1) * nodes * sub]
            values, scales = _reorder_quantize(z, impl, nodes=1, local=1, signs=signs,
                                               seed=seed(s, 1), **kw)
            new_e2.append(z - _decode(values, scales, impl, signs, **kw))
        values, scales = _exchange(values, scales, nodes, node_axis)
        parts.append(_dequantize_reduce(values, scales, impl, signs=signs, **kw))
    out = parts[0] if stages == 1 else jnp.concatenate(parts)
    e1_new = y - _unreorder(sent1, nodes=nodes, local=local, m=m)
    e2_new = jnp.concatenate(new_e2) if new_e2 else e2
    return out[:m], (e1_new, e2_new)
