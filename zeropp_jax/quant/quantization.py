"""Block-wise symmetric quantization (INT8, INT4 packed two per byte), any shape.

``quantize_blockwise`` flattens its input, pads it with zeros to whole blocks, and keeps one
fp32 scale per block of ``block_size`` consecutive elements: ``scale = absmax / (2**(bits-1)
- 1)``. The numerics (rounding half away from zero, NaN scale for blocks holding inf/NaN, zero
scale for all-zero blocks) are stated once, in ``pallas_kernels/quantize.py``, whose jnp
reference (``implementation="xla"``) and Pallas kernels (``"pallas"``) agree bit for bit.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Any, Iterator

import jax
import jax.numpy as jnp

from pallas_kernels import quantize as _kernels
from pallas_kernels.hadamard import check_block_size

IMPLEMENTATIONS = ("xla", "pallas")
_FLOAT_INPUTS = (jnp.float32, jnp.bfloat16, jnp.float16)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedArray:
    """A block-quantized array: a pytree whose children are ``values`` and ``scales``.

    Attributes:
      values: int8 ``[n_pad]`` (bits=8) or uint8 ``[n_pad / 2]`` (bits=4, two per byte).
      scales: fp32 ``[n_pad / block_size]``, one per block.
      shape: shape of the original array (static).
      bits: 8 or 4 (static).
      block_size: elements per block (static).
    """

    values: jax.Array
    scales: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    bits: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of values plus scales (what a collective moves)."""
        return self.values.size * self.values.dtype.itemsize + self.scales.size * 4


_COMPILED_KERNELS: contextvars.ContextVar = contextvars.ContextVar(
    "zeropp_compiled_kernels", default=False
)


def _for_gpu() -> bool:
    """Tracing for a GPU: on one, or inside ``compiled_kernels()``."""
    return _COMPILED_KERNELS.get() or jax.default_backend() == "gpu"


def default_implementation(hadamard: bool = False) -> str:
    """What ``implementation=None`` runs: ``"pallas"`` for Hadamard-rotated blocks on a GPU
    (or inside ``compiled_kernels()``), ``"xla"`` (plain jnp) for everything else.

    Why not Pallas for every block on a GPU: a kernel call needs its operand as one buffer,
    so a unit's gradient is first concatenated into a flat copy and a gathered buffer is
    dequantized whole before it is sliced into weights, where XLA fuses the quantization
    into the ops that make the gradient and slice the weights. Compiled for 16x8 H100s
    (``make gpu-cluster``), the scanned 7B ZeRO++ step prices 157 ms of compute with the
    kernels and 140 ms with XLA's fusions, and needs less memory with the fusions. A
    rotation is seven butterfly passes through memory in XLA and one in the kernel: there
    the kernels win (INT4 weights with Hadamard smoothing, 147 against 389 ms)."""
    return "pallas" if _for_gpu() and hadamard else "xla"


@contextlib.contextmanager
def compiled_kernels() -> Iterator[None]:
    """Trace Pallas kernels for compilation (not interpret mode) even on a CPU host, and
    resolve ``implementation=None`` as on a GPU (``default_implementation``).

    For cross-lowering checks: ``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))``
    of a program that uses ``implementation="pallas"``; and for compiling a GPU program
    from a CPU host (``make gpu-cluster``).
    """
    token = _COMPILED_KERNELS.set(True)
    try:
        yield
    finally:
        _COMPILED_KERNELS.reset(token)


def _interpret(like: jax.Array | None = None) -> bool:
    """Pallas kernels compile for GPUs; elsewhere they run in interpret mode (slow, exact)."""
    if _for_gpu():
        return False
    if like is not None and jax.typeof(like).manual_axis_type.varying:
        # JAX 0.10's Pallas interpreter fails shard_map's varying-axes check (its index
        # arithmetic mixes device-varying and invariant values), so interpret mode cannot
        # run inside shard_map. The jnp reference is bit-identical to the kernels.
        raise NotImplementedError(
            "implementation='pallas' inside shard_map needs a GPU: on CPU the kernels would "
            "run in Pallas interpret mode, which JAX 0.10 cannot trace inside shard_map. Use "
            "implementation='xla' (the default on CPU; bit-identical to the kernels)."
        )
    return True


