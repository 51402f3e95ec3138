"""Communication report read from a lowered (StableHLO) or compiled (HLO) program.

Every all-gather, all-to-all, reduce-scatter, all-reduce and collective-permute becomes a row:
its kind, element dtype, bytes, replica groups, and the bytes it moves inside nodes and
across nodes. Device ``i`` of a group is the program's logical device ``i``, which for a
``("node", "local")`` mesh is ``node * L + local`` (node-major).

Counting model (bytes summed over all devices, for one execution of the program):

* all-to-all: exactly the chunks whose sender and receiver sit on different nodes (cross)
  or on the same node (intra).
* all-gather / reduce-scatter of total size ``T`` over a group: a node holding ``c`` of the
  group's ``g`` devices must receive (all-gather) or send (reduce-scatter) ``(g - c) / g * T``
  across nodes — the lower bound a hierarchical algorithm meets, ``(n-1)/n * T`` per node
  for ``n`` nodes with equal devices. Intra-node: ``(c - 1) / g * T`` per device.
* all-reduce: a reduce-scatter plus an all-gather of its size.
* collective-permute: each (source, target) pair moves the whole operand.

A lowered program reports what the program asks for. A compiled program reports what XLA
actually moves: on the CPU backend XLA widens bf16 reduce-scatters and all-reduces to f32,
and such rows are flagged ``widened``. Collectives inside both branches of a ``cond`` are
both counted; functions called several times are counted that many times (lowered text).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Sequence

import numpy as np

KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")

_ITEMSIZE = {
    "pred": 1, "i1": 1, "s8": 1, "u8": 1, "i8": 1, "ui8": 1,
    "s16": 2, "u16": 2, "i16": 2, "ui16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "i32": 4, "ui32": 4, "f32": 4,
    "s64": 8, "u64": 8, "i64": 8, "ui64": 8, "f64": 8,
}


@dataclasses.dataclass(frozen=True)
class CollectiveRow:
    """One collective. Byte counts are summed over all participating devices.

    Attributes:
      kind: one of ``KINDS``.
      dtype: element type as printed (``bf16``, ``u16``/``ui16``, ``s8``/``i8``, ``f32``...).
      shape: result shape (per device); for tuple results, the first element's.
      bytes: result bytes per device (all elements of a tuple result).
      groups: replica groups (logical device ids), or (source, target) pairs for permutes.
      intra_node_bytes: bytes moved between devices of the same node.
      cross_node_bytes: bytes crossing node boundaries.
      widened: True if XLA promoted the reduction to a wider type than the program asked
        for (compiled programs only).
      count: how many times the program runs it (function calls).
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    intra_node_bytes: float
    cross_node_bytes: float
    widened: bool = False
    count: int = 1


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Rows plus totals; ``nodes`` and ``local`` describe the mesh the ids map onto."""

    rows: tuple[CollectiveRow, ...]
    nodes: int
    local: int

    @property
    def cross_node_bytes(self) -> float:
        """All bytes crossing node boundaries in one execution, summed over nodes."""
        return float(sum(r.cross_node_bytes * r.count for r in self.rows))

    @property
    def cross_node_bytes_per_node(self) -> float:
        return self.cross_node_bytes / self.nodes

    @property
    def intra_node_bytes(self) -> float:
        return float(sum(r.intra_node_bytes * r.count for r in self.rows))

    def by_kind(self) -> dict[str, dict[str, float]]:
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            key = f"{r.kind} {r.dtype}"
            d = out.setdefault(key, {"count": 0, "cross_node_bytes": 0.0,
                                     "intra_node_bytes": 0.0})
            d["count"] += r.count
            d["cross_node_bytes"] += r.cross_node_bytes * r.count
            d["intra_node_bytes"] += r.intra_node_bytes * r.count
        return out

    def table(self) -> str:
        lines = [f"{'collective':<28} {'count':>5} {'cross-node B':>14} {'intra-node B':>14}"]
        for key, d in sorted(self.by_kind().items()):
            lines.append(f"{key:<28} {d['count']:>5} {d['cross_node_bytes']:>14,.0f} "
                         f"{d['intra_node_bytes']:>14,.0f}")
        widened = sum(r.count for r in self.rows if r.widened)
        lines.append(f"{'total':<28} {sum(r.count for r in self.rows):>5} "
                     f"{self.cross_node_bytes:>14,.0f} {self.intra_node_bytes:>14,.0f}")
        lines.append(f"cross-node bytes per node: {self.cross_node_bytes_per_node:,.0f} "
                     f"({self.nodes} nodes x {self.local} devices)")
        if widened:
            lines.append(f"note: {widened} collective(s) widened by XLA (flagged 'widened')")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "local": self.local,
            "cross_node_bytes": self.cross_node_bytes,
            "cross_node_bytes_per_node": self.cross_node_bytes_per_node,
            "intra_node_bytes": self.intra_node_bytes,
            "by_kind": self.by_kind(),
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


# -- byte counting ----------------------------------------------------------------------------


def _count_bytes(kind: str, nbytes: int, groups: Sequence[Sequence[int]], local: int
                 ) -> tuple[float, float]:
    """(intra, cross) bytes of one collective whose per-device result is ``nbytes``."""
    node_of = lambda d: d // local  # noqa: E731
    intra = cross = 0.0
    if kind == "collective-permute":
        for src, dst in groups:
            if src == dst:
                continue
            if node_of(src) == node_of(dst):
                intra += nbytes
            else:
                cross += nbytes
        return intra, cross
    for group in groups:
        g = len(group)
        if g <= 1:
            continue
        per_node: dict[int, int] = {}
        for d in group:
            per_node[node_of(d)] = per_node.get(node_of(d), 0) + 1
        if kind == "all-to-all":
            chunk = nbytes / g
            for d in group:
                c = per_node[node_of(d)]
                intra += (c - 1) * chunk
                cross += (g - c) * chunk
            continue
        # all-gather / reduce-scatter / all-reduce: T is the full (gathered) size.
        total = {"all-gather": nbytes, "reduce-scatter": nbytes * g, "all-reduce": nbytes}[kind]
        factor = 2 if kind == "all-reduce" else 1
        for c in per_node.values():
            cross += factor * (g - c) / g * total
            intra += factor * c * (c - 1) / g * total
    return intra, cross


# -- parsing ----------------------------------------------------------------------------------


def _iota_groups(spec: str) -> list[list[int]]:
    """``[G,S]<=[dims]T(perm)`` (XLA's iota replica-group list) -> explicit groups."""
    m = re.match(r"\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", spec)
    if not m:
        raise ValueError(f"cannot parse replica groups {spec!r}")
    g, s = int(m.group(1)), int(m.group(2))
    dims = [int(v) for v in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
        ids = ids.transpose([int(v) for v in m.group(4).split(",")])
    return ids.reshape(g, s).tolist()


def _brace_groups(text: str) -> list[list[int]]:
    return [[int(v) for v in grp.split(",") if v.strip()]
            for grp in re.findall(r"\{([\d,\s]*)\}", text)]


def _hlo_types(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    return [(t, tuple(int(v) for v in dims.split(",") if v))
            for t, dims in re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", type_text)]


_HLO_OP = re.compile(
    r"=\s*(?P<type>\([^=]*?\)|[a-z]+\d*\[[\d,]*\](?:\{[\d,]*\})?)\s+"
    r"(?P<kind>all-gather|all-to-all|reduce-scatter|all-reduce|collective-permute)"
    r"(?P<start>-start)?\((?P<rest>.*)$"
)


def _parse_hlo(text: str, nodes: int, local: int, num: int) -> list[CollectiveRow]:
    rows = []
    for line in text.splitlines():
        m = _HLO_OP.search(line)
        if not m:
            continue
        kind, rest = m.group("kind"), m.group("rest")
        types = _hlo_types(m.group("type"))
        if m.group("start") and kind in ("all-gather", "collective-permute") and len(types) >= 2:
            types = types[len(types) // 2:]  # (operands..., results...) of the async start
        dtype, shape = types[0]
        nbytes = sum(_ITEMSIZE.get(t, 4) * math.prod(s) for t, s in types)
        if kind == "collective-permute":
            pm = re.search(r"source_target_pairs=(\{\{.*?\}\})", rest)
            groups = _brace_groups(pm.group(1)) if pm else []
        else:
            gm = re.search(r"replica_groups=(\{\{.*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)",
                           rest)
            if gm is None or gm.group(1) == "{}":
                groups = [list(range(num))]
            elif gm.group(1).startswith("["):
                groups = _iota_groups(gm.group(1))
            else:
                groups = _brace_groups(gm.group(1))
        widened = bool(re.search(r"to_apply=%?[\w.\-]*_promoted", rest))
        intra, cross = _count_bytes(kind, nbytes, groups, local)
        rows.append(CollectiveRow(kind, dtype, shape, nbytes,
                                  tuple(tuple(g) for g in groups), intra, cross, widened))
    return rows


_MLIR_OP = re.compile(
    r'"stablehlo\.(all_gather|all_to_all|reduce_scatter|all_reduce|collective_permute)"'
)


def _mlir_tensor_types(text: str) -> list[tuple[str, tuple[int, ...]]]:
    out = []
    for body in re.findall(r"tensor<([^>]*)>", text):
        parts = body.split("x")
        dims = tuple(int(p) for p in parts[:-1] if p.isdigit())
        out.append((parts[-1], dims))
    return out


def _dense_groups(text: str) -> list[list[int]]:
    m = re.search(r"dense<(.*?)>\s*:\s*tensor<(\d+)x(\d+)xi64>", text)
    if not m:
        return []
    body, g, s = m.group(1), int(m.group(2)), int(m.group(3))
    values = [int(v) for v in re.findall(r"-?\d+", body)]
    if len(values) == 1:  # splat
        values = values * (g * s)
    return np.array(values).reshape(g, s).tolist()


def _mlir_functions(text: str) -> dict[str, str]:
    """name -> body text of each ``func.func`` (top level)."""
    starts = [(m.start(), m.group(1)) for m in
              re.finditer(r"func\.func\s+(?:public\s+|private\s+)?@([\w$.\-]+)\(", text)]
    funcs = {}
    for i, (pos, name) in enumerate(starts):
        end = starts[i + 1][0] if i + 1 < len(starts) else len(text)
        funcs[name] = text[pos:end]
    return funcs


def _multiplicities(funcs: dict[str, str]) -> dict[str, int]:
    calls = {name: re.findall(r"call @([\w$.\-]+)\(", body) for name, body in funcs.items()}
    called = {c for cs in calls.values() for c in cs}
    roots = [n for n in funcs if n not in called] or list(funcs)[:1]
    memo: dict[str, int] = {}

    def mult(name: str) -> int:
        if name in memo:
            return memo[name]
        if name in roots:
            memo[name] = 1
            return 1
        memo[name] = 0  # cycle guard
        total = sum(mult(caller) * cs.count(name) for caller, cs in calls.items())
        memo[name] = total
        return total

    return {name: mult(name) for name in funcs}


def _parse_mlir(text: str, nodes: int, local: int, num: int) -> list[CollectiveRow]:
    funcs = _mlir_functions(text) or {"main": text}
    mult = _multiplicities(funcs)
    rows = []
    for fname, body in funcs.items():
        matches = list(_MLIR_OP.finditer(body))
        for i, m in enumerate(matches):
            kind = m.group(1).replace("_", "-")
            # The op's text runs to the first "->" that follows (regions hold none), and
            # then to the end of that line: the result types.
            seg_end = matches[i + 1].start() if i + 1 < len(matches) else len(body)
            seg = body[m.end():seg_end]
            arrow = seg.find("->")
            if arrow < 0:
                continue
            attrs = seg[:arrow]
            result_text = seg[arrow:].split("\n", 1)[0]
            types = _mlir_tensor_types(result_text)
            if not types:
                continue
            dtype, shape = types[0]
            nbytes = sum(_ITEMSIZE.get(t, 4) * math.prod(s) for t, s in types)
            if kind == "collective-permute":
                pm = re.search(r"source_target_pairs\s*=\s*(dense<.*?>\s*:\s*tensor<\w+>)", attrs)
                groups = _dense_groups(pm.group(1)) if pm else []
            else:
                gm = re.search(r"replica_groups\s*=\s*(dense<.*?>\s*:\s*tensor<\w+>)", attrs)
                groups = _dense_groups(gm.group(1)) if gm else [list(range(num))]
            intra, cross = _count_bytes(kind, nbytes, groups, local)
            rows.append(CollectiveRow(kind, dtype, shape, nbytes,
                                      tuple(tuple(g) for g in groups), intra, cross, False,
                                      mult.get(fname, 1)))
    return rows


def comm_report(program: Any, mesh: Any) -> CommReport:
    """Collectives of ``program`` and the bytes they move inside and across nodes.

    Args:
      program: a ``jax.stages.Lowered`` (what the program asks for), a
        ``jax.stages.Compiled`` (what XLA actually moves), or the text of either
        (StableHLO MLIR or HLO).
      mesh: the ``("node", "local")`` mesh the program runs on (or a ``(nodes, local)``
        tuple).
    """
    from zeropp_jax.mesh import mesh_shape

    nodes, local = tuple(mesh) if isinstance(mesh, tuple) else mesh_shape(mesh)
    num = nodes * local
    text = program if isinstance(program, str) else program.as_text()
    if "stablehlo." in text or "func.func" in text:
        rows = _parse_mlir(text, nodes, local, num)
    else:
        rows = _parse_hlo(text, nodes, local, num)
    return CommReport(tuple(rows), nodes, local)
