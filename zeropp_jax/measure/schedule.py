"""How much of a step's communication its compiled schedule hides behind compute.

Reads a scheduled HLO module (``compiled.as_text()`` of a GPU program: XLA prints each
computation's instructions in the order its scheduler chose, and splits every collective it
runs asynchronously into a ``-start`` and a ``-done``) and replays it on two streams, as the
GPU runs it:

* the compute stream runs the instructions in order, each for its roofline time
  (``Roofline``: its matmul FLOPs at the peak rate of its operand type, or the bytes it
  reads and writes at the memory bandwidth, whichever is longer);
* the communication stream runs the collectives one at a time in the order they start, each
  for its wire time (``Links``: the bytes it moves inside a node over the per-device link,
  the bytes it moves across nodes over the node's network, as ``zeropp_jax.comm.wire``
  counts them);
* a ``-done`` waits for its collective; a synchronous collective (``is_sync``, or one XLA
  did not split) stops the compute stream for all of its wire time.

A collective's exposed time is how long the compute stream waited for it; the rest of its
wire time is hidden. A ``while`` loop (a scanned stack of layers) is replayed for two
iterations, so a collective the scheduler started in one iteration for the next (pipelined)
is found, and the second, steady iteration stands for all of them.

The prices are a roofline, not a profile: kernels run at peak here, so the compute that can
hide a collective is, if anything, underestimated, and the hidden fraction with it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Mapping

from zeropp_jax.comm.wire import count_bytes
from zeropp_jax.core import scopes
from zeropp_jax.measure.comm_report import ITEMSIZE, KINDS, hlo_collective, hlo_types

# Instructions that move no data through a kernel of their own.
_FREE = frozenset({
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "add-dependency", "domain",
    # Host transfers and point-to-point ops run on streams of their own.
    "copy-start", "copy-done", "send", "send-done", "recv", "recv-done",
})
# Ops whose output is a part of their first operand's elements.
_SLICES = frozenset({"slice", "dynamic-slice", "gather"})
# Root ops that update their first operand in place: the operand index of the update.
_IN_PLACE = {"dynamic-update-slice": 1, "scatter": 2}
# Ops whose output element i needs only element i of each same-shaped operand.
_ONE_TO_ONE = frozenset({
    "convert", "bitcast", "bitcast-convert", "reshape", "transpose", "copy", "negate", "abs",
    "not", "is-finite", "exponential", "exponential-minus-one", "log", "log-plus-one", "sqrt",
    "rsqrt", "cbrt", "tanh", "logistic", "sign", "floor", "ceil", "round-nearest-even",
    "round-nearest-afz", "sine", "cosine", "add", "subtract", "multiply", "divide",
    "maximum", "minimum", "power", "remainder", "and", "or", "xor", "compare", "select",
    "clamp", "atan2", "shift-left", "shift-right-logical", "shift-right-arithmetic",
    "stochastic-convert", "erf", "real", "imag", "popcnt", "count-leading-zeros"})
# A fusion's kernel: run in line, or asynchronously (``fusion-start``; its ``fusion-done``
# only waits, so costs nothing here).
_FUSIONS = frozenset({"fusion", "fusion-start"})


@dataclasses.dataclass(frozen=True)
class Instruction:
    """One HLO instruction: ``%name = type opcode(operands), attributes``."""

    name: str
    type: str
    opcode: str
    operands: tuple[str, ...]
    line: str

    @property
    def nbytes(self) -> float:
        return _bytes_of(hlo_types(self.type))

    def attr(self, key: str) -> str | None:
        """The computation an attribute names (``calls=%f`` -> ``"f"``)."""
        m = re.search(rf"\b{key}=%([\w.\-]+)", self.line)
        return m.group(1) if m else None


def _bytes_of(types: list[tuple[str, tuple[int, ...]]]) -> float:
    """Bytes of the arrays ``hlo_types`` lists."""
    return float(sum(ITEMSIZE.get(t, 4) * math.prod(s) for t, s in types))


def _fused(comps: Mapping[str, tuple[Instruction, ...]], ins: Instruction
           ) -> tuple[Instruction, ...]:
    """The body a fusion kernel runs (in line or asynchronously); () for any other op."""
    return comps.get(ins.attr("calls") or "", ()) if ins.opcode in _FUSIONS else ()


def _balanced(text: str, i: int) -> int:
    """Index just past the bracket group opening at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] in "([{":
            depth += 1
        elif text[j] in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced brackets in {text[:120]!r}")


