"""The offload policy: which units' optimizer state lives in host memory, and the run's
label, resolved once from the config and asked by the builder, the engine and the models."""

import zeropp_jax as zpp
from zeropp_jax.comm.offload import OffloadPolicy
from zeropp_jax.comm.transports import plan_of

SIZES = [("b", 30), ("a", 50), ("c", 20)]


def test_units_in_name_order_until_the_ratio_is_reached():
    assert OffloadPolicy().units(SIZES) == frozenset()  # optimizer state on the device
    assert OffloadPolicy(optimizer=True).units(SIZES) == {"a", "b", "c"}
    # Name order: a (50) reaches 0.5 alone; 0.6 needs b too (80); 0.9, c (100).
    assert OffloadPolicy(optimizer=True, ratio=0.5).units(SIZES) == {"a"}
    assert OffloadPolicy(optimizer=True, ratio=0.6).units(SIZES) == {"a", "b"}
    assert OffloadPolicy(optimizer=True, ratio=0.9).units(SIZES) == {"a", "b", "c"}
    assert OffloadPolicy(optimizer=True, ratio=0.0).units(SIZES) == frozenset()


def test_the_plan_holds_the_configs_policy_and_names_it():
    config = zpp.ZeroPPConfig(offload_optimizer=True, offload_ratio=0.5, offload_params=True)
    plan = plan_of(config)
    assert plan.offload == OffloadPolicy(True, 0.5, True)
    assert plan.offload.label() == "offload0.5+offload-params"
    assert plan.label() == "zero3+offload0.5+offload-params"
    assert plan_of(zpp.ZeroPPConfig()).offload.label() == ""
