"""The transports on their own: small shard_maps over a 2x2 or 2x4 mesh, no model, no step.

Each weight transport must (1) gather exactly what its wire format promises, (2) rebuild in
backward, from what it keeps, bit for bit the weights forward gathered (the unit transform
relies on it: a unit's backward must see its forward's weights), and hpZ's wrapper must do
so for every inner transport and group size. Each gradient transport must be a
reduce-scatter of the sum: exact for the unquantized ones (up to fp32 summation order),
within the quantization bound for qgZ, and qgZ switched off must be its fallback exactly.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.comm import transports
from zeropp_jax.comm.partition import make_unit_layout
from zeropp_jax.comm.transports.fp8 import Fp8Gather
from zeropp_jax.comm.transports.hpz import SecondaryRegather
from zeropp_jax.comm.transports.plain import PlainGather
from zeropp_jax.comm.transports.qgz import QgzReduceScatter
from zeropp_jax.comm.transports.qwz import QwzGather
from zeropp_jax.comm.transports.reduce_scatter import FlatReduceScatter
from zeropp_jax.comm.transports.stored_quantized import StoredQuantizedGather
from zeropp_jax.core.mesh import AXES
from zeropp_jax.quant.fp8 import dequantize_fp8_flat, quantize_fp8_flat
from zeropp_jax.quant.quantization import dequantize_flat, quantize_flat
from zeropp_jax.quant.rotation import hadamard_signs

from helpers import fresh_seed

SHARD = 512  # elements per device: two 256-element quantization blocks


def _run(mesh, fn, *arrays):
    """``fn`` on each device's rows of ``arrays`` (split over both mesh axes); its outputs
    concatenated in device order."""
    spec = P(AXES)
    return jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * len(arrays),
                                 out_specs=spec))(*arrays)


def _weights(devices, seed):
    rng = np.random.default_rng(seed)
    return rng.standard_normal(devices * SHARD).astype(np.float32)


def _round_trip(transport, mesh, stored):
    """Per device: forward's full weights, and backward's rebuild from what it kept."""
    def body(*stored):
        full, moved = transport.gather(stored)
        rebuilt = transport.regather(transport.keep(stored, moved))
        return full[None], rebuilt[None]

    spec = P(AXES)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(stored),
                                 out_specs=(spec, spec)))(*stored)


def _value_transports(dtype):
    return {
        "plain": PlainGather(dtype),
        "plain_two_hop": PlainGather(dtype, hierarchical=True),
        "qwz8": QwzGather(8, 256, dtype, "xla"),
        "qwz4_shard_scale": QwzGather(4, None, dtype, "xla"),
        "qwz4_hadamard": QwzGather(4, 256, dtype, "xla", hadamard=True),
        "fp8": Fp8Gather(256, dtype),
    }


@pytest.mark.parametrize("shape", [(2, 2), (2, 4)])
@pytest.mark.parametrize("name", ["plain", "plain_two_hop", "qwz8", "qwz4_shard_scale",
                                  "qwz4_hadamard", "fp8"])
def test_gather_is_the_wire_format_and_regather_is_bitwise(shape, name):
    mesh = zpp.make_mesh(*shape, devices=jax.devices()[: shape[0] * shape[1]])
    devices = shape[0] * shape[1]
    w = _weights(devices, seed=devices)
    t = _value_transports(jnp.bfloat16)[name]
    full, rebuilt = _round_trip(t, mesh, (w,))
    full, rebuilt = np.asarray(full), np.asarray(rebuilt)
    # Every device holds the same full weights, and backward rebuilt them bit for bit.
    assert full.shape == (devices, devices * SHARD) and full.dtype == jnp.bfloat16
    np.testing.assert_array_equal(full, np.broadcast_to(full[0], full.shape))
    np.testing.assert_array_equal(rebuilt, full)
    # What the wire format promises: the bf16 cast, or each shard's own dequantized blocks
    # (computed in one jitted program, as the transport's own code runs, not op by op).
    if name.startswith("plain"):
        def wire(w):
            return w.astype(jnp.bfloat16)
    elif name == "fp8":
        def wire(w):
            v, s = quantize_fp8_flat(w, block_size=256)
            return dequantize_fp8_flat(v, s, block_size=256, dtype=jnp.bfloat16)
    elif name == "qwz4_hadamard":  # the fixed key's signs: rotated, quantized, rotated back
        def wire(w):
            kw = dict(bits=4, block_size=256, implementation="xla",
                      signs=hadamard_signs(None, 256))
            v, s = quantize_flat(w, **kw)
            return dequantize_flat(v, s, dtype=jnp.bfloat16, **kw)
    else:
        block = t.block_size or SHARD

        def wire(w):
            v, s = quantize_flat(w, bits=t.bits, block_size=block, implementation="xla")
            return dequantize_flat(v, s, bits=t.bits, block_size=block, dtype=jnp.bfloat16,
                                   implementation="xla")
    np.testing.assert_array_equal(full[0], np.asarray(jax.jit(wire)(jnp.asarray(w))))


def _stored(w, bits):
    """``w`` quantized as stored: ``quantize_flat``'s (values, scales), in one jitted program."""
    return jax.jit(lambda w: quantize_flat(w, bits=bits, block_size=256,
                                           implementation="xla"))(w)


