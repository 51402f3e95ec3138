"""Randomized Walsh–Hadamard rotation of quantization blocks, in ops both XLA and Triton have.

A block ``x [B]`` (``B`` a power of 2) is rotated to ``y = c * H (s * x)`` and back by
``x = s * (c * H y)``: ``H`` the ``B x B`` Sylvester Hadamard matrix (entries ±1, ``H H = B
I``), ``s`` a ±1 sign per position of the block (the same for every block), ``c =
fp32(1 / sqrt(B))``. With exact arithmetic the rotation is orthogonal, so quantizing ``y``
instead of ``x`` spreads a block's outliers over all its elements (their absmax, hence the
block scale, shrinks) and the error of the dequantized ``y`` maps back with the same L2 norm.
It is linear, so a sum of rotated blocks is the rotation of their sum: qgZ sums in the
rotated domain and rotates back once.

``walsh_hadamard`` computes ``H x`` row by row in ``log2(B)`` stages of the constant-geometry
(Pease) form: stage ``k`` splits the row into halves ``a, b`` and writes ``a[i] + b[i]`` to
position ``2i`` and ``a[i] - b[i]`` to ``2i + 1``. Each stage consumes the top index bit
and appends an output bit at the bottom, so after ``log2(B)`` stages output bit ``p`` pairs
with input bit ``p``: entry ``(-1)**popcount(i & j)``, Sylvester's ``H``. Only a split in
halves, a stack on a new last axis and a reshape are needed (Triton can neither slice nor
concatenate along the last axis), and every stage is one fp32 addition or subtraction per
element with no product feeding it (a sign flip is exact), so FMA contraction cannot change
a result: the kernels and the references below, being the same code, agree bit for bit.

Rounding (``u = 2**-24``): each stage rounds each element once, ``|fl(a ± b) - (a ± b)| <=
u |a ± b|``, and a stage is ``sqrt(2)`` times an orthogonal map, so the stage errors carried
to the output keep their relative size: ``||fl(H x) - H x||_2 <= ((1 + u)**m - 1) ||H x||_2``
for ``m = log2(B)`` stages. The product by ``c`` (and ``c``'s own rounding, nothing when
``B`` is a power of 4) adds two more factors of ``1 + u``, so a rotation is within ``((1 +
u)**(m + 2) - 1)`` of the exact one in relative L2 norm per block, and a rotation followed by
the inverse within ``((1 + u)**(2m + 4) - 1)``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def check_block_size(block_size: int) -> None:
    """The Walsh–Hadamard transform needs blocks of a power of 2 (>= 2) elements."""
    if (not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 2
            or block_size & (block_size - 1)):
        raise ValueError(
            f"the Hadamard rotation works on blocks of a power of 2 elements, got "
            f"block_size={block_size!r}; use e.g. {_nearest_power_of_2(block_size)}")


def _nearest_power_of_2(n: object) -> int:
    if not isinstance(n, int) or n < 2:
        return 2
    return 1 << round(math.log2(n))


def inv_sqrt(block_size: int) -> jax.Array:
    """``c = fp32(1 / sqrt(block_size))``: exact when ``block_size`` is a power of 4."""
    return jnp.float32(1.0 / math.sqrt(block_size))


def walsh_hadamard(x: jax.Array) -> jax.Array:
    """``H x`` along the last axis of fp32 ``x [r, B]`` (unnormalized, Sylvester order)."""
    rows, b = x.shape
    for _ in range(b.bit_length() - 1):
        a, c = jnp.split(x, 2, axis=-1)
        x = jnp.stack([a + c, a - c], axis=-1).reshape(rows, b)
    return x


def rotate_rows(x: jax.Array, signs: jax.Array) -> jax.Array:
    """fp32 ``x [r, B]``, fp32 ±1 ``signs [1, B]`` -> ``c * H (signs * x)`` per row."""
    b = x.shape[1]
    return walsh_hadamard(x * jnp.broadcast_to(signs, x.shape)) * inv_sqrt(b)


def unrotate_rows(y: jax.Array, signs: jax.Array) -> jax.Array:
    """Inverse of ``rotate_rows``: ``signs * (c * H y)`` per row."""
    b = y.shape[1]
    return (walsh_hadamard(y) * inv_sqrt(b)) * jnp.broadcast_to(signs, y.shape)


def join_halves(lo: jax.Array, hi: jax.Array) -> jax.Array:
    """``concatenate([lo, hi], axis=1)`` for ``[r, h]`` tiles in ops Triton has (it can
    concatenate only size-1 trailing axes): stack on a new last axis, transpose, reshape."""
    rows, half = lo.shape
    return jnp.swapaxes(jnp.stack([lo, hi], axis=-1), 1, 2).reshape(rows, 2 * half)


def check_signs(signs: jax.Array, block_size: int) -> jax.Array:
    """``signs`` as fp32 ``[1, block_size]`` (given as ``[block_size]`` or ``[1,
    block_size]``), after checking the block size is a power of 2."""
    check_block_size(block_size)
    signs = jnp.asarray(signs)
    if signs.shape not in ((block_size,), (1, block_size)):
        raise ValueError(f"signs must have shape ({block_size},) (one per position of a "
                         f"block), got {signs.shape}")
    if not jnp.issubdtype(signs.dtype, jnp.floating):
        raise TypeError(f"signs must be float ±1 values, got {signs.dtype}")
    return signs.astype(jnp.float32).reshape(1, block_size)


def rotate_reference(x: jax.Array, signs: jax.Array, *, block_size: int) -> jax.Array:
    """``x [n]`` (any float dtype, ``n`` a multiple of ``block_size``) -> fp32 ``[n]``, each
    block rotated (``rotate_rows``)."""
    signs = check_signs(signs, block_size)
    (n,) = x.shape
    if n % block_size:
        raise ValueError(f"{n=} must be a multiple of {block_size=}")
    xf = x.astype(jnp.float32).reshape(n // block_size, block_size)
    return rotate_rows(xf, signs).reshape(n)


def unrotate_reference(y: jax.Array, signs: jax.Array, *, block_size: int) -> jax.Array:
    """Inverse of ``rotate_reference``: fp32 ``[n]``."""
    signs = check_signs(signs, block_size)
    (n,) = y.shape
    if n % block_size:
        raise ValueError(f"{n=} must be a multiple of {block_size=}")
    yf = y.astype(jnp.float32).reshape(n // block_size, block_size)
    return unrotate_rows(yf, signs).reshape(n)
