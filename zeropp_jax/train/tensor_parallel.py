"""Tensor parallelism's plan for a run: which dimension of each parameter the ``"model"``
mesh axis splits, read from the model's Flax partitioning metadata and the logical-axis
rules (``TrainState.create(logical_axis_rules=..., param_axes=...)``), and what it does not
combine with yet.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import warnings
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh

from zeropp_jax.comm.frozen import as_predicate, split_frozen
from zeropp_jax.comm.transports import TransportPlan, frozen_format
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import AXES, MODEL, SLICE_AXES, MeshInfo, slice_axis, slice_size
from zeropp_jax.units.adapters import ModelAdapter

PyTree = Any


def layer_dim(dim: int, path: tuple[str, ...]) -> int:
    """A stacked parameter's split dimension (counting the leading layer axis) -> one
    layer's."""
    if dim == 0:
        raise ValueError(
            f"the layer axis of the nn.scan stack {'/'.join(path)!r} maps to the mesh's "
            f"inner axis ({' or '.join(map(repr, SLICE_AXES))}); "
            "the layers are ZeRO's units, so map the scan's axis name (nn.scan's "
            "metadata_params={nn.PARTITION_NAME: ...}) to None")
    return dim - 1 if dim > 0 else dim


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """How a run splits its parameters over the mesh's ``"model"`` axis.

    Attributes:
      size: the ``"model"`` axis size (the tensor-parallel degree).
      dims: a tree like the params tree: each leaf's dimension split over ``"model"``, or
        -1 for a leaf the model uses whole.
      rules: the logical-axis rules the model's constraints are read with inside the step
        (those naming ``"model"``; every other logical name unconstrained: the data axes
        are the step's own).
      frozen_dims: with frozen parameters, ``dims`` of those (``dims`` then holds the
        trainable ones').
    """

    size: int
    dims: PyTree
    rules: tuple[tuple[str, Any], ...]
    frozen_dims: PyTree = None


def _model_dim(names: Any, mesh_axes: Any, where: str, axis: str = MODEL) -> int:
    """The dimension of a parameter whose sharding names ``mesh_axes`` (one entry per
    dimension) that is split over ``axis`` (the mesh's inner axis); -1 if none."""
    found = [i for i, a in enumerate(mesh_axes or ())
             if a == axis or (isinstance(a, tuple) and axis in a)]
    if len(found) > 1:
        raise ValueError(f"parameter {where} is split over {axis!r} on dimensions {found} "
                         f"({names}); at most one dimension can be")
    for i, a in enumerate(mesh_axes or ()):
        if isinstance(a, tuple) and set(a) - {axis} and axis in a:
            raise ValueError(f"parameter {where}: dimension {i} maps to {a}; ZeRO shards over "
                             f"the data axes itself, so map it to {axis!r} alone")
    return found[0] if found else -1


Rules = tuple[tuple[str, Any], ...]
ParamAxes = tuple[tuple[str, tuple[Any, ...]], ...]

_RULES_FORM = ("a list of (logical name, mesh axes) pairs, as nn.logical_axis_rules takes: "
               "logical_axis_rules=[(\"mlp\", \"model\"), (\"embed\", None)]")
_AXES_FORM = ("a list of (regex, names) pairs: param_axes=[(r\"mlp/up_proj/kernel\", "
              "(\"embed\", \"mlp\"))]")


def _is_axis(a: Any) -> bool:
    """One mesh-axes entry of a rule, as Flax takes it: None (unsplit), an axis name, a
    tuple of them (split over several axes), or ``PartitionSpec.UNCONSTRAINED`` (left to
    XLA; activation constraints)."""
    if a is None or isinstance(a, str) or a is jax.sharding.PartitionSpec.UNCONSTRAINED:
        return True
    return isinstance(a, (tuple, list)) and all(isinstance(x, str) for x in a)


def _sequence_of_pairs(value: Any, arg: str, form: str) -> list:
    """``value`` as a list of entries, or an error naming ``arg`` for a value that is one
    pair, a dict, or no list at all."""
    if isinstance(value, Mapping):
        raise ValueError(f"{arg} is a {type(value).__name__}; give {form} (order matters: "
                         "the first matching entry wins), e.g. list(d.items())")
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise ValueError(f"{arg}={value!r} is not a list; give {form}")
    if value and isinstance(value[0], str):  # a pair's name where a pair should be
        if len(value) == 2:
            raise ValueError(f"{arg}={value!r} is one pair, not a list of pairs: write "
                             f"{arg}=[{tuple(value)!r}]")
        raise ValueError(f"{arg}={value!r} holds strings where pairs go; give {form}")
    return list(value)


