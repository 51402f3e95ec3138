"""The randomized Hadamard rotation (``pallas_kernels/hadamard.py``) and stochastic
rounding (``pallas_kernels/quantize.py``): exactness, error bounds from the block scale,
kernels vs references bit for bit (interpret mode), lowering for CUDA.

Rounding constants: ``U = 2**-24`` (fp32 unit roundoff); a rotation of a block of ``B =
2**m`` elements is within ``eps_rot = (1 + U)**(m + 2) - 1`` of the exact orthogonal map in
relative L2 norm (derived in the module's docstring: one rounding per butterfly stage, the
product by ``c`` and ``c``'s own rounding).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import hadamard as H
from pallas_kernels import quantize as Q
from pallas_kernels import reduce as D
from pallas_kernels import reorder as R
from zeropp_jax.quant.rotation import hadamard_signs, rounding_key, rounding_seed

from helpers import fresh_seed
from kernel_testing import (TRITON_CALL, assert_bitwise_equal, lower_for_cuda, sample_blocks,
                            seed_of, to_np)

U = 2.0**-24
SEED = jnp.uint32(0x9E3779B9)


def _eps_rot(block_size: int) -> float:
    m = block_size.bit_length() - 1
    return (1 + U) ** (m + 2) - 1


def _blocks(a, block_size: int) -> np.ndarray:
    return np.asarray(a, np.float64).reshape(-1, block_size)


def _signs(block_size: int, seed: int = 0) -> jax.Array:
    return hadamard_signs(jax.random.key(seed), block_size)


# ------------------------------------------------------------------ 1. the rotation itself


@pytest.mark.parametrize("block_size", [2, 8, 32])
def test_walsh_hadamard_is_sylvesters_matrix(block_size):
    """The constant-geometry stages give Sylvester's H exactly (entries ±1 are exact)."""
    h = np.array([[1.0]])
    while h.shape[0] < block_size:
        h = np.block([[h, h], [h, -h]])
    got = H.walsh_hadamard(jnp.eye(block_size, dtype=jnp.float32))  # row i: H e_i = column i
    np.testing.assert_array_equal(np.asarray(got).T, h)


@pytest.mark.parametrize("block_size", [32, 64, 256])  # 64 and 256: c = 1/sqrt(B) is exact
def test_rotate_then_unrotate_is_the_identity_to_fp32_rounding(block_size):
    """Per block, ``||unrotate(rotate(x)) - x||_2 <= ((1 + U)**(2m + 4) - 1) ||x||_2``, and
    ``||rotate(x)||_2`` is ``||x||_2`` within ``eps_rot`` (orthogonality). A rotation
    back with other signs, or without ``c``, is off by the size of ``x`` itself."""
    rng = np.random.default_rng(seed_of("identity", block_size))
    x = sample_blocks(rng, 16, block_size, jnp.float32)
    signs = _signs(block_size)
    # Both ways jitted (one program each, instead of one per op): the butterflies are adds
    # and subtracts, the products by the signs and by c stand alone, so XLA contracts
    # nothing into an FMA and rounds as op by op.
    y = jax.jit(H.rotate_reference, static_argnames="block_size")(x, signs, block_size=block_size)
    unrotate = jax.jit(H.unrotate_reference, static_argnames="block_size")
    back = unrotate(y, signs, block_size=block_size)
    xb, yb, bb = _blocks(x, block_size), _blocks(y, block_size), _blocks(back, block_size)
    norm = np.linalg.norm(xb, axis=1)
    err = np.linalg.norm(bb - xb, axis=1)
    assert np.all(err <= ((1 + U) ** (2 * (block_size.bit_length() + 1)) - 1) * norm)
    assert np.all(np.abs(np.linalg.norm(yb, axis=1) - norm) <= _eps_rot(block_size) * norm)
    assert np.max(err / norm) > 0  # rounding happened: the bound is what holds it
    # The rotation mixes every element of its block: no element survives unchanged.
    assert np.mean(np.isclose(yb, xb)) < 0.05
    wrong = unrotate(y, -signs, block_size=block_size)
    assert np.min(np.linalg.norm(_blocks(wrong, block_size) - xb, axis=1) / norm) > 0.1