def _resolve(implementation: str | None, hadamard: bool = False) -> str:
    impl = default_implementation(hadamard) if implementation is None else implementation
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"implementation={impl!r} is invalid; valid values are {IMPLEMENTATIONS}")
    return impl


def check_settings(bits: int, block_size: int, *, hadamard: bool = False) -> None:
    if bits not in _kernels.VALID_BITS:
        raise ValueError(f"bits={bits!r} is invalid; valid values are {_kernels.VALID_BITS}")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if bits == 4 and block_size % 2:
        raise ValueError(f"INT4 packs two values per byte: block_size={block_size} must be even")
    if hadamard:
        check_block_size(block_size)


def quantize_blockwise(
    x: jax.Array, *, bits: int = 8, block_size: int = 256, implementation: str | None = None
) -> QuantizedArray:
    """Quantizes ``x`` (bf16, fp16 or fp32, any shape) in blocks of its flattened elements.

    Returns a ``QuantizedArray`` holding ``ceil(x.size / block_size)`` blocks.
    """
    check_settings(bits, block_size)
    x = jnp.asarray(x)
    if not any(x.dtype == jnp.dtype(d) for d in _FLOAT_INPUTS):
        raise TypeError(
            f"quantize_blockwise takes bf16, fp16 or fp32 input, got {x.dtype}; "
            "cast with x.astype(jnp.float32) first"
        )
    if x.size == 0:
        raise ValueError(f"cannot quantize an empty array (shape {x.shape})")
    flat = x.reshape(-1)
    pad = -flat.shape[0] % block_size
    if pad:
        flat = jnp.pad(flat, (0, pad))
    if _resolve(implementation) == "pallas":
        values, scales = _kernels.quantize(
            flat, bits=bits, block_size=block_size, interpret=_interpret(flat)
        )
    else:
        values, scales = _kernels.quantize_reference(flat, bits=bits, block_size=block_size)
    return QuantizedArray(values, scales, tuple(x.shape), bits, block_size)


def dequantize_blockwise(
    q: QuantizedArray, dtype: Any = jnp.float32, *, implementation: str | None = None
) -> jax.Array:
    """Inverse of ``quantize_blockwise``: an array of ``q.shape`` and ``dtype``."""
    if not isinstance(q, QuantizedArray):
        raise TypeError(f"dequantize_blockwise takes a QuantizedArray, got {type(q).__name__}")
    kwargs = dict(bits=q.bits, block_size=q.block_size, dtype=jnp.dtype(dtype))
    if _resolve(implementation) == "pallas":
        flat = _kernels.dequantize(q.values, q.scales, interpret=_interpret(q.values), **kwargs)
    else:
        flat = _kernels.dequantize_reference(q.values, q.scales, **kwargs)
    return flat[: q.size].reshape(q.shape)


def quantize_flat(
    x: jax.Array, *, bits: int, block_size: int, implementation: str | None = None,
    signs: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """1-D ``x`` of whole blocks -> ``(values, scales)`` (no padding, no metadata).
    ``signs`` (fp32 ±1 ``[block_size]``, ``rotation.hadamard_signs``): rotate every block
    before quantizing it (``pallas_kernels/hadamard.py``)."""
    if x.shape[0] % block_size:
        raise ValueError(f"n={x.shape[0]} must be a multiple of block_size={block_size}")
    if _resolve(implementation, signs is not None) == "pallas":
        return _kernels.quantize(x, bits=bits, block_size=block_size, interpret=_interpret(x),
                                 signs=signs)
    return _kernels.quantize_reference(x, bits=bits, block_size=block_size, signs=signs)


def dequantize_flat(
    values: jax.Array,
    scales: jax.Array,
    *,
    bits: int,
    block_size: int,
    dtype: Any,
    implementation: str | None = None,
    signs: jax.Array | None = None,
) -> jax.Array:
    """Inverse of ``quantize_flat``: ``[len(scales) * block_size]`` of ``dtype`` (with
    ``signs``: each block rotated back, in fp32, before the cast)."""
    kwargs = dict(bits=bits, block_size=block_size, dtype=jnp.dtype(dtype), signs=signs)
    if _resolve(implementation, signs is not None) == "pallas":
        return _kernels.dequantize(values, scales, interpret=_interpret(values), **kwargs)
    return _kernels.dequantize_reference(values, scales, **kwargs)
