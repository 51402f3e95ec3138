"""The cost model's arithmetic on cases small enough to check by hand."""

from __future__ import annotations

import dataclasses

import pytest

from zeropp_jax.plan.cost_model import (
    CollectiveCost,
    Hardware,
    Link,
    Workload,
    predict_all,
    predict_step,
)

HW = Hardware(nodes=2, local=4, intra=Link(1e9, 1e-4), inter=Link(1e8, 1e-3),
              flops_per_s=1e12, quant_elems_per_s=1e9, overlap=0.5)
WORK = Workload((CollectiveCost("gather", "all-gather", 1e6, 0.0, True),
                 CollectiveCost("inside", "all-gather", 0.0, 2e6, False, count=2)),
                flops_per_device=5e9, quant_elems_per_device=1e6, memory_bytes_per_device=7.0)


def test_a_step_by_hand():
    p = predict_step(WORK, HW)
    # compute: 5e9 / 1e12 + 1e6 / 1e9 = 6 ms; cross: 1e6 / 1e8 = 10 ms; intra: 2 x 2e6 / 1e9 =
    # 4 ms; fixed: 1 x 1 ms + 2 x 0.1 ms = 1.2 ms; exposed: 14 - 0.5 x min(14, 6) = 11 ms.
    assert p.compute_s == pytest.approx(6e-3, rel=1e-12)
    assert p.cross_s == pytest.approx(10e-3, rel=1e-12)
    assert p.intra_s == pytest.approx(4e-3, rel=1e-12)
    assert p.fixed_s == pytest.approx(1.2e-3, rel=1e-12)
    assert p.exposed_s == pytest.approx(11e-3, rel=1e-12)
    assert p.step_s == pytest.approx(18.2e-3, rel=1e-12)
    assert p.memory_bytes == 7.0
    assert p.as_dict()["step_s"] == p.step_s


def test_the_gradient_path_has_its_own_rate():
    # 1e6 quantized elements, 4e5 of them qgZ's: 6e5 / 1e9 + 4e5 / 1e8 = 0.6 ms + 4 ms, so
    # compute is 5 + 4.6 = 9.6 ms; without a rate of its own the path runs at 1e9/s (6 ms).
    work = dataclasses.replace(WORK, grad_quant_elems_per_device=4e5)
    assert predict_step(work, HW).compute_s == pytest.approx(6e-3, rel=1e-12)
    slow = dataclasses.replace(HW, grad_quant_elems_per_s=1e8)
    assert slow.grad_quant_rate == 1e8 and HW.grad_quant_rate == 1e9
    assert predict_step(work, slow).compute_s == pytest.approx(9.6e-3, rel=1e-12)
    with pytest.raises(ValueError, match="grad_quant_elems_per_s"):
        dataclasses.replace(HW, grad_quant_elems_per_s=0.0)


def test_overlap_hides_wire_time_up_to_the_compute_and_never_the_fixed_cost():
    full = dataclasses.replace(HW, overlap=1.0)
    # Wire 14 ms > compute 6 ms: 8 ms stay exposed.
    assert predict_step(WORK, full).step_s == pytest.approx(6e-3 + 8e-3 + 1.2e-3, rel=1e-12)
    heavy = dataclasses.replace(WORK, flops_per_device=5e10)  # compute 51 ms > wire
    assert predict_step(heavy, full).step_s == pytest.approx(51e-3 + 1.2e-3, rel=1e-12)
    none = dataclasses.replace(HW, overlap=0.0)
    assert predict_step(WORK, none).step_s == pytest.approx(6e-3 + 14e-3 + 1.2e-3, rel=1e-12)


def test_one_node_has_no_cross_node_time_and_links_scale_it():
    assert predict_step(WORK, HW.with_mesh(1)).cross_s == 0.0
    faster = dataclasses.replace(HW, inter=Link(2e8, 1e-3))
    assert predict_step(WORK, faster).cross_s == pytest.approx(5e-3, rel=1e-12)
    assert Link.gbps(8.0).bytes_per_s == 1e9


def test_predict_all_is_fastest_first():
    slow = dataclasses.replace(WORK, flops_per_device=5e10, label="slow")
    assert [p.label for p in predict_all([slow, dataclasses.replace(WORK, label="fast")], HW)] \
        == ["fast", "slow"]


def test_bad_constants_name_the_rule():
    with pytest.raises(ValueError, match="overlap is a fraction"):
        dataclasses.replace(HW, overlap=1.5)
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        Link(0.0)
    with pytest.raises(ValueError, match="latency must be >= 0"):
        Link(1.0, -1.0)
    with pytest.raises(ValueError, match="nodes >= 1"):
        dataclasses.replace(HW, nodes=0)
