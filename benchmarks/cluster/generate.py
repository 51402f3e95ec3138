"""Generation and the RLHF loop on the emulated cluster: ZeRO-3 vs ZeRO++ (hpZ) per bandwidth.

    sudo .venv/bin/python benchmarks/cluster/generate.py            # ~15 min on 2 cores
    sudo .venv/bin/python benchmarks/cluster/generate.py --quick    # tiny, ~3 min

Builds the cluster of ``benchmarks/cluster/run.py`` (``--nodes`` node namespaces on a bridge,
each node's egress shaped with ``tc tbf``, gloo between node processes, loopback inside a
node) and, for every bandwidth and mode (``zero3``: every unit gathered across nodes for
every token; ``zeropp``: qwZ + hpZ + qgZ, so each generated token gathers inside the node):

* ``benchmarks/cluster/generate_node.py``: tokens/s of KV-cached generation (``zpp.generate``,
  ``--batch`` prompts, ``--new-tokens`` new tokens, the hpZ secondary gathered once per
  call and counted in) and of the older cache-less generator, median over ``--rounds``;
  cross-node bytes per node per token from the compiled programs;
* ``examples/rlhf.py`` run as one process per node: median seconds per phase (generate,
  reward, train) over its iterations after the first.

Ratios are taken within one run: hpZ ÷ ZeRO-3 generation tokens/s, KV ÷ cache-less, and
the RLHF phases' ZeRO-3 ÷ ZeRO++ times. Writes ``OUT/NAME.json`` (default
``benchmarks/out/cluster_generate.json``; ``--out benchmarks/results`` replaces the
tracked results the docs show). The one-device comparison (``zpp.generate`` against a
plain ``jax.jit`` KV decoder) is ``benchmarks/generation.py``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Callable

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster import run as cl  # noqa: E402  (the cluster's namespaces and links)
from benchmarks.cli import add_out_argument, write_json  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2, help="CPU devices per node")
    p.add_argument("--bandwidths", default="100mbit,1gbit")
    p.add_argument("--modes", default="zero3,zeropp")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=8, help="prompts per generation")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--rlhf-steps", type=int, default=5, help="RLHF iterations (0: skip)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--quick", action="store_true", help="a tiny model and 8 new tokens")
    p.add_argument("--subnet", default="10.213.0")
    p.add_argument("--port", type=int, default=23456)
    add_out_argument(p)
    p.add_argument("--name", default="cluster_generate")
    args = p.parse_args(argv)
    if args.quick:
        args.layers, args.d_model, args.new_tokens, args.rounds, args.rlhf_steps = 2, 64, 8, 2, 3
    return args


def run_nodes(cluster: cl.Cluster, port: int, script: str, flags: list[str],
              json_path: pathlib.Path, process_flags: Callable[[int, int], list[str]]) -> dict:
    """One ``script`` process per node namespace; process 0 writes ``json_path``."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES", "JAX_PLATFORMS")}
    env.update(JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    procs, logs = [], []
    for i in range(cluster.nodes):
        cmd = ["ip", "netns", "exec", cl.node_ns(i), sys.executable, str(ROOT / script),
               *process_flags(i, port), *flags]
        if i == 0:
            cmd += ["--json", str(json_path)]
        logs.append(json_path.with_suffix(f".node{i}.log"))
        with open(logs[-1], "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          text=True, env=env))
    for i, (p, log) in enumerate(zip(procs, logs)):
        if p.wait(timeout=1800) != 0:
            raise SystemExit(f"{script} node {i} failed ({p.returncode}):\n"
                             f"{log.read_text()[-3000:]}")
    return json.loads(json_path.read_text())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cl.check_environment()
    cl.cleanup_leftovers(verbose=False)
    cluster = cl.Cluster(args.nodes, args.subnet, 0.0)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    model = ["--layers", str(args.layers), "--d-model", str(args.d_model),
             "--heads", str(args.heads), "--compute-dtype", args.compute_dtype]
    gen_flags = model + ["--batch", str(args.batch), "--prompt-len", str(args.prompt_len),
                         "--new-tokens", str(args.new_tokens), "--rounds", str(args.rounds),
                         "--local-devices", str(args.local)]
    # Each run's JSON and its processes' logs (kept, and named, only if a run fails).
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f"{args.name}_runs_"))
    port = [args.port]

    def gen_process(i: int, p: int) -> list[str]:
        return ["--coordinator", f"{cluster.addr(0)}:{p}", "--num-processes",
                str(cluster.nodes), "--process-id", str(i)]

    cells = []
    try:
        cluster.build()
        for bw in args.bandwidths.split(","):
            cluster.shape(bw)
            for mode in args.modes.split(","):
                port[0] += 1
                cl.log(f"{bw} {mode}: generation")
                gen = run_nodes(cluster, port[0], "benchmarks/cluster/generate_node.py",
                                gen_flags + ["--mode", mode], tmp / f"gen-{bw}-{mode}.json",
                                gen_process)
                cell = {"bandwidth": bw, "mode": mode, "generation": gen}
                if args.rlhf_steps:
                    port[0] += 1
                    cl.log(f"{bw} {mode}: rlhf")
                    cell["rlhf"] = run_nodes(
                        cluster, port[0], "examples/rlhf.py",
                        ["--mode", mode, "--local", str(args.local), "--steps",
                         str(args.rlhf_steps), "--layers", str(args.layers), "--d-model",
                         str(args.d_model), "--heads", str(args.heads), "--compute-dtype",
                         args.compute_dtype, "--new-tokens", str(args.new_tokens // 2)],
                        tmp / f"rlhf-{bw}-{mode}.json", gen_process)
                cells.append(cell)
    finally:
        cluster.teardown()
    shutil.rmtree(tmp, ignore_errors=True)
    result = {"nodes": args.nodes, "local": args.local, "args": vars(args) | {
        "out": str(args.out)}, "cells": cells, "ratios": ratios(cells),
        "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    print(table(result))
    write_json(args.out, f"{args.name}.json", result)
    return 0


def ratios(cells: list[dict]) -> list[dict]:
    """Per bandwidth: hpZ ÷ ZeRO-3 generation tokens/s, KV ÷ cache-less (each mode), and the
    RLHF phases' ZeRO-3 ÷ ZeRO++ median times."""
    out = []
    for bw in dict.fromkeys(c["bandwidth"] for c in cells):
        by = {c["mode"]: c for c in cells if c["bandwidth"] == bw}
        if not {"zero3", "zeropp"} <= set(by):
            continue
        z3, zp = by["zero3"]["generation"], by["zeropp"]["generation"]
        row = {"bandwidth": bw,
               "hpz_over_zero3_tokens_per_s": zp["tokens_per_s"]["kv"] / z3["tokens_per_s"]["kv"]}
        for mode, g in (("zero3", z3), ("zeropp", zp)):
            if "cacheless" in g["tokens_per_s"]:
                row[f"kv_over_cacheless_{mode}"] = (g["tokens_per_s"]["kv"]
                                                    / g["tokens_per_s"]["cacheless"])
        if "rlhf" in by["zero3"] and "rlhf" in by["zeropp"]:
            for phase in ("generate_s", "train_s"):
                row[f"rlhf_{phase[:-2]}_zero3_over_zeropp"] = (
                    by["zero3"]["rlhf"]["median_s"][phase] / by["zeropp"]["rlhf"]["median_s"][phase])
        out.append(row)
    return out


def table(result: dict) -> str:
    lines = ["| link | mode | KV tokens/s (spread) | cache-less tokens/s | cross-node B/token/node "
             "| RLHF generate s | RLHF train s |", "|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        g = c["generation"]
        n = g["batch"] * g["new_tokens"]
        kv = [n / t for t in g["times_s"]["kv"]]
        cl_ = g["tokens_per_s"].get("cacheless")
        r = c.get("rlhf", {}).get("median_s", {})
        lines.append(
            f"| {c['bandwidth']} | {c['mode']} | {g['tokens_per_s']['kv']:.1f} "
            f"({min(kv):.1f}-{max(kv):.1f}) | {'-' if cl_ is None else f'{cl_:.1f}'} | "
            f"{g['cross_node_bytes_per_node']['kv_token']:.0f} | "
            f"{r.get('generate_s', float('nan')):.3f} | {r.get('train_s', float('nan')):.3f} |")
    for r in result["ratios"]:
        lines.append(f"{r['bandwidth']}: " + ", ".join(
            f"{k} {v:.2f}x" for k, v in r.items() if k != "bandwidth"))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
