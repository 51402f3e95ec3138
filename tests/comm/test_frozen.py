"""Frozen parameters (LoRA / RLHF): stored pre-quantized, gathered as stored, never trained."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from pallas_kernels.quantize import dequantize_reference, quantize_reference
from zeropp_jax.measure.comm_report import collectives
from zeropp_jax.comm.frozen import split_frozen
from zeropp_demo.gpt import GPT

from helpers import (FLOAT64, FLOAT64_RHO, SMALL, SMALL64, as_float64, assert_leaves_equal,
                     assert_loss_and_grads_close, float64_run, fresh_seed, init_params,
                     make_step, reference_loss_and_grads, seed_on_failure, tokens)

BLOCK = 64
_SEED = fresh_seed()  # the shared steps' parameters and batches, fresh each run


@pytest.fixture(autouse=True)
def _float64():
    """Every test here runs float64 steps (the parity tests' derived tolerance:
    helpers.FLOAT64_RHO); the states are built and stepped inside ``float64_run``."""
    with float64_run():
        yield


def _frozen(path):
    # Every kernel and the whole token embedding: blocks and the head become mixed units
    # (frozen kernels beside trainable biases / LayerNorms, like LoRA adapters beside a
    # frozen Dense), "wte" a wholly frozen unit, and the root's logit_scale stays trainable.
    return path[-1] == "kernel" or path[0] == "wte"


def _state(config, params, tx=None, mesh=(2, 4)):
    return zpp.TrainState.create(model=GPT(SMALL64), params=params, tx=tx or optax.adam(1e-2),
                                 mesh=zpp.make_mesh(*mesh), config=config, frozen=_frozen)


# Steps built once per module and shared between tests (a step compiles once per engine,
# compared by identity, and step function; steps do not donate the state, so the untrained
# state serves every test that reads it):
# - the float64 quantize_frozen steps of test_forward_and_gradients_equal_model_at_dequantized_
#   weights, with the step's output on its batch: test_frozen_params_get_no_gradient_and_
#   no_optimizer_state reads the INT8 one's output, and
#   test_lowered_step_gathers_frozen_as_stored_without_quantizing lowers the INT8 and INT4
#   ones (the same trace; lowering alone compiles nothing, so in `make test`, where the
#   INT4 step does not run, INT4 is only lowered);
# - the float64 step without quantize_frozen of
#   test_unquantized_frozen_is_exact_and_excluded_from_the_optimizer, whose lowered program
#   the lowering test also reads.
_BUILT: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_built():
    yield
    _BUILT.clear()


def _quantized(bits: int, hpz: bool = False):
    """(params, batch, untrained state, step) of the float64 quantize_frozen step (INT``bits``,
    Adam(1e-2)) that also returns its gradients; nothing compiled yet."""
    key = ("quantized", bits, hpz)
    if key not in _BUILT:
        params, batch = as_float64(init_params(seed=_SEED)), tokens(16, seed=_SEED + 1)
        cfg = zpp.ZeroPPConfig(quantize_frozen=True, weight_bits=bits, block_size=BLOCK,
                               hpz=hpz, **FLOAT64)
        _BUILT[key] = (params, batch, _state(cfg, params), make_step(with_grads=True))
    return _BUILT[key]


def _quantized_run(bits: int, hpz: bool = False):
    """``_quantized(bits, hpz)`` and ``(new state, outputs)`` of its step on its batch."""
    key = ("ran", bits, hpz)
    if key not in _BUILT:
        params, batch, state, step = _quantized(bits, hpz)
        _BUILT[key] = (params, batch, state, step, step(state, batch))
    return _BUILT[key]


def _unquantized():
    """(params, untrained state, step) of the float64 step without quantize_frozen (SGD(0.5))."""
    if "unquantized" not in _BUILT:
        params = as_float64(init_params(seed=_SEED + 2))
        state = _state(zpp.ZeroPPConfig(**FLOAT64), params, tx=optax.sgd(0.5))
        _BUILT["unquantized"] = (params, state, make_step(with_grads=True))
    return _BUILT["unquantized"]


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def _round_trip(flat, *, bits, block):
    """Q then Q^-1 of a flat buffer, in one program instead of ~50 op-by-op compiles. Jitting
    cannot change a bit here: quantize_reference / dequantize_reference are elementwise
    (plus an exact max) and no product feeds a sum, so there is nothing for XLA to contract
    into an FMA, and fusion does not change IEEE results of the other ops."""
    v, s = quantize_reference(flat, bits=bits, block_size=block)
    return dequantize_reference(v, s, bits=bits, block_size=block, dtype=np.float32), s


def _dequantized(params, bits, block):
    """The reference weights: every frozen unit's flat buffer through Q and Q^-1, computed
    here independently of the engine's storage (shards are whole blocks, so quantizing the
    whole padded buffer equals quantizing each device's shard)."""
    train, froz = split_frozen(params, _frozen)
    out = {}

    def deq(x):
        flat = np.asarray(x, np.float32).ravel()
        pad = -flat.size % block
        d, s = _round_trip(np.pad(flat, (0, pad)), bits=bits, block=block)
        return np.asarray(d)[: flat.size].reshape(np.shape(x)), np.asarray(s)

    # Quantize per unit flat buffer (leaf order = the layout's flatten order).
    for unit, sub in froz.items():
        leaves, treedef = jax.tree_util.tree_flatten(sub)
        sizes = [np.size(x) for x in leaves]
        flat, scales = deq(np.concatenate([np.ravel(x) for x in leaves]))
        parts = np.split(flat, np.cumsum(sizes)[:-1])
        out[unit] = (jax.tree_util.tree_unflatten(
            treedef, [p.reshape(np.shape(x)) for p, x in zip(parts, leaves)]), scales)
    from zeropp_jax.comm.frozen import merge_trees

    return merge_trees(train, {k: t for k, (t, _) in out.items()}), {k: s for k, (_, s) in out.items()}


