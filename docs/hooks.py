"""Result tables for the docs, rendered from ``benchmarks/results/*.json`` at build time.

A page asks for a table with a marker on a line of its own::

    <!-- table: keep_3m -->
    <!-- table: gpu_check_h100/bandwidth -->

``NAME`` is a file in ``benchmarks/results/`` (without ``.json``); ``/VIEW`` picks one of
several tables a file holds. The file's shape (which benchmark wrote it) is recognised from
its keys and picks the renderer; a file of unknown shape, an unknown view, a missing file or a
malformed marker raises, so ``mkdocs build --strict`` fails instead of printing nothing.

MkDocs runs :func:`on_page_markdown` for every page (``hooks:`` in ``mkdocs.yml``). Nothing
is written to disk. To see a table without building the site::

    .venv/bin/python docs/hooks.py keep_3m
    .venv/bin/python docs/hooks.py            # lists every NAME and NAME/VIEW
"""

from __future__ import annotations

import collections
import json
import pathlib
import re
import statistics
import sys
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

MARKER = re.compile(r"<!--\s*table:\s*([A-Za-z0-9_.\-]+)(?:/([A-Za-z0-9_\-]+))?\s*-->")
ANY_MARKER = re.compile(r"<!--\s*table\b[^>]*-->")


class TableError(ValueError):
    """A marker that cannot be rendered (unknown file shape, view, or missing file)."""


# --------------------------------------------------------------------------- formatting


def _int(x: float) -> str:
    return f"{int(round(x)):,}"


