"""qgZ: placement of psum_scatter, a derived error bound, stages, the lowered step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from pallas_kernels.quantize import dequantize_reference, quantize_reference
from zeropp_jax.core import compat
from zeropp_jax.measure.comm_report import collectives
from zeropp_demo.gpt import GPT
from zeropp_jax.comm.qgz import qgz_reduce_scatter

from helpers import (FLOAT64, FLOAT64_RHO, SMALL, SMALL64, U32, all_pairs, as_float64,
                     assert_leaves_equal, assert_loss_and_grads_close, float64_run, fresh_seed,
                     init_params, make_step, pairs_covered, seed_on_failure, tokens)

AXES = ("node", "local")


def _runner(mesh, **kwargs):
    """One jitted qgZ program: x_dev [P, n] (row d = device d's gradient) -> qgZ result of
    each device, [P, n/P]. Calls with inputs of the same shape reuse its compiled program."""
    fn = jax.jit(jax.shard_map(lambda v: qgz_reduce_scatter(v, **kwargs), mesh=mesh,
                               in_specs=P(AXES), out_specs=P(AXES)))

    def run(x_dev):
        x = jax.device_put(jnp.asarray(x_dev).reshape(-1), NamedSharding(mesh, P(AXES)))
        return np.asarray(fn(x)).reshape(x_dev.shape[0], -1)

    return run


def _run(mesh, x_dev, **kwargs):
    """x_dev [P, n] (row d = device d's gradient) -> qgZ result of each device, [P, n/P]."""
    return _runner(mesh, **kwargs)(x_dev)


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def _q_dq_program(v, signs=None, *, bits: int, block: int):
    """Q then Q^-1 (``signs``: rotated blocks, left rotated) -> (fp32 values, block scales):
    one program per shape instead of the references' ops one by one (each a small compile;
    the step runs the same references jitted, and they round alike either way)."""
    vals, scales = quantize_reference(v, bits=bits, block_size=block, signs=signs)
    return dequantize_reference(vals, scales, bits=bits, block_size=block,
                                dtype=jnp.float32), scales


def _q_dq(v: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    deq, scales = _q_dq_program(jnp.asarray(v, jnp.float32), bits=bits, block=block)
    return np.asarray(deq, np.float64), np.repeat(np.asarray(scales, np.float64), block)


def _bound(x_dev: np.ndarray, nodes: int, local: int, bits: int, block: int) -> np.ndarray:
    """Per-element error bound of qgZ against the exact sum, derived hop by hop.

    Hop 1 quantizes each device's slice once: error <= s1/2 per element (s1: the scale of the
    element's block on that device). The fp32 sum of the L dequantized slices is then
    requantized: error <= s2/2 (s2: the partial sum's block scale). Hop 2 adds the N
    dequantized partial sums. Total: sum over devices of s1/2 + sum over nodes of s2/2, plus
    fp32 rounding of the quantizer (2**-22 * qmax * scale, see pallas_kernels/quantize.py)
    and of the sums (2**-23 per addition of the magnitudes involved).
    """
    num = nodes * local
    n = x_dev.shape[1]
    m = n // num
    m_pad = -(-m // block) * block
    slices = np.zeros((num, num, m_pad))  # [source device, destination slice, element]
    slices[:, :, :m] = x_dev.astype(np.float64).reshape(num, num, m)
    qmax = 2 ** (bits - 1) - 1
    rounding = 2.0**-22 * qmax
    bound = np.zeros((num, m_pad))
    for d in range(num):
        for a in range(nodes):
            partial = np.zeros(m_pad)
            magnitude = np.zeros(m_pad)
            for l in range(local):
                deq, s1 = _q_dq(slices[a * local + l, d], bits, block)
                partial += deq
                magnitude += np.abs(deq)
                bound[d] += s1 * (0.5 + rounding)
            bound[d] += 2.0**-23 * local * magnitude
            if nodes > 1 and local > 1:  # the middle requantization
                deq2, s2 = _q_dq(partial.astype(np.float32), bits, block)
                bound[d] += s2 * (0.5 + rounding) + 2.0**-23 * nodes * np.abs(deq2)
    return bound[:, :m]


MESHES = [(2, 4), (4, 2), (3, 2), (1, 8), (8, 1)]


# Meshes x slice lengths (whole blocks, and not) x widths: an all-pairs cover runs in
# `make test`, the rest in test-all.
PLACEMENT = [MESHES, [96, 100], [4, 8]]
PLACEMENT_CASES = all_pairs(*PLACEMENT)
assert pairs_covered(PLACEMENT_CASES, PLACEMENT)


def _placement_ratios(mesh_shape, m, bits, seed):
    """The body of ``test_placement_and_error_bound`` on the inputs drawn from ``seed``:
    asserts, and returns ``(max err / bound, max bound / max |exact|)``."""
    nodes, local = mesh_shape
    num = nodes * local
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:num])
    rng = np.random.default_rng(seed)
    # Heavy tails and per-device scales: blocks with very different scales.
    x = (rng.standard_t(3, size=(num, num * m))
         * 10.0 ** rng.uniform(-2, 1, size=(num, 1))).astype(np.float32)
    exact = x.astype(np.float64).sum(axis=0).reshape(num, m)  # slice d of the sum
    single = "quantize" if nodes == 1 else "reduce_scatter"
    out = _run(mesh, x, bits=bits, block_size=32, single_node=single)
    assert out.shape == (num, m) and out.dtype == np.float32
    err = np.abs(out - exact)
    bound = _bound(x, nodes, local, bits, 32)
    assert np.all(err <= bound), (seed, float(np.max(err / bound)))
    # The bound is not vacuous: errors reach a good fraction of it somewhere (over 30 fresh
    # seeds of every case at least 0.37), and it catches slices sent to the wrong devices:
    # the output with its slices rotated by one device fails it on these inputs (what this
    # checks is the draw, that it can tell a misplacement; a 768-element draw where no
    # neighbouring sums differ by more than the bound would be one to look at).
    assert np.max(err / bound) > 0.1, (seed, float(np.max(err / bound)))
    if num > 1:
        assert np.any(np.abs(np.roll(out, 1, axis=0) - exact) > bound), seed
    return float(np.max(err / bound)), float(np.max(bound) / np.max(np.abs(exact)))


@pytest.mark.parametrize("mesh_shape,m,bits", PLACEMENT_CASES)
def test_placement_and_error_bound(mesh_shape, m, bits):
    _placement_ratios(mesh_shape, m, bits, seed=fresh_seed())  # fresh inputs


@pytest.mark.bitwise_programs
def test_single_node_falls_back_to_exact_reduce_scatter():
    mesh = zpp.make_mesh(1, 8)
    x = np.random.default_rng(5).standard_normal((8, 8 * 64)).astype(np.float32)
    out = _run(mesh, x, bits=4, block_size=32)
    ref = jax.jit(jax.shard_map(lambda v: jax.lax.psum_scatter(v, AXES, tiled=True),
                                mesh=mesh, in_specs=P(AXES), out_specs=P(AXES)))(
        jax.device_put(jnp.asarray(x).reshape(-1), NamedSharding(mesh, P(AXES))))
    np.testing.assert_array_equal(out.reshape(-1), np.asarray(ref))


# Meshes x dtypes x the stage count compared with one stage (each a program of its own):
# an all-pairs cover runs in `make test` (every mesh and every dtype against both stage
# counts, every mesh with every dtype), the rest in test-all.
STAGES = [[(2, 4), (3, 2)], ["bfloat16", "float16", "float32"], [2, 4]]
STAGES_CASES = all_pairs(*STAGES)
assert pairs_covered(STAGES_CASES, STAGES)


@pytest.mark.parametrize("mesh_shape,dtype,stages", STAGES_CASES)
@pytest.mark.bitwise_programs
def test_stages_give_identical_results(mesh_shape, dtype, stages):
    nodes, local = mesh_shape
    num = nodes * local
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:num])
    x = np.random.default_rng(7).standard_normal((num, num * 4 * 40)).astype(np.float32)
    x = np.asarray(jnp.asarray(x, dtype))
    results = [_run(mesh, jnp.asarray(x, dtype), bits=4, block_size=16, stages=s)
               for s in (1, stages)]
    np.testing.assert_array_equal(results[0], results[1])


