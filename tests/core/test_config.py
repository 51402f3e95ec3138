"""ZeroPPConfig: presets, DeepSpeed configs, validation."""

import dataclasses

import pytest

from zeropp_jax import ZeroPPConfig


def test_defaults_and_presets():
    c = ZeroPPConfig()
    assert (c.stage, c.qwz, c.hpz, c.qgz) == (3, False, False, False)
    assert (c.weight_bits, c.grad_bits, c.qgz_pipeline_stages) == (8, 4, 1)
    assert (c.compute_dtype, c.param_dtype) == ("bfloat16", "float32")
    assert ZeroPPConfig.zero3() == c
    assert hash(ZeroPPConfig.zero3(compute_dtype="float32")) == hash(
        ZeroPPConfig(compute_dtype="float32")
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.stage = 2  # type: ignore[misc]


def test_dtype_names_are_normalised():
    import jax.numpy as jnp

    assert ZeroPPConfig(compute_dtype=jnp.float32).compute_dtype == "float32"
    assert ZeroPPConfig(compute_dtype="bf16" if False else jnp.bfloat16) == ZeroPPConfig()


def test_presets_turn_on_every_technique():
    c = ZeroPPConfig.zeropp()
    assert (c.qwz, c.hpz, c.qgz) == (True, True, True)
    for mode in ("qwz", "hpz", "qgz"):
        assert getattr(ZeroPPConfig.from_mode(mode), mode)


def test_qgz_until():
    assert ZeroPPConfig(qgz=True, qgz_until=10).qgz_until_step == 10
    c = ZeroPPConfig(qgz=True, qgz_until=0.5, planned_steps=101)
    assert c.qgz_until_step == 50
    with pytest.raises(ValueError, match="planned_steps"):
        ZeroPPConfig(qgz=True, qgz_until=0.5)
    with pytest.raises(ValueError, match=r"\(0, 1\]"):
        ZeroPPConfig(qgz=True, qgz_until=1.5, planned_steps=10)
    with pytest.raises(ValueError, match="only applies"):
        ZeroPPConfig(qgz_until=3)
    with pytest.raises(ValueError, match=">= 0"):
        ZeroPPConfig(qgz=True, qgz_until=-1)


def test_zeropp_switches_need_stage_3():
    with pytest.raises(ValueError, match="stage=3"):
        ZeroPPConfig(stage=2, qwz=True)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"stage": 0}, r"valid stages are \(1, 2, 3\)"),
        ({"stage": 4}, "valid stages"),
        ({"weight_bits": 2}, r"valid values are \(4, 8\)"),
        ({"grad_bits": 16}, "valid values"),
        ({"block_size": 0}, "positive"),
        ({"block_size": -5}, "positive"),
        ({"hpz_group_size": 0}, "positive"),
        ({"qgz_pipeline_stages": 0}, ">= 1"),
        ({"compute_dtype": "int8"}, "valid dtypes"),
        ({"param_dtype": "int32"}, "valid dtypes"),
        ({"compute_dtype": "nonsense"}, "not a dtype"),
        ({"qwz": 1}, "True or False"),
        ({"weight_bits": 4, "block_size": 33}, "must be even"),
        ({"quantization_impl": "cuda"}, "valid values"),
        ({"keep_last_unit": 0}, "True or False"),
    ],
)
def test_invalid_values_name_the_valid_ones(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs)


def test_from_mode():
    assert ZeroPPConfig.from_mode("zero3") == ZeroPPConfig.zero3()
    with pytest.raises(ValueError, match="valid modes"):
        ZeroPPConfig.from_mode("zero4")


def test_int4_gradients_need_an_even_block():
    with pytest.raises(ValueError, match="grad_bits=4.*must be even"):
        ZeroPPConfig(qgz=True, block_size=255)
    ZeroPPConfig(qgz=True, block_size=255, grad_bits=8)  # INT8: any block size
    ZeroPPConfig(qgz=False, block_size=255)  # grad_bits unused without qgZ


