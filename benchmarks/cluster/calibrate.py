"""``run.py --predict``: the cost model calibrated by the run's own probes, its
prediction for every cell, and the automatic configuration's choice per cell.

Probes (run by ``run.py`` in the same session as the rows):

* ``probe_psum`` (a row of the sweep, measured at every bandwidth in the same rounds): its
  step time / ``--probe-k`` is the fixed cost of one collective between processes.
* the compute floor of every zeropp_jax row's configuration (``floor.run_config``:
  each node's share of the step in ``--nodes`` standalone processes at once, no network;
  the collectives inside a process are in it), and FSDP2's (each torch rank alone, in
  process groups of one) when the run has its row.
* the link: ``tc``'s rate.

Prediction for a zeropp_jax cell: ``kappa x floor + cross-node bytes / (eta x rate) +
collectives between processes x fixed cost``, the bytes and the count read from the row's
compiled program, no overlap (on XLA's CPU backend a device's collectives and compute ran
at once for 3-5% of the step in traces: ``traces.py``). Two constants are fitted, by least squares on the zero3 row's cells only:
``kappa``, what running as processes of a cluster adds to the standalone compute (gloo's
threads share the cores), and ``eta``, the link's achieved fraction of the rate (headers,
TCP under the shaper). Every other row's cells check the model.

FSDP2 (torch's compute is not XLA's): its collectives are gloo's (a ring all-gather of every
block in forward and again in backward, the root's once, and a reduce-scatter done as a ring
all-reduce: ``fsdp2_workload``), priced with the same eta and fixed cost; its compute is its
own floor times kappa, and every FSDP2 cell checks it (runs without that floor: fitted on
the fastest link's cell, the other cells check it).

The automatic configuration is ranked with the hardware constants a user would have
(``presets.emulated_cpu`` filled from these probes: one compute throughput from zero3's
floor, the fitted eta, the probe's fixed cost), not with each row's own floor.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
from typing import Any

import numpy as np

from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.measure.comm_report import CommReport
from zeropp_jax.plan.auto import plan
from zeropp_jax.plan.cost_model import CollectiveCost, Hardware, Link, Workload, predict_step
from zeropp_jax.plan.workload import (
    ModelShape,
    config_workload,
    report_workload,
    shape_of_params,
    transformer_shape,
)

# Collectives inside a process are in the compute floor: the intra link costs nothing more.
FREE = Link(1e15, 0.0)
VOCAB = 256  # zeropp_demo.data.VOCAB_SIZE
PROBE_K = 32  # chained psums per probe_psum "step" (run.py's)


def demo_shape(args: argparse.Namespace) -> ModelShape:
    """The demo GPT's units (from its params' shapes, the default wrap policy) and flops per
    token (``transformer_shape``'s accounting of its dimensions)."""
    import jax
    import numpy as np

    from zeropp_demo.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=VOCAB, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=args.heads)
    params = jax.eval_shape(GPT(cfg).init, jax.random.PRNGKey(0),
                            np.zeros((1, args.seq_len), np.int32))["params"]
    flops = transformer_shape(args.layers, args.d_model, VOCAB, args.seq_len).flops_per_token
    return dataclasses.replace(shape_of_params(params, flops_per_token=flops),
                               name=f"demo GPT {args.layers}L d{args.d_model}")


def row_config(row: str, local: int = 1) -> ZeroPPConfig:
    """The configuration of a zeropp_jax row of ``run.py`` (``MODE`` or ``MODE@opts``
    with the options that change the configuration: ``unbucketed``, ``groupK``,
    ``prefetchK``)."""
    mode, _, opts = row.partition("@")
    overrides: dict[str, Any] = {}
    for opt in filter(None, opts.split("+")):
        if opt == "unbucketed":
            overrides["bucket"] = False
        elif opt.startswith("group") and opt[5:].isdigit():
            overrides["hpz_group_size"] = int(opt[5:]) * local
        elif opt.startswith("prefetch") and opt[8:].isdigit():
            overrides["prefetch"] = int(opt[8:])
        else:
            raise ValueError(f"row {row!r}: option {opt!r} does not name a configuration")
    return ZeroPPConfig.from_mode(mode, reduce_scatter="hierarchical",
                                  all_gather="hierarchical", **overrides)