def test_bad_input():
    mesh = zpp.make_mesh(2, 4)
    x = np.ones((8, 8 * 32), np.float32)
    with pytest.raises(ValueError, match="valid values"):
        _run(mesh, x, bits=2, block_size=32)
    with pytest.raises(ValueError, match="stages"):
        _run(mesh, x, bits=4, block_size=32, stages=0)
    with pytest.raises(ValueError, match="divisible"):
        _run(mesh, np.ones((8, 8 * 32 + 8), np.float32)[:, :-1], bits=4, block_size=32)


# fp32 steps (returning their gradients) on the 2x4 mesh, built once per module. A step
# compiles once per engine (compared by identity) and step function, and steps do not
# donate the state, so the same start serves every test that shares it.
# - ZeRO-3: test_qgz_until_switches_without_recompiling and
#   test_hierarchical_all_gather_in_the_step_crosses_nodes_in_node_groups compare it bit for
#   bit; test_hierarchical_reduce_scatter_in_the_step_moves_16_bit takes it as its flat
#   reference. It is compiled with XLA's default fusion emitters (what bitwise_programs
#   tests get, tests/conftest.py) whichever test builds it first, so the bitwise tests
#   compare like with like.
# - always-on qgZ: test_qgz_until_switches_without_recompiling runs it;
#   test_lowered_step_has_two_hops_per_unit_and_stage[1] reads its lowered program (the
#   same trace and lowering; it compiles nothing).
_BUILT: dict = {}
_FP32 = dict(compute_dtype="float32", block_size=32)
_SHARED_SEED = 61  # the shared states' parameters: init_params(seed=61)


