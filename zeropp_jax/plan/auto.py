"""The automatic configuration: rank ZeRO-3 and the ZeRO++ combinations with the cost model.

``plan(state_or_model, nodes=, local=, ...)`` builds every candidate configuration (ZeRO-3;
qwZ with INT8 weights, and INT4 with ``allow_int4_weights=True``; hpZ with every group of k
whole nodes; qgZ; and their combinations), predicts each one's step time and memory per
device on the hardware (``cost_model.predict_step`` of ``workload.config_workload``), drops
those over the memory budget, and chooses the fastest; ties within ``tie`` go to the
candidate with fewer techniques on (less quantization error). ``auto_config``
(``zpp.auto_config``) prints the plan's table and returns the chosen config.

qgZ's error feedback (``qgz_error_feedback``) is never turned on by the plan: it costs
memory (on two nodes or more each device keeps about ``1 + 1 / local`` bytes per
parameter of the whole model, whatever the device count: ``workload.feedback_sizes``)
for accuracy the ranking does not see. A ``base`` with it on gives it to every qgZ
candidate, whose memory (against the budget too) and quantization work then count it;
``configs`` with it on are priced likewise. Per-step signs (``qgz_signs="per_step"``)
likewise come from ``base`` only (they cost nothing the model counts).

The ranking is by speed; accuracy is not modelled. So by default it ranks only the
techniques of the ZeRO++ paper and DeepSpeed (INT8 weights, hpZ, INT4 gradients), whose
accuracy the paper and ``benchmarks/convergence.py`` measured. INT4 weights lose accuracy
where INT8 weights do not, with or without ``qwz_hadamard`` (``benchmarks/int4_weights.py``;
docs/guides/techniques.md), so they are ranked only with ``allow_int4_weights=True``; the
plan's last line says which it did.

Offload: when no candidate fits the budget on the device and the hardware has a host link,
the same candidates are ranked again with the optimizer state in host memory, and if none of
those fits either, with the primary shards there too (``offload_params``), each priced with
its transfers over the host link.

Activations: a ``ModelShape`` says what its model keeps per token (``transformer_shape``
with ``heads``, or ``activation_bytes_per_token``); a params tree says nothing, and is
priced without them. A ``TrainState`` is priced with what the compiler says its step
holds: when a step of the state has been lowered (``lowered=step.lower(state, batch)``, or
the step a ``train_step`` recorded on the state, ``measured.step_of_state``), that step is
compiled once (or read, if compiled already), and what its arguments + temporaries hold
beyond the memory model's other terms becomes the state's activation bytes per token
(``measured.calibrated_shape``), priced for every candidate at its tokens per device.
One compile, not one per candidate: the terms that differ between candidates (hpZ's
secondaries, qwZ's buffers, qgZ's, offloaded state) are the model's, and what the model
keeps for backward is the same under each (``measured``'s docstring says what this
leaves out). Without a lowered step a state's activations are not counted, and the plan's
last line says so.

Hardware: ``hardware=`` (a ``cost_model.Hardware``, e.g. one calibrated by
``benchmarks/cluster/run.py --predict`` or a preset of ``presets``), else ``presets.for_devices``
on the given link speeds, nodes and devices per node defaulting to ``jax``'s processes and
local devices.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import numbers
from typing import Any, Mapping, Sequence

import numpy as np

from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.plan import presets
from zeropp_jax.plan.measured import calibrated_shape, compiled_memory, step_of_state
from zeropp_jax.plan.cost_model import Hardware, StepPrediction, predict_step
from zeropp_jax.plan.workload import (
    ModelShape,
    config_label,
    config_workload,
    shape_of_params,
    shape_of_state,
)


# Candidates within this fraction of the fastest count as tied (plan's default tie).
_TIE = 0.02
# With activations measured from a compiled step, a candidate other than the compiled
# configuration (or at other tokens) fits the budget only with this much to spare. The
# memory model's terms that differ between configurations are held to 10% of compiled
# steps (tests/plan/test_memory_model.py), but that is on models whose activations dwarf
# their weights. With weights a larger share (d 64, vocab 2048, 32 tokens a device, 2x4
# CPU mesh), ZeRO++'s compiled step was 1 / 0.889 = 1.125x its prediction from ZeRO-3's
# for transformers' GPT-2 (1.09x Llama, 1.03x an NNX and a linen GPT): all of it hpZ,
# whose regathered weights XLA's CPU backend holds for longer than the model counts.
# 15% covers the largest of these.
MEMORY_MARGIN = 0.15


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One configuration and what the cost model says of it."""

    config: ZeroPPConfig
    prediction: StepPrediction
    fits: bool
    wire_mb: float = 0.0  # MB each node sends across nodes per step
    tensor_parallel: int = 1  # the "model" axis size it is costed for (make_mesh(model=))
    # The fraction of its predicted memory it must have to spare to fit the budget
    # (MEMORY_MARGIN when priced from another configuration's compiled step, else 0).
    margin: float = 0.0

    @property
    def memory_needed(self) -> float:
        """The predicted bytes per device, with its margin: what the budget must hold."""
        return self.prediction.memory_bytes * (1 + self.margin)

    @property
    def label(self) -> str:
        tp = f" tp{self.tensor_parallel}" if self.tensor_parallel > 1 else ""
        return config_label(self.config) + tp

    @property
    def cost(self) -> float:
        """What the ranking compares: the step time, per device's share of the tokens (a
        tensor-parallel candidate's ``T`` devices share one rank's tokens, so its step is
        weighed ``T`` times)."""
        return self.prediction.step_s * self.tensor_parallel

    @property
    def techniques(self) -> int:
        c = self.config
        return (int(c.qwz) + int(c.hpz) + int(c.qgz) + int(c.qwz and c.weight_format == "int4")
                + int(c.offload_optimizer) + int(c.offload_params))


