"""`ZeroPPConfig`: which ZeRO stage and which ZeRO++ techniques a training run uses.

A frozen dataclass, so a config is hashable and can sit in a jitted function's static
arguments. Presets `zero3()` and `zeropp()`; `from_deepspeed(dict)` reads the config a DeepSpeed
user already has.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from typing import Any, Mapping

import jax.numpy as jnp
import numpy as np

from zeropp_jax import _deprecations
from zeropp_jax.core import compat
from zeropp_jax.core.deepspeed import VALID_STAGES as _VALID_STAGES
from zeropp_jax.core.deepspeed import deepspeed_settings
from zeropp_jax.core.settings import (
    Gradients,
    Offload,
    Precision,
    Quantization,
    Schedule,
    Secondary,
    Update,
    Weights,
    flatten_groups,
    group_of,
)

_VALID_BITS = (4, 8)
# A wire format's name: its kind, then its bits per value (weight_bits is the older name of
# the INT ones: weight_bits=4 is weight_format="int4").
_FORMAT_NAME = re.compile(r"[a-z][a-z_]*?(\d+)")
_EXAMPLE_FORMATS = "'int8', 'int4' or 'fp8'"
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float64")

_IMPLEMENTATIONS = (None, "xla", "pallas")
_REDUCE_SCATTERS = ("flat", "hierarchical")
_REMATS = ("full", "minimal")


def _dtype_name(dtype: Any) -> str:
    try:
        return np.dtype(jnp.dtype(dtype)).name
    except TypeError as e:
        raise ValueError(f"{dtype!r} is not a dtype; use one of {_FLOAT_DTYPES}") from e


# The integer settings and what they take, for the error when one is not an int.
_INT_FIELDS = {
    "stage": "1, 2 or 3",
    "weight_bits": "4 or 8, or None",
    "grad_bits": "4 or 8",
    "block_size": "a positive int",
    "hpz_group_size": "a positive int, or None",
    "qgz_pipeline_stages": "an int >= 1",
    "planned_steps": "a positive int, or None",
    "prefetch": "an int >= 0",
}


def _as_int(name: str, value: Any) -> Any:
    """An integer setting as a Python int: a numpy integer (a sweep's value) becomes an
    int, so the config equals, hashes and prints as one written with ints. A float (even
    8.0), a bool or anything else raises naming the setting: 8.0 would otherwise pass the
    range checks (8.0 == 8) and reach names and shapes as a float (weight_format
    'int8.0'), True would pass as 1. None (not given; refused for a required setting) is
    left to the range checks."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}={value!r} is a bool: give an int ({_INT_FIELDS[name]})")
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        fix = (f"write {name}={int(value)}" if math.isfinite(value) and float(value).is_integer()
               else f"give an int ({_INT_FIELDS[name]})")
        raise ValueError(f"{name}={value!r} is a float: {fix}")
    raise ValueError(f"{name}={value!r} is a {type(value).__name__}: give an int "
                     f"({_INT_FIELDS[name]})")


def _weight_format(fmt: Any, bits: Any) -> tuple[str, int]:
    """``(weight_format, weight_bits)`` from either or both (None: not given); a pair
    that disagrees raises, naming both.

    A wire format is named by its kind and its bits per value (``"int8"``, ``"int4"``,
    ``"fp8"``): the bits come from the name, so the config takes any format the
    transports' registry may hold without listing them (``comm/transports/registry.py``
    refuses, when the run's plan is made, a name it has no transport for)."""
    if fmt is None:
        bits = 8 if bits is None else bits
        if bits not in _VALID_BITS:
            raise ValueError(f"weight_bits={bits!r} is invalid; valid values are {_VALID_BITS}"
                             f" (or weight_format, such as {_EXAMPLE_FORMATS})")
        return f"int{bits}", bits
    named = _FORMAT_NAME.fullmatch(fmt) if isinstance(fmt, str) else None
    fmt_bits = int(named.group(1)) if named else None
    if fmt_bits not in _VALID_BITS:
        raise ValueError(
            f"weight_format={fmt!r} is invalid: a wire format is named by its kind and its "
            f"bits per value, {' or '.join(map(str, _VALID_BITS))}, such as "
            f"{_EXAMPLE_FORMATS} (the transports' registry lists them)")
    if bits is not None and bits != fmt_bits:
        raise ValueError(
            f"weight_format={fmt!r} and weight_bits={bits!r} disagree: weight_format={fmt!r} "
            f"is {fmt_bits}-bit" + (f", weight_bits={bits} is weight_format='int{bits}'"
                                    if bits in _VALID_BITS else "")
            + ". Give one of them (weight_bits is the older name of 'int8' and 'int4'); "
            "dataclasses.replace copies both, so pass weight_bits=None with a new "
            "weight_format, or weight_format=None with a new weight_bits")
    return fmt, fmt_bits