def parse_instruction(line: str) -> Instruction | None:
    """The instruction one line of HLO text defines, or None for any other line."""
    m = re.match(r"\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*", line)
    if not m:
        return None
    i = m.end()
    end = _balanced(line, i) if line[i] == "(" else line.index(" ", i)
    type_text = line[i:end]
    op = re.match(r"\s*([\w\-]+)\(", line[end:])
    if not op:
        return None
    args_at = end + op.end() - 1
    args = line[args_at + 1:_balanced(line, args_at) - 1]
    operands = tuple(re.findall(r"%([\w.\-]+)", args))
    return Instruction(m.group(1), type_text, op.group(1), operands, line)


def parse_module(text: str) -> tuple[dict[str, tuple[Instruction, ...]], str]:
    """``(computations, entry)``: each computation's instructions in printed (for a
    scheduled module: execution) order, by name, and the entry computation's name."""
    comps: dict[str, tuple[Instruction, ...]] = {}
    entry, name, body = "", None, []
    for line in text.splitlines():
        head = re.match(r"(ENTRY\s+)?%([\w.\-]+)\s.*\{\s*$", line)
        if head and not line.startswith(" "):
            name, body = head.group(2), []
            if head.group(1):
                entry = name
        elif line.startswith("}") and name is not None:
            comps[name], name = tuple(body), None
        elif name is not None:
            ins = parse_instruction(line)
            if ins is not None:
                body.append(ins)
    if not entry:
        raise ValueError("no ENTRY computation: pass the text of a compiled HLO module")
    return comps, entry


@dataclasses.dataclass(frozen=True)
class Roofline:
    """One device's prices: matmul FLOP/s by operand type (``"bf16"``, ``"f32"``, ...;
    others take ``matmul_flops_per_s["bf16"]``) and memory bytes/s. ``class_factors``
    (by ``KERNEL_CLASSES`` name, empty by default) multiplies each kernel's roofline time
    by its class's factor: measured over priced time on a real GPU (``make
    gpu-calibrate``), for a step priced as that GPU ran its kernels."""

    matmul_flops_per_s: Mapping[str, float]
    memory_bytes_per_s: float
    class_factors: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def flops_rate(self, dtype: str) -> float:
        return self.matmul_flops_per_s.get(dtype, self.matmul_flops_per_s["bf16"])