def config_row(row: str) -> bool:
    """True if ``row`` is a zeropp_jax row whose options only change the configuration
    (its floor is its mode's: the same compute)."""
    if row.partition("@")[0] not in ("zero3", "qwz", "hpz", "qgz", "zeropp"):
        return False
    try:
        row_config(row)
    except ValueError:  # an option that does not name a configuration (a profiling one)
        return False
    return True


def tokens_per_device(args: argparse.Namespace) -> float:
    return args.batch * args.seq_len / (args.nodes * args.local)


def constants(args: argparse.Namespace, floors: dict[str, float],
              probe_s: dict[str, float]) -> dict[str, Any]:
    """The probes' constants: compute throughput from zero3's floor, the fixed cost per
    collective between processes per bandwidth."""
    shape, tokens = demo_shape(args), tokens_per_device(args)
    zero3 = config_workload(row_config("zero3"), shape, MeshInfo(args.nodes, args.local), tokens)
    out = {"flops_per_s": zero3.flops_per_device / floors["zero3"],
           "inter_latency_s": dict(probe_s), "floors_s": dict(floors),
           "flops_per_device": zero3.flops_per_device, "tokens_per_device": tokens}
    # qwZ's dequantization: what its floor adds to zero3's, per element it dequantizes.
    weight_mode = next((m for m in ("qwz", "zeropp") if m in floors), None)
    if weight_mode is not None:
        w = config_workload(row_config(weight_mode), shape, MeshInfo(args.nodes, args.local),
                            tokens)
        base = "hpz" if weight_mode == "zeropp" and "hpz" in floors else "zero3"
        extra = floors[weight_mode] - floors[base]
        weight_elems = w.quant_elems_per_device - w.grad_quant_elems_per_device
        if extra > 0 and weight_elems > 0:
            out["quant_elems_per_s"] = weight_elems / extra
    return out


def grad_quant_elems(args: argparse.Namespace, row: str) -> float:
    """Elements one device runs through qgZ's gradient path per step in ``mode``: the
    work a compute floor lacks (one node alone: qgZ falls back to an unquantized
    reduce-scatter there)."""
    return config_workload(row_config(row, args.local), demo_shape(args),
                           MeshInfo(args.nodes, args.local),
                           tokens_per_device(args)).grad_quant_elems_per_device


def hardware(args: argparse.Namespace, const: dict[str, Any], bw: str, bits: float
             ) -> Hardware:
    """The emulated cluster at one link speed, with the probes' and the fit's constants."""
    return Hardware(args.nodes, args.local, FREE,
                    Link(bits / 8 * const.get("eta", 1.0), const["inter_latency_s"][bw]),
                    const["flops_per_s"] * const.get("kappa", 1.0) ** -1,
                    const.get("quant_elems_per_s", float("inf")), 0.0,
                    f"emulated cluster calibrated at {bw}",
                    const.get("grad_quant_elems_per_s"))


def _terms(c: dict, run: dict, const: dict[str, Any]) -> tuple[float, float, float]:
    """(standalone floor s, cross-node bytes per node / rate in s, fixed s) of a cell
    (the floor of a mode with qgZ lacks its gradient path: ``grad_quant_elems``)."""
    w = report_workload(CommReport.from_json(run["predicted"]["compiled_report"]))
    raw = w.cross_bytes_per_node / (c["bandwidth_bits_per_s"] / 8)
    return (const["floors_s"][c["mode"]], raw,
            w.cross_node_collectives * const["inter_latency_s"][c["bandwidth"]])