@dataclasses.dataclass(frozen=True)
class Plan:
    """Every candidate, fastest first, and the one chosen."""

    candidates: tuple[Candidate, ...]
    chosen: Candidate
    hardware: Hardware
    shape: ModelShape
    tokens_per_device: float
    memory_budget_bytes: float | None
    why: str
    activations: str = ""  # where the activations priced came from (``_activations``)

    def table(self) -> str:
        hw = self.hardware
        sliced = self.shape.tensor_parallel * self.shape.expert_parallel > 1
        lines = [f"zeropp_jax plan: {self.shape.name or 'model'} ({self.shape.params:,} params"
                 f"{' in a slice' if sliced else ''}) on "
                 f"{hw.nodes} nodes x {hw.local} devices; {hw.name}",
                 f"  links: inside a node {hw.intra.bytes_per_s * 8 / 1e9:,.0f} Gbit/s per device "
                 f"(+{hw.intra.latency_s * 1e6:,.0f} us per collective), between nodes "
                 f"{hw.inter.bytes_per_s * 8 / 1e9:,.1f} Gbit/s per node "
                 f"(+{hw.inter.latency_s * 1e6:,.0f} us per collective); compute "
                 f"{hw.flops_per_s / 1e12:,.1f} TFLOP/s per device, overlap {hw.overlap:.2f}",
                 f"{'config':<28} {'step ms':>9} {'compute':>8} {'wire':>8} {'fixed':>8} "
                 f"{'xnode MB':>9} {'mem GiB':>8}  "]
        if any(c.prediction.host_s for c in self.candidates):
            lines[-1] = lines[-1].replace(f"{'fixed':>8} ", f"{'fixed':>8} {'host':>8} ")
        for c in self.candidates:
            p = c.prediction
            mark = "<- chosen" if c is self.chosen else ("" if c.fits else "over budget")
            host = (f"{p.host_s * 1e3:>8.2f} "
                    if any(c.prediction.host_s for c in self.candidates) else "")
            lines.append(f"{c.label:<28} {p.step_s * 1e3:>9.2f} {p.compute_s * 1e3:>8.2f} "
                         f"{p.exposed_s * 1e3:>8.2f} {p.fixed_s * 1e3:>8.2f} {host}"
                         f"{c.wire_mb:>9.2f} {p.memory_bytes / 2**30:>8.3f}  {mark}")
        lines.append(self.why)
        return "\n".join(lines)


