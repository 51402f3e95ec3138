"""Communication report read from a lowered (StableHLO) or compiled (HLO) program.

Every all-gather, all-to-all, reduce-scatter, all-reduce and collective-permute becomes a row:
its kind, element dtype, bytes, replica groups, and the bytes it moves inside nodes and
across nodes. Device ``i`` of a group is the program's logical device ``i``, which for a
``("node", "local")`` mesh is ``node * L + local`` (node-major).

Bytes follow the one counting model of ``zeropp_jax.comm.wire`` (``count_bytes``; the
transports report their bytes with the same model), summed over all devices for one
execution of the program.

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

from zeropp_jax.comm.wire import count_bytes

KINDS = ("all-gather", "all-to-all", "reduce-scatter", "all-reduce", "collective-permute")

ITEMSIZE = {
    "pred": 1, "i1": 1, "s8": 1, "u8": 1, "i8": 1, "ui8": 1,
    "s16": 2, "u16": 2, "i16": 2, "ui16": 2, "f16": 2, "bf16": 2,
    "s32": 4, "u32": 4, "i32": 4, "ui32": 4, "f32": 4,
    "s64": 8, "u64": 8, "i64": 8, "ui64": 8, "f64": 8,
    "f8e4m3fn": 1, "f8e5m2": 1, "f8e4m3": 1, "f8e4m3fnuz": 1, "f8e5m2fnuz": 1, "f8e8m0fnu": 1,
    "s4": 0.5, "u4": 0.5, "i4": 0.5, "ui4": 0.5, "c64": 8, "c128": 16,
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
      axis: which mesh axes its groups span on a mesh with a ``"model"`` axis: ``"data"``
        (ZeRO's: devices holding the same tensor-parallel slice), ``"model"`` (tensor
        parallelism's own, XLA's: devices of one tensor-parallel group) or ``"mixed"``;
        always ``"data"`` on a ``("node", "local")`` mesh.
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
    axis: str = "data"

    def spans_nodes(self, local: int) -> bool:
        """True if a group (or permute pair) holds devices of more than one node: on a
        cluster, a collective between processes, which pays the network's fixed cost."""
        return any(len({d // local for d in g}) > 1 for g in self.groups)


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Rows plus totals; ``nodes``, ``local`` and ``model`` describe the mesh the ids map
    onto (``model``: the size of the inner axis, 1 without one; a node holds
    ``local * model`` devices); ``inner``: that axis' name, ``"model"`` (tensor
    parallelism) or ``"expert"`` (expert parallelism)."""

    rows: tuple[CollectiveRow, ...]
    nodes: int
    local: int
    model: int = 1
    inner: str = "model"

    @property
    def per_node(self) -> int:
        """Devices per node."""
        return self.local * self.model

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

    @property
    def cross_node_collectives(self) -> int:
        """Collectives run per execution whose groups span nodes (between processes on a
        cluster): each pays a fixed cost whatever its size, so their count is a lever of
        its own on fast links."""
        return sum(r.count for r in self.rows if r.spans_nodes(self.per_node))

    @property
    def collectives_run(self) -> int:
        """Every collective run per execution (inside nodes or across)."""
        return sum(r.count for r in self.rows)

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

    def by_axis(self) -> dict[str, dict[str, float]]:
        """Per ``CollectiveRow.axis`` (``"data"``: ZeRO's collectives; ``"model"``: tensor
        parallelism's; ``"expert"``: the tokens' moves to their experts and back;
        ``"mixed"``): count and bytes inside and across nodes."""
        out: dict[str, dict[str, float]] = {}
        for r in self.rows:
            d = out.setdefault(r.axis, {"count": 0, "cross_node_bytes": 0.0,
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
        if self.model > 1:
            for axis, d in sorted(self.by_axis().items()):
                lines.append(f"{'  over ' + axis + ' axes':<28} {d['count']:>5} "
                             f"{d['cross_node_bytes']:>14,.0f} {d['intra_node_bytes']:>14,.0f}")
        shape = (f"{self.nodes} nodes x {self.local} devices" if self.model == 1 else
                 f"{self.nodes} nodes x {self.local} x {self.model} ({self.inner}) devices")
        lines.append(f"cross-node bytes per node: {self.cross_node_bytes_per_node:,.0f} "
                     f"({shape})")
        lines.append(f"collectives between nodes: {self.cross_node_collectives} of "
                     f"{self.collectives_run}")
        if widened:
            lines.append(f"note: {widened} collective(s) widened by XLA (flagged 'widened')")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "nodes": self.nodes,
            "local": self.local,
            "model": self.model,
            "inner": self.inner,
            "by_axis": self.by_axis(),
            "cross_node_bytes": self.cross_node_bytes,
            "cross_node_bytes_per_node": self.cross_node_bytes_per_node,
            "intra_node_bytes": self.intra_node_bytes,
            "cross_node_collectives": self.cross_node_collectives,
            "collectives_run": self.collectives_run,
            "by_kind": self.by_kind(),
            "rows": [dataclasses.asdict(r) for r in self.rows],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CommReport":
        """The report ``to_json`` wrote (e.g. read back from a benchmark's JSON)."""
        rows = tuple(CollectiveRow(r["kind"], r["dtype"], tuple(r["shape"]), r["bytes"],
                                   tuple(tuple(g) for g in r["groups"]),
                                   r["intra_node_bytes"], r["cross_node_bytes"], r["widened"],
                                   r["count"], r.get("axis", "data"))
                     for r in data["rows"])
        return cls(rows, data["nodes"], data["local"], data.get("model", 1),
                   data.get("inner", "model"))

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1)


# -- byte counting ----------------------------------------------------------------------------


# -- parsing ----------------------------------------------------------------------------------
#
# Replica groups come in several textual forms (see zeropp_jax/compat.py, item "replica
# groups"); all of them become explicit tuples of logical device ids here:
#   StableHLO, jax <= 0.10:  replica_groups = dense<[[0, 1], [2, 3]]> : tensor<2x2xi64>
#   StableHLO, jax >= 0.11:  replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh_0,
#                              axes = [#stablehlo.axis_ref<name = "local">]>
#                            with `sdy.mesh @mesh_0 = <["node"=4, "local"=2]>` at the top
#   HLO, jax <= 0.10:        replica_groups={{0,1},{2,3}}  or  replica_groups=[4,2]<=[8]
#   HLO, jax >= 0.11:        replica_groups=mesh['node'=4,'local'=2] {'local'}
# A mesh's device ``i`` (row-major over its axes) is logical device ``i``, or
# ``device_ids[i]`` where the mesh lists device ids.


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op as printed in a program's text.

    Attributes:
      kind: one of ``KINDS``.
      dtype: result element type as printed (``bf16``, ``ui16``/``u16``, ``i8``/``s8``...).
      shape: result shape (per device); for tuple results, the first element's.
      bytes: result bytes per device (all elements of a tuple result).
      groups: replica groups as tuples of logical device ids (all devices in one group
        where the program names none), or (source, target) pairs for permutes.
      widened: True if XLA promoted the reduction to a wider type (compiled HLO only).
      count: how many times the program runs it (calls of its function; lowered text).
    """

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    groups: tuple[tuple[int, ...], ...]
    widened: bool = False
    count: int = 1


@dataclasses.dataclass(frozen=True)
class _MeshSpec:
    axes: tuple[tuple[str, int], ...]  # (name, size), major to minor
    device_ids: tuple[int, ...] | None = None  # None: iota


def _iota_ids(spec: str) -> np.ndarray:
    """``[d0,d1,...]<=[r0,r1,...]T(perm)`` (XLA's iota tile assignment) -> ids, shape ``d``."""
    m = re.fullmatch(r"\s*\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?\s*", spec)
    if not m:
        raise ValueError(f"cannot parse iota device list {spec!r}")
    dims = [int(v) for v in m.group(1).split(",")]
    reshape = [int(v) for v in m.group(2).split(",")]
    ids = np.arange(math.prod(reshape)).reshape(reshape)
    if m.group(3):
        ids = ids.transpose([int(v) for v in m.group(3).split(",")])
    return ids.reshape(dims)


def _iota_groups(spec: str) -> list[list[int]]:
    """``[G,S]<=[dims]T(perm)`` (XLA's iota replica-group list) -> explicit groups."""
    return _iota_ids(spec).tolist()


def _brace_groups(text: str) -> list[list[int]]:
    return [[int(v) for v in grp.split(",") if v.strip()]
            for grp in re.findall(r"\{([\d,\s]*)\}", text)]


def _device_id_list(text: str) -> tuple[int, ...]:
    """A mesh's ``device_ids``: a plain list of ints, or an iota spec."""
    text = text.strip()
    if text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    if "<=" in text:
        return tuple(int(v) for v in _iota_ids(text).ravel())
    return tuple(int(v) for v in re.findall(r"\d+", text))


def mesh_axes_groups(mesh: _MeshSpec | Sequence[tuple[str, int]],
                     axes: Sequence[str | tuple[str, int | None, int | None]],
                     device_ids: Sequence[int] | None = None) -> list[list[int]]:
    """Replica groups spanning ``axes`` of a mesh, as explicit device-id lists.

    Args:
      mesh: the mesh's ``(name, size)`` axes, major to minor (or a parsed mesh).
      axes: the group's axes in order: a name, or ``(name, pre_size, size)`` for a
        sub-axis (Shardy's ``"name":(pre_size)size``; ``pre_size`` is the product of the
        sub-axes more major than it), or ``(name, None, None)`` for the whole axis.
      device_ids: the devices at the mesh's positions, row-major (default: iota).

    Returns:
      One group per combination of the other axes (row-major); inside a group, devices
      ordered row-major over ``axes`` in the order given. This is the order XLA's
      ``dense``/iota forms use, e.g. ``"node"`` of a 4x2 mesh -> ``[[0,2,4,6],[1,3,5,7]]``.
    """
    if isinstance(mesh, _MeshSpec):
        device_ids = mesh.device_ids if device_ids is None else device_ids
        mesh = mesh.axes
    sizes = dict(mesh)
    refs = [(a, None, None) if isinstance(a, str) else tuple(a) for a in axes]
    for name, _, _ in refs:
        if name not in sizes:
            raise ValueError(f"replica groups name axis {name!r}, not in mesh {dict(mesh)}")
    # Split each mesh axis at the sub-axis boundaries the groups use: factors major-first.
    bounds: dict[str, set[int]] = {name: {1, size} for name, size in mesh}
    for name, pre, size in refs:
        if pre is not None:
            bounds[name] |= {pre, pre * size}
    factors = []  # (axis name, pre_size, size), major to minor
    for name, _ in mesh:
        b = sorted(bounds[name])
        factors += [(name, lo, hi // lo) for lo, hi in zip(b, b[1:])]
    n = math.prod(sizes.values())
    ids = np.asarray(device_ids if device_ids is not None else np.arange(n)).reshape(
        [f[2] for f in factors] or [1])
    group_dims = []
    for name, pre, size in refs:
        lo, hi = (1, sizes[name]) if pre is None else (pre, pre * size)
        group_dims += [i for i, (fn, fp, _) in enumerate(factors)
                       if fn == name and lo <= fp < hi]
    other = [i for i in range(len(factors)) if i not in group_dims]
    g = math.prod(factors[i][2] for i in group_dims)
    return ids.transpose(other + group_dims).reshape(-1, g).tolist()


# StableHLO (lowered) ---------------------------------------------------------------------


def _mlir_meshes(text: str) -> dict[str, _MeshSpec]:
    """``sdy.mesh @name = <["a"=2, "b"=4], device_ids=[...]>`` declarations by name."""
    meshes = {}
    for m in re.finditer(r"^\s*(?:sdy|stablehlo)\.mesh\s+@([\w$.\-]+)\s*=\s*(.*)$", text,
                         re.M):
        meshes[m.group(1)] = _mlir_mesh_body(m.group(2))
    return meshes


def _mlir_mesh_body(body: str) -> _MeshSpec:
    axes = tuple((n, int(s)) for n, s in re.findall(r'"([^"]+)"\s*=\s*(\d+)', body))
    if not axes:  # #stablehlo.mesh<axes = [#stablehlo.mesh_axis<name = "x", size = 2>]>
        axes = tuple((n, int(s)) for n, s in
                     re.findall(r'name\s*=\s*"([^"]+)"\s*,\s*size\s*=\s*(\d+)', body))
    ids = re.search(r"device_ids\s*=\s*(?:array<i64:)?\s*\[?([\d,\s]+)", body)
    return _MeshSpec(axes, tuple(int(v) for v in ids.group(1).replace(",", " ").split())
                     if ids else None)


def _mlir_axis_refs(text: str) -> list[tuple[str, int | None, int | None]]:
    refs = []
    # #stablehlo.axis_ref<name = "y", sub_axis_info = (1)2>  or  #sdy<axis_ref"y":(1)2>
    for m in re.finditer(r'axis_ref\s*(?:<\s*name\s*=\s*)?"([^"]+)"'
                         r"(?:\s*(?:,\s*sub_axis_info\s*=|:)\s*\((\d+)\)(\d+))?", text):
        pre, size = m.group(2), m.group(3)
        refs.append((m.group(1), int(pre) if pre else None, int(size) if size else None))
    return refs


def _mlir_replica_groups(attrs: str, meshes: dict[str, _MeshSpec]) -> list[list[int]] | None:
    """Groups of an op's attribute text; None where it names none."""
    m = re.search(r"replica_groups\s*=\s*(dense<.*?>\s*:\s*tensor<\w+>)", attrs)
    if m:
        return _dense_groups(m.group(1))
    m = re.search(r"replica_groups\s*=\s*#stablehlo\.replica_group_mesh_axes<", attrs)
    if not m:
        return None
    body = _balanced(attrs, m.end() - 1, "<", ">")
    ref = re.match(r"<\s*mesh(?:_name)?\s*=\s*@([\w$.\-]+)", body)
    if ref:
        if ref.group(1) not in meshes:
            raise ValueError(f"replica groups name mesh @{ref.group(1)}, which the program "
                             f"does not declare (declared: {sorted(meshes)})")
        mesh = meshes[ref.group(1)]
    else:  # inline: mesh = #stablehlo.mesh<...>
        inline = re.search(r"mesh\s*=\s*#stablehlo\.mesh<", body)
        if not inline:
            raise ValueError(f"cannot parse replica groups {body!r}")
        mesh_text = _balanced(body, inline.end() - 1, "<", ">")
        mesh = _mlir_mesh_body(mesh_text)
        body = body.replace(mesh_text, "")
    axes_at = re.search(r"\baxes\s*=", body)
    return mesh_axes_groups(mesh, _mlir_axis_refs(body[axes_at.start():] if axes_at else ""))


def _balanced(text: str, start: int, open_: str, close: str) -> str:
    """``text[start:end]`` where ``text[start] == open_`` and ``end`` closes it."""
    depth = 0
    for i in range(start, len(text)):
        c = text[i]
        if c == open_:
            depth += 1
        elif c == close and not (close == ">" and text[i - 1] == "-"):  # skip "->"
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return text[start:]


def _mlir_op_parts(seg: str) -> tuple[str, str]:
    """(attribute text, type signature) of an op's text after its name.

    Generic form: ``(operands) <{properties}> ({region}) {attributes} : (types) -> types``,
    where properties, region and attributes are each optional; regions hold their own
    ``->`` signatures, so they are skipped as a whole.
    """
    pos, attrs = 0, []
    if seg.lstrip().startswith("("):
        pos = seg.index("(")
        pos += len(_balanced(seg, pos, "(", ")"))
    while pos < len(seg):
        rest = seg[pos:]
        stripped = rest.lstrip()
        pos += len(rest) - len(stripped)
        if stripped.startswith("<{"):
            block = _balanced(seg, pos + 1, "{", "}")
            attrs.append(block)
            pos += 1 + len(block) + 1  # "<" block ">"
        elif stripped.startswith("({"):
            pos += len(_balanced(seg, pos, "(", ")"))
        elif stripped.startswith("{"):
            block = _balanced(seg, pos, "{", "}")
            attrs.append(block)
            pos += len(block)
        else:
            return " ".join(attrs), seg[pos:]
    return " ".join(attrs), ""


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


def _mlir_collectives(text: str, num: int | None) -> list[Collective]:
    meshes = _mlir_meshes(text)
    funcs = _mlir_functions(text) or {"main": text}
    mult = _multiplicities(funcs)
    out = []
    for fname, body in funcs.items():
        matches = list(_MLIR_OP.finditer(body))
        for i, m in enumerate(matches):
            kind = m.group(1).replace("_", "-")
            seg_end = matches[i + 1].start() if i + 1 < len(matches) else len(body)
            seg = body[m.end():seg_end]
            attrs, signature = _mlir_op_parts(seg)
            arrow = signature.find("->")
            if arrow < 0:
                continue
            types = _mlir_tensor_types(signature[arrow:].split("\n", 1)[0])
            if not types:
                continue
            dtype, shape = types[0]
            nbytes = int(sum(ITEMSIZE.get(t, 4) * math.prod(s) for t, s in types))
            if kind == "collective-permute":
                pm = re.search(r"source_target_pairs\s*=\s*(dense<.*?>\s*:\s*tensor<\w+>)",
                               attrs)
                groups = _dense_groups(pm.group(1)) if pm else []
            else:
                groups = _mlir_replica_groups(attrs, meshes)
                if not groups:
                    groups = [list(range(num))] if num else []
            out.append(Collective(kind, dtype, shape, nbytes, tuple(map(tuple, groups)),
                                  False, mult.get(fname, 1)))
    return out


# HLO (compiled) ----------------------------------------------------------------------------


def hlo_types(type_text: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(dtype, dims)`` of every array in an HLO type, a tuple's elements in order."""
    return [(t, tuple(int(v) for v in dims.split(",") if v))
            for t, dims in re.findall(r"\b([a-z][a-z0-9]*)\[([\d,]*)\]", type_text)]


# A tuple result type: XLA prints a comment before every fifth element
# (``(f32[16]{0}, ..., /*index=5*/f32[96]{0}, ...)``), so "=" may occur inside it; an async
# start on the GPU nests its operands' tuple in it (``((bf16[64]{0}), bf16[8]{0})``).
_TUPLE_PART = r"(?:[^=()]|/\*index=\d+\*/)"
_HLO_OP = re.compile(
    rf"=\s*(?P<type>\((?:{_TUPLE_PART}|\({_TUPLE_PART}*\))*?\)"
    r"|[a-z]+\d*\[[\d,]*\](?:\{[\d,]*\})?)\s+"
    r"(?P<kind>all-gather|all-to-all|reduce-scatter|all-reduce|collective-permute)"
    r"(?P<start>-start)?\((?P<rest>.*)$"
)
# replica_groups=mesh['node'=4,'local'=2] {'local'}; the mesh may carry
# `, device_ids=(...)` (a list or an iota spec such as `[4,2]<=[2,4]T(1,0)`).
_HLO_MESH_GROUPS = re.compile(
    r"replica_groups=mesh\[(?P<axes>[^\]]*)\]"
    r"(?:\s*,?\s*device_ids=(?P<ids>\((?:[^()]|\([^()]*\))*\)|\[[\d,\s]*\]))?"
    r"\s*\{(?P<group>[^}]*)\}"
)


def _hlo_replica_groups(rest: str) -> list[list[int]] | None:
    m = _HLO_MESH_GROUPS.search(rest)
    if m:
        axes = tuple((n, int(s)) for n, s in
                     re.findall(r"'?([^',=\s]+)'?\s*=\s*(\d+)", m.group("axes")))
        ids = _device_id_list(m.group("ids")) if m.group("ids") else None
        refs = [(n, int(p) if p else None, int(s) if s else None) for n, p, s in
                re.findall(r"'?([^',:(){}\s]+)'?(?::\((\d+)\)(\d+))?", m.group("group"))]
        return mesh_axes_groups(axes, refs, ids)
    gm = re.search(r"replica_groups=(\{\{.*?\}\}|\{\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)",
                   rest)
    if gm is None or gm.group(1) == "{}":
        return None
    if gm.group(1).startswith("["):
        return _iota_groups(gm.group(1))
    return _brace_groups(gm.group(1))


def tuple_elements(type_text: str) -> list[str]:
    """The top-level elements of an HLO tuple type (``"(a, (b, c))"`` -> ``["a", "(b,
    c)"]``); a non-tuple type is its own one element."""
    text = re.sub(r"/\*index=\d+\*/", "", type_text).strip()
    if not text.startswith("("):
        return [text]
    parts, depth, start = [], 0, 1
    for i, ch in enumerate(text):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 1:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:-1].strip())
    return [p for p in parts if p]


def _async_results(type_text: str) -> str:
    """The results in an async collective start's type: GPU HLO prints ``((operands...),
    results...)`` (reduce-scatter, all-to-all) or ``(operands..., results...)`` (all-gather,
    collective-permute), and an all-reduce start as its result alone."""
    parts = tuple_elements(type_text)
    if len(parts) == 1:
        return parts[0]
    if parts[0].startswith("("):
        return ", ".join(parts[1:])
    return ", ".join(parts[len(parts) // 2:])


def hlo_collective(line: str, num: int | None) -> Collective | None:
    """The collective one line of HLO text defines (an async ``-start`` counts as its
    collective), or None if it defines none. ``num``: devices of the program, for ops that
    name no groups."""
    m = _HLO_OP.search(line)
    if not m:
        return None
    kind, rest = m.group("kind"), m.group("rest")
    types = hlo_types(_async_results(m.group("type")) if m.group("start") else m.group("type"))
    dtype, shape = types[0]
    nbytes = int(sum(ITEMSIZE.get(t, 4) * math.prod(s) for t, s in types))
    if kind == "collective-permute":
        pm = re.search(r"source_target_pairs=(\{\{.*?\}\})", rest)
        groups = _brace_groups(pm.group(1)) if pm else []
    else:
        groups = _hlo_replica_groups(rest) or ([list(range(num))] if num else [])
    widened = bool(re.search(r"to_apply=%?[\w.\-]*_promoted", rest))
    return Collective(kind, dtype, shape, nbytes, tuple(map(tuple, groups)), widened)


def _hlo_collectives(text: str, num: int | None) -> list[Collective]:
    return [c for c in map(lambda line: hlo_collective(line, num), text.splitlines())
            if c is not None]


def _program_text(program: Any) -> str:
    return program if isinstance(program, str) else program.as_text()


def _num_devices(text: str) -> int | None:
    m = (re.search(r"mhlo\.num_partitions\s*=\s*(\d+)", text)
         or re.search(r"\bnum_partitions=(\d+)", text))
    r = (re.search(r"mhlo\.num_replicas\s*=\s*(\d+)", text)
         or re.search(r"\breplica_count=(\d+)", text))
    if not m and not r:
        return None
    return (int(m.group(1)) if m else 1) * (int(r.group(1)) if r else 1)


def collectives(program: Any, num_devices: int | None = None) -> tuple[Collective, ...]:
    """Every collective of ``program``, in program order, with explicit replica groups.

    The one parser of program text in this package (tests use it too): it reads every
    form of replica groups JAX 0.10 to 0.12 print (see the parsing notes above), so
    callers never match version-specific text.

    Args:
      program: a ``jax.stages.Lowered``, a ``jax.stages.Compiled``, or the text of either
        (StableHLO MLIR or HLO).
      num_devices: devices of the program, for ops that name no groups (all devices);
        default: read from the program (``mhlo.num_partitions`` / ``num_partitions``).
    """
    text = _program_text(program)
    num = num_devices or _num_devices(text)
    if "stablehlo." in text or "func.func" in text:
        return tuple(_mlir_collectives(text, num))
    return tuple(_hlo_collectives(text, num))


def comm_report(program: Any, mesh: Any) -> CommReport:
    """Collectives of ``program`` and the bytes they move inside and across nodes.

    Args:
      program: a ``jax.stages.Lowered`` (what the program asks for), a
        ``jax.stages.Compiled`` (what XLA actually moves), or the text of either
        (StableHLO MLIR or HLO).
      mesh: the mesh the program runs on (``("node", "local")``, or with an inner
        ``"model"`` or ``"expert"`` axis), or a ``(nodes, local)`` / ``(nodes, local,
        model)`` tuple.
    """
    from zeropp_jax.core.mesh import MODEL, mesh_shape, slice_axis, slice_size

    inner = MODEL
    if isinstance(mesh, tuple):
        nodes, local, model = (tuple(mesh) + (1,))[:3]
    else:
        (nodes, local), model = mesh_shape(mesh), slice_size(mesh)
        inner = slice_axis(mesh) or MODEL
    rows = []
    for c in collectives(program, nodes * local * model):
        intra, cross = count_bytes(c.kind, c.bytes, c.groups, local * model)
        rows.append(CollectiveRow(c.kind, c.dtype, c.shape, c.bytes, c.groups, intra, cross,
                                  c.widened, c.count, _axis_of(c.groups, model, inner)))
    return CommReport(tuple(rows), nodes, local, model, inner)


def _axis_of(groups: Sequence[Sequence[int]], model: int, inner: str = "model") -> str:
    """``"data"``, ``inner`` (``"model"`` or ``"expert"``) or ``"mixed"``: whether every
    group (or permute pair) holds devices of one slice (same index ``d % model``), of one
    inner group (same ``d // model``), or neither. Device ``d`` sits at ``(node, local,
    inner)`` row-major, the inner axis innermost."""
    if model == 1:
        return "data"
    real = [g for g in groups if len(set(g)) > 1]
    if all(len({d % model for d in g}) == 1 for g in real):
        return "data"
    if all(len({d // model for d in g}) == 1 for g in real):
        return inner
    return "mixed"
