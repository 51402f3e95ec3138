"""DeepSpeed configs: the settings a ``ds_config`` dict gives ``ZeroPPConfig``
(``ZeroPPConfig.from_deepspeed``), and the errors that name its keys."""

from __future__ import annotations

import difflib
from typing import Any, Mapping

VALID_STAGES = (1, 2, 3)


def deepspeed_settings(ds_config: Mapping[str, Any], overrides: Mapping[str, Any]
                       ) -> dict[str, Any]:
    """``ZeroPPConfig``'s flat keywords from a DeepSpeed config dict, ``overrides`` (flat
    keywords) applied on top. See ``ZeroPPConfig.from_deepspeed`` for the keys read."""
    if not isinstance(ds_config, Mapping):
        raise TypeError(f"ds_config must be a dict, got {type(ds_config).__name__}")
    zo = ds_config.get("zero_optimization", {})
    if not isinstance(zo, Mapping):
        raise TypeError("ds_config['zero_optimization'] must be a dict")
    understood = ("stage", "zero_quantized_weights", "zero_quantized_gradients",
                  "zero_hpz_partition_size", "stage3_max_reuse_distance",
                  "offload_optimizer", "cpu_offload", "cpu_offload_use_pin_memory",
                  "offload_param", "cpu_offload_params")
    for key, value in zo.items():
        if key in understood or key in _DS_TUNING:
            continue
        if key in _DS_UNIMPLEMENTED:
            if _ds_active(value):
                raise NotImplementedError(
                    f"zero_optimization.{key}={value!r}: {_DS_UNIMPLEMENTED[key]} is not "
                    "implemented by zeropp_jax; remove it (or disable it) to run without")
            continue
        close = difflib.get_close_matches(
            key, [*understood, *_DS_TUNING, *_DS_UNIMPLEMENTED], n=1, cutoff=0.6)
        raise ValueError(f"zero_optimization key {key!r} is not a DeepSpeed key"
                         + (f"; did you mean {close[0]!r}?" if close else ""))
    _check_top_level(ds_config)
    kwargs: dict[str, Any] = {}
    # Where each setting came from, to name the DeepSpeed key in errors.
    source: dict[str, str] = {}
    if "stage" not in overrides:
        kwargs["stage"] = _ds_stage(ds_config, zo)
        source["stage"] = f"zero_optimization.stage={kwargs['stage']}"
    kwargs["qwz"] = _ds_flag(zo.get("zero_quantized_weights", False),
                             "zero_optimization.zero_quantized_weights")
    if kwargs["qwz"]:
        source["qwz"] = "zero_optimization.zero_quantized_weights"
    kwargs["qgz"] = _ds_flag(zo.get("zero_quantized_gradients", False),
                             "zero_optimization.zero_quantized_gradients")
    if kwargs["qgz"]:
        source["qgz"] = "zero_optimization.zero_quantized_gradients"
    hpz = _ds_hpz_partition_size(zo.get("zero_hpz_partition_size", 1))
    kwargs["hpz"] = hpz > 1
    kwargs["hpz_group_size"] = hpz if hpz > 1 else None
    if hpz > 1:
        source["hpz"] = f"zero_optimization.zero_hpz_partition_size={hpz}"
    ratio = _ds_offload_optimizer(zo)
    if ratio:
        kwargs["offload_optimizer"] = True
        if ratio < 1:
            kwargs["offload_ratio"] = float(ratio)
            source["offload_ratio"] = "zero_optimization.offload_optimizer.ratio"
    if _ds_offload(zo, "offload_param", "cpu_offload_params", "parameter", partial=False):
        kwargs["offload_params"] = True
        source["offload_params"] = "zero_optimization.offload_param"
    if "stage3_max_reuse_distance" in zo:
        # DeepSpeed keeps a parameter gathered when it is used again within this many
        # parameters (default 1e9); the last unit is used again next, so only 0 (release
        # every parameter after use) makes it regather.
        reuse = zo["stage3_max_reuse_distance"]
        if isinstance(reuse, bool) or not isinstance(reuse, (int, float)) or reuse < 0:
            raise ValueError(f"zero_optimization.stage3_max_reuse_distance={reuse!r} must "
                             "be a number >= 0")
        kwargs["keep_last_unit"] = reuse > 0

    def enabled(name: str) -> bool:
        section = ds_config.get(name, {})
        if isinstance(section, Mapping):
            return _ds_flag(section.get("enabled", False), f"{name}.enabled")
        return _ds_flag(section, name)  # "bf16": true, a common shorthand

    bf16, fp16, amp = enabled("bf16"), enabled("fp16"), enabled("amp")
    if sum((bf16, fp16, amp)) > 1:
        on = " and ".join(n for n, v in (("bf16", bf16), ("fp16", fp16), ("amp", amp)) if v)
        raise ValueError(f"ds_config enables {on}; enable one of them (bf16 here)")
    if "compute_dtype" not in overrides:
        if fp16:
            raise ValueError(
                "ds_config enables fp16: DeepSpeed then computes in float16 with loss "
                "scaling (fp16.loss_scale, 0 = dynamic), which zeropp_jax does not "
                "implement. The equivalent here is bf16 mixed precision (no loss scaling "
                "needed): enable bf16 instead ({\"bf16\": {\"enabled\": true}}, "
                "compute_dtype='bfloat16')"
            )
        if amp:
            _ds_amp(ds_config["amp"])  # raises unless opt_level O0 (plain fp32)
    kwargs["compute_dtype"] = "bfloat16" if bf16 else "float32"
    clip = ds_config.get("gradient_clipping", 0.0)
    if isinstance(clip, str):
        raise ValueError(
            f"gradient_clipping={clip!r}: give a number (transformers' DeepSpeed "
            "integration fills 'auto' from TrainingArguments.max_grad_norm; resolve it "
            "before passing the dict here)"
        )
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0:
        raise ValueError(f"gradient_clipping={clip!r} must be a number: the maximum global "
                         "norm, or 0 (DeepSpeed's default) for no clipping")
    if clip:  # DeepSpeed's 0.0 means off
        kwargs["gradient_clipping"] = float(clip)
    kwargs.update(overrides)
    stage = kwargs.get("stage", 3)
    if stage != 3 and stage in VALID_STAGES:
        # qwZ, hpZ and qgZ are ZeRO-3 techniques: name the DeepSpeed keys that asked.
        asked = [source[k] for k in ("qwz", "hpz", "qgz")
                 if kwargs.get(k) and k in source and k not in overrides]
        if asked:
            where, fix = ((f"the override stage={stage}", "pass stage=3")
                          if "stage" in overrides
                          else (source["stage"], "set zero_optimization.stage to 3"))
            raise ValueError(
                f"ZeRO++ (qwZ, hpZ, qgZ) works on ZeRO-3 only: {' and '.join(asked)} "
                f"with {where}; {fix}, or remove {'it' if len(asked) == 1 else 'them'}"
            )
        if kwargs.get("offload_params") and "offload_params" not in overrides:
            raise ValueError(
                f"zero_optimization.offload_param offloads parameters, which needs ZeRO-3 "
                f"(in DeepSpeed too), and the config has stage {stage}: set "
                "zero_optimization.stage to 3, or offload only the optimizer state "
                "(offload_optimizer)")
    return kwargs