def _ours(c: dict, runs: dict, const: dict[str, Any]) -> bool:
    run = runs[c["row"]]
    return (config_row(c["row"]) and c["mode"] in const["floors_s"]
            and bool((run.get("predicted") or {}).get("compiled_report")))


def fsdp2_workload(args: argparse.Namespace, params: int, itemsize: int = 2) -> Workload:
    """FSDP2 under gloo: ring all-gathers (each node's one outgoing cross edge carries
    (g - 1) / g of the payload), reduce-scatters as ring all-reduces (twice that), in
    FSDP2's dtype (``itemsize`` bytes: 4 where a CPU without bf16 made it run fp32)."""
    g = args.nodes * args.local
    shape = demo_shape(args)
    blocks = [n for name, n in shape.units if name.startswith("block_")]
    root = params - sum(blocks)
    ring = (g - 1) / g
    costs = []
    for what, n, gathers in [*(("block", b, 2) for b in blocks), ("root", root, 1)]:
        for _ in range(gathers):
            costs.append(CollectiveCost(f"{what} all-gather", "all-gather",
                                        ring * n * itemsize, 0.0, True))
        costs.append(CollectiveCost(f"{what} reduce-scatter", "all-reduce",
                                    2 * ring * n * itemsize, 0.0, True))
    return Workload(tuple(costs), label="torch_fsdp2")


def predict_cells(args: argparse.Namespace, result: dict, const: dict[str, Any]) -> dict:
    """Fits kappa and eta on the zero3 cells, adds ``predicted_step_s`` (and its split) to
    every training cell of ``result``; returns the calibration summary (constants, fitted
    cells, predicted / measured per row)."""
    cells, runs = result["cells"], result["runs"]
    fit = [c for c in cells if c["mode"] == "zero3" and c["row"] == "zero3"]
    a = np.array([[_terms(c, runs[c["row"]], const)[0], _terms(c, runs[c["row"]], const)[1]]
                  for c in fit])
    y = np.array([c["step_time_median_s"] - _terms(c, runs[c["row"]], const)[2] for c in fit])
    kappa, inv_eta = np.linalg.lstsq(a, y, rcond=None)[0]
    const["kappa"], const["eta"] = float(kappa), float(1.0 / inv_eta)
    fit_bw = max(args.bandwidths, key=lambda b: _bits(cells, b))
    # qgZ's gradient path, which no floor holds: its rate fitted on one cell, the fastest
    # link's cell of the qgz row (zeropp's where there is none), where wire time is least.
    q_fit = next((c for m in ("qgz", "zeropp") for c in cells
                  if c["row"] == m == c["mode"] and c["bandwidth"] == fit_bw
                  and _ours(c, runs, const)), None)
    if q_fit is not None:
        floor, raw, fixed = _terms(q_fit, runs[q_fit["row"]], const)
        extra = float(q_fit["step_time_median_s"]
                      - (const["kappa"] * floor + raw / const["eta"] + fixed))
        # No time left over (a backend whose gradient path is free): an infinite rate.
        const["grad_quant_elems_per_s"] = (grad_quant_elems(args, q_fit["row"]) / extra
                                           if extra > 0 else float("inf"))
        const["grad_quant_fitted_on"] = f"{q_fit['row']} at {fit_bw}"
    grad_rate = const.get("grad_quant_elems_per_s", float("inf"))
    fsdp2_compute = None
    errors: dict[str, list[float]] = {}
    # Without FSDP2's floor its compute is fitted on one cell, which must come first.
    f_measured = "torch_fsdp2" in const["floors_s"]
    for c in sorted(cells, key=lambda c: f_measured or c["mode"] != "torch_fsdp2"
                    or c["bandwidth"] != fit_bw):
        hw = hardware(args, const, c["bandwidth"], c["bandwidth_bits_per_s"])
        if c["mode"] == "torch_fsdp2":
            p = predict_step(fsdp2_workload(args, runs[c["row"]]["params"],
                                            _torch_itemsize(runs[c["row"]])), hw)
            if "torch_fsdp2" in const["floors_s"]:
                # Measured: torch's own floor (its ranks alone, no network), slowed by
                # running in the cluster as zero3's fit says; every FSDP2 cell checks it.
                fsdp2_compute = const["kappa"] * const["floors_s"]["torch_fsdp2"]
            elif c["bandwidth"] == fit_bw:
                fsdp2_compute = c["step_time_median_s"] - p.exposed_s - p.fixed_s
                c["predicted_fitted"] = True
            if fsdp2_compute is None:
                continue
            compute, wire, fixed = fsdp2_compute, p.exposed_s, p.fixed_s
            n_x = fsdp2_workload(args, runs[c["row"]]["params"]).cross_node_collectives
        elif _ours(c, runs, const):
            floor, raw, fixed = _terms(c, runs[c["row"]], const)
            compute = (const["kappa"] * floor
                       + grad_quant_elems(args, c["row"]) / grad_rate)
            wire = raw / const["eta"]
            n_x = report_workload(CommReport.from_json(
                runs[c["row"]]["predicted"]["compiled_report"])).cross_node_collectives
            c["predicted_fitted"] = c["row"] == "zero3" or c is q_fit
        else:
            continue
        step = compute + wire + fixed
        c.update({"predicted_step_s": step, "predicted_compute_s": compute,
                  "predicted_wire_s": wire, "predicted_fixed_s": fixed,
                  "predicted_cross_node_collectives": n_x,
                  "predicted_over_measured": step / c["step_time_median_s"]})
        if not c.get("predicted_fitted"):
            errors.setdefault(c["row"], []).append(c["predicted_over_measured"])
    q_note = (f"; qgZ's gradient path rate on {const['grad_quant_fitted_on']}"
              if "grad_quant_fitted_on" in const else "")
    f_note = ("; FSDP2's compute: its floor x kappa" if f_measured
              else f"; FSDP2's compute on its {fit_bw} cell")
    return {"constants": const, "fitted_on": "zero3 (kappa, eta)" + f_note + q_note,
            "fsdp2_compute_s": fsdp2_compute,
            "fsdp2_fitted_on": (fit_bw if fsdp2_compute is not None and not f_measured
                                else None),
            "predicted_over_measured": errors,
            "within_15pct": int(sum(abs(r - 1) <= 0.15 for v in errors.values() for r in v)),
            "checked_cells": sum(len(v) for v in errors.values())}


