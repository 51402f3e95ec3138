"""benchmarks/cluster/calibrate.py (``benchmarks/cluster/run.py --predict``): the fit
recovers the constants a run was made of, and predicts the cells it was not fitted on."""

from __future__ import annotations

import argparse

import pytest

from benchmarks.cluster import calibrate
from zeropp_jax.measure.comm_report import CollectiveRow, CommReport
from zeropp_jax.plan.workload import config_workload

# Traced transports shared by every ``config_workload`` call of this module (calibrate's
# ``grad_quant_elems`` prices each cell anew): the keys name all a trace depends on
# (transport, padded length, dtype, mesh), so the workloads are the same, traced once.
_MEMO: dict = {}


@pytest.fixture(autouse=True)
def _shared_traces(monkeypatch):
    monkeypatch.setattr(calibrate, "config_workload",
                        lambda *a, memo=None, **k: config_workload(*a, memo=_MEMO, **k))


def _report(cross_bytes: float, collectives: int) -> dict:
    # 2 nodes x 2 devices; one cross-node all-gather row run `collectives` times whose
    # cross bytes per node are `cross_bytes` in all, and one intra-node row.
    rows = (CollectiveRow("all-gather", "bf16", (8,), 16, ((0, 2), (1, 3)), 0.0,
                          2 * cross_bytes / collectives, count=collectives),
            CollectiveRow("all-gather", "bf16", (8,), 16, ((0, 1), (2, 3)), 64.0, 0.0))
    return CommReport(rows, 2, 2).to_json()


def test_the_fit_recovers_kappa_and_eta_and_predicts_the_other_rows():
    kappa, eta = 1.25, 0.8
    floors = {"zero3": 0.20, "zeropp": 0.15}
    latency = {"100mbit": 2e-3, "1gbit": 1.5e-3, "10gbit": 1e-3}
    bits = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}
    shape = {"zero3": (9e6, 14), "zeropp": (2.5e6, 11)}  # cross bytes per node, collectives
    runs = {m: {"params": 1000, "predicted": {"compiled_report": _report(*shape[m])}}
            for m in shape}
    cells = []
    for m in shape:
        for bw in bits:
            x, n = shape[m]
            t = kappa * floors[m] + x / (eta * bits[bw] / 8) + n * latency[bw]
            cells.append({"row": m, "mode": m, "bandwidth": bw, "bandwidth_bits_per_s": bits[bw],
                          "step_time_median_s": t})
    args = argparse.Namespace(nodes=2, local=2, bandwidths=list(bits), layers=1, d_model=32,
                              heads=2, seq_len=16, batch=4)
    const = {"floors_s": floors, "inter_latency_s": latency, "flops_per_s": 1e9}
    calib = calibrate.predict_cells(args, {"cells": cells, "runs": runs}, const)
    assert const["kappa"] == pytest.approx(kappa, rel=1e-9)
    assert const["eta"] == pytest.approx(eta, rel=1e-9)
    # zero3 is fitted (not counted), and zeropp's fastest-link cell (qgZ's gradient-path
    # rate, none planted here); zeropp's two other cells are checked and exact here.
    assert const["grad_quant_fitted_on"] == "zeropp at 10gbit"
    assert list(calib["predicted_over_measured"]) == ["zeropp"]
    assert calib["predicted_over_measured"]["zeropp"] == pytest.approx([1.0] * 2, rel=1e-9)
    assert calib["within_15pct"] == calib["checked_cells"] == 2
    for c in cells:
        assert c["predicted_fitted"] == (c["mode"] == "zero3" or c["bandwidth"] == "10gbit")
        assert c["predicted_cross_node_collectives"] == shape[c["mode"]][1]
    # A model that is wrong shows: double zeropp's measured times on the checked cells and
    # they miss.
    for c in cells:
        if c["mode"] == "zeropp" and c["bandwidth"] != "10gbit":
            c["step_time_median_s"] *= 2
    calib = calibrate.predict_cells(args, {"cells": cells, "runs": runs}, const)
    assert calib["predicted_over_measured"]["zeropp"] == pytest.approx([0.5] * 2, rel=1e-9)
    assert calib["within_15pct"] == 0