@dataclasses.dataclass(frozen=True)
class Links:
    """The wire: ``nodes`` x ``local`` devices; ``intra_bytes_per_s`` per device inside a
    node, ``inter_bytes_per_s`` per node across nodes (all its NICs), ``latency_s`` a fixed
    cost of every collective."""

    nodes: int
    local: int
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    latency_s: float = 0.0

    def wire_s(self, kind: str, nbytes: int, groups: Any) -> tuple[float, bool]:
        """``(seconds, spans_nodes)`` of one collective (``comm.wire.count_bytes``)."""
        intra, cross = count_bytes(kind, nbytes, groups, self.local)
        seconds = (intra / (self.nodes * self.local) / self.intra_bytes_per_s
                   + cross / self.nodes / self.inter_bytes_per_s + self.latency_s)
        return seconds, cross > 0


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of the schedule.

    Attributes:
      name: its (start) instruction; kind: one of ``comm_report.KINDS``.
      op_name: the JAX name stack it came from (``.../layers/all_gather``).
      bytes: result bytes per device; spans_nodes: whether any group crosses a node.
      runs: how many times a step runs it (loop trip counts).
      wire_s, exposed_s: per run; the compute stream waited ``exposed_s`` of ``wire_s``.
      sync: XLA runs it synchronously (nothing can hide it).
    """

    name: str
    kind: str
    op_name: str
    bytes: int
    spans_nodes: bool
    runs: int
    wire_s: float
    exposed_s: float
    sync: bool

    @property
    def hidden_s(self) -> float:
        return self.wire_s - self.exposed_s


# Name-stack segments that are transformations or the library's scopes, not module paths.
_WRAPPERS = re.compile(r"^(jit\(|shard_map$|jvp\(|transpose\(|\(|while$|body$|closed_call$|"
                       rf"checkpoint$|rematted_computation$|{scopes.REDUCED}$|{scopes.OWN}$)")


def unit_of(op_name: str) -> tuple[str, str]:
    """``(unit, role)`` of a collective from its JAX name stack (``op_name``).

    ``unit``: the module path the collective ran for (``layers_3``, ``embed``; a scanned
    stack's ``layers`` for all its layers; ``<rest>`` where the name stack has no module,
    the rest unit riding in a bucket), several joined by ``+`` where XLA combined
    collectives. ``role``: ``gather`` (forward), ``regather`` (backward), ``gradient``
    (the reduction making a gradient shard) or ``other`` (the step's own: loss and norms).
    """
    units, roles = [], []
    # XLA names a combined collective "<common prefix>/(<part>:<part>...)".
    combined = re.fullmatch(r"(.*?/)?\((.*)\)", op_name)
    prefix, inner = (combined.group(1) or "", combined.group(2)) if combined else ("", op_name)
    for part in (prefix + p for p in inner.split(":")):
        segments = [s for s in part.split("/") if s]
        path = [s for s in segments[:-1] if not _WRAPPERS.match(s)]
        op = segments[-1] if segments else ""
        role = ("gradient" if scopes.REDUCED in part
                else "other" if (scopes.OWN in part or op.startswith(("psum", "pm"))
                                 or (not path and "jvp(" not in part))
                else "regather" if "transpose(" in part else "gather")
        unit = "/".join(path) or ("<rest>" if role != "other" else "")
        if unit not in units:
            units.append(unit)
        if role not in roles:
            roles.append(role)
    return "+".join(units), "+".join(roles)


@dataclasses.dataclass(frozen=True)
class UnitTraffic:
    """One unit's collectives of one role, summed over a step (``ScheduleReport.by_unit``):
    ``runs``, their wire and exposed seconds in all (``wire_s``, ``exposed_s``)."""

    unit: str
    role: str
    spans_nodes: bool
    runs: int
    wire_s: float
    exposed_s: float


@dataclasses.dataclass(frozen=True)
class ScheduleReport:
    """A step's replayed schedule: ``step_s`` (both streams), ``compute_s`` (the compute
    stream's work alone) and every collective run."""

    collectives: tuple[ScheduledCollective, ...]
    compute_s: float
    step_s: float

    def wire_s(self, spans_nodes: bool | None = None) -> float:
        return sum(c.wire_s * c.runs for c in self._of(spans_nodes))

    def exposed_s(self, spans_nodes: bool | None = None) -> float:
        return sum(c.exposed_s * c.runs for c in self._of(spans_nodes))

    def hidden_fraction(self, spans_nodes: bool | None = None) -> float | None:
        """Hidden share of the wire time (of the collectives that cross nodes, stay inside
        them, or all: ``spans_nodes`` True, False, None); None if there is none."""
        wire = self.wire_s(spans_nodes)
        return None if wire == 0 else 1.0 - self.exposed_s(spans_nodes) / wire

    def by_unit(self, spans_nodes: bool | None = None) -> list[UnitTraffic]:
        """The collectives summed per unit, role and whether they cross nodes
        (``unit_of``), in the order the step first runs them."""
        sums: dict[tuple[str, str, bool], list[float]] = {}
        for c in self._of(spans_nodes):
            total = sums.setdefault((*unit_of(c.op_name), c.spans_nodes), [0, 0.0, 0.0])
            total[0] += c.runs
            total[1] += c.wire_s * c.runs
            total[2] += c.exposed_s * c.runs
        return [UnitTraffic(u, r, x, int(n), w, e) for (u, r, x), (n, w, e) in sums.items()]

    def _of(self, spans_nodes: bool | None) -> list[ScheduledCollective]:
        return [c for c in self.collectives
                if spans_nodes is None or c.spans_nodes == spans_nodes]


class _Replay:
    """Replays the computations of one module (see the module docstring)."""

    def __init__(self, comps: Mapping[str, tuple[Instruction, ...]], roofline: Roofline,
                 links: Links):
        self.comps, self.roofline, self.links = comps, roofline, links
        self.memo: dict[str, tuple[float, float, list[ScheduledCollective]]] = {}
        self.sizes = {i.name: i.nbytes for body in comps.values() for i in body}
        self.types = {i.name: i.type for body in comps.values() for i in body}

    def run(self, name: str, iterations: int = 1
            ) -> tuple[float, float, list[ScheduledCollective]]:
        """``(seconds, compute seconds, collectives)`` of the last of ``iterations`` runs
        of computation ``name`` back to back (collectives may stay in flight between)."""
        key = f"{name}/{iterations}"
        if key in self.memo:
            return self.memo[key]
        t = comm_free = 0.0
        in_flight: dict[str, tuple[float, float, Any]] = {}
        for it in range(iterations):
            last = it == iterations - 1
            begin, compute, found = t, 0.0, []
            for ins in self.comps[name]:
                coll = hlo_collective(ins.line, self.links.nodes * self.links.local)
                kind = ins.opcode.removesuffix("-start")
                if coll is not None and kind in KINDS:
                    wire, spans = self.links.wire_s(coll.kind, coll.bytes, coll.groups)
                    start = max(t, comm_free)
                    comm_free = start + wire
                    sync = (not ins.opcode.endswith("-start")
                            or '"is_sync":true' in ins.line)
                    info = (coll, spans, _op_name(ins.line), sync)
                    if sync:
                        found.append(self._record(ins.name, info, wire, comm_free - t))
                        t = comm_free
                    else:
                        in_flight[ins.name] = (comm_free, wire, info)
                elif ins.opcode.endswith("-done") and ins.operands and \
                        ins.operands[0] in in_flight:
                    finish, wire, info = in_flight.pop(ins.operands[0])
                    stall = max(0.0, finish - t)
                    found.append(self._record(ins.operands[0], info, wire, stall))
                    t += stall
                else:
                    seconds, work, inner = self._instruction(ins)
                    t, compute = t + seconds, compute + work
                    found.extend(inner)
            if last:
                self.memo[key] = (t - begin, compute, found)
        return self.memo[key]

    @staticmethod
    def _record(name: str, info: Any, wire: float, exposed: float) -> ScheduledCollective:
        coll, spans, op_name, sync = info
        return ScheduledCollective(name, coll.kind, op_name, coll.bytes, spans, 1, wire,
                                   min(wire, exposed), sync)

    def _instruction(self, ins: Instruction
                     ) -> tuple[float, float, list[ScheduledCollective]]:
        """``(seconds, compute seconds, collectives inside)`` of one instruction."""
        if ins.opcode == "while":
            n = _trip_count(ins)
            seconds, compute, inner = self.run(ins.attr("body"), min(n, 2))
            cond = self._priced(ins.attr("condition"))
            return (n * (seconds + cond), n * (compute + cond),
                    [dataclasses.replace(c, runs=c.runs * n) for c in inner])
        if _called(ins):
            return self.run(_called(ins))
        if ins.opcode == "conditional":
            runs = [self.run(b) for b in _branches(ins)]
            return max(runs, key=lambda r: r[0])
        seconds = self._price(ins)
        return seconds, seconds, []

    def _priced(self, name: str | None) -> float:
        return 0.0 if name is None else self.run(name)[0]

    def _price(self, ins: Instruction) -> float:
        if ins.opcode in _FREE or ins.opcode.endswith("-done"):
            return 0.0
        operand_bytes = [self.sizes.get(o, 0.0) for o in ins.operands]
        fused = _fused(self.comps, ins)
        if ins.opcode in _FUSIONS:
            seconds = self._matmul_s(fused)
            nbytes = _fusion_bytes(ins, fused, operand_bytes)
        else:
            seconds = self._matmul_s((ins,)) + self._attention_s(ins) + self._gemm_s(ins)
            nbytes = ins.nbytes + sum(operand_bytes)
        seconds = max(seconds, nbytes / self.roofline.memory_bytes_per_s)
        if self.roofline.class_factors and seconds:
            seconds *= self.roofline.class_factors.get(_kernel_class(ins, fused), 1.0)
        return seconds

    def _gemm_s(self, ins: Instruction) -> float:
        """Seconds of a cuBLAS matmul call (``__cublas$gemm``, ``__cublas$lt$matmul``: what
        XLA emits for a dot it does not fuse into a Triton kernel), priced as a dot:
        ``2 * output elements * contracted size`` FLOPs at the rate of its left operand's
        type; 0 for any other instruction."""
        if ins.opcode != "custom-call" or "__cublas$" not in ins.line or not ins.operands:
            return 0.0
        dims = re.search(r'"lhs_contracting_dimensions":\[([^\]]*)\]', ins.line.replace(" ", ""))
        lhs = hlo_types(self.types.get(ins.operands[0], ""))
        if not dims or not lhs:
            return 0.0
        dtype, shape = lhs[0]
        contract = math.prod(shape[int(d)] for d in re.findall(r"\d+", dims.group(1)))
        out = math.prod(hlo_types(ins.type)[0][1])  # (result, workspace)
        return 2.0 * out * contract / self.roofline.flops_rate(dtype)

    def _attention_s(self, ins: Instruction) -> float:
        """Seconds of a cuDNN fused attention call (``fused_attention_flops``) at the
        peak rate of its output's type; 0 for any other instruction."""
        flops = fused_attention_flops(ins)
        if not flops:
            return 0.0
        return flops / self.roofline.flops_rate(hlo_types(ins.type)[0][0])

    def _matmul_s(self, body: tuple[Instruction, ...]) -> float:
        """Seconds of the dots in ``body`` (and in computations its fusions call) at the
        peak rate of their left operand's type: ``2 * output elements * contracted size``
        FLOPs each."""
        shapes = {i.name: hlo_types(i.type) for i in body}
        seconds = 0.0
        for ins in body:
            if ins.opcode == "fusion" and ins.attr("calls"):
                seconds += self._matmul_s(self.comps.get(ins.attr("calls"), ()))
            lhs = shapes.get(ins.operands[0]) if ins.operands else None
            dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.line)
            if ins.opcode != "dot" or not lhs or not dims:
                continue
            dtype, lhs_shape = lhs[0]
            contract = math.prod(lhs_shape[int(d)] for d in dims.group(1).split(",") if d)
            out = sum(math.prod(s) for _, s in hlo_types(ins.type))
            seconds += 2.0 * out * contract / self.roofline.flops_rate(dtype)
        return seconds