def candidate_configs(nodes: int, local: int, base: ZeroPPConfig | None = None, *,
                      allow_int4_weights: bool = False) -> list[ZeroPPConfig]:
    """ZeRO-3 and every ZeRO++ combination that means something on ``nodes x local``: qwZ
    (INT8 weights; INT4 too with ``allow_int4_weights``), hpZ (groups of k whole nodes,
    k < nodes dividing it), qgZ. One node: ZeRO-3 only (nothing crosses nodes to save).

    Every candidate keeps ``base``'s other settings. qgZ's own options
    (``qgz_error_feedback``, ``qgz_signs="per_step"``, ``qgz_hops="cross"``) are never
    turned on here: the qgZ candidates carry ``base``'s, priced as they are (error
    feedback's kept errors in their memory, ``workload.memory_breakdown``), and the
    candidates without qgZ drop them (they need qgZ)."""
    base = base or ZeroPPConfig()
    fields = {f.name for f in dataclasses.fields(ZeroPPConfig)}
    keep = {k: getattr(base, k) for k in fields
            if k not in ("qwz", "hpz", "qgz", "weight_bits", "weight_format", "hpz_group_size")}
    # What only qgZ takes, off for the candidates without it.
    no_qgz = {"qgz_error_feedback": False, "qgz_signs": "fixed", "qgz_hops": "both"}
    if nodes == 1:
        return [ZeroPPConfig(**{**keep, **no_qgz})]
    weights = [None, "int8", *(["int4"] if allow_int4_weights else [])]
    groups = [None] + [k * local for k in range(2, nodes) if nodes % k == 0]
    out = []
    for fmt, hpz, qgz in itertools.product(weights, [False, True], [False, True]):
        for group in (groups if hpz else [None]):
            out.append(ZeroPPConfig(**{**keep, **({} if qgz else no_qgz),
                                       "qwz": fmt is not None, "hpz": hpz, "qgz": qgz,
                                       "weight_format": fmt, "hpz_group_size": group}))
    return out


