"""The replay's prices checked on one GPU: the 1.3B Llama's train step run for real, each
kernel's measured time against the price ``make gpu-cluster`` gives it.

    make gpu-calibrate                                  # on a machine with an NVIDIA GPU
    python -m benchmarks.gpu_cluster.calibrate --allow-cpu --model tiny   # a dry run here
    python -m benchmarks.gpu_cluster.calibrate --reprice --out benchmarks/results \
        --name gpu_calibrate_h200 --hlo-dir tests/measure/fixtures     # new prices, old run

``make gpu-cluster`` never runs a step: it prices every kernel of the compiled program at
roofline (``measure.schedule``: matmuls at the datasheet's dense peak, everything else at
the memory bandwidth) and replays the schedule. This runs the same 1.3B (24 layers,
d_model 2048, one 2048-token sequence, AdamW, bf16 compute on fp32 weights) on the GPU
attached, as a plain ``jax.jit`` step (``plain``) and as zeropp_jax's ZeRO-3 step on a
1 x 1 mesh (``zero3``), and for each:

* times ``--steps`` steps (wall clock, each step waited for; the median and the spread);
* profiles ``--profile-steps`` more (``jax.profiler``) and sums every GPU kernel's time by
  the HLO instruction it ran for (the profile's ``hlo_op``: the name the compiled program's
  text gives it). XLA's command buffers (CUDA graphs) are off for the whole run
  (``--xla_gpu_enable_command_buffer=``), else a graph's kernels lose that name;
* prices the same compiled program as the replay does (``compute_by_instruction``), with
  the roofline of the GPU it ran on (``ROOFLINES``) and with the H100 one the cluster rows
  use, and sets measured against priced: per kernel class (``compute_by_class``'s
  classes), per instruction (the largest differences), and in total. A ratio of 1.3 means
  that class takes 1.3x its roofline price on this GPU.

Also measures the GPU's ceilings the prices assume: a device copy's bandwidth (bytes read
and written) and a bf16 8192^3 matmul's FLOP/s.

``--reprice`` needs no GPU: it prices a run's programs again with this checkout's replay,
against the kernel times the run measured (``measured_ms_by_op``), after a change to the
prices. Writes ``gpu_calibrate.json`` and ``.md`` (``--out``, ``--name``), and the compiled
programs' HLO text (``*.hlo.gz``; with ``--keep-trace`` the first one's profile too) for
offline analysis.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

# Profile kernels by instruction: a CUDA graph's kernels carry no ``hlo_op``.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="

# Dense bf16 FLOP/s and HBM bytes/s by device kind (datasheet values), matched in order.
ROOFLINES = (
    ("H200", 989e12, 4.8e12),
    ("H100 PCIe", 756e12, 2.0e12),
    ("H100", 989e12, 3.35e12),
    ("A100", 312e12, 2.0e12),
)
# ``plain``: a plain ``jax.jit`` step; the others: ``gpu_cluster.run.configs()``'s on a
# 1 x 1 mesh (qwZ still quantizes and dequantizes every weight there; qgZ reduces plainly).
CONFIGS = ("plain", "zero3", "zeropp", "zeropp_pallas", "qwz_int4_hadamard")
# A profiled kernel whose ``hlo_op`` names no instruction of the program (XLA's
# asynchronous fusions report the fusion's name before it was wrapped): its class by name.
_NAME_CLASSES = (("attention", r"attention|fmha|flash"), ("matmul", r"gemm|cublas|dot"),
                 ("copies and layout", r"slice|copy|concatenate|transpose|pad|gather|scatter"))
# Lines of a GPU profile plane that repeat its kernels (derived views), not kernels.
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "Framework Ops", "Framework Name Scope",
                  "Steps", "Source code", "XLA TraceMe", "TensorFlow Name Scope",
                  "Launch Stats", "Memcpy", "Memset")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from benchmarks.cli import add_out_argument

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="1.3B", help="a gpu_cluster.llama SHAPES key, or tiny")
    p.add_argument("--seq", type=int, default=2048, help="tokens of the one sequence")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=3, help="profiled steps")
    p.add_argument("--attention", default="cudnn", choices=["cudnn", "xla"],
                   help="the Llama's attention (cudnn: the fused kernel the cluster rows use)")
    p.add_argument("--allow-cpu", action="store_true",
                   help="run on the CPU (a dry run of the script; measures nothing useful)")
    p.add_argument("--top", type=int, default=15, help="instructions listed by difference")
    p.add_argument("--keep-trace", action="store_true",
                   help="also write the first config's profile (``*.xplane.pb.gz``)")
    p.add_argument("--name", default="gpu_calibrate")
    p.add_argument("--reprice", action="store_true",
                   help="no GPU: price the programs of the run in --out/--name.json again "
                        "(the HLO files --name_CONFIG.hlo.gz in --hlo-dir) with this "
                        "checkout's replay, against the same measured kernel times")
    p.add_argument("--hlo-dir", type=pathlib.Path, default=None,
                   help="--reprice: where the run's HLO files are (default --out)")
    add_out_argument(p)
    return p.parse_args(argv)


def roofline_for(device_kind: str):
    """The ``Roofline`` of ``device_kind`` (``ROOFLINES``; the H100's for any other)."""
    from benchmarks.gpu_cluster.target import H100_ROOFLINE
    from zeropp_jax.measure.schedule import Roofline

    for key, flops, memory in ROOFLINES:
        if key in device_kind:
            rates = {k: v * flops / 989e12 for k, v in H100_ROOFLINE.matmul_flops_per_s.items()}
            return Roofline(matmul_flops_per_s=rates, memory_bytes_per_s=memory)
    return H100_ROOFLINE


def _seconds_each(fn, *args, reps: int = 10, rounds: int = 5) -> float:
    """Seconds per call of the jitted ``fn``: ``reps`` calls queued back to back, then
    waited for (so launch and wait overheads are not counted per call); the best of
    ``rounds``."""
    import jax

    jax.block_until_ready(fn(*args))
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        outs = [fn(*args) for _ in range(reps)]
        jax.block_until_ready(outs)
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def ceilings(quick: bool) -> dict:
    """The device's copy bandwidth (bytes read + written per second, ``x + 1`` on 2^28
    uint32) and bf16 matmul rate (``n^3`` with ``n`` 8192, random inputs)."""
    import jax
    import jax.numpy as jnp

    n_copy = 2**16 if quick else 2**28
    x = jnp.zeros((n_copy,), jnp.uint32)
    copy_s = _seconds_each(jax.jit(lambda a: a + 1), x)
    n = 256 if quick else 8192
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    mm_s = _seconds_each(jax.jit(lambda a, b: a @ b), a, b)
    return {"copy_bytes_per_s": 2 * 4 * n_copy / copy_s,
            "matmul_bf16_flops_per_s": 2.0 * n**3 / mm_s, "matmul_n": n,
            "copy_elements": n_copy}


def shape_of(name: str):
    from benchmarks.gpu_cluster.llama import SHAPES, LlamaShape

    if name == "tiny":
        return LlamaShape("tiny", layers=2, d_model=64, heads=4, kv_heads=4, ffn=128, vocab=256)
    return SHAPES[name]


def build(config: str, shape, seq: int, attention: str | None):
    """``(step, args)``: the donated train step of ``config`` and its real inputs (random
    weights, AdamW state, one random ``seq + 1``-token sequence) on the first device."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import Mesh

    import zeropp_jax as zpp
    from benchmarks.gpu_cluster.llama import Llama
    from benchmarks.gpu_cluster.steps import plain_step, zero_step
    from zeropp_jax.core.mesh import AXES

    model = Llama(shape, attention=attention)
    tokens = jnp.zeros((1, seq), jnp.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), tokens)["params"]
    batch = jax.random.randint(jax.random.PRNGKey(1), (1, seq + 1), 0, shape.vocab,
                               jnp.int32)
    tx = optax.adamw(3e-4)
    if config == "plain":
        return jax.jit(plain_step(model, tx), donate_argnums=(0, 1)), (
            params, tx.init(params), batch)
    from benchmarks.gpu_cluster.run import configs

    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), AXES)
    state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh,
                                  config=configs()[config])
    return zero_step(), (state, batch)


def _run(step, args):
    """One step on ``args`` (the state donated): ``(new args, loss)``, waited for."""
    import jax

    out = step(*args)
    jax.block_until_ready(out)
    if len(args) == 3:  # plain: (params, opt_state, batch) -> (params, opt_state, loss)
        return (out[0], out[1], args[2]), out[2]
    return (out[0], args[1]), out[1]["loss"]


def measured_by_instruction(trace_dir: str, module: str) -> tuple[dict, dict]:
    """Kernel seconds by ``hlo_op`` (and run counts) summed over a ``jax.profiler`` trace:
    the GPU planes' kernel lines when there are any, else (a CPU dry run) the host's
    events; only events of HLO module ``module`` when they name one. Also a summary of the
    planes and lines seen, for a reader checking what was counted."""
    import glob

    import jax

    paths = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)
    profile = jax.profiler.ProfileData.from_file(paths[0])
    planes = list(profile.planes)
    gpu = [p for p in planes if p.name.startswith("/device:GPU")]
    use = gpu or [p for p in planes if p.name.startswith("/host:CPU")]
    seconds: dict[str, float] = {}
    runs: dict[str, int] = {}
    seen = {}
    for plane in use:
        for line in plane.lines:
            counted = 0
            if not line.name.startswith(_DERIVED_LINES):
                for e in line.events:
                    with warnings.catch_warnings():
                        # jax 0.11's profile reader warns on every event's stats (their
                        # C++ type has no __module__): noise, once per kernel.
                        warnings.simplefilter("ignore", DeprecationWarning)
                        stats = dict(e.stats)
                    op = stats.get("hlo_op")
                    mod = str(stats.get("hlo_module", module))
                    if op is None or not (mod == module or mod.startswith(module)):
                        continue
                    seconds[str(op)] = seconds.get(str(op), 0.0) + e.duration_ns * 1e-9
                    runs[str(op)] = runs.get(str(op), 0) + 1
                    counted += 1
            seen[f"{plane.name} | {line.name}"] = counted
    return {"seconds": seconds, "runs": runs}, seen


def price_run(run: dict, text: str, measured: dict, steps: int, roofline, top: int) -> None:
    """Sets ``run``'s comparisons (``vs_roofline``, ``vs_h100_roofline``: the H100 prices
    the cluster rows use) of ``measured`` (kernel seconds and runs by ``hlo_op`` over
    ``steps`` steps) against ``text``'s prices."""
    from benchmarks.gpu_cluster.target import H100_ROOFLINE as h100

    run["vs_roofline"] = compare(text, measured, steps, roofline, top)
    run["vs_h100_roofline"] = {k: v for k, v in compare(text, measured, steps, h100, 0).items()
                               if k in ("priced_ms", "ratio", "ratio_classified", "by_class")}