_FMHA = re.compile(r'custom_call_target="__cudnn\$fmha(\w*)"')


def fused_attention_flops(ins: Instruction) -> float:
    """Matmul FLOPs of a cuDNN fused attention call (``__cudnn$fmha...``; 0 for any other
    instruction), which the roofline prices as matmuls, as it does a flash attention's:
    over scores ``[B, H, Sq, Sk]`` (its ``intermediate_tensor_shape``) and head dimensions
    ``D`` (queries and keys) and ``Dv`` (values), the forward runs two products,
    ``2 B H Sq Sk (D + Dv)``; the backward (``...Backward``) five, the scores recomputed
    and the gradients of the probabilities, values, queries and keys,
    ``2 B H Sq Sk (3 D + 2 Dv)``. A causal mask halves both: the kernel skips the blocks
    above the diagonal."""
    target = _FMHA.search(ins.line)
    if target is None:
        return 0.0
    config = ins.line.replace(" ", "")
    scores = re.search(r'"intermediate_tensor_shape":\{[^{}]*?"dimensions":\[([^\]]*)\]',
                       config)
    if scores is None:
        return 0.0
    b, h, sq, sk = (int(x) for x in re.findall(r"\d+", scores.group(1)))
    outs = [shape for _, shape in hlo_types(ins.type) if shape]
    backward = "Backward" in target.group(1)
    # Forward: (out [B, H, Sq, Dv], ...); backward: (dq [.., D], dk [.., D], dv [.., Dv], ...).
    d, dv = (outs[0][-1], outs[2][-1]) if backward else (None, outs[0][-1])
    if d is None:
        dims = re.search(r"operand_layout_constraints=\{\w+\[([\d,]+)\]", ins.line)
        d = int(dims.group(1).split(",")[-1]) if dims else dv
    flops = 2.0 * b * h * sq * sk * ((3 * d + 2 * dv) if backward else (d + dv))
    causal = re.search(r'"mask_type":"\w*CAUSAL', config)
    return flops / 2 if causal else flops