def test_the_gradient_path_rate_is_fitted_on_one_qgz_cell_and_predicts_the_others():
    """qgZ's quantized reduce-scatter is missing from every compute floor (one node alone
    reduces unquantized): its rate is fitted on the qgz row's fastest-link cell and must
    then predict the qgz row's other cells, and zeropp's."""
    kappa, eta, rate = 1.1, 0.9, 5e7
    floors = {"zero3": 0.20, "qgz": 0.19, "zeropp": 0.21}
    latency = {"100mbit": 2e-3, "1gbit": 1.5e-3, "10gbit": 1e-3}
    bits = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}
    shape = {"zero3": (9e6, 14), "qgz": (6e6, 14), "zeropp": (2.5e6, 11)}
    args = argparse.Namespace(nodes=2, local=2, bandwidths=list(bits), layers=1, d_model=32,
                              heads=2, seq_len=16, batch=4)
    runs = {m: {"params": 1000, "predicted": {"compiled_report": _report(*shape[m])}}
            for m in shape}
    cells = []
    for m in shape:
        grad_elems = calibrate.grad_quant_elems(args, m)
        assert (grad_elems > 0) == (m != "zero3")
        for bw in bits:
            x, n = shape[m]
            t = (kappa * floors[m] + grad_elems / rate + x / (eta * bits[bw] / 8)
                 + n * latency[bw])
            cells.append({"row": m, "mode": m, "bandwidth": bw, "bandwidth_bits_per_s": bits[bw],
                          "step_time_median_s": t})
    const = {"floors_s": floors, "inter_latency_s": latency, "flops_per_s": 1e9}
    calib = calibrate.predict_cells(args, {"cells": cells, "runs": runs}, const)
    assert const["grad_quant_elems_per_s"] == pytest.approx(rate, rel=1e-9)
    assert const["grad_quant_fitted_on"] == "qgz at 10gbit"
    assert calib["predicted_over_measured"]["qgz"] == pytest.approx([1.0] * 2, rel=1e-9)
    assert calib["predicted_over_measured"]["zeropp"] == pytest.approx([1.0] * 3, rel=1e-9)
    # Without the gradient path term every qgZ cell would be predicted short.
    for c in cells:
        if c["mode"] != "zero3":
            assert c["predicted_step_s"] > c["step_time_median_s"] - 1e-12
            assert c["predicted_compute_s"] > kappa * floors[c["mode"]] + 1e-4


def test_fsdp2_under_gloo_moves_rings():
    # 2 nodes x 2 ranks: a ring all-gather sends (g - 1) / g = 3/4 of the payload across each
    # node's one outgoing cross edge; the reduce-scatter runs as an all-reduce (twice that).
    args = argparse.Namespace(nodes=2, local=2, layers=2, d_model=32, heads=2, seq_len=16)
    units = dict(calibrate.demo_shape(args).units)
    block = units["block_0"]
    assert units["block_1"] == block
    w = calibrate.fsdp2_workload(args, params=2 * block + 1000)
    assert w.cross_node_collectives == 2 * 3 + 2  # per block: AG, AG, RS; root: AG, RS
    # Bytes (bf16): all-gathers 3/4 x (blocks twice + root once), all-reduces 3/2 x all.
    expected = 0.75 * 2 * (4 * block + 1000) + 1.5 * 2 * (2 * block + 1000)
    assert w.cross_bytes_per_node == pytest.approx(expected, rel=1e-12)
    assert calibrate.fsdp2_workload(args, 2 * block + 1000, 4).cross_bytes_per_node == \
        pytest.approx(2 * expected, rel=1e-12)


