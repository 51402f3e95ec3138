"""Block-scaled FP8 (e4m3, or e5m2) quantization of flat arrays, in plain jnp.

Per block of ``block_size`` consecutive elements: ``scale = absmax * fp32(1 / fmax)``
(``fmax``: 448 for e4m3, 57344 for e5m2), ``y = x * fp32(1 / scale)`` clipped to ``[-fmax,
fmax]`` (a product spelled out, as in ``pallas_kernels/quantize.py``; the clip keeps a
``y`` that rounding pushed just past ``fmax`` from becoming e4m3's NaN), then cast to the FP8
type (round to nearest even). Non-finite blocks: NaN scale, zero values, dequantized to NaN;
all-zero blocks: scale 0. Dequantize: ``fp32(values) * scale``, cast to the asked dtype.

There is no Pallas kernel: dequantizing is a convert and a multiply, which XLA can fuse into
whatever consumes the weights (on a GPU with FP8 support, into the matmul's operand load
where its GEMM fusion takes elementwise producers); a custom call in between would stop
that. On CPU the FP8 types are emulated: the same values, slower.

Error per element: for ``|y|`` at or above the format's smallest normal ``2**emin``, half
an ulp, ``2**-(mantissa bits + 1) |y|``; below, half the subnormal spacing ``2**(emin -
mantissa bits - 1)``. In ``x``'s units (times ``scale``): ``|x - x'| <= max(2**-(m+1) |x|,
2**(emin-m-1) * scale)`` plus fp32 rounding of the products (a few ``2**-24`` of ``|x|``
and of ``fmax * scale``), where e4m3 has ``m = 3, emin = -6`` and e5m2 ``m = 2, emin =
-14``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

FORMATS = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def check_format(fmt: str) -> jnp.dtype:
    """The FP8 dtype of ``fmt`` ("e4m3" or "e5m2")."""
    if fmt not in FORMATS:
        raise ValueError(f"fp8 format {fmt!r} is invalid; valid formats are {tuple(FORMATS)}")
    return jnp.dtype(FORMATS[fmt])


def fmax(fmt: str) -> float:
    """Largest finite value of the format: 448 (e4m3) or 57344 (e5m2)."""
    return float(jnp.finfo(check_format(fmt)).max)


def quantize_fp8_flat(x: jax.Array, *, block_size: int, fmt: str = "e4m3"
                      ) -> tuple[jax.Array, jax.Array]:
    """``x [n]`` (bf16, fp16 or fp32; ``n`` a multiple of ``block_size``) -> (FP8 values
    ``[n]``, fp32 scales ``[n / block_size]``)."""
    dtype = check_format(fmt)
    (n,) = x.shape
    if not isinstance(block_size, int) or block_size <= 0 or n % block_size:
        raise ValueError(f"{n=} must be a multiple of a positive block_size, got {block_size!r}")
    top = fmax(fmt)
    xf = x.astype(jnp.float32).reshape(n // block_size, block_size)
    finite = jnp.all(jnp.isfinite(xf), axis=1, keepdims=True)
    absmax = jnp.max(jnp.where(finite, jnp.abs(xf), 0.0), axis=1, keepdims=True)
    scale = jnp.where(finite, absmax * jnp.float32(1.0 / top), jnp.float32(jnp.nan))
    safe = jnp.where(finite & (scale > 0), scale, jnp.float32(1.0))
    y = jnp.clip(jnp.where(finite, xf, 0.0) * (jnp.float32(1.0) / safe), -top, top)
    return y.astype(dtype).reshape(n), scale.reshape(n // block_size)


def dequantize_fp8_flat(values: jax.Array, scales: jax.Array, *, block_size: int,
                        dtype: Any = jnp.float32) -> jax.Array:
    """Inverse of ``quantize_fp8_flat``: ``[len(scales) * block_size]`` of ``dtype``."""
    nb = scales.shape[0]
    if values.shape != (nb * block_size,):
        raise ValueError(f"values.shape={values.shape} does not match {nb} scales of "
                         f"{block_size=}: expected ({nb * block_size},)")
    out = values.astype(jnp.float32).reshape(nb, block_size) * scales[:, None]
    return out.astype(dtype).reshape(-1)
