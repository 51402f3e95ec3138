"""The groups of ``ZeroPPConfig``'s settings: one frozen dataclass per concern.

``ZeroPPConfig(weights=Weights(quantize=True, format="int4"), gradients=Gradients(
quantize=True))`` is ``ZeroPPConfig(qwz=True, weight_format="int4", qgz=True)``; a config
hands its settings back grouped (``config.weights``, ``config.gradients``, ...). In a group
given to the config, a field left at None is not given: the config's default (or a
preset's value) stays. Each group's ``FLAT`` maps its fields to the config's flat keywords,
which stay the config's canonical form (what ``dataclasses.replace``, checkpoints and
DeepSpeed configs use).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Mapping


@dataclasses.dataclass(frozen=True)
class Weights:
    """How weights travel in the forward and backward gathers (qwZ).

    Attributes:
      quantize: qwZ: block-quantized weights on the wire (``qwz``).
      format: ``"int8"``, ``"int4"`` or ``"fp8"`` (``weight_format``).
      hadamard: rotate each block before quantizing (``qwz_hadamard``).
      all_gather: ``"flat"`` or ``"hierarchical"`` (``all_gather``).
      quantize_frozen: store frozen weights quantized (``quantize_frozen``).
    """

    quantize: bool | None = None
    format: str | None = None
    hadamard: bool | None = None
    all_gather: str | None = None
    quantize_frozen: bool | None = None

    FLAT: ClassVar[Mapping[str, str]] = {
        "quantize": "qwz", "format": "weight_format", "hadamard": "qwz_hadamard",
        "all_gather": "all_gather", "quantize_frozen": "quantize_frozen"}


@dataclasses.dataclass(frozen=True)
class Secondary:
    """hpZ's secondary weight partition, for the backward gather.

    Attributes:
      enabled: keep a secondary partition inside each group of nodes (``hpz``).
      group_size: devices per group, whole nodes (``hpz_group_size``); None: one node.
    """

    enabled: bool | None = None
    group_size: int | None = None

    FLAT: ClassVar[Mapping[str, str]] = {"enabled": "hpz", "group_size": "hpz_group_size"}


@dataclasses.dataclass(frozen=True)
class Gradients:
    """How gradients are reduce-scattered (qgZ and the unquantized reduce-scatter).

    Attributes:
      quantize: qgZ: quantized two-hop all-to-all (``qgz``).
      bits: 4 or 8 (``grad_bits``).
      pipeline_stages: chunks sent independently (``qgz_pipeline_stages``).
      until: qgZ only before this step or fraction of the run (``qgz_until``).
      planned_steps: the run's total steps (``planned_steps``).
      hadamard: rotate each block before quantizing (``qgz_hadamard``).
      stochastic_rounding: unbiased rounding (``stochastic_rounding``).
      error_feedback: keep each device's quantization errors (``qgz_error_feedback``).
      signs: ``"fixed"`` or ``"per_step"`` (``qgz_signs``).
      hops: ``"both"`` or ``"cross"``: which hops are quantized (``qgz_hops``).
      defer: a scanned layer's gradient reduced during the next layer's backward
        (``qgz_defer``).
      reduce_scatter: the unquantized one, ``"flat"`` or ``"hierarchical"``
        (``reduce_scatter``).
    """

    quantize: bool | None = None
    bits: int | None = None
    pipeline_stages: int | None = None
    until: int | float | None = None
    planned_steps: int | None = None
    hadamard: bool | None = None
    stochastic_rounding: bool | None = None
    error_feedback: bool | None = None
    signs: str | None = None
    hops: str | None = None
    defer: bool | None = None
    reduce_scatter: str | None = None

    FLAT: ClassVar[Mapping[str, str]] = {
        "quantize": "qgz", "bits": "grad_bits", "pipeline_stages": "qgz_pipeline_stages",
        "until": "qgz_until", "planned_steps": "planned_steps", "hadamard": "qgz_hadamard",
        "stochastic_rounding": "stochastic_rounding", "error_feedback": "qgz_error_feedback",
        "signs": "qgz_signs", "hops": "qgz_hops", "defer": "qgz_defer",
        "reduce_scatter": "reduce_scatter"}


@dataclasses.dataclass(frozen=True)
class Quantization:
    """What qwZ, qgZ and quantized frozen weights share.

    Attributes:
      block_size: elements per scale (``block_size``).
      blockwise: one scale per block, else per message (``blockwise``).
      implementation: ``"pallas"``, ``"xla"`` or None for by backend
        (``quantization_impl``).
    """

    block_size: int | None = None
    blockwise: bool | None = None
    implementation: str | None = None

    FLAT: ClassVar[Mapping[str, str]] = {
        "block_size": "block_size", "blockwise": "blockwise",
        "implementation": "quantization_impl"}


@dataclasses.dataclass(frozen=True)
class Precision:
    """Dtypes of the run.

    Attributes:
      compute: the dtype weights are gathered and the model computes in (``compute_dtype``).
      params: the primary shards' and the update's dtype (``param_dtype``).
      output: floating outputs of ``apply_fn`` cast to this (``output_dtype``).
    """

    compute: str | None = None
    params: str | None = None
    output: str | None = None

    FLAT: ClassVar[Mapping[str, str]] = {
        "compute": "compute_dtype", "params": "param_dtype", "output": "output_dtype"}


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When units gather, what they keep, what shares a collective.

    Attributes:
      remat: ``"minimal"``, ``"full"`` or a ``jax.checkpoint`` policy (``remat``).
      prefetch: units gathered ahead (``prefetch``).
      keep_last_unit: the last unit keeps its weights for its backward
        (``keep_last_unit``).
      bucket: the rest unit shares the first unit's collectives (``bucket``).
    """

    remat: Any = None
    prefetch: int | None = None
    keep_last_unit: bool | None = None
    bucket: bool | None = None

    FLAT: ClassVar[Mapping[str, str]] = {
        "remat": "remat", "prefetch": "prefetch", "keep_last_unit": "keep_last_unit",
        "bucket": "bucket"}


