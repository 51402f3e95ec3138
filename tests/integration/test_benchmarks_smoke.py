"""Smoke tests of benchmarks/overhead.py and benchmarks/gpu_check.py on the CPU.

The fast ones (a few seconds): gpu_check's no-GPU exit, one case of each Pallas kernel
through gpu_check's own case machinery (interpret mode), its bit comparison and markdown,
and overhead's matmul counter and remat GPT. End-to-end runs of both scripts are ``slow``.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import gpu_check, overhead
from helpers import fresh_seed, seed_on_failure

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_gpu_check_without_a_gpu_says_so_and_exits_2(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "gpu-check: no GPU found (platform: cpu)" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list(tmp_path.iterdir())  # nothing measured, nothing written


@pytest.mark.parametrize("case", [
    dict(kernel="quantize+dequantize", bits=4, dtype="bfloat16", block_size=32, blocks=5),
    dict(kernel="reorder_quantize", bits=8, dtype="float16", block_size=32, blocks=3,
         nodes=2, local=2, stages=2, stage=1),
    dict(kernel="dequantize_reduce(+requantize)", bits=4, out_bits=8, dtype="float32",
         block_size=32, blocks=5, groups=3),
])
def test_gpu_check_kernel_cases_are_bit_exact_in_interpret_mode(case):
    make_inputs, kernel, reference, names = gpu_check._case_fns(case, interpret=True)
    args = make_inputs(np.random.default_rng(0))
    got, want = jax.jit(lambda *a: (kernel(*a), reference(*a)))(*args)
    assert len(got) == len(want) == len(names)
    assert {n: gpu_check.bit_mismatches(a, e) for n, a, e in zip(names, got, want)} == {
        n: 0 for n in names}


def test_gpu_check_bit_mismatches_counts_bits_and_nan_positions():
    x = np.array([1.0, -0.0, np.nan, 2.0], np.float32)
    assert gpu_check.bit_mismatches(x, x.copy()) == 0
    assert gpu_check.bit_mismatches(x, np.array([1.0, 0.0, np.nan, 2.0], np.float32)) == 1
    assert gpu_check.bit_mismatches(x, np.array([1.0, -0.0, 3.0, 2.0], np.float32)) == 1
    assert gpu_check.bit_mismatches(x.astype(jnp.bfloat16), x.astype(jnp.bfloat16)) == 0
    assert gpu_check.bit_mismatches(x, x.astype(np.float16)) == -1  # dtype differs
    assert gpu_check.bit_mismatches(np.int8([1, 2]), np.int8([1, 3])) == 1


def test_gpu_check_markdown_survives_errors_and_skips():
    md = gpu_check.markdown({
        "versions": {"error": "boom"},
        "kernels": {"cases": [dict(kernel="quantize+dequantize", bits=8, dtype="float32",
                                   ok=False)], "passed": 0, "total": 1},
        "bandwidth": {"skipped": True},
        "train_step": {"error": "RuntimeError: out of memory"},
    })
    assert "0/1 FAIL" in md and "skipped (--skip-bandwidth)" in md and "out of memory" in md


def test_overhead_counts_matmul_instructions_not_metadata():
    f = jax.jit(lambda a, b: jnp.tanh(a @ b) @ b)
    text = f.lower(jnp.ones((8, 8)), jnp.ones((8, 8))).compile().as_text()
    assert overhead.count_matmuls(text)["dot"] == 2  # dot_general appears only in metadata
    gemm = ('%c = (f32[8,8], s8[0]) custom-call(%a, %b), custom_call_target="__cublas$gemm", '
            'metadata={op_name="jit(f)/dot_general"}')
    assert overhead.count_matmuls(gemm) == {"dot": 0, "gemm_custom_call": 1, "total": 1}


def test_overhead_remat_gpt_has_gpt_params_and_loss():
    from zeropp_demo.gpt import GPT, GPTConfig

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    cfg = GPTConfig(vocab_size=32, seq_len=8, layers=2, d_model=16, heads=2)
    tokens = jnp.asarray(rng.integers(0, 32, (2, 8)), jnp.int32)
    model, remat = GPT(cfg), overhead.remat_gpt_class()(cfg)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens)["params"]
    remat_params = jax.eval_shape(remat.init, jax.random.PRNGKey(0), tokens)["params"]
    assert jax.tree_util.tree_structure(remat_params) == jax.tree_util.tree_structure(params)
    params = jax.tree_util.tree_map(  # random values: no need to run init
        lambda s: jnp.asarray(rng.normal(size=s.shape), s.dtype), params)

    def losses(p, x):  # both models in one program: one compile
        return model.apply({"params": p}, x), remat.apply({"params": p}, x)

    plain_out, remat_out = jax.jit(losses)(params, tokens)
    # Bit for bit: the same operations on the same inputs. RematGPT mirrors GPT.__call__
    # op for op, and a forward that is not differentiated lowers jax.checkpoint to its
    # body inlined (no optimization barrier: those guard only the recomputation in a
    # backward), so the two halves of the program are the same ops.
    with seed_on_failure(seed):
        np.testing.assert_array_equal(remat_out, plain_out)


@pytest.mark.slow
def test_overhead_runs_end_to_end(tmp_path):
    res = overhead.main(["--layers", "1", "--d-model", "16", "--heads", "2", "--seq-len", "8",
                         "--batch", "2", "--rounds", "2", "--steps-per-round", "1",
                         "--out", str(tmp_path), "--name", "tiny"])
    assert set(res["variants"]) == set(overhead.VARIANTS)
    assert json.loads((tmp_path / "tiny.json").read_text())["targets"]
    # No recomputed matmul with remat="minimal"; full remat reruns the blocks' forward.
    v = res["variants"]
    assert v["zero3_minimal"]["matmuls"]["total"] == v["plain"]["matmuls"]["total"]
    assert v["zero3_full"]["matmuls"]["total"] > v["zero3_minimal"]["matmuls"]["total"]


@pytest.mark.slow
def test_gpu_check_cpu_dry_run(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"),
                           "--allow-cpu", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["failures"] == [] and data["kernels"]["passed"] == data["kernels"]["total"]
    md = (tmp_path / "gpu_check.md").read_text().splitlines()
    assert sum(line.startswith("|---") for line in md) == 3  # the (a), (b) and (c) tables


def test_gpu_calibrate_joins_profiled_kernels_to_priced_instructions():
    """benchmarks/gpu_cluster/calibrate.py's join of a profile to the replay's prices, on a
    hand-written program: kernels by instruction name (per step over the profiled steps),
    a kernel whose name is no instruction's (an asynchronous fusion's) by its name's class,
    every priced instruction listed, and the ratios of the sums."""
    from benchmarks.gpu_cluster.calibrate import compare
    from zeropp_jax.measure.schedule import Roofline, compute_by_instruction

    text = """HloModule m, is_scheduled=true

