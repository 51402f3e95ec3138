"""qwZ: block-quantized weight all-gather, alone and inside the train step."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from pallas_kernels.quantize import dequantize_reference, quantize_reference
from zeropp_jax.comm.collectives import qwz_all_gather
from zeropp_jax.measure.comm_report import collectives
from zeropp_demo.gpt import GPT

from helpers import (FLOAT64, FLOAT64_RHO, SMALL64, as_float64, assert_loss_and_grads_close,
                     dequantized_params, float64_run, fresh_seed, init_params, make_step,
                     reference_loss_and_grads, seed_on_failure, tokens)

AXES = ("node", "local")


def _run_gather(mesh, x, **kwargs):
    fn = jax.shard_map(
        lambda s: qwz_all_gather(s, **kwargs), mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)
    )
    # Every device returns the full gathered array; out_specs stacks them: [P * n].
    return np.asarray(jax.jit(fn)(jax.device_put(x, NamedSharding(mesh, P(AXES)))))


@functools.partial(jax.jit, static_argnames=("devices", "bits", "block"))
def _shard_round_trips(x, *, devices, bits, block):
    """Each device's shard of ``x`` through Q then Q^-1 (concatenated, in ``x``'s dtype) and
    its scales, as one program instead of op by op. Jitting changes no bit: the reference's
    ops are elementwise (plus an exact max), with no product feeding a sum to contract."""
    k = x.size // devices
    deq, scales = [], []
    for d in range(devices):
        v, s = quantize_reference(x[d * k:(d + 1) * k], bits=bits, block_size=block)
        deq.append(dequantize_reference(v, s, bits=bits, block_size=block, dtype=x.dtype))
        scales.append(s)
    return jnp.concatenate(deq), jnp.concatenate(scales)


@pytest.mark.parametrize("nodes,local", [(2, 4), (3, 2)])
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_qwz_all_gather_equals_gather_of_dequantized_shards(nodes, local, bits, dtype):
    devices = nodes * local
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:devices])
    block, blocks_per_shard = 32, 3
    k = block * blocks_per_shard
    rng = np.random.default_rng(nodes * 100 + bits)
    # Heavy tails and a different scale per shard, so blocks get very different scales.
    x = rng.standard_t(3, size=devices * k) * np.repeat(10.0 ** rng.uniform(-3, 2, devices), k)
    x = jnp.asarray(x, dtype)
    out = _run_gather(mesh, x, bits=bits, block_size=block)
    expected, scales = map(np.asarray, _shard_round_trips(x, devices=devices, bits=bits,
                                                          block=block))
    for d in range(devices):  # each device holds the same gathered array
        np.testing.assert_array_equal(out[d * devices * k:(d + 1) * devices * k], expected)
    # And it is close to x: within half a quantization step per element (fp32 case).
    if dtype == "float32":
        bound = np.repeat(scales, block) * (0.5 + 2.0 ** -20)
        assert np.all(np.abs(expected - np.asarray(x)) <= bound)


def test_qwz_all_gather_rejects_partial_blocks():
    mesh = zpp.make_mesh(2, 4)
    with pytest.raises(ValueError, match="multiple of block_size"):
        _run_gather(mesh, jnp.ones(8 * 48, jnp.float32), bits=8, block_size=32)
    with pytest.raises(ValueError, match="valid values"):
        _run_gather(mesh, jnp.ones(8 * 32, jnp.float32), bits=3, block_size=32)


def _gathers(text: str) -> list[tuple[int, str]]:
    """(elements sent per device, element type) of every all-gather in program text."""
    return [(math.prod(c.shape) // len(c.groups[0]), c.dtype)
            for c in collectives(text) if c.kind == "all-gather"]


# fp32 steps (returning their gradients) on the 2x4 mesh, built once per module: a step
# compiles once per engine (compared by identity) and step function, and steps do not
# donate the state, so the same untrained state serves every test that shares it.
# - qwZ INT8 / INT4 (blocks of 64, SGD(0.1)): test_qwz_step_is_exact_at_dequantized_weights
#   and test_qwz_loss_within_derived_bound_of_zero3 run it (each on a batch of its own);
#   test_train_step_gathers_quantized_values_and_scales_only reads its lowered program (the
#   same trace and lowering: it compiles nothing);
# - ZeRO-3 at the same parameters: the loss-bound test's reference, for both bit widths.
_BUILT: dict = {}
_BLOCK = 64


@pytest.fixture(scope="module", autouse=True)
def _forget_built():
    yield
    _BUILT.clear()


# The shared states' parameters: fresh each run.
_SEED = fresh_seed()


def _shared(bits: int | None):
    """(untrained state, step) of the shared float64 qwZ INT``bits`` step at
    init_params(seed=_SEED), or with ``bits=None`` of the ZeRO-3 step at the same
    parameters. Build and run them inside ``float64_run()``."""
    if bits not in _BUILT:
        cfg = (zpp.ZeroPPConfig(**FLOAT64) if bits is None else
               zpp.ZeroPPConfig(qwz=True, weight_bits=bits, block_size=_BLOCK, **FLOAT64))
        state = zpp.TrainState.create(model=GPT(SMALL64),
                                      params=as_float64(init_params(seed=_SEED)),
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4), config=cfg)
        _BUILT[bits] = (state, make_step(with_grads=True))
    return _BUILT[bits]


@pytest.mark.parametrize("bits", [8, 4])
def test_train_step_gathers_quantized_values_and_scales_only(bits):
    # The shared qwZ step (float64 compute: the compute dtype is what the gathered weights
    # are dequantized to, not what they travel as).
    block = _BLOCK
    with float64_run():
        state, step = _shared(bits)
        text = step.lower(state, tokens(16, seed=0)).as_text()
    gathers = _gathers(text)
    assert gathers
    others = [t for _, t in gathers if t not in ("i8", "ui8")]
    assert not others, f"weights or scales gathered unquantized or apart: {others}"
    # One byte buffer per gather: a device's values (INT4: 2 per byte), then its fp32
    # scales, one per block. Forward moves it as uint8; backward regathers move the same
    # bytes as int8 (kept apart from the forward gather).
    assert {t for _, t in gathers} == {"ui8", "i8"}
    per_byte = 2 if bits == 4 else 1
    for n_in, _ in gathers:
        value_bytes = n_in * block // (block + 4 * per_byte)
        assert value_bytes * per_byte % block == 0
        assert value_bytes + 4 * (value_bytes * per_byte // block) == n_in
    # Every unit's weights travel quantized, forward and backward.
    assert len(gathers) >= len(state.engine.layouts)


@pytest.mark.parametrize("bits", [8, 4])
def test_qwz_step_is_exact_at_dequantized_weights(bits):
    """Loss and gradients of the qwZ step equal those of the plain model evaluated at the
    dequantized weights — forward and backward saw the same (quantized) weights. Float64
    runs: the INT blocks dequantize to fp32 values (fp32 scales), computed with in float64."""
    block = _BLOCK
    model = GPT(SMALL64)
    batch = tokens(16, seed=_SEED + 1)
    with float64_run():
        state, step = _shared(bits)
        _, out = step(state, batch)
        deq = as_float64(dequantized_params(state, block, bits))
        ref_loss, ref_grads = reference_loss_and_grads(model, deq, batch)
    # Both float64 at the same weights; only the summation order differs.
    with seed_on_failure(_SEED):
        assert_loss_and_grads_close(out["loss"], state.engine.consolidate(out["grads"]),
                                    ref_loss, ref_grads, FLOAT64_RHO)


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def _scales(flat, *, bits, block):
    """The per-block scales of ``flat``, one program per unit size (op by op, each eager op
    compiles; the max and division round alike either way)."""
    return quantize_reference(flat, bits=bits, block_size=block)[1]


@pytest.mark.parametrize("bits", [8, 4])
def test_qwz_loss_within_derived_bound_of_zero3(bits):
    """|L(w + d) - L(w)| <= sum_i |dL/dw_i| * |d_i| to first order, and |d_i| <= s_b / 2
    (half a quantization step of the element's block). So the bound is
    B = sum_i |g_i| * s_b(i) / 2; the first-order term alone is usually far below B (signs
    cancel), which leaves room for the second-order term."""
    block = _BLOCK
    batch = tokens(16, seed=_SEED + 2)
    with float64_run():
        # The shared qwZ and ZeRO-3 steps: the same parameters.
        z3, z3_step = _shared(None)
        qw, qw_step = _shared(bits)
        _, out_z3 = z3_step(z3, batch)
        _, out_qw = qw_step(qw, batch)
        bound = 0.0
        for name, lay in qw.engine.layouts.items():
            flat = jnp.asarray(np.asarray(qw.params.units[name]))
            s = _scales(flat, bits=bits, block=block)
            # Same flat order in both runs; only the padding differs (qwZ pads to whole
            # blocks).
            g = np.zeros(lay.n_pad, np.float64)
            g[: lay.n] = np.asarray(jax.device_get(out_z3["grads"].units[name]))[: lay.n]
            bound += float(np.sum(np.abs(g) * np.repeat(np.asarray(s), block) / 2))
    diff = abs(float(out_qw["loss"]) - float(out_z3["loss"]))
    with seed_on_failure(_SEED):
        assert 0 < diff <= bound, (diff, bound)


@functools.partial(jax.jit, static_argnames=("block", "weight_format", "hadamard"))
def _round_trip_as_sent(flat, *, block: int, weight_format: str, hadamard: bool):
    """One unit's flat buffer through Q and Q^-1 in ``weight_format`` (with the fixed key's
    Hadamard signs when ``hadamard``), as one program per unit size instead of ~25 op-by-op
    compiles (jitted and op by op, these references gave the same bits for every format
    and unit size of the test GPT, Hadamard or not: checked when this was jitted)."""
    from pallas_kernels.hadamard import rotate_reference, unrotate_reference
    from zeropp_jax.quant.fp8 import dequantize_fp8_flat, quantize_fp8_flat
    from zeropp_jax.quant.rotation import hadamard_signs

    signs = hadamard_signs(None, block) if hadamard else None
    if weight_format == "fp8":
        x = rotate_reference(flat, signs, block_size=block) if hadamard else flat
        deq = dequantize_fp8_flat(*quantize_fp8_flat(x, block_size=block), block_size=block)
        return unrotate_reference(deq, signs, block_size=block) if hadamard else deq
    kw = dict(bits=int(weight_format[3:]), block_size=block, signs=signs)
    return dequantize_reference(*quantize_reference(flat, **kw), dtype=jnp.float32, **kw)


def _dequantized_as_sent(state, block: int, weight_format: str, hadamard: bool) -> dict:
    """The weights a qwZ step computes with in ``weight_format`` (with the fixed key's
    Hadamard signs when ``hadamard``): every unit's flat buffer through Q and Q^-1."""
    return dequantized_params(state, block, 8, functools.partial(
        _round_trip_as_sent, block=block, weight_format=weight_format, hadamard=hadamard))