def auto_choices(args: argparse.Namespace, result: dict, const: dict[str, Any]) -> list[dict]:
    """Per bandwidth: ``plan``'s choice among the measured zeropp_jax rows (calibrated
    hardware, the demo GPT's shape) against the fastest measured of them."""
    cells = result["cells"]
    modes = list(dict.fromkeys(c["row"] for c in cells if config_row(c["row"])))
    configs = [row_config(m, args.local) for m in modes]
    out = []
    for bw in args.bandwidths:
        here = {c["row"]: c for c in cells if c["bandwidth"] == bw and c["row"] in modes}
        hw = hardware(args, const, bw, next(iter(here.values()))["bandwidth_bits_per_s"])
        p = plan(demo_shape(args), hardware=hw, tokens_per_device=tokens_per_device(args),
                 configs=configs)
        chosen = modes[configs.index(p.chosen.config)]
        fastest = min(here, key=lambda m: here[m]["step_time_median_s"])
        ratio = here[chosen]["step_time_median_s"] / here[fastest]["step_time_median_s"]
        out.append({"bandwidth": bw, "chosen": chosen, "fastest_measured": fastest,
                    "chosen_over_fastest": ratio, "within_5pct": ratio <= 1.05,
                    "table": p.table()})
    return out


# Step-time targets against PyTorch FSDP2 on the emulated cluster (3.32M GPT, 2 nodes x 2
# devices): (link in bits/s, row, FSDP2's step time / the row's, at least).
FSDP2_TARGETS = ((1e10, "zero3", 1.1), (1e9, "zero3", 1.3), (1e8, "zeropp", 6.0))