def plan(state_or_model: Any, *, nodes: int | None = None, local: int | None = None,
         intra_gbps: float | None = None, inter_gbps: float | None = None,
         memory_budget_bytes: float | None = None, hardware: Hardware | None = None,
         tokens_per_device: float | None = 0.0, base: ZeroPPConfig | None = None,
         tie: float | None = _TIE, configs: Sequence[ZeroPPConfig] | None = None,
         allow_int4_weights: bool = False,
         tensor_parallel: Mapping[int, ModelShape] | None = None,
         lowered: Any = None) -> Plan:
    """Rank the candidate configurations for a model on a cluster (module docstring).

    Args:
      state_or_model: a ``TrainState``, a params tree, or a ``workload.ModelShape``.
      nodes, local: the cluster (default: ``hardware``'s, else jax's process count and
        local device count).
      intra_gbps, inter_gbps: link payload bandwidths, Gbit/s per device inside a node and
        per node between nodes (default: the preset's for this device kind).
      memory_budget_bytes: per-device budget; candidates above it are not chosen.
      hardware: calibrated constants; overrides the preset (links given above still
        replace its bandwidths).
      tokens_per_device: tokens each device trains per step (0 or None: compute is left
        out, so the ranking is by communication alone, and the table says so); with
        ``tensor_parallel``, each data-parallel rank (its ``T`` devices share them).
      base: other settings every candidate keeps (dtypes, prefetch, block size...);
        qgZ's options (``qgz_error_feedback``, ``qgz_signs``, ``qgz_hops``) go to the qgZ candidates
        only, and the plan never turns them on itself (module docstring).
      tie: candidates within this fraction of the fastest count as tied.
      configs: the candidates to rank instead of ``candidate_configs``' (e.g. only the
        configurations a benchmark measured); INT4-weight configs listed here are ranked
        (listing them is opting in).
      allow_int4_weights: also rank qwZ with INT4 weights (``weight_format="int4"``). Off
        by default: they halve INT8's weight bytes but cost accuracy on models whose
        weight blocks have no outliers (module docstring); turn it on once a convergence
        run of your model shows they train as well.
      tensor_parallel: tensor-parallel degrees to rank too, each with the model's shape on
        one rank (``{2: transformer_shape(..., tensor_parallel=2), ...}``; degree 1 is
        ``state_or_model``'s): a degree ``T`` dividing ``local`` is costed on a ``nodes x
        local / T`` data mesh, each data-parallel rank (``T`` devices) training
        ``tokens_per_device`` tokens, and ranked by step time per device's share of the
        tokens (``Candidate.cost``: ``T`` x its step). The chosen one is
        ``Plan.chosen.tensor_parallel``: build the mesh with ``make_mesh(nodes, local // T,
        model=T)``.
      lowered: a step of ``state_or_model`` (a ``TrainState``) lowered or compiled
        (``step.lower(state, batch)``, or its ``.compile()``): compiled here once if
        lowered, and its memory gives the state's activations per token (module
        docstring). None: the step a ``train_step`` recorded on the state, if any.
        ``tokens_per_device`` not given, memory is priced at that step's tokens.

    None means not given, for every argument that has a default. Anything else that is
    not what the argument takes (0 nodes, a negative bandwidth, a budget given as the
    string ``"70GB"``) raises ``ValueError`` or ``TypeError`` naming the argument, before
    any candidate is costed.
    """
    nodes, local = presets.check_count("nodes", nodes), presets.check_count("local", local)
    intra_gbps = _number("intra_gbps", intra_gbps, "Gbit/s per device inside a node",
                         "the hardware's")
    inter_gbps = _number("inter_gbps", inter_gbps, "Gbit/s per node between nodes",
                         "the hardware's")
    memory_budget_bytes = _number(
        "memory_budget_bytes", memory_budget_bytes,
        "bytes per device, e.g. memory_budget_bytes=70 * 2**30 for 70 GiB", "no budget")
    tokens_per_device = _number("tokens_per_device", tokens_per_device,
                                "tokens each device trains per step",
                                "compute left out", zero=True) or 0.0
    tie = _number("tie", tie, "a fraction of the fastest step time", f"{_TIE}", zero=True)
    tie = _TIE if tie is None else tie
    allow_int4_weights = False if allow_int4_weights is None else allow_int4_weights
    if not isinstance(allow_int4_weights, (bool, np.bool_)):
        raise TypeError(f"allow_int4_weights={allow_int4_weights!r} is a "
                        f"{type(allow_int4_weights).__name__}: give True (also rank INT4 "
                        "weights) or False")
    if hardware is not None and not isinstance(hardware, Hardware):
        raise TypeError(
            f"hardware={hardware!r} is a {type(hardware).__name__}: give a "
            "zeropp_jax.plan.cost_model.Hardware (e.g. zeropp_jax.plan.presets.h100(nodes)), "
            "or None for the preset of the devices jax sees")
    if base is not None and not isinstance(base, ZeroPPConfig):
        raise TypeError(f"base={base!r} is a {type(base).__name__}: give a ZeroPPConfig "
                        "(e.g. ZeroPPConfig(**settings)), or None")
    if configs is not None:
        configs = list(configs)
        if not configs:
            raise ValueError("configs is empty: give the ZeroPPConfigs to rank, or None for "
                             "every candidate")
        for c in configs:
            if not isinstance(c, ZeroPPConfig):
                raise TypeError(f"configs holds a {type(c).__name__}: give ZeroPPConfigs")
    shape = _shape_of(state_or_model)
    hw = _hardware(hardware, nodes, local, intra_gbps, inter_gbps)
    shape, backend, memory_tokens, activations, compiled = _activations(
        state_or_model, shape, lowered, tokens_per_device)
    shapes = _tensor_parallel_shapes(shape, tensor_parallel, hw.local)
    # The data axes each shape is priced on: a node's devices over the devices one
    # data-parallel rank spans (its tensor-parallel or expert slices: a state's own).
    data_local = {t: _data_local(s, hw.local) for t, s in shapes.items()}
    given = configs is not None
    per_degree = {t: list(configs) if given else candidate_configs(
        hw.nodes, data_local[t], base, allow_int4_weights=bool(allow_int4_weights))
        for t in shapes}

    memo: dict = {}  # traced transports, shared by every candidate of this call

    def costed(config: ZeroPPConfig, t: int = 1) -> Candidate:
        w = config_workload(config, shapes[t], MeshInfo(hw.nodes, data_local[t]),
                            memory_tokens, memo=memo, backend=backend)
        if memory_tokens != tokens_per_device:  # memory at the lowered step's tokens alone
            w = dataclasses.replace(w, flops_per_device=tokens_per_device
                                    * shapes[t].flops_per_token)
        p = predict_step(w, hw)
        # The compiled configuration at its own tokens is priced at its compiled bytes;
        # any other with MEMORY_MARGIN to spare.
        spare = 0.0 if compiled is None or (config, t, memory_tokens) == compiled else \
            MEMORY_MARGIN
        fits = (memory_budget_bytes is None
                or p.memory_bytes * (1 + spare) <= memory_budget_bytes)
        return Candidate(config, p, fits, w.cross_bytes_per_node / 1e6, t, spare)

    candidates = [costed(c, t) for t, cs in per_degree.items() for c in cs]
    if (not given and not any(c.fits for c in candidates) and hw.host is not None
            and not any(c.offload_optimizer for cs in per_degree.values() for c in cs)
            and len(shapes) == 1):
        # Nothing fits on the device: the same candidates with the optimizer state in
        # host memory, priced with the transfers over the host link; if that is not
        # enough either, with the primary shards there too.
        for offload in ({"offload_optimizer": True},
                        {"offload_optimizer": True, "offload_params": True}):
            candidates += [costed(dataclasses.replace(c, **offload)) for c in per_degree[1]]
            if any(c.fits for c in candidates):
                break
    candidates.sort(key=lambda c: c.cost)
    fitting = [c for c in candidates if c.fits]
    if not fitting:
        least = min(candidates, key=lambda c: c.memory_needed)
        margin = (f" ({least.prediction.memory_bytes:,.0f} predicted, {least.margin:.0%} to "
                  "spare: it is not the compiled configuration)" if least.margin else "")
        raise ValueError(
            f"no configuration fits memory_budget_bytes={memory_budget_bytes:,.0f}: the "
            f"smallest, {least.label}, needs {least.memory_needed:,.0f} bytes per "
            f"device{margin}. Raise the budget, add devices, or lower the per-device batch "
            "(activations)")
    best = fitting[0].cost
    tied = [c for c in fitting if c.cost <= best * (1 + tie)]
    chosen = min(tied, key=lambda c: (c.techniques, c.tensor_parallel, c.cost))
    why = (f"chose {chosen.label}: {chosen.prediction.step_s * 1e3:.2f} ms predicted"
           + (f", within {tie:.0%} of the fastest ({fitting[0].label}, "
              f"{fitting[0].prediction.step_s * 1e3:.2f} ms) "
              "with fewer techniques on" if chosen is not fitting[0] else ", the fastest")
           + ("" if memory_budget_bytes is None else
              f", under the budget of {memory_budget_bytes / 2**30:.2f} GiB per device")
           + ("" if tokens_per_device else
              "; no tokens_per_device given, so compute is not counted"))
    if activations:
        why += "\n" + activations
    if shape.expert_parallel > 1:
        e = shape.expert_parallel
        why += (f"\nexpert mesh (expert={e}): ZeRO's collectives and memory are priced on "
                f"the data axes ({hw.nodes} x {data_local[1]}); the expert groups' own "
                "collectives (the tokens' all-to-alls, the dense weights' gathers inside a "
                "group) are the same for every candidate and not priced, nor are the "
                "experts' flops (a token runs a few experts, not a device's slice): the step "
                "times leave them out")
    if chosen.tensor_parallel > 1:
        t = chosen.tensor_parallel
        why += (f"\ntensor parallel {t}: build the mesh with zpp.make_mesh({hw.nodes}, "
                f"{hw.local // t}, model={t}) and pass the model's logical_axis_rules")
    if _int4(chosen.config):
        why += ("\nINT4 weights chosen: they lose accuracy where INT8 weights do not "
                "(benchmarks/int4_weights.py); check a convergence run of this model against "
                "zero3 before training on them")
    elif not given and hw.nodes > 1 and not allow_int4_weights:
        why += ("\nINT4 weights (qwz-int4) not ranked: they lose accuracy where INT8 "
                "weights do not; allow_int4_weights=True ranks them too")
    return Plan(tuple(candidates), chosen, hw, shape, tokens_per_device, memory_budget_bytes,
                why, activations)


