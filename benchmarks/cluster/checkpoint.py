"""Multi-host checkpoints on the emulated cluster: 2 node processes save, others resume.

    sudo .venv/bin/python benchmarks/cluster/checkpoint.py [--out DIR]   # ~3 min on 2 cores

Builds the cluster of ``benchmarks/cluster/run.py`` (2 node namespaces, tc-shaped links, gloo)
and runs its node worker ``benchmarks/cluster/node.py`` (fp32, so runs on different meshes
agree to rounding):

1. on the cluster, 6 steps straight (the reference);
2. on the cluster, the same 6-step schedule stopped after 4 steps with ``--save``: each
   node process writes its own shards;
3. on the cluster again, ``--resume`` to step 6 (2 processes read their shards back);
4. outside the cluster, 1 process with 2 devices (mesh 1x2), ``--resume`` to step 6 from
   a copy of the checkpoint of 2.

Steps 5-6 of 3 and 4 must equal steps 5-6 of 1 (rtol 1e-5: only the order of the
cross-device sums differs). Prints a table and writes ``OUT/cluster_checkpoint.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import shutil
import subprocess
import sys
import tempfile

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.cluster import run as cl  # noqa: E402  (the cluster's namespaces and links)
from benchmarks.cli import add_out_argument, write_json  # noqa: E402

MODEL = ["--batch", "8", "--seq-len", "32", "--layers", "2", "--d-model", "64", "--heads", "2",
         "--compute-dtype", "float32", "--seed", "0", "--no-progress", "--init-timeout", "120"]


def run_on_cluster(cluster: cl.Cluster, port: int, steps: int, extra: list[str],
                   out: pathlib.Path) -> dict:
    procs = []
    for i in range(cluster.nodes):
        cmd = ["ip", "netns", "exec", cl.node_ns(i), sys.executable,
               str(ROOT / "benchmarks/cluster/node.py"), "--coordinator",
               f"{cluster.addr(0)}:{port}",
               "--num-processes", str(cluster.nodes), "--process-id", str(i),
               "--local-devices", "2", "--steps", str(steps), *MODEL, *extra]
        if i == 0:
            cmd += ["--json", str(out)]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for i, (p, log) in enumerate(zip(procs, logs)):
        if p.returncode != 0:
            raise SystemExit(f"node {i} failed ({p.returncode}):\n{log[-3000:]}")
    return json.loads(out.read_text())


def run_alone(port: int, steps: int, extra: list[str], out: pathlib.Path) -> dict:
    cmd = [sys.executable, str(ROOT / "benchmarks/cluster/node.py"), "--coordinator",
           f"127.0.0.1:{port}", "--num-processes", "1", "--process-id", "0",
           "--local-devices", "2", "--steps", str(steps), *MODEL, *extra, "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        raise SystemExit(f"single process failed:\n{(r.stdout + r.stderr)[-3000:]}")
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--bandwidth", default="1gbit", help="tc rate of every node's link")
    add_out_argument(p)
    args = p.parse_args(argv)
    cl.check_environment()
    work = pathlib.Path(tempfile.mkdtemp(prefix="zpp-ckpt-"))
    cluster = cl.Cluster(2, "10.213.0", 0.0)
    try:
        cluster.build()
        cluster.shape(args.bandwidth)
        ref = run_on_cluster(cluster, cl.PORT + 20, 6, [], work / "ref.json")
        run_on_cluster(cluster, cl.PORT + 21, 6, ["--save", str(work / "ck"),
                                                  "--stop-after", "4"], work / "save.json")
        meta = json.loads(next((work / "ck").glob("step_*/meta.json")).read_text())
        stores = sorted(p.name for p in (work / "ck").glob("step_*/arrays/ocdbt.process_*"))
        shutil.copytree(work / "ck", work / "ck_alone")
        back = run_on_cluster(cluster, cl.PORT + 22, 6,
                              ["--save", str(work / "ck"), "--resume"], work / "back.json")
    finally:
        cluster.teardown()
    alone = run_alone(cl.PORT + 23, 6, ["--save", str(work / "ck_alone"), "--resume"],
                      work / "alone.json")
    want = ref["losses"][4:6]
    rows = [("2 processes, uninterrupted (reference)", want),
            ("2 processes, resumed on the cluster", back["losses"]),
            ("1 process (1x2), resumed", alone["losses"])]
    ok = all(np.allclose(r, want, rtol=1e-5, atol=0) for _, r in rows)
    print(f"\ncheckpoint written by {meta['written_on']['processes']} processes "
          f"({meta['written_on']['nodes']}x{meta['written_on']['local']}), "
          f"stores {stores}, link {args.bandwidth}")
    print(f"{'run':42s} loss step 5   loss step 6")
    for name, losses in rows:
        print(f"{name:42s} {losses[0]:.7f}    {losses[1]:.7f}")
    print("equal to the reference (rtol 1e-5):", ok)
    write_json(args.out, "cluster_checkpoint.json", {
        "bandwidth": args.bandwidth, "written_on": meta["written_on"]["processes"],
        "stores": stores, "rows": [{"run": n, "losses": r} for n, r in rows], "equal": ok})
    shutil.rmtree(work, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
