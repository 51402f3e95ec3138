"""Shared pieces of the Pallas kernel tests (tests/quant/test_pallas_*.py): test data, bitwise
comparison, lowering for CUDA through Triton, and tables of bad inputs."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas import triton as pltriton

from zeropp_jax.core import compat

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}

TRITON_PARAMS = pltriton.CompilerParams(num_warps=4, num_stages=1)
TRITON_CALL = re.compile(r"stablehlo\.custom_call @" + re.escape(compat.TRITON_CALL_TARGET))


def seed_of(*parts: object) -> list[int]:
    """A stable per-case seed (``hash`` of a str is salted per process)."""
    return [int(b) for b in repr(parts).encode()]


def sample_blocks(rng: np.random.Generator, nb: int, block_size: int, dtype) -> jax.Array:
    """Heavy-tailed ``[nb * block_size]`` data whose blocks have scales 1e-3..1e1 apart.

    Student-t with df=2 has infinite variance, so blocks hold rare large outliers. The clip at
    1e3 keeps fp16 (max 65504) finite; non-finite blocks are tested separately.
    """
    t = np.clip(rng.standard_t(df=2, size=(nb, block_size)), -1e3, 1e3)
    block_scale = 10.0 ** rng.uniform(-3.0, 1.0, size=(nb, 1))
    return jnp.asarray((t * block_scale).astype(np.float32).reshape(-1)).astype(dtype)


def to_np(a: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(a))


def assert_bitwise_equal(actual: jax.Array, expected: jax.Array) -> None:
    """Same dtype, shape, NaN positions, and bit patterns everywhere else (so -0 != +0)."""
    a, e = to_np(actual), to_np(expected)
    assert a.dtype == e.dtype and a.shape == e.shape, (a.dtype, a.shape, e.dtype, e.shape)
    if np.issubdtype(a.dtype, np.integer):
        np.testing.assert_array_equal(a, e)
        return
    a32, e32 = a.astype(np.float32), e.astype(np.float32)  # exact for bf16/fp16
    np.testing.assert_array_equal(np.isnan(a32), np.isnan(e32))
    bits = np.dtype(f"uint{8 * a.dtype.itemsize}")
    keep = ~np.isnan(a32)
    np.testing.assert_array_equal(a.view(bits)[keep], e.view(bits)[keep])


def lower_for_cuda(f, *args: jax.ShapeDtypeStruct) -> str:
    """``jax.jit(f)`` lowered for CUDA, as text. Works on a host without a GPU on every
    supported JAX (see zeropp_jax.core.compat)."""
    return compat.lower_for_cuda(jax.jit(f), *args).as_text()


def strip_kernel_ir(text: str) -> str:
    """The module text without the serialized Triton kernel (an escaped byte string)."""
    return re.sub(r'ir = "(?:[^"\\]|\\.)*"', 'ir = "..."', text)


def call_with(fn, **defaults):
    """For tables of bad inputs: ``call_with(f, x=a, bits=8)(bits=3)`` is the call
    ``f(x=a, bits=3)``, made later (a ``lambda``, for ``pytest.raises`` to wrap)."""
    return lambda **kw: (lambda: fn(**{**defaults, **kw}))