def auto_config(state_or_model: Any, *, nodes: int | None = None, local: int | None = None,
                intra_gbps: float | None = None, inter_gbps: float | None = None,
                memory_budget_bytes: float | None = None, verbose: bool = True,
                **kwargs: Any) -> ZeroPPConfig:
    """The fastest configuration for a model on a cluster, by the cost model
    (``zpp.auto_config``).

    Ranks ZeRO-3 and the ZeRO++ combinations (qwZ with INT8 weights, hpZ over k-node
    groups, qgZ; INT4 weights too with ``allow_int4_weights=True``: they cost accuracy on
    some models) by predicted step time on ``nodes`` x ``local`` devices (default: jax's
    processes and local devices) with links of ``intra_gbps`` (per device, inside a node)
    and ``inter_gbps`` (per node, between nodes) Gbit/s, keeps those under
    ``memory_budget_bytes`` per device (a number, e.g. ``70 * 2**30``), prints the table
    (unless ``verbose=False``) and returns the chosen ``ZeroPPConfig``. Other keyword
    arguments go to ``plan`` (``hardware``, ``tokens_per_device``, ``base``, ``tie``,
    ``configs``, ``allow_int4_weights``, ``tensor_parallel``: degrees to rank too, with the
    model's shape on one rank at each; the chosen degree is printed with the mesh to build;
    ``lowered``: a step of the ``TrainState`` lowered, ``step.lower(state, batch)``, whose
    compiled memory gives the activations, module docstring). For a ``TrainState``, lower
    a step first: without one its activations are not counted (the table says so). None
    means not given; 0 nodes, a negative bandwidth or a budget given as a string raise
    naming the argument. qgZ's error
    feedback and per-step signs are never chosen here: a ``base`` with them on gives them
    to the qgZ candidates, priced with the feedback's memory.
    """
    p = plan(state_or_model, nodes=nodes, local=local, intra_gbps=intra_gbps,
             inter_gbps=inter_gbps, memory_budget_bytes=memory_budget_bytes, **kwargs)
    if verbose:
        print(p.table())
    return p.chosen.config