# zero_optimization keys that tune DeepSpeed's own bucketing, prefetching and bookkeeping:
# here XLA schedules the collectives, so they have nothing to set. Accepted and ignored.
_DS_TUNING = frozenset({
    "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "allgather_partitions",
    "allgather_bucket_size", "overlap_comm", "load_from_fp32_weights", "elastic_checkpoint",
    "sub_group_size", "stage3_max_live_parameters",
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "round_robin_gradients", "ignore_unused_parameters",
    "legacy_stage1", "use_multi_rank_bucket_allreduce", "memory_efficient_linear",
    "log_trace_cache_warnings", "stage3_module_granularity_threshold",
    "module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "mics_hierarchical_params_gather", "pipeline_loading_checkpoint",
    "override_module_apply", "allgather_sequential"})

# DeepSpeed features zeropp_jax does not implement: an error naming them when enabled.
# Top-level keys from_deepspeed reads.
_DS_READ = ("zero_optimization", "bf16", "fp16", "amp", "gradient_clipping")
# Top-level DeepSpeed keys it does not read: what they set comes from elsewhere here (the
# optax transformation, the train loop, ZeroPPConfig), so they are named in a warning.
_DS_TOP_UNREAD = {
    "optimizer": "pass an optax transformation to TrainState.create(tx=...)",
    "scheduler": "use an optax schedule in tx",
    "train_batch_size": "the train loop's global batch",
    "train_micro_batch_size_per_gpu": "the train loop's batch",
    "gradient_accumulation_steps": "zeropp_jax.accumulate_gradients(micro_batches=...)",
    "activation_checkpointing": "ZeroPPConfig(remat=...)",
    "communication_data_type": "ZeroPPConfig(compute_dtype=...) sets the wire dtype",
    "prescale_gradients": "gradients are averaged by the reduce-scatter",
    "gradient_predivide_factor": "gradients are averaged by the reduce-scatter",
}
# Top-level DeepSpeed features that change what trains (the data, the batch, the model) and
# are not implemented here: an error naming them when enabled.
_DS_TOP_UNIMPLEMENTED = {
    "curriculum_learning": "curriculum learning (DeepSpeed shortens sequences early on)",
    "data_efficiency": "data efficiency (curriculum data sampling, random layerwise token "
                       "dropping)",
    "elasticity": "elastic training (DeepSpeed picks the batch size from the device count)",
    "compression_training": "compression training (quantization-aware training, pruning, "
                            "layer reduction)",
}
_DS_TOP_HARMLESS = frozenset({
    "steps_per_print", "wall_clock_breakdown", "dump_state", "memory_breakdown",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "flops_profiler",
    "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger", "timers", "aio",
    "sparse_gradients", "seq_parallel_communication_data_type", "disable_allgather",
    "autotuning", "checkpoint", "data_types", "sparse_attention", "pipeline",
    "zero_optimization_stage", "graph_harvesting", "use_data_before_expert_parallelism",
})


