"""Block-scaled FP8 quantization (``zeropp_jax/quant/fp8.py``): the round-trip bound from
the format's mantissa and the block scale, special blocks, bad input."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.quant.fp8 import dequantize_fp8_flat, fmax, quantize_fp8_flat

from kernel_testing import sample_blocks, seed_of

# (mantissa bits, smallest normal exponent) of each format.
FORMATS = {"e4m3": (3, -6), "e5m2": (2, -14)}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_round_trip_error_is_bounded_by_the_format_and_the_scale(fmt):
    """``|x - x'| <= max(2**-(m+1) |x|, 2**(emin-m-1) s) + 2**-21 (|x| + fmax s)``.

    ``y = fl(x * fl(1/s))`` is within ``2u`` (u = 2**-24) of ``x / s`` relatively, and
    ``|y| <= fmax (1 + 3u)`` is clipped to ``fmax`` (moving it by at most ``3u fmax``).
    Rounding to the FP8 grid moves ``y`` by at most half an ulp: ``2**-(m+1) |y|`` for
    normal ``|y|``, ``2**(emin-m-1)`` below. The product ``fl(fp32(q) * s)`` adds ``u |q|
    s``. In ``x``'s units, with ``|y| s <= |x| (1 + 2u)``, all the fp32 terms together stay
    below ``2**-21 (|x| + fmax s)``."""
    m, emin = FORMATS[fmt]
    rng = np.random.default_rng(seed_of("fp8", fmt))
    x = sample_blocks(rng, 24, 64, jnp.float32)
    values, scales = quantize_fp8_flat(x, block_size=64, fmt=fmt)
    assert values.dtype == jnp.dtype({"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt])
    assert values.shape == x.shape and scales.shape == (24,)
    back = np.asarray(dequantize_fp8_flat(values, scales, block_size=64), np.float64)
    xs = np.asarray(x, np.float64)
    s = np.repeat(np.asarray(scales, np.float64), 64)
    bound = (np.maximum(2.0 ** -(m + 1) * np.abs(xs), 2.0 ** (emin - m - 1) * s)
             + 2.0**-21 * (np.abs(xs) + fmax(fmt) * s))
    err = np.abs(back - xs)
    assert np.all(err <= bound), float(np.max(err / bound))
    assert np.max(err / bound) > 0.5  # half an ulp is reached somewhere
    # The block's largest element lands on fmax exactly: the scale is absmax / fmax.
    assert np.allclose(np.max(np.abs(np.asarray(values, np.float32)).reshape(24, 64), axis=1),
                       fmax(fmt))


def test_special_blocks_and_bad_input():
    x = np.ones((3, 32), np.float32)
    x[0] = 0.0
    x[1, 5] = np.inf
    x[2, 7] = np.nan
    values, scales = quantize_fp8_flat(jnp.asarray(x.reshape(-1)), block_size=32)
    back = np.asarray(dequantize_fp8_flat(values, scales, block_size=32, dtype=jnp.bfloat16),
                      np.float32).reshape(3, 32)
    assert np.all(back[0] == 0) and np.all(np.isnan(back[1:]))  # loud, never finite garbage
    with pytest.raises(ValueError, match="valid formats are"):
        quantize_fp8_flat(jnp.ones(32), block_size=32, fmt="e3m4")
    with pytest.raises(ValueError, match="multiple of a positive block_size"):
        quantize_fp8_flat(jnp.ones(40), block_size=32)
