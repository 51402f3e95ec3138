"""GPU check (issue 15, item 3): the Pallas kernels on a real GPU, and a one-GPU train step.

    make gpu-check                              # = python benchmarks/gpu_check.py
    python3 benchmarks/gpu_check.py             # from the repository root, no install needed
    python3 benchmarks/gpu_check.py --quick     # small sizes and a small GPT (smoke test)

About 4-6 minutes on one H100 (mostly compiling). Sections:

(a) correctness: every Pallas kernel in ``pallas_kernels/`` (quantize + dequantize,
    the qgZ reorder + quantize, dequantize + reduce, dequantize + reduce + requantize; each
    also with its options on: the Hadamard rotation and stochastic rounding),
    compiled for the GPU (``interpret=False``), bit for bit (NaN positions equal, every
    other bit pattern equal) against its jnp reference as written: IEEE fp32 arithmetic,
    which XLA CPU keeps, so the reference runs on the host CPU. The same jnp code compiled
    by XLA for the GPU is compared too and its differences reported (not a failure): for
    bf16/fp16 inputs XLA's GPU fusion rounds a few half-way quotients the other way. INT8 and INT4; fp32, bf16 and fp16 inputs;
    block counts that are and are not powers of 2 or multiples of a program's tile; blocks
    of zeros, inf and NaN.
(b) bandwidth: each kernel and XLA's compiled jnp reference of the same op on 64M and 256M
    elements: achieved bandwidth = (bytes read + bytes written) / median time, as a
    fraction of a device copy of the same bytes (``jit(lambda x: x + 1)`` on a uint32
    array of half those bytes: one read and one write of every byte, which XLA cannot
    elide). Target: >= 80% of the copy. Where XLA's reference is as fast or faster, it says
    so: then XLA, not Pallas, should be the default implementation on GPU.
(c) one-GPU train step of a ~125M-class GPT (12 layers, d_model 768, 12 heads, seq 1024,
    vocab 50304, untied head: 163M parameters; batch 8; bf16 compute, fp32 parameters,
    AdamW): plain ``jax.jit``, zeropp_jax ZeRO-3 on a 1x1 mesh with ``remat="minimal"`` and
    ``"full"``, and ZeRO++ (``ZeroPPConfig.zeropp``, ``quantization_impl="pallas"``: on one
    device qwZ still quantizes and dequantizes every weight, hpZ's secondary is the
    device's own, qgZ falls back to a plain reduce-scatter). Same model object, same data:
    the plain step computes in bf16 through ``GPTConfig.dtype`` (Flax casts the fp32 params
    at each matmul); ZeRO-3 gathers bf16 weights and runs the same model. Tokens/s, model
    FLOPs utilisation (6 x parameters x tokens / time / peak dense bf16), ratio to plain
    (target: ZeRO-3 minimal <= 1.10x), matmuls in the compiled program, temp memory.
(d) versions: jax, jaxlib, CUDA plugin packages, the device, driver and CUDA (nvidia-smi).

Every section records its own errors and the run goes on; the exit status is 1 if any
kernel mismatched or any section failed, 2 if there is no GPU, else 0 (performance targets
are reported, not enforced). Writes ``--out/--name.json`` and ``--name.md`` (the markdown
tables, also printed at the end). ``--allow-cpu`` runs everything on the CPU instead (kernels
in Pallas interpret mode, tiny sizes): a dry run for debugging the script itself.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback

# Runs from the repository root without installation: zeropp_jax and pallas_kernels live here.
ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.cli import add_out_argument  # noqa: E402

# Results go to --out: by default benchmarks/out/ (git-ignored). The tracked copies in

PEAK_BF16 = (  # dense bf16 FLOP/s per device, matched in order against device_kind
    ("H200", 989e12),
    ("GH200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("A100", 312e12),
)
BANDWIDTH_TARGET = 0.80
STEP_TARGET = 1.10  # zero3_minimal / plain
PACKAGES = ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda13-pjrt", "jax-cuda12-plugin",
            "jax-cuda12-pjrt", "flax", "optax", "orbax-checkpoint", "numpy")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="small sizes, few iterations, a small GPT (a smoke test, ~1 minute)")
    p.add_argument("--skip-step", action="store_true", help="skip (c), the train step")
    p.add_argument("--skip-bandwidth", action="store_true", help="skip (b), the bandwidth")
    p.add_argument("--allow-cpu", action="store_true",
                   help="without a GPU, run on the CPU (kernels in interpret mode, tiny sizes): "
                        "checks the script, measures nothing meaningful")
    p.add_argument("--batch", type=int, default=8, help="(c) GPT batch (default 8)")
    add_out_argument(p)
    p.add_argument("--name", default="gpu_check", help="output file names (without suffix)")
    return p.parse_args(argv)


# ------------------------------------------------------------------------------ plumbing


class Report:
    """Results and failures of the whole run."""

    def __init__(self) -> None:
        self.data: dict = {}
        self.failures: list[str] = []

    def section(self, key: str, title: str, fn, *a, **kw) -> None:
        """Runs one section; an exception is recorded (JSON and failures) and the run goes on."""
        print(f"\n== {title}", flush=True)
        t0 = time.perf_counter()
        try:
            self.data[key] = fn(*a, **kw)
        except Exception as e:  # noqa: BLE001 -- a check records every failure and goes on
            tb = traceback.format_exc()
            print(tb, file=sys.stderr, flush=True)
            self.data[key] = {"error": f"{type(e).__name__}: {e}", "traceback": tb}
            self.failures.append(f"section {key}: {type(e).__name__}: {e}")
        self.data.setdefault("seconds", {})[key] = time.perf_counter() - t0
        print(f"   ({key}: {time.perf_counter() - t0:.0f} s)", flush=True)


def _short(e: BaseException) -> str:
    s = f"{type(e).__name__}: {e}"
    return s if len(s) < 300 else s[:297] + "..."


def no_gpu_exit(platform_name: str) -> None:
    print(f"gpu-check: no GPU found (platform: {platform_name}); run it on a machine with an "
          "NVIDIA GPU", file=sys.stderr)
    sys.exit(2)


def find_device(allow_cpu: bool):
    """The device to check: the first GPU, or (``allow_cpu``) the first CPU. Exits 2 without."""
    try:
        import jax
    except ImportError as e:
        print(f"gpu-check: cannot import jax ({e}); install jax with CUDA support",
              file=sys.stderr)
        sys.exit(2)
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if gpus:
        return gpus[0]
    default = jax.devices()[0].platform
    if allow_cpu:
        print(f"gpu-check: no GPU (platform: {default}); --allow-cpu: a CPU dry run, kernels "
              "in interpret mode, nothing measured is meaningful", flush=True)
        return jax.devices("cpu")[0]
    no_gpu_exit(default)


# --------------------------------------------------------------------------- (d) versions


def versions(device) -> dict:
    import importlib.metadata as md

    import jax

    out: dict = {"python": platform.python_version(), "jax": jax.__version__, "packages": {}}
    for name in PACKAGES:
        try:
            out["packages"][name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    out["device_kind"] = device.device_kind
    out["platform"] = device.platform
    out["device_count"] = len(jax.devices(device.platform))
    try:
        from jax.extend import backend as jeb

        out["platform_version"] = jeb.get_backend(device.platform).platform_version
    except Exception as e:  # noqa: BLE001 -- optional information
        out["platform_version"] = f"n/a ({_short(e)})"
    try:
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                            "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = q.stdout.strip().splitlines()
        head = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30).stdout
        m = re.search(r"CUDA Version:\s*([\d.]+)", head)
        out["cuda_driver_api"] = m.group(1) if m else None
    except (OSError, subprocess.SubprocessError) as e:
        out["nvidia_smi"] = f"n/a ({_short(e)})"
    for k in ("python", "jax", "device_kind", "platform_version"):
        print(f"   {k}: {out[k]}")
    print(f"   packages: {out['packages']}")
    print(f"   nvidia-smi: {out.get('nvidia_smi')} (CUDA {out.get('cuda_driver_api')})")
    return out


# -------------------------------------------------------------------------- (a) kernels


def _sample(rng, nb: int, block_size: int, dtype, *, specials: bool = True):
    """Heavy-tailed ``[nb * block_size]`` host data (Student-t, df 2, clipped to 1e3 so fp16
    stays finite), blocks scaled 1e-3..1e1 apart; with ``specials`` and >= 4 blocks, block 1
    is all zeros, block 2 holds an inf and block 3 a NaN (contract: NaN scale, NaN block)."""
    import jax.numpy as jnp
    import numpy as np

    t = np.clip(rng.standard_t(df=2, size=(nb, block_size)), -1e3, 1e3)
    x = (t * 10.0 ** rng.uniform(-3.0, 1.0, size=(nb, 1))).astype(np.float32)
    if specials and nb >= 4:
        x[1] = 0.0
        x[2, block_size // 3] = np.inf
        x[3, block_size // 2] = np.nan
    return x.reshape(-1).astype(jnp.dtype(dtype))  # numpy casts fp32 -> bf16 / fp16 exactly


def bit_mismatches(actual, expected) -> int:
    """Elements whose bits differ (NaN positions must match; NaN payloads may differ)."""
    import numpy as np

    a, e = np.asarray(actual), np.asarray(expected)
    if a.dtype != e.dtype or a.shape != e.shape:
        return -1
    if np.issubdtype(a.dtype, np.integer):
        return int(np.sum(a != e))
    a32, e32 = a.astype(np.float32), e.astype(np.float32)
    nan_a, nan_e = np.isnan(a32), np.isnan(e32)
    uint = np.dtype(f"uint{8 * a.dtype.itemsize}")
    diff = (a.view(uint) != e.view(uint)) & ~(nan_a & nan_e)
    return int(np.sum(diff | (nan_a != nan_e)))


def kernel_cases(quick: bool, on_gpu: bool) -> list[dict]:
    """The (a) cases. Blocks per program is 8 (quantize.py) and tiles of the qgZ kernels take
    min(8, largest power of 2 <= count) blocks: counts 1, 3, 13, 1000, 4099 cover one
    partial tile, several with a padded or overlapping last one, and exact ones."""
    big = not quick and on_gpu
    sizes = [(256, 1), (256, 13), (64, 3), (128, 1000)] + ([(256, 4099)] if big else [])
    if not on_gpu:  # interpret mode is slow: keep the CPU dry run tiny
        sizes = [(64, 1), (64, 13), (32, 3)]
    cases = []
    for bits in (8, 4):
        for dtype in ("float32", "bfloat16", "float16"):
            for bs, nb in sizes:
                cases.append(dict(kernel="quantize+dequantize", bits=bits, dtype=dtype,
                                  block_size=bs, blocks=nb))
    layouts = [(2, 4, 1, 0, 13), (1, 8, 2, 1, 3), (4, 2, 1, 0, 1)]
    if big:
        layouts.append((2, 8, 2, 0, 517))
    for bits in (8, 4):
        for dtype in ("float32", "bfloat16", "float16"):
            for nodes, local, stages, stage, nb in layouts:
                cases.append(dict(kernel="reorder_quantize", bits=bits, dtype=dtype,
                                  block_size=64 if on_gpu else 32, blocks=nb, nodes=nodes,
                                  local=local, stages=stages, stage=stage))
    groups = [(3, 13), (8, 1000 if on_gpu else 5), (2, 1)]
    for bits, out_bits in ((8, 8), (4, 4), (4, 8), (8, 4)):
        for g, nb in groups:
            cases.append(dict(kernel="dequantize_reduce(+requantize)", bits=bits,
                              out_bits=out_bits, dtype="float32", block_size=64 if on_gpu else 32,
                              blocks=nb, groups=g))
    # The same kernels with their options on ("smooth"): a Hadamard rotation fused into
    # quantize, dequantize, reorder+quantize and the final dequantize+reduce, stochastic
    # rounding into reorder+quantize and the middle hop's requantize.
    for case in list(cases):
        first_sizes = (case["block_size"], case["blocks"]) in sizes[:2]
        if case["kernel"] == "quantize+dequantize" and first_sizes and case["dtype"] != "float16":
            cases.append(dict(case, smooth=True))
        elif case["kernel"] == "reorder_quantize" and case["dtype"] != "float16":
            cases.append(dict(case, smooth=True))
        elif case["kernel"].startswith("dequantize_reduce") and case["bits"] == case["out_bits"]:
            cases.append(dict(case, smooth=True))
    return cases


def _case_fns(case: dict, interpret: bool):
    """``(make_inputs(rng), kernel_fn, reference_fn, output names)`` for one case."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import quantize as Q
    from pallas_kernels import reduce as D
    from pallas_kernels import reorder as R

    import numpy as np

    bits, bs, nb = case["bits"], case["block_size"], case["blocks"]
    dtype = jnp.dtype(case["dtype"])
    kw = dict(bits=bits, block_size=bs)
    # Options (case "smooth"): Hadamard signs (fp32 ±1 per block position) and a
    # stochastic-rounding seed, fixed per case.
    smooth = case.get("smooth", False)
    signs = (jnp.asarray(np.random.default_rng(bs).choice([-1.0, 1.0], bs), jnp.float32)
             if smooth else None)
    seed = jnp.uint32(0x2545F491) if smooth else None
    if case["kernel"] == "quantize+dequantize":
        def kernel(x):
            v, s = Q.quantize(x, **kw, interpret=interpret, signs=signs)
            return v, s, Q.dequantize(v, s, **kw, dtype=dtype, interpret=interpret,
                                      signs=signs)

        def reference(x):
            v, s = Q.quantize_reference(x, **kw, signs=signs)
            return v, s, Q.dequantize_reference(v, s, **kw, dtype=dtype, signs=signs)

        return ((lambda rng: (_sample(rng, nb, bs, dtype),)), kernel, reference,
                ("quantize.values", "quantize.scales", "dequantize.out"))
    if case["kernel"] == "reorder_quantize":
        lay = {k: case[k] for k in ("nodes", "local", "stages", "stage")}
        num = case["nodes"] * case["local"] * case["stages"]

        def inputs(rng):
            return (_sample(rng, num * nb, bs, dtype),)

        opts = dict(signs=signs, seed=seed)
        return (inputs,
                functools.partial(R.reorder_quantize, **kw, **lay, **opts, interpret=interpret),
                functools.partial(R.reorder_quantize_reference, **kw, **lay, **opts),
                ("reorder_quantize.values", "reorder_quantize.scales"))
    out_bits, g = case["out_bits"], case["groups"]

    def inputs(rng):
        x = _sample(rng, g * nb, bs, jnp.float32)
        v, s = jax.jit(functools.partial(Q.quantize_reference, **kw))(x)
        return jax.device_get(v).reshape(g, -1), jax.device_get(s).reshape(g, nb)

    def kernel(v, s):
        return (D.dequantize_reduce(v, s, **kw, signs=signs, interpret=interpret),
                *D.dequantize_reduce_requantize(v, s, **kw, out_bits=out_bits, seed=seed,
                                                interpret=interpret))

    def reference(v, s):
        return (D.dequantize_reduce_reference(v, s, **kw, signs=signs),
                *D.dequantize_reduce_requantize_reference(v, s, **kw, out_bits=out_bits,
                                                          seed=seed))

    return (inputs, kernel, reference,
            ("dequantize_reduce.out", "requantize.values", "requantize.scales"))