def test_ceilings_are_fsdp2_over_compute_wire_and_fixed_cost_worked_by_hand():
    """``calibrate.ceilings``: FSDP2's measured time over the row's compute floor + its
    cross-node bytes at the full rate + its collectives x the probe's fixed cost; targets
    whose cells the run lacks are left out; the floor is scaled only by a kappa below 1."""
    runs = {"zero3": {"params": 1000, "predicted": {"compiled_report": _report(9e6, 10)}},
            "torch_fsdp2": {"params": 1000}}
    cells = [{"row": "zero3", "mode": "zero3", "bandwidth": "1gbit",
              "bandwidth_bits_per_s": 1e9, "step_time_median_s": 0.35},
             {"row": "torch_fsdp2", "mode": "torch_fsdp2", "bandwidth": "1gbit",
              "bandwidth_bits_per_s": 1e9, "step_time_median_s": 0.40}]
    const = {"floors_s": {"zero3": 0.2}, "inter_latency_s": {"1gbit": 2e-3}, "kappa": 1.3}
    targets = ((1e10, "zero3", 1.1), (1e9, "zero3", 1.3), (1e8, "zeropp", 6.0))
    (t,) = calibrate.ceilings({"cells": cells, "runs": runs}, const, targets)
    # 9e6 bytes at 1e9 / 8 bytes/s = 72 ms; 10 collectives x 2 ms = 20 ms.
    assert (t["bandwidth"], t["row"], t["target"]) == ("1gbit", "zero3", 1.3)
    assert (t["compute_s"], t["wire_s"], t["fixed_s"]) == pytest.approx((0.2, 0.072, 0.02))
    assert t["measured"] == pytest.approx(0.40 / 0.35) and not t["met"]
    assert t["ceiling"] == pytest.approx(0.40 / 0.292)
    assert t["ceiling_without_fixed"] == pytest.approx(0.40 / 0.272)
    # A cluster that computes faster than the floor (kappa < 1) lowers the compute term.
    const["kappa"] = 0.5
    (t,) = calibrate.ceilings({"cells": cells, "runs": runs}, const, targets)
    assert t["compute_s"] == pytest.approx(0.1)
    assert t["ceiling"] == pytest.approx(0.40 / 0.192)
    # A target met is marked met.
    (t,) = calibrate.ceilings({"cells": cells, "runs": runs}, const, ((1e9, "zero3", 1.1),))
    assert t["met"]



def test_row_options_name_their_configuration_and_profiling_ones_do_not():
    c = calibrate.row_config("zeropp@unbucketed+group2+prefetch3", local=2)
    assert (c.bucket, c.hpz_group_size, c.prefetch) == (False, 4, 3)
    assert calibrate.row_config("zero3") == calibrate.row_config("zero3@prefetch1")
    assert calibrate.config_row("hpz@prefetch2") and not calibrate.config_row("zero3@trace")
    assert not calibrate.config_row("torch_fsdp2")
    with pytest.raises(ValueError, match="does not name a configuration"):
        calibrate.row_config("zero3@pin")


def test_fsdp2_with_its_own_floor_is_predicted_on_every_cell_with_nothing_fitted():
    """With torch's floor measured, FSDP2's compute is that floor x kappa (zero3's fit) and
    all its cells are checks; a planted FSDP2 that runs 10% slower shows as 0.91."""
    kappa, eta = 1.2, 0.9
    floors = {"zero3": 0.20, "torch_fsdp2": 0.15}
    latency = {"100mbit": 2e-3, "1gbit": 1.5e-3, "10gbit": 1e-3}
    bits = {"100mbit": 1e8, "1gbit": 1e9, "10gbit": 1e10}
    args = argparse.Namespace(nodes=2, local=2, bandwidths=list(bits), layers=1, d_model=32,
                              heads=2, seq_len=16, batch=4)
    runs = {"zero3": {"params": 1000, "predicted": {"compiled_report": _report(9e6, 14)}},
            "torch_fsdp2": {"params": 20_000}}
    const = {"floors_s": floors, "inter_latency_s": latency, "flops_per_s": 1e9}
    cells = []
    for bw in bits:
        cells.append({"row": "zero3", "mode": "zero3", "bandwidth": bw,
                      "bandwidth_bits_per_s": bits[bw],
                      "step_time_median_s": kappa * 0.2 + 9e6 / (eta * bits[bw] / 8)
                      + 14 * latency[bw]})
    for bw in bits:
        hw = calibrate.hardware(args, {**const, "kappa": kappa, "eta": eta}, bw, bits[bw])
        p = calibrate.predict_step(calibrate.fsdp2_workload(args, 20_000), hw)
        cells.append({"row": "torch_fsdp2", "mode": "torch_fsdp2", "bandwidth": bw,
                      "bandwidth_bits_per_s": bits[bw],
                      "step_time_median_s": 1.1 * (kappa * 0.15 + p.exposed_s + p.fixed_s)})
    calib = calibrate.predict_cells(args, {"cells": cells, "runs": runs}, const)
    assert calib["fsdp2_fitted_on"] is None
    assert calib["fsdp2_compute_s"] == pytest.approx(kappa * 0.15)
    assert calib["predicted_over_measured"]["torch_fsdp2"] == pytest.approx([1 / 1.1] * 3)
    assert not any(c.get("predicted_fitted") for c in cells if c["mode"] == "torch_fsdp2")
