"""qwZ: the fp32 primary shard block-quantized to INT8/INT4 (optionally Hadamard-rotated
first), gathered, dequantized."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zeropp_jax.comm.collectives import qwz_all_gather
from zeropp_jax.comm.transports.base import Buffers, DirectGather
from zeropp_jax.core.mesh import AXES


@dataclasses.dataclass(frozen=True)
class QwzGather(DirectGather):
    """Stored ``(shard,)``; on the wire block-quantized values plus fp32 scales, packed
    in one byte buffer (``collectives.qwz_all_gather``). Quantization is deterministic, so
    the backward regather sees the forward's weights bit for bit.

    Attributes:
      bits: 8 or 4.
      block_size: elements per scale; None: one scale per shard.
      dtype: the compute dtype of the full weights.
      implementation: ``"xla"`` or ``"pallas"`` (``quant.quantization``).
      hierarchical: two hops, over ``"node"`` then ``"local"``.
      hadamard: rotate each block by a randomized Walsh–Hadamard transform before
        quantizing (``config.qwz_hadamard``), with the fixed key's signs
        (``quant.rotation.fixed_key``: a gather has no step counter, and forward and
        backward must decode the same weights). Same bytes on the wire.
    """

    bits: int
    block_size: int | None
    dtype: Any
    implementation: str
    hierarchical: bool = False
    hadamard: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "QwzGather":
        return cls(config.weight_bits, config.block_size if config.blockwise else None,
                   config.compute_jnp_dtype, config.quantization_impl,
                   config.all_gather == "hierarchical", config.qwz_hadamard)

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        shard = stored[0]
        full = qwz_all_gather(
            shard, axis_names=AXES, bits=self.bits,
            block_size=self.block_size or shard.shape[0], out_dtype=self.dtype,
            implementation=self.implementation, distinct=backward,
            hierarchical=self.hierarchical, hadamard=self.hadamard,
        )
        return full, (full,)

    def decode(self, moved: Buffers) -> jax.Array:
        return moved[0]

    def label(self) -> str:
        return f"qwz-int{self.bits}" + ("-had" if self.hadamard else "")

    def quantized_elems(self, n: int) -> float:
        # Every device dequantizes the whole unit (quantizing its own shard is 1/P of
        # that); a rotation reads the data once more.
        return float(n * (2 if self.hadamard else 1))

    def moved_bytes(self, n_pad: int) -> float:
        """The quantized buffer (values and one fp32 scale per block)."""
        return n_pad * (self.bits / 8 + 4 / (self.block_size or n_pad))

    def bucketable(self) -> bool:
        # One scale per shard would mix the members; the rotation's signs follow the
        # position in the buffer.
        return self.block_size is not None and not self.hadamard