@pytest.fixture(scope="module", autouse=True)
def _forget_built():
    yield
    _BUILT.clear()


def _fp32_zero3():
    """(untrained state, step) of the shared fp32 ZeRO-3 program, compiled here with XLA's
    default fusion emitters by one step on a throwaway batch (later calls from any test
    reuse that program)."""
    if "zero3" not in _BUILT:
        state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=_SHARED_SEED),
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig(**_FP32))
        step = make_step(with_grads=True)
        with compat.xla_options(compat.cpu_fusion_emitter_options(True)):
            step(state, tokens(16, seed=60))
        _BUILT["zero3"] = (state, step)
    return _BUILT["zero3"]


def _qgz_always():
    """(untrained state, step) of the shared fp32 always-on qgZ program (compiled by its
    first run)."""
    if "qgz" not in _BUILT:
        state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=_SHARED_SEED),
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig(qgz=True, **_FP32))
        _BUILT["qgz"] = (state, make_step(with_grads=True))
    return _BUILT["qgz"]


@pytest.mark.parametrize("stages", [1, 2])
def test_lowered_step_has_two_hops_per_unit_and_stage(stages):
    nodes, local = 2, 4
    if stages == 1:  # the shared always-on qgZ step: its trace and lowering serve both tests
        state, step = _qgz_always()
    else:
        cfg = zpp.ZeroPPConfig(qgz=True, qgz_pipeline_stages=stages, **_FP32)
        state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=_SHARED_SEED),
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(nodes, local),
                                      config=cfg)
        step = make_step(with_grads=True)
    text = step.lower(state, tokens(16, seed=0)).as_text()
    ops = collectives(text)
    assert not [c for c in ops if c.kind == "reduce-scatter"]  # no bf16/fp32 one remains
    a2a = [([list(g) for g in c.groups], c.dtype) for c in ops if c.kind == "all-to-all"]
    intra = [(g, t) for g, t in a2a if all(len({d // local for d in grp}) == 1 for grp in g)]
    cross = [(g, t) for g, t in a2a if all(len({d % local for d in grp}) == 1 for grp in g)
             and (g, t) not in intra]
    assert len(intra) + len(cross) == len(a2a)
    units = len(state.engine.layouts) - 1  # the rest unit's rides in the first unit's
    # Per unit and stage, one all-to-all on each hop: the INT4 values (two per byte) and
    # their fp32 scales packed into one byte buffer (a collective has a fixed cost).
    for hop in (intra, cross):
        assert [t for _, t in hop] == ["ui8"] * units * stages


@pytest.mark.bitwise_programs
def test_qgz_until_switches_without_recompiling():
    """qgz_until=2 (0.5 of 4 planned steps): quantized for steps 0 and 1 only, by one
    compiled program; switched off (past qgz_until, or qgz_until=0 from the start: the
    same run-time switch) it is identical to ZeRO-3 over steps of training."""
    from zeropp_jax.comm.transports import gradient_transport

    batches = [tokens(16, seed=62 + i) for i in range(4)]

    def run(state, step, steps=4):
        grads = []
        for b in batches[:steps]:
            state, out = step(state, b)
            grads.append(state.engine.consolidate(out["grads"]))
        return grads

    fp32 = _FP32
    z3 = run(*_fp32_zero3())  # zpp.ZeroPPConfig(**fp32), the shared program
    always = run(*_qgz_always(), steps=1)  # only its step 0 is used
    half_cfg = zpp.ZeroPPConfig(qgz=True, qgz_until=0.5, planned_steps=4, **fp32)
    start = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=_SHARED_SEED),
                                  tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
                                  config=half_cfg)
    step = make_step(with_grads=True)
    half = run(start, step)
    # The same state and program with the step counter at 2, past qgz_until: every step
    # runs switched off (a separate qgz_until=0 program would be this one with 0 for 2:
    # the transport's switch is the only place the setting reaches, checked below), from
    # ZeRO-3's start. SGD reads no step counter, so only the switch sees it.
    late = start.replace(step=jax.device_put(np.int32(2), start.step.sharding))
    never = run(late, step)
    assert gradient_transport(zpp.ZeroPPConfig(qgz=True, qgz_until=0, **fp32)
                              ).switch_step() == 0
    assert gradient_transport(half_cfg).switch_step() == 2
    # Off, qgZ is its fallback reduce-scatter: the same sums in the same order, bit for bit
    # (as tests/comm/test_transports.py checks on the transport alone), at every step.
    for i in range(4):
        assert_leaves_equal(never[i], z3[i])
    assert step.jitted._cache_size() == 1
    for i in (0, 1):  # quantized: not the unquantized gradient, which would be exact
        assert any(not np.array_equal(a, b) for a, b in
                   zip(jax.tree_util.tree_leaves(half[i]), jax.tree_util.tree_leaves(z3[i])))
    # Step 0: the same quantization of the same gradient as always-on.
    assert_leaves_equal(half[0], always[0])


@pytest.mark.parametrize("nodes,local", MESHES)
def test_hierarchical_reduce_scatter_equals_psum_scatter(nodes, local):
    from zeropp_jax.comm.qgz import hierarchical_reduce_scatter

    num = nodes * local
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:num])
    x = np.random.default_rng(num).standard_normal((num, num * 24)).astype(np.float32)
    spec = P(AXES)
    xs = jax.device_put(jnp.asarray(x).reshape(-1), NamedSharding(mesh, spec))
    out = jax.jit(jax.shard_map(hierarchical_reduce_scatter, mesh=mesh, in_specs=spec,
                                out_specs=spec))(xs)
    exact = x.astype(np.float64).sum(axis=0)
    # fp32 sums of num fp32 terms, in any grouping (within nodes, then across): each of the
    # at most num - 1 additions on an element's path rounds by U32 of a partial sum, so the
    # error is at most gamma_{num-1} sum|x|, gamma_k = k U32 / (1 - k U32) < k U32 (1 + 1e-6)
    # (the textbook bound for any summation order). A slice sent to the wrong device is off
    # by the size of the sums.
    bound = (num - 1) * U32 * (1 + 1e-6) * np.abs(x.astype(np.float64)).sum(axis=0)
    assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound)
    assert np.max(bound) < 1e-3 * np.mean(np.abs(exact))