def _activations(x: Any, shape: ModelShape, lowered: Any, tokens_per_device: float
                 ) -> tuple[ModelShape, str, float, str, tuple | None]:
    """``(shape, backend, tokens, note, compiled)`` the candidates' memory is priced
    with: for a
    ``TrainState`` with a lowered step (``lowered``, else the one recorded on it), the
    shape with the activations per token the compiled step holds (``measured``), the
    backend it was compiled for and ``tokens_per_device`` (that step's own if not given);
    else ``shape`` as it is, on a GPU, at ``tokens_per_device``. ``note``: the plan's line
    saying where the activations came from ("" for a ``ModelShape`` or params).
    ``compiled``: ``(config, 1, tokens)`` of the compiled step (its prediction is its
    compiled bytes), or None."""
    is_state = hasattr(x, "engine")
    if lowered is not None and not is_state:
        raise TypeError(f"lowered= needs a TrainState to plan for (the state the step was "
                        f"lowered with), got {type(x).__name__}: pass plan(state, "
                        "lowered=step.lower(state, batch))")
    step = lowered if lowered is not None else (step_of_state(x) if is_state else None)
    if step is None:
        note = ("activations not counted: no step of this state has been lowered; pass "
                "lowered=step.lower(state, batch) to count them" if is_state else "")
        return shape, "gpu", tokens_per_device, note, None
    engine = x.engine
    measured = compiled_memory(step, x)
    shape = calibrated_shape(shape, engine.config, engine.info, measured)
    seq = f", sequences of {measured.sequence}" if measured.sequence else ""
    note = (f"activations measured: {shape.activation_bytes_per_token:,.0f} bytes per token "
            f"(the compiled step of this state: {measured.total / 2**20:,.2f} MiB per device "
            f"at {measured.tokens_per_device:g} tokens{seq}, {measured.backend.upper()}); "
            f"other configurations and token counts fit the budget only with "
            f"{MEMORY_MARGIN:.0%} to spare")
    if tokens_per_device and tokens_per_device != measured.tokens_per_device:
        note += (f"\nmemory at {tokens_per_device:g} tokens scaled from the step's "
                 f"{measured.tokens_per_device:g}: activations scale with the tokens only at "
                 f"the same sequence length{seq and ' (' + seq[2:] + ')'}; lower a step at "
                 "the sequence length you will train at")
    return (shape, measured.backend, tokens_per_device or measured.tokens_per_device, note,
            (engine.config, 1, measured.tokens_per_device))