%fused_mul (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%p0, %p0)
}

ENTRY %main (a: f32[1024]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %f = f32[1024]{0} fusion(%a), kind=kLoop, calls=%fused_mul
  ROOT %out = f32[1024]{0} copy(%f)
}
"""
    roof = Roofline({"bf16": 2.0**20}, 8192.0)
    priced = compute_by_instruction(text, roof)
    assert {k: v[0] for k, v in priced.items()} == {"f": "elementwise",
                                                     "out": "copies and layout"}
    # Two profiled steps: f took 3x its price, out 2x, and an unnamed slice fusion 0.5 s.
    measured = {"seconds": {"f": 2 * 3 * priced["f"][1], "out": 2 * 2 * priced["out"][1],
                            "loop_dynamic_slice_fusion.7": 1.0},
                "runs": {"f": 2, "out": 2, "loop_dynamic_slice_fusion.7": 2}}
    got = compare(text, measured, 2, roof, top=5)
    e, c = got["by_class"]["elementwise"], got["by_class"]["copies and layout"]
    assert e["ratio"] == pytest.approx(3.0, rel=1e-12)
    assert c["unnamed_ms"] == pytest.approx(500.0, rel=1e-12)
    assert c["measured_ms"] == pytest.approx(2e3 * priced["out"][1] + 500.0, rel=1e-12)
    assert got["priced_ms"] == pytest.approx(1e3 * (priced["f"][1] + priced["out"][1]))
    assert got["measured_kernels_ms"] == pytest.approx(
        1e3 * (3 * priced["f"][1] + 2 * priced["out"][1]) + 500.0, rel=1e-12)
    assert {r["instruction"] for r in got["rows"]} == {"f", "out"}
    assert all(r["measured_runs"] == 1.0 for r in got["rows"])


@pytest.mark.slow
def test_gpu_calibrate_cpu_dry_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_cluster.calibrate", "--allow-cpu", "--model",
         "tiny", "--seq", "64", "--steps", "2", "--profile-steps", "1", "--configs", "plain",
         "zero3", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "gpu_calibrate.json").read_text())
    for run in data["runs"]:
        v = run["vs_roofline"]
        # On the CPU every kernel appears in the profile under its instruction's name.
        assert v["instructions_measured"] >= 0.95 * v["instructions_priced"], v
        assert v["priced_ms"] > 0 and v["measured_kernels_ms"] > 0
    assert (tmp_path / "gpu_calibrate_zero3.hlo.gz").exists()


def test_qgz_hops_transport_matches_qgz_and_bounds_each_hop():
    """benchmarks/qgz_hops.py (the hop-selective qgZ behind benchmarks/qgz_gap.py) on a 2x4
    mesh: with both hops INT4 it is the library's qgZ bit for bit; with neither
    hop quantized its only error is the bf16 rounding of the node partial sums; with only
    the cross-node hop quantized its error is within that hop's INT4 rounding bound, and it
    is the library's ``qgz_hops="cross"`` bit for bit."""
    
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeropp_jax as zpp
    from benchmarks.qgz_hops import hop_reduce_scatter
    from zeropp_jax.comm.qgz import qgz_reduce_scatter

    nodes, local, block = 2, 4, 256
    num = nodes * local
    mesh = zpp.make_mesh(nodes, local)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n = num * block * 2
    x = rng.standard_t(3, size=(num, n)).astype(np.float32)  # heavy tails, as gradients
    x = np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # exactly bf16
    xs = jax.device_put(jnp.asarray(x, jnp.bfloat16), NamedSharding(mesh, P(("node", "local"))))

    def run(f):
        return np.asarray(jax.jit(jax.shard_map(lambda v: f(v[0]), mesh=mesh,
                                                in_specs=P(("node", "local")),
                                                out_specs=P(("node", "local"))))(xs))

    got = run(lambda v: hop_reduce_scatter(v, hop1_bits=4, hop2_bits=4))
    want = run(lambda v: qgz_reduce_scatter(v))
    assert np.array_equal(got, want), f"seed {seed}: INT4 on both hops is not qgZ"
    exact = x.astype(np.float64).sum(0)
    partial = x.astype(np.float64).reshape(nodes, local, n).sum(1)  # [nodes, n]
    # No quantization: each node's fp32 partial sum rounded to bf16 once (relative 2**-8),
    # then an fp32 sum (2**-24 per add, a few adds).
    err = np.abs(run(lambda v: hop_reduce_scatter(v, hop1_bits=None, hop2_bits=None)) - exact)
    bound = 2.0 ** -8 * np.abs(partial).sum(0) + 2.0 ** -20 * np.abs(x).sum(0)
    assert np.all(err <= bound), f"seed {seed}: {np.max(err / bound):.3f} of the bf16 bound"
    # Cross-node hop only, INT4: each node's partial sums quantized in blocks of 256 along
    # each destination slice, round to nearest: at most absmax/7/2 per element and node
    # (pallas_kernels/quantize.py; 1e-5 for its fp32 rounding), plus the fp32 sums.
    err = np.abs(run(lambda v: hop_reduce_scatter(v, hop1_bits=None, hop2_bits=4)) - exact)
    absmax = np.abs(partial).reshape(nodes, -1, block).max(-1, keepdims=True)
    q_bound = np.broadcast_to(absmax / 14, (nodes, n // block, block)).reshape(nodes, n).sum(0)
    bound = q_bound * (1 + 1e-5) + 2.0 ** -20 * np.abs(x).sum(0)
    assert np.all(err <= bound), f"seed {seed}: {np.max(err / bound):.3f} of the INT4 bound"
    assert np.max(err / bound) > 0.1, f"seed {seed}: no INT4 error at all (hop not quantized?)"
    # ... and it is the library's cross-node-only qgZ (``qgz_hops="cross"``) bit for bit.
    assert np.array_equal(run(lambda v: hop_reduce_scatter(v, hop1_bits=None, hop2_bits=4)),
                          run(lambda v: qgz_reduce_scatter(v, hops="cross"))), f"seed {seed}"


def test_gspmd_fsdp_peer_splits_each_weight_once_and_never_the_layer_axis():
    """The gpu-cluster benchmark's peer (benchmarks/gpu_cluster/run.py, config gspmd_fsdp):
    each array split over both data axes along its largest dimension the device count
    divides, a scanned stack's layer axis never, an array with no such dimension whole; and
    the count of pipelined collectives read from a compiled program's text."""
    from jax.sharding import PartitionSpec as P

    from benchmarks.gpu_cluster.run import _fsdp_spec, pipelined_collectives
    from zeropp_jax.core.mesh import AXES

    assert _fsdp_spec((32000, 4096), 128, stacked=False) == P(AXES, None)
    assert _fsdp_spec((32, 4096, 11008), 32, stacked=True) == P(None, None, AXES)
    # Only the leading axis divisible: split unless it is a scanned stack's layer axis.
    assert _fsdp_spec((64, 32, 48), 64, stacked=True) == P()
    assert _fsdp_spec((64, 32, 48), 64, stacked=False) == P(AXES, None, None)
    assert _fsdp_spec((32, 4096), 128, stacked=True) == P(None, AXES)
    assert _fsdp_spec((4096,), 3, stacked=False) == P()  # a norm scale 3 does not divide
    line = ('%ag = all-gather-start(%p), backend_config={"collective_backend_config":'
            '{"is_sync":false,"is_pipelined":true}}')
    assert pipelined_collectives("\n".join([line, line.replace("true}", "false}")])) == 1
