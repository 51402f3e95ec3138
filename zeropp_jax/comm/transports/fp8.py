"""FP8 qwZ: the fp32 primary shard block-scaled to FP8 (e4m3), gathered, dequantized."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from zeropp_jax.comm.collectives import fp8_all_gather
from zeropp_jax.comm.transports.base import Buffers, DirectGather
from zeropp_jax.core.mesh import AXES


@dataclasses.dataclass(frozen=True)
class Fp8Gather(DirectGather):
    """Stored ``(shard,)``; on the wire one FP8 byte per value plus one fp32 scale per
    block, packed in one byte buffer (``collectives.fp8_all_gather``): the bytes of INT8
    qwZ, with a floating-point grid (relative error per element instead of a step fixed
    by the block's largest value). Deterministic, so the backward regather sees the
    forward's weights bit for bit.

    Attributes:
      block_size: elements per scale; None: one scale per shard.
      dtype: the compute dtype of the full weights.
      hierarchical: two hops, over ``"node"`` then ``"local"``.
      hadamard: rotate each block before quantizing (``config.qwz_hadamard``; fixed signs,
        as ``QwzGather``).
      fmt: ``"e4m3"`` (``config.weight_format="fp8"``) or ``"e5m2"``.
    """

    block_size: int | None
    dtype: Any
    hierarchical: bool = False
    hadamard: bool = False
    fmt: str = "e4m3"

    @classmethod
    def from_config(cls, config: Any) -> "Fp8Gather":
        return cls(config.block_size if config.blockwise else None, config.compute_jnp_dtype,
                   config.all_gather == "hierarchical", config.qwz_hadamard)

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        shard = stored[0]
        full = fp8_all_gather(
            shard, axis_names=AXES, block_size=self.block_size or shard.shape[0],
            fmt=self.fmt, out_dtype=self.dtype, distinct=backward,
            hierarchical=self.hierarchical, hadamard=self.hadamard,
        )
        return full, (full,)

    def decode(self, moved: Buffers) -> jax.Array:
        return moved[0]

    def label(self) -> str:
        return ("qwz-fp8" if self.fmt == "e4m3" else f"qwz-fp8-{self.fmt}") + ("-had" if self.hadamard else "")

    def quantized_elems(self, n: int) -> float:
        # Every device dequantizes the whole unit (quantizing its own shard is 1/P of
        # that); a rotation reads the data once more.
        return float(n * (2 if self.hadamard else 1))

    def moved_bytes(self, n_pad: int) -> float:
        """The quantized buffer (values and one fp32 scale per block)."""
        return n_pad * (8 / 8 + 4 / (self.block_size or n_pad))

    def bucketable(self) -> bool:
        # One scale per shard would mix the members; the rotation's signs follow the
        # position in the buffer.
        return self.block_size is not None and not self.hadamard