def _check_top_level(ds_config: Mapping[str, Any]) -> None:
    """Unknown top-level keys raise with the closest known one; DeepSpeed keys whose
    setting comes from elsewhere here are named in one warning; the rest are logging
    and tooling switches without an effect on training, ignored."""
    import warnings

    unread = []
    for key, value in ds_config.items():
        if key in _DS_READ or key in _DS_TOP_HARMLESS:
            continue
        if key in _DS_TOP_UNIMPLEMENTED:
            if _ds_any_enabled(value):
                raise NotImplementedError(
                    f"ds_config enables {key}: {_DS_TOP_UNIMPLEMENTED[key]} is not "
                    "implemented by zeropp_jax; remove the block (or disable it) to run "
                    "without")
            continue
        if key in _DS_TOP_UNREAD:
            unread.append(f"{key} ({_DS_TOP_UNREAD[key]})")
            continue
        close = difflib.get_close_matches(
            key, [*_DS_READ, *_DS_TOP_UNREAD, *_DS_TOP_UNIMPLEMENTED, *_DS_TOP_HARMLESS], n=1,
            cutoff=0.6)
        raise ValueError(f"ds_config key {key!r} is not a DeepSpeed key zeropp_jax knows"
                         + (f"; did you mean {close[0]!r}?" if close else ""))
    if unread:
        warnings.warn("from_deepspeed does not read these ds_config keys, set them here "
                      "instead: " + "; ".join(unread), stacklevel=3)


_DS_UNIMPLEMENTED = {
    "zero_quantized_nontrainable_weights": "quantized frozen weights from a DeepSpeed "
                                           "config (use TrainState.create(frozen=...) with "
                                           "ZeroPPConfig(quantize_frozen=True))",
    "mics_shard_size": "MiCS sharding",
    "zeropp_loco_param": "LoCo error-feedback gradient quantization",
}


