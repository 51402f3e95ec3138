"""The emulated cluster's reporting tools (``benchmarks/cluster/weak_scaling.py``,
``benchmarks/cluster/traces.py``) on hand-made inputs."""

from __future__ import annotations

import pytest


def _run(nodes: int, batch: int, times: dict[str, float]) -> dict:
    cells = [{"row": r, "bandwidth": "1gbit", "step_time_median_s": t,
              "round_medians_s": [t * 0.98, t, t * 1.02], "predicted_step_s": t * 1.1}
             for r, t in times.items()]
    return {"nodes": nodes, "local": 1, "bandwidths": ["1gbit"], "rounds": 3,
            "model": {"layers": 4, "d_model": 256, "batch": batch}, "cells": cells,
            "floors_s": {"zero3": 0.1 * nodes, "zeropp": 0.12 * nodes}}


def test_weak_scaling_puts_the_runs_side_by_side_and_refuses_other_batches():
    from benchmarks.cluster import weak_scaling

    rows = ("zero3", "zeropp", "torch_fsdp2")
    a = _run(2, 4, dict(zip(rows, (0.2, 0.15, 0.25))))
    b = _run(4, 8, dict(zip(rows, (0.3, 0.35, 0.4))))
    out = weak_scaling.combine([a, b], ["a", "b"])
    e = next(e for e in out["entries"] if e["row"] == "zeropp")
    assert [p["step_s"] for p in e["points"]] == [0.15, 0.35]
    assert e["points"][1]["spread"] == pytest.approx(0.04)
    assert [f["zero3"] for f in out["floors_s"]] == pytest.approx([0.2, 0.4])
    with pytest.raises(ValueError, match="rows per device"):
        weak_scaling.combine([a, _run(4, 4, dict(zip(rows, (1, 1, 1))))], ["a", "c"])
    with pytest.raises(ValueError, match="no torch_fsdp2 cell"):
        weak_scaling.combine([a, _run(4, 8, {"zero3": 1, "zeropp": 1})], ["a", "d"])


def test_trace_overlap_counts_time_covered_by_both_collectives_and_compute_per_device():
    """``traces.device_overlap``, worked by hand: device 0 gathers over [0, 10) and
    [20, 30) us and computes over [5, 25) and [8, 12) us (nested: counted once); device 1
    only computes."""
    from benchmarks.cluster import traces

    def op(name, dev, ts, dur):
        return {"name": name, "ts": ts, "dur": dur,
                "args": {"hlo_op": name, "device_ordinal": dev}}

    ops = [op("all_gather.1", "0", 0, 10), op("all-gather.2", "0", 20, 10),
           op("fusion.3", "0", 5, 20), op("fusion.4", "0", 8, 4), op("fusion.5", "1", 0, 7)]
    out = traces.device_overlap(ops, n=1)
    assert out["0"] == pytest.approx({"collective_per_step_s": 20e-6,
                                      "compute_per_step_s": 20e-6,
                                      "both_per_step_s": 10e-6})
    assert out["1"] == pytest.approx({"collective_per_step_s": 0.0,
                                      "compute_per_step_s": 7e-6, "both_per_step_s": 0.0})
    assert traces.device_overlap(ops, n=2)["0"]["both_per_step_s"] == pytest.approx(5e-6)
