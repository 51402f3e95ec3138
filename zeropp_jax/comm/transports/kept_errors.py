"""qgZ's kept errors as state of the run: how they are stored, described and moved to
another mesh. The gradient transport that keeps them (``QgzReduceScatter`` with
``error_feedback``) answers through these; a checkpoint stores the buffers and the record
without knowing what they are.

Per unit and device five buffers: hop 1's error as FP8 e4m3 values and one fp32 scale per
``FEEDBACK_BLOCK`` elements, hop 2's the same, and an fp32 ``[1]`` use count. Globally
each is the devices' buffers end to end (device ``node * local + local index``), split
over ``("node", "local")``.

Onto another mesh a device's errors mean nothing (they are laid out by the writing mesh's
slices and quantization hops), so ``reshard`` applies one rule per unit: every device's
kept errors are decoded, put into the layout of the unit's flat gradient (hop 2's into
the slices they belong to) and summed over devices and hops, in fp32, over the unit's
real elements: the gradient mass not sent yet. Every device of the new mesh keeps an
equal share of it, total / (number of devices), as its hop-1 error (re-encoded in FP8
with block scales, which rounds it once more: by at most 2^-4 of each element plus 2^-10
of its block's scale) and nothing for hop 2, so the next step sends the whole total. On
a single node qgZ keeps no errors: there the mass is dropped.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.comm.qgz import hop2_to_flat
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.quant.fp8 import dequantize_fp8_flat, quantize_fp8_flat

# The kept errors are stored as FP8 e4m3 with one fp32 scale per this many elements:
# 8 bits per element plus 32 / FEEDBACK_BLOCK for the scales (1.125 bits at 256).
FEEDBACK_BLOCK = 256
FEEDBACK_FORMAT = "e4m3"

# The record's keys that fix how the buffers are laid out: equal records on the same mesh
# mean the stored buffers are the new ones, bit for bit.
LAYOUT_KEYS = ("n", "n_pad", "h1", "h2", "stages", "shapes", "dtypes")

Feedback = tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]


def padded(n: int) -> int:
    """``n`` rounded up to whole blocks of ``FEEDBACK_BLOCK``."""
    return -(-n // FEEDBACK_BLOCK) * FEEDBACK_BLOCK


def encode_error(e: jax.Array) -> tuple[jax.Array, jax.Array]:
    """fp32 ``[h]`` -> (FP8 values ``[h_pad]``, fp32 scales ``[h_pad / FEEDBACK_BLOCK]``),
    ``h_pad`` ``h`` rounded up to whole blocks (zeros after ``h``)."""
    (h,) = e.shape
    if padded(h) != h:
        e = jnp.pad(e, (0, padded(h) - h))
    return quantize_fp8_flat(e, block_size=FEEDBACK_BLOCK, fmt=FEEDBACK_FORMAT)


def decode_error(values: jax.Array, scales: jax.Array, h: int) -> jax.Array:
    """Inverse of ``encode_error``: fp32 ``[h]``."""
    return dequantize_fp8_flat(values, scales, block_size=FEEDBACK_BLOCK)[:h]


def specs(lengths: tuple[int, int]) -> tuple[jax.ShapeDtypeStruct, ...]:
    """One device's five buffers for hop lengths ``(h1, h2)`` (``()``: both 0, nothing
    kept)."""
    if tuple(lengths) == (0, 0):
        return ()
    out = []
    for h in lengths:
        out += [jax.ShapeDtypeStruct((padded(h),), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((padded(h) // FEEDBACK_BLOCK,), jnp.float32)]
    return (*out, jax.ShapeDtypeStruct((1,), jnp.float32))


def record(n: int, n_pad: int, lengths: tuple[int, int], stages: int, mesh: MeshInfo
           ) -> dict[str, Any] | None:
    """What describes a unit's stored buffers (JSON-able; None when nothing is kept): its
    lengths (``n`` real, ``n_pad`` padded), the per-device hop lengths, qgZ's pipeline
    stages (hop 2's layout), the buffers' global shapes and dtypes, and their format."""
    per_device = specs(lengths)
    if not per_device:
        return None
    return {"n": int(n), "n_pad": int(n_pad), "h1": int(lengths[0]), "h2": int(lengths[1]),
            "stages": int(stages), "shapes": [int(mesh.data * s.shape[0]) for s in per_device],
            "dtypes": [str(np.dtype(s.dtype)) for s in per_device],
            "block": FEEDBACK_BLOCK, "format": FEEDBACK_FORMAT}


def check_readable(old: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the fix if ``old`` (a stored record) is in a format this
    version cannot decode."""
    if old.get("block") != FEEDBACK_BLOCK or old.get("format") != FEEDBACK_FORMAT:
        raise ValueError(
            f"kept qgZ errors stored as {old.get('format')} in blocks of {old.get('block')}; "
            f"this zeropp_jax reads {FEEDBACK_FORMAT} in blocks of {FEEDBACK_BLOCK}. Restore "
            "with the version that wrote them, or into a state with qgz_error_feedback=False")


def reshard(old: dict[str, Any], old_mesh: MeshInfo, new: dict[str, Any], mesh: MeshInfo
            ) -> Callable[..., tuple[jax.Array, ...]] | None:
    """How a unit's stored buffers written on ``old_mesh`` (record ``old``) become its
    buffers on ``mesh`` (record ``new``): None when they are the same bits (same mesh,
    same layout); else a pure function of the five stored buffers (global arrays, None
    where the writing mesh kept none; any length at least the stored one, zero padded) ->
    the five global buffers, by the rule of the module docstring, use
    counts 1 as after a step."""
    check_readable(old)
    if old_mesh.shape == mesh.shape and all(old[k] == new[k] for k in LAYOUT_KEYS):
        return None
    devices_o, devices = old_mesh.data, mesh.data

    def decode_all(values: jax.Array, scales: jax.Array, h: int) -> jax.Array:
        """Every old device's buffer -> fp32 ``[devices_o, h]``."""
        h_pad = padded(h)
        flat = decode_error(values[: devices_o * h_pad],
                            scales[: devices_o * h_pad // FEEDBACK_BLOCK], devices_o * h_pad)
        return flat.reshape(devices_o, h_pad)[:, :h]

    def convert(v1, s1, v2, s2, count=None):  # the old use counts are not read
        total = jnp.zeros((old["n_pad"],), jnp.float32)  # the old flat gradient layout
        if old["h1"]:  # hop 1: already in that layout
            total = total + jnp.sum(decode_all(v1, s1, old["h1"]), axis=0)
        if old["h2"]:  # hop 2: per local index j, its rows into slices i' * local + j
            e2 = decode_all(v2, s2, old["h2"]).reshape(*old_mesh.shape, old["h2"])
            by_local = jnp.sum(e2, axis=0)  # hop2_to_flat is linear: add nodes first
            for j in range(old_mesh.local):
                total = total + hop2_to_flat(by_local[j], nodes=old_mesh.nodes,
                                             local=old_mesh.local, stages=old["stages"],
                                             m=old["n_pad"] // devices_o, local_index=j)
        share = total[: old["n"]] / jnp.float32(devices)
        # A record exists only where hop 1 is quantized, and then h1 = n_pad >= n.
        values, scales = encode_error(jnp.pad(share, (0, new["h1"] - old["n"])))
        out = [jnp.tile(values, devices), jnp.tile(scales, devices)]
        out += [jnp.zeros((new["shapes"][k],), jnp.dtype(new["dtypes"][k])) for k in (2, 3)]
        out.append(jnp.ones((new["shapes"][4],), jnp.dtype(new["dtypes"][4])))
        return tuple(out)

    return convert