def test_from_deepspeed_reads_strictly():
    """Typos, strings and 'auto' used to be read silently (a typo turned qwZ off, "false"
    turned it on); now they either mean what DeepSpeed means or raise."""
    zo = lambda **kw: {"zero_optimization": {"stage": 3, **kw}}  # noqa: E731
    assert ZeroPPConfig.from_deepspeed(zo(zero_quantized_weights="true")).qwz
    assert not ZeroPPConfig.from_deepspeed(zo(zero_quantized_weights="false")).qwz
    assert not ZeroPPConfig.from_deepspeed(zo(zero_quantized_gradients=0)).qgz
    with pytest.raises(ValueError, match="did you mean 'zero_quantized_weights'"):
        ZeroPPConfig.from_deepspeed(zo(zero_quantized_weight=True))
    with pytest.raises(ValueError, match="not a boolean.*auto"):
        ZeroPPConfig.from_deepspeed({"bf16": {"enabled": "auto"}, **zo()})
    with pytest.raises(ValueError, match="gradient_clipping='auto'"):
        ZeroPPConfig.from_deepspeed({"gradient_clipping": "auto", **zo()})
    with pytest.raises(ValueError, match="enables bf16 and fp16; enable one"):
        ZeroPPConfig.from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True},
                                     **zo()})
    assert ZeroPPConfig.from_deepspeed({"bf16": True, **zo()}).compute_dtype == "bfloat16"
    # DeepSpeed keys that only tune its own bucketing are still ignored.
    assert ZeroPPConfig.from_deepspeed(zo(overlap_comm=True, reduce_bucket_size=5e8)).stage == 3
    # Any other key raises, with the closest valid one; features not implemented are named.
    with pytest.raises(ValueError, match="did you mean 'overlap_comm'"):
        ZeroPPConfig.from_deepspeed(zo(overlap_com=True))
    with pytest.raises(ValueError, match="not a DeepSpeed key"):
        ZeroPPConfig.from_deepspeed(zo(something_else=1))
    with pytest.raises(NotImplementedError, match="mics_shard_size.*MiCS"):
        ZeroPPConfig.from_deepspeed(zo(mics_shard_size=8))
    ZeroPPConfig.from_deepspeed(zo(mics_shard_size=-1))  # disabled: fine
    with pytest.raises(ValueError, match="did you mean 'gradient_clipping'"):
        ZeroPPConfig.from_deepspeed({"gradient_cliping": 1.0, **zo()})
    # Top level: keys whose setting comes from elsewhere are named; logging keys pass;
    # anything else raises.
    with pytest.warns(UserWarning, match=r"optimizer \(pass an optax.*train_batch_size"):
        ZeroPPConfig.from_deepspeed({"optimizer": {"type": "AdamW"}, "train_batch_size": 8,
                                     "steps_per_print": 10, **zo()})
    with pytest.raises(ValueError, match="did you mean 'train_batch_size'"):
        ZeroPPConfig.from_deepspeed({"train_batchsize": 8, **zo()})
    with pytest.raises(ValueError, match="'fancy_feature' is not a DeepSpeed key"):
        ZeroPPConfig.from_deepspeed({"fancy_feature": True, **zo()})


def test_from_deepspeed():
    stage3 = {"zero_optimization": {"stage": 3}}
    ds = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8},
    }
    assert ZeroPPConfig.from_deepspeed(ds) == ZeroPPConfig.zero3()
    c2 = ZeroPPConfig.from_deepspeed({"bf16": {"enabled": True},
                                      "zero_optimization": {"stage": 2}})
    assert (c2.stage, c2.compute_dtype) == (2, "bfloat16")
    # fp16 without loss scaling trains wrongly without a word: refused, naming bf16.
    with pytest.raises(ValueError, match="fp16.*loss scaling.*bf16.*bfloat16"):
        ZeroPPConfig.from_deepspeed({"fp16": {"enabled": True},
                                     "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="loss scaling"):
        ZeroPPConfig(compute_dtype="float16")
    assert ZeroPPConfig.from_deepspeed(stage3).compute_dtype == "float32"
    # DeepSpeed's ZeRO++ keys reach the switches.
    c = ZeroPPConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    )
    assert c.qwz and not c.hpz and not c.qgz
    c = ZeroPPConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 8}})
    assert c.hpz and c.hpz_group_size == 8
    c = ZeroPPConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
    )
    assert c.qgz and not c.qwz
    # DeepSpeed's default hpz partition size 1 means off.
    c = ZeroPPConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 1}})
    assert not c.hpz and c.hpz_group_size is None
    # Reuse distance 0 releases every parameter after use: the last unit regathers too.
    reuse = lambda d: ZeroPPConfig.from_deepspeed(  # noqa: E731
        {"zero_optimization": {"stage": 3, "stage3_max_reuse_distance": d}}).keep_last_unit
    assert (reuse(0), reuse(1e9), reuse(1),
            ZeroPPConfig.from_deepspeed(stage3).keep_last_unit) == (False, True, True, True)
    with pytest.raises(ValueError, match="stage3_max_reuse_distance"):
        reuse(-1)
    with pytest.raises(ValueError, match="valid stages"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 5}})
    with pytest.raises(TypeError):
        ZeroPPConfig.from_deepspeed("ds_config.json")  # type: ignore[arg-type]