def test_the_sum_commutes_with_the_rotation():
    """``unrotate(sum_g rotate(x_g)) = sum_g x_g`` within ``(2 eps_rot + gamma_{G-1})
    sum_g ||x_g||_2`` per block: each rotation's error (relative eps_rot), the fp32 sum of G
    rotated blocks (gamma_k = k U / (1 - k U), any order), the rotation back, and the 1e-6
    covering products of these small terms. This is what lets qgZ sum rotated blocks."""
    block_size, groups = 64, 6
    rng = np.random.default_rng(seed_of("commutes"))
    xs = [sample_blocks(rng, 8, block_size, jnp.float32) for _ in range(groups)]
    signs = _signs(block_size, seed=3)
    rotated = [H.rotate_reference(x, signs, block_size=block_size) for x in xs]
    total = rotated[0]
    for r in rotated[1:]:
        total = total + r
    back = _blocks(H.unrotate_reference(total, signs, block_size=block_size), block_size)
    exact = sum(_blocks(x, block_size) for x in xs)
    norms = sum(np.linalg.norm(_blocks(x, block_size), axis=1) for x in xs)
    gamma = (groups - 1) * U / (1 - (groups - 1) * U)
    bound = (2 * _eps_rot(block_size) + gamma) * (1 + 1e-6) * norms
    assert np.all(np.linalg.norm(back - exact, axis=1) <= bound)


def test_signs_are_shared_for_a_key_and_checked():
    a, b = hadamard_signs(jax.random.key(7), 32), hadamard_signs(jax.random.key(7), 32)
    assert_bitwise_equal(a, b)
    assert set(np.unique(to_np(a)).tolist()) == {-1.0, 1.0}
    assert not np.array_equal(to_np(a), to_np(hadamard_signs(jax.random.key(8), 32)))
    assert_bitwise_equal(hadamard_signs(None, 32), hadamard_signs(None, 32))
    with pytest.raises(ValueError, match="power of 2.*block_size=96; use e.g. 128"):
        hadamard_signs(None, 96)
    with pytest.raises(ValueError, match="power of 2"):
        Q.quantize_reference(jnp.ones(96), bits=8, block_size=96, signs=jnp.ones(96))
    with pytest.raises(ValueError, match=r"signs must have shape \(32,\)"):
        Q.quantize(jnp.ones(64), bits=8, block_size=32, signs=jnp.ones(16), interpret=True)
    with pytest.raises(TypeError, match="seed must be one uint32"):
        R.reorder_quantize_reference(jnp.ones(64), nodes=1, local=2, bits=8, block_size=32,
                                     seed=jnp.int32(1))


def test_rounding_keys_differ_per_device_and_per_gradient():
    x, y = jnp.ones(8), jnp.ones(8).at[3].set(2.0)
    seeds = {int(rounding_seed(rounding_key(None, g, jnp.int32(d)), 0, 0))
             for g in (x, y) for d in (0, 1)}
    assert len(seeds) == 4
    key = jax.random.key(1)  # a caller's key: the gradient no longer enters
    assert int(rounding_seed(rounding_key(key, x, jnp.int32(0)), 0, 0)) == int(
        rounding_seed(rounding_key(key, y, jnp.int32(0)), 0, 0))


# --------------------------------------------------------- 2. error bounds from the scale


def _rotated_bound(x, signs, bits: int, block_size: int):
    """Per block of ``x``: the rotated round trip's L2 error and its bound (below)."""
    kw = dict(bits=bits, block_size=block_size)
    values, scales = Q.quantize_reference(x, signs=signs, **kw)
    back = Q.dequantize_reference(values, scales, dtype=jnp.float32, signs=signs, **kw)
    qm, s = Q.qmax(bits), np.asarray(scales, np.float64)
    xb = _blocks(x, block_size)
    err = np.linalg.norm(_blocks(back, block_size) - xb, axis=1)
    root = np.sqrt(block_size)
    bound = (root * s * (0.5 + 2.0**-22 * qm)
             + _eps_rot(block_size) * (np.linalg.norm(xb, axis=1) + root * qm * s) * (1 + 1e-6))
    return err, bound


