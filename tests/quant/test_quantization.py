"""zeropp_jax.quant.quantization: the public block-quantization API on any shape."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.quant.quantization import (
    QuantizedArray,
    compiled_kernels,
    default_implementation,
    dequantize_blockwise,
    quantize_blockwise,
)


def _bound(x: np.ndarray, q: QuantizedArray) -> np.ndarray:
    """Half a quantization step of each element's block, plus fp32 rounding of the divide
    and multiply (a few ulps of qmax * scale; qmax * scale = the block's absmax)."""
    qmax = 2 ** (q.bits - 1) - 1
    s = np.repeat(np.asarray(q.scales), q.block_size)[: x.size].reshape(x.shape)
    return s / 2 + 2.0**-22 * qmax * s


@functools.partial(jax.jit, static_argnames="bits")
def _round_trip(x, *, bits):
    """Quantize and dequantize in one program: one compile per shape instead of one per op
    (elementwise ops, no product feeding a sum: jit changes no bit, and the bound is
    per element)."""
    q = quantize_blockwise(x, bits=bits, block_size=16)
    return q, dequantize_blockwise(q, jnp.float32)


@pytest.mark.parametrize("shape", [(7,), (33, 5), (4, 64), (3, 2, 50)])
@pytest.mark.parametrize("bits", [8, 4])
def test_round_trip_any_shape(shape, bits):
    rng = np.random.default_rng(hash((shape, bits)) % 2**32)
    x = (rng.standard_t(3, size=shape) * 10.0 ** rng.uniform(-2, 2)).astype(np.float32)
    q, back = _round_trip(jnp.asarray(x), bits=bits)
    assert q.shape == shape and q.bits == bits
    n_blocks = -(-x.size // 16)
    assert q.scales.shape == (n_blocks,) and q.scales.dtype == jnp.float32
    assert q.values.dtype == (jnp.int8 if bits == 8 else jnp.uint8)
    assert q.values.shape == ((n_blocks * 16) // (1 if bits == 8 else 2),)
    back = np.asarray(back)
    assert back.shape == shape
    assert np.all(np.abs(back - x) <= _bound(x, q))
    # The bound is tight: the largest error reaches a good part of half a step.
    assert np.max(np.abs(back - x) / _bound(x, q)) > 0.5


def test_quantized_array_is_a_pytree_through_jit():
    x = jnp.asarray(np.random.default_rng(0).standard_normal(100), jnp.bfloat16)
    q = jax.jit(lambda x: quantize_blockwise(x, bits=8, block_size=32))(x)
    assert isinstance(q, QuantizedArray)
    out = jax.jit(lambda q: dequantize_blockwise(q, jnp.bfloat16))(q)
    assert out.dtype == jnp.bfloat16 and out.shape == (100,)
    assert len(jax.tree_util.tree_leaves(q)) == 2  # values and scales
    assert q.nbytes == 128 + 4 * 4


def test_default_implementation_on_cpu_is_xla():
    assert default_implementation() == "xla"
    assert default_implementation(hadamard=True) == "xla"


def test_default_implementation_as_on_a_gpu():
    # compiled_kernels() resolves the default as a GPU does: the kernels where a rotation
    # makes XLA take seven passes, XLA's fusions elsewhere.
    with compiled_kernels():
        assert default_implementation(hadamard=True) == "pallas"
        assert default_implementation() == "xla"
    assert default_implementation(hadamard=True) == "xla"


def test_pallas_switch_matches_xla():
    x = jnp.asarray(np.random.default_rng(3).standard_normal((5, 40)), jnp.float32)
    for bits in (8, 4):
        a = quantize_blockwise(x, bits=bits, block_size=32, implementation="xla")
        b = quantize_blockwise(x, bits=bits, block_size=32, implementation="pallas")
        np.testing.assert_array_equal(np.asarray(a.values), np.asarray(b.values))
        np.testing.assert_array_equal(np.asarray(a.scales), np.asarray(b.scales))
        np.testing.assert_array_equal(
            np.asarray(dequantize_blockwise(a, implementation="xla")),
            np.asarray(dequantize_blockwise(a, implementation="pallas")),
        )


def test_non_finite_and_zero_blocks():
    x = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    x[:16] = 0.0
    x[20] = np.inf
    x[40] = np.nan
    q = quantize_blockwise(jnp.asarray(x), bits=8, block_size=16)
    back = np.asarray(dequantize_blockwise(q))
    np.testing.assert_array_equal(back[:16], 0.0)  # all-zero block: exact zeros, no 0/0
    assert np.all(np.isnan(back[16:48]))  # blocks holding inf / NaN: NaN, never finite
    assert np.all(np.isfinite(back[48:]))  # neighbours unaffected


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(bits=2), ValueError, r"valid values are \(4, 8\)"),
        (dict(bits=16), ValueError, "valid values"),
        (dict(block_size=0), ValueError, "positive"),
        (dict(block_size=-4), ValueError, "positive"),
        (dict(bits=4, block_size=15), ValueError, "even"),
        (dict(implementation="cuda"), ValueError, "valid values"),
    ],
)
def test_bad_settings(kwargs, error, match):
    with pytest.raises(error, match=match):
        quantize_blockwise(jnp.ones(32), **{"bits": 8, "block_size": 16, **kwargs})


def test_bad_inputs():
    with pytest.raises(ValueError, match="empty"):
        quantize_blockwise(jnp.ones((0, 3)), bits=8, block_size=16)
    with pytest.raises(TypeError, match="bf16, fp16 or fp32"):
        quantize_blockwise(jnp.arange(32), bits=8, block_size=16)
    with pytest.raises(TypeError, match="QuantizedArray"):
        dequantize_blockwise(jnp.ones(4))  # type: ignore[arg-type]
