"""DeepSpeed-Ulysses sequence parallelism: attention on sequence-sharded activations.

Each of the ``P`` devices of a mesh axis (by default ``"local"``, the devices of one node)
holds ``seq / P`` consecutive tokens of every sequence. Just before attention one all-to-all
over that axis turns the sequence-sharded ``q, k, v`` into full sequences for ``heads / P``
heads; any attention function runs on those heads; a second all-to-all turns its output back
into sequence shards. Per layer a device sends ``3 N h / P`` elements (q, k, v) and then
``N h / P`` (the output), ``4 N h / P`` in all (``N`` tokens per sequence times batch, ``h``
hidden size), of which the fraction ``(P - 1) / P`` leaves the device.

Gradients come from autodiff: the transpose of an all-to-all is the all-to-all with split and
concat axes swapped, so backward also runs exactly two per layer. bf16/fp16 activations move
as uint16 (bitcast; a custom_vjp states the same transpose), because XLA's CPU backend would
widen a 16-bit float all-to-all to f32.

Head layouts (``Hq`` query heads, ``Hkv`` key/value heads, ``Hq % Hkv == 0``; query head
``i`` uses key/value head ``i // (Hq / Hkv)``, the usual GQA/MQA convention):

* ``Hq % P == 0``: device ``r`` gets query heads ``[r Hq/P, (r+1) Hq/P)``. Key/value heads
  are repeated ``P / gcd(Hkv, P)`` times first (once, i.e. not at all, if ``Hkv % P == 0``;
  MQA/GQA with ``Hkv < P`` gets each head replicated to the devices whose query heads use
  it), so that each device also receives exactly the key/value heads its queries need.
* ``Hq % P != 0`` (uneven): with ``uneven_heads="pad"`` (default) key/value heads are
  expanded to ``Hq`` and all three are padded with zero heads to the next multiple of ``P``;
  the padded heads' outputs are dropped. Costs ``ceil(Hq/P) P / Hq`` the traffic and compute
  of an even split. ``uneven_heads="error"`` raises instead. (DeepSpeed splits heads
  unevenly with variable-size all-to-alls; JAX's all-to-all needs equal chunks.)
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

AttentionFn = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]


def dot_product_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Plain softmax attention on whole sequences; the single-device reference.

    Args:
      q: ``[batch, seq, Hq, head_dim]``.
      k, v: ``[batch, seq, Hkv, head_dim]`` with ``Hq % Hkv == 0`` (GQA/MQA: query head
        ``i`` uses key/value head ``i // (Hq / Hkv)``).
      causal: token ``i`` attends to tokens ``<= i`` only.
      mask: optional bool ``[seq_q, seq_k]`` (or broadcastable to ``[batch, Hq, seq_q,
        seq_k]``), True where attention is allowed.

    Returns:
      ``[batch, seq, Hq, head_dim]`` in ``q``'s dtype; softmax in fp32.
    """
    hq, hkv = q.shape[2], k.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads {hq} must be a multiple of key/value heads {hkv}")
    if hkv != hq:
        k = jnp.repeat(k, hq // hkv, axis=2)
        v = jnp.repeat(v, hq // hkv, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(q.shape[-1]).astype(q.dtype)
    allowed = None
    if causal:
        allowed = jnp.tril(jnp.ones((q.shape[1], k.shape[1]), bool))[None, None]
    if mask is not None:
        m = jnp.asarray(mask, bool)
        m = m[None, None] if m.ndim == 2 else m
        allowed = m if allowed is None else allowed & m
    if allowed is not None:
        logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def head_plan(q_heads: int, kv_heads: int, sp: int,
              uneven_heads: Literal["pad", "error"] = "pad") -> tuple[int, int]:
    """How ``ulysses_attention`` splits heads over ``sp`` devices.

    Returns ``(kv_repeat, padded_q_heads)``: each key/value head is repeated ``kv_repeat``
    times (consecutively) and query heads (and the repeated key/value heads, if padding)
    are padded with zero heads to ``padded_q_heads``. See the module docstring.
    """
    if q_heads < 1 or kv_heads < 1 or q_heads % kv_heads:
        raise ValueError(
            f"query heads ({q_heads}) must be a positive multiple of key/value heads "
            f"({kv_heads}): GQA/MQA query head i uses key/value head i // (Hq / Hkv)"
        )
    if q_heads % sp == 0:
        # kv_heads * rep becomes a multiple of sp, and rep divides the group size
        # q_heads / kv_heads (sp | q_heads), so every device's queries find their keys there.
        return sp // math.gcd(kv_heads, sp), q_heads
    if uneven_heads == "error":
        raise ValueError(
            f"{q_heads} query heads cannot be split evenly over the {sp} devices of the "
            f"sequence-parallel axis; use a head count that is a multiple of {sp}, a "
            "sequence-parallel degree that divides it, or uneven_heads='pad' (pads with "
            f"{-q_heads % sp} zero heads)"
        )
    if uneven_heads != "pad":
        raise ValueError(f"uneven_heads must be 'pad' or 'error', got {uneven_heads!r}")
    return q_heads // kv_heads, -(-q_heads // sp) * sp


def _check_shapes(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
    for name, a in (("q", q), ("k", k), ("v", v)):
        if a.ndim != 4:
            raise ValueError(
                f"{name} must be [batch, seq / P, heads, head_dim] (4-D), got shape {a.shape}"
            )
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {k.shape} and v {v.shape}")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(
            f"q {q.shape} and k/v {k.shape} must agree on [batch, seq / P] (self-attention: "
            "every device holds the same tokens of q, k and v)"
        )
    if q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q head_dim {q.shape[3]} != k/v head_dim {k.shape[3]}; the three move in one "
            "all-to-all, so they need one head_dim (pad v's heads if they are narrower)"
        )
    if q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}; cast them")
    if q.shape[2] % k.shape[2]:
        raise ValueError(
            f"query heads {q.shape[2]} must be a multiple of key/value heads {k.shape[2]}"
        )


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _all_to_all_16bit(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int
                      ) -> jax.Array:
    # bf16/fp16 move as uint16 (a bitcast): XLA's CPU backend widens 16-bit float
    # collectives to f32 when it compiles (see collectives.py), doubling the bytes.
    u = jax.lax.bitcast_convert_type(x, jnp.uint16)
    u = jax.lax.all_to_all(u, axis_name, split_axis, concat_axis, tiled=True)
    return jax.lax.bitcast_convert_type(u, x.dtype)