# offload_optimizer keys: read (device, pin_memory, ratio), or tuning DeepSpeed's own
# CPU/NVMe pipelines, which have nothing to set here.
_DS_OFFLOAD_KEYS = ("device", "pin_memory", "ratio")
_DS_OFFLOAD_TUNING = ("buffer_count", "buffer_size", "max_in_cpu", "fast_init", "pipeline",
                      "pipeline_read", "pipeline_write", "nvme_path", "super_offload",
                      "cpuadam_cores_perc")


def _ds_offload_optimizer(zo: Mapping[str, Any]) -> float:
    """The fraction of the optimizer state ``zero_optimization`` offloads (0: none):
    ``offload_optimizer`` with ``device: "cpu"`` and its ``ratio`` (DeepSpeed's default
    1: all of it), or the older ``cpu_offload: true``. NVMe and unknown keys raise naming
    the fix. ``pin_memory`` is accepted either way (the state is always kept in pinned
    memory)."""
    if "cpu_offload_use_pin_memory" in zo:
        _ds_flag(zo["cpu_offload_use_pin_memory"], "zero_optimization.cpu_offload_use_pin_memory")
    return _ds_offload(zo, "offload_optimizer", "cpu_offload", "optimizer-state")


def _ds_offload(zo: Mapping[str, Any], name: str, legacy_name: str, what: str,
                partial: bool = True) -> float:
    """The fraction the ``zero_optimization.<name>`` section (or the older
    ``<legacy_name>: true``, all of it) offloads to the CPU, 0 for none; NVMe, unknown keys
    and (without ``partial``) a ``ratio`` below 1 raise."""
    legacy = float(_ds_flag(zo.get(legacy_name, False), f"zero_optimization.{legacy_name}"))
    section = zo.get(name)
    if section is None:
        return legacy
    key = f"zero_optimization.{name}"
    if not isinstance(section, Mapping):
        raise ValueError(f"{key} must be a dict such as {{\"device\": \"cpu\"}}, got "
                         f"{section!r}")
    for k in section:
        if k not in _DS_OFFLOAD_KEYS and k not in _DS_OFFLOAD_TUNING:
            close = difflib.get_close_matches(k, [*_DS_OFFLOAD_KEYS, *_DS_OFFLOAD_TUNING],
                                              n=1, cutoff=0.6)
            raise ValueError(f"{key}.{k} is not a DeepSpeed offload key"
                             + (f"; did you mean {close[0]!r}?" if close else ""))
    device = section.get("device", "none")
    if device in (None, "none"):
        return legacy
    if device == "nvme":
        raise NotImplementedError(
            f"{key}.device='nvme': NVMe offload is not implemented by zeropp_jax; use "
            f"device 'cpu' (the {what} in pinned host memory)")
    if device != "cpu":
        raise ValueError(f"{key}.device={device!r} is invalid; DeepSpeed's devices are "
                         "'cpu', 'nvme' and 'none'")
    if "pin_memory" in section:
        _ds_flag(section["pin_memory"], f"{key}.pin_memory")
    ratio = section.get("ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"{key}.ratio={ratio!r} must be a number in (0, 1]")
    if ratio < 1 and not partial:
        raise NotImplementedError(
            f"{key}.ratio={ratio}: a partial ratio applies to the optimizer state "
            "(offload_optimizer.ratio); the parameters are offloaded whole: use ratio 1.0 "
            "or no parameter offload")
    return float(ratio)


def _ds_active(value: Any) -> bool:
    """Whether a DeepSpeed feature setting turns the feature on."""
    if value is None or value is False or value in (0, -1, "none"):
        return False
    if isinstance(value, Mapping):
        return value.get("device", "none") not in (None, "none")
    return True


def _ds_any_enabled(section: Any) -> bool:
    """Whether a top-level DeepSpeed feature block turns anything on: ``"enabled": true``
    at any depth (compression_training nests one per technique), or the block given as
    ``true``."""
    if isinstance(section, Mapping):
        return any(_ds_any_enabled(v) if k != "enabled" else _ds_flag(v, "enabled")
                   for k, v in section.items() if k == "enabled" or isinstance(v, Mapping))
    return section is True


def _ds_flag(value: Any, key: str) -> bool:
    """A DeepSpeed boolean: True/False, 0/1 or "true"/"false"; anything else raises."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    hint = (" ('auto' is filled in by transformers' DeepSpeed integration; resolve it "
            "before passing the dict here)") if value == "auto" else ""
    raise ValueError(f"{key}={value!r} is not a boolean{hint}")


def _ds_int(value: Any, key: str, valid: str = "") -> int:
    """A DeepSpeed integer setting (an int or its string); ``valid`` says what the values
    may be, appended to the error."""
    message = f"{key}={value!r} is not an integer" + (f"; {valid}" if valid else "")
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(message)
    try:
        return int(value)
    except ValueError:
        raise ValueError(message) from None


def _ds_stage(ds_config: Mapping[str, Any], zo: Mapping[str, Any]) -> int:
    """``zero_optimization.stage`` as a stage here; DeepSpeed's stage 0 (ZeRO off, also
    what a config without the key or the section means) raises, naming how to choose."""
    choose = ("set zero_optimization.stage to 1, 2 or 3 (stage 1 trains the same as "
              "stage 0 with the optimizer state sharded; 3 shards everything), or pass "
              "stage=... to from_deepspeed")
    if "stage" not in zo:
        where = ("has no zero_optimization section" if "zero_optimization" not in ds_config
                 else "has no zero_optimization.stage")
        raise ValueError(
            f"ds_config {where}, which DeepSpeed reads as ZeRO off (stage 0: plain data "
            f"parallelism, every device holding everything); zeropp_jax has no stage 0: "
            f"{choose}"
        )
    stage = _ds_int(zo["stage"], "zero_optimization.stage")
    if stage == 0:
        raise ValueError(
            "zero_optimization.stage=0 is DeepSpeed's ZeRO off (plain data parallelism, "
            f"every device holding everything); zeropp_jax has no stage 0: {choose}"
        )
    if stage not in VALID_STAGES:
        raise ValueError(f"zero_optimization.stage={zo['stage']!r} is invalid; valid stages "
                         f"are {VALID_STAGES}")
    return stage


def _ds_hpz_partition_size(value: Any) -> int:
    """``zero_optimization.zero_hpz_partition_size``: 1 (off) or an hpZ group size."""
    valid = ("valid values are 1 (hpZ off, DeepSpeed's default) or the devices of whole "
             "nodes: the devices per node times a divisor of the node count "
             "(TrainState.create checks it against the mesh)")
    key = "zero_optimization.zero_hpz_partition_size"
    size = _ds_int(value, key, valid)
    if size < 1:
        raise ValueError(f"{key}={value!r} is invalid; {valid}")
    return size


# apex AMP optimization levels: O0 is fp32 training; O1 (apex's default) casts to float16
# per op, O2 keeps float16 weights with fp32 masters, O3 is pure float16. O1-O3 need loss
# scaling.
_AMP_OPT_LEVELS = ("O0", "O1", "O2", "O3")


def _ds_amp(section: Any) -> None:
    """An enabled ``amp`` block (NVIDIA apex mixed precision): fp32 at opt_level O0, else
    float16 with loss scaling, which raises naming the equivalent here (bf16)."""
    level = section.get("opt_level", "O1") if isinstance(section, Mapping) else "O1"
    if level not in _AMP_OPT_LEVELS:
        raise ValueError(f"amp.opt_level={level!r} is invalid; apex's levels are "
                         f"{_AMP_OPT_LEVELS}")
    if level == "O0":
        return  # fp32 training: compute_dtype float32, as without amp
    raise ValueError(
        f"ds_config enables amp (NVIDIA apex mixed precision, opt_level={level!r}): it "
        "computes in float16 with dynamic loss scaling, which zeropp_jax does not implement. "
        "The equivalent here is bf16 mixed precision (fp32 master weights, bf16 compute, no "
        "loss scaling needed): replace the amp block with {\"bf16\": {\"enabled\": true}} "
        "(compute_dtype='bfloat16'), or disable amp ({\"amp\": {\"enabled\": false}}) "
        "for fp32"
    )