def check_rules(rules: Any, param_axes: Any, mesh: Mesh) -> tuple[Rules, ParamAxes]:
    """``TrainState.create``'s ``logical_axis_rules`` and ``param_axes``, checked before
    anything is traced and normalised to tuples (the engine keeps the rules in its static
    data, so they must hash).

    ``logical_axis_rules``: what ``nn.logical_axis_rules`` takes, a list of ``(logical name,
    mesh axes)`` pairs, the mesh axes ``None``, an axis name, a tuple of them or
    ``PartitionSpec.UNCONSTRAINED``. Every axis named must be an axis of ``mesh`` (or
    ``"model"``, so one list serves meshes with and without it): Flax leaves a dimension
    whose rule names an axis the mesh lacks whole, with no word. ``param_axes``: a list of
    ``(regex, names)`` pairs, each regex valid and its names strings or None. Raises
    ``ValueError`` naming the argument, the entry and the fix."""
    checked_rules = []
    arg = "logical_axis_rules"
    for i, entry in enumerate(_sequence_of_pairs(
            () if rules is None else rules, arg, _RULES_FORM)):
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            n = f"has {len(entry)} elements" if isinstance(entry, (tuple, list)) else \
                f"is a {type(entry).__name__}"
            raise ValueError(
                f"{arg}[{i}]={entry!r} {n}: each rule is one pair (logical name, mesh axes); "
                "a dimension split over several mesh axes names them in one tuple, "
                "(\"mlp\", (\"a\", \"b\")). Give " + _RULES_FORM)
        name, axes = entry
        if not isinstance(name, str) or not _is_axis(axes):
            raise ValueError(
                f"{arg}[{i}]={entry!r}: a rule is (logical name: str, mesh axes: None, an "
                "axis name or a tuple of them); give " + _RULES_FORM)
        axes = tuple(axes) if isinstance(axes, list) else axes
        inner = slice_axis(mesh)
        known = tuple(mesh.axis_names) + tuple(a for a in SLICE_AXES
                                               if a not in mesh.axis_names)
        for a in (axes if isinstance(axes, tuple) else (axes,)):
            if isinstance(a, str) and a not in known:
                close = difflib.get_close_matches(a, known, n=1)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise ValueError(
                    f"{arg}[{i}]=({name!r}, {axes!r}) names the mesh axis {a!r}, which the "
                    f"mesh does not have (its axes: {tuple(mesh.axis_names)}): Flax would "
                    f"leave every dimension named {name!r} whole on each device. {hint}"
                    + (f"This mesh splits parameters over {inner!r}: map {name!r} to "
                       f"{inner!r} or to None" if inner else
                       f"Tensor parallelism splits over {MODEL!r} (make_mesh(..., model=T)), "
                       "expert parallelism over 'expert' (make_mesh(..., expert=E)); map "
                       f"{name!r} to one of those or to None"))
        checked_rules.append((name, axes))

    checked_axes = []
    arg = "param_axes"
    for i, entry in enumerate(_sequence_of_pairs(
            () if param_axes is None else param_axes, arg, _AXES_FORM)):
        if not (isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(
                entry[0], str) and isinstance(entry[1], (tuple, list)) and all(
                    isinstance(n, str) or n is None for n in entry[1])):
            raise ValueError(f"{arg}[{i}]={entry!r}: each entry is (regex: str, names: a "
                             "tuple of logical names or None, one per dimension); give "
                             + _AXES_FORM)
        try:
            re.compile(entry[0])
        except re.error as e:
            raise ValueError(f"{arg}[{i}]: {entry[0]!r} is not a valid regex ({e})") from e
        checked_axes.append((entry[0], tuple(entry[1])))
    return tuple(checked_rules), tuple(checked_axes)


def _data_axis_rule(names: Sequence[Any], axes: Sequence[Any], rules: Rules, where: str
                    ) -> None:
    """Raises if a rule splits a dimension of the parameter at ``where`` (logical
    ``names``, mesh ``axes``) over a data axis: ZeRO shards every parameter over those
    itself, so such a rule would be ignored with no word."""
    for name, a in zip(names, axes):
        spanned = a if isinstance(a, tuple) else (a,)
        data = [x for x in spanned if x in AXES]
        if not data:
            continue
        rule = next((r for r in rules if r[0] == name and r[1] == a), (name, a))
        raise ValueError(
            f"logical_axis_rules entry {rule!r} maps {name!r} to the data axis "
            f"{data[0]!r}, and parameter {where} has a dimension named {name!r}: ZeRO "
            f"shards every parameter over the data axes {AXES} itself, so a parameter's "
            f"logical names map to {SLICE_AXES} or to None. Map {name!r} to None (or to "
            f"the mesh's {MODEL!r} or 'expert' axis to split it); rules for activation "
            "names no parameter uses, such "
            f"as MaxText's (\"batch\", {AXES!r}), may name the data axes")