@dataclasses.dataclass(frozen=True)
class Update:
    """The optimizer step's guards.

    Attributes:
      clip_norm: clip the gradient to this global L2 norm (``gradient_clipping``).
      skip_nonfinite: skip a step whose gradient has an inf or NaN (``skip_nonfinite``).
    """

    clip_norm: float | None = None
    skip_nonfinite: bool | None = None

    FLAT: ClassVar[Mapping[str, str]] = {
        "clip_norm": "gradient_clipping", "skip_nonfinite": "skip_nonfinite"}


@dataclasses.dataclass(frozen=True)
class Offload:
    """What lives in host memory instead of the device's.

    Attributes:
      optimizer: the optimizer state, brought to the device for the update
        (``offload_optimizer``).
      params: the primary shards, brought to the device per unit (``offload_params``).
      ratio: the fraction of the optimizer state offloaded, whole units (``offload_ratio``).
    """

    optimizer: bool | None = None
    params: bool | None = None
    ratio: float | None = None

    FLAT: ClassVar[Mapping[str, str]] = {"optimizer": "offload_optimizer",
                                         "params": "offload_params",
                                         "ratio": "offload_ratio"}


# The config's keyword for each group.
GROUPS: Mapping[str, type] = {
    "weights": Weights, "secondary": Secondary, "gradients": Gradients,
    "quantization": Quantization, "precision": Precision, "schedule": Schedule,
    "update": Update, "offload": Offload}


def flatten_groups(settings: Mapping[str, Any]) -> dict[str, Any]:
    """Keywords with groups (``weights=Weights(...)``) -> flat keywords only.

    A group's fields left at None are not given. A setting given both flat and in a group,
    or a group keyword given something else than its group, raises naming the fix."""
    flat = {k: v for k, v in settings.items() if k not in GROUPS}
    for key, cls in GROUPS.items():
        group = settings.get(key)
        if group is None:
            continue
        if not isinstance(group, cls):
            raise TypeError(f"{key}= takes a zeropp_jax.{cls.__name__}(...), got "
                            f"{type(group).__name__}")
        for field, name in cls.FLAT.items():
            value = getattr(group, field)
            if value is None:
                continue
            if name in flat:
                raise ValueError(
                    f"{name}={flat[name]!r} and {key}={cls.__name__}({field}={value!r}) set "
                    f"the same setting: give it in one place")
            flat[name] = value
    return flat


def group_of(config: Any, cls: type) -> Any:
    """The ``cls`` group of ``config``'s settings, every field filled in."""
    return cls(**{field: getattr(config, name) for field, name in cls.FLAT.items()})


__all__ = ["GROUPS", "Gradients", "Offload", "Precision", "Quantization", "Schedule", "Secondary",
           "Update", "Weights", "flatten_groups", "group_of"]