def _a2a16_fwd(x, axis_name, split_axis, concat_axis):
    return _all_to_all_16bit(x, axis_name, split_axis, concat_axis), None


def _a2a16_bwd(axis_name, split_axis, concat_axis, _, g):
    # The transpose of an all-to-all: the same exchange with split and concat swapped.
    return (_all_to_all_16bit(g, axis_name, concat_axis, split_axis),)


_all_to_all_16bit.defvjp(_a2a16_fwd, _a2a16_bwd)


def _all_to_all(x: jax.Array, axis_name: str, split_axis: int, concat_axis: int) -> jax.Array:
    """Tiled all-to-all over ``axis_name`` in ``x``'s dtype (16-bit floats as uint16)."""
    if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize == 2:
        return _all_to_all_16bit(x, axis_name, split_axis, concat_axis)
    return jax.lax.all_to_all(x, axis_name, split_axis, concat_axis, tiled=True)


def _pad_heads(x: jax.Array, heads: int) -> jax.Array:
    return jnp.pad(x, ((0, 0), (0, 0), (0, heads - x.shape[2]), (0, 0)))


def ulysses_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    attention_fn: AttentionFn,
    axis_name: str = "local",
    uneven_heads: Literal["pad", "error"] = "pad",
) -> jax.Array:
    """Sequence-parallel attention (DeepSpeed-Ulysses). Runs inside ``jax.shard_map``.

    Two all-to-alls over ``axis_name`` (size ``P``): one carries q, k and v stacked
    (sequence-sharded -> head-sharded), one carries the output back (head-sharded ->
    sequence-sharded). Device ``r`` of ``axis_name`` holds tokens ``[r S/P, (r+1) S/P)`` of
    every sequence (``S`` the full length), before and after.

    Args:
      q: ``[batch, S / P, Hq, head_dim]``, this device's tokens.
      k, v: ``[batch, S / P, Hkv, head_dim]`` (``Hq % Hkv == 0``; GQA, MQA), same dtype.
      attention_fn: ``attention_fn(q, k, v) -> out`` on full sequences for a group of heads:
        ``q [batch, S, hq, head_dim]``, ``k, v [batch, S, hkv, head_dim]`` with
        ``hq % hkv == 0`` (query head ``i`` uses key/value head ``i // (hq / hkv)``),
        returning ``[batch, S, hq, head_dim]``. Dense, causal, masked or your own; it must
        treat every head alike (it is not told which heads it got) and must not mix
        heads. Position-dependent masks see global positions ``0..S-1``.
      axis_name: the mesh axis the sequence is split over.
      uneven_heads: ``"pad"`` pads to a multiple of ``P`` heads when ``Hq % P != 0``;
        ``"error"`` raises instead.

    Returns:
      ``[batch, S / P, Hq, head_dim]`` in ``q``'s dtype: this device's tokens of the output.
    """
    _check_shapes(q, k, v)
    sp = jax.lax.axis_size(axis_name)
    b, s_local, hq, d = q.shape
    hkv = k.shape[2]
    kv_repeat, hq_pad = head_plan(hq, hkv, sp, uneven_heads)
    if kv_repeat > 1:
        k = jnp.repeat(k, kv_repeat, axis=2)
        v = jnp.repeat(v, kv_repeat, axis=2)
    if hq_pad != hq:  # uneven: k, v were expanded to hq heads above; pad all three
        q, k, v = (_pad_heads(a, hq_pad) for a in (q, k, v))
    hq_dev, hkv_dev = hq_pad // sp, k.shape[2] // sp
    # One all-to-all for q, k, v: group each device's heads ([..., P, heads/P, d]) and put
    # its q, k and v heads side by side, so chunk r of the split axis is device r's share.
    qkv = jnp.concatenate(
        [q.reshape(b, s_local, sp, hq_dev, d),
         k.reshape(b, s_local, sp, hkv_dev, d),
         v.reshape(b, s_local, sp, hkv_dev, d)],
        axis=3,
    )  # [b, S/P, P, hq/P + 2 hkv/P, d]
    # Split the device-group axis, concatenate the sequence: chunks arrive in device order,
    # which is sequence order because device r holds tokens [r S/P, (r+1) S/P).
    qkv = _all_to_all(qkv, axis_name, split_axis=2, concat_axis=1)
    qkv = qkv[:, :, 0]  # [b, S, hq/P + 2 hkv/P, d]
    q_full = qkv[:, :, :hq_dev]
    k_full = qkv[:, :, hq_dev:hq_dev + hkv_dev]
    v_full = qkv[:, :, hq_dev + hkv_dev:]
    out = attention_fn(q_full, k_full, v_full)
    if out.shape != q_full.shape:
        raise ValueError(
            f"attention_fn returned shape {out.shape}; expected {q_full.shape} "
            "([batch, full seq, heads of this group, head_dim], same as its q)"
        )
    out = out.astype(q.dtype)
    # Back: split the sequence, concatenate heads in device order (= original head order).
    out = _all_to_all(out, axis_name, split_axis=1, concat_axis=2)
    return out[:, :, :hq] if hq_pad != hq else out  # [b, S/P, Hq, d]