def _trip_count(ins: Instruction) -> int:
    """A ``while``'s known trip count (1 if XLA did not record one)."""
    trips = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.line)
    return int(trips.group(1)) if trips else 1


def _called(ins: Instruction) -> str | None:
    """The computation a ``call`` or ``async-start`` runs, else None."""
    if ins.opcode not in ("call", "async-start"):
        return None
    return ins.attr("to_apply" if ins.opcode == "call" else "calls")


def _branches(ins: Instruction) -> list[str]:
    """A ``conditional``'s branch computations."""
    return re.findall(r"%([\w.\-]+)", re.search(
        r"branch_computations=\{([^}]*)\}", ins.line).group(1))


def _op_name(line: str) -> str:
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else ""


def _output_bytes(ins: Instruction) -> float:
    """Bytes an instruction writes. An asynchronous fusion (``fusion-start``, which XLA's
    GPU compiler makes of a loop's slices and in-place updates, run on a stream of their
    own) is typed ``((operands...), output, u32[] context)``: its output alone."""
    if ins.opcode != "fusion-start":
        return ins.nbytes
    types = hlo_types(ins.type)[len(ins.operands):]
    if types and types[-1] == ("u32", ()):
        types = types[:-1]
    return _bytes_of(types)


def _fusion_bytes(ins: Instruction, fused: tuple[Instruction, ...],
                  operand_bytes: list[float]) -> float:
    """Bytes a fusion reads and writes: an operand counts the share of its elements the
    outputs need (``_demanded``: a sliced operand its slices); an output updated in place
    (``dynamic-update-slice`` or ``scatter`` into an operand) counts the update."""
    if not fused:
        return _output_bytes(ins) + sum(operand_bytes)
    params: dict[str, int] = {}
    for i in fused:
        if i.opcode == "parameter":
            params[i.name] = int(re.search(r"parameter\((\d+)\)", i.line).group(1))
    users: dict[str, list[Instruction]] = {}
    for i in fused:
        for o in i.operands:
            users.setdefault(o, []).append(i)
    read = list(operand_bytes)
    written = _output_bytes(ins)
    by_name = {i.name: i for i in fused}
    root = next((i for i in fused if i.line.lstrip().startswith("ROOT")), fused[-1])
    roots = [by_name.get(o) for o in root.operands] if root.opcode == "tuple" else [root]
    for r in roots:
        at = _IN_PLACE.get(r.opcode) if r is not None else None
        if at is not None and len(r.operands) > at \
                and params.get(r.operands[0], len(read)) < len(read):
            update = by_name.get(r.operands[at])
            written += (0.0 if update is None else update.nbytes) - r.nbytes
            read[params[r.operands[0]]] = 0.0
    demand = _demanded(fused, users, root)
    for name, k in params.items():
        if k < len(read):
            read[k] = min(read[k], demand.get(name, 1.0) * read[k])
    return max(written, 0.0) + sum(read)