@pytest.mark.parametrize("bits", [8, 4])
def test_stored_quantized_moves_what_is_stored(bits):
    mesh = zpp.make_mesh(2, 2, devices=jax.devices()[:4])
    w = jnp.asarray(_weights(4, seed=bits))
    # Stored as each device's shard quantized on its own (whole blocks per shard); both
    # sides jitted (one program each, not op by op).
    v, s = _stored(w, bits)
    t = StoredQuantizedGather(bits, 256, jnp.float32, "xla")
    full, rebuilt = _round_trip(t, mesh, (v, s))
    expect = jax.jit(lambda v, s: dequantize_flat(v, s, bits=bits, block_size=256,
                                                  dtype=jnp.float32, implementation="xla"))(v, s)
    np.testing.assert_array_equal(np.asarray(full)[0], np.asarray(expect))
    np.testing.assert_array_equal(np.asarray(rebuilt), np.asarray(full))


@pytest.mark.parametrize("group_size", [None, 8])  # one node, or the 2 nodes of a 2x4 mesh
@pytest.mark.parametrize("inner", ["plain", "qwz8", "stored8"])
def test_hpz_rebuilds_forward_weights_from_the_secondary(inner, group_size):
    mesh = zpp.make_mesh(2, 4)
    w = jnp.asarray(_weights(8, seed=3))
    if inner == "stored8":
        stored = _stored(w, 8)
        base = StoredQuantizedGather(8, 256, jnp.bfloat16, "xla")
    else:
        stored = (w,)
        base = _value_transports(jnp.bfloat16)[inner]
    t = SecondaryRegather(base, group_size)
    full, rebuilt = _round_trip(t, mesh, stored)
    np.testing.assert_array_equal(np.asarray(rebuilt), np.asarray(full))
    # The secondary is a slice: 1/4 (one node's devices) or 1/8 of what moved.
    def kept_len(*stored):
        kept = t.keep(stored, t.gather(stored)[1])
        return jnp.full((1,), kept[0].shape[0])

    n = np.asarray(_run(mesh, kept_len, *stored))
    assert set(n.tolist()) == {8 * SHARD // (4 if group_size is None else 8)}


def test_flat_reduce_scatter_is_the_sum_and_qgz_off_is_its_fallback():
    mesh = zpp.make_mesh(2, 4)
    seed = fresh_seed()  # fresh inputs each run
    rng = np.random.default_rng(seed)
    g = rng.standard_normal((8, 8 * SHARD)).astype(np.float32)  # each device's full gradient
    exact = g.astype(np.float64).sum(0)
    flat = FlatReduceScatter()
    qgz = QgzReduceScatter(8, 256, 1, "xla", flat)

    def body(gd, on):
        return (flat.reduce_sum(gd[0])[None], qgz.reduce_sum(gd[0], on[0])[None],
                qgz.reduce_sum(gd[0])[None])

    spec = P(AXES)
    out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec),
                                out_specs=(spec, spec, spec)))
    plain, switched_off, quantized = (np.asarray(x).reshape(-1)
                                      for x in out(g, np.zeros(8, bool)))
    # fp32 sums of 8 terms: within 8 ulps of the largest partial sum.
    tol = 8 * 2.0**-23 * np.abs(g).sum(0).max()
    np.testing.assert_allclose(plain, exact, rtol=0, atol=tol, err_msg=f"seed {seed}")
    np.testing.assert_array_equal(switched_off, plain)
    # INT8 rounds a value by at most half a step, step = (its block's max |x|) / 127.
    # Hop 1 (inside the node): the 8 device gradients, |x| <= M, each rounded once:
    # <= 8 M / 254 in the sum. Hop 2 (across nodes): the 2 node partial sums, |x| <= 4 M
    # (plus hop 1's error, hence 1%), each rounded once: <= 2 * 4 M / 254.
    m = np.abs(g).max()
    bound = (8 * m / 254 + 2 * 4 * m * 1.01 / 254)
    err = np.max(np.abs(quantized - exact))
    assert err <= bound, (seed, err, bound)
    assert not np.array_equal(quantized, plain), seed  # it did quantize


