"""Randomness for the quantizers: Hadamard signs every device shares, stochastic-rounding
seeds each device draws its own.

Hadamard smoothing (``pallas_kernels/hadamard.py``) rotates every quantization block by
``c * H * diag(signs)``; the devices of one collective must use the same ``signs``, or the
sum of rotated blocks would not be the rotation of the sum. They come from a PRNG key every
device holds: the caller's (fold the step counter into a fixed key for fresh signs each
step), or ``FIXED_KEY`` when the caller has none (the transports today: a step's unit
calls carry no step counter, so the signs are the same every step; smoothing needs no
fresh signs, only signs that do not line up with the data's structure).

Stochastic rounding needs independent random bits per element, and per device: a seed
(uint32) for the kernels' counter-based hash (``pallas_kernels.quantize.stochastic_uniform``)
per device, pipeline stage and hop, folded from the key. Without a caller's key, the fixed
key is folded with a checksum of the device's own gradient, so the dither changes whenever
the gradient does (with a key that never changed, the same gradient would round the same
way every step, and the bias would not average out across steps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels.hadamard import check_block_size

# "ZeRO" in hex-speak; any constant works, every device just has to use the same one.
FIXED_KEY_SEED = 0x2E60

# fold_in tags, so the signs and the rounding seeds never share a stream.
_SIGNS_TAG = 0
_ROUNDING_TAG = 1


def fixed_key() -> jax.Array:
    """The key used when the caller gives none (the same on every device and every call)."""
    return jax.random.key(FIXED_KEY_SEED)


def _as_key(key: jax.Array | None) -> jax.Array:
    if key is None:
        return fixed_key()
    key = jnp.asarray(key)
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key) or key.shape == (2,):
        return key
    raise TypeError(f"key must be a PRNG key (jax.random.key(...) or jax.random.PRNGKey"
                    f"(...)), got {key.dtype}{key.shape}")


# Jitted: traced once per block size and reused by every unit and step that asks.
@functools.partial(jax.jit, static_argnames=("block_size",))
def hadamard_signs(key: jax.Array | None, block_size: int) -> jax.Array:
    """fp32 ±1 ``[block_size]`` (a power of 2), a function of ``key`` only: every device
    holding the same key (or none: ``fixed_key()``) gets the same signs."""
    check_block_size(block_size)
    bits = jax.random.bits(jax.random.fold_in(_as_key(key), _SIGNS_TAG), (block_size,),
                           jnp.uint8)
    # The low bit of each byte; jax.random.rademacher would do, but its dtype handling
    # differs between JAX versions.
    return jnp.where((bits & 1) == 1, jnp.float32(1.0), jnp.float32(-1.0))


def checksum(x: jax.Array) -> jax.Array:
    """uint32 wrapping sum of ``x``'s bits (any float dtype): cheap, and different for
    almost any two different gradients."""
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    words = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    return jnp.sum(words, dtype=jnp.uint32)


def rounding_key(key: jax.Array | None, x: jax.Array, device: jax.Array) -> jax.Array:
    """The key stochastic rounding of this device's ``x`` draws from: ``key`` (or the fixed
    key folded with ``checksum(x)``), folded with the device's index."""
    base = jax.random.fold_in(_as_key(key), _ROUNDING_TAG)
    if key is None:
        base = jax.random.fold_in(base, checksum(x))
    return jax.random.fold_in(base, device)


def rounding_seed(key: jax.Array, *tags: int) -> jax.Array:
    """uint32 seed for one quantization (``tags``: stage, hop), from ``rounding_key``."""
    for tag in tags:
        key = jax.random.fold_in(key, tag)
    return jax.random.bits(key, (), jnp.uint32)