def reprice(data: dict, hlo_dir: pathlib.Path, name: str, top: int) -> dict:
    """``data`` (a run's JSON) with every run priced again from its HLO
    (``hlo_dir/name_CONFIG.hlo.gz``) against its measured kernel times
    (``measured_ms_by_op``): for a change to the replay's prices, without a GPU."""
    roofline = roofline_for(data["device"])
    for run in data["runs"]:
        if "error" in run:
            continue
        with gzip.open(hlo_dir / f"{name}_{run['config']}.hlo.gz", "rt") as f:
            text = f.read()
        measured = {"seconds": {k: v * 1e-3 for k, v in run["measured_ms_by_op"].items()},
                    "runs": dict(run["measured_runs_by_op"])}
        price_run(run, text, measured, 1, roofline, top)
    return data


def compare(text: str, measured: dict, steps: int, roofline, top: int) -> dict:
    """Measured against priced (seconds per step): by class, in total, and the ``top``
    instructions by absolute difference."""
    from zeropp_jax.measure.schedule import (KERNEL_CLASSES, compute_by_instruction,
                                             parse_module)

    priced = compute_by_instruction(text, roofline)
    by_class = {c: {"priced_ms": 0.0, "measured_ms": 0.0} for c in KERNEL_CLASSES}
    rows = []
    for name, (cls, seconds, runs) in priced.items():
        got = measured["seconds"].get(name)
        by_class[cls]["priced_ms"] += seconds * 1e3
        if got is not None:
            by_class[cls]["measured_ms"] += got / steps * 1e3
        rows.append({"instruction": name, "class": cls, "priced_ms": seconds * 1e3,
                     "measured_ms": None if got is None else got / steps * 1e3,
                     "priced_runs": runs,
                     "measured_runs": measured["runs"].get(name, 0) / steps})
    unpriced = {k: v / steps * 1e3 for k, v in measured["seconds"].items() if k not in priced}
    comps, _ = parse_module(text)
    names = {i.name for body in comps.values() for i in body}
    unnamed = {k: v for k, v in unpriced.items() if k not in names}
    for k, v in unnamed.items():
        cls = next((c for c, pattern in _NAME_CLASSES if re.search(pattern, k)),
                   "elementwise")
        by_class[cls]["measured_ms"] += v
        by_class[cls]["unnamed_ms"] = by_class[cls].get("unnamed_ms", 0.0) + v
    for c in by_class.values():
        c["ratio"] = c["measured_ms"] / c["priced_ms"] if c["priced_ms"] else None
    matched = [r for r in rows if r["measured_ms"] is not None]
    rows.sort(key=lambda r: -abs((r["measured_ms"] or 0.0) - r["priced_ms"]))
    priced_ms = sum(r["priced_ms"] for r in rows)
    measured_ms = sum(r["measured_ms"] for r in matched)
    classified = measured_ms + sum(unnamed.values())
    return {
        "measured_classified_ms": classified,
        "ratio_classified": classified / priced_ms if priced_ms else None,
        "unnamed_ms": sum(unnamed.values()),
        "priced_ms": priced_ms,
        "measured_kernels_ms": measured_ms + sum(unpriced.values()),
        "measured_priced_kernels_ms": measured_ms,
        "ratio": measured_ms / priced_ms if priced_ms else None,
        "instructions_priced": len(rows), "instructions_measured": len(matched),
        "priced_not_measured_ms": sum(r["priced_ms"] for r in rows if r["measured_ms"] is None),
        "unpriced_ms": dict(sorted(unpriced.items(), key=lambda kv: -kv[1])[:top]),
        "unpriced_total_ms": sum(unpriced.values()),
        "by_class": by_class,
        "top": rows[:top],
        "rows": rows,
    }