def _elements(ins: Instruction) -> int:
    return sum(math.prod(s) for _, s in hlo_types(ins.type))


def _demanded(fused: tuple[Instruction, ...], users: Mapping[str, list[Instruction]],
              root: Instruction) -> dict[str, float]:
    """The share of each fused instruction's elements the fusion's outputs need (1 at the
    root), walked back from the root: a slice of ``x`` needs its own elements of ``x``;
    an op mapping elements one to one (elementwise, convert, bitcast, reshape, transpose,
    copy, select) or in equal disjoint groups (a reduce) passes its share on; any other
    use (a dot, a broadcast, a concatenate, an in-place update, ...) needs all of ``x``.
    Shares from several uses add up, at most 1. XLA's GPU kernels compute only the
    elements an output needs, so a fused operand that is converted and then sliced reads
    its slice, not the whole array."""
    demand: dict[str, float] = {root.name: 1.0}
    for i in reversed(fused):
        if i.name == root.name:
            continue
        need = 0.0
        for u in users.get(i.name, ()):
            share = 1.0 if u.opcode == "tuple" else demand.get(u.name, 0.0)
            if u.opcode in _SLICES and u.operands and u.operands[0] == i.name:
                need += share * _elements(u) / max(_elements(i), 1)
            elif u.opcode in _ONE_TO_ONE or (
                    u.opcode == "reduce" and u.operands and u.operands[0] == i.name):
                need += share if u.opcode == "reduce" or _elements(u) == _elements(i) else 1.0
            else:
                need += 1.0
            if need >= 1.0:
                break
        demand[i.name] = min(need, 1.0)
    return demand


