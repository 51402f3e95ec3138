"""A unit's parameters <-> one padded flat buffer <-> per-device primary shards.

Each unit (a submodule whose weights are gathered together) is stored as one flat buffer of
``n_pad`` elements, ``n_pad`` a multiple of ``num_shards * align``. Device ``d`` owns
``flat[d * shard_len:(d + 1) * shard_len]`` — its *primary shard*. As a global array the
buffer has shape ``[n_pad]`` and sharding ``PartitionSpec(("node", "local"))``.

Parameters that belong to no unit (for example a scalar declared directly on the root module)
form the *rest* unit, named ``REST``.

With tensor parallelism (a ``"model"`` mesh axis of size ``T``) a unit is stored as ``T`` such
buffers, one per tensor-parallel slice: ``[T, n_pad]``, sharded ``P("model", ("node",
"local"))``. Slice ``t`` of a parameter split on dimension ``k`` is its ``t``-th block along
``k``; a parameter the model keeps whole is cut into ``T`` equal pieces of its flattened
values (storage only: the step rebuilds it whole). ``n`` and ``n_pad`` then count one slice.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zeropp_jax.core.mesh import slice_axis

PyTree = Any
REST = "<rest>"


def unit_name(path: Sequence[str], layer: int | None = None) -> str:
    """``"a/b"`` for a module path, ``"a/b[3]"`` for layer 3 of a scanned stack there."""
    name = "/".join(map(str, path)) if path else REST
    return name if layer is None else f"{name}[{layer}]"


# Inside a step, a scanned stack's params subtree is replaced by this one leaf: the stacked
# local primary shards ``[layers, shard_len]``. ``nn.scan`` slices it like any parameter,
# so each iteration's call of the layer finds its own layer's shard here.
STACKED_SHARD = "__zeropp_stacked_shard__"


def stack_layers(subtree: PyTree, path: Sequence[str]) -> list[PyTree]:
    """A scanned stack's params (every leaf ``[layers, ...]``) -> one subtree per layer."""
    leaves = jax.tree_util.tree_leaves(subtree)
    lengths = {int(np.shape(x)[0]) if np.ndim(x) else None for x in leaves}
    name = "/".join(map(str, path))
    if not leaves or len(lengths) != 1 or None in lengths:
        raise ValueError(
            f"{name!r} is not an nn.scan stack: its parameters do not all share a leading "
            f"layer axis (leading sizes {sorted(map(str, lengths))}). Pass only the paths of "
            "modules made with nn.scan(..., variable_axes={'params': 0}) as stacked="
        )
    (layers,) = lengths
    return [jax.tree_util.tree_map(lambda x, i=i: _layer(x, i), subtree)
            for i in range(layers)]