@dataclasses.dataclass(frozen=True)
class ZeroPPConfig:
    """Settings of one ZeRO / ZeRO++ run.

    Invalid settings raise ``ValueError`` at construction, naming the setting. The integer
    settings (``stage``, ``weight_bits``, ``grad_bits``, ``block_size``,
    ``hpz_group_size``, ``qgz_pipeline_stages``, ``planned_steps``, ``prefetch``) take
    ints; numpy integers are converted to ints, and floats (even ``8.0``) and bools are
    refused.

    Attributes:
      stage: ZeRO stage, DeepSpeed's meaning. 1: optimizer state sharded over all devices;
        2: + gradients sharded; 3: + parameters sharded and gathered per unit just before use.
      qwz: quantize weights (block-wise INT8, INT4 or FP8: ``weight_format``) before the
        forward all-gather.
      hpz: keep a secondary weight partition inside each node for the backward gather.
      qgz: INT4 hierarchical all-to-all gradient reduce-scatter.
      weight_bits: bits of qwZ's quantized weights (8 or 4): the older name of
        ``weight_format`` ``"int8"`` / ``"int4"``. Either may be given; they are resolved to
        each other (``"fp8"`` is 8 bits), and a pair that disagrees raises. None (default):
        from ``weight_format``, else 8.
      weight_format: how qwZ's weights travel: ``"int8"`` (default), ``"int4"`` (two per
        byte; see ``qwz_hadamard``) or ``"fp8"`` (e4m3 with one fp32 scale per block:
        INT8's bytes, a relative instead of an absolute error per element, which measured
        5x INT8's error on the demo GPT's weights, ``benchmarks/qgz_accuracy.py``;
        dequantized in plain jnp, which XLA can fuse into the consumer, whatever
        ``quantization_impl`` says). DeepSpeed has no key for it (``zero_quantized_weights`` is INT8): pass it
        to ``from_deepspeed`` as an override. Frozen weights stored quantized
        (``quantize_frozen``) are INT8 with ``"fp8"`` and are not rotated.
      grad_bits: bits of qgZ's quantized gradients (8 or 4).
      block_size: elements per quantization block (one fp32 scale each).
      hpz_group_size: devices in one hpZ secondary group: ``k * L`` for ``k`` whole nodes
        (``k`` dividing the node count; checked against the mesh); None means the
        ``"local"`` axis (one node).
      qgz_pipeline_stages: chunks qgZ sends independently (paper Algorithm 2).
      compute_dtype: dtype weights are gathered and the model computes in.
      param_dtype: dtype of the primary (master) shards and the optimizer update.
        ``"float64"`` (with ``compute_dtype="float64"``) needs JAX's 64-bit mode
        (``jax_enable_x64``): a reference-precision run, as the exactness tests use.
      quantization_impl: ``"pallas"`` (the kernels in ``pallas_kernels``), ``"xla"``
        (plain jnp, which XLA fuses into the ops around it) or None: on a GPU the kernels
        for Hadamard-rotated blocks and jnp for the rest, jnp elsewhere
        (``quant.quantization.default_implementation`` says why). Same bits either way.
      qgz_until: with qgZ, use it only for steps ``< qgz_until`` and a full-precision
        reduce-scatter after (the paper's "qgZ for the first 50%"). An int is a step
        count; a float in (0, 1] a fraction of ``planned_steps``. None: always.
      planned_steps: total steps of the run; needed when ``qgz_until`` is a fraction.
      reduce_scatter: the unquantized gradient reduce-scatter (ZeRO-3, and qgZ after
        ``qgz_until``): ``"flat"`` is XLA's ``psum_scatter`` over all devices;
        ``"hierarchical"`` is qgZ's two-hop all-to-all without quantization, which keeps
        16-bit gradients 16-bit on the wire where a backend widens reduce-scatters (XLA CPU).
      all_gather: the weight all-gathers (ZeRO-3 and qwZ, forward and backward; frozen
        weights too). ``"flat"`` (default) is one all-gather over all devices: a ring over
        all P devices moves (P-1)/P of the weights into each node (0.75 against 0.5 on 2
        nodes of 2). ``"hierarchical"`` gathers over ``"node"`` first, then over
        ``"local"``, so each node receives each remote byte once ((N-1)/N, the lower
        bound), in two collectives instead of one. Measured on the emulated cluster
        (ZeRO-3, 2 nodes x 2): 1.18x faster at 100 Mbit/s, equal at 1 Gbit/s, 0.93x at
        10 Gbit/s; and on XLA CPU the compiled step's temp memory grows by 0.50 of a
        layer's weights per added layer against 0.33 for flat (tests/units/test_units.py), so it
        is not the default. Same weights bit for bit; on one node both are one all-gather.
      blockwise: True (default): one quantization scale per ``block_size`` elements. False:
        the paper's *non-blocked* baseline, one scale per quantized message — a device's
        whole primary shard in qwZ, a whole destination slice in each qgZ hop. Exists to
        measure what blocks buy (the paper reports non-blocked training diverges).
      gradient_clipping: clip the gradient to this global L2 norm before the optimizer
        (DeepSpeed's ``gradient_clipping``; ``optax.clip_by_global_norm`` on the whole
        gradient). The norm is summed over all devices' shards. None: no clipping.
      skip_nonfinite: if any gradient element is inf or NaN on any device, skip the update
        (parameters and optimizer state stay as they were) and count it in
        ``state.skipped_steps``. False applies such updates.
      quantize_frozen: store the primary shards of frozen parameters (``TrainState.create(
        ..., frozen=...)``) block-quantized — INT8, or INT4 with ``weight_bits=4``, one fp32
        scale per ``block_size`` elements — and gather them as stored, without
        requantization. False keeps them in ``param_dtype``. Frozen parameters never get
        gradients or optimizer state either way.
      remat: what a stage-3 unit keeps from forward for its backward (never its gathered
        weights: backward regathers them). ``"minimal"`` (default): every activation
        backward needs, as a plain step keeps them (if one is a copy of a weight, e.g. a
        tied head's transpose: only matmul outputs and collective results, recomputing the
        elementwise rest); no forward matmul runs twice. What DeepSpeed ZeRO-3 and FSDP do
        (regather weights, keep activations). ``"full"``: only the unit's inputs; backward
        recomputes the whole unit (least memory, one extra forward; activation
        checkpointing, an opt-in there too). A ``jax.checkpoint`` policy callable chooses
        itself.
      prefetch: how many units' gathers may run ahead of the computation (stage 3), in
        forward and in backward. Each unit's gather waits for the output of the unit
        ``prefetch + 1`` calls before it, and its backward regather for the backward of
        the unit ``prefetch`` calls after it to start, so about ``prefetch + 1`` units' full
        weights are live at once (DeepSpeed's ``stage3_prefetch_bucket_size``, FSDP's
        ``limit_all_gathers`` and forward / backward prefetch). Layers of a scanned stack
        are XLA's to prefetch (its collective pipeliner on GPUs).
      keep_last_unit: True (default): the unit called last in forward (among units called
        once; only smaller units, such as a tied head's embedding, may be called after it)
        keeps its gathered weights for its backward, which runs next, instead of
        regathering them: one all-gather less per step, the same weights bit for bit (rule:
        ``units.apply.kept_unit``). Its full weights then
        stay live through the loss instead of being gathered again right after it (FSDP2
        keeps the root module's weights this way; DeepSpeed keeps parameters reused within
        ``stage3_max_reuse_distance``). False: every unit regathers.
      bucket: True (default): the rest unit (parameters outside every unit: embeddings,
        final norms the wrap policy left) shares its forward all-gather and its gradient's
        reduce-scatter with the first unit the model calls, whose collectives run at the
        same two moments of the step: two collectives fewer per step (four with two-hop
        collectives), the same values bit for bit. Skipped where that could change a value
        (one quantization scale per shard, Hadamard rotation, stochastic rounding) or
        memory (the first unit called twice, kept, or with frozen parameters). DeepSpeed's
        ``allgather_bucket_size`` / ``reduce_bucket_size`` merge collectives the same way.
      output_dtype: floating outputs of ``state.apply_fn`` (logits, a model-computed loss)
        are cast to this dtype when the compute dtype is narrower, so the loss and the
        metrics are computed in fp32 (jmp's ``output=float32``; PyTorch autocast runs
        losses in fp32 too). None keeps the model's output dtype.
      qgz_hadamard: with qgZ, rotate every gradient block by a randomized Walsh–Hadamard
        transform before it is quantized (random ±1 signs, the same on every device) and
        the sum back after, in both hops: an outlier no longer sets its block's scale
        alone. Same bytes on the wire; ``block_size`` must be a power of 2 and
        ``blockwise`` True. Off by default until a convergence study says otherwise (the
        rotation costs ``log2(block_size)`` additions per element on each end).
      qwz_hadamard: the same rotation for qwZ's weight blocks (any ``weight_format``). It
        helps blocks with outliers and hurts near-uniform ones (INT4, measured by
        ``benchmarks/qgz_accuracy.py``: heavy-tailed weights 0.28 -> 0.12 relative error,
        the demo GPT's light-tailed trained weights 0.10 -> 0.13), so whether it makes
        ``"int4"`` usable depends on the model: off by default. The signs come from a
        fixed key (the gathers know no step; forward and backward must decode the same
        weights).
      stochastic_rounding: with qgZ, round the gradient quantizations up or down at random
        with the probabilities that make them unbiased (the expected dequantized value is
        the input), instead of to nearest. Each device draws its own bits, seeded from its
        gradient (``quant/rotation.py``). Off by default: it doubles the variance of the
        rounding error for an unbiased mean.
      qgz_hops: with qgZ, which of its two all-to-all hops carry quantized blocks:
        ``"both"`` (default; the ZeRO++ paper's qgZ) or ``"cross"``: only the hop between
        nodes. The hop inside the node then moves the gradient's own dtype (16-bit for
        bf16) and every element is quantized once instead of twice: the same cross-node
        bytes as ``"both"``, more bytes on the fast links inside the node, about half the
        quantization error (``comm.qgz.qgz_reduce_scatter``). Not with
        ``qgz_error_feedback``.
      qgz_defer: with qgZ, a scanned stack's layers (``nn.scan``, ``nnx.scan``) reduce their
        gradients as a pipeline across the backward loop (``units.deferral``): layer ``i``'s
        backward quantizes its own gradient, sends layer ``i + 1``'s blocks inside the node
        and layer ``i + 2``'s across nodes, so qgZ's all-to-alls run beside a layer's
        compute. XLA moves a scanned layer's reduce-scatter across loop iterations itself,
        but not an all-to-all: without this, qgZ's hops end every backward iteration with
        nothing left to overlap them. The same gradients, bit for bit; the quantized blocks
        of two layers are live through backward (with ``qgz_until``, one layer's flat
        gradient instead). Needs ``train_step`` (which makes the arrays that carry them from
        one iteration to the next); units outside a scanned stack are unchanged. Off by
        default. Not with ``qgz_error_feedback``.
      offload_optimizer: keep the optimizer state (Adam's moments: 8 bytes per parameter,
        split over all devices) in each device's pinned host memory between steps
        (DeepSpeed's ``offload_optimizer``, FSDP2's ``CPUOffloadPolicy`` for the state).
        The update brings it to the device and sends the new state back, leaf by leaf, so
        XLA can overlap the transfers with the update; the arithmetic is the same, so
        training is bit for bit the same as without. The primary (master) shards stay on
        the device unless ``offload_params``.
      offload_params: keep the fp32 primary shards in pinned host memory too (stage 3):
        each unit's shard comes to the device just before its gather (forward, and
        backward's regather unless hpZ's secondary, which stays on the device, rebuilds
        it), its gradient shard goes back to the host, and the update brings both to the
        device (DeepSpeed's ``offload_param`` with ``device: "cpu"``). Bit for bit the
        same training.
      offload_ratio: with ``offload_optimizer``, the fraction of the optimizer state kept
        in host memory, in (0, 1] (DeepSpeed's ``offload_optimizer.ratio``; ZeRO-Offload++
        keeps the rest on the GPU): whole units' state, the units taken in order until
        their parameters reach this fraction of the trainable ones
        (``comm.offload.OffloadPolicy.units``); the others' state stays on the device. 1.0
        (default): all of it, the step count too.
    """

    stage: int = 3
    qwz: bool = False
    hpz: bool = False
    qgz: bool = False
    weight_bits: int | None = None
    grad_bits: int = 4
    block_size: int = 256
    hpz_group_size: int | None = None
    qgz_pipeline_stages: int = 1
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    quantization_impl: str | None = None
    qgz_until: int | float | None = None
    planned_steps: int | None = None
    reduce_scatter: str = "flat"
    all_gather: str = "flat"
    blockwise: bool = True
    gradient_clipping: float | None = None
    skip_nonfinite: bool = True
    quantize_frozen: bool = False
    remat: Any = "minimal"
    prefetch: int = 1
    keep_last_unit: bool = True
    bucket: bool = True
    output_dtype: str | None = "float32"
    qgz_hadamard: bool = False
    qwz_hadamard: bool = False
    weight_format: str | None = None
    stochastic_rounding: bool = False
    qgz_error_feedback: bool = False
    qgz_signs: str = "fixed"
    qgz_hops: str = "both"
    qgz_defer: bool = False
    offload_optimizer: bool = False
    offload_params: bool = False
    offload_ratio: float = 1.0

    def __init__(self, stage: int = 3, **settings: Any) -> None:
        """Settings by their flat keywords (``qwz=True``, ``weight_format="int4"``), or
        grouped (``weights=Weights(quantize=True, format="int4")``; the groups are in
        ``zeropp_jax.core.settings``, exported at the top level), or both; one setting
        given twice raises. Unknown keywords raise naming the closest one."""
        flat = flatten_groups(settings)
        fields = dataclasses.fields(self)
        names = [f.name for f in fields]
        for key in flat:
            if key not in names:
                close = difflib.get_close_matches(key, [*names, *_GROUP_KEYWORDS], n=1)
                raise TypeError(f"ZeroPPConfig has no setting {key!r}"
                                + (f"; did you mean {close[0]!r}?" if close else ""))
        for f in fields:
            value = stage if f.name == "stage" else flat.get(f.name, f.default)
            object.__setattr__(self, f.name, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        # Integer settings first: weight_format is derived from weight_bits below.
        for name in _INT_FIELDS:
            object.__setattr__(self, name, _as_int(name, getattr(self, name)))
        # Normalise dtypes to canonical names so equal configs hash equal.
        object.__setattr__(self, "compute_dtype", _dtype_name(self.compute_dtype))
        object.__setattr__(self, "param_dtype", _dtype_name(self.param_dtype))
        if self.output_dtype is not None:
            object.__setattr__(self, "output_dtype", _dtype_name(self.output_dtype))
        # weight_format and its older name weight_bits, resolved to each other, so that
        # ZeroPPConfig(weight_bits=4) == ZeroPPConfig(weight_format="int4").
        fmt, bits = _weight_format(self.weight_format, self.weight_bits)
        object.__setattr__(self, "weight_format", fmt)
        object.__setattr__(self, "weight_bits", bits)
        self._validate()

    def _validate(self) -> None:
        if self.stage not in _VALID_STAGES:
            raise ValueError(f"stage={self.stage!r} is invalid; valid stages are {_VALID_STAGES}")
        for name in ("qwz", "hpz", "qgz", "blockwise", "skip_nonfinite", "quantize_frozen",
                     "qgz_hadamard", "qwz_hadamard", "stochastic_rounding",
                     "qgz_error_feedback", "offload_optimizer", "offload_params"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("weight_bits", "grad_bits"):
            if getattr(self, name) not in _VALID_BITS:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid; valid values are {_VALID_BITS}"
                )
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {self.block_size!r}")
        if self.weight_bits == 4 and self.block_size % 2:
            raise ValueError(
                f"weight_bits=4 packs two values per byte: block_size={self.block_size} "
                "must be even"
            )
        if self.qgz and self.grad_bits == 4 and self.block_size % 2:
            raise ValueError(
                f"qgZ with grad_bits=4 packs two values per byte: block_size="
                f"{self.block_size} must be even (or grad_bits=8)"
            )
        if self.qgz_signs not in ("fixed", "per_step"):
            raise ValueError(f"qgz_signs={self.qgz_signs!r} is invalid; valid values are "
                             "'fixed' and 'per_step'")
        if self.qgz_hops not in ("both", "cross"):
            raise ValueError(f"qgz_hops={self.qgz_hops!r} is invalid; valid values are "
                             "'both' and 'cross'")
        if self.qgz_hops != "both" and not self.qgz:
            raise ValueError(f"qgz_hops={self.qgz_hops!r} chooses which of qgZ's hops are "
                             "quantized: it needs qgz=True")
        if self.qgz_hops == "cross" and self.qgz_error_feedback:
            raise ValueError("qgz_error_feedback keeps the errors of both of qgZ's "
                             "quantizations: use it with qgz_hops='both', or turn it off")
        if self.qgz_defer and not self.qgz:
            raise ValueError("qgz_defer defers qgZ's reduction of a scanned layer's "
                             "gradient: it needs qgz=True")
        if self.qgz_defer and self.qgz_error_feedback:
            raise ValueError("qgz_defer and qgz_error_feedback do not combine (a scanned "
                             "stack keeps no per-layer errors): turn one off")
        if self.qgz_error_feedback and not self.qgz:
            raise ValueError("qgz_error_feedback keeps qgZ's quantization errors: it needs "
                             "qgz=True")
        if self.qgz_signs == "per_step" and not (
                self.qgz and (self.qgz_hadamard or self.stochastic_rounding)):
            raise ValueError("qgz_signs='per_step' draws qgZ's Hadamard signs and rounding "
                             "seeds from the step: it needs qgz=True with qgz_hadamard=True "
                             "or stochastic_rounding=True")
        for name, technique in (("qgz_hadamard", "qgz"), ("qwz_hadamard", "qwz")):
            if not (getattr(self, name) and getattr(self, technique)):
                continue  # like grad_bits without qgZ: unused, so unchecked
            if not self.blockwise:
                raise ValueError(f"{name} rotates each quantization block: it needs "
                                 "blockwise=True (one scale per block_size elements)")
            if self.block_size < 2 or self.block_size & (self.block_size - 1):
                raise ValueError(
                    f"{name}: the Walsh–Hadamard transform needs block_size a power of 2, "
                    f"got block_size={self.block_size}; use e.g. "
                    f"{1 << max(1, round(math.log2(self.block_size)))}")
        if self.quantization_impl not in _IMPLEMENTATIONS:
            raise ValueError(
                f"quantization_impl={self.quantization_impl!r} is invalid; valid values are "
                f"{_IMPLEMENTATIONS}"
            )
        if self.hpz_group_size is not None and (
            not isinstance(self.hpz_group_size, int) or self.hpz_group_size <= 0
        ):
            raise ValueError(
                f"hpz_group_size must be None (the local axis) or a positive int, "
                f"got {self.hpz_group_size!r}"
            )
        if not isinstance(self.qgz_pipeline_stages, int) or self.qgz_pipeline_stages < 1:
            raise ValueError(
                f"qgz_pipeline_stages must be an int >= 1, got {self.qgz_pipeline_stages!r}"
            )
        if not isinstance(self.prefetch, int) or isinstance(self.prefetch, bool) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead), got "
                             f"{self.prefetch!r}")
        if not isinstance(self.keep_last_unit, bool):
            raise ValueError(f"keep_last_unit must be True or False, got {self.keep_last_unit!r}")
        if not isinstance(self.bucket, bool):
            raise ValueError(f"bucket must be True or False, got {self.bucket!r}")
        if not (self.remat in _REMATS or callable(self.remat)):
            raise ValueError(
                f"remat={self.remat!r} is invalid; use one of {_REMATS} or a jax.checkpoint "
                "policy callable (e.g. jax.checkpoint_policies.dots_saveable)"
            )
        if self.compute_dtype == "float16":
            # fp16 needs loss scaling (its smallest normal is 6e-5: small gradients vanish)
            # and fp32 sums of reduced gradients (8 devices' 2e4 overflow 65504); neither
            # is implemented, and training would go wrong without a word.
            raise ValueError(
                "compute_dtype='float16' is not supported: it needs dynamic loss scaling "
                "(DeepSpeed's fp16.loss_scale) and fp32 gradient sums, which zeropp_jax "
                "does not implement. Use compute_dtype='bfloat16' (same bytes on the wire, "
                "fp32's range, no loss scaling needed); from a DeepSpeed config, enable "
                "bf16 instead of fp16."
            )
        for name in ("compute_dtype", "param_dtype", "output_dtype"):
            if name == "output_dtype" and self.output_dtype is None:
                continue
            if getattr(self, name) not in _FLOAT_DTYPES:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid; valid dtypes are {_FLOAT_DTYPES}"
                )
            if getattr(self, name) == "float64" and not compat.x64_enabled():
                # Without x64 JAX makes float64 arrays float32 with only a warning: the run
                # would not be the float64 one asked for.
                raise ValueError(
                    f"{name}='float64' needs JAX's 64-bit mode: set "
                    "jax.config.update('jax_enable_x64', True) at startup (or build and "
                    "run the state inside `with jax.enable_x64(True):`)"
                )
        for name in ("reduce_scatter", "all_gather"):
            if getattr(self, name) not in _REDUCE_SCATTERS:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is invalid; valid values are "
                    f"{_REDUCE_SCATTERS}"
                )
        if self.gradient_clipping is not None and (
            isinstance(self.gradient_clipping, bool)
            or not isinstance(self.gradient_clipping, (int, float))
            or not self.gradient_clipping > 0
        ):
            raise ValueError(
                f"gradient_clipping must be a positive number (the maximum global norm) or "
                f"None, got {self.gradient_clipping!r}"
            )
        if self.planned_steps is not None and (
            not isinstance(self.planned_steps, int) or self.planned_steps < 1
        ):
            raise ValueError(f"planned_steps must be a positive int, got {self.planned_steps!r}")
        if self.qgz_until is not None:
            if isinstance(self.qgz_until, bool) or not isinstance(self.qgz_until, (int, float)):
                raise ValueError(f"qgz_until must be an int, a float or None, got {self.qgz_until!r}")
            if isinstance(self.qgz_until, float):
                if not 0.0 < self.qgz_until <= 1.0:
                    raise ValueError(
                        f"qgz_until={self.qgz_until} as a fraction must be in (0, 1]; give an "
                        "int for a step count"
                    )
                if self.planned_steps is None:
                    raise ValueError(
                        f"qgz_until={self.qgz_until} is a fraction of the planned steps: also "
                        "set planned_steps (the run's total step count)"
                    )
            elif self.qgz_until < 0:
                raise ValueError(f"qgz_until must be >= 0, got {self.qgz_until}")
            if not self.qgz:
                raise ValueError("qgz_until only applies with qgz=True")
        if (self.qwz or self.hpz or self.qgz) and self.stage != 3:
            raise ValueError(
                "qwz, hpz and qgz are ZeRO-3 techniques; set stage=3 or turn them off"
            )
        ratio = self.offload_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
            raise ValueError(f"offload_ratio={ratio!r} must be a number in (0, 1]: the "
                             "fraction of the optimizer state kept in host memory")
        if ratio < 1 and not self.offload_optimizer:
            raise ValueError(f"offload_ratio={ratio} is the fraction of the optimizer state "
                             "offloaded: it needs offload_optimizer=True")
        if self.offload_params and self.stage != 3:
            raise ValueError(
                "offload_params keeps the primary shards in host memory and gathers them per "
                "unit, a ZeRO-3 layout; set stage=3 (or offload only the optimizer state: "
                "offload_optimizer=True)")
        if self.quantize_frozen and self.stage != 3:
            raise ValueError(
                "quantize_frozen stores frozen weights as quantized primary shards, a ZeRO-3 "
                "layout; set stage=3 or quantize_frozen=False"
            )

    # -- the settings by group ------------------------------------------------------------

    @property
    def weights(self) -> Weights:
        """How weights travel (qwZ's settings, the all-gather, frozen storage)."""
        return group_of(self, Weights)

    @property
    def secondary(self) -> Secondary:
        """hpZ's secondary partition."""
        return group_of(self, Secondary)

    @property
    def gradients(self) -> Gradients:
        """How gradients are reduce-scattered (qgZ's settings)."""
        return group_of(self, Gradients)

    @property
    def quantization(self) -> Quantization:
        """Block size, blockwise scales and kernels, shared by the quantized paths."""
        return group_of(self, Quantization)

    @property
    def precision(self) -> Precision:
        """The compute, param and output dtypes."""
        return group_of(self, Precision)

    @property
    def schedule(self) -> Schedule:
        """Rematerialization, prefetch, the kept last unit, buckets."""
        return group_of(self, Schedule)

    @property
    def update(self) -> Update:
        """Gradient clipping and skipping non-finite steps."""
        return group_of(self, Update)

    @property
    def offload(self) -> Offload:
        """What lives in host memory."""
        return group_of(self, Offload)

    # -- presets -------------------------------------------------------------------------------

    @classmethod
    def zero3(cls, **overrides: Any) -> "ZeroPPConfig":
        """ZeRO-3 with every ZeRO++ switch off (the baseline)."""
        return cls(**{"stage": 3, "qwz": False, "hpz": False, "qgz": False,
                      **flatten_groups(overrides)})

    @classmethod
    def zeropp(cls, **overrides: Any) -> "ZeroPPConfig":
        """ZeRO-3 with qwZ, hpZ and qgZ all on."""
        return cls(**{"stage": 3, "qwz": True, "hpz": True, "qgz": True,
                      **flatten_groups(overrides)})

    @classmethod
    def from_mode(cls, mode: str, **overrides: Any) -> "ZeroPPConfig":
        """The config behind the example's ``--mode`` names: zero3, qwz, hpz, qgz, qwz_hpz,
        zeropp."""
        modes = {
            "zero3": {},
            "qwz": {"qwz": True},
            "hpz": {"hpz": True},
            "qwz_hpz": {"qwz": True, "hpz": True},
            "qgz": {"qgz": True},
            "zeropp": {"qwz": True, "hpz": True, "qgz": True},
        }
        if mode not in modes:
            raise ValueError(f"mode={mode!r} is invalid; valid modes are {tuple(modes)}")
        return cls(**{"stage": 3, **modes[mode], **flatten_groups(overrides)})

    # The planner's old spelling: it is ``zpp.auto_config`` (the top layer; this one is the
    # bottom). Reading it warns and returns ``zeropp_jax.auto_config``, found by name in the
    # package's deprecation table when it is read, so this module imports nothing above it.
    auto = _deprecations.MovedAttribute("zeropp_jax.ZeroPPConfig.auto")

    @classmethod
    def from_deepspeed(cls, ds_config: Mapping[str, Any], **overrides: Any) -> "ZeroPPConfig":
        """Reads a DeepSpeed config dict: its ``zero_optimization`` section and the top-level
        keys that set how training computes.

        Understood ``zero_optimization`` keys: ``stage`` (1, 2 or 3; required: DeepSpeed
        reads a config without it, or without the section, as ZeRO off, stage 0, which has
        no counterpart here, so that raises unless ``stage=`` is passed as an override),
        ``zero_quantized_weights``, ``zero_hpz_partition_size`` (> 1 turns hpZ on with that
        group size; DeepSpeed's default 1 means off), ``zero_quantized_gradients``,
        ``stage3_max_reuse_distance`` (0 sets ``keep_last_unit=False``; any larger distance
        keeps the last unit). The top-level ``bf16.enabled`` picks bf16 compute (neither it
        nor ``fp16`` nor ``amp``: fp32); ``fp16.enabled`` and an enabled apex ``amp`` block
        (float16 with loss scaling) raise, naming bf16 as the equivalent; a top-level
        ``gradient_clipping`` > 0 sets ``gradient_clipping``. ``zero_optimization`` keys that
        only tune DeepSpeed's own bucketing and prefetching are accepted and ignored (XLA
        schedules those here); DeepSpeed features not implemented here (offload, MiCS, LoCo,
        quantized frozen weights, curriculum learning, data efficiency, elasticity,
        compression training) raise naming themselves when enabled; any other key raises
        with the closest valid one. Errors name the DeepSpeed key as written. Flags accept
        booleans, 0/1 and "true"/"false"; "auto" (as transformers' integration writes)
        raises: resolve it first. Keyword ``overrides`` apply on top and take precedence.
        """
        return cls(**deepspeed_settings(ds_config, flatten_groups(overrides)))

    @property
    def flat_alignment(self) -> int:
        """Each primary shard's length is a multiple of this: whole quantization blocks
        when any quantized collective is on."""
        if not self.blockwise:
            # One scale per message: only INT4's two-per-byte packing and qgZ's stages
            # constrain the length.
            return 2 * self.qgz_pipeline_stages if (self.qwz or self.qgz) else 1
        if self.qgz:  # qgZ cuts each slice into stages of whole blocks
            return self.block_size * self.qgz_pipeline_stages
        return self.block_size if self.qwz else 1

    @property
    def qgz_until_step(self) -> int | None:
        """``qgz_until`` as a step count (None: qgZ for every step)."""
        if self.qgz_until is None:
            return None
        if isinstance(self.qgz_until, float):
            return int(round(self.qgz_until * self.planned_steps))
        return self.qgz_until

    @property
    def compute_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.compute_dtype)

    @property
    def param_jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.param_dtype)


_GROUP_KEYWORDS = ("weights", "secondary", "gradients", "quantization", "precision",
                   "schedule", "update", "offload")
