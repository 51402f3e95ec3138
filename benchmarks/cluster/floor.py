"""The no-communication floor of ``benchmarks/cluster/run.py``'s step: each node's share of the
step run by ``peers.py --standalone`` (no jax.distributed, no gloo, no network: one
process with ``--local`` devices, ``batch / nodes`` rows), ``--nodes`` of them at once so
they share the cores as the cluster's node processes do (``--alone``: one process only).

    .venv/bin/python benchmarks/cluster/floor.py --impls zpp:zero3,zpp:zeropp,jax_dp \\
        --variants default,eigen1,pin --reps 2 --layers 4 --d-model 256 --heads 4 \\
        --seq-len 128 --batch 8 --json benchmarks/out/cluster_floor.json

Variants: ``default``; ``eigen1`` (``XLA_FLAGS=--xla_cpu_multi_thread_eigen=false``); ``pin``
(process ``i`` pinned to core ``i % cores`` with ``taskset``); ``alone`` (a single process:
one node's compute with the whole machine). Configurations run in turn, ``--reps`` times,
so drifts of the shared machine hit them alike. Prints the median step time per config.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def run_config(args: argparse.Namespace, impl: str, variant: str) -> list[float]:
    """Step times of process 0 (every process's median, if more than one)."""
    kind, _, mode = impl.partition(":")
    n = 1 if variant == "alone" else args.nodes
    procs = []
    for i in range(n):
        cmd = [sys.executable, str(ROOT / "benchmarks/cluster/peers.py"), "--impl", kind,
               "--standalone", "--coordinator", "none:0", "--num-processes", str(args.nodes),
               "--process-id", "0", "--local-devices", str(args.local),
               "--batch", str(args.batch), "--seq-len", str(args.seq_len),
               "--layers", str(args.layers), "--d-model", str(args.d_model),
               "--heads", str(args.heads), "--steps", "1000",
               "--compute-dtype", getattr(args, "compute_dtype", "bfloat16")]
        if kind == "zpp":
            cmd += ["--mode", mode or "zero3", "--reduce-scatter", "hierarchical"]
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
        env["JAX_PLATFORMS"] = "cpu"
        if variant == "eigen1":
            env["XLA_FLAGS"] = "--xla_cpu_multi_thread_eigen=false"
        if variant == "pin":
            cmd = ["taskset", "-c", str(i % (os.cpu_count() or 1))] + cmd
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        procs.append(p)
    for p in procs:  # wait until every process compiled, then start the phase together
        line = p.stdout.readline()
        if not line.startswith("ZPP-READY"):
            raise RuntimeError(f"{impl} {variant}: {line!r}")
    cmd = json.dumps({"steps": args.steps, "warmup": args.warmup, "label": variant}) + "\nquit\n"
    for p in procs:
        p.stdin.write(cmd)
        p.stdin.flush()
    times = []
    for p in procs:
        for line in p.stdout:
            if line.startswith("ZPP-PHASE"):
                times.append(json.loads(line.split(" ", 1)[1])["times"])
                break
        p.wait(timeout=120)
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impls", default="zpp:zero3,zpp:zeropp,jax_dp")
    p.add_argument("--variants", default="default,eigen1,pin,alone")
    p.add_argument("--reps", type=int, default=2)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (each process: / nodes)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--json", type=pathlib.Path, default=None)
    a = p.parse_args(argv)
    configs = [(i, v) for i in a.impls.split(",") for v in a.variants.split(",")]
    res: dict[str, list[float]] = {}
    for rep in range(a.reps):
        for impl, variant in configs:
            meds = run_config(a, impl, variant)
            res.setdefault(f"{impl} {variant}", []).extend(meds)
            ms = [round(m * 1e3, 1) for m in meds]
            print(f"rep {rep + 1} {impl:<11} {variant:<8} step {ms} ms "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
    print()
    for k, v in res.items():
        print(f"{k:<22} median {statistics.median(v) * 1e3:7.1f} ms/step  (all: "
              f"{[round(x * 1e3) for x in v]})")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"args": vars(a) | {"json": str(a.json)}, "results": res},
                                     indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