def _layer(x: Any, i: int) -> Any:
    """Layer ``i`` of a stacked leaf: a numpy array, or the shape of one for a
    ``jax.ShapeDtypeStruct`` (an abstract state's)."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    return np.asarray(x)[i]


@dataclasses.dataclass(frozen=True)
class UnitLayout:
    """Flat layout of one unit's parameters.

    Attributes:
      name: ``"/"``-joined module path, or ``REST``.
      path: module path of the unit (``()`` for the rest unit).
      treedef: tree structure of the unit's parameter subtree.
      shapes: shape of each leaf, in ``treedef`` order.
      n: number of real elements.
      n_pad: padded length, a multiple of ``num_shards * align``.
      num_shards: devices the buffer is split over.
      layer: for one layer of an ``nn.scan`` stack (params with a leading layer axis at
        ``path``), its index along that axis; the layout then describes one layer's slice
        of the stacked subtree. None for an ordinary unit.
      tp: tensor-parallel slices (the ``"model"`` axis size); 1: none, the buffer is 1-D.
      tp_dims: with ``tp > 1``, per leaf the dimension split over ``"model"``, or -1 for a
        leaf the model uses whole (stored as ``tp`` pieces of its flattened values).
    """

    name: str
    path: tuple[str, ...]
    treedef: Any
    shapes: tuple[tuple[int, ...], ...]
    n: int
    n_pad: int
    num_shards: int
    layer: int | None = None
    tp: int = 1
    tp_dims: tuple[int, ...] = ()

    @property
    def shard_len(self) -> int:
        return self.n_pad // self.num_shards

    @property
    def sizes(self) -> tuple[int, ...]:
        """Elements of each leaf in the flat buffer (in one tensor-parallel slice)."""
        if self.tp == 1:
            return tuple(math.prod(s) for s in self.shapes)
        return tuple(-(-math.prod(s) // self.tp) for s in self.shapes)

    @property
    def params(self) -> int:
        """The unit's parameters (all tensor-parallel slices together)."""
        return sum(math.prod(s) for s in self.shapes)

    @property
    def global_shape(self) -> tuple[int, ...]:
        """Shape of the unit's global flat buffer: ``(n_pad,)``, or ``(tp, n_pad)``."""
        return (self.n_pad,) if self.tp == 1 else (self.tp, self.n_pad)

    def flatten(self, tree: PyTree, dtype: Any) -> jax.Array:
        """Unit subtree -> flat ``[n_pad]`` buffer of ``dtype``, zero padded (``[tp,
        n_pad]`` with tensor parallelism: row ``t`` holds slice ``t`` of every leaf).

        A tree of numpy arrays is flattened with numpy (a numpy result, the same values:
        each leaf is first read as the dtype JAX would give it), so building a state runs
        no per-leaf device programs and holds no whole unit on one device."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if treedef != self.treedef:
            raise ValueError(
                f"unit {self.name!r}: parameter tree structure {treedef} does not match the "
                f"layout's {self.treedef}"
            )
        xp = _array_module(leaves)
        if xp is np:
            leaves = [_as_jax_would(x) for x in leaves]
        if self.tp > 1:
            parts = [self._slices(xp, x, dim, size).astype(dtype)
                     for x, dim, size in zip(leaves, self.tp_dims, self.sizes)]
            pad = self.n_pad - self.n
            if pad:
                parts.append(xp.zeros((self.tp, pad), dtype))
            return xp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
        parts = [xp.ravel(x).astype(dtype) for x in leaves]
        pad = self.n_pad - self.n
        if pad:
            parts.append(xp.zeros((pad,), dtype))
        return xp.concatenate(parts) if len(parts) > 1 else parts[0]

    def _slices(self, xp: Any, x: Any, dim: int, size: int) -> Any:
        """A full leaf -> its ``[tp, size]`` tensor-parallel slices, flattened (``xp``:
        numpy or ``jax.numpy``)."""
        x = xp.asarray(x)
        if dim < 0:  # used whole: equal pieces of the flattened values
            flat = xp.ravel(x)
            return xp.pad(flat, (0, self.tp * size - flat.size)).reshape(self.tp, size)
        shape = x.shape
        split = shape[:dim] + (self.tp, shape[dim] // self.tp) + shape[dim + 1:]
        return xp.moveaxis(x.reshape(split), dim, 0).reshape(self.tp, size)

    def unflatten(self, flat: jax.Array) -> PyTree:
        """Flat ``[n_pad]`` (or ``[n]``) buffer -> unit subtree, in ``flat``'s dtype.

        With tensor parallelism ``flat`` is ``[tp, n_pad]``; inside a step (a mesh whose
        ``"model"`` axis XLA partitions) each rebuilt leaf is constrained to its
        tensor-parallel sharding, so every device computes with its slice only. A numpy
        buffer gives numpy leaves (views, no device programs)."""
        if flat.shape[-1] < self.n:
            raise ValueError(f"unit {self.name!r}: flat buffer {flat.shape} shorter than {self.n}")
        leaves, offset = [], 0
        host = isinstance(flat, np.ndarray)
        xp = np if host else jnp
        if self.tp > 1:
            if flat.ndim != 2 or flat.shape[0] != self.tp:
                raise ValueError(f"unit {self.name!r}: tensor-parallel flat buffer must be "
                                 f"[{self.tp}, n], got {flat.shape}")
            for shape, dim, size in zip(self.shapes, self.tp_dims, self.sizes):
                piece = (flat[:, offset:offset + size] if host
                         else jax.lax.slice_in_dim(flat, offset, offset + size, axis=1))
                whole = self._whole(xp, piece, shape, dim)
                leaves.append(whole if host else _tp_constrained(whole, dim))
                offset += size
            return jax.tree_util.tree_unflatten(self.treedef, leaves)
        for shape, size in zip(self.shapes, self.sizes):
            piece = (flat[offset:offset + size] if host
                     else jax.lax.slice_in_dim(flat, offset, offset + size))
            leaves.append(piece.reshape(shape))
            offset += size
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _whole(self, xp: Any, piece: Any, shape: tuple[int, ...], dim: int) -> Any:
        """``[tp, size]`` slices of one leaf -> the leaf (inverse of ``_slices``)."""
        if dim < 0:
            return piece.reshape(-1)[: math.prod(shape)].reshape(shape)
        block = shape[:dim] + (shape[dim] // self.tp,) + shape[dim + 1:]
        return xp.moveaxis(piece.reshape((self.tp,) + block), 0, dim).reshape(shape)


def _array_module(leaves: list) -> Any:
    """numpy if every leaf is a numpy array (or a Python/numpy scalar), else jax.numpy."""
    return np if all(isinstance(x, (np.ndarray, np.generic, int, float)) for x in leaves) else jnp


def _as_jax_would(x: Any) -> np.ndarray:
    """``x`` as numpy in the dtype ``jnp.asarray`` gives it (float64 -> float32 unless
    ``jax_enable_x64``), so the numpy path rounds exactly as the jax one."""
    x = np.asarray(x)
    return x.astype(jax.dtypes.canonicalize_dtype(x.dtype), copy=False)


def _tp_constrained(x: jax.Array, dim: int) -> jax.Array:
    """``x`` constrained to be split on ``dim`` over ``"model"`` (replicated for -1) when
    traced under a mesh whose ``"model"`` axis XLA partitions; as it is elsewhere (host
    values, a mesh without that axis)."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = slice_axis(mesh)
    if axis is None:
        return x
    if mesh.axis_types[mesh.axis_names.index(axis)] == jax.sharding.AxisType.Manual:
        return x
    spec = [None] * x.ndim
    if dim >= 0:
        spec[dim] = axis
    return jax.lax.with_sharding_constraint(x, P(*spec))


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def make_unit_layout(
    path: tuple[str, ...], subtree: PyTree, num_shards: int, align: int = 1,
    layer: int | None = None, tp: int = 1, tp_dims: PyTree = None,
) -> UnitLayout:
    """The layout of one unit, its flat length padded to a multiple of ``num_shards*align``.
    ``layer``: the subtree is layer ``layer`` of a scanned stack at ``path``. ``tp``: the
    tensor-parallel degree, with ``tp_dims`` a tree like ``subtree`` of each leaf's
    dimension split over ``"model"`` (-1: used whole)."""
    leaves, treedef = jax.tree_util.tree_flatten(subtree)
    name = unit_name(path, layer)
    for leaf_path, leaf in jax.tree_util.tree_flatten_with_path(subtree)[0]:
        if not _is_float(leaf):
            raise TypeError(
                f"parameter {name}{jax.tree_util.keystr(leaf_path)} has dtype "
                f"{jnp.result_type(leaf)}; ZeRO shards only floating-point parameters. Keep "
                "integer state in another Flax collection (not 'params')."
            )
    shapes = tuple(tuple(int(d) for d in jnp.shape(x)) for x in leaves)
    if tp > 1:
        dims = tuple(int(d) for d in jax.tree_util.tree_leaves(tp_dims))
        if len(dims) != len(shapes):
            raise ValueError(f"unit {name!r}: {len(dims)} tensor-parallel dims for "
                             f"{len(shapes)} parameters")
        lay = UnitLayout(name, path, treedef, shapes, 0, 0, num_shards, layer, tp, dims)
        n = sum(lay.sizes)
        return dataclasses.replace(lay, n=n, n_pad=padded_length(n, num_shards, align))
    n = sum(math.prod(s) for s in shapes)
    return UnitLayout(name, path, treedef, shapes, n, padded_length(n, num_shards, align),
                      num_shards, layer)