def test_hierarchical_reduce_scatter_in_the_step_moves_16_bit():
    cfg = zpp.ZeroPPConfig(reduce_scatter="hierarchical")  # bf16 compute
    state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(), tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 4), config=cfg)
    from zeropp_jax.measure.analysis import comm_report

    compiled = make_step().lower(state, tokens(16, seed=0)).compile()
    rows = comm_report(compiled, state.mesh).rows
    assert not [r for r in rows if r.kind == "reduce-scatter"]
    a2a = {r.dtype for r in rows if r.kind == "all-to-all"}
    assert a2a == {"u16"}, a2a
    # In float64 against the flat reduce-scatter (the parity tests' derived tolerance,
    # helpers.FLOAT64_RHO), at fresh parameters and batch.
    seed = fresh_seed()
    params, batch = as_float64(init_params(seed=seed)), tokens(16, seed=seed + 1)
    runs = []
    with float64_run():
        for rs in ("hierarchical", "flat"):
            st = zpp.TrainState.create(
                model=GPT(SMALL64), params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
                config=zpp.ZeroPPConfig(reduce_scatter=rs, **FLOAT64))
            _, out = make_step(with_grads=True)(st, batch)
            runs.append((out["loss"], st.engine.consolidate(out["grads"])))
    # Two gradients that sum the device shares in different groupings.
    with seed_on_failure(seed):
        assert_loss_and_grads_close(*runs[0], *runs[1], FLOAT64_RHO)


# Two meshes by default (nodes and local both > 1, the only case with two hops, in both
# orders of size); all five under `make test-all`.
@pytest.mark.parametrize("nodes,local", [m if m in ((2, 4), (3, 2)) else
                                         pytest.param(*m, marks=pytest.mark.slow)
                                         for m in MESHES])
