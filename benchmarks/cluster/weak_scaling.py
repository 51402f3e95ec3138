"""Weak scaling on the emulated cluster: the ``run.py --predict`` runs of 2, 3 and 4
node processes of one device each, with the same rows per device, side by side.

    .venv/bin/python benchmarks/cluster/weak_scaling.py     # reads benchmarks/results
    .venv/bin/python benchmarks/cluster/weak_scaling.py --runs A.json,B.json --out DIR

Reads the runs (default ``benchmarks/results/predict_{2x1,3x1,4x1}.json``; they must share
the model, the rows per device and the link speeds), prints one line per (link, row): the
median step time at each node count, its round-to-round spread, the model's prediction and
the step time relative to the fewest nodes; writes ``OUT/weak_scaling.json`` and
``OUT/weak_scaling.png``. Measures nothing itself: every number comes from the runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.cli import OUT_HELP, pyplot  # noqa: E402

DEFAULT_RUNS = [ROOT / "benchmarks" / "results" / f"predict_{n}x1.json" for n in (2, 3, 4)]
ROWS = ("zero3", "zeropp", "torch_fsdp2")


def rows_per_device(run: dict) -> float:
    return run["model"]["batch"] / (run["nodes"] * run["local"])


def combine(runs: list[dict], names: list[str]) -> dict[str, Any]:
    """One entry per (link, row) with each run's measured median, spread and prediction.
    Raises ``ValueError`` when the runs do not form a weak-scaling series (another model,
    another batch per device, other links, or a row one of them lacks)."""
    first = runs[0]
    model = {k: v for k, v in first["model"].items() if k != "batch"}
    for run, name in zip(runs, names):
        if {k: v for k, v in run["model"].items() if k != "batch"} != model:
            raise ValueError(f"{name}: another model than {names[0]}'s")
        if rows_per_device(run) != rows_per_device(first):
            raise ValueError(f"{name}: {rows_per_device(run)} rows per device, "
                             f"{names[0]} has {rows_per_device(first)} (weak scaling keeps it)")
        if run["bandwidths"] != first["bandwidths"]:
            raise ValueError(f"{name}: links {run['bandwidths']}, {names[0]} has "
                             f"{first['bandwidths']}")
    entries = []
    for bw in first["bandwidths"]:
        for row in ROWS:
            points = []
            for run, name in zip(runs, names):
                cell = next((c for c in run["cells"]
                             if c["row"] == row and c["bandwidth"] == bw), None)
                if cell is None:
                    raise ValueError(f"{name}: no {row} cell at {bw}")
                medians = cell["round_medians_s"]
                points.append({
                    "nodes": run["nodes"], "local": run["local"], "run": name,
                    "step_s": cell["step_time_median_s"],
                    "spread": (max(medians) - min(medians)) / cell["step_time_median_s"],
                    "predicted_s": cell.get("predicted_step_s"),
                })
            entries.append({"bandwidth": bw, "row": row, "points": points})
    # What each node count costs with no network at all: on a machine of few cores the node
    # processes share the cores, so the compute grows with their number too.
    floors = [{"nodes": run["nodes"], **{m: run["floors_s"].get(m) for m in ROWS}}
              for run in runs]
    return {"model": model, "rows_per_device": rows_per_device(first),
            "rounds": first["rounds"], "bandwidths": first["bandwidths"],
            "runs": names, "entries": entries, "floors_s": floors}


def lines(result: dict) -> list[str]:
    out = []
    for e in result["entries"]:
        base = e["points"][0]["step_s"]
        out.append(f"{e['bandwidth']:>8} {e['row']:<12} " + "  ".join(
            f"{p['nodes']} nodes {1e3 * p['step_s']:7.0f} ms ±{50 * p['spread']:.0f}% "
            f"(x{p['step_s'] / base:.2f})" for p in e["points"]))
    for m in ROWS:
        if any(f[m] is None for f in result["floors_s"]):
            continue
        out.append(f"{'no link':>8} {m + ' floor':<12} " + "  ".join(
            f"{f['nodes']} nodes {1e3 * f[m]:7.0f} ms" for f in result["floors_s"]))
    return out


def plot(result: dict, path: pathlib.Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    bws = result["bandwidths"]
    fig, axes = plt.subplots(1, len(bws), figsize=(4.2 * len(bws), 3.6), squeeze=False)
    for ax, bw in zip(axes[0], bws):
        for e in result["entries"]:
            if e["bandwidth"] != bw:
                continue
            xs = [p["nodes"] for p in e["points"]]
            ax.plot(xs, [1e3 * p["step_s"] for p in e["points"]], "o-", label=e["row"])
            if all(p["predicted_s"] for p in e["points"]):
                ax.plot(xs, [1e3 * p["predicted_s"] for p in e["points"]], "x:",
                        color=ax.lines[-1].get_color())
        ax.set_title(bw)
        ax.set_xlabel("node processes (1 device each)")
        ax.set_xticks(xs)
        ax.set_ylabel("step ms (o measured, x predicted)")
        ax.set_ylim(bottom=0)
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", default=",".join(str(r) for r in DEFAULT_RUNS),
                   help="comma-separated run.py --predict JSON files, fewest nodes first")
    p.add_argument("--out", type=pathlib.Path, default=ROOT / "benchmarks" / "out",
                   help=OUT_HELP)
    args = p.parse_args(argv)
    paths = [pathlib.Path(r) for r in args.runs.split(",")]
    result = combine([json.loads(x.read_text()) for x in paths], [x.stem for x in paths])
    for line in lines(result):
        print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "weak_scaling.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "weak_scaling.png")
    print(f"wrote {args.out / 'weak_scaling.json'} and {args.out / 'weak_scaling.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
