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
        ({"param_dtype": "float64"}, "valid dtypes"),
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
        ZeroPPConfig.from_deepspeed({"bf16": {"enabled": "auto"}})
    with pytest.raises(ValueError, match="gradient_clipping='auto'"):
        ZeroPPConfig.from_deepspeed({"gradient_clipping": "auto"})
    with pytest.raises(ValueError, match="both bf16 and fp16"):
        ZeroPPConfig.from_deepspeed({"bf16": {"enabled": True}, "fp16": {"enabled": True}})
    assert ZeroPPConfig.from_deepspeed({"bf16": True}).compute_dtype == "bfloat16"
    # DeepSpeed keys that only tune its own bucketing are still ignored.
    assert ZeroPPConfig.from_deepspeed(zo(overlap_comm=True, reduce_bucket_size=5e8)).stage == 3
    # Any other key raises, with the closest valid one; features not implemented are named.
    with pytest.raises(ValueError, match="did you mean 'overlap_comm'"):
        ZeroPPConfig.from_deepspeed(zo(overlap_com=True))
    with pytest.raises(ValueError, match="not a DeepSpeed key"):
        ZeroPPConfig.from_deepspeed(zo(something_else=1))
    with pytest.raises(NotImplementedError, match="offload_optimizer.*offload"):
        ZeroPPConfig.from_deepspeed(zo(offload_optimizer={"device": "cpu"}))
    ZeroPPConfig.from_deepspeed(zo(offload_optimizer={"device": "none"}))  # disabled: fine
    with pytest.raises(ValueError, match="did you mean 'gradient_clipping'"):
        ZeroPPConfig.from_deepspeed({"gradient_cliping": 1.0})
    # Top level: keys whose setting comes from elsewhere are named; logging keys pass;
    # anything else raises.
    with pytest.warns(UserWarning, match=r"optimizer \(pass an optax.*train_batch_size"):
        ZeroPPConfig.from_deepspeed({"optimizer": {"type": "AdamW"}, "train_batch_size": 8,
                                     "steps_per_print": 10, **zo()})
    with pytest.raises(ValueError, match="did you mean 'train_batch_size'"):
        ZeroPPConfig.from_deepspeed({"train_batchsize": 8})
    with pytest.raises(ValueError, match="'fancy_feature' is not a DeepSpeed key"):
        ZeroPPConfig.from_deepspeed({"fancy_feature": True})


def test_from_deepspeed():
    ds = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 5e8},
    }
    assert ZeroPPConfig.from_deepspeed(ds) == ZeroPPConfig.zero3()
    c2 = ZeroPPConfig.from_deepspeed({"bf16": {"enabled": True},
                                      "zero_optimization": {"stage": 2}})
    assert (c2.stage, c2.compute_dtype) == (2, "bfloat16")
    # fp16 without loss scaling trains wrongly without a word: refused, naming bf16.
    with pytest.raises(ValueError, match="loss scaling.*bfloat16"):
        ZeroPPConfig.from_deepspeed({"fp16": {"enabled": True},
                                     "zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match="loss scaling"):
        ZeroPPConfig(compute_dtype="float16")
    assert ZeroPPConfig.from_deepspeed({}).compute_dtype == "float32"
    # DeepSpeed's ZeRO++ keys reach the switches.
    c = ZeroPPConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_weights": True}}
    )
    assert c.qwz and not c.hpz and not c.qgz
    c = ZeroPPConfig.from_deepspeed({"zero_optimization": {"zero_hpz_partition_size": 8}})
    assert c.hpz and c.hpz_group_size == 8
    c = ZeroPPConfig.from_deepspeed(
        {"zero_optimization": {"stage": 3, "zero_quantized_gradients": True}}
    )
    assert c.qgz and not c.qwz
    # DeepSpeed's default hpz partition size 1 means off.
    c = ZeroPPConfig.from_deepspeed({"zero_optimization": {"zero_hpz_partition_size": 1}})
    assert not c.hpz and c.hpz_group_size is None
    # Reuse distance 0 releases every parameter after use: the last unit regathers too.
    reuse = lambda d: ZeroPPConfig.from_deepspeed(  # noqa: E731
        {"zero_optimization": {"stage3_max_reuse_distance": d}}).keep_last_unit
    assert (reuse(0), reuse(1e9), reuse(1), ZeroPPConfig.from_deepspeed({}).keep_last_unit) \
        == (False, True, True, True)
    with pytest.raises(ValueError, match="stage3_max_reuse_distance"):
        reuse(-1)
    with pytest.raises(ValueError, match="valid stages"):
        ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 5}})
    with pytest.raises(TypeError):
        ZeroPPConfig.from_deepspeed("ds_config.json")  # type: ignore[arg-type]