# Kernel classes of ``compute_by_class``, in the order a kernel is tested against them.
KERNEL_CLASSES = ("quantize/dequantize/Hadamard", "optimizer and bookkeeping", "attention",
                  "matmul", "copies and layout", "elementwise")
_QUANT_NAMES = re.compile(r"quantiz|hadamard|rotate|reorder|pack_rows|unpack_rows")
_LAYOUT = frozenset({"copy", "transpose", "concatenate", "dynamic-update-slice",
                     "dynamic-slice", "slice", "pad", "gather", "scatter", "reshape",
                     "broadcast", "iota", "reverse"})
# Attention by name: a ``jax.named_scope("attention")``, or the einsums of
# ``jax.nn.dot_product_attention``'s XLA implementation (scores and weighted values).
_ATTENTION_NAMES = re.compile(r"/attention/|BTNH,BSNH->BNTS|BNTS,BSNH->BTNH")


def _kernel_class(ins: Instruction, fused: tuple[Instruction, ...]) -> str:
    """One kernel's class (``KERNEL_CLASSES``): by the JAX name stack it came from
    (qgZ's and qwZ's quantization kernels; the engine's own scope, ``scopes.OWN``, or a
    ``named_scope("optimizer")``: the update, norms and checks; ``_ATTENTION_NAMES``), by a
    dot inside it (matmul), by its fused root or opcode moving data only (copies and
    layout), else elementwise. A kernel fusing parts of several classes takes the first."""
    names = [_op_name(ins.line)] + [_op_name(i.line) for i in fused]
    if any(_QUANT_NAMES.search(n) for n in names):
        return KERNEL_CLASSES[0]
    if any(scopes.OWN in n or "/optimizer/" in n for n in names):
        return KERNEL_CLASSES[1]
    if any(_ATTENTION_NAMES.search(n) for n in names) or fused_attention_flops(ins):
        return KERNEL_CLASSES[2]
    if any(i.opcode in ("dot", "convolution") for i in (ins, *fused)) or (
            ins.opcode == "custom-call" and re.search(r"gemm|cublas|matmul", ins.line)):
        return KERNEL_CLASSES[3]
    body = [i for i in fused if i.opcode not in ("parameter", "tuple", "bitcast",
                                                 "get-tuple-element", "constant")]
    moves = body or [ins]
    if all(i.opcode in _LAYOUT for i in moves):
        return KERNEL_CLASSES[4]
    return KERNEL_CLASSES[5]