def _case_label(c: dict) -> str:
    extra = ""
    if "nodes" in c:
        extra = f" {c['nodes']}x{c['local']} stage {c['stage']}/{c['stages']}"
    if "groups" in c:
        extra = f" G={c['groups']} -> INT{c['out_bits']}"
    if c.get("smooth"):
        extra += " +hadamard+stochastic"
    return (f"{c['kernel']:<31} INT{c['bits']} {c['dtype']:<8} bs {c['block_size']:<3} "
            f"blocks {c['blocks']:<5}{extra}")


def check_kernels(device, report: Report, quick: bool) -> dict:
    import jax
    import numpy as np

    on_gpu = device.platform == "gpu"
    cpu = jax.devices("cpu")[0]
    cases = kernel_cases(quick, on_gpu)
    mode = "compiled for the GPU" if on_gpu else "in interpret mode"
    print(f"   {len(cases)} cases; kernels {mode}; reference compiled by XLA on {device.platform}"
          f"{' and on the host CPU' if on_gpu else ''}")
    results = []
    for i, case in enumerate(cases):
        row = dict(case)
        try:
            make_inputs, kernel, reference, names = _case_fns(case, interpret=not on_gpu)
            rng = np.random.default_rng([i, case["bits"], case["blocks"]])
            host = make_inputs(rng)
            args = jax.device_put(host, device)
            # One program for both (one compile); outputs compared on the host.
            got, want = jax.device_get(jax.jit(lambda *a: (kernel(*a), reference(*a)))(*args))
            row["mismatches"] = {n: bit_mismatches(a, e) for n, a, e in zip(names, got, want)}
            if on_gpu:
                want_cpu = jax.device_get(jax.jit(reference)(*jax.device_put(host, cpu)))
                row["mismatches_vs_cpu_reference"] = {
                    n: bit_mismatches(a, e) for n, a, e in zip(names, got, want_cpu)}
            # The contract is the reference's arithmetic as written (IEEE fp32, which XLA CPU
            # keeps): on a GPU that is the host-CPU reference. XLA's GPU compilation of the
            # same jnp code is reported beside it: for bf16/fp16 inputs it rounds a few
            # half-way quotients differently (measured on an H100, jax 0.11.2).
            contract = row.get("mismatches_vs_cpu_reference", row["mismatches"])
            bad = {n: k for n, k in contract.items() if k}
            row["ok"] = not bad
            xla_gpu = sum(row["mismatches"].values()) if on_gpu else 0
            status = "PASS" if row["ok"] else f"FAIL {bad}"
            if on_gpu and xla_gpu:
                status += f" (XLA's GPU-compiled reference differs in {xla_gpu} elements)"
        except Exception as e:  # noqa: BLE001 -- one failing case must not hide the rest
            row.update(ok=False, error=_short(e))
            status = f"ERROR {_short(e)}"
            traceback.print_exc()
        if not row["ok"]:
            report.failures.append(f"(a) {_case_label(case)}: {status}")
        print(f"   {_case_label(case)}  {status}", flush=True)
        results.append(row)
    passed = sum(r["ok"] for r in results)
    print(f"   {passed}/{len(results)} cases bit-exact")
    return {"cases": results, "passed": passed, "total": len(results)}