# Rotated INT4 in `make test-all`: a step takes the same path for every quantized wire
# format (FP8 here, INT8 and INT4 above), and the rotated INT4 transport's gather is
# checked against its wire format, and its regather bit for bit, on its own
# (test_transports.py::test_gather_is_the_wire_format_and_regather_is_bitwise).
@pytest.mark.parametrize("weight_format,hadamard", [
    pytest.param("int4", True, marks=pytest.mark.slow), ("fp8", False)])
def test_smoothed_and_fp8_steps_are_exact_at_their_dequantized_weights(weight_format,
                                                                       hadamard):
    """As for INT8/INT4 above: the step's loss and gradients are the plain model's at the
    weights the wire format delivers (rotated INT4; FP8 e4m3), forward and backward alike."""
    block = 64
    model = GPT(SMALL64)
    seed = fresh_seed()
    params = as_float64(init_params(seed=seed))
    batch = tokens(16, seed=seed + 1)
    with float64_run():
        cfg = zpp.ZeroPPConfig(qwz=True, weight_format=weight_format, qwz_hadamard=hadamard,
                               block_size=block, **FLOAT64)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 4), config=cfg)
        _, out = make_step(with_grads=True)(state, batch)
        deq = as_float64(_dequantized_as_sent(state, block, weight_format, hadamard))
        ref_loss, ref_grads = reference_loss_and_grads(model, deq, batch)
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], state.engine.consolidate(out["grads"]),
                                    ref_loss, ref_grads, FLOAT64_RHO)