def test_hierarchical_all_gather_is_bitwise_the_flat_one(nodes, local):
    """Two hops (node, then local, then a transpose) give the flat all-gather's buffer bit
    for bit: 16- and 32-bit data, and qwZ's values and scales."""
    from zeropp_jax.comm.collectives import all_gather_flat, qwz_all_gather

    num = nodes * local
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:num])
    x = np.random.default_rng(num).standard_normal(num * 128).astype(np.float32)
    xs = jax.device_put(x, NamedSharding(mesh, P(AXES)))

    def run(fn):
        return np.asarray(jax.jit(jax.shard_map(lambda s: fn(s)[None], mesh=mesh,
                                                in_specs=P(AXES), out_specs=P(AXES)))(xs))

    for dt in (jnp.bfloat16, jnp.float32):
        flat = run(lambda s: all_gather_flat(s.astype(dt), distinct=True))
        two = run(lambda s: all_gather_flat(s.astype(dt), distinct=True, hierarchical=True))
        np.testing.assert_array_equal(two, flat)
        np.testing.assert_array_equal(flat[-1], np.asarray(x.astype(dt)))  # the real gather
    kw = dict(block_size=64, bits=8)
    np.testing.assert_array_equal(run(lambda s: qwz_all_gather(s, hierarchical=True, **kw)),
                                  run(lambda s: qwz_all_gather(s, **kw)))


@pytest.mark.bitwise_programs
def test_hierarchical_all_gather_in_the_step_crosses_nodes_in_node_groups():
    """In the compiled step every weight all-gather spans one axis: node groups (one
    device per node) or local groups (one node); none spans all devices. fp32 gradients
    equal the flat gathers' exactly (the gathers move the same bits)."""
    from zeropp_jax.measure.analysis import comm_report

    mesh = zpp.make_mesh(2, 4)
    node_groups = {(0, 4), (1, 5), (2, 6), (3, 7)}
    local_groups = {(0, 1, 2, 3), (4, 5, 6, 7)}
    grads = []
    # The shared fp32 ZeRO-3 state's parameters: its step is the flat configuration's.
    params, batch = init_params(seed=_SHARED_SEED), tokens(16, seed=74)
    for ag, qwz in (("hierarchical", False), ("hierarchical", True), ("flat", False)):
        # block_size=32 as the shared program's (the same for all three: a block size
        # decides no gather's groups).
        cfg = zpp.ZeroPPConfig(all_gather=ag, qwz=qwz, **_FP32)
        if cfg == zpp.ZeroPPConfig(**_FP32):  # flat, no qwZ: the shared program
            st, step = _fp32_zero3()
        else:
            st = zpp.TrainState.create(model=GPT(SMALL), params=params,
                                       tx=optax.sgd(0.1), mesh=mesh, config=cfg)
            step = make_step(with_grads=True)
        # One program per configuration: the step that also returns the gradients is the
        # one inspected and the one run (the gradients leave it as sharded as they are
        # reduce-scattered, so returning them adds no gather). The qwZ program is only
        # inspected, not compared bit for bit: it compiles with the suite's elemental
        # emitter (tests/conftest.py), which decides how fusions are emitted, not which
        # collectives the program has.
        with compat.xla_options(compat.cpu_fusion_emitter_options(not qwz)):
            compiled = step.lower(st, batch).compile()
        rows = comm_report(compiled, mesh).rows
        gathers = [set(r.groups) for r in rows if r.kind == "all-gather"]
        assert gathers
        if ag == "hierarchical":
            assert all(g in (node_groups, local_groups) for g in gathers), gathers
            assert node_groups in gathers and local_groups in gathers
        else:
            assert {tuple(range(8))} in gathers
        if not qwz:
            _, out = compiled(st, st.engine.shard_batch(batch))
            grads.append(st.engine.consolidate(out["grads"]))
    for a, b in zip(jax.tree_util.tree_leaves(grads[0]), jax.tree_util.tree_leaves(grads[1])):
        np.testing.assert_array_equal(a, b)


def test_pallas_inside_shard_map_on_cpu_is_a_clear_error():
    """On CPU the kernels would run in Pallas interpret mode, which JAX 0.10 cannot trace
    inside shard_map; the error names the fix. (Kernels equal the references bit for bit
    outside shard_map: tests/quant/test_pallas_*.py; the shard_map'd GPU path is lowered for CUDA
    in tests/quant/test_gpu_lowering.py.)"""
    mesh = zpp.make_mesh(2, 4)
    x = np.ones((8, 8 * 64), np.float32)
    with pytest.raises(NotImplementedError, match="implementation='xla'"):
        _run(mesh, x, bits=4, block_size=16, implementation="pallas")


# ------------------------------------------------ Hadamard smoothing, stochastic rounding

U = 2.0**-24