# INT4 in `make test-all`: the step's frozen path is INT8's with other bits (storing,
# gathering as stored, decoding); INT4's stored transport is checked bit for bit on its
# own (test_transports.py::test_stored_quantized_moves_what_is_stored[4]) and its lowered
# step read below.
@pytest.mark.parametrize("bits,hpz", [(8, False), pytest.param(4, False, marks=pytest.mark.slow),
                                      (8, True)])
def test_forward_and_gradients_equal_model_at_dequantized_weights(bits, hpz):
    """Float64 compute: the step's loss equals the plain model's at the dequantized frozen
    weights (fp32 values: INT blocks times fp32 scales; the same float64 arithmetic after,
    in a different reduction order over 8 devices: within the derived rounding,
    helpers.assert_loss_and_grads_close), and its gradient — of the trainable leaves only —
    equals the reference gradient there."""
    params, batch, state, _, (_, out) = _quantized_run(bits, hpz)
    deq, scales = _dequantized(params, bits, BLOCK)
    ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), as_float64(deq), batch)
    trainable_ref, _ = split_frozen(ref_grads, _frozen)
    with seed_on_failure(_SEED):
        assert_loss_and_grads_close(out["loss"], state.engine.consolidate(out["grads"]),
                                    ref_loss, trainable_ref, FLOAT64_RHO)
    # The stored weights are the quantized ones: consolidate gives the dequantized tree (the
    # same quantize_reference of the same whole blocks: bit for bit), within half a
    # quantization step of the original weights, plus fp32 rounding. Derived: the quantizer
    # computes y = fl(x * fl(1 / s)) with the stored scale s, two roundings of x / s, so
    # |y - x / s| <= |x / s| 2^-23 <= 128 * 2^-23 = 2^-16 (|x / s| <= qmax = 127, and a
    # little over it clips closer); q = round(y) (or the clip) is within 1/2 of y; the
    # dequantized fl(q * s) adds |q s| 2^-24 <= 127 s 2^-24 < s 2^-17. In all,
    # |deq - x| <= s (1/2 + 2^-16 + 2^-17) < s (1/2 + 2^-15). (2^-20, used before, held for
    # small |x / s| only: an element within 2^-16 of a rounding boundary can round the other
    # way.)
    full = state.consolidate()
    assert_leaves_equal(full, deq)
    orig = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(params["wte"])])
    stored = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(full["wte"])])
    step = np.repeat(scales["wte"], BLOCK)[: orig.size].astype(np.float64)
    excess = np.abs(stored - orig) / step - 0.5
    with seed_on_failure(_SEED):
        assert np.all(excess <= 2.0**-15), (
            f"element {int(np.argmax(excess))}: {np.max(excess):.3g} of a step over half "
            "a step from its original value")
        assert np.any(stored != orig)  # it really is quantized