def _rotated_bound_ratio(bits: int, seed: int) -> float:
    """The body of the test below on the inputs drawn from ``seed``: asserts, and returns
    the largest error over its bound."""
    block_size, nb = 64, 24
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_t(2, size=nb * block_size).astype(np.float32))
    signs = _signs(block_size, seed=bits)
    err, bound = _rotated_bound(x, signs, bits, block_size)
    assert np.all(err <= bound), (seed, float(np.max(err / bound)))
    # Not vacuous (the inputs' property, not the quantizer's: over 30 fresh seeds of each
    # width the largest ratio was at least 0.60).
    assert np.max(err / bound) > 0.4, (seed, float(np.max(err / bound)))
    # Smoothing is the point: on blocks of one outlier M and small elements, all rounded to
    # 0 without the rotation (|x_i| in [0.4, 0.45] |M| / Q, below half the plain scale
    # |M| / Q), the plain error is at least ||small|| >= 0.4 sqrt(B - 1) |M| / Q = 3.17
    # |M| / Q; the rotated block's elements are at most (|M| + 0.45 (B - 1) |M| / Q) /
    # sqrt(B), so its bound is at most (1 + 0.45 (B - 1) / Q) |M| / (2 Q), 2.53 |M| / Q at
    # Q = 7 (the eps_rot terms are ~1e-6 of it): below the plain error on every draw.
    qm, shape = Q.qmax(bits), (nb, block_size)
    big = rng.choice([-1.0, 1.0], (nb, 1)) * 10.0 ** rng.uniform(-2, 1, (nb, 1))
    spiky = rng.choice([-1.0, 1.0], shape) * rng.uniform(0.4, 0.45, shape) * np.abs(big) / qm
    np.put_along_axis(spiky, rng.integers(0, block_size, (nb, 1)), big, axis=1)
    spiky = jnp.asarray(spiky.astype(np.float32).reshape(-1))
    err, bound = _rotated_bound(spiky, signs, bits, block_size)
    kw = dict(bits=bits, block_size=block_size)
    plain = Q.dequantize_reference(*Q.quantize_reference(spiky, **kw), dtype=jnp.float32, **kw)
    sb = _blocks(spiky, block_size)
    plain_err = np.linalg.norm(_blocks(plain, block_size) - sb, axis=1)
    lower = np.linalg.norm(np.sort(np.abs(sb), axis=1)[:, :-1], axis=1)
    assert np.all(err <= bound), (seed, float(np.max(err / bound)))
    assert np.all(bound < lower), (seed, float(np.max(bound / lower)))
    # (equal where the outlier comes back exactly: float64 norms, summed in other orders)
    assert np.all(lower <= plain_err * (1 + 1e-12)), (seed, float(np.max(lower / plain_err)))
    return float(np.max(err / bound))


@pytest.mark.parametrize("bits", [8, 4])
def test_rotated_round_trip_error_is_bounded_by_the_block_scale(bits):
    """Per block, with ``s`` the scale of the *rotated* block and ``Q = qmax``:
    ``||x - x'||_2 <= sqrt(B) s (1/2 + 2**-22 Q) + eps_rot (||x||_2 + sqrt(B) Q s)(1 + 1e-6)``.

    The rotated values are quantized elementwise within ``s/2 + 2**-22 Q s`` (the plain
    quantizer's bound, tests/quant/test_pallas_quantize.py), so within ``sqrt(B)`` times that
    in L2; the exact inverse rotation is orthogonal and keeps that norm; the computed
    rotations add ``eps_rot`` of what they rotate (``||x||`` forward; back, the dequantized
    block, ``|x'_i| <= Q s``). The typical error, ``sqrt(B / 12) s``, is 0.58 of the main
    term, so the bound is nearly reached. On blocks with an outlier the rotated scale is
    much smaller than the plain one: the error drops, provably on the blocks built for it."""
    _rotated_bound_ratio(bits, seed=fresh_seed())  # fresh inputs


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased(bits):
    """The mean of ``N`` stochastically rounded dequantizations converges to ``x``.

    Per element (step ``s``): each rounding is ``y``'s floor or ceiling, ``E[q] - y`` is in
    ``[0, 2**-23)`` (u's grid), and its variance is ``f (1 - f) <= 1/4``; so the mean over
    ``N`` independent seeds is within ``6 / (2 sqrt(N))`` steps of ``E[q]`` except with
    probability ~2e-9 per element, plus the quantizer's fp32 rounding ``2**-22 Q s`` (as
    for nearest rounding). Rounding to nearest instead is off by up to half a step in every
    draw, far outside the bound. Each single draw is within one step."""
    block_size, nb, n_seeds = 32, 4, 4096
    rng = np.random.default_rng(seed_of("sr", bits))
    x = sample_blocks(rng, nb, block_size, jnp.float32)
    kw = dict(bits=bits, block_size=block_size)

    def draw(seed):
        v, s = Q.quantize_reference(x, seed=seed, **kw)
        return Q.dequantize_reference(v, s, dtype=jnp.float32, **kw)

    seeds = jax.random.bits(jax.random.key(bits), (n_seeds,), jnp.uint32)
    draws = np.asarray(jax.jit(jax.vmap(draw))(seeds), np.float64)
    _, scales = Q.quantize_reference(x, **kw)
    s = np.repeat(np.asarray(scales, np.float64), block_size)
    fp32 = 2.0**-22 * Q.qmax(bits) * s
    xs = np.asarray(x, np.float64)
    assert np.all(np.abs(draws - xs) <= s + fp32)
    bias = np.abs(draws.mean(axis=0) - xs)
    assert np.all(bias <= s * (3.0 / np.sqrt(n_seeds) + 2.0**-23) + fp32), float(
        np.max(bias / s))
    nearest = np.asarray(Q.dequantize_reference(*Q.quantize_reference(x, **kw),
                                                dtype=jnp.float32, **kw), np.float64)
    assert np.max(np.abs(nearest - xs) / s) > 10 * 3.0 / np.sqrt(n_seeds)  # the test bites
    # Two draws differ, and a seed draws the same bits every time.
    assert np.any(draws[0] != draws[1])
    np.testing.assert_array_equal(np.asarray(draw(seeds[0])), draws[0])


