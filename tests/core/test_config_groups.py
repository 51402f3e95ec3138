"""ZeroPPConfig's grouped settings: groups and flat keywords give the same config, a
setting given twice raises, every flat setting sits in exactly one group."""

import copy
import dataclasses
import pickle

import numpy as np
import pytest

import zeropp_jax as zpp
from zeropp_jax.core.settings import GROUPS

from helpers import fresh_seed

C = zpp.ZeroPPConfig


def test_every_flat_setting_is_in_one_group():
    flat = [f.name for f in dataclasses.fields(C)]
    owners = {}
    for key, cls in GROUPS.items():
        for name in cls.FLAT.values():
            assert name not in owners, (name, owners.get(name), key)
            owners[name] = key
    # stage is the config's own; weight_bits is weight_format's older name.
    assert set(flat) - set(owners) == {"stage", "weight_bits"}
    assert set(owners) <= set(flat)


def _random_config(rng):
    """A valid config with settings drawn at random (fresh each run)."""
    return C(
        qwz=bool(rng.integers(2)), hpz=bool(rng.integers(2)), qgz=True,
        weight_format=str(rng.choice(["int8", "int4", "fp8"])),
        grad_bits=int(rng.choice([4, 8])), block_size=int(2 ** rng.integers(4, 10)),
        qgz_pipeline_stages=int(rng.integers(1, 4)), qgz_hadamard=bool(rng.integers(2)),
        prefetch=int(rng.integers(0, 4)), bucket=bool(rng.integers(2)),
        gradient_clipping=float(rng.uniform(0.1, 5)), compute_dtype="float32",
        remat=str(rng.choice(["full", "minimal"])), qgz_error_feedback=bool(rng.integers(2)))


def test_groups_round_trip_to_the_same_config():
    rng = np.random.default_rng(fresh_seed())
    for _ in range(20):
        config = _random_config(rng)
        grouped = C(config.stage, weight_bits=config.weight_bits,
                    **{key: getattr(config, key) for key in GROUPS})
        assert grouped == config and hash(grouped) == hash(config)
        for key, cls in GROUPS.items():
            group = getattr(config, key)
            assert isinstance(group, cls)
            for field, name in cls.FLAT.items():
                assert getattr(group, field) == getattr(config, name)


def test_group_fields_left_at_none_keep_defaults_and_presets():
    config = C.zeropp(weights=zpp.Weights(format="fp8"),
                      gradients=zpp.Gradients(hadamard=True, bits=8))
    assert config == C.zeropp(weight_format="fp8", qgz_hadamard=True, grad_bits=8)
    assert config.qwz and config.hpz and config.qgz  # the preset's switches stay on
    assert C(schedule=zpp.Schedule(prefetch=3)) == C(prefetch=3)
    assert C.from_mode("qwz", precision=zpp.Precision(compute="float32")).compute_dtype \
        == "float32"


def test_a_setting_given_twice_raises_naming_both():
    with pytest.raises(ValueError, match=r"qwz=True and weights=Weights\(quantize=False\)"):
        C(qwz=True, weights=zpp.Weights(quantize=False))
    with pytest.raises(ValueError, match="gradient_clipping"):
        C(gradient_clipping=1.0, update=zpp.Update(clip_norm=2.0))


def test_bad_group_and_unknown_keywords_raise_naming_the_fix():
    with pytest.raises(TypeError, match=r"weights= takes a zeropp_jax.Weights"):
        C(weights={"quantize": True})
    with pytest.raises(TypeError, match="did you mean 'qgz_hadamard'"):
        C(qgz_hadamrd=True)
    with pytest.raises(TypeError, match="did you mean 'gradients'"):
        C(gradient=zpp.Gradients(quantize=True))
    # A group's values are validated like flat ones.
    with pytest.raises(ValueError, match="grad_bits=3"):
        C(gradients=zpp.Gradients(quantize=True, bits=3))


def test_replace_copy_pickle_and_deepspeed_keep_working():
    config = C.zeropp(gradients=zpp.Gradients(hadamard=True))
    assert dataclasses.replace(config, qwz=False).weights.quantize is False
    assert copy.deepcopy(config) == config
    assert pickle.loads(pickle.dumps(config)) == config
    ds = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    assert C.from_deepspeed(ds, gradients=zpp.Gradients(quantize=True)) == C.from_deepspeed(
        ds, qgz=True)