def annotated(raw: PyTree, params: PyTree, adapter: ModelAdapter) -> PyTree:
    """The params tree with its partitioning metadata: ``params`` as the user passed them
    (linen's boxes), else the adapter's (an NNX model's sharding metadata), else the
    plain tree."""
    if raw is not None:
        return raw
    return adapter.partitioning() if hasattr(adapter, "partitioning") else params


def tensor_parallel(raw_params: PyTree, rules: Sequence[tuple[str, Any]] | None,
                    param_axes: Sequence[tuple[str, Sequence[Any]]] | None, mesh: Mesh,
                    plan: TransportPlan, frozen: Any) -> TensorParallel | None:
    """The run's tensor parallelism: None on a mesh without a ``"model"`` axis. Each
    parameter's split dimension comes from its Flax partitioning metadata
    (``nn.with_logical_partitioning`` or ``nnx.with_partitioning`` names through ``rules``,
    or ``nn.with_partitioning`` mesh axes), or for a parameter without any from the first
    ``param_axes`` entry ``(regex, names)`` whose regex ``re.search``-matches its
    ``"/"``-joined path. Raises for what tensor parallelism does not support yet, naming
    it."""
    rules, param_axes = check_rules(rules, param_axes, mesh)
    size, axis = slice_size(mesh), slice_axis(mesh)
    if size == 1:
        return None
    unsupported = [
        ("stage=3", plan.config.stage != 3),
        ("quantize_frozen=False", frozen_format(plan.config) is not None),
        ("qgz_error_feedback=False", plan.feedback(1 << 20, MeshInfo.of(mesh))[0] > 0)]
    missing = [need for need, bad in unsupported if bad]
    if missing:
        raise NotImplementedError(
            f"an inner {axis!r} mesh axis (of size {size}) needs "
            f"{', '.join(missing)} for now")
    if isinstance(raw_params, Mapping) and "params" in raw_params and all(
            isinstance(v, Mapping) for v in raw_params.values()):
        raw_params = raw_params["params"]
    patterns = [(re.compile(rx), names) for rx, names in param_axes]
    used = [False] * len(patterns)  # which param_axes entries named a parameter
    unannotated = []  # the paths param_axes is matched against (for the warning)

    def dim(path: Any, leaf: Any) -> int:
        where = jax.tree_util.keystr(path)
        if not isinstance(leaf, (nn.LogicallyPartitioned, nn.Partitioned)):
            joined = "/".join(str(getattr(k, "key", k)) for k in path)
            unannotated.append(joined)
            k = next((k for k, (rx, _) in enumerate(patterns) if rx.search(joined)), None)
            if k is None:
                return -1
            used[k] = True
            names = patterns[k][1]
            if len(names) != np.ndim(leaf):
                raise ValueError(f"param_axes gives {joined} the names {names}, one per "
                                 f"dimension, but its shape is {np.shape(leaf)}")
            leaf = nn.LogicallyPartitioned(leaf, names)
        if isinstance(leaf, nn.LogicallyPartitioned):
            axes = nn.logical_to_mesh_axes(leaf.names, rules)
            d = _model_dim(leaf.names, axes, where, axis)
            _data_axis_rule(leaf.names, axes, rules, where)
        else:
            d = _model_dim(leaf.names, leaf.names, where, axis)
        shape = np.shape(nn.meta.unbox(leaf))
        if d >= 0 and shape[d] % size:
            raise ValueError(
                f"parameter {where} of shape {shape} is split over {axis!r} on dimension {d}, "
                f"which {size} devices do not divide; pick an {axis!r} axis size dividing "
                f"{shape[d]}, or map that dimension's logical name to None")
        return d

    dims = jax.tree_util.tree_map_with_path(
        dim, raw_params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    for (rx, names), hit in zip(param_axes, used):
        if not hit:
            shown = ", ".join(unannotated[:4]) + (", ..." if len(unannotated) > 4 else "")
            warnings.warn(
                f"param_axes entry ({rx!r}, {names}) names no parameter: its regex matches "
                "none of the model's parameters without partitioning metadata, or only ones "
                f"an earlier entry names ({len(unannotated)} paths, such as: "
                f"{shown or 'none'}), so it splits nothing. Fix the regex (re.search on "
                "the '/'-joined path) or remove the entry", UserWarning, stacklevel=3)
    model_rules = tuple((name, axis if a == axis or (isinstance(a, tuple) and axis in a)
                         else None) for name, a in rules)
    frozen_dims = None
    if frozen is not None:
        dims, frozen_dims = split_frozen(dims, as_predicate(frozen))
    return TensorParallel(size, dims, model_rules, frozen_dims)