def test_from_deepspeed_reads_no_stage_as_deepspeed_does():
    """DeepSpeed reads a config without zero_optimization (or without its stage) as ZeRO off,
    stage 0; it used to be read as stage 3 here. Stage 0 has no counterpart: it raises,
    naming how to choose a stage; stage= as an override chooses one."""
    for ds, what in (({}, "no zero_optimization section"),
                     ({"bf16": {"enabled": True}}, "no zero_optimization section"),
                     ({"zero_optimization": {"overlap_comm": True}},
                      "no zero_optimization.stage"),
                     ({"zero_optimization": {"stage": 0}}, r"zero_optimization.stage=0")):
        with pytest.raises(ValueError, match=rf"{what}.*ZeRO off.*stage 0.*"
                                             r"zero_optimization.stage to 1, 2 or 3.*stage="):
            ZeroPPConfig.from_deepspeed(ds)
    assert ZeroPPConfig.from_deepspeed({}, stage=1).stage == 1
    assert ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 0}}, stage=2).stage == 2
    assert ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": "2"}}).stage == 2
    with pytest.raises(ValueError, match=r"zero_optimization.stage=4 is invalid; valid stages"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 4}})
    with pytest.raises(ValueError, match=r"zero_optimization.stage=None is not an integer"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": None}})


def test_from_deepspeed_errors_name_the_deepspeed_keys():
    """An invalid zero_hpz_partition_size, or ZeRO++ keys with stage 1 or 2, used to be
    reported under zeropp_jax's own field names (hpz_group_size, qwz, stage=3); the errors
    name the keys the user wrote and the valid values."""
    zo = lambda **kw: {"zero_optimization": {"stage": 3, **kw}}  # noqa: E731
    for bad in (0, -8, True, 2.5, "eight", None):
        with pytest.raises(ValueError, match=r"zero_optimization.zero_hpz_partition_size="
                                             r".*valid values are 1 \(hpZ off.*whole nodes"):
            ZeroPPConfig.from_deepspeed(zo(zero_hpz_partition_size=bad))
    assert ZeroPPConfig.from_deepspeed(zo(zero_hpz_partition_size="4")).hpz_group_size == 4
    with pytest.raises(ValueError, match=r"ZeRO-3 only: zero_optimization.zero_hpz_partition_"
                                         r"size=4 with zero_optimization.stage=2; set "
                                         r"zero_optimization.stage to 3, or remove it"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 2,
                                                           "zero_hpz_partition_size": 4}})
    with pytest.raises(ValueError, match=r"zero_quantized_weights and zero_optimization."
                                         r"zero_quantized_gradients with zero_optimization."
                                         r"stage=1.*remove them"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {
            "stage": 1, "zero_quantized_weights": True, "zero_quantized_gradients": True}})
    with pytest.raises(ValueError, match=r"zero_quantized_weights with the override stage=2; "
                                         r"pass stage=3"):
        ZeroPPConfig.from_deepspeed(zo(zero_quantized_weights=True), stage=2)
    # An override that turns the technique off settles it.
    assert not ZeroPPConfig.from_deepspeed(zo(zero_quantized_weights=True), stage=2,
                                           qwz=False).qwz
    with pytest.raises(ValueError, match=r"gradient_clipping=True must be a number"):
        ZeroPPConfig.from_deepspeed({"gradient_clipping": True, **zo()})
    with pytest.raises(ValueError, match=r"gradient_clipping=-1.0 must be a number"):
        ZeroPPConfig.from_deepspeed({"gradient_clipping": -1.0, **zo()})