def ceilings(result: dict, const: dict[str, Any],
             targets: tuple[tuple[float, str, float], ...] = FSDP2_TARGETS) -> list[dict]:
    """Each target whose cells the run has, measured, and the best FSDP2 / ours a step that
    does not overlap communication with compute could reach with this row's compute and
    bytes (on XLA's CPU backend they overlap for a few percent of a step at most):
    FSDP2's measured time over ``compute + wire + fixed``, where ``compute`` is the row's
    compute floor (times the fitted ``kappa`` where that is below 1: a cluster whose
    processes compute faster than in the floor's run), ``wire`` its cross-node bytes per
    node at the full ``tc`` rate and ``fixed`` its collectives between processes times the
    probe's fixed cost. ``ceiling_without_fixed`` drops ``fixed``: what merging every
    collective into one could give at most. A target above ``ceiling_without_fixed`` needs
    less compute, fewer bytes or overlap; no bucketing can reach it."""
    cells, runs = result["cells"], result["runs"]
    at = {(c["row"], c["bandwidth"]): c for c in cells}
    out = []
    for bits, row, target in targets:
        bw = next((c["bandwidth"] for c in cells
                   if c["row"] == row and abs(c["bandwidth_bits_per_s"] - bits) < 1), None)
        if bw is None or ("torch_fsdp2", bw) not in at or not _ours(at[(row, bw)], runs,
                                                                    const):
            continue
        c = at[(row, bw)]
        floor, wire, fixed = _terms(c, runs[row], const)
        compute = min(1.0, const.get("kappa", 1.0)) * floor
        fsdp2 = at[("torch_fsdp2", bw)]["step_time_median_s"]
        measured = fsdp2 / c["step_time_median_s"]
        out.append({"bandwidth": bw, "row": row, "target": target,
                    "fsdp2_s": fsdp2, "measured_s": c["step_time_median_s"],
                    "measured": measured, "met": measured >= target,
                    "compute_s": compute, "wire_s": wire, "fixed_s": fixed,
                    "fsdp2_floor_s": const["floors_s"].get("torch_fsdp2"),
                    "ceiling": fsdp2 / (compute + wire + fixed),
                    "ceiling_without_fixed": fsdp2 / (compute + wire)})
    return out


def calibrate(args: argparse.Namespace, result: dict, floors: dict[str, float]) -> dict:
    """The whole calibration of a run: the probes' constants, the fit and every cell's
    prediction (``predict_cells``), the automatic configuration's choices, the targets and
    their no-overlap ceilings. Adds the predictions to ``result``'s cells."""
    const = constants(args, floors, median_probe(result["cells"], PROBE_K))
    calibration = predict_cells(args, result, const)
    calibration["auto"] = auto_choices(args, result, const)
    calibration["targets"] = ceilings(result, const)
    return calibration


def _torch_itemsize(run: dict) -> int:
    return 4 if run.get("worker", {}).get("torch_dtype") == "float32" else 2


def _bits(cells: list[dict], bw: str) -> float:
    return next(c["bandwidth_bits_per_s"] for c in cells if c["bandwidth"] == bw)


