"""zeropp_jax.auto_config: the fastest candidate by the cost model, within the memory budget."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import zeropp_jax as zpp
from tests.helpers import SMALL, init_params
from zeropp_jax.plan import auto, presets
from zeropp_jax.plan.auto import candidate_configs, plan
from zeropp_jax.plan.cost_model import Hardware, Link
from zeropp_jax.plan.workload import config_label, config_workload, transformer_shape

SHAPE = transformer_shape(4, 512, 8000, 512, name="GPT 4L d512")
# A slow network and free compute: the ranking is by bytes and collectives only.
SLOW = Hardware(4, 2, Link(1e10, 1e-5), Link.gbps(0.1, 1e-4), flops_per_s=1e15)
# Traced transports shared by every plan of this module (each ``plan`` call keeps its own
# memo otherwise): the keys name all a trace depends on (transport, padded length, dtype,
# mesh), so every candidate is costed as before, each transport traced once.
_MEMO: dict = {}


@pytest.fixture(autouse=True)
def _shared_traces(monkeypatch):
    monkeypatch.setattr(auto, "config_workload",
                        lambda *a, memo=None, **k: config_workload(*a, memo=_MEMO, **k))


def test_candidates_cover_the_combinations_and_one_node_is_zero3_only():
    labels = [config_label(c) for c in candidate_configs(4, 2, allow_int4_weights=True)]
    assert len(labels) == len(set(labels)) == 3 * 2 * (1 + 2)  # weights x qgz x hpz groups
    assert {"zero3", "qwz-int8", "qwz-int4+hpz+qgz-int4", "hpz[4]+qgz-int4"} <= set(labels)
    # Without the opt-in: the same combinations without INT4 weights.
    default = [config_label(c) for c in candidate_configs(4, 2)]
    assert default == [x for x in labels if "qwz-int4" not in x]
    assert len(default) == 2 * 2 * (1 + 2)
    assert [config_label(c) for c in candidate_configs(1, 8)] == ["zero3"]
    # Settings outside the techniques come from base.
    base = zpp.ZeroPPConfig(prefetch=2, block_size=128)
    assert all(c.prefetch == 2 and c.block_size == 128 for c in candidate_configs(4, 2, base))


def test_a_slow_network_picks_the_fewest_bytes_and_the_table_is_the_ranking():
    p = plan(SHAPE, hardware=SLOW, allow_int4_weights=True)
    times = [c.prediction.step_s for c in p.candidates]
    assert times == sorted(times)
    assert p.chosen is p.candidates[0]
    assert p.chosen.label == "qwz-int4+hpz+qgz-int4"
    least_bytes = min(p.candidates, key=lambda c: c.wire_mb)
    assert least_bytes.wire_mb == p.chosen.wire_mb
    assert "<- chosen" in p.table() and "compute is not counted" in p.table()


def test_int4_weights_are_ranked_only_when_allowed_and_the_table_says_so(capsys):
    """INT4 weights lose accuracy where INT8 weights do not (benchmarks/int4_weights.py):
    the fastest on a slow network, yet not chosen unless the user opts in; the table's
    last line names the switch, and an INT4 choice comes with a warning to check
    convergence. Listing INT4 configs in configs= is opting in."""
    default = plan(SHAPE, hardware=SLOW)
    assert not any(c.config.weight_format == "int4" and c.config.qwz
                   for c in default.candidates)
    assert default.chosen.label == "qwz-int8+hpz+qgz-int4"
    assert "allow_int4_weights=True" in default.table().splitlines()[-1]
    allowed = plan(SHAPE, hardware=SLOW, allow_int4_weights=True)
    assert allowed.chosen.label == "qwz-int4+hpz+qgz-int4"
    assert allowed.chosen.prediction.step_s < default.chosen.prediction.step_s
    assert "INT4 weights chosen" in allowed.table() and "convergence" in allowed.table()
    listed = plan(SHAPE, hardware=SLOW, configs=[zpp.ZeroPPConfig(),
                                                 zpp.ZeroPPConfig.zeropp(weight_format="int4")])
    assert listed.chosen.label == "qwz-int4+hpz+qgz-int4"
    # auto_config passes the switch on and prints the note.
    config = zpp.auto_config(SHAPE, hardware=SLOW)
    assert config.weight_format == "int8" and config.qwz
    assert "allow_int4_weights=True ranks them" in capsys.readouterr().out
    assert zpp.auto_config(SHAPE, hardware=SLOW, allow_int4_weights=True,
                                 verbose=False).weight_format == "int4"


def test_when_compute_dominates_ties_go_to_fewer_techniques():
    fast = dataclasses.replace(SLOW, inter=Link.gbps(400.0, 1e-5), flops_per_s=1e11)
    p = plan(SHAPE, hardware=fast, tokens_per_device=4096)
    assert p.chosen.label == "zero3"
    assert p.chosen.prediction.step_s <= p.candidates[0].prediction.step_s * 1.02
    assert p.candidates[0].label != "zero3"  # a technique is marginally faster, within the tie


def test_the_memory_budget_rules_out_hpz_and_an_impossible_budget_names_the_fix():
    free = plan(SHAPE, hardware=SLOW)
    assert free.chosen.config.hpz
    without_hpz = max(c.prediction.memory_bytes for c in free.candidates if not c.config.hpz)
    p = plan(SHAPE, hardware=SLOW, memory_budget_bytes=without_hpz)
    assert not p.chosen.config.hpz and p.chosen.fits
    assert any(not c.fits for c in p.candidates) and "over budget" in p.table()
    with pytest.raises(ValueError, match="Raise the budget, add devices"):
        plan(SHAPE, hardware=SLOW, memory_budget_bytes=1.0)


def test_config_auto_takes_params_prints_and_returns_a_config(capsys):
    params = init_params(SMALL, 0)
    config = zpp.auto_config(params, nodes=2, local=4, inter_gbps=0.1,
                                   hardware=presets.emulated_cpu(2, 4))
    assert isinstance(config, zpp.ZeroPPConfig) and config.stage == 3
    out = capsys.readouterr().out
    assert "<- chosen" in out and "2 nodes x 4 devices" in out
    # Link speeds given replace the hardware's.
    assert "0.1 Gbit/s per node" in out
    with pytest.raises(TypeError, match="jax.eval_shape"):
        zpp.auto_config(object(), nodes=2, local=4)


def test_presets_detect_the_devices():
    hw = presets.for_devices()  # the suite's 8 CPU devices in one process
    assert (hw.nodes, hw.local) == (1, 8) and "emulated" in hw.name
    assert presets.h100(8).inter.bytes_per_s == 8 * 400e9 / 8


@pytest.mark.parametrize("kwargs, error, match", [
    # 0 is not "not given": it used to plan silently for the hardware's cluster.
    ({"nodes": 0}, ValueError, r"nodes=0 .*>= 1.*None"),
    ({"local": 0}, ValueError, r"local=0 .*>= 1.*None"),
    ({"nodes": -2}, ValueError, "nodes=-2"),
    ({"local": 2.0}, TypeError, r"local=2\.0 .*an int"),
    ({"nodes": True}, TypeError, "nodes=True"),
    ({"memory_budget_bytes": "70GB"}, TypeError,
     r"memory_budget_bytes='70GB' .*70 \* 2\*\*30"),
    ({"memory_budget_bytes": 0}, ValueError, "memory_budget_bytes=0 "),
    ({"memory_budget_bytes": -1.0}, ValueError, "memory_budget_bytes=-1.0 "),
    ({"memory_budget_bytes": True}, TypeError, "memory_budget_bytes=True"),
    ({"memory_budget_bytes": float("nan")}, ValueError, "memory_budget_bytes=nan"),
    ({"intra_gbps": 0}, ValueError, "intra_gbps=0 "),
    ({"inter_gbps": "100"}, TypeError, "inter_gbps='100'"),
    ({"inter_gbps": float("inf")}, ValueError, "inter_gbps=inf"),
    ({"tokens_per_device": -1}, ValueError, "tokens_per_device=-1 "),
    ({"tokens_per_device": "4k"}, TypeError, "tokens_per_device='4k'"),
    ({"tie": -0.01}, ValueError, "tie=-0.01 "),
    ({"hardware": "h100"}, TypeError, "hardware='h100'"),
    ({"base": {"stage": 3}}, TypeError, "base="),
    ({"configs": []}, ValueError, "configs"),
    ({"allow_int4_weights": "yes"}, TypeError, "allow_int4_weights='yes'"),
    ({"allow_int4_weights": 1}, TypeError, "allow_int4_weights=1 "),
])
def test_bad_arguments_are_refused_by_name_before_any_costing(monkeypatch, kwargs, error,
                                                             match):
    def costed(*args, **kw):
        raise AssertionError("a candidate was costed before the arguments were checked")

    monkeypatch.setattr("zeropp_jax.plan.auto.config_workload", costed)
    with pytest.raises(error, match=match):
        plan(SHAPE, **{"hardware": SLOW, **kwargs})
    with pytest.raises(error, match=match):
        zpp.auto_config(SHAPE, verbose=False, **{"hardware": SLOW, **kwargs})


def test_none_means_not_given_and_numpy_ints_are_counts():
    """None takes the hardware's cluster and the defaults; a numpy integer (a sweep's
    value) is a count."""
    one = {"hardware": SLOW, "configs": [zpp.ZeroPPConfig()]}  # one candidate to cost
    hw = plan(SHAPE, nodes=None, local=None, **one).hardware
    assert (hw.nodes, hw.local) == (SLOW.nodes, SLOW.local)
    given = plan(SHAPE, tokens_per_device=None, tie=None, allow_int4_weights=None, **one)
    assert (given.why, given.tokens_per_device) == (plan(SHAPE, **one).why, 0.0)
    hw = plan(SHAPE, nodes=np.int64(2), local=np.int32(4), **one).hardware
    assert (hw.nodes, hw.local) == (2, 4) and type(hw.nodes) is int
    for bad, match in (({"nodes": 0}, "nodes=0"), ({"local": -1}, "local=-1")):
        with pytest.raises(ValueError, match=match):
            presets.for_devices(**bad)