# ------------------------------------------------------------------------- (b) bandwidth


def _median_times(fns: dict, args: dict, *, iters: int, reps: int) -> dict[str, float]:
    """Seconds per call, median over ``reps``; functions take turns within a repetition.
    Each timed repetition dispatches ``iters`` calls back to back, then blocks."""
    import jax

    for k, f in fns.items():
        jax.block_until_ready(f(*args[k]))  # compile and warm up
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for k, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(iters):
                out = f(*args[k])
            jax.block_until_ready(out)
            times[k].append((time.perf_counter() - t0) / iters)
    return {k: statistics.median(v) for k, v in times.items()}


def _nbytes(tree) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def bandwidth_configs() -> list[dict]:
    cfgs = []
    for bits in (8, 4):
        for dtype in ("float32", "bfloat16"):
            cfgs.append(dict(kernel="quantize", bits=bits, dtype=dtype))
    for bits in (8, 4):
        for dtype in ("bfloat16", "float32"):
            cfgs.append(dict(kernel="dequantize", bits=bits, dtype=dtype))
    for bits in (4, 8):
        cfgs.append(dict(kernel="reorder_quantize", bits=bits, dtype="bfloat16"))
    for bits in (4, 8):
        cfgs.append(dict(kernel="dequantize_reduce", bits=bits, dtype="float32"))
    cfgs.append(dict(kernel="dequantize_reduce_requantize", bits=4, dtype="float32"))
    # INT4 with the options on: the Hadamard rotation (quantize, dequantize, reorder +
    # quantize, the final dequantize + reduce) and stochastic rounding (reorder + quantize,
    # the middle requantize): what the smoothing costs against the rows above.
    for kernel, dtype in (("quantize", "bfloat16"), ("dequantize", "bfloat16"),
                          ("reorder_quantize", "bfloat16"), ("dequantize_reduce", "float32"),
                          ("dequantize_reduce_requantize", "float32")):
        cfgs.append(dict(kernel=kernel, bits=4, dtype=dtype, smooth=True))
    return cfgs