def all_to_all_bytes_per_layer(batch: int, seq_len: int, hidden: int, sp: int,
                               itemsize: int) -> dict[str, float]:
    """Ulysses' per-device traffic of one attention layer's forward (paper: ``4 N h / P``).

    ``N = batch * seq_len`` tokens, ``h = hidden`` (all query heads times head_dim, MHA),
    ``P = sp``. Returns ``result_bytes`` (the two all-to-alls' per-device buffers,
    ``4 N h / P`` elements) and ``sent_bytes`` (the part that leaves the device,
    ``(P - 1) / P`` of it).
    """
    result = 4 * batch * seq_len * hidden / sp * itemsize
    return {"result_bytes": result, "sent_bytes": result * (sp - 1) / sp}


def pad_sequence(x: np.ndarray, multiple: int, *, axis: int = 1, value: int = 0
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Pads ``x`` at the end of ``axis`` to a multiple of ``multiple`` (host side).

    Returns ``(padded, valid)`` with ``valid`` a bool mask over ``axis`` (True on real
    tokens). With causal attention, padding at the end is exact: no real token attends to a
    later (padded) one; weight the loss with ``valid``. Non-causal attention must also mask
    keys at positions ``>= seq_len`` inside ``attention_fn``.
    """
    x = np.asarray(x)
    n = x.shape[axis]
    extra = -n % multiple
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    valid = np.arange(n + extra) < n
    return np.pad(x, widths, constant_values=value), valid