def compute_by_instruction(text: str, roofline: Roofline
                           ) -> dict[str, tuple[str, float, int]]:
    """The compute stream's kernels of one step, by HLO instruction name: ``(class, seconds,
    runs)``, each priced as the replay prices it (roofline; ``seconds`` over all ``runs``,
    loops counted by their trip counts), its class by ``_kernel_class`` (``KERNEL_CLASSES``),
    collectives left out, a conditional's costliest branch alone (as the replay counts it).
    A GPU profile's kernels carry the same names (their ``hlo_op``), so the prices can be
    checked one kernel at a time."""
    comps, entry = parse_module(text)
    replay = _Replay(comps, roofline, Links(1, 1, 1.0, 1.0))
    memo: dict[str, dict[str, tuple[str, float, int]]] = {}

    def walk(name: str) -> dict[str, tuple[str, float, int]]:
        if name in memo:
            return memo[name]
        out: dict[str, tuple[str, float, int]] = {}

        def add(part: dict[str, tuple[str, float, int]], times: int = 1) -> None:
            for k, (cls, seconds, runs) in part.items():
                _, s0, r0 = out.get(k, (cls, 0.0, 0))
                out[k] = (cls, s0 + times * seconds, r0 + times * runs)

        for ins in comps.get(name, ()):
            kind = ins.opcode.removesuffix("-start")
            if kind in KINDS or ins.opcode.endswith("-done"):
                continue
            if ins.opcode == "while":
                add(walk(ins.attr("body")), _trip_count(ins))
                if ins.attr("condition"):
                    add(walk(ins.attr("condition")), _trip_count(ins))
            elif _called(ins):
                add(walk(_called(ins)))
            elif ins.opcode == "conditional":
                add(max((walk(b) for b in _branches(ins)),
                        key=lambda d: sum(v[1] for v in d.values())))
            else:
                seconds = replay._price(ins)
                if seconds:
                    add({ins.name: (_kernel_class(ins, _fused(comps, ins)), seconds, 1)})
        memo[name] = out
        return out

    return walk(entry)


def compute_by_class(text: str, roofline: Roofline) -> dict[str, float]:
    """Seconds per step of the compute stream's kernels by class (``KERNEL_CLASSES``; see
    ``_kernel_class`` for the rules), each priced as the replay prices it (roofline), loops
    counted by their trip counts, collectives left out. Sums to the replay's
    ``compute_s`` (a conditional counts its costliest branch, as the replay does)."""
    out = dict.fromkeys(KERNEL_CLASSES, 0.0)
    for cls, seconds, _ in compute_by_instruction(text, roofline).values():
        out[cls] += seconds
    return out


def schedule_report(text: str, roofline: Roofline, links: Links) -> ScheduleReport:
    """Replays the scheduled HLO module ``text`` (``compiled.as_text()``) on ``links``
    priced by ``roofline``: every collective's wire and exposed time, the step's time."""
    comps, entry = parse_module(text)
    replay = _Replay(comps, roofline, links)
    step_s, compute_s, found = replay.run(entry)
    return ScheduleReport(tuple(found), compute_s, step_s)