def test_from_deepspeed_amp_is_read_not_ignored():
    """DeepSpeed's amp block (NVIDIA apex mixed precision) used to be ignored, so an apex
    float16 run silently trained in fp32 here. Enabled at O1-O3 (float16 with loss
    scaling) it raises naming bf16; O0 is fp32; disabled is fine."""
    zo = {"zero_optimization": {"stage": 3}}
    for amp, level in (({"enabled": True}, "O1"),  # apex's default level
                       ({"enabled": True, "opt_level": "O2"}, "O2"),
                       ({"enabled": "true", "opt_level": "O3", "loss_scale": 0}, "O3")):
        with pytest.raises(ValueError, match=rf"amp \(NVIDIA apex.*opt_level='{level}'.*loss "
                                             r"scaling.*\"bf16\": \{\"enabled\": true\}"):
            ZeroPPConfig.from_deepspeed({"amp": amp, **zo})
    assert ZeroPPConfig.from_deepspeed(
        {"amp": {"enabled": True, "opt_level": "O0"}, **zo}).compute_dtype == "float32"
    assert ZeroPPConfig.from_deepspeed(
        {"amp": {"enabled": False, "opt_level": "O1"}, **zo}).compute_dtype == "float32"
    # The settings it names work, and an explicit compute dtype overrides the block.
    assert ZeroPPConfig.from_deepspeed({"amp": {"enabled": True}, **zo},
                                       compute_dtype="bfloat16").compute_dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"amp.opt_level='O4' is invalid.*'O0', 'O1'"):
        ZeroPPConfig.from_deepspeed({"amp": {"enabled": True, "opt_level": "O4"}, **zo})
    with pytest.raises(ValueError, match="enables bf16 and amp; enable one"):
        ZeroPPConfig.from_deepspeed({"amp": {"enabled": True}, "bf16": True, **zo})
    with pytest.raises(ValueError, match=r"amp.enabled='auto' is not a boolean"):
        ZeroPPConfig.from_deepspeed({"amp": {"enabled": "auto"}, **zo})


def test_from_deepspeed_refuses_features_that_change_what_trains():
    """Top-level blocks that change the data, the batch or the model (curriculum learning,
    data efficiency, elasticity, compression training) used to be ignored as harmless;
    enabled, they raise naming themselves; disabled, they pass."""
    zo = {"zero_optimization": {"stage": 3}}
    enabled = {
        "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"},
        "data_efficiency": {"enabled": True},
        "elasticity": {"enabled": True, "max_train_batch_size": 64},
        "compression_training": {"weight_quantization": {"shared_parameters":
                                                         {"enabled": True}}},
    }
    for key, block in enabled.items():
        with pytest.raises(NotImplementedError, match=rf"enables {key}:.*not implemented"):
            ZeroPPConfig.from_deepspeed({key: block, **zo})
    ZeroPPConfig.from_deepspeed({
        "curriculum_learning": {"enabled": False}, "elasticity": {"enabled": False},
        "compression_training": {"weight_quantization": {"shared_parameters":
                                                         {"enabled": False}}}, **zo})