def _tensor_parallel_shapes(shape: ModelShape, given: Mapping[int, ModelShape] | None,
                            local: int) -> dict[int, ModelShape]:
    """Degree -> one rank's shape: ``{1: shape}`` plus the ``given`` degrees that divide
    ``local`` (checked: positive ints mapped to ``ModelShape``s of that degree)."""
    out = {1: shape}
    if given is None:
        return out
    if not isinstance(given, Mapping):
        raise TypeError(f"tensor_parallel={given!r}: give a dict {{degree: ModelShape}} "
                        "(transformer_shape(..., tensor_parallel=degree)), or None")
    for t, s in given.items():
        if isinstance(t, bool) or not isinstance(t, int) or t < 1:
            raise ValueError(f"tensor_parallel degree {t!r} is not a positive int")
        if not isinstance(s, ModelShape) or s.tensor_parallel != t:
            raise ValueError(f"tensor_parallel[{t}] must be one rank's ModelShape of degree "
                             f"{t} (transformer_shape(..., tensor_parallel={t}))")
        if t > 1 and local % t == 0:
            out[t] = s
    return out


def _data_local(shape: ModelShape, local: int) -> int:
    """Data-parallel devices per node for ``shape`` on nodes of ``local`` devices: ``local``
    over the devices one rank spans (its tensor-parallel or expert slices). Raises naming
    the fix when they do not divide it."""
    per_rank = shape.tensor_parallel * shape.expert_parallel
    if local % per_rank:
        what = ("tensor-parallel" if shape.tensor_parallel > 1 else "expert") + " degree"
        raise ValueError(f"the model's {what} {per_rank} does not divide local={local} "
                         "devices per node: give local as every device of a node")
    return local // per_rank


def _int4(config: ZeroPPConfig) -> bool:
    return config.qwz and config.weight_format == "int4"


def _shape_of(x: Any) -> ModelShape:
    if isinstance(x, ModelShape):
        return x
    if hasattr(x, "engine"):
        return shape_of_state(x)
    if isinstance(x, dict) or hasattr(x, "items"):
        return shape_of_params(x)
    raise TypeError(
        f"auto_config takes a TrainState, a params tree or a plan.workload.ModelShape, "
        f"got {type(x).__name__}. For a Flax module, pass its params "
        "(jax.eval_shape(model.init, key, batch)['params'] costs no memory)")


def _number(name: str, value: Any, what: str, default: str, *,
            zero: bool = False) -> float | None:
    """A number a user gave: None (not given: ``default``), else a finite number > 0
    (>= 0 with ``zero``), as a float. A bool is refused although Python counts it a
    number."""
    if value is None:
        return None
    least = ">= 0" if zero else "> 0"
    fix = f"give a number {least} ({what}), or None for {default}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}: {fix}")
    if not (math.isfinite(value) and (value >= 0 if zero else value > 0)):
        raise ValueError(f"{name}={value!r} is not a finite number {least}: {fix}")
    return float(value)


def _hardware(hardware: Hardware | None, nodes: int | None, local: int | None,
              intra_gbps: float | None, inter_gbps: float | None) -> Hardware:
    if hardware is None:
        hardware = presets.for_devices(nodes, local)
    # None is "not given" (0 was already refused): keep the hardware's own.
    hw = hardware.with_mesh(hardware.nodes if nodes is None else nodes,
                            hardware.local if local is None else local)
    if intra_gbps is not None:
        hw = dataclasses.replace(hw, intra=dataclasses.replace(
            hw.intra, bytes_per_s=intra_gbps * 1e9 / 8))
    if inter_gbps is not None:
        hw = dataclasses.replace(hw, inter=dataclasses.replace(
            hw.inter, bytes_per_s=inter_gbps * 1e9 / 8))
    return hw


__all__ = ["MEMORY_MARGIN", "Candidate", "Plan", "auto_config", "candidate_configs", "plan"]