def test_frozen_params_get_no_gradient_and_no_optimizer_state():
    # The INT8 step of test_forward_and_gradients_equal_model_at_dequantized_weights (Adam,
    # quantize_frozen; float64 compute, which decides nothing here) and its step's output.
    _, _, state, _, (new, out) = _quantized_run(8)
    engine = state.engine
    assert "wte" not in engine.layouts and "wte" in engine.frozen_layouts
    # Adam keeps mu and nu: exactly two buffers per trainable unit, nothing for frozen ones.
    shapes = sorted(x.shape[0] for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim)
    assert shapes == sorted(2 * [lay.n_pad for lay in engine.layouts.values()])
    assert set(out["grads"].units) == set(engine.layouts)
    grads = engine.consolidate(out["grads"])
    paths = [tuple(k.key for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(grads)[0]]
    assert paths and not any(_frozen(p) for p in paths)
    # Storage: int8 values, one fp32 scale per block; unchanged by the step, while the
    # trainable shards moved.
    for name in engine.frozen_layouts:
        assert new.frozen.values[name].dtype == np.int8
        np.testing.assert_array_equal(np.asarray(new.frozen.values[name]),
                                      np.asarray(state.frozen.values[name]))
        np.testing.assert_array_equal(np.asarray(new.frozen.scales[name]),
                                      np.asarray(state.frozen.scales[name]))
    assert any(np.any(np.asarray(new.params.units[k]) != np.asarray(state.params.units[k]))
               for k in engine.layouts)


_CONVERT_TO_INT = re.compile(r"stablehlo\.convert [^\n]*\(tensor<[0-9x]*f32>\) -> tensor<[0-9x]*i8>")


def _gather_types(text: str) -> list[str]:
    return [c.dtype for c in collectives(text) if c.kind == "all-gather"]


@pytest.mark.parametrize("bits", [8, 4])
def test_lowered_step_gathers_frozen_as_stored_without_quantizing(bits):
    # The float64 steps the tests above run (lowering compiles nothing; where a step ran, its
    # trace is reused), and the same configuration with qwZ; the compute dtype decides only
    # the trainable units' type.
    params, batch, state, step = _quantized(bits)
    text = step.lower(state, batch).as_text()
    types = _gather_types(text)
    # Forward gathers of the 4 frozen units carry the stored bytes (values and scales in
    # one uint8 buffer); trainable units in their float dtype; no fp32 -> int8 conversion
    # anywhere: nothing is quantized in the step.
    value_type = "ui8"
    assert types.count(value_type) == 4, types
    assert not _CONVERT_TO_INT.search(text)
    # The check can fail: the same step with qwZ quantizes the trainable units.
    qwz = _state(dataclasses.replace(state.engine.config, qwz=True), params)
    assert _CONVERT_TO_INT.search(make_step(with_grads=True).lower(qwz, batch).as_text())
    # Without quantize_frozen (test_unquantized_frozen_is_exact_and_excluded_from_the_
    # optimizer's step), frozen weights move unquantized (as unsigned ints of their width).
    _, plain, plain_step = _unquantized()
    assert value_type not in _gather_types(plain_step.lower(plain, batch).as_text())


def test_unquantized_frozen_is_exact_and_excluded_from_the_optimizer():
    """quantize_frozen=False: frozen weights stay in the parameter dtype, the step equals
    the plain model (float64, within the derived rounding), and after training steps the
    frozen weights are bit-identical."""
    params, state, step = _unquantized()
    batch = tokens(16, seed=_SEED + 3)
    new, out = step(state, batch)
    new, _ = step(new, batch)
    ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), params, batch)
    trainable_ref, _ = split_frozen(ref_grads, _frozen)
    with seed_on_failure(_SEED):
        assert_loss_and_grads_close(out["loss"], state.engine.consolidate(out["grads"]),
                                    ref_loss, trainable_ref, FLOAT64_RHO)
    _, froz_before = split_frozen(params, _frozen)
    _, froz_after = split_frozen(new.consolidate(), _frozen)
    for a, b in zip(jax.tree_util.tree_leaves(froz_after), jax.tree_util.tree_leaves(froz_before)):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_bad_frozen_setups_name_the_fix():
    params = init_params(seed=91)
    with pytest.raises(ValueError, match="nothing to train"):
        zpp.TrainState.create(model=GPT(SMALL), params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4), frozen=lambda p: True)
    with pytest.raises(ValueError, match="no parameters are frozen"):
        zpp.TrainState.create(model=GPT(SMALL), params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4),
                              config=zpp.ZeroPPConfig(quantize_frozen=True))
    with pytest.raises(NotImplementedError, match="stage 3"):
        zpp.TrainState.create(model=GPT(SMALL), params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4), config=zpp.ZeroPPConfig(stage=2),
                              frozen=_frozen)
    with pytest.raises(TypeError, match="tuple of names"):
        zpp.TrainState.create(model=GPT(SMALL), params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4), frozen=["wte"])
    with pytest.raises(ValueError, match="stage=3"):
        zpp.ZeroPPConfig(stage=2, quantize_frozen=True)