def padded_length(n: int, num_shards: int, align: int = 1) -> int:
    """``n`` elements padded to a (nonzero) multiple of ``num_shards * align``."""
    quantum = num_shards * align
    return max(quantum, -(-n // quantum) * quantum)


# -- splitting a model's params tree into units -----------------------------------------------


def default_unit_paths(params: Mapping[str, Any]) -> tuple[tuple[str, ...], ...]:
    """Every direct child module of the root (top-level keys whose value is a dict)."""
    return tuple((k,) for k, v in params.items() if isinstance(v, Mapping))


def _get(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    for k in path:
        if not isinstance(tree, Mapping) or k not in tree:
            raise KeyError("/".join(map(str, path)))
        tree = tree[k]
    return tree


def _without(tree: Mapping[str, Any], paths: Iterable[tuple[str, ...]]) -> dict:
    """Copy of ``tree`` without the subtrees at ``paths`` (empty dicts left behind dropped)."""
    paths = [p for p in paths if p]
    out = {}
    for k, v in tree.items():
        inner = [p[1:] for p in paths if p[0] == k]
        if any(len(p) == 0 for p in inner):
            continue
        if inner and isinstance(v, Mapping):
            v = _without(v, inner)
            if not v:
                continue
        out[k] = v
    return out


def split_units(
    params: Mapping[str, Any], unit_paths: Sequence[tuple[str, ...]]
) -> tuple[dict[tuple[str, ...], PyTree], dict]:
    """``params`` -> ({unit path: subtree}, rest subtree without any unit)."""
    units = {}
    for p in unit_paths:
        try:
            units[p] = _get(params, p)
        except KeyError:
            raise ValueError(
                f"unit path {'/'.join(map(str, p))!r} is not in the model's params; top-level names "
                f"are {list(params)}"
            ) from None
    for a in unit_paths:
        for b in unit_paths:
            if a != b and b[: len(a)] == a:
                raise ValueError(f"unit {'/'.join(map(str, b))!r} is nested inside unit {'/'.join(map(str, a))!r}")
    return units, _without(params, unit_paths)


def merge_units(rest: Mapping[str, Any], units: Mapping[tuple[str, ...], PyTree]) -> dict:
    """Inverse of ``split_units``."""
    def put(tree: dict, path: tuple[str, ...], value: Any) -> None:
        for k in path[:-1]:
            tree = tree.setdefault(k, {})
        tree[path[-1]] = value

    def copy_dicts(t: Any) -> Any:
        return {k: copy_dicts(v) for k, v in t.items()} if isinstance(t, Mapping) else t

    out = copy_dicts(rest)
    for path, sub in units.items():
        put(out, path, sub)
    return out



def unit_of(path: tuple, units: Mapping[str, Any]) -> str | None:
    """The unit a leaf at key path ``path`` of a per-unit tree (an optimizer state: Adam's
    ``mu[name]``) belongs to: the last dict key on it naming one of ``units``; None for a
    leaf of no unit (a step count)."""
    for k in reversed(path):
        key = getattr(k, "key", None)
        if isinstance(key, str) and key in units:
            return key
    return None