def summary_lines(calib: dict, choices: list[dict]) -> list[str]:
    const = calib["constants"]
    lines = [f"cost model constants: compute {const['flops_per_s'] / 1e9:.2f} GFLOP/s per "
             "device standalone (floors "
             + ", ".join(f"{m} {t * 1e3:.1f} ms" for m, t in const["floors_s"].items())
             + f"), in the cluster x{const['kappa']:.3f}; link at {const['eta']:.3f} of the "
             "rate (both fitted on zero3); per collective between processes "
             + ", ".join(f"{b} {s * 1e3:.2f} ms" for b, s in const["inter_latency_s"].items())]
    if "quant_elems_per_s" in const or "grad_quant_elems_per_s" in const:
        lines.append(
            "quantization: weight path "
            + (f"{const['quant_elems_per_s'] / 1e6:.0f} M elements/s (from the floors)"
               if "quant_elems_per_s" in const else "free")
            + ", qgZ's gradient path "
            + (f"{const['grad_quant_elems_per_s'] / 1e6:.0f} M elements/s (fitted on "
               f"{const['grad_quant_fitted_on']})" if "grad_quant_elems_per_s" in const
               else "free"))
    if calib["fsdp2_compute_s"] is not None and calib["fsdp2_fitted_on"] is not None:
        lines.append(f"FSDP2 compute fitted on the {calib['fsdp2_fitted_on']} cell: "
                     f"{calib['fsdp2_compute_s'] * 1e3:.1f} ms")
    elif calib["fsdp2_compute_s"] is not None:
        lines.append(f"FSDP2 compute from its floor ({const['floors_s']['torch_fsdp2'] * 1e3:.1f}"
                     f" ms) x kappa: {calib['fsdp2_compute_s'] * 1e3:.1f} ms")
    for row, rs in calib["predicted_over_measured"].items():
        lines.append(f"  {row:<14} predicted / measured: " + ", ".join(f"{r:.2f}" for r in rs))
    lines.append(f"within 15%: {calib['within_15pct']} of {calib['checked_cells']} checked "
                 "cells")
    for ch in choices:
        lines.append(f"auto at {ch['bandwidth']}: chose {ch['chosen']}, fastest measured "
                     f"{ch['fastest_measured']} ({ch['chosen_over_fastest']:.3f}x its time)")
    for t in calib.get("targets", []):
        lines.append(
            f"target {t['row']} >= {t['target']}x FSDP2 at {t['bandwidth']}: {t['measured']:.2f}x "
            f"{'met' if t['met'] else 'MISSED'}; without overlap at most {t['ceiling']:.2f}x "
            f"(compute {1e3 * t['compute_s']:.0f} + wire {1e3 * t['wire_s']:.0f} + fixed "
            f"{1e3 * t['fixed_s']:.0f} ms), {t['ceiling_without_fixed']:.2f}x with no fixed cost")
    return lines


def median_probe(cells: list[dict], probe_k: int) -> dict[str, float]:
    """Per bandwidth: the probe's step time / k (one collective between processes)."""
    return {c["bandwidth"]: statistics.median(c["times_s"]) / probe_k
            for c in cells if c["mode"] == "probe_psum"}


def recalibrate(path: str, write: bool = False) -> dict:
    """The calibration and predictions of a saved ``run.py --predict`` run, made again
    from its measurements (the probe row, the floors, each row's compiled collectives) by
    this version of the model; ``write=True`` stores them back in the JSON."""
    import json
    import pathlib

    result = json.loads(pathlib.Path(path).read_text())
    model = result["model"]
    args = argparse.Namespace(nodes=result["nodes"], local=result["local"],
                              bandwidths=result["bandwidths"], **{
                                  k: model[k] for k in ("layers", "d_model", "heads",
                                                        "seq_len", "batch")})
    floors = result.get("floors_s") or result["calibration"]["constants"]["floors_s"]
    result["calibration"] = calibrate(args, result, floors)
    if write:
        pathlib.Path(path).write_text(json.dumps(
            result, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Calibrate the cost model again from saved "
                                "run.py --predict runs (no cluster needed).")
    p.add_argument("runs", nargs="+", help="JSON files written by run.py --predict")
    p.add_argument("--write", action="store_true", help="store the new calibration in them")
    args = p.parse_args(argv)
    for path in args.runs:
        result = recalibrate(path, args.write)
        print(f"{path}: {result['nodes']} nodes x {result['local']} devices")
        for line in summary_lines(result["calibration"], result["calibration"]["auto"]):
            print("  " + line)


if __name__ == "__main__":
    main()