# -------------------------------------------- 3. kernels == references bit for bit (interpret)


def _kernel_cases(bits: int, dtype):
    """Every new option of every kernel on one small case, all in one ``jit`` each side
    (compiling dominates), returned as (name, kernel outputs, reference outputs)."""
    block = 32
    rng = np.random.default_rng(seed_of("kernels", bits, str(dtype)))
    x = sample_blocks(rng, 13, block, dtype)
    g = sample_blocks(rng, 2 * 4 * 2 * 3, block, dtype)  # 2x4 devices, 2 stages of 3 blocks
    values, scales = jax.jit(lambda v: Q.quantize_reference(v, bits=bits, block_size=block))(
        sample_blocks(rng, 3 * 13, block, jnp.float32))
    values, scales = values.reshape(3, -1), scales.reshape(3, -1)
    signs = _signs(block, seed=bits)
    kw = dict(bits=bits, block_size=block)
    lay = dict(nodes=2, local=4, stages=2, stage=1)

    def run(interpret: bool):
        def call(kernel, reference, *args, **extra):
            return (kernel(*args, **extra, interpret=True) if interpret
                    else reference(*args, **extra))

        q = call(Q.quantize, Q.quantize_reference, x, signs=signs, **kw)
        return {
            "quantize(signs)": q,
            "dequantize(signs)": call(Q.dequantize, Q.dequantize_reference, *q, signs=signs,
                                      dtype=dtype, **kw),
            "reorder_quantize(signs)": call(R.reorder_quantize, R.reorder_quantize_reference,
                                            g, signs=signs, **lay, **kw),
            "reorder_quantize(seed)": call(R.reorder_quantize, R.reorder_quantize_reference,
                                           g, seed=SEED, **lay, **kw),
            "reorder_quantize(signs, seed)": call(
                R.reorder_quantize, R.reorder_quantize_reference, g, signs=signs, seed=SEED,
                **lay, **kw),
            "dequantize_reduce(signs)": call(D.dequantize_reduce,
                                             D.dequantize_reduce_reference, values, scales,
                                             signs=signs, **kw),
            "dequantize_reduce_requantize(seed)": call(
                D.dequantize_reduce_requantize, D.dequantize_reduce_requantize_reference,
                values, scales, seed=SEED, out_bits=12 - bits, **kw),
        }

    return jax.jit(lambda: run(True))(), jax.jit(lambda: run(False))()


@pytest.mark.parametrize("bits,dtype", [(8, jnp.bfloat16), (4, jnp.float32)])
def test_kernels_match_references_bit_for_bit(bits, dtype):
    kernels, references = _kernel_cases(bits, dtype)
    assert kernels.keys() == references.keys()
    for name in kernels:
        got = jax.tree_util.tree_leaves(kernels[name])
        want = jax.tree_util.tree_leaves(references[name])
        for a, b in zip(got, want):
            assert_bitwise_equal(a, b)
    # The options changed something: rotation and stochastic rounding are not no-ops.
    plain = R.reorder_quantize_reference(
        sample_blocks(np.random.default_rng(seed_of("kernels", bits, str(dtype))), 13, 32,
                      dtype), nodes=1, local=1, bits=bits, block_size=32)
    assert not np.array_equal(to_np(plain[0]), to_np(kernels["quantize(signs)"][0]))


def test_new_kernels_lower_for_cuda():
    sd = jax.ShapeDtypeStruct
    signs, seed = sd((32,), jnp.float32), sd((), jnp.uint32)
    kw = dict(bits=4, block_size=32)
    calls = [
        (lambda x, s: Q.quantize(x, signs=s, **kw), sd((1024,), jnp.bfloat16), signs),
        (lambda v, sc, s: Q.dequantize(v, sc, signs=s, dtype=jnp.bfloat16, **kw),
         sd((512,), jnp.uint8), sd((32,), jnp.float32), signs),
        (lambda x, s, e: R.reorder_quantize(x, nodes=2, local=4, signs=s, seed=e, **kw),
         sd((8 * 32 * 3,), jnp.float32), signs, seed),
        (lambda v, sc, s: D.dequantize_reduce(v, sc, signs=s, **kw),
         sd((4, 16 * 13), jnp.uint8), sd((4, 13), jnp.float32), signs),
        (lambda v, sc, e: D.dequantize_reduce_requantize(v, sc, seed=e, **kw),
         sd((4, 16 * 13), jnp.uint8), sd((4, 13), jnp.float32), seed),
    ]
    for fn, *args in calls:
        assert len(TRITON_CALL.findall(lower_for_cuda(fn, *args))) == 1