def test_config_picks_the_transports():
    lay = make_unit_layout(("u",), {"w": np.zeros((40, 32), np.float32)}, 8, 256)
    z3 = zpp.ZeroPPConfig.zero3()
    assert isinstance(transports.weight_transport(z3), PlainGather)
    assert isinstance(transports.gradient_transport(z3), FlatReduceScatter)
    zpp_cfg = zpp.ZeroPPConfig.zeropp()
    t = transports.weight_transport(zpp_cfg)
    assert isinstance(t, SecondaryRegather) and isinstance(t.inner, QwzGather)
    g = transports.gradient_transport(zpp_cfg)
    assert isinstance(g, QgzReduceScatter) and g.bits == zpp_cfg.grad_bits
    frozen_cfg = zpp.ZeroPPConfig(quantize_frozen=True)
    assert isinstance(transports.weight_transport(frozen_cfg, lay), StoredQuantizedGather)
    # Frozen weights stored in the param dtype travel like trainable ones.
    assert isinstance(transports.weight_transport(z3, lay), PlainGather)
    # The wire format and the smoothing switches reach the transports.
    fp8 = transports.weight_transport(zpp.ZeroPPConfig(qwz=True, weight_format="fp8",
                                                       qwz_hadamard=True))
    assert isinstance(fp8, Fp8Gather) and fp8.hadamard and fp8.fmt == "e4m3"
    int4 = transports.weight_transport(zpp.ZeroPPConfig(qwz=True, weight_format="int4",
                                                        qwz_hadamard=True))
    assert isinstance(int4, QwzGather) and (int4.bits, int4.hadamard) == (4, True)
    smooth = transports.gradient_transport(zpp.ZeroPPConfig(qgz=True, qgz_hadamard=True,
                                                            stochastic_rounding=True))
    assert (smooth.hadamard, smooth.stochastic_rounding) == (True, True)
    assert (g.hadamard, g.stochastic_rounding) == (False, False)  # off by default
    # Transports are static data: equal configs give equal (hashable) transports.
    assert hash(transports.weight_transport(zpp_cfg)) == hash(transports.weight_transport(
        zpp.ZeroPPConfig.zeropp()))


def test_a_new_wire_format_is_a_transport_and_one_registry_entry(monkeypatch):
    """A wire format the library has never seen: its transport (here a subclass of the
    plain gather with a label of its own, a stand-in for a real format) and one
    ``WEIGHTS`` entry under a name that ends in its bits. The config takes the name as it is, the plan resolves it, a step
    runs it and labels it; a name with no entry is refused when the plan is made."""
    import dataclasses

    import optax

    from zeropp_jax.comm.transports import registry

    @dataclasses.dataclass(frozen=True)
    class Halves(PlainGather):
        def label(self) -> str:
            return "halves8"

    monkeypatch.setitem(registry.WEIGHTS, "halves8",
                        lambda config: Halves(config.compute_jnp_dtype))
    config = zpp.ZeroPPConfig(qwz=True, weight_format="halves8", compute_dtype="float32")
    assert config.weight_bits == 8
    assert isinstance(transports.plan_of(config).weights, Halves)
    assert transports.plan_of(config).label() == "halves8"

    from helpers import SMALL, init_params, make_step, tokens
    from zeropp_demo.gpt import GPT

    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=config)
    assert isinstance(state.engine.transports["block_0"].weights, Halves)
    _, out = make_step()(state, tokens(16, seed=0))
    assert np.isfinite(float(out["loss"]))
    with pytest.raises(ValueError, match="'nf4' has no transport.*'int8', 'int4', 'fp8'"):
        zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 4),
                              config=zpp.ZeroPPConfig(qwz=True, weight_format="nf4"))
