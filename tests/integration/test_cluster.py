"""benchmarks/cluster/run.py end to end: a short emulated-cluster run (2 nodes x 2 devices, one
bandwidth, tiny model, zero3 and zeropp) writes every cell, and leaves no namespace,
veth or /etc/netns entry behind. Needs root and `ip netns`; slow (about a minute)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from helpers import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
PREFIX = "zppcl-"


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth pairs, tc)"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return "iproute2 (`ip`, `tc`) not installed"
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns` unavailable: {r.stderr.strip()}"
    return None


def _our_namespaces() -> list[str]:
    r = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return [ln.split()[0] for ln in r.stdout.splitlines() if ln.startswith(PREFIX)]


@pytest.mark.slow
def test_short_cluster_run_writes_cells_and_cleans_up(tmp_path):
    reason = _netns_unavailable()
    if reason:
        pytest.skip(reason)
    if _our_namespaces():
        pytest.skip(f"leftover {PREFIX}* namespaces; run benchmarks/cluster/run.py --cleanup")
    env = subprocess_env()
    cmd = [sys.executable, str(ROOT / "benchmarks/cluster/run.py"), "--nodes", "2", "--local", "2",
           "--bandwidths", "100mbit", "--modes", "zero3,zeropp", "--no-native-row", "--no-fsdp2",
           "--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "16",
           "--batch", "4", "--steps", "2", "--rounds", "1", "--warmup", "0",
           "--timeout", "240",
           "--out", str(tmp_path), "--name", "t"]
    try:
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    finally:
        leftovers = _our_namespaces()
        if leftovers:  # never leave them behind, even when the assertions below fail
            subprocess.run([sys.executable, str(ROOT / "benchmarks/cluster/run.py"), "--cleanup"],
                           cwd=ROOT, capture_output=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert leftovers == [], f"namespaces left after the run: {leftovers}"
    assert not list(pathlib.Path("/etc/netns").glob(PREFIX + "*"))
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert "zcl-" not in links and "zclbr" not in links

    out = json.loads((tmp_path / "t.json").read_text())
    assert (tmp_path / "t.png").stat().st_size > 0
    cells = {(c["bandwidth"], c["row"]): c for c in out["cells"]}
    assert set(cells) == {("100mbit", "zero3"), ("100mbit", "zeropp")}
    for c in cells.values():
        assert c["step_time_median_s"] > 0 and len(c["times_s"]) == 2
        assert c["speedup_vs_zero3"] > 0
        # Both nodes sent traffic over their shaped link during the timed steps.
        assert len(c["measured_tx_bytes_per_step_by_node"]) == 2
        assert min(c["measured_tx_bytes_per_step_by_node"]) > 0
    assert cells[("100mbit", "zero3")]["speedup_vs_zero3"] == 1.0
    # ZeRO++ sends fewer bytes than ZeRO-3 (INT8 weights, local backward gathers, INT4
    # gradients); the exact ratio depends on gloo's algorithms, so only the direction here.
    assert (cells[("100mbit", "zeropp")]["measured_tx_bytes_per_node_per_step"]
            < 0.6 * cells[("100mbit", "zero3")]["measured_tx_bytes_per_node_per_step"])
    assert out["baseline_note"]  # says which reduce-scatter the baseline used


def test_cluster_without_root_explains(monkeypatch):
    """The root check names what is needed (runs without root or network namespaces)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks.cluster import run

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit, match="needs root"):
        run.check_environment()
