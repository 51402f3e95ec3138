"""Frozen weights stored quantized: gathered as stored, dequantized only on arrival."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.comm.collectives import gather_packed
from zeropp_jax.comm.transports.base import Buffers, DirectGather
from zeropp_jax.core.mesh import AXES
from zeropp_jax.quant.quantization import dequantize_flat


def all_gather_quantized(
    values: jax.Array, scales: jax.Array, axis_names: Any = AXES, *, distinct: bool = False,
    hierarchical: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """All-gathers stored quantized shards as they are (no quantization). Inside ``shard_map``.

    Communicates over ``axis_names``: int8 (or INT4-packed uint8) values and fp32 scales,
    packed into one uint8 buffer per device (``collectives.pack_rows``) and returned
    concatenated in row-major device order. ``distinct=True`` moves the same bytes as int8
    so XLA cannot merge a backward regather with the forward gather. ``hierarchical``: two
    hops, node first (``collectives.gather_tiled``).
    """
    axes = (axis_names,) if isinstance(axis_names, str) else tuple(axis_names)
    return gather_packed(values, scales, axes, distinct=distinct, hierarchical=hierarchical)


@dataclasses.dataclass(frozen=True)
class StoredQuantizedGather(DirectGather):
    """Stored ``(values, scales)``: int8 (or INT4 pairs packed in uint8) values of the
    primary shard and one fp32 scale per block. What moves is what is stored; nothing is
    quantized in the step. Dequantized to the compute dtype after the gather.

    Attributes:
      bits: 8 or 4.
      block_size: elements per scale.
      dtype: the compute dtype of the full weights.
      implementation: ``"xla"`` or ``"pallas"`` for the dequantize.
      hierarchical: two hops, over ``"node"`` then ``"local"``.
    """

    bits: int
    block_size: int
    dtype: Any
    implementation: str
    hierarchical: bool = False

    @classmethod
    def from_config(cls, config: Any, layout: Any) -> "StoredQuantizedGather":
        # Non-blocked (``blockwise=False``): one scale per device's shard.
        block = config.block_size if config.blockwise else layout.shard_len
        return cls(config.weight_bits, block, config.compute_jnp_dtype,
                   config.quantization_impl, config.all_gather == "hierarchical")

    @staticmethod
    def alignment(config: Any) -> int:
        """Each frozen primary shard's length is a multiple of this: whole blocks
        (non-blocked: 2, INT4 still packs pairs)."""
        return config.block_size if config.blockwise else 2

    def store(self, flat: np.ndarray) -> tuple[np.ndarray, ...]:
        """Host fp32 ``[n_pad]`` -> ``(values, scales)`` of the whole buffer, quantized in
        blocks. Shards are whole blocks, so device ``d``'s slice is its own shard quantized
        on its own. The jnp reference, bit-identical to the Pallas kernels."""
        from pallas_kernels.quantize import quantize_reference

        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            v, s = quantize_reference(jnp.asarray(flat, jnp.float32), bits=self.bits,
                                      block_size=self.block_size)
        return np.asarray(v), np.asarray(s)

    def unstore(self, stored: tuple[np.ndarray, ...]) -> np.ndarray:
        """``store``'s buffers (host, global) -> the fp32 ``[n_pad]`` values a forward
        computes with, before the compute-dtype cast."""
        with jax.default_device(jax.local_devices(backend="cpu")[0]):
            out = dequantize_flat(jnp.asarray(stored[0]), jnp.asarray(stored[1]),
                                  bits=self.bits, block_size=self.block_size,
                                  dtype=jnp.float32, implementation=self.implementation)
        return np.asarray(out, np.float32)

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        moved = all_gather_quantized(*stored, AXES, distinct=backward,
                                     hierarchical=self.hierarchical)
        return self.decode(moved), moved

    def stored_specs(self, n_pad: int, param_dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        """``(values, scales)``: int8 values (INT4: pairs packed in uint8) and one fp32
        scale per block."""
        values = (jax.ShapeDtypeStruct((n_pad,), jnp.int8) if self.bits == 8
                  else jax.ShapeDtypeStruct((n_pad // 2,), jnp.uint8))
        return values, jax.ShapeDtypeStruct((n_pad // self.block_size,), jnp.float32)

    def decode(self, moved: Buffers) -> jax.Array:
        values, scales = moved
        return dequantize_flat(values, scales, bits=self.bits, block_size=self.block_size,
                               dtype=self.dtype, implementation=self.implementation)

    def moved_bytes(self, n_pad: int) -> float:
        """What moved as stored: the values (``bits / 8`` bytes each), one fp32 scale per
        block."""
        return n_pad * (self.bits / 8 + 4 / self.block_size)
