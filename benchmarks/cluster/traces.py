"""Where a node's step goes: summarizes the ``jax.profiler`` traces that
``benchmarks/cluster/run.py``'s ``MODE@trace`` rows write (``perfetto_trace.json.gz`` under
``OUT/NAME_traces/ROW/BANDWIDTH/node<i>/``).

    .venv/bin/python benchmarks/cluster/traces.py benchmarks/out/NAME_traces [--json OUT.json]

``--json`` writes ``{"trace_summaries": [...]}``, one summary per trace (the docs render
its per-device overlap as a table).

Per trace (one node, one timed phase of ``steps`` steps), per step:

* ``wall``: the phase's wall time (first to last event of the Python thread's steps);
* ``host``: Python's own time in the step (building and placing the batch, dispatch), i.e.
  the step minus its wait for the result (``__float__``/``block_until_ready``);
* per XLA executor thread (``tf_XLAEigen``: the thunk executor's threads, one per device
  in practice): time in collective thunks (all-gather, all-to-all, reduce-scatter,
  all-reduce, psum, collective-permute: gloo, including the wait for the peers),
  in compute thunks (every other op: fusions, YNNPACK matmuls, copies) and idle;
* per device (the ``device_ordinal`` of its thunks, on whichever thread they ran): the time
  covered by its collective thunks, by its compute thunks, and by both at once, the overlap
  of communication with compute that XLA's thunk executor gave;
* the top ops by time.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import pathlib
import re
import sys
from typing import Any

COLLECTIVE = re.compile(r"all[-_]gather|all[-_]to[-_]all|reduce[-_]scatter|all[-_]reduce|psum"
                        r"|collective[-_]permute|ppermute", re.I)
ENVELOPE = re.compile(r"^ThunkExecutor::Execute")


def _union(spans: list[tuple[float, float]]) -> list[list[float]]:
    out: list[list[float]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _covered(spans: list[list[float]]) -> float:
    return sum(b - a for a, b in spans)


def _intersection(xs: list[list[float]], ys: list[list[float]]) -> float:
    """Time covered by both of two sorted, disjoint span lists."""
    i = j = 0
    total = 0.0
    while i < len(xs) and j < len(ys):
        total += max(0.0, min(xs[i][1], ys[j][1]) - max(xs[i][0], ys[j][0]))
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def device_overlap(ops: list[dict], n: int) -> dict[str, dict[str, float]]:
    """Per device ordinal, per step: seconds covered by its collective thunks, by its compute
    thunks, and by both at once. ``ops``: trace events of thunks (``args`` with ``hlo_op``
    and ``device_ordinal``)."""
    out = {}
    for dev in sorted({e["args"]["device_ordinal"] for e in ops}):
        mine = [e for e in ops if e["args"]["device_ordinal"] == dev]
        coll = _union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                       if COLLECTIVE.search(e["name"])])
        comp = _union([(e["ts"], e["ts"] + e["dur"]) for e in mine
                       if not COLLECTIVE.search(e["name"])])
        out[str(dev)] = {"collective_per_step_s": _covered(coll) / 1e6 / n,
                         "compute_per_step_s": _covered(comp) / 1e6 / n,
                         "both_per_step_s": _intersection(coll, comp) / 1e6 / n}
    return out


def summarize(path: pathlib.Path, steps: int | None = None, top: int = 12) -> dict[str, Any]:
    ev = json.load(gzip.open(path))["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in ev
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
    xs = [e for e in ev if e.get("ph") == "X"]
    py = [e for e in xs if names.get(e["tid"]) == "python"]
    steps_ev = [e for e in py if e["name"].endswith(" one_step")]
    n = steps or len(steps_ev) or 1
    if steps_ev:
        t0 = min(e["ts"] for e in steps_ev)
        t1 = max(e["ts"] + e["dur"] for e in steps_ev)
    else:
        t0 = min(e["ts"] for e in xs)
        t1 = max(e["ts"] + e.get("dur", 0) for e in xs)
    wall = (t1 - t0) / 1e6
    waits = sum(e["dur"] for e in py if e["name"] in ("np.asarray(jax.Array)",)
                or e["name"].endswith("block_until_ready")) / 1e6
    step_total = sum(e["dur"] for e in steps_ev) / 1e6
    out: dict[str, Any] = {"trace": str(path), "steps": n, "wall_per_step_s": wall / n,
                           "host_per_step_s": (step_total - waits) / n if steps_ev else None,
                           "wait_per_step_s": waits / n, "threads": {}}
    ops = collections.Counter()
    for tid, tname in names.items():
        if not tname.startswith(("tf_XLAEigen", "tf_XLAPjRtCpuClient")):
            continue
        mine = [e for e in xs if e["tid"] == tid and t0 <= e["ts"] <= t1]
        coll = sum(e["dur"] for e in mine if not ENVELOPE.match(e["name"])
                   and COLLECTIVE.search(e["name"])) / 1e6
        comp = sum(e["dur"] for e in mine if not ENVELOPE.match(e["name"])
                   and not COLLECTIVE.search(e["name"])) / 1e6
        env = sum(e["dur"] for e in mine if e["name"] == "ThunkExecutor::Execute") / 1e6
        for e in mine:
            if not ENVELOPE.match(e["name"]):
                ops[re.sub(r"\.\d+$", "", e["name"])] += e["dur"]
        out["threads"][tname] = {"collective_per_step_s": coll / n, "compute_per_step_s": comp / n,
                                 "executing_per_step_s": env / n,
                                 "idle_per_step_s": max(0.0, wall - coll - comp) / n}
    out["top_ops_per_step_ms"] = {k: round(v / 1e3 / n, 2) for k, v in ops.most_common(top)}
    out["devices"] = device_overlap(
        [e for e in xs if t0 <= e["ts"] <= t1 and "hlo_op" in (e.get("args") or {})
         and "device_ordinal" in e["args"]], n)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("root", type=pathlib.Path, help="a traces directory (searched recursively)")
    p.add_argument("--json", type=pathlib.Path, default=None)
    p.add_argument("--top", type=int, default=12)
    a = p.parse_args(argv)
    files = sorted(a.root.rglob("perfetto_trace.json.gz"))
    if not files:
        print(f"no perfetto_trace.json.gz under {a.root}", file=sys.stderr)
        return 1
    results = []
    for f in files:
        s = summarize(f, top=a.top)
        rel = f.relative_to(a.root).parts
        rel = rel[:rel.index("plugins")] if "plugins" in rel else rel
        s["trace"] = "/".join(rel)  # ROW/BANDWIDTH/node<i>
        results.append(s)
        print(f"== {'/'.join(rel)}: {s['steps']} steps, wall {s['wall_per_step_s'] * 1e3:.1f} "
              f"ms/step, python host {1e3 * (s['host_per_step_s'] or 0):.1f} ms/step, "
              f"python waiting {s['wait_per_step_s'] * 1e3:.1f} ms/step")
        for t, v in s["threads"].items():
            print(f"   {t[:26]:<26} collective {v['collective_per_step_s'] * 1e3:7.1f}  "
                  f"compute {v['compute_per_step_s'] * 1e3:7.1f}  "
                  f"idle {v['idle_per_step_s'] * 1e3:7.1f} ms/step")
        for d, v in s["devices"].items():
            print(f"   device {d:<19} collective {v['collective_per_step_s'] * 1e3:7.1f}  "
                  f"compute {v['compute_per_step_s'] * 1e3:7.1f}  "
                  f"both at once {v['both_per_step_s'] * 1e3:7.1f} ms/step")
        print("   top ops (ms/step, summed over threads): " + ", ".join(
            f"{k} {v}" for k, v in s["top_ops_per_step_ms"].items()))
    if a.json:
        a.json.write_text(json.dumps({"trace_summaries": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