def test_weight_format_and_weight_bits_are_one_setting():
    """weight_format is the new name; weight_bits (8 | 4) keeps working as its alias, both
    are resolved on creation (so equal settings compare and hash equal), and a pair that
    disagrees raises naming both."""
    assert (ZeroPPConfig().weight_format, ZeroPPConfig().weight_bits) == ("int8", 8)
    assert ZeroPPConfig(weight_bits=4) == ZeroPPConfig(weight_format="int4")
    assert hash(ZeroPPConfig(weight_bits=4)) == hash(ZeroPPConfig(weight_format="int4"))
    assert ZeroPPConfig(weight_format="int4").weight_bits == 4
    assert ZeroPPConfig(weight_bits=4).weight_format == "int4"
    fp8 = ZeroPPConfig(qwz=True, weight_format="fp8")
    assert fp8.weight_bits == 8 and fp8 != ZeroPPConfig(qwz=True)
    assert ZeroPPConfig(qwz=True, weight_format="fp8", weight_bits=8) == fp8
    for fmt, bits in (("int4", 8), ("fp8", 4), ("int8", 4)):
        with pytest.raises(ValueError, match=f"weight_format='{fmt}' and weight_bits={bits} "
                                             "disagree"):
            ZeroPPConfig(weight_format=fmt, weight_bits=bits)
    for bad in ("int2", "fp16", "int8.0", "int"):
        with pytest.raises(ValueError, match="named by its kind and its bits per value"):
            ZeroPPConfig(weight_format=bad)
    with pytest.raises(ValueError, match="must be even"):
        ZeroPPConfig(weight_format="int4", block_size=33)
    # dataclasses.replace copies both names: changing one alone is a disagreement, and the
    # error says how to change it.
    with pytest.raises(ValueError, match="pass weight_bits=None"):
        dataclasses.replace(ZeroPPConfig(), weight_format="int4")
    assert dataclasses.replace(ZeroPPConfig(), weight_format="int4", weight_bits=None) == \
        ZeroPPConfig(weight_bits=4)
    # DeepSpeed has no key for the weight format: an override sets it.
    ds = {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    from_ds = ZeroPPConfig.from_deepspeed(ds, weight_format="fp8")
    assert (from_ds.qwz, from_ds.weight_format, from_ds.weight_bits) == (True, "fp8", 8)


def test_smoothing_and_stochastic_rounding_switches():
    c = ZeroPPConfig.zeropp()
    assert (c.qgz_hadamard, c.qwz_hadamard, c.stochastic_rounding) == (False, False, False)
    on = ZeroPPConfig.zeropp(qgz_hadamard=True, qwz_hadamard=True, stochastic_rounding=True,
                             weight_format="int4")
    assert (on.qgz_hadamard, on.qwz_hadamard, on.stochastic_rounding) == (True, True, True)
    with pytest.raises(ValueError, match="qgz_hadamard: .*power of 2.*block_size=96; use e.g. 128"):
        ZeroPPConfig(qgz=True, qgz_hadamard=True, block_size=96)
    with pytest.raises(ValueError, match="qwz_hadamard: .*power of 2"):
        ZeroPPConfig(qwz=True, qwz_hadamard=True, block_size=96)
    with pytest.raises(ValueError, match="qwz_hadamard .*needs blockwise=True"):
        ZeroPPConfig(qwz=True, qwz_hadamard=True, blockwise=False)
    ZeroPPConfig(qgz_hadamard=True, block_size=96)  # without qgZ: unused, so unchecked
    for name in ("qgz_hadamard", "qwz_hadamard", "stochastic_rounding"):
        with pytest.raises(ValueError, match=f"{name} must be True or False"):
            ZeroPPConfig(**{name: 1})


@pytest.mark.parametrize("name, value, match", [
    # 8.0 used to pass and become weight_format='int8.0', refused at the first step.
    ("weight_bits", 8.0, r"weight_bits=8\.0 is a float: write weight_bits=8"),
    ("grad_bits", 8.0, r"grad_bits=8\.0 is a float: write grad_bits=8"),
    ("block_size", 256.0, r"block_size=256\.0 is a float: write block_size=256"),
    ("stage", 3.0, r"stage=3\.0 is a float: write stage=3"),
    ("prefetch", 2.5, r"prefetch=2\.5 is a float: give an int"),
    ("planned_steps", 1e4, r"planned_steps=10000\.0 is a float: write planned_steps=10000"),
    ("qgz_pipeline_stages", 2.0, "qgz_pipeline_stages=2.0 is a float"),
    ("hpz_group_size", 8.0, "hpz_group_size=8.0 is a float"),
    # True == 1: it used to pass as block_size 1, a one-stage pipeline, a group of 1.
    ("block_size", True, "block_size=True is a bool: give an int"),
    ("qgz_pipeline_stages", True, "qgz_pipeline_stages=True is a bool"),
    ("hpz_group_size", True, "hpz_group_size=True is a bool"),
    ("planned_steps", True, "planned_steps=True is a bool"),
    ("weight_bits", True, "weight_bits=True is a bool"),
    ("grad_bits", "8", "grad_bits='8' is a str: give an int"),
])
def test_integer_settings_refuse_floats_bools_and_strings_at_construction(name, value, match):
    kwargs = {"qwz": True, "qgz": True, name: value}
    if name == "planned_steps":
        kwargs.update(qgz_until=0.5)
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs)


def test_numpy_integers_become_ints():
    """A sweep's numpy integers are ints: equal and hashed like the config written with
    ints, the derived weight_format included."""
    import numpy as np

    swept = ZeroPPConfig(qwz=True, weight_bits=np.int64(4), grad_bits=np.int32(8),
                         block_size=np.int64(128), prefetch=np.int64(2))
    written = ZeroPPConfig(qwz=True, weight_bits=4, grad_bits=8, block_size=128, prefetch=2)
    assert swept == written and hash(swept) == hash(written)
    assert swept.weight_format == "int4"
    assert all(type(getattr(swept, f)) is int
               for f in ("weight_bits", "grad_bits", "block_size", "prefetch", "stage"))


def test_float64_needs_x64_and_sums_stay_float64():
    """float64 dtypes are refused outside JAX's 64-bit mode (JAX would make the arrays
    float32 with only a warning), naming the switch; inside it they are taken, and gradient
    sums keep float64 (fp32 at least: bf16 sums widen, float64 ones do not narrow)."""
    import jax
    import jax.numpy as jnp

    from zeropp_jax.core.dtypes import accumulation_dtype

    for name in ("compute_dtype", "param_dtype", "output_dtype"):
        with pytest.raises(ValueError, match=f"{name}='float64'.*jax_enable_x64"):
            ZeroPPConfig(**{name: "float64"})
    with jax.enable_x64(True):
        c = ZeroPPConfig(compute_dtype="float64", param_dtype="float64")
        assert (c.compute_dtype, c.param_dtype) == ("float64", "float64")
    assert [accumulation_dtype(d) for d in (jnp.bfloat16, jnp.float16, jnp.float32,
                                             jnp.float64)] == [jnp.float32] * 3 + [jnp.float64]
