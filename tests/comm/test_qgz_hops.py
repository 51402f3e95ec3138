"""qgZ with only the cross-node hop quantized (``hops="cross"``, ``config.qgz_hops``): bit for
bit a numpy reference of its two hops, its bytes on each link, the one-node and one-device-
per-node cases, the config's checks, and the step it builds."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.core.mesh import MeshInfo
from zeropp_demo.gpt import GPT
from zeropp_jax.comm.qgz import qgz_reduce_scatter
from zeropp_jax.comm.transports import gradient_transport
from zeropp_jax.comm.transports.base import gradient_bytes
from zeropp_jax.measure.comm_report import collectives
from zeropp_jax.plan.auto import candidate_configs

from helpers import fresh_seed, SMALL, all_pairs, init_params, make_step, pairs_covered, tokens
from test_qgz_feedback import (AXES, BITS, BLOCK, _geometry, _hop2, _mesh, _put, _q_dq,
                               _signs, _sum_in_order)

MESHES = [(2, 4), (3, 2)]
FACTORS = [MESHES, [False, True], [1, 2]]
CASES = all_pairs(*FACTORS)
assert pairs_covered(CASES, FACTORS)
M = 100  # not whole blocks per stage: every slice is padded (test_qgz_feedback's M)


@functools.lru_cache(maxsize=None)
def _library(nodes: int, local: int, hadamard: bool, stages: int, hops: str = "cross"):
    """Jitted ``qgz_reduce_scatter(hops=hops)`` on a ``nodes x local`` mesh: per-device
    rows ``[P, n]`` in, ``[P, n / P]`` out."""
    mesh = _mesh(nodes, local)
    fn = jax.jit(jax.shard_map(
        functools.partial(qgz_reduce_scatter, bits=BITS, block_size=BLOCK, stages=stages,
                          hadamard=hadamard, hops=hops, single_node="quantize"),
        mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))
    return lambda x: np.asarray(fn(_put(mesh, np.asarray(x, np.float32)))).reshape(
        nodes * local, -1)


def reference_cross(x: np.ndarray, *, nodes, local, stages, signs) -> np.ndarray:
    """numpy qgZ with only the node hop quantized, for every device at once: ``x [P, P*m]``
    (row ``d = i*L + j``: device d's gradient) -> ``[P, m]``. Per stage, device ``(i, j)``
    adds in fp32, in sender order, sub-slice ``s`` of slices ``i'*L + j`` (every ``i'``) of
    its node's ``L`` devices; those partial sums are quantized (rotated first with
    ``signs``) and the node hop adds the ``N`` dequantized products in sender order and
    rotates back (``test_qgz_feedback._hop2``)."""
    num, m, m_pad, sub = _geometry(nodes, local, stages, x.shape[1])
    x_pad = np.zeros((num, num, m_pad), np.float32)  # [device, slice, position]
    x_pad[:, :, :m] = x.reshape(num, num, m)
    slots = x_pad.reshape(num, nodes, local, stages, sub).transpose(0, 3, 2, 1, 4)
    z = np.zeros((num, stages, nodes, sub), np.float32)  # row i': slice i'*L + j
    for i in range(nodes):
        for j in range(local):
            z[i * local + j] = _sum_in_order([slots[i * local + l, :, j]
                                              for l in range(local)])
    deq2 = _q_dq(z.reshape(-1), signs).reshape(z.shape)
    return _hop2(deq2, nodes=nodes, local=local, signs=signs)[:, :m]


def _gradients(rng, num: int, m: int = M) -> np.ndarray:
    """Heavy-tailed gradients with a scale per device (test_qgz_feedback's inputs)."""
    size = 10.0 ** rng.uniform(-1, 1, size=(num, 1))
    return (rng.standard_t(3, size=(num, num * m)) * size).astype(np.float32)


@pytest.mark.parametrize("mesh_shape,hadamard,stages", CASES)
def test_matches_numpy_reference_bit_for_bit(mesh_shape, hadamard, stages):
    nodes, local = mesh_shape
    seed = fresh_seed()
    x = _gradients(np.random.default_rng(seed), nodes * local)
    out = _library(nodes, local, hadamard, stages)(x)
    want = reference_cross(x, nodes=nodes, local=local, stages=stages,
                           signs=_signs(hadamard))
    # Tolerance: none, for the reason test_qgz_feedback.test_matches_numpy_reference gives:
    # the same fp32 operations on the same operands in the same order.
    np.testing.assert_array_equal(out, want, err_msg=f"seed {seed}")
    # ... and the quantization is there: the exact sum is not what came out (a heavy-tailed
    # block's INT4 rounding moves most of its elements).
    exact = x.astype(np.float64).reshape(nodes * local, nodes * local, M).sum(0)
    assert np.mean(out != exact.astype(np.float32)) > 0.5, f"seed {seed}"


def test_one_quantization_instead_of_two():
    """With the intra-node hop exact, what is left is the node hop's error alone: every
    element within the bound that hop's blocks promise (half a quantization step of each
    of the ``N`` blocks it sums, plus fp32 rounding), a bound both-hop qgZ exceeds."""
    nodes, local, stages = 2, 4, 1
    seed = fresh_seed()
    x = _gradients(np.random.default_rng(seed), nodes * local)
    num, m, m_pad, sub = _geometry(nodes, local, stages, x.shape[1])
    out = _library(nodes, local, False, stages)(x)
    both = _library(nodes, local, False, stages, "both")(x)
    exact = x.astype(np.float64).reshape(num, num, m).sum(0)  # [slice d, m]
    # The node hop's blocks: device (a, j)'s partial sums of slice i*L + j, the L exact
    # contributions of node a (their fp32 sum is within (L-1) U of their absolute sum).
    qmax = 2 ** (BITS - 1) - 1
    bound = np.zeros((num, m))
    for d in range(num):
        i, j = divmod(d, local)
        for a in range(nodes):
            part = x[a * local:(a + 1) * local].reshape(local, num, m)[:, d]
            blocks = np.zeros(m_pad)
            blocks[:m] = np.abs(part.astype(np.float64).sum(0))
            step = blocks.reshape(-1, BLOCK).max(1) / qmax * (1 + 2**-20)  # fp32 scale
            bound[d] += np.repeat(step / 2, BLOCK)[:m]
    rounding = 2 * num * 2.0**-24 * np.abs(x.astype(np.float64)).reshape(num, num, m).sum(0)
    err = np.abs(out - exact)
    assert np.all(err <= bound + rounding), f"seed {seed}"
    # Both-hop qgZ quantizes each device's whole gradient first: its error is not within
    # the node hop's bound (a check that could not tell the two apart would pass here).
    assert np.any(np.abs(both - exact) > bound + rounding), f"seed {seed}"


def test_one_node_is_the_exact_reduce_scatter_and_one_device_per_node_is_qgz():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    # One node: nothing crosses nodes, nothing is quantized, even with single_node="quantize".
    x = _gradients(rng, 4)
    out = _library(1, 4, False, 1)(x)
    np.testing.assert_allclose(out, x.reshape(4, 4, M).sum(0), rtol=0,
                               atol=4 * 4 * 2.0**-24 * float(np.abs(x).sum(0).max()),
                               err_msg=f"seed {seed}")
    # One device per node: the node hop is the only hop, so "cross" is qgZ itself.
    x = _gradients(rng, 4)
    np.testing.assert_array_equal(_library(4, 1, True, 1)(x),
                                  _library(4, 1, True, 1, "both")(x), err_msg=f"seed {seed}")


@pytest.mark.parametrize("mesh_shape", MESHES)
def test_bytes_cross_nodes_as_qgz_and_16_bit_inside(mesh_shape):
    nodes, local = mesh_shape
    n_pad = 3 * 4096  # divisible by both meshes' device counts
    base = dict(qgz=True, block_size=256)
    both = gradient_transport(zpp.ZeroPPConfig(**base))
    cross = gradient_transport(zpp.ZeroPPConfig(**base, qgz_hops="cross"))
    hier = gradient_transport(zpp.ZeroPPConfig(reduce_scatter="hierarchical"))
    assert cross.label() == "qgz-int4-cross" and both.label() == "qgz-int4"
    mesh = MeshInfo(nodes, local)
    b, c, h = (gradient_bytes(t, n_pad, "bfloat16", mesh) for t in (both, cross, hier))
    assert c.cross == b.cross < h.cross / 3.5  # INT4 + scales against bf16
    assert c.intra == h.intra > 3.5 * b.intra  # bf16 inside the node, as unquantized


def test_config_checks():
    with pytest.raises(ValueError, match="valid values are 'both' and 'cross'"):
        zpp.ZeroPPConfig(qgz=True, qgz_hops="intra")
    with pytest.raises(ValueError, match="needs qgz=True"):
        zpp.ZeroPPConfig(qgz_hops="cross")
    with pytest.raises(ValueError, match="qgz_hops='both'"):
        zpp.ZeroPPConfig(qgz=True, qgz_hops="cross", qgz_error_feedback=True)
    with pytest.raises(ValueError, match="hops='both' with feedback"):
        jax.eval_shape(jax.shard_map(
            lambda x: qgz_reduce_scatter(x, hops="cross", feedback=(x, x)),
            mesh=_mesh(2, 1), in_specs=P(AXES), out_specs=P(AXES), check_vma=False),
            jax.ShapeDtypeStruct((1024,), np.float32))
    # The planner's candidates without qgZ drop it (they could not be built otherwise).
    cands = candidate_configs(2, 2, base=zpp.ZeroPPConfig(qgz=True, qgz_hops="cross"))
    assert {c.qgz_hops for c in cands if c.qgz} == {"cross"}
    assert {c.qgz_hops for c in cands if not c.qgz} == {"both"}


def test_step_sends_16_bit_inside_nodes_and_int4_across():
    nodes, local = 2, 4
    cfg = zpp.ZeroPPConfig(qgz=True, qgz_hops="cross", compute_dtype="bfloat16",
                           block_size=32)
    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=3),
                                  tx=optax.sgd(0.1), mesh=zpp.make_mesh(nodes, local),
                                  config=cfg)
    ops = collectives(make_step().lower(state, tokens(16, seed=0)).as_text())
    a2a = [([list(g) for g in c.groups], c.dtype) for c in ops if c.kind == "all-to-all"]
    intra = [t for g, t in a2a if all(len({d // local for d in grp}) == 1 for grp in g)]
    cross = [t for g, t in a2a if all(len({d % local for d in grp}) == 1 for grp in g)]
    units = len(state.engine.layouts) - 1  # the rest unit's rides in the first unit's
    assert len(intra) + len(cross) == len(a2a)
    # bf16 moved as same-width integers inside the node; INT4 values and scales packed
    # into bytes across nodes.
    assert intra == ["ui16"] * units and cross == ["ui8"] * units