def calibrate(config: str, args, shape, roofline, out: pathlib.Path) -> dict:
    import jax

    attention = None if args.attention == "xla" else "cudnn"
    step, inputs = build(config, shape, args.seq, attention)
    t0 = time.perf_counter()
    compiled = step.lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    text = compiled.as_text()
    with gzip.open(out / f"{args.name}_{config}.hlo.gz", "wt") as f:
        f.write(text)
    module = text.split()[1].rstrip(",")
    for _ in range(3):  # warm-up
        inputs, value = _run(step, inputs)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        inputs, value = _run(step, inputs)
        times.append(time.perf_counter() - t0)
    with tempfile.TemporaryDirectory() as trace:
        with jax.profiler.trace(trace):
            for _ in range(args.profile_steps):
                inputs, value = _run(step, inputs)
        measured, seen = measured_by_instruction(trace, module)
        if args.keep_trace and config == args.configs[0]:
            import glob
            raw = glob.glob(os.path.join(trace, "**", "*.xplane.pb"), recursive=True)[0]
            with open(raw, "rb") as f, gzip.open(out / f"{args.name}_{config}.xplane.pb.gz",
                                                 "wb") as g:
                g.write(f.read())
    step_s = statistics.median(times)
    flops = shape.train_flops_per_token(args.seq) * args.seq
    run = {
        "config": config, "attention": args.attention, "compile_s": compile_s,
        "module": module, "loss": float(value),
        "step_ms_median": step_s * 1e3, "step_ms_min": min(times) * 1e3,
        "step_ms_max": max(times) * 1e3, "step_ms": [t * 1e3 for t in times],
        "mfu": flops / step_s / roofline.flops_rate("bf16"),
        "profile_lines": seen,
        # Every profiled kernel's time per step by hlo_op: enough to price again offline.
        "measured_ms_by_op": {k: v / args.profile_steps * 1e3
                              for k, v in sorted(measured["seconds"].items())},
        "measured_runs_by_op": {k: v / args.profile_steps
                                for k, v in sorted(measured["runs"].items())},
    }
    price_run(run, text, measured, args.profile_steps, roofline, args.top)
    return run