def _x(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def _pct(x: float, digits: int = 1) -> str:
    return f"{100 * x:.{digits}f}%"


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _bandwidth(name: str) -> str:
    m = re.fullmatch(r"(\d+)(mbit|gbit)", name)
    if not m:
        return name
    return f"{m.group(1)} {'Mbit/s' if m.group(2) == 'mbit' else 'Gbit/s'}"


def _need(data: dict, keys: list[str], what: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise TableError(f"{what}: missing keys {missing}")


# --------------------------------------------------------------------------- emulated cluster

PEERS = {"torch_fsdp2": "FSDP2", "jax_fsdp": "JAX FSDP", "jax_dp": "JAX DP"}
ROW_NAMES = {
    "zero3@regather": "zero3, every unit regathers",
    "zeropp@regather": "zeropp, every unit regathers",
    "zero3@agflat": "zero3, flat gather",
    "zeropp@agflat": "zeropp, flat gather",
}


def cluster(data: dict, view: str | None) -> str:
    """Step times of ``benchmarks/cluster/run.py``: one row per link speed, one column per row
    of the run. The first column is the reference (FSDP2 when the run has it, else zero3) in
    ms; the others are its step time divided by theirs (> 1: faster than the reference)."""
    _no_view(view, "cluster")
    cells = data["cells"]
    bandwidths = data["bandwidths"]
    order: list[str] = []
    for c in cells:
        if c["row"] not in order:
            order.append(c["row"])
    ref = "torch_fsdp2" if "torch_fsdp2" in order else "zero3"
    if ref not in order:
        raise TableError("cluster: the run has neither a torch_fsdp2 nor a zero3 row")
    # The reference first, then the other peers, then zeropp_jax's rows in run order.
    cols = ([ref] + [r for r in order if r != ref and r in PEERS]
            + [r for r in order if r != ref and r not in PEERS])
    t = {(c["row"], c["bandwidth"]): c for c in cells}
    ours = [r for r in cols if r not in PEERS and not r.startswith("probe")]
    header = ["link"] + [PEERS.get(r, ROW_NAMES.get(r, r)) for r in cols]
    rows = []
    def spread(c: dict) -> str:  # half the spread of the round medians, where recorded
        m = c.get("round_medians_s")
        return f" ±{50 * (max(m) - min(m)) / c['step_time_median_s']:.0f}%" if m else ""

    for bw in bandwidths:
        ref_s = t[(ref, bw)]["step_time_median_s"]
        row = [_bandwidth(bw), f"{1000 * ref_s:.0f} ms{spread(t[(ref, bw)])}"]
        for r in cols[1:]:
            c = t.get((r, bw))
            if c is None:
                row.append("")
                continue
            cell = _x(ref_s / c["step_time_median_s"]) + spread(c)
            if ref != "zero3" and r in ours and r != "zero3" and ("zero3", bw) in t:
                cell += f" ({_x(t[('zero3', bw)]['step_time_median_s'] / c['step_time_median_s'])} zero3)"
            row.append(cell)
        rows.append(row)
    ratio_row = ["link bytes measured / predicted"]
    for r in cols:
        ratios = [t[(r, bw)]["measured_tx_bytes_per_node_per_step"]
                  / t[(r, bw)]["predicted_bytes_per_node_compiled"]
                  for bw in bandwidths
                  if (r, bw) in t and t[(r, bw)].get("predicted_bytes_per_node_compiled")]
        ratio_row.append(f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "")
    rows.append(ratio_row)
    m = data["model"]
    caption = (
        f"GPT of {m['params']:,} parameters ({m['layers']} layers, d_model {m['d_model']}, "
        f"{m['heads']} heads, sequence {m['seq_len']}, batch {m['batch']}, "
        f"{m['compute_dtype']}); {data['nodes']} node processes x {data['local']} devices; "
        f"median step time over {data['rounds']} interleaved rounds; "
        f"reference column: {PEERS.get(ref, ref)} in ms, other columns: its time / theirs "
        "(± half the spread of the row's round medians)."
    )
    notes = {r.get("worker", {}).get("torch_dtype_note") for r in data["runs"].values()} - {None}
    caption += "".join(f" {n}." for n in sorted(notes))
    return _table(header, rows) + "\n\n" + caption


def cluster_predicted(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/run.py --predict``: views ``measured`` (the ``cluster`` table),
    ``predicted`` (measured and predicted step time per row and link), ``auto`` (the
    automatic configuration's choice per link against the fastest measured row)."""
    calib = data["calibration"]
    if view == "measured":
        return cluster(data, None)
    if view == "auto":
        rows = [[_bandwidth(a["bandwidth"]), a["chosen"], a["fastest_measured"],
                 f"{a['chosen_over_fastest']:.3f}", "yes" if a["within_5pct"] else "no"]
                for a in calib["auto"]]
        return _table(["link", "auto chose", "fastest measured", "chosen's time / fastest",
                       "within 5%"], rows) + (
            f"\n\n{data['nodes']} node processes x {data['local']} devices; the candidates are "
            "the measured zeropp_jax rows, ranked by the cost model with this run's constants.")
    if view == "targets":
        return _cluster_targets(data)
    if view != "predicted":
        raise TableError("cluster --predict results: views measured, predicted, auto, targets")
    cells = data["cells"]
    order = [r for r in dict.fromkeys(c["row"] for c in cells)
             if any("predicted_step_s" in c for c in cells if c["row"] == r)]
    t = {(c["row"], c["bandwidth"]): c for c in cells}
    header = ["link"] + [PEERS.get(r, r) for r in order]
    rows = []
    for bw in data["bandwidths"]:
        row = [_bandwidth(bw)]
        for r in order:
            c = t[(r, bw)]
            spread = (max(c["round_medians_s"]) - min(c["round_medians_s"])) / c[
                "step_time_median_s"]
            fit = " (fitted)" if c.get("predicted_fitted") else ""
            row.append(f"{1000 * c['step_time_median_s']:.0f} ms ±{100 * spread / 2:.0f}% / "
                       f"{1000 * c['predicted_step_s']:.0f} ms = "
                       f"{c['predicted_over_measured']:.2f}{fit}")
        rows.append(row)
    const = calib["constants"]
    lat = ", ".join(f"{_bandwidth(b)} {1000 * v:.2f} ms"
                    for b, v in const["inter_latency_s"].items())
    caption = (
        f"Each cell: measured (median; ± half the spread of the round medians) / predicted = "
        f"predicted ÷ measured. {data['nodes']} node processes x {data['local']} devices, GPT "
        f"of {data['model']['params']:,} parameters. From this run's probes: each row's "
        "compute floor without a network ("
        + ", ".join(f"{PEERS.get(m, m)} {1000 * t:.0f} ms" for m, t in const["floors_s"].items())
        + f"), the fixed cost per collective between processes ({lat}). Fitted on the zero3 "
        f"row (marked): the cluster's compute x{const['kappa']:.2f} of the floor, the link "
        f"at {const['eta']:.2f} of the tc rate. "
        + (f"qwZ's dequantization {const['quant_elems_per_s'] / 1e6:.0f} M elements/s per "
           "device (qwZ's floor over zero3's). " if "quant_elems_per_s" in const else "")
        + (f"qgZ's gradient path {const['grad_quant_elems_per_s'] / 1e6:.0f} M elements/s "
           f"per device, fitted on the {const['grad_quant_fitted_on']} cell (marked; no "
           "single-node floor contains it). " if "grad_quant_fitted_on" in const else "")
        + f"{calib['within_15pct']} of "
        f"{calib['checked_cells']} checked cells within 15%"
        + (f"; FSDP2's compute ({1000 * calib['fsdp2_compute_s']:.0f} ms) fitted on its "
           f"{_bandwidth(calib['fsdp2_fitted_on'])} cell." if calib.get("fsdp2_fitted_on")
           else f"; FSDP2's compute: torch's own floor without a network "
           f"({1000 * const['floors_s']['torch_fsdp2']:.0f} ms) x{const['kappa']:.2f}, "
           "nothing fitted on its cells." if calib.get("fsdp2_compute_s")
           else "."))
    return _table(header, rows) + "\n\n" + caption


def _cluster_targets(data: dict) -> str:
    """The step-time targets against FSDP2, measured, and the most a step that runs its
    compute and its collectives in turn could reach (``calibrate.ceilings``)."""
    targets = data["calibration"].get("targets")
    if not targets:
        raise TableError("cluster --predict results: no targets "
                         "(benchmarks/cluster/calibrate.py RUN.json --write)")
    rows = [[_bandwidth(t["bandwidth"]), f"{t['row']} >= {t['target']}x",
             f"{1000 * t['fsdp2_s']:.0f} ms / {1000 * t['measured_s']:.0f} ms = "
             f"{_x(t['measured'])}" + (" (met)" if t["met"] else ""),
             f"{1000 * t['compute_s']:.0f} + {1000 * t['wire_s']:.0f} + "
             f"{1000 * t['fixed_s']:.0f} ms",
             _x(t["ceiling"]), _x(t["ceiling_without_fixed"])]
            for t in targets]
    header = ["link", "target (FSDP2 / ours)", "measured: FSDP2 / ours",
              "ours without overlap: compute + wire + fixed", "at most",
              "at most, no fixed cost"]
    if all(t.get("fsdp2_floor_s") for t in targets):
        header.append("FSDP2's compute floor")
        for row, t in zip(rows, targets):
            row.append(f"{1000 * t['fsdp2_floor_s']:.0f} ms")
    return _table(header, rows) + (
        f"\n\n{data['nodes']} node processes x {data['local']} devices. Compute: the row's "
        "compute floor without a network (scaled by the fitted cluster factor where that is "
        "below 1); wire: its cross-node bytes per node at the full tc rate; fixed: its "
        "collectives between processes times the probe's cost per collective. \"At most\": "
        "FSDP2's measured time over that sum; \"no fixed cost\": over compute + wire alone, "
        "what merging every collective into one could give at most.")


def weak_scaling(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/weak_scaling.py``: the step time of each row at each node count (one
    device per node, the same rows per device), with the compute floors beneath."""
    _no_view(view, "weak_scaling")
    counts = [f["nodes"] for f in data["floors_s"]]
    header = ["link", "row"] + [f"{n} nodes" for n in counts]
    rows = []
    for e in data["entries"]:
        base = e["points"][0]["step_s"]
        rows.append([_bandwidth(e["bandwidth"]), PEERS.get(e["row"], e["row"])] + [
            f"{1000 * p['step_s']:.0f} ms ±{50 * p['spread']:.0f}% (x{p['step_s'] / base:.2f})"
            for p in e["points"]])
    for m in ("zero3", "zeropp", "torch_fsdp2"):
        if all(f.get(m) for f in data["floors_s"]):
            rows.append(["no network", f"{PEERS.get(m, m)}'s compute floor"]
                        + [f"{1000 * f[m]:.0f} ms" for f in data["floors_s"]])
    m = data["model"]
    return _table(header, rows) + (
        f"\n\nGPT of {m['params']:,} parameters, {data['rows_per_device']:g} sequences of "
        f"{m['seq_len']} tokens per device per step, one device per node process, medians "
        f"over {data['rounds']} rounds (± half the spread of the round medians; x: against "
        f"{counts[0]} nodes). Runs: {', '.join(data['runs'])}. All node processes share "
        "the same 2 CPU cores, so the compute floor (each node's step with no network, all "
        "at once) grows with the node count as well.")


def cluster_floor(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/floor.py --json``: each implementation's step with no network
    (every node's share at once, as the cluster's node processes share the cores)."""
    _no_view(view, "cluster_floor")
    import statistics

    a = data["args"]
    names = {"zpp": "zeropp_jax", "jax_dp": "plain jax.jit, data parallel",
             "jax_fsdp": "JAX FSDP (GSPMD)", "torch_fsdp2": "PyTorch FSDP2, each rank alone"}
    rows = []
    for key, times in data["results"].items():
        impl, _, variant = key.partition(" ")
        kind, _, mode = impl.partition(":")
        label = names.get(kind, kind) + (f" {mode}" if mode else "")
        rows.append([label, variant, f"{1000 * statistics.median(times):.0f} ms",
                     f"{1000 * min(times):.0f}-{1000 * max(times):.0f} ms"])
    return _table(["step", "variant", "median", "range"], rows) + (
        f"\n\nEach node's share of the step with no network: {a['nodes']} processes of "
        f"{a['local']} devices at once on the same cores, GPT {a['layers']}L d{a['d_model']}, "
        f"sequence {a['seq_len']}, global batch {a['batch']}, "
        f"{a.get('compute_dtype', 'bfloat16')}; {a['reps']} repetitions of {a['steps']} "
        "steps, every process's median.")


def trace_overlap(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/traces.py --json``: per traced node and device, the time per step
    its collective thunks and its compute thunks covered, and both at once."""
    _no_view(view, "trace_overlap")
    rows = []
    for s in data["trace_summaries"]:
        row, bw, node = (s["trace"].split("/") + ["", "", ""])[:3]
        for dev, v in s["devices"].items():
            both = v["both_per_step_s"]
            rows.append([row, _bandwidth(bw), node, dev, f"{1000 * s['wall_per_step_s']:.0f} ms",
                         f"{1000 * v['collective_per_step_s']:.0f} ms",
                         f"{1000 * v['compute_per_step_s']:.0f} ms",
                         f"{1000 * both:.0f} ms ({_pct(both / s['wall_per_step_s'], 0)})"])
    steps = sorted({s["steps"] for s in data["trace_summaries"]})
    return _table(["row", "link", "node", "device", "step", "in collectives", "in compute",
                   "both at once (of the step)"], rows) + (
        f"\n\nFrom JAX profiler traces of {'/'.join(map(str, steps))} steps per node: the "
        "time each device's collective thunks covered, its compute thunks covered (on "
        "whichever executor thread they ran), and both at once.")


def predict_paper(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/predict.py``: predicted ZeRO++ / ZeRO-3 speedups on the paper's
    cluster beside the published ones, with the assumed and with the fitted overlap."""
    _no_view(view, "predict_paper")
    rows = []
    for c, f in zip(data["against_published"], data["against_published_fitted"]):
        rows.append([f"{c['inter_gbps']} Gbit/s",
                     "any" if c["tokens_per_gpu"] is None else f"{c['tokens_per_gpu']}",
                     f"{c['published_low']:.2f}-{c['published_high']:.2f}",
                     ", ".join(f"{k}: {_x(v)}" for k, v in c["predicted"].items()),
                     ", ".join(f"{k}: {_x(v)}" for k, v in f["predicted"].items())
                     + (" (fitted here)" if f.get("fitted_here") else ""),
                     c["published"]])
    hw = data["constants"]["v100_dgx2_100"]
    return _table(["between nodes", "tokens per GPU", "published",
                   f"predicted, overlap {hw['overlap']:.1f} (assumed)",
                   f"predicted, overlap {data['fitted_overlap']:.2f} (fitted)",
                   "what was published"], rows) + (
        f"\n\n384 V100 (24 DGX-2 nodes); compute {hw['flops_per_s'] / 1e12:.1f} TFLOP/s per GPU "
        f"(assumed: 0.45 of the fp16 peak), NCCL latencies {1e6 * hw['intra_latency_s']:.0f} / "
        f"{1e6 * hw['inter_latency_s']:.0f} us (assumed). The fitted overlap puts the 18B model "
        "at 1K tokens and 400 Gbit/s in the middle of its published range; the other cells "
        "check it. '200 vs 800' rows: ZeRO++'s throughput at 200 Gbit/s over ZeRO-3's at 800.")


def predict_gpu(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/predict.py``: predicted step times on H100 nodes."""
    _no_view(view, "predict_gpu")
    rows = []
    for r in data["predictions"]:
        rows.append([r["model"], str(r["tokens_per_gpu"]), f"{r['inter_gbps_per_gpu']} Gbit/s",
                     str(r["nodes"]),
                     f"{r['zero3_step_s']:.3f} s" + ("" if r["zero3_fits"] else " (over 80 GiB)"),
                     f"{r['zeropp_step_s']:.3f} s ({_x(r['zeropp_speedup'])})",
                     f"{r['chosen']}", f"{r['chosen_step_s']:.3f} s"])
    hw = data["constants"]["h100_ib400"]
    return _table(["model", "tokens per GPU", "network per GPU", "nodes", "ZeRO-3",
                   "ZeRO++ (speedup)", "auto's choice", "its step"], rows) + (
        f"\n\nPredictions, not measurements: 8 x H100 per node, NVLink "
        f"{hw['intra_bytes_per_s'] / 1e9:.0f} GB/s per GPU, 80 GiB per GPU. Compute "
        f"{hw['flops_per_s'] / 1e12:.0f} TFLOP/s and quantization "
        f"{hw['quant_elems_per_s'] / 1e9:.0f} G elements/s per GPU measured on one H100; NCCL "
        f"latencies ({1e6 * hw['intra_latency_s']:.0f} / {1e6 * hw['inter_latency_s']:.0f} us) "
        f"and overlap ({hw['overlap']:.1f}) assumed. auto breaks ties within 2% toward fewer "
        "techniques; hpz[N]: secondary groups of N GPUs.")


def cluster_checkpoint(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/checkpoint.py``: losses after the stop, per way of resuming."""
    _no_view(view, "cluster_checkpoint")
    n = max(len(r["losses"]) for r in data["rows"])
    header = ["run"] + [f"loss, step {i + 1} after the stop" for i in range(n)]
    rows = [[r["run"]] + [f"{x:.6f}" for x in r["losses"]] for r in data["rows"]]
    verdict = "yes" if data["equal"] else "**no**"
    return (_table(header, rows) + f"\n\nCheckpoint written by {data['written_on']} processes "
            f"(stores: {', '.join(data['stores'])}); resumed losses equal the uninterrupted "
            f"run: {verdict}.")


# --------------------------------------------------------------------------- communication

COMM_MODES = {
    "zero3 (hierarchical RS)": "zero3, hierarchical bf16 reduce-scatter",
    "zero3 (every unit regathers)": "zero3, every unit regathers (`keep_last_unit=False`)",
    "zeropp (INT4 weights)": "zeropp, INT4 weights",
}


def comm_volume(data: dict, view: str | None) -> str:
    """``benchmarks/comm_volume.py``: cross-node bytes per node per step, lowered and compiled."""
    _no_view(view, "comm_volume")
    rows = []
    paper = data.get("vs_regather_all_by_mode", {})
    for name, v in data["modes"].items():
        rows.append([
            COMM_MODES.get(name, name),
            _int(v["lowered_bytes_per_node"]), f"{v['lowered_per_M']:.3f}",
            f"{v['ratio_lowered']:.3f}",
            _int(v["compiled_bytes_per_node"]), f"{v['compiled_per_M']:.3f}",
            f"{v['ratio_compiled']:.3f}",
        ] + ([f"{paper[name]:.3f}"] if paper else []))
    header = ["mode", "lowered B", "/ M", "vs zero3", "compiled B", "/ M", "vs zero3"] + (
        ["lowered, vs the paper's ZeRO-3"] if paper else [])
    va = data["vs_regather_all"]
    caption = (
        f"M = {data['params']:,} parameters, {data['nodes']} nodes x {data['local']} devices; "
        f"bytes per node per step. Against a ZeRO-3 whose every unit regathers (lowered): "
        f"zeropp {va['zeropp']:.3f}, zeropp with INT4 weights {va['zeropp_int4']:.3f}."
    )
    return _table(header, rows) + "\n\n" + caption


# --------------------------------------------------------------------------- convergence


def _paper_column(table: str) -> dict[str, str]:
    out = {}
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 5:
            out[cells[0]] = cells[-1]
    return out


def convergence(data: dict, view: str | None) -> str:
    """``benchmarks/convergence.py``: final validation loss and last-100-steps train loss
    of every config against zero3 (same seed, data and hyperparameters)."""
    _no_view(view, "convergence")
    runs = data["runs"]
    if "zero3" not in runs:
        raise TableError("convergence: no zero3 run to compare against")
    base = runs["zero3"]
    tail = min(100, len(base["losses"]))
    base_tail = statistics.fmean(base["losses"][-tail:])
    paper = _paper_column(data.get("table", ""))
    rows = []
    for name, r in runs.items():
        rows.append([
            name, f"{r['final_val_loss']:.4f}",
            f"{100 * (r['final_val_loss'] / base['final_val_loss'] - 1):+.2f}%",
            f"{statistics.fmean(r['losses'][-tail:]) / base_tail:.4f}",
            paper.get(name, ""),
        ])
    header = ["config", "final val loss", "vs zero3", f"last-{tail} train loss / zero3",
              "paper, GPT-350M (Table 5)"]
    s = data["settings"]
    caption = (
        f"{s['steps']} steps, global batch {s['batch']} x {s['seq_len']} bytes, {s['layers']} "
        f"layers, d_model {s['d_model']}, {s['heads']} heads, peak lr {s['lr']}, "
        f"{s['nodes']} nodes x {s['local']} devices, seed {s['seed']}; validation on "
        f"{s['eval_batches']} held-out batches."
    )
    targets = "; ".join(
        f"{t['config']} within {t['target_pct']}% of zero3: {t['measured_pct']:+.2f}% "
        f"({'met' if t['met'] else 'not met'})" for t in data.get("targets", []))
    return _table(header, rows) + "\n\n" + caption + (f" Targets: {targets}." if targets else "")


# --------------------------------------------------------------------------- GPU check


def _bits(c: dict) -> str:
    return f"INT{c['bits']}" + (f"->INT{c['out_bits']}" if "out_bits" in c else "")


def gpu_check(data: dict, view: str | None) -> str:
    """``benchmarks/gpu_check.py`` (``make gpu-check``). Views: ``device``, ``kernels``,
    ``bandwidth``, ``step``."""
    views: dict[str, Callable[[dict], str]] = {
        "device": _gpu_device, "kernels": _gpu_kernels,
        "bandwidth": _gpu_bandwidth, "step": _gpu_step,
    }
    if view not in views:
        raise TableError(f"gpu_check results need a view, one of {sorted(views)}; got {view!r}")
    return views[view](data)


def _gpu_device(data: dict) -> str:
    v = data["versions"]
    p = v["packages"]
    rows = [["device", f"{v['device_kind']} ({v['device_count']} visible)"],
            ["driver (nvidia-smi)", "; ".join(v.get("nvidia_smi") or [])],
            ["CUDA driver API", str(v.get("cuda_driver_api", ""))],
            ["Python", v["python"]]]
    rows += [[k, ver] for k, ver in p.items()]
    return _table(["", "version"], rows)


def _gpu_kernels(data: dict) -> str:
    k = data["kernels"]
    groups: dict[tuple, list[int]] = collections.OrderedDict()
    for c in k["cases"]:
        g = groups.setdefault((c["kernel"], _bits(c), c["dtype"]), [0, 0, 0])
        g[0] += 1
        g[1] += bool(c["ok"])
        g[2] += max(c["mismatches"].values()) if c["mismatches"] else 0
    rows = [[kern, bits, dt, str(n), f"{ok}/{n}", _int(diff)]
            for (kern, bits, dt), (n, ok, diff) in groups.items()]
    header = ["kernel", "bits", "input dtype", "cases", "bit-exact",
              "elements where XLA's GPU-compiled reference rounds differently"]
    return _table(header, rows) + f"\n\n{k['passed']}/{k['total']} cases bit-exact."


def _gpu_bandwidth(data: dict) -> str:
    b = data["bandwidth"]
    if "rows" not in b:
        raise TableError(f"gpu_check: this run has no bandwidth section ({b})")
    rows = []
    for r in b["rows"]:
        rows.append([
            r["kernel"], f"INT{r['bits']}", r["dtype"], _int(r["elements"]),
            f"{r['gbps']['pallas']:.0f}",
            _pct(r["pallas_fraction_of_copy"], 0) + ("" if r["meets_target"] else " (below)"),
            f"{r['gbps']['xla']:.0f}", _pct(r["xla_fraction_of_copy"], 0),
            f"{r['pallas_over_xla_time']:.2f}",
        ])
    header = ["kernel", "bits", "dtype", "elements", "Pallas GB/s", "Pallas % of copy",
              "XLA GB/s", "XLA % of copy", "Pallas / XLA time"]
    s = b["summary"]
    caption = (f"Pallas reaches {_pct(s['target'], 0)} of a device copy in {s['met']} of "
               f"{s['measured']} cases; XLA's fused reference is as fast in {s['xla_as_fast']}; "
               f"geometric mean of Pallas / XLA time {s['geomean_pallas_over_xla_time']:.2f}.")
    return _table(header, rows) + "\n\n" + caption


STEP_NAMES = {
    "plain": "plain `jax.jit`",
    "plain_remat": "plain, every block under `nn.remat`",
    "zero3_minimal": 'ZeRO-3, `remat="minimal"`',
    "zero3_full": 'ZeRO-3, `remat="full"`',
    "zeropp": "ZeRO++ (qwZ + hpZ + qgZ)",
}


def _gpu_step(data: dict) -> str:
    ts = data["train_step"]
    if "variants" not in ts:
        raise TableError(f"gpu_check: this run has no train-step section ({ts})")
    rows = []
    for name, v in ts["variants"].items():
        rows.append([
            STEP_NAMES.get(name, name), f"{1000 * v['median_s']:.1f}",
            _int(v["tokens_per_s"]), _pct(v["mfu"]), _x(v["vs_plain"], 3),
            str(v["matmuls"]["total"]), f"{v['temp_bytes'] / 2**30:.2f}",
        ])
    header = ["step", "ms/step", "tokens/s", "MFU", "vs plain", "matmuls", "temp GiB"]
    m = ts["model"]
    t = ts["target"]
    caption = (
        f"GPT of {m['params'] / 1e6:.1f}M parameters ({m['layers']} layers, d_model "
        f"{m['d_model']}, {m['heads']} heads, sequence {m['seq_len']}, vocabulary {m['vocab']}), "
        f"batch {m['batch']}, {m['compute_dtype']} compute, {m['param_dtype']} parameters, "
        f"{ts['optimizer']}; median of {ts['rounds']} interleaved rounds; MFU against "
        f"{ts['peak_bf16_flops'] / 1e12:.0f} TFLOP/s. ZeRO-3 minimal / plain = "
        f"{t['zero3_minimal/plain']:.3f}x (target <= {t['target']:.2f}x: "
        f"{'met' if t['met'] else 'not met'})."
    )
    return _table(header, rows) + "\n\n" + caption


def gpu_calibrate(data: dict, view: str | None) -> str:
    """``benchmarks/gpu_cluster/calibrate.py`` (``make gpu-calibrate``): per config, the
    measured step and, per kernel class, the replay's roofline price against the measured
    kernel time on that GPU."""
    _no_view(view, "gpu_calibrate")
    runs = [r for r in data["runs"] if "error" not in r]
    if not runs:
        raise TableError(f"gpu_calibrate: no run without an error ({data['runs']})")
    classes = list(runs[0]["vs_roofline"]["by_class"])
    rows = []
    for r in runs:
        v = r["vs_roofline"]
        first = len(rows)
        for cls in [*classes, None]:
            if cls is None:
                priced, got = v["priced_ms"], v["measured_kernels_ms"]
                label = "**all kernels**"
            else:
                c = v["by_class"][cls]
                priced, got, label = c["priced_ms"], c["measured_ms"], cls
                if not priced and not got:
                    continue
            rows.append([r["config"] if len(rows) == first else "", label,
                         f"{priced:.2f}", f"{got:.2f}", _x(got / priced) if priced else "-"])
    steps = "; ".join(f"{r['config']} {r['step_ms_median']:.1f} ms (MFU {r['mfu']:.3f})"
                      for r in runs)
    c = data["ceilings"]
    roof = data["roofline"]
    caption = (
        f"{data['device']}, jax {data['jax']}: the {data['model']} Llama "
        f"({data['params'] / 1e9:.2f}B parameters), one {data['seq']}-token sequence. "
        f"Prices at {roof['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s bf16 and "
        f"{roof['memory_bytes_per_s'] / 1e12:.2f} TB/s (datasheet); this GPU measured "
        f"{c['matmul_bf16_flops_per_s'] / 1e12:.0f} TFLOP/s on an {c['matmul_n']}^3 bf16 "
        f"matmul and {c['copy_bytes_per_s'] / 1e12:.2f} TB/s on a copy. Steps (median): "
        f"{steps}.")
    return _table(["config", "kernel class", "priced ms", "measured ms", "measured / priced"],
                  rows) + "\n\n" + caption


# --------------------------------------------------------------------------- one-file benchmarks


def lora(data: dict, view: str | None) -> str:
    """``examples/lora_finetune.py --json``: per-device state bytes and cross-node bytes."""
    _no_view(view, "lora_finetune")
    rows = []
    for r in data["runs"]:
        mem = r["memory_per_device"]
        loss = (f"{r['first_loss']:.2f} -> {r['last_loss']:.2f}"
                if "first_loss" in r else "not run")
        rows.append([r["run"], _int(mem["trainable"]), _int(mem["optimizer"]),
                     _int(mem["frozen"]), _int(mem["total"]),
                     _int(r["cross_node_bytes_per_step_per_node"]), loss])
    header = ["run", "trainable B", "optimizer B", "frozen B", "whole state B",
              "cross-node B per step per node", "loss"]
    a = data["args"]
    caption = (f"Per device; GPT {a['layers']} layers x d_model {a['d_model']}, rank-{a['rank']} "
               f"LoRA, {a['steps']} steps, {a['nodes']} nodes x {a['local']} devices, frozen "
               f"weights INT{a['weight_bits']} in the quantized run.")
    return _table(header, rows) + "\n\n" + caption


def memory(data: dict, view: str | None) -> str:
    """``benchmarks/memory.py``. Views: ``state`` (sections a, b), ``paper`` (the paper's
    100B example), ``depth`` (section c: temp bytes against depth)."""
    if view == "state":
        rows = []
        for name, m in data["modes"].items():
            rows.append([name, _int(m["model_state_bytes"]), _int(m["batch_bytes"]),
                         _int(m["compiled_argument_bytes"]), f"{m['relative_error']:.2e}",
                         _int(m["secondary_bytes"]), _int(m["compiled_temp_bytes"])])
        header = ["mode", "model state B (predicted)", "batch B", "compiled argument B",
                  "relative difference", "hpZ secondary B", "compiled temp B"]
        return (_table(header, rows) + f"\n\nPer device; {data['params']:,} parameters on "
                f"{data['devices']} devices.")
    if view == "paper":
        p = data["paper_example"]
        gib = 2**30
        rows = [["data parallel", f"{p['data_parallel'] / gib:,.1f}", ""],
                ["ZeRO-3", f"{p['zero3'] / gib:,.2f}", _x(1.0, 1)],
                ["ZeRO-3 + hpZ", f"{p['hpz'] / gib:,.1f}", _x(p["hpz"] / p["zero3"], 1)]]
        return (_table(["", "GiB per GPU", "vs ZeRO-3"], rows)
                + f"\n\nData parallelism needs {p['data_parallel'] / p['hpz']:.0f}x the hpZ "
                  "figure.")
    if view == "depth":
        rows = []
        for name, d in data["depth"].items():
            model, remat = name.rsplit("/", 1)
            rows.append([model, remat, _int(d["temp_4"]), _int(d["temp_8"]),
                         f"{d['ratio']:.2f}"])
        header = ["model", "remat", "temp B, 4 layers", "temp B, 8 layers",
                  "growth per layer / one layer's bf16 weights"]
        return _table(header, rows)
    raise TableError(f"memory results need a view, one of ['depth', 'paper', 'state']; got {view!r}")


def models(data: dict, view: str | None) -> str:
    """``benchmarks/models.py``: per-device bytes of the compiled step by unit policy."""
    _no_view(view, "models")
    names = {"hf_gpt2": "transformers GPT-2", "hf_bert": "transformers BERT",
             "nnx_lm": "NNX transformer"}
    policies = {"auto": "default", "children": '`"children"`'}
    rows = []
    for key, variants in data["models"].items():
        plain = variants["plain (1 device)"]
        plain_b = plain["argument_bytes"] + plain["temp_bytes"]
        for pol, v in variants.items():
            if pol == "plain (1 device)":
                continue
            b = v["argument_bytes"] + v["temp_bytes"]
            rows.append([names.get(key, key), policies.get(pol, pol), str(v["units"]),
                         _pct(v["largest_share"], 0), f"{b / 1e6:.1f} MB", _x(b / plain_b)])
        rows.append([names.get(key, key), "plain one-device `jax.jit`", "", "",
                     f"{plain_b / 1e6:.1f} MB", _x(1.0)])
    header = ["model", "units", "unit count", "largest unit", "arguments + temp per device",
              "vs plain"]
    return (_table(header, rows) + f"\n\n{data['layers']} layers, d_model {data['d_model']}, "
            f"{data['devices']} devices.")


def overhead(data: dict, view: str | None) -> str:
    """``benchmarks/overhead.py``: one device, no communication: what the unit transform costs."""
    _no_view(view, "overhead")
    v = data["variants"]
    rows = []
    for name, r in v.items():
        rows.append([STEP_NAMES.get(name, name), f"{r['median_ms']:.1f}", _x(r["vs_plain"], 3),
                     _x(r["vs_plain_remat"], 3) if "vs_plain_remat" in r else "",
                     str(r["matmuls"]["total"]), f"{r['temp_bytes'] / 2**20:.1f}"])
    header = ["step", "median ms", "vs plain", "vs plain + full remat", "matmuls", "temp MiB"]
    m = data["model"]
    def pretty(key: str) -> str:
        for short, long in (("zero3_minimal", "ZeRO-3 minimal"), ("zero3_full", "ZeRO-3 full"),
                            ("plain_remat", "plain + full remat")):
            key = key.replace(short, long)
        return key.replace("/", " / ")

    targets = "; ".join(
        f"{pretty(k)}: {t['ratio']:.3f}x, target <= {t['target']}x, "
        f"{'met' if t['met'] else 'not met'}"
        for k, t in data["targets"].items() if "ratio" in t)
    caption = (f"GPT of {m['params']:,} parameters ({m['layers']} layers, d_model "
               f"{m['d_model']}, sequence {m['seq_len']}, batch {m['batch']}, "
               f"{m['compute_dtype']}), {data['optimizer']}, {data['rounds']} interleaved "
               f"rounds on {data['device']['platform']}, jax {data['jax']}. {targets}.")
    return _table(header, rows) + "\n\n" + caption


def qgz_accuracy(data: dict, view: str | None) -> str:
    """``benchmarks/qgz_accuracy.py``: relative L2 error of reduce-scatters of real gradients
    (no view), of qgZ with Hadamard smoothing and stochastic rounding (``smoothing``), of one
    quantization of gradients per format (``formats``), of weight round trips
    (``weights``) and of qgZ with error feedback over a training run (``feedback``)."""
    views = {"smoothing": _qgz_smoothing, "formats": _qgz_formats, "weights": _qgz_weights,
             "feedback": _qgz_feedback}
    if view is not None:
        if view not in views:
            raise TableError(f"qgz_accuracy views: none or one of {sorted(views)}; got {view!r}")
        return views[view](data)
    rows = []
    for when, e in data["errors"].items():
        q, ring = e["qgz (1 quantization/hop)"], e["ring (7 requantizations)"]
        rows.append([when, f"{q['4']:.3f}", f"{ring['4']:.3f}", f"{q['8']:.4f}",
                     f"{ring['8']:.4f}", f"{e['bf16 ring']:.4f}",
                     f"{e['single_node_quantized_int4']:.3f}",
                     f"{e['single_node_fallback']:.1e}"])
    header = ["gradients", "qgZ INT4", "ring INT4", "qgZ INT8", "ring INT8", "bf16 ring",
              "one node, INT4 local hop", "one node, fallback (fp32)"]
    return (_table(header, rows) + f"\n\n{data['nodes']} nodes x {data['local']} devices "
            f"(the one-node columns: 1 x {data['nodes'] * data['local']}), block "
            f"{data['block_size']}.")


def _qgz_smoothing(data: dict) -> str:
    rs = data["reduce_scatter"]
    whens = list(rs)
    rows = [[name] + [f"{rs[w][name]['4']:.3f} / {rs[w][name]['8']:.4f}" for w in whens]
            for name in rs[whens[0]]]
    return (_table(["qgZ reduce-scatter (INT4 / INT8)"] + [f"gradients at {w}" for w in whens],
                    rows)
            + f"\n\nRelative L2 error against the exact sum, {data['nodes']} nodes x "
              f"{data['local']} devices, block {data['block_size']}. \"mean of 8 keys\": the "
              "average of 8 reduce-scatters with different rounding keys (what unbiased "
              "rounding buys over steps).")


def _qgz_feedback(data: dict) -> str:
    if "error_feedback" not in data:
        raise TableError("qgz_accuracy has no error_feedback study: rerun "
                         "benchmarks/qgz_accuracy.py")
    ef = data["error_feedback"]
    steps = ef["steps"]
    marks = [s for s in (1, 10, 30) if s < steps] + [steps]
    rows = []
    for name, v in ef["variants"].items():
        rows.append([name]
                    + [f"{v['per_step'][s - 1]:.3f}" for s in (1, steps)]
                    + [f"{v['accumulated'][s - 1]:.4f}" for s in marks]
                    + [f"{v['accumulated_over_qgz']:.2f}x"])
    header = (["qgZ INT4 reduce-scatter", "one step: step 1", f"step {steps}"]
              + [f"accumulated: {s} steps" for s in marks] + [f"accumulated vs qgZ at {steps}"])
    return (_table(header, rows)
            + f"\n\nRelative L2 error against the exact sum over one training trajectory "
              f"({ef['nodes']} nodes x {ef['local']} devices, block {ef['block_size']}): of "
              "each step's reduce-scatter, and of the sum of all reduce-scatters so far (what "
              "the parameters integrate).")


def _qgz_formats(data: dict) -> str:
    gq = data["gradient_quantization"]
    whens = list(gq)
    rows = [[name] + [f"{gq[w][name]:.4f}" for w in whens] for name in gq[whens[0]]]
    return (_table(["one quantization of the gradients"] + [f"at {w}" for w in whens], rows)
            + f"\n\nRelative L2 error of quantize-dequantize, block {data['block_size']}.")


def _qgz_weights(data: dict) -> str:
    wg = data["weight_gather"]
    sets = [k for k, v in wg.items() if isinstance(v, dict)]
    names = {"trained": "demo GPT, trained", "student_t3_synthetic": "Student-t (3 dof) weights"}
    rows = [[fmt] + [f"{wg[k][fmt]:.4f}" for k in sets] for fmt in wg[sets[0]]]
    kurt = wg.get("trained_median_block_excess_kurtosis")
    return (_table(["weight format"] + [names.get(k, k) for k in sets], rows)
            + f"\n\nRelative L2 error of a weight gather's round trip, block "
              f"{data['block_size']}"
            + (f"; the trained GPT's blocks have a median excess kurtosis of {kurt:.2f} "
               "(lighter tails than a Gaussian)." if kurt is not None else "."))


def feedback_cost(data: dict, view: str | None) -> str:
    """``benchmarks/feedback_cost.py``: step time, kept memory and bytes of qgZ's error
    feedback and per-step signs against Hadamard-smoothed qgZ."""
    _no_view(view, "feedback_cost")
    rows = []
    for name, v in data["variants"].items():
        rows.append([name, f"{v['median_s'] * 1e3:.0f} ± {v['half_spread_s'] * 1e3:.0f}",
                     _x(v["ratio"]), f"{v['kept_bytes_per_param_per_device']:.2f}",
                     "yes" if v["same_wire_bytes"] else "NO"])
    st = data["settings"]
    return (_table(["zeropp + Hadamard", "step (ms)", "vs first row",
                    "kept bytes / parameter / device", "same bytes on the wire"], rows)
            + f"\n\n{data['params'] / 1e6:.2f}M-parameter GPT, {st['nodes']} x {st['local']} "
              f"simulated CPU devices on a {data['cpu']}, jax {data['jax']}: median of "
              f"{st['rounds']} interleaved rounds of {st['steps_per_round']} steps, ± half "
              "the spread of the rounds.")


def offload(data: dict, view: str | None) -> str:
    """``benchmarks/offload.py``: the compiled step's argument bytes per memory space and
    the step time, with and without the optimizer state offloaded."""
    _no_view(view, "offload")
    rows = []
    for name, v in data["variants"].items():
        args = v["arguments"]
        rows.append([name, f"{args['device'] / 1e6:.2f}", f"{args['host'] / 1e6:.2f}",
                     f"{v['temp_bytes'] / 1e6:.1f}",
                     f"{v['median_s'] * 1e3:.0f} ± {v['half_spread_s'] * 1e3:.0f}",
                     _x(v["ratio"])])
    st = data["settings"]
    return (_table(["AdamW", "device arguments (MB / device)", "host arguments (MB / device)",
                    "temporaries (MB / device)", "step (ms)", "vs without offload"], rows)
            + f"\n\n{data['params'] / 1e6:.2f}M-parameter GPT, {st['nodes']} x {st['local']} "
              f"simulated CPU devices on a {data['cpu']}, jax {data['jax']}: median of "
              f"{st['rounds']} interleaved rounds of {st['steps_per_round']} steps, ± half "
              "the spread of the rounds.")


def tensor_parallel(data: dict, view: str | None) -> str:
    """``benchmarks/tensor_parallel.py``: predicted memory per GPU and step time of a
    70B-class model on 16 x 8 H100s at tensor-parallel degrees 1 to 8."""
    _no_view(view, "tensor_parallel_70b")
    rows = []
    for r in data["tp_rows"]:
        rows.append([f"{r['config']}, remat {r['remat']}", str(r["tensor_parallel"]),
                     str(r["data_parallel"]), f"{r['memory_gib']:.1f}",
                     f"{r['gathered_gib']:.1f}", f"{r['activations_gib']:.1f}",
                     f"{r['step_s']:.2f}", f"{r['tokens_per_s_per_gpu']:.0f}"])
    m, c = data["model"], data["cluster"]
    return (_table(["config", "tensor parallel", "data-parallel ranks", "peak GiB / GPU",
                    "of it: gathered weights", "of it: activations and logits",
                    "step (s)", "tokens / s / GPU"], rows)
            + f"\n\nPredicted, not measured: {m['name']} ({m['layers']} layers, d_model "
              f"{m['d_model']}), {data['tokens_per_rank']} tokens per data-parallel rank, "
              f"{c['nodes']} nodes x {c['gpus_per_node']} GPUs (`{c['preset']}`).")


def experts(data: dict, view: str | None) -> str:
    """``benchmarks/experts.py``: a compiled MoE step's memory and bytes per device, with and
    without an expert axis, against a plain ``jax.jit`` step."""
    _no_view(view, "experts")
    rows = []
    for r in data["experts_rows"]:
        rows.append([r["setup"], r["mesh"], f"{r['arguments'] / 2**20:.2f}",
                     f"{r['temporaries'] / 2**20:.2f}", f"{r['gathered_experts'] / 2**10:.0f}",
                     _int(r["cross_node_bytes_per_node"]), _int(r["intra_node_bytes"]),
                     _int(r["by_axis"].get("expert", {}).get("intra_node_bytes", 0.0))])
    m = data["model"]
    return (_table(["setup", "mesh", "arguments MiB", "temporaries MiB",
                    "a layer's experts gathered, KiB", "cross-node B / node", "intra-node B",
                    "of it on the expert axis"], rows)
            + f"\n\nCompiled for {data['devices']} simulated {data['platform'].upper()} "
              f"devices, not timed: {m['experts']} experts a layer, {m['layers']} MoE layers, "
              f"d_model {m['d_model']}, expert width {m['hidden']}, {data['batch']} "
              f"sequences of {m['seq_len']} tokens a step, fp32.")


def int4_weights(data: dict, view: str | None) -> str:
    """``benchmarks/int4_weights.py``: final loss of each config against zero3 per model
    (no view), and the INT4 round trip of each model's weights (``round_trip``)."""
    models = [m for m in data["summary"] if m != "all models"]
    titles = {m: data["models"][m]["title"] for m in models}
    s = data["settings"]

    def pct(r: float) -> str:
        return f"{100 * (r - 1):+.0f}%"

    if view == "round_trip":
        schemes = list(data["models"][models[0]]["round_trip"]["init"])
        rows = []
        for sch in schemes:
            row = [sch]
            for m in models:
                rt = data["models"][m]["round_trip"]
                row.append(" / ".join(f"{rt[w][sch]['matrices']:.3f}" for w in rt))
            rows.append(row)
        whens = " / ".join(data["models"][models[0]]["round_trip"])
        def extra(key: str) -> str:
            return ", ".join(f"{titles[m]} {100 * data['models'][m][key]:.1f}%"
                             for m in models if key in data["models"][m])

        scales = ", ".join(f"{b}: +{100 * (4 / b - 4 / 256) / (0.5 + 4 / 256):.1f}%"
                           for b in (64, 32))
        return (_table(["INT4 round trip (block 256 unless named)"]
                       + [f"{titles[m]}: {whens}" for m in models], rows)
                + "\n\nRelative L2 error of a weight gather's round trip over the >=2-D "
                  "parameters (matrices, embeddings), each unit's flat buffer quantized as its "
                  "gather quantizes it (1-D norm gains and biases share its blocks). The "
                  "bytes each variant adds to a gather of INT4 in blocks of 256 (4.125 bits "
                  f"per weight): weight blocks of {scales}; 1-D parameters in bf16: "
                  f"{extra('one_d_extra_bytes_over_int4')}; the rest unit in INT8: "
                  f"{extra('rest_int8_extra_bytes_over_int4')}.")
    if view is not None:
        raise TableError(f"int4_weights views: none or 'round_trip'; got {view!r}")
    rows = []
    for c in data["configs"]:
        cells = [c]
        for m in models:
            r = data["summary"][m][c]
            if c == "zero3":
                losses = [v["eval_loss"] for v in data["models"][m]["runs"][c]["seeds"].values()]
                cells.append(f"{r['eval_loss']:.3f} ({min(losses):.3f} to {max(losses):.3f})")
            else:
                cells.append(f"{pct(r['ratio'])} [{pct(r['ratio_min'])}, {pct(r['ratio_max'])}]")
        rows.append(cells)
    caption = (
        "zero3's row: its final loss, the mean over seeds (lowest to highest). Other rows: "
        "the final loss over zero3's of the same seed, the mean over seeds [lowest, highest]; "
        f"seeds {', '.join(map(str, s['seeds']))} (initialization and data). Copy task: the "
        f"loss on the {s['half']} copied tokens (vocabulary 64) after {s['steps']} AdamW "
        f"steps at lr {s['lr']}, global batch {s['batch']}, {s['layers']} layers of d_model "
        f"{s['d_model']}, bf16 compute, {s['nodes']}x{s['local']} simulated devices on "
        f"{data['cpu']}; the loss of the final fp32 weights on {64 * s['eval_batches']} "
        "held-out sequences, without quantization.")
    return _table(["config"] + [titles[m] for m in models], rows) + "\n\n" + caption


QUANT_DATA = {"gpt_init": "GPT at init", "gpt_trained": "same GPT after training",
              "student_t2": "Student-t (2 dof) matrices"}


def quantization(data: dict, view: str | None) -> str:
    """``benchmarks/quantization.py``. Views: ``block_vs_tensor``, ``sweep``."""
    block = data["default_block_size"]
    if view == "block_vs_tensor":
        bvt = data["block_vs_tensor"]
        rows = []
        for key, label in QUANT_DATA.items():
            r8, r4 = bvt[f"{key}/int8"], bvt[f"{key}/int4"]
            rows.append([label, f"{r8['block']:.5f}", f"{r8['per_tensor']:.5f}",
                         _x(r8["ratio"]), f"{r4['block']:.4f}", f"{r4['per_tensor']:.4f}",
                         _x(r4["ratio"])])
        header = ["weights", f"INT8, block {block}", "INT8, per tensor", "per tensor / block",
                  f"INT4, block {block}", "INT4, per tensor", "per tensor / block"]
        return (_table(header, rows) + f"\n\nRelative L2 error over all tensors, each "
                f"quantized on its own; the trained GPT after {len(data['train_losses'])} steps.")
    if view == "sweep":
        rows = []
        for size, r in data["sweep"].items():
            mark = "**" if int(size) == block else ""
            rows.append([f"{mark}{size}{mark}", f"{r['gpt_trained/int8']:.5f}",
                         f"{r['gpt_trained/int4']:.4f}", f"{r['student_t2/int8']:.4f}",
                         _pct(r["overhead_int8"]), _pct(r["overhead_int4"])])
        header = ["block size", "trained GPT, INT8", "trained GPT, INT4", "Student-t, INT8",
                  "scale bytes / INT8 payload", "scale bytes / INT4 payload"]
        return _table(header, rows) + f"\n\nBold: the default block size ({block})."
    raise TableError("quantization results need a view, one of ['block_vs_tensor', 'sweep']; "
                     f"got {view!r}")


def ulysses(data: dict, view: str | None) -> str:
    """``benchmarks/ulysses.py``: all-to-all bytes, longest sequence, step time."""
    _no_view(view, "ulysses")
    a = data["all_to_all"]
    ls = data["longest_sequence"]
    st = data["step_time"]
    low = a["per_step"]["lowered"]
    comp = a["per_step"]["compiled"]
    rows = [
        [f"all-to-all bytes per layer, forward, per device (batch {a['batch']} x {a['seq']}, "
         f"P = {a['sp']})",
         f"{_int(a['measured_fwd_bytes_per_layer_per_device'])} B (model 4Nh/P: "
         f"{_int(a['model_4Nh_over_P_bytes'])} B)"],
        ["all-to-alls per step, lowered / compiled", f"{low['count']} / {comp['count']}"],
        ["cross-node all-to-all bytes per step", _int(comp["cross_node_bytes"])],
        [f"longest sequence whose compiled step fits {ls['budget_mib']:.0f} MiB per device",
         f"{ls['without SP']['longest_seq']} without SP, {ls['Ulysses SP']['longest_seq']} with "
         f"SP ({_x(ls['ratio'])})"],
        [f"step time, global batch {st['batch']} x {st['seq']}",
         f"SP {_x(st['ratio_sp_over_no_sp'])} of the plain step's time"],
    ]
    m = data["model"]
    return (_table(["", "result"], rows) + f"\n\nGPT {m['layers']} layers, d_model "
            f"{m['d_model']}, {m['heads']} heads; {data['nodes']} nodes x {data['local']} "
            f"devices, {data['compute_dtype']} compute.")


# --------------------------------------------------------------------------- dispatch


# --------------------------------------------------------------------------- generation


def generation(data: dict, view: str | None) -> str:
    """``benchmarks/generation.py``. Views: ``exactness``, ``bytes``, ``speed``."""
    views = {"exactness": _gen_exactness, "bytes": _gen_bytes, "speed": _gen_speed}
    if view not in views:
        raise TableError(f"generation results need a view, one of {sorted(views)}; got {view!r}")
    return views[view](data)


def _gen_exactness(data: dict) -> str:
    rows = []
    for r in data["exactness"]:
        where = ("mesh " + "x".join(map(str, r["mesh"])) if "mesh" in r
                 else ("hpZ" if r["hpz"] else "no hpZ") + ", mesh " + "x".join(map(str, data["mesh"])))
        own = r.get("mismatches_vs_transformers_generate")
        rows.append([r["model"], where, _int(r["tokens"]), str(r["mismatches_vs_one_device"]),
                     "" if own is None else str(own)])
    return _table(["model", "run", "generated tokens", "differ from one device's decoding",
                   "differ from transformers' generate"], rows)


def _gen_bytes(data: dict) -> str:
    rows = []
    for r in data["bytes_per_token"]:
        once = r.get("secondary_gather_cross_node_bytes_per_node")
        rows.append([r["config"], _int(r["cross_node_bytes_per_node_per_token"]),
                     "" if once is None else _int(once)])
    return _table(["config", "cross-node bytes per node, per generated token",
                   "once per generate call (hpZ's secondary)"], rows)


def _gen_speed(data: dict) -> str:
    s = data["speed"]
    n = s["batch"] * s["new_tokens"]
    rows = [[k, f"{v:.0f}", f"{n / max(s['times_s'][k]):.0f}-{n / min(s['times_s'][k]):.0f}"]
            for k, v in s["tokens_per_s"].items()]
    caption = (f"One device, {s['batch']} prompts of {s['prompt_len']} tokens, "
               f"{s['new_tokens']} new tokens, median of {len(next(iter(s['times_s'].values())))}"
               f" rounds; zpp.generate / plain jit {_x(s['kv_over_plain_jit'])}, / cache-less "
               f"{_x(s['kv_over_cacheless'])}; same tokens: {'yes' if s['same_tokens'] else 'no'}.")
    return _table(["generator", "tokens/s (median)", "range over rounds"], rows) + "\n\n" + caption


def cluster_generate(data: dict, view: str | None) -> str:
    """``benchmarks/cluster/generate.py``: generation and RLHF phases per link and mode."""
    _no_view(view, "cluster_generate")
    rows = []
    for c in data["cells"]:
        g = c["generation"]
        n = g["batch"] * g["new_tokens"]
        kv = [n / t for t in g["times_s"]["kv"]]
        r = c.get("rlhf", {}).get("median_s", {})
        rows.append([_bandwidth(c["bandwidth"]), c["mode"],
                     f"{g['tokens_per_s']['kv']:.1f} ({min(kv):.1f}-{max(kv):.1f})",
                     f"{g['tokens_per_s']['cacheless']:.1f}" if "cacheless" in g["tokens_per_s"] else "",
                     _int(g["cross_node_bytes_per_node"]["kv_token"]),
                     f"{r['generate_s']:.2f}" if r else "", f"{r['train_s']:.3f}" if r else ""])
    table = _table(["link", "mode", "KV tokens/s (range)", "cache-less tokens/s",
                    "cross-node B per node per token", "RLHF generate s", "RLHF train s"], rows)
    ratios = []
    for r in data["ratios"]:
        parts = [f"hpZ / ZeRO-3 tokens/s {_x(r['hpz_over_zero3_tokens_per_s'])}"]
        for mode in ("zero3", "zeropp"):
            if f"kv_over_cacheless_{mode}" in r:
                parts.append(f"KV / cache-less ({mode}) {_x(r[f'kv_over_cacheless_{mode}'])}")
        for phase in ("generate", "train"):
            k = f"rlhf_{phase}_zero3_over_zeropp"
            if k in r:
                parts.append(f"RLHF {phase} ZeRO-3 / ZeRO++ time {_x(r[k])}")
        ratios.append(f"- {_bandwidth(r['bandwidth'])}: " + "; ".join(parts))
    g = data["cells"][0]["generation"]
    caption = (f"{data['nodes']} node processes x {data['local']} devices; GPT of "
               f"{g['params']:,} parameters ({g['compute_dtype']}); {g['batch']} prompts of "
               f"{g['prompt_len']} tokens, {g['new_tokens']} new tokens. The cache-less "
               "generator always rebuilds every unit from hpZ's secondary (its only mode), so "
               "its zero3 row also gathers inside the node per token.")
    return table + "\n\n" + caption + "\n\n" + "\n".join(ratios)


def gpu_cluster(data: dict, view: str | None) -> str:
    """``benchmarks/gpu_cluster/run.py`` (``make gpu-cluster``). Views: ``grid`` (every
    model, mesh, config and flag set), ``unrolled`` (the 7B at 16x8 with its blocks
    unrolled), ``largest`` (the largest Llama shapes at 16x8 against 80 GB), ``memory``
    (per config, how many rows the memory model predicts within 10%), ``scheduler`` (the
    scanned 7B at 16x8 with XLA's default scheduling against the pipelined flags),
    ``versions`` (a run on another JAX version beside the tracked run's same rows),
    ``defer`` (the scanned 7B at 16x8: ZeRO-3, ZeRO++ and ZeRO++ with ``qgz_defer``)."""
    views = ("grid", "unrolled", "largest", "memory", "units", "peer", "compute", "plain",
             "calibrated", "scheduler", "versions", "defer")
    if view not in views:
        raise TableError(f"gpu_cluster results need a view, one of {', '.join(views)}; "
                         f"got {view!r}")
    if view == "memory":
        configs: dict[str, list[float]] = {}
        for r in data["rows"]:
            if r["memory_error"] is not None:  # the peer has no memory model
                configs.setdefault(r["config"], []).append(r["memory_error"])
        return _table(
            ["config", "rows", "within 10%", "model / compiled - 1: lowest", "highest"],
            [[c, str(len(e)), str(sum(abs(x) <= 0.10 for x in e)), f"{min(e):+.1%}",
              f"{max(e):+.1%}"] for c, e in configs.items()])
    if view == "units":
        return _gpu_cluster_units(data)
    if view == "peer":
        return _gpu_cluster_peer(data)
    if view == "compute":
        return _gpu_cluster_compute(data)
    if view == "plain":
        return _gpu_cluster_plain(data)
    if view == "calibrated":
        return _gpu_cluster_calibrated(data)
    if view == "scheduler":
        return _gpu_cluster_scheduler(data)
    if view == "versions":
        return _gpu_cluster_versions(data)
    if view == "defer":
        return _gpu_cluster_defer(data)
    rows = [r for r in data["rows"] if r["experiment"] == view]
    if not rows:
        raise TableError(f"gpu_cluster: this run has no {view} rows")

    def gb(x: float) -> str:
        return f"{x / 1e9:.1f}"

    def pct(x: float | None) -> str:
        return "-" if x is None else _pct(x)

    def model_gb(r: dict) -> str:  # the peer (gspmd_fsdp) has no memory model
        return "-" if r["memory_predicted_bytes"] is None else gb(r["memory_predicted_bytes"])

    def error(r: dict) -> str:
        return "-" if r["memory_error"] is None else f"{r['memory_error']:+.1%}"

    def pipelined(r: dict) -> str:
        n = r.get("pipelined_collectives")  # rows of runs before it was recorded: unknown
        return "?" if n is None else str(n)

    if view == "largest":
        return _table(
            ["model", "parameters", "mesh", "config", "compiled GB per GPU", "model GB",
             "error", "fits 80 GB", "overlap limit"],
            [[r["model"], f"{r['params'] / 1e9:.1f}B", r["mesh"], r["config"],
              gb(r["memory_compiled_bytes"]), model_gb(r), error(r),
              "yes" if r["fits_80gb"] else "no", _overlap_limit(r)]
             for r in rows])
    return _table(
        ["model", "mesh", "config", "XLA flags", "compiled GB per GPU", "model GB", "error",
         "hidden 400G", "hidden 100G", "step ms 400G", "step ms 100G", "compute ms",
         "pipelined collectives", "overlap limit"],
        [[r["model"], r["mesh"], r["config"], r["flags"], gb(r["memory_compiled_bytes"]),
          model_gb(r), error(r), pct(r["hidden_fraction_400g"]),
          pct(r["hidden_fraction_100g"]), f"{r['step_ms_400g']:.0f}",
          f"{r['step_ms_100g']:.0f}", f"{r['compute_ms']:.0f}", pipelined(r),
          _overlap_limit(r)]
         for r in rows])


_LIMIT = "xla_gpu_experimental_parallel_collective_overlap_limit"


def _overlap_limit(r: dict) -> str:
    """How many collectives XLA's scheduler kept in flight for the row: from its compile
    options; a row from before rows recorded them was compiled with the pipelined flag
    sets' limit of then, 2 (``git log -S`` on ``core/compat.py``); "-" without the
    option."""
    if "compile_options" in r:
        return str(r["compile_options"].get(_LIMIT, "-"))
    return "2 (earlier run)" if r["flags"] in ("pipelined", "pipelined_single_buffer") else "-"


def _seven_b_pipelined(r: dict) -> bool:
    """A 7B row at 16x8 compiled with the pipelined flags (``zpp.gpu_overlap_flags()``),
    scanned or unrolled."""
    return ((r["model"], r["mesh"]) == ("7B", "16x8") and r["experiment"] != "largest"
            and r["flags"] == "pipelined")


def _gpu_cluster_scheduler(data: dict) -> str:
    """The scanned 7B at 16x8 with the pipeliner and XLA's default scheduling against the
    pipelined flags (which add the scheduler options), per config, 400 and 100 Gbit/s."""
    by = {(r["config"], r["flags"]): r for r in data["rows"]
          if (r["model"], r["mesh"], r["layers"]) == ("7B", "16x8", "scan")
          and r["experiment"] == "grid"}
    configs = [c for (c, f) in by if f == "pipeliner_scheduler_default"
               and (c, "pipelined") in by]
    if not configs:
        raise TableError("gpu_cluster: no pipeliner_scheduler_default rows for the 7B at 16x8")

    def pair(c: str, key: str, fmt: str) -> str:
        return (f"{format(by[c, 'pipeliner_scheduler_default'][key], fmt)} → "
                f"{format(by[c, 'pipelined'][key], fmt)}")

    return _table(
        ["config", "step ms 400G", "hidden 400G", "step ms 100G", "compiled GB per GPU"],
        [[c, pair(c, "step_ms_400g", ".0f"), pair(c, "hidden_fraction_400g", ".0%"),
          pair(c, "step_ms_100g", ".0f"),
          f"{by[c, 'pipeliner_scheduler_default']['memory_compiled_bytes'] / 1e9:.1f} → "
          f"{by[c, 'pipelined']['memory_compiled_bytes'] / 1e9:.1f}"] for c in configs])


def _gpu_cluster_defer(data: dict) -> str:
    """The scanned 7B at 16x8 with the pipelined flags: ZeRO-3, ZeRO++ and ZeRO++ with
    ``qgz_defer`` (config ``zeropp_defer``): cross-node share hidden, step at 400 and
    100 Gbit/s, priced compute, compiled memory."""
    by = {r["config"]: r for r in data["rows"] if _seven_b_pipelined(r)
          and r["layers"] == "scan"}
    configs = [c for c in ("zero3", "zeropp", "zeropp_defer") if c in by]
    if "zeropp_defer" not in configs:
        raise TableError("gpu_cluster: no zeropp_defer row for the scanned 7B at 16x8")
    return _table(
        ["config", "hidden 400G", "step ms 400G", "hidden 100G", "step ms 100G",
         "compute ms", "compiled GB per GPU"],
        [[c, _pct(by[c]["hidden_fraction_400g"]), f"{by[c]['step_ms_400g']:.1f}",
          _pct(by[c]["hidden_fraction_100g"]), f"{by[c]['step_ms_100g']:.1f}",
          f"{by[c]['compute_ms']:.1f}", f"{by[c]['memory_compiled_bytes'] / 1e9:.2f}"]
         for c in configs])


def _gpu_cluster_versions(data: dict) -> str:
    """Each row of ``data`` (a ``make gpu-cluster`` run, another JAX version) beside the
    tracked run's row of the same model, mesh, config, flags and layers
    (``gpu_cluster_h100.json``): the JAX that compiled it, the collectives XLA's pipeliner
    moved, the hidden cross-node share and the step at 400 Gbit/s, the compiled memory."""
    tracked = json.loads((RESULTS / "gpu_cluster_h100.json").read_text())
    key = ("experiment", "model", "mesh", "config", "flags", "layers")
    by = {tuple(r[k] for k in key): r for r in tracked["rows"]}
    out = []
    for r in data["rows"]:
        for run, row in ((data, r), (tracked, by.get(tuple(r[k] for k in key)))):
            if row is None:
                raise TableError(f"gpu_cluster: the tracked run has no row {[r[k] for k in key]}")
            if "jax" not in run:
                raise TableError("gpu_cluster: a run without its JAX version (run it again)")
            out.append([row["model"], row["mesh"], row["config"], row["flags"], run["jax"],
                        _overlap_limit(row), str(row["pipelined_collectives"]),
                        _pct(row["hidden_fraction_400g"]), f"{row['step_ms_400g']:.1f}",
                        f"{row['memory_compiled_bytes'] / 1e9:.2f}"])
    return _table(["model", "mesh", "config", "flags", "jax", "overlap limit",
                   "pipelined collectives", "hidden 400G", "step ms 400G",
                   "compiled GB per GPU"], out)


def _gpu_cluster_calibrated(data: dict) -> str:
    """The 7B at 16x8 rows (scanned with the pipelined flags, and unrolled) replayed at
    roofline prices and at the kernel times a GPU measured per class (``*_calibrated``):
    step, hidden cross-node share and MFU at 400 and 100 Gbit/s."""
    rows = [r for r in data["rows"] if r.get("calibration") and _seven_b_pipelined(r)]
    if not rows:
        raise TableError("gpu_cluster: no 7B 16x8 row has calibrated keys (--calibration)")

    def pair(r: dict, key: str, fmt: str) -> str:
        return f"{format(r[key], fmt)} / {format(r[key + '_calibrated'], fmt)}"

    return _table(
        ["layers", "config", "calibrated by", "compute ms", "step ms 400G", "hidden 400G",
         "MFU 400G", "step ms 100G", "hidden 100G"],
        [[r["layers"], r["config"], r["calibration"]["run"],
          f"{r['compute_ms']:.0f} / {r['compute_ms_calibrated']:.0f}",
          pair(r, "step_ms_400g", ".0f"), pair(r, "hidden_fraction_400g", ".0%"),
          f"{r['mfu_roofline_400g']:.2f} / {r['mfu_400g_calibrated']:.2f}",
          pair(r, "step_ms_100g", ".0f"), pair(r, "hidden_fraction_100g", ".0%")]
         for r in rows])


def _gpu_cluster_peer(data: dict) -> str:
    """The 7B at 16x8 side by side with the peer (``gspmd_fsdp``: a plain ``jax.jit`` step,
    state split by ``NamedSharding``): the scanned stack with the pipelined flags, and the
    unrolled blocks, at 400 and 100 Gbit/s."""
    keep = ("zero3", "zeropp", "qwz_hpz", "zeropp_cross", "gspmd_fsdp")
    rows = [r for r in data["rows"] if _seven_b_pipelined(r) and r["config"] in keep]
    if not any(r["config"] == "gspmd_fsdp" for r in rows):
        raise TableError("gpu_cluster: this run has no gspmd_fsdp rows for the 7B at 16x8")
    rows.sort(key=lambda r: (r["layers"] != "scan", keep.index(r["config"])))
    return _table(
        ["layers", "config", "compiled GB per GPU", "hidden 400G", "step ms 400G",
         "hidden 100G", "step ms 100G", "compute ms"],
        [[r["layers"], r["config"], f"{r['memory_compiled_bytes'] / 1e9:.1f}",
          _pct(r["hidden_fraction_400g"]), f"{r['step_ms_400g']:.0f}",
          _pct(r["hidden_fraction_100g"]), f"{r['step_ms_100g']:.0f}",
          f"{r['compute_ms']:.0f}"] for r in rows])


def _gpu_cluster_plain(data: dict) -> str:
    """The rows with ``compute_ratio_vs_plain`` (the 1.3B), pipelined flags: priced compute
    against a plain ``jax.jit`` step of the same model on one H100, and by class."""
    rows = [r for r in data["rows"] if r.get("compute_ratio_vs_plain") is not None
            and r["flags"] == "pipelined"]
    if not rows:
        raise TableError("gpu_cluster: no row has compute_ratio_vs_plain")
    classes = list(rows[0]["compute_by_class_ms"])
    return _table(
        ["model", "mesh", "config", "compute ms", "vs plain", *classes],
        [[r["model"], r["mesh"], r["config"], f"{r['compute_ms']:.1f}",
          f"{r['compute_ratio_vs_plain']:.2f}",
          *[f"{r['compute_by_class_ms'][c]:.1f}" for c in classes]] for r in rows])


def _gpu_cluster_compute(data: dict) -> str:
    """The 7B at 16x8 rows with a kernel-class breakdown (``compute_by_class_ms``), the
    scanned stack with the pipelined flags and the unrolled blocks: priced compute by
    class, ms per step, and the roofline MFU at 400 Gbit/s."""
    rows = [r for r in data["rows"] if r.get("compute_by_class_ms") and _seven_b_pipelined(r)]
    if not rows:
        raise TableError("gpu_cluster: no row has a compute breakdown (compute_by_class_ms)")
    classes = list(rows[0]["compute_by_class_ms"])
    return _table(
        ["model", "mesh", "layers", "config", *classes, "compute ms", "MFU 400G"],
        [[r["model"], r["mesh"], r["layers"], r["config"],
          *[f"{r['compute_by_class_ms'][c]:.1f}" for c in classes],
          f"{r['compute_ms']:.0f}", f"{r['mfu_roofline_400g']:.2f}"] for r in rows])


def _gpu_cluster_units(data: dict) -> str:
    """The 7B at 16x8, 400 Gbit/s, pipelined flags (scanned) and unrolled: each unit's
    collectives by role, inside and across nodes (unrolled layers summed as ``layers_*``)."""
    import re

    out = []
    for r in data["rows"]:
        if "units_400g" not in r or not _seven_b_pipelined(r) or (
                r["layers"] == "scan"
                and r["config"] not in ("zero3", "zeropp", "qwz_hpz", "zeropp_cross")):
            continue
        sums: dict[tuple, list[float]] = {}
        for u in r["units_400g"]:
            if u["role"] == "other":
                continue
            # Unrolled layers summed; a combined collective's parts named once.
            unit = "+".join(dict.fromkeys(re.sub(r"layers_\d+", "layers_*", u["unit"])
                                          .split("+")))
            key = (unit, u["role"], u["spans_nodes"])
            total = sums.setdefault(key, [0, 0.0, 0.0])
            total[0] += u["runs"]
            total[1] += u["wire_ms"]
            total[2] += u["exposed_ms"]
        for (unit, role, spans), (runs, wire, exposed) in sums.items():
            out.append([r["config"], r["layers"], f"`{unit}`", role,
                        "across" if spans else "inside", str(int(runs)), f"{wire:.1f}",
                        _pct(1 - exposed / wire) if wire else "-"])
    if not out:
        raise TableError("gpu_cluster: this run has no per-unit rows for the 7B at 16x8")
    return _table(["config", "layers", "unit", "role", "nodes", "runs", "wire ms",
                   "hidden"], out)


def qgz_gap(data: dict, view: str | None) -> str:
    """``benchmarks/qgz_gap.py``: the 4-bit gradient loss gap split over qgZ's hops and
    techniques (view None), AdamW's second moment against its prediction ("nu"), and the
    spread of runs that differ only in rounding ("noise")."""
    rows = data["rows"]
    seeds = sorted({int(s) for r in rows for s in r["vs_zero3_pct"]})
    s = data["settings"]

    def cell(r: dict, seed: int) -> str:
        v = r["vs_zero3_pct"].get(str(seed), r["vs_zero3_pct"].get(seed))
        return "—" if v is None else f"{v:+.2f}%"

    if view is None:
        header = (["configuration", "what it isolates"] + [f"seed {x}" for x in seeds]
                  + ["mean", "cross-node bytes vs ZeRO-3"])
        body = []
        for r in rows:
            if r["config"] == "zero3":
                continue
            mean = r["mean_vs_zero3_pct"]
            b = r["bytes_vs_zero3"]
            body.append([r["config"], r["what"], *[cell(r, x) for x in seeds],
                         "—" if mean is None else f"{mean:+.2f}%",
                         "—" if b is None else _x(b, 3)])
        z = data["zero3_val_loss"]
        caption = (
            f"Final validation loss against ZeRO-3 of the same seed (ZeRO-3: "
            + ", ".join(f"{float(v):.4f} at seed {k}" + (
                " from " + data["zero3_source"][k].split(" (")[0]
                if data.get("zero3_source", {}).get(k, "").startswith("benchmarks/") else "")
                for k, v in sorted(z.items()))
            + f"). {s['steps']} steps, global batch {s['batch']} x {s['seq_len']} bytes, "
            f"{s['layers']} layers, d_model {s['d_model']}, peak lr {s['lr']}, "
            f"{s['nodes']} nodes x {s['local']} devices, bf16; "
            f"{data['machine']['cpu']}. Target: within {data['target_pct']}% at "
            f"cross-node bytes <= {data['bytes_budget']:.2f}x ZeRO-3's, on every seed.")
        verdicts = "; ".join(
            f"{t['config']}: " + ", ".join(f"{float(v):+.2f}%" for _, v in sorted(
                t["vs_zero3_pct"].items())) + (" (met)" if t["met"] else " (not met)")
            for t in data.get("targets", []))
        return _table(header, body) + "\n\n" + caption + (
            f" Within the bytes, on {len(seeds)} seeds: {verdicts}." if verdicts else "")
    if view == "nu":
        header = ["configuration", "seed", "step", "sqrt(nu) vs ZeRO-3", "RMS of mu vs ZeRO-3",
                  "predicted sqrt(nu) vs ZeRO-3"]
        body = []
        for r in rows:
            for seed, by_step in sorted(r["nu_vs_zero3"].items()):
                if r["config"] == "zero3":
                    continue
                for step, v in sorted(by_step.items(), key=lambda kv: int(kv[0])):
                    pred = r.get("predicted_sqrt_nu")
                    body.append([r["config"], seed, step, f"{v['sqrt_nu']:.4f}",
                                 f"{v['mu_rms']:.4f}", "—" if pred is None else f"{pred:.4f}"])
        if not body:
            raise TableError("qgz_gap: no run recorded its optimizer moments")
        return _table(header, body) + (
            "\n\nsqrt(nu) summed over every parameter, the run's over ZeRO-3's at the same "
            "step; predicted: sqrt(1 + E[e^2] / E[g^2]), e the variant's reduce-scatter error "
            "measured on ZeRO-3's own gradients at its checkpoints.")
    if view == "noise":
        nf = data["noise_floor"]
        if not nf or not nf.get("runs"):
            raise TableError("qgz_gap: no noise-floor runs")
        body = [[r["run"], f"{r['val_loss']:.4f}"] for r in nf["runs"]]
        for r in data.get("reproduced", []):
            body.append([f"{r['config']} (seed {r['seed']}), this machine vs "
                         f"{r['tracked_source']}", f"{r['diff_pct']:+.3f}%"])
        spread = nf.get("spread_pct")
        th = nf.get("two_hop")
        extra = "" if th is None else (
            f" ZeRO-3 with the two-hop reduce-scatter (bf16 partial sums) against the flat one "
            f"at step {th['step']}: {th['two_hop']:.4f} against {th['zero3']:.4f} "
            f"({th['diff_pct']:+.3f}%).")
        return _table(["ZeRO-3 run, seed " + str(nf["seed"]), "final val loss"], body) + (
            "" if spread is None else f"\n\nSpread (max - min): {spread:.3f}%.") + extra
    if view == "error":
        pred = data["predicted_nu"].get(str(seeds[0])) or data["predicted_nu"].get(seeds[0])
        if not pred:
            raise TableError("qgz_gap: no reduce-scatter error probes")
        steps = sorted({int(k) for v in pred.values() for k in v})
        body = [[name, *[_pct(by[str(t)]["err_over_g2"], 2) if str(t) in by else "—"
                         for t in steps]] for name, by in pred.items()]
        return _table(["reduce-scatter", *[f"step {t}" for t in steps]], body) + (
            f"\n\nE[e^2] / E[g^2] over all parameters: e the reduce-scatter's error against the "
            f"exact sum of the {s['nodes'] * s['local']} devices' gradients (bf16, as the step "
            f"sends them), g that sum; ZeRO-3's parameters and next batch at each step, seed "
            f"{seeds[0]}.")
    if view == "bytes":
        sw = data["switching"]
        lb = data["lowered_bytes_per_step"]
        z = lb["zero3"]["cross"]
        body = [[name, _x(v["cross"] / z, 3), _x(v["intra"] / lb["zero3"]["intra"], 2)]
                for name, v in lb.items()]
        body += [[f"zeropp + Hadamard, qgZ for the first {100 * float(f):.0f}% of steps",
                  _x(v, 3), "—"] for f, v in sw["by_fraction"].items()]
        return _table(["configuration", "cross-node bytes per step vs ZeRO-3",
                       "intra-node bytes vs ZeRO-3"], body) + (
            f"\n\nFrom each configuration's lowered step (all devices, one step). Switching "
            f"qgZ off stays within {data['bytes_budget']:.2f}x up to the first "
            f"{100 * sw['max_fraction']:.1f}% of steps.")
    if view == "leaves":
        cols = [r for r in rows if r["config"] != "zero3" and r.get("leaf_groups")
                and any(g["predicted_sqrt_nu"] for g in r["leaf_groups"])]
        if not cols:
            raise TableError("qgz_gap: no per-parameter moments with a prediction")
        groups = [g["group"] for g in cols[0]["leaf_groups"]]
        body = []
        for k in groups:
            cells = []
            for r in cols:
                g = next((g for g in r["leaf_groups"] if g["group"] == k), None)
                m = "—" if g is None or g["measured_sqrt_nu"] is None else (
                    f"{g['measured_sqrt_nu']:.3f}")
                pr = "—" if g is None or g["predicted_sqrt_nu"] is None else (
                    f"{g['predicted_sqrt_nu']:.3f}")
                cells.append(f"{m} / {pr}")
            body.append([k, *cells])
        return _table(["parameters (all layers)", *[r["config"] for r in cols]], body) + (
            f"\n\nsqrt(nu) against ZeRO-3's at step {s['steps']}, seed {seeds[0]}: measured / "
            "predicted from the reduce-scatter error on ZeRO-3's gradients.")
    raise TableError(f"qgz_gap: unknown view {view!r}; views: nu, noise, leaves, bytes, error")


def _no_view(view: str | None, shape: str) -> None:
    if view is not None:
        raise TableError(f"{shape} results have one table; drop '/{view}'")


# Each shape: the keys that identify it, and its renderer.
SHAPES: list[tuple[str, set[str], Callable[[dict, str | None], str]]] = [
    ("cluster", {"bandwidths", "cells", "runs", "model", "rounds"}, cluster),
    ("cluster_predicted", {"bandwidths", "cells", "runs", "model", "rounds", "calibration"},
     cluster_predicted),
    ("predict_paper", {"rows", "against_published", "against_published_fitted", "constants"},
     predict_paper),
    ("predict_gpu", {"predictions", "constants"}, predict_gpu),
    ("cluster_checkpoint", {"rows", "equal", "stores", "written_on"}, cluster_checkpoint),
    ("comm_volume", {"modes", "vs_regather_all", "params"}, comm_volume),
    ("cluster_generate", {"cells", "ratios", "nodes", "local"}, cluster_generate),
    ("generation", {"exactness", "bytes_per_token", "speed"}, generation),
    ("convergence", {"settings", "runs", "targets"}, convergence),
    ("gpu_check", {"versions", "kernels", "bandwidth", "train_step"}, gpu_check),
    ("gpu_cluster", {"device", "seq_len", "rows"}, gpu_cluster),
    ("gpu_calibrate", {"device", "ceilings", "roofline", "runs"}, gpu_calibrate),
    ("lora_finetune", {"args", "runs"}, lora),
    ("memory", {"modes", "paper_example", "depth"}, memory),
    ("models", {"models", "layers", "d_model", "devices"}, models),
    ("overhead", {"variants", "targets", "model", "rounds"}, overhead),
    ("qgz_accuracy", {"errors", "block_size"}, qgz_accuracy),
    ("feedback_cost", {"settings", "variants", "params", "cpu"}, feedback_cost),
    ("offload", {"settings", "variants", "params", "cpu", "memory_spaces"}, offload),
    ("tensor_parallel_70b", {"tp_rows", "model", "cluster", "predicted"}, tensor_parallel),
    ("experts", {"experts_rows", "model", "batch", "devices"}, experts),
    ("quantization", {"block_vs_tensor", "sweep", "default_block_size"}, quantization),
    ("int4_weights", {"settings", "summary", "models", "configs", "cpu"}, int4_weights),
    ("ulysses", {"all_to_all", "longest_sequence", "step_time"}, ulysses),
    ("weak_scaling", {"entries", "floors_s", "rows_per_device"}, weak_scaling),
    ("trace_overlap", {"trace_summaries"}, trace_overlap),
    ("cluster_floor", {"args", "results"}, cluster_floor),
    ("qgz_gap", {"rows", "predicted_nu", "lowered_bytes_per_step", "bytes_budget"}, qgz_gap),
]
VIEWS = {"gpu_check": ["device", "kernels", "bandwidth", "step"],
         "gpu_cluster": ["grid", "unrolled", "largest", "calibrated", "scheduler", "versions",
                         "defer"],
         "cluster_predicted": ["measured", "predicted", "auto", "targets"],
         "generation": ["exactness", "bytes", "speed"],
         "qgz_accuracy": [None, "smoothing", "formats", "weights", "feedback"],
         "memory": ["state", "paper", "depth"],
         "quantization": ["block_vs_tensor", "sweep"],
         "int4_weights": [None, "round_trip"],
         "qgz_gap": [None, "nu", "noise", "leaves", "bytes", "error"]}


def shape_of(data: Any, name: str) -> tuple[str, Callable[[dict, str | None], str]]:
    if not isinstance(data, dict):
        raise TableError(f"{name}.json: not a JSON object")
    found = [(s, fn, keys) for s, keys, fn in SHAPES if keys <= data.keys()]
    # The most specific shape wins (a cluster run with a calibration is also a cluster run).
    most = max((len(k) for _, _, k in found), default=0)
    found = [(s, fn) for s, fn, k in found if len(k) == most]
    if len(found) != 1:
        raise TableError(
            f"{name}.json: {'no' if not found else 'more than one'} known result shape matches "
            f"its keys {sorted(data.keys())}; add a renderer to docs/hooks.py")
    return found[0]


def render(name: str, view: str | None = None) -> str:
    """The Markdown table for ``benchmarks/results/NAME.json`` (and ``VIEW``)."""
    path = RESULTS / f"{name}.json"
    if not path.is_file():
        raise TableError(f"no results file {path.relative_to(ROOT)}")
    data = json.loads(path.read_text())
    shape, fn = shape_of(data, name)
    try:
        out = fn(data, view)
    except (KeyError, TypeError, IndexError, ZeroDivisionError) as e:
        raise TableError(f"{name}.json ({shape}): unexpected contents: {e!r}") from e
    if "nan" in out.lower().split() or not out.strip():
        raise TableError(f"{name}.json ({shape}): rendered an empty or NaN table")
    return out


def replace_markers(markdown: str, where: str = "page") -> str:
    def sub(m: re.Match) -> str:
        return render(m.group(1), m.group(2))

    out = MARKER.sub(sub, markdown)
    left = ANY_MARKER.findall(out)
    if left:
        raise TableError(f"{where}: malformed table marker(s) {left}; "
                         "write <!-- table: NAME --> or <!-- table: NAME/VIEW -->")
    return out


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return replace_markers(markdown, page.file.src_uri)


def available() -> list[str]:
    out = []
    for path in sorted(RESULTS.glob("*.json")):
        try:
            shape, _ = shape_of(json.loads(path.read_text()), path.stem)
        except TableError:
            out.append(f"{path.stem}  (unknown shape)")
            continue
        for v in VIEWS.get(shape, [None]):
            name = path.stem if v is None else f"{path.stem}/{v}"
            try:
                render(path.stem, v)
            except TableError as e:
                name += f"  (not renderable: {e})"
            out.append(name)
    return out


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        print("\nTables:\n  " + "\n  ".join(available()))
        return 0
    for arg in argv:
        name, _, view = arg.partition("/")
        print(render(name.removesuffix(".json"), view or None))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