def _hadamard_bound(x_dev: np.ndarray, nodes: int, local: int, bits: int, block: int,
                    signs) -> np.ndarray:
    """Per destination slice and block, an L2 bound on qgZ-with-rotation's error against the
    exact sum, derived hop by hop in the rotated domain (``[P, blocks per slice]``).

    The rotation is orthogonal up to ``eps = (1 + U)**(log2(B) + 2) - 1`` relative error
    per application (tests/quant/test_hadamard.py), so errors made on rotated blocks keep
    their L2 norm when rotated back. Each device's rotated block is quantized with its own
    scale ``s1``: error ``<= sqrt(B) s1 (1/2 + 2**-22 Q)`` in L2 (the elementwise bound of
    the quantizer, times sqrt(B)), after a rotation off by ``eps ||x||``. The node's fp32
    sum of L dequantized blocks rounds by ``gamma_{L-1}`` of the sum of their norms; the
    partial sum is requantized with its scale ``s2`` (``sqrt(B) s2 (1/2 + 2**-22 Q)``); the
    N partial sums are added (``gamma_{N-1}``) and rotated back (``eps`` of the result).
    Products of these small terms are covered by the 1e-6."""
    num = nodes * local
    m = x_dev.shape[1] // num
    m_pad = -(-m // block) * block
    slices = np.zeros((num, num, m_pad), np.float32)  # [source device, destination, element]
    slices[:, :, :m] = x_dev.reshape(num, num, m)
    qm, root = 2 ** (bits - 1) - 1, np.sqrt(block)
    eps = (1 + U) ** (block.bit_length() + 1) - 1
    gamma = lambda k: k * U / (1 - k * U)  # noqa: E731
    kw = dict(bits=bits, block=block)

    def norms(v):
        return np.linalg.norm(np.asarray(v, np.float64).reshape(-1, block), axis=1)

    bound = np.zeros((num, m_pad // block))
    for d in range(num):
        final = np.zeros(m_pad)
        partial_norms = np.zeros(m_pad // block)
        for a in range(nodes):
            deqs = []
            for l in range(local):
                x = jnp.asarray(slices[a * local + l, d])
                deq, s1 = _q_dq_program(x, signs, **kw)
                deqs.append(deq)  # rotated
                bound[d] += root * np.asarray(s1) * (0.5 + 2.0**-22 * qm) + eps * norms(x)
            partial = functools.reduce(lambda p, q: p + q, deqs)
            bound[d] += gamma(local - 1) * sum(norms(q) for q in deqs)
            if nodes > 1 and local > 1:  # the middle requantization
                partial, s2 = _q_dq_program(partial, **kw)
                bound[d] += root * np.asarray(s2) * (0.5 + 2.0**-22 * qm)
            partial_norms += norms(partial)
            final = final + np.asarray(partial, np.float64)
        bound[d] += gamma(nodes - 1) * partial_norms + eps * norms(final)
    return bound * (1 + 1e-6)


def _hadamard_ratios(mesh_shape, bits, seed):
    """The body of ``test_hadamard_placement_and_error_bound`` on the inputs drawn from
    ``seed``: asserts, and returns ``(max err / bound, max bound / max block norm)``."""
    from zeropp_jax.quant.rotation import hadamard_signs

    nodes, local = mesh_shape
    num, m, block = nodes * local, 96, 32
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:num])
    rng = np.random.default_rng(seed)
    x = (rng.standard_t(2, size=(num, num * m))
         * 10.0 ** rng.uniform(-2, 1, size=(num, 1))).astype(np.float32)
    exact = x.astype(np.float64).sum(axis=0).reshape(num, m)
    single = "quantize" if nodes == 1 else "reduce_scatter"  # one node: the quantized hop
    out = _run(mesh, x, bits=bits, block_size=block, hadamard=True, single_node=single)
    err = np.linalg.norm((out - exact).reshape(num, -1, block), axis=2)
    bound = _hadamard_bound(x, nodes, local, bits, block, hadamard_signs(None, block))
    assert np.all(err <= bound), (seed, float(np.max(err / bound)))
    # Reached to a good fraction (over 30 fresh seeds of each case at least 0.26). How small
    # the bound is against the sums depends on how the heavy-tailed devices' blocks cancel
    # (a check that it stays under half the largest block failed on seed 880602913 at 0.56:
    # an observation, not a bound); that the bound is informative is proven instead by
    # test_hadamard_beats_plain_qgz_on_outlier_blocks, where it lies below the plain path's
    # provable error on every draw.
    assert np.max(err / bound) > 0.1, (seed, float(np.max(err / bound)))
    rolled = np.linalg.norm((np.roll(out, 1, axis=0) - exact).reshape(num, -1, block), axis=2)
    assert np.any(rolled > bound), seed  # slices on the wrong devices would be caught
    sums = np.max(np.linalg.norm(exact.reshape(num, -1, block), axis=2))
    return float(np.max(err / bound)), float(np.max(bound) / sums)


@pytest.mark.parametrize("mesh_shape,bits", [((2, 4), 4), ((3, 2), 8), ((1, 4), 4)])
def test_hadamard_placement_and_error_bound(mesh_shape, bits):
    """With the rotation: ``psum_scatter``'s placement, each block within the hop-by-hop L2
    bound from its rotated scales, the bound not vacuous (reached to a good fraction,
    small against the sums). What the rotation is for, a smaller error than without it on
    blocks with an outlier, is test_hadamard_beats_plain_qgz_on_outlier_blocks."""
    _hadamard_ratios(mesh_shape, bits, seed=fresh_seed())  # fresh inputs


def _outlier_blocks(rng, rows: int, n: int, block: int, qm: int) -> np.ndarray:
    """``[rows, n]`` fp32, per block of ``block``: one outlier ``M`` (random sign and
    position, ``|M|`` in [1e-2, 10]) and the other elements ``+-U(0.3, 0.4) |M| / qm``, below
    half the block's INT scale ``|M| / qm``: the quantizer rounds them all to 0."""
    shape = (rows, n // block, block)
    big = rng.choice([-1.0, 1.0], (rows, n // block, 1)) * 10.0 ** rng.uniform(
        -2, 1, (rows, n // block, 1))
    x = rng.choice([-1.0, 1.0], shape) * rng.uniform(0.3, 0.4, shape) * np.abs(big) / qm
    at = rng.integers(0, block, (rows, n // block))
    np.put_along_axis(x, at[..., None], big, axis=2)
    return x.reshape(rows, n).astype(np.float32)


def test_hadamard_beats_plain_qgz_on_outlier_blocks():
    """On blocks of one outlier and small elements (one device's gradient, the others zero;
    one node, so one quantized hop): without the rotation every small element rounds to 0,
    an error of at least ``||small|| >= 0.3 sqrt(B - 1) |M| / qm`` per block. With it the
    rotated block's elements are at most ``(|M| + (B - 1) 0.4 |M| / qm) / sqrt(B)``, so its
    error bound (``_hadamard_bound``, one hop: ``sqrt(B) s / 2``, s = that / qm) is at most
    ``(1 + 0.4 (B - 1) / qm) |M| / (2 qm)``: 1.39 |M| / qm at B = 32, INT4, against 1.67
    |M| / qm without. So on every draw: rotated error <= its bound < the plain path's
    lower bound <= its error. (The (1, 4) INT4 programs of the test above.)"""
    from zeropp_jax.quant.rotation import hadamard_signs

    seed = fresh_seed()  # fresh inputs
    nodes, local, m, block, bits, qm = 1, 4, 96, 32, 4, 7
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:local])
    x = np.zeros((local, local * m), np.float32)
    x[0] = _outlier_blocks(np.random.default_rng(seed), 1, local * m, block, qm)[0]
    exact = x.astype(np.float64).sum(axis=0).reshape(local, -1, block)
    run = functools.partial(_run, mesh, x, bits=bits, block_size=block, single_node="quantize")
    rotated = np.linalg.norm(run(hadamard=True).reshape(local, -1, block) - exact, axis=2)
    plain = np.linalg.norm(run().reshape(local, -1, block) - exact, axis=2)
    # What rounds to 0 without the rotation: every element but the block's largest.
    small = np.sort(np.abs(exact), axis=2)[..., :-1]
    lower = np.linalg.norm(small, axis=2)
    bound = _hadamard_bound(x, nodes, local, bits, block, hadamard_signs(None, block))
    assert np.all(rotated <= bound), (seed, float(np.max(rotated / bound)))
    assert np.all(bound < lower), (seed, float(np.max(bound / lower)))
    # (equal where the outlier comes back exactly: float64 norms, summed in other orders)
    assert np.all(lower <= plain * (1 + 1e-12)), (seed, float(np.max(lower / plain)))


@pytest.mark.bitwise_programs
def test_hadamard_stages_are_bitwise_identical_and_the_block_is_checked():
    """Through the documented path ``zeropp_jax.collectives.qgz_reduce_scatter``, with a
    caller's key: stage counts quantize the same rotated blocks (bit-identical results);
    the key picks the signs (another key, other bits); a block that is no power of 2 is
    refused, naming one that is."""
    mesh = zpp.make_mesh(2, 4)
    x = np.random.default_rng(8).standard_normal((8, 8 * 4 * 32)).astype(np.float32)
    spec = P(AXES)
    xs = jax.device_put(jnp.asarray(x).reshape(-1), NamedSharding(mesh, spec))

    @functools.lru_cache(maxsize=None)  # one program per stage count (the key is an input)
    def program(stages):
        return jax.jit(jax.shard_map(
            lambda v, k: zpp.collectives.qgz_reduce_scatter(
                v, bits=4, block_size=32, stages=stages, hadamard=True, key=k[0]),
            mesh=mesh, in_specs=(spec, P()), out_specs=spec))

    def run(stages, key):
        return np.asarray(program(stages)(xs, jax.random.key(key)[None]))

    one = run(1, key=5)
    np.testing.assert_array_equal(run(4, key=5), one)
    assert not np.array_equal(run(1, key=6), one)
    with pytest.raises(ValueError, match="power of 2.*use e.g."):
        _run(mesh, np.ones((8, 8 * 96), np.float32), bits=4, block_size=96, hadamard=True)


def test_stochastic_rounding_is_seeded_and_averages_out():
    """With stochastic rounding (and the rotation): the same key gives the same result, other
    keys others; with no key the gradient seeds the dither. Averaged over K keys the error
    shrinks like 1/sqrt(K) (each rounding is unbiased, so the mean converges to the exact
    sum), where rounding to nearest, deterministic, would keep its error: at K = 16 the
    expected ratio is 1/4, asserted below 1/2."""
    mesh = zpp.make_mesh(2, 4)
    seed = fresh_seed()  # fresh inputs each run
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, size=(8, 8 * 64)).astype(np.float32)
    exact = x.astype(np.float64).sum(axis=0).reshape(8, -1)
    spec = P(AXES)
    fn = jax.jit(jax.shard_map(
        lambda v, k: qgz_reduce_scatter(v, bits=4, block_size=32, hadamard=True,
                                        stochastic_rounding=True, key=k[0]),
        mesh=mesh, in_specs=(spec, P()), out_specs=spec))
    xs = jax.device_put(jnp.asarray(x).reshape(-1), NamedSharding(mesh, spec))

    def run(seed):
        return np.asarray(fn(xs, jax.random.key(seed)[None]), np.float64).reshape(8, -1)

    draws = np.stack([run(k) for k in range(16)])
    np.testing.assert_array_equal(run(0), draws[0])
    assert not np.array_equal(draws[0], draws[1]), seed
    single = np.sqrt(np.mean((draws - exact) ** 2))
    averaged = np.sqrt(np.mean((draws.mean(axis=0) - exact) ** 2))
    assert averaged < 0.5 * single, (seed, averaged / single)
    keyless = _runner(mesh, bits=4, block_size=32, stochastic_rounding=True)  # one program
    no_key = keyless(x)
    np.testing.assert_array_equal(no_key, keyless(x))
    x2 = x.copy()
    x2[0, 0] += 1.0
    other = keyless(x2)
    assert np.mean(other != no_key) > 0.1, seed  # a new gradient: a new dither everywhere


@pytest.mark.parametrize("options", [
    dict(bits=4, stages=1),
    dict(bits=8, stages=2, hadamard=True, stochastic_rounding=True),
])
def test_three_phases_compute_the_reduce_scatter_bit_for_bit(options):
    """``qgz_quantize`` -> ``qgz_hop_local`` -> ``qgz_hop_nodes`` (run apart by
    ``qgz_defer``) give ``qgz_reduce_scatter``'s result, bit for bit, on fresh gradients."""
    from zeropp_jax.comm.qgz import qgz_hop_local, qgz_hop_nodes, qgz_quantize

    seed = fresh_seed()
    mesh = zpp.make_mesh(2, 4)
    x = np.random.default_rng(seed).standard_normal((8, 4096)).astype(np.float32)
    kw = dict(block_size=64, key=jax.random.key(seed % 2**31), **options)

    def both(x):
        x = x[0]
        phased = qgz_hop_nodes(qgz_hop_local(qgz_quantize(x, **kw), **kw), x.shape[0], **kw)
        return qgz_reduce_scatter(x, **kw)[None], phased[None]

    f = jax.jit(jax.shard_map(both, mesh=mesh, in_specs=P(("node", "local")),
                              out_specs=(P(("node", "local")), P(("node", "local"))),
                              check_vma=False))
    whole, phased = f(x)
    with seed_on_failure(seed):
        np.testing.assert_array_equal(np.asarray(phased), np.asarray(whole))