def markdown(data: dict) -> str:
    lines = [f"Device: {data['device']} (roofline: bf16 "
             f"{data['roofline']['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s, "
             f"{data['roofline']['memory_bytes_per_s'] / 1e12:.2f} TB/s; measured copy "
             f"{data['ceilings'].get('copy_bytes_per_s', 0) / 1e12:.2f} TB/s, bf16 matmul "
             f"{data['ceilings'].get('matmul_bf16_flops_per_s', 0) / 1e12:.0f} TFLOP/s)", ""]
    for r in data["runs"]:
        if "error" in r:
            lines += [f"**{r['config']}**: {r['error']}", ""]
            continue
        v = r["vs_roofline"]
        lines += [f"**{data['model']} {r['config']}** ({r['attention']} attention): step "
                  f"{r['step_ms_median']:.1f} ms (min {r['step_ms_min']:.1f}, max "
                  f"{r['step_ms_max']:.1f}), MFU {r['mfu']:.3f}; kernels measured "
                  f"{v['measured_kernels_ms']:.1f} ms against {v['priced_ms']:.1f} ms priced "
                  f"(x{v['ratio_classified']:.2f}; kernels of asynchronous fusions, classed "
                  f"by name: {v['unnamed_ms']:.2f} ms)", "",
                  "| class | priced ms | measured ms | measured / priced | H100 price ms |",
                  "|---|---:|---:|---:|---:|"]
        h = r["vs_h100_roofline"]["by_class"]
        for cls, c in v["by_class"].items():
            ratio = "-" if c["ratio"] is None else f"{c['ratio']:.2f}"
            lines.append(f"| {cls} | {c['priced_ms']:.2f} | {c['measured_ms']:.2f} | "
                         f"{ratio} | {h[cls]['priced_ms']:.2f} |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.reprice:
        path = args.out / f"{args.name}.json"
        data = reprice(json.loads(path.read_text()), args.hlo_dir or args.out, args.name,
                       args.top)
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")
        md = markdown(data)
        path.with_suffix(".md").write_text(md + "\n")
        print(md)
        print(f"wrote {path}")
        return 0
    if args.allow_cpu:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.attention = "xla"
    else:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {NO_COMMAND_BUFFERS}".strip()
    import jax

    device = jax.devices()[0]
    if device.platform != "gpu" and not args.allow_cpu:
        print(f"gpu-calibrate: no GPU (platform {device.platform}); run it where one is, "
              "or pass --allow-cpu for a dry run", file=sys.stderr)
        return 2
    roofline = roofline_for(device.device_kind)
    shape = shape_of(args.model)
    args.out.mkdir(parents=True, exist_ok=True)
    data = {"device": device.device_kind, "platform": device.platform,
            "jax": jax.__version__, "model": shape.name, "params": shape.params,
            "seq": args.seq, "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "roofline": {"bf16_flops_per_s": roofline.flops_rate("bf16"),
                         "memory_bytes_per_s": roofline.memory_bytes_per_s},
            "runs": []}
    try:
        data["ceilings"] = ceilings(args.allow_cpu)
    except Exception as e:  # noqa: BLE001 -- the runs below still go
        traceback.print_exc()
        data["ceilings"] = {"error": f"{type(e).__name__}: {e}"}
    path = args.out / f"{args.name}.json"
    failed = False
    for config in args.configs:
        print(f"== {config}", flush=True)
        try:
            data["runs"].append(calibrate(config, args, shape, roofline, args.out))
        except Exception as e:  # noqa: BLE001 -- the next config still runs
            traceback.print_exc()
            failed = True
            data["runs"].append({"config": config, "error": f"{type(e).__name__}: {e}"})
        path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    md = markdown(data)
    path.with_suffix(".md").write_text(md + "\n")
    print("\n" + md)
    print(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