def _bandwidth_fns(cfg: dict, n: int, device, interpret: bool):
    """``(inputs on device, pallas fn, xla fn)`` for ``n`` input elements."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import quantize as Q
    from pallas_kernels import reduce as D
    from pallas_kernels import reorder as R

    bs, bits = 256, cfg["bits"]
    dtype = jnp.dtype(cfg["dtype"])
    kw = dict(bits=bits, block_size=bs)
    smooth = cfg.get("smooth", False)
    signs = (jax.device_put(jnp.where(jnp.arange(bs) % 3 == 0, -1.0, 1.0).astype(jnp.float32),
                            device) if smooth else None)
    seed = jnp.uint32(0x2545F491) if smooth else None
    key = jax.device_put(jax.random.PRNGKey(n + bits), device)  # jit runs where its input is
    x = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32).astype(dtype))(key)
    kernel = cfg["kernel"]
    if kernel == "quantize":
        return ((x,), functools.partial(Q.quantize, **kw, signs=signs, interpret=interpret),
                functools.partial(Q.quantize_reference, **kw, signs=signs))
    if kernel == "reorder_quantize":
        lay = dict(nodes=2, local=8, signs=signs, seed=seed)
        return ((x,), functools.partial(R.reorder_quantize, **kw, **lay, interpret=interpret),
                functools.partial(R.reorder_quantize_reference, **kw, **lay))
    v, s = jax.jit(functools.partial(Q.quantize_reference, **kw))(x.astype(jnp.float32))
    del x
    if kernel == "dequantize":
        return ((v, s),
                functools.partial(Q.dequantize, **kw, dtype=dtype, signs=signs,
                                  interpret=interpret),
                functools.partial(Q.dequantize_reference, **kw, dtype=dtype, signs=signs))
    g = 8  # qgZ's local hop on an 8-GPU node: 8 chunks summed
    v, s = v.reshape(g, -1), s.reshape(g, -1)
    if kernel == "dequantize_reduce":
        return ((v, s),
                functools.partial(D.dequantize_reduce, **kw, signs=signs, interpret=interpret),
                functools.partial(D.dequantize_reduce_reference, **kw, signs=signs))
    return ((v, s),
            functools.partial(D.dequantize_reduce_requantize, **kw, seed=seed,
                              interpret=interpret),
            functools.partial(D.dequantize_reduce_requantize_reference, **kw, seed=seed))


def measure_bandwidth(device, quick: bool) -> dict:
    import jax
    import jax.numpy as jnp

    on_gpu = device.platform == "gpu"
    if on_gpu:
        sizes = [1 << 20] if quick else [64 << 20, 256 << 20]
        iters, reps = (5, 3) if quick else (20, 7)
    else:
        sizes, iters, reps = [1 << 13], 2, 2
    print(f"   sizes {sizes} elements; median of {reps} x {iters} back-to-back calls; the copy: "
          "jit(lambda x: x + 1) on uint32[bytes / 8] (reads and writes the same bytes)")
    copy = jax.jit(lambda a: a + jnp.uint32(1))
    rows = []
    for n in sizes:
        for cfg in bandwidth_configs():
            row = dict(cfg, elements=n)
            try:
                args, pallas_fn, xla_fn = _bandwidth_fns(cfg, n, device, interpret=not on_gpu)
                out = jax.eval_shape(xla_fn, *args)
                moved = _nbytes(args) + _nbytes(out)
                buf = jnp.zeros((-(-moved // 8),), jnp.uint32, device=device)
                # Compiled once each; the executables are what is timed.
                pallas_exe = jax.jit(pallas_fn).lower(*args).compile()
                xla_exe = jax.jit(xla_fn).lower(*args).compile()
                copy_exe = copy.lower(buf).compile()
                if on_gpu:  # what the Pallas path compiled to (a Triton custom call?)
                    row["pallas_custom_calls"] = sorted(set(re.findall(
                        r'custom_call_target="([^"]*)"', pallas_exe.as_text())))
                t = _median_times({"pallas": pallas_exe, "xla": xla_exe, "copy": copy_exe},
                                  {"pallas": args, "xla": args, "copy": (buf,)},
                                  iters=iters, reps=reps)
                del buf
                row.update(bytes=moved, seconds=t,
                           gbps={k: moved / v / 1e9 for k, v in t.items()},
                           pallas_fraction_of_copy=t["copy"] / t["pallas"],
                           xla_fraction_of_copy=t["copy"] / t["xla"],
                           pallas_over_xla_time=t["pallas"] / t["xla"])
                row["meets_target"] = row["pallas_fraction_of_copy"] >= BANDWIDTH_TARGET
                row["xla_as_fast"] = t["xla"] <= t["pallas"]
                label = cfg["kernel"] + (" +H/SR" if cfg.get("smooth") else "")
                print(f"   {label:<35} INT{cfg['bits']} {cfg['dtype']:<8} n={n:>10,}: "
                      f"pallas {row['gbps']['pallas']:7.0f} GB/s "
                      f"({row['pallas_fraction_of_copy']:.0%} of copy), xla "
                      f"{row['gbps']['xla']:7.0f} GB/s ({row['xla_fraction_of_copy']:.0%}), "
                      f"copy {row['gbps']['copy']:7.0f} GB/s"
                      f"{'  <- XLA as fast or faster' if row['xla_as_fast'] else ''}", flush=True)
            except Exception as e:  # noqa: BLE001 -- record and go on to the next kernel
                row["error"] = _short(e)
                traceback.print_exc()
                print(f"   {cfg['kernel']} INT{cfg['bits']} {cfg['dtype']} n={n}: ERROR "
                      f"{_short(e)}", flush=True)
            rows.append(row)
    measured = [r for r in rows if "error" not in r]
    errors = [r for r in rows if "error" in r]
    summary = {
        "target": BANDWIDTH_TARGET,
        "met": sum(r["meets_target"] for r in measured),
        "xla_as_fast": sum(r["xla_as_fast"] for r in measured),
        "measured": len(measured),
        "errors": len(errors),
    }
    if measured:
        ratios = [r["pallas_over_xla_time"] for r in measured]
        summary["geomean_pallas_over_xla_time"] = statistics.geometric_mean(ratios)
    summary["recommend_xla_default_on_gpu"] = bool(
        measured and (summary["xla_as_fast"] > len(measured) / 2
                      or summary["geomean_pallas_over_xla_time"] >= 1.0))
    print(f"   Pallas >= {BANDWIDTH_TARGET:.0%} of the copy in {summary['met']}/{len(measured)}; "
          f"XLA as fast or faster in {summary['xla_as_fast']}/{len(measured)}")
    if summary["recommend_xla_default_on_gpu"]:
        print("   RECOMMENDATION: XLA's fused jnp reference is as fast as the Pallas kernels or "
              "faster: make XLA the default implementation on GPU")
    return {"rows": rows, "summary": summary}


# ------------------------------------------------------------------------ (c) train step


def peak_flops(device_kind: str) -> float | None:
    for name, peak in PEAK_BF16:
        if name.lower() in device_kind.lower():
            return peak
    return None


def train_step_check(device, quick: bool, batch_size: int) -> dict:
    import warnings

    import jax
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from benchmarks.overhead import count_matmuls, plain_step, zero3_step
    from zeropp_demo.gpt import GPT, GPTConfig

    warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
    on_gpu = device.platform == "gpu"
    if quick or not on_gpu:
        cfg = GPTConfig(vocab_size=256, seq_len=64 if on_gpu else 32, layers=2, d_model=128,
                        heads=4, dtype="bfloat16")
        batch_size = 4 if on_gpu else 2
        rounds, steps = (3, 2) if on_gpu else (2, 1)
    else:
        cfg = GPTConfig(vocab_size=50304, seq_len=1024, layers=12, d_model=768, heads=12,
                        dtype="bfloat16")
        rounds, steps = 8, 3
    model = GPT(cfg)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)).astype(np.int32)
    params = jax.jit(model.init)(*jax.device_put((jax.random.PRNGKey(0), tokens[:, :-1]),
                                                 device))["params"]
    params = jax.tree_util.tree_map(np.asarray, params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    tx = optax.adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)
    print(f"   GPT {n_params / 1e6:.1f}M params ({cfg.layers} layers, d_model {cfg.d_model}, "
          f"{cfg.heads} heads, seq {cfg.seq_len}, vocab {cfg.vocab_size}), batch {batch_size}, "
          f"bf16 compute, fp32 params, AdamW; {rounds} interleaved rounds of {steps} steps")

    # The steps of benchmarks/overhead.py: plain jax.jit and @zpp.train_step, state donated.
    plain, zero_step = plain_step(model, tx), zero3_step()
    mesh = zpp.make_mesh(1, 1, devices=[device])
    # On CPU the Pallas kernels run in interpret mode, which JAX cannot trace inside
    # shard_map: the dry run uses the (bit-identical) jnp reference there.
    impl = "pallas" if on_gpu else "xla"
    configs = {
        "zero3_minimal": zpp.ZeroPPConfig(stage=3, compute_dtype="bfloat16", remat="minimal",
                                          skip_nonfinite=False),
        "zero3_full": zpp.ZeroPPConfig(stage=3, compute_dtype="bfloat16", remat="full",
                                       skip_nonfinite=False),
        "zeropp": zpp.ZeroPPConfig.zeropp(compute_dtype="bfloat16", quantization_impl=impl,
                                          skip_nonfinite=False),
    }
    runners: dict = {}
    results: dict = {
        "model": {"params": n_params, "layers": cfg.layers, "d_model": cfg.d_model,
                  "heads": cfg.heads, "seq_len": cfg.seq_len, "vocab": cfg.vocab_size,
                  "batch": batch_size, "compute_dtype": "bfloat16", "param_dtype": "float32"},
        "optimizer": "adamw(3e-4, b1=0.9, b2=0.95, weight_decay=0.1)",
        "zeropp_quantization_impl": impl,
        "skip_nonfinite": False,
        "rounds": rounds, "steps_per_round": steps,
        "variants": {},
    }
    # Each variant: (zero?, its jitted step, state, batch placed as the step wants it).
    try:
        state = jax.device_put((params, tx.init(params)), device)
        runners["plain"] = [False, plain, list(state),
                            jax.device_put(tokens, device)]
    except Exception as e:  # noqa: BLE001
        results["variants"]["plain"] = {"error": _short(e)}
        traceback.print_exc()
    for name, config in configs.items():
        try:
            st = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh,
                                       config=config)
            runners[name] = [True, zero_step, st, st.engine.shard_batch(tokens)]
        except Exception as e:  # noqa: BLE001
            results["variants"][name] = {"error": _short(e)}
            traceback.print_exc()

    def run(name: str, n: int):
        """``n`` steps of a variant through its compiled executable; the last loss."""
        zero, call, state, batch = runners[name]
        loss = None
        for _ in range(n):
            if zero:
                state, metrics = call(state, batch)
                loss = metrics["loss"]
            else:
                *state, loss = call(*state, batch)
        jax.block_until_ready((state, loss))
        runners[name][2] = state
        return loss

    def drop(name: str, e: Exception) -> None:
        results["variants"][name] = {**results["variants"].get(name, {}), "error": _short(e)}
        traceback.print_exc()
        del runners[name]

    for name in list(runners):
        zero, fn, state, batch = runners[name]
        try:
            t0 = time.perf_counter()
            # Compiled once; the executable (state donated as in the jitted step) is what runs.
            compiled = (fn.lower(state, batch) if zero else fn.lower(*state, batch)).compile()
            runners[name][1] = compiled
            mem = compiled.memory_analysis()
            v = {"compile_s": time.perf_counter() - t0,
                 "matmuls": count_matmuls(compiled.as_text()),
                 "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
                 "argument_bytes": getattr(mem, "argument_size_in_bytes", None),
                 "output_bytes": getattr(mem, "output_size_in_bytes", None)}
            results["variants"][name] = v
            v["first_loss"] = float(run(name, 1))
            run(name, 1)  # warm up
            print(f"   {name}: compiled in {v['compile_s']:.0f} s, first loss "
                  f"{v['first_loss']:.3f}, temp {_gb(v['temp_bytes'])} GiB", flush=True)
        except Exception as e:  # noqa: BLE001 -- e.g. out of memory: the others still run
            drop(name, e)
    times: dict[str, list[float]] = {k: [] for k in runners}
    last_loss: dict = {}
    for _ in range(rounds):
        for name in list(runners):
            try:
                t0 = time.perf_counter()
                last_loss[name] = run(name, steps)
                times[name].append((time.perf_counter() - t0) / steps)
            except Exception as e:  # noqa: BLE001
                drop(name, e)
                del times[name]
    tokens_per_step = batch_size * cfg.seq_len
    peak = peak_flops(device.device_kind)
    results["peak_bf16_flops"] = peak
    results["flops_per_step"] = 6 * n_params * tokens_per_step
    for name, ts in times.items():
        v = results["variants"][name]
        med = statistics.median(ts)
        v.update(median_s=med, times_s=ts, tokens_per_s=tokens_per_step / med,
                 final_loss=float(last_loss[name]))
        v["mfu"] = results["flops_per_step"] / med / peak if peak else None
    base = results["variants"].get("plain", {}).get("median_s")
    for name in times:
        v = results["variants"][name]
        v["vs_plain"] = v["median_s"] / base if base else None
    m = results["variants"].get("zero3_minimal", {})
    if base and "median_s" in m:
        results["target"] = {"zero3_minimal/plain": m["vs_plain"], "target": STEP_TARGET,
                             "met": m["vs_plain"] <= STEP_TARGET}
    try:
        stats = device.memory_stats() or {}
        results["process_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
    except Exception:  # noqa: BLE001 -- not every backend keeps statistics
        results["process_peak_bytes_in_use"] = None
    for name, v in results["variants"].items():
        if "median_s" in v:
            mfu = f"{v['mfu']:.1%}" if v["mfu"] is not None else "n/a"
            vs = f"{v['vs_plain']:.3f}x" if v["vs_plain"] else "n/a"
            print(f"   {name:<14} {v['median_s'] * 1e3:8.1f} ms/step {v['tokens_per_s']:10,.0f} "
                  f"tokens/s  MFU {mfu:>6}  vs plain {vs}  matmuls {v['matmuls']['total']}")
        else:
            print(f"   {name:<14} ERROR {v.get('error')}")
    return results


# --------------------------------------------------------------------------- markdown


def _gb(b) -> str:
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def markdown(data: dict) -> str:
    out = []
    v = data.get("versions", {})
    if "error" not in v and v:
        pk = v.get("packages", {})
        out.append(f"Device: {v.get('device_kind')} ({v.get('platform_version')}); "
                   f"jax {v.get('jax')}, " + ", ".join(f"{k} {pk[k]}" for k in pk if k != "jax")
                   + f"; driver / CUDA: {v.get('nvidia_smi')} / {v.get('cuda_driver_api')}")
        out.append("")
    k = data.get("kernels", {})
    out.append("**(a) Pallas kernels vs their jnp references, bit for bit**")
    out.append("")
    if "error" in k:
        out.append(f"section failed: {k['error']}")
    elif k:
        out.append("| kernel | bits | input dtype | cases | bit-exact | elements where XLA's "
                   "GPU-compiled reference differs |")
        out.append("|---|---|---|---|---|---|")
        groups: dict = {}
        for c in k["cases"]:
            bits = f"INT{c['bits']}" + (f"->INT{c['out_bits']}" if "out_bits" in c else "")
            kernel_name = c["kernel"] + (" +hadamard+stochastic" if c.get("smooth") else "")
            key = (kernel_name, bits, c["dtype"])
            g = groups.setdefault(key, [0, 0, 0])
            g[0] += 1
            g[1] += bool(c["ok"])
            if "mismatches_vs_cpu_reference" in c:
                g[2] += max(c["mismatches"].values(), default=0)
        for (kern, bits, dt), (n, ok, xla) in groups.items():
            out.append(f"| {kern} | {bits} | {dt} | {n} | {ok}/{n}{'' if ok == n else ' FAIL'} "
                       f"| {xla} |")
        out.append(f"\n{k['passed']}/{k['total']} cases bit-exact.")
    out.append("")
    b = data.get("bandwidth", {})
    out.append("**(b) achieved bandwidth ((read + written bytes) / median time) vs a device copy "
               "of the same bytes**")
    out.append("")
    if b.get("skipped"):
        out.append("skipped (--skip-bandwidth)")
    elif "error" in b:
        out.append(f"section failed: {b['error']}")
    elif b:
        out.append("| kernel | bits | dtype | elements | Pallas GB/s | % of copy | XLA GB/s | "
                   "% of copy | Pallas / XLA time | copy GB/s |")
        out.append("|---|---|---|---|---|---|---|---|---|---|")
        for r in b["rows"]:
            name = r["kernel"] + (" +hadamard+stochastic" if r.get("smooth") else "")
            head = f"| {name} | INT{r['bits']} | {r['dtype']} | {r['elements']:,} |"
            if "error" in r:
                out.append(head + f" error: {r['error'][:80]} | | | | | |")
                continue
            g = r["gbps"]
            out.append(head + f" {g['pallas']:.0f} | {r['pallas_fraction_of_copy']:.0%}"
                       f"{'' if r['meets_target'] else ' (<80%)'} | {g['xla']:.0f} | "
                       f"{r['xla_fraction_of_copy']:.0%} | {r['pallas_over_xla_time']:.2f} | "
                       f"{g['copy']:.0f} |")
        s = b["summary"]
        out.append(f"\nPallas >= {s['target']:.0%} of copy bandwidth in {s['met']}/"
                   f"{s['measured']} cases; XLA's reference as fast or faster in "
                   f"{s['xla_as_fast']}/{s['measured']}.")
        if "geomean_pallas_over_xla_time" in s:
            out.append(f"Geometric mean of Pallas / XLA time: "
                       f"{s['geomean_pallas_over_xla_time']:.2f}.")
        if s["recommend_xla_default_on_gpu"]:
            out.append("**Recommendation: XLA's fused jnp reference is as fast as the Pallas "
                       "kernels or faster (in most cases, or on the geometric mean): make XLA "
                       "the default on GPU.**")
    out.append("")
    c = data.get("train_step", {})
    out.append("**(c) one-GPU train step**")
    out.append("")
    if c.get("skipped"):
        out.append("skipped (--skip-step)")
    elif "error" in c:
        out.append(f"section failed: {c['error']}")
    elif c:
        m = c["model"]
        out.append(f"GPT {m['params'] / 1e6:.1f}M params, {m['layers']} layers, d_model "
                   f"{m['d_model']}, seq {m['seq_len']}, batch {m['batch']}, bf16 compute, "
                   f"{c['optimizer']}; MFU = 6 x params x tokens / time / "
                   + (f"{c['peak_bf16_flops'] / 1e12:.0f} TFLOP/s (dense bf16 peak)."
                      if c["peak_bf16_flops"] else "peak (n/a: device not in the table)."))
        out.append("")
        out.append("| step | ms/step | tokens/s | MFU | vs plain | matmuls | temp GiB |")
        out.append("|---|---|---|---|---|---|---|")
        for name, v in c["variants"].items():
            if "median_s" not in v:
                out.append(f"| {name} | error: {v.get('error', '?')[:80]} | | | | | |")
                continue
            mfu = f"{v['mfu']:.1%}" if v["mfu"] is not None else "n/a"
            vs = f"{v['vs_plain']:.3f}x" if v["vs_plain"] else "n/a"
            out.append(f"| {name} | {v['median_s'] * 1e3:.1f} | {v['tokens_per_s']:,.0f} | {mfu} "
                       f"| {vs} | {v['matmuls']['total']} | {_gb(v['temp_bytes'])} |")
        t = c.get("target")
        if t:
            out.append(f"\nZeRO-3 (remat minimal) / plain = {t['zero3_minimal/plain']:.3f}x "
                       f"(target <= {t['target']:.2f}x): {'met' if t['met'] else 'NOT met'}. "
                       f"Peak device memory of the whole process: "
                       f"{_gb(c.get('process_peak_bytes_in_use'))} GiB.")
    return "\n".join(out)


# ------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = find_device(args.allow_cpu)
    report = Report()
    report.data["args"] = {k: str(v) for k, v in vars(args).items()}
    t0 = time.perf_counter()
    report.section("versions", "(d) versions", versions, device)
    report.section("kernels", "(a) Pallas kernels vs jnp references, bit for bit",
                   check_kernels, device, report, args.quick)
    if args.skip_bandwidth:
        report.data["bandwidth"] = {"skipped": True}
    else:
        report.section("bandwidth", "(b) bandwidth vs a device copy", measure_bandwidth,
                       device, args.quick)
    if args.skip_step:
        report.data["train_step"] = {"skipped": True}
    else:
        report.section("train_step", "(c) one-GPU train step", train_step_check, device,
                       args.quick, args.batch)
    for r in report.data.get("bandwidth", {}).get("rows", []):
        if "error" in r:
            report.failures.append(f"(b) {r['kernel']} INT{r['bits']} {r['dtype']} "
                                   f"n={r['elements']}: {r['error']}")
    for name, v in report.data.get("train_step", {}).get("variants", {}).items():
        if "error" in v:
            report.failures.append(f"(c) {name}: {v['error']}")
    report.data["failures"] = report.failures
    report.data["total_seconds"] = time.perf_counter() - t0
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    try:
        md = markdown(report.data)
    except Exception as e:  # noqa: BLE001 -- the JSON below still holds every result
        traceback.print_exc()
        report.failures.append(f"markdown: {_short(e)}")
        md = f"(markdown tables failed: {_short(e)}; see {path})"
    path.write_text(json.dumps(report.data, indent=1, default=str))
    path.with_suffix(".md").write_text(md + "\n")
    print("\n" + md + "\n")
    print(f"wrote {path} and {path.with_suffix('.md')} ({report.data['total_seconds']:.0f} s)")
    if report.failures:
        print(f"\ngpu-check: {len(report.failures)} failure(s):", file=sys.stderr)
        for f in report.failures:
            print(f"  {f}", file=sys.stderr)
        return 1
    print("gpu-check: all kernels bit-exact, every section ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
