"""Tensor parallelism's plan for a run: which dimension of each parameter the ``"model"``
mesh axis splits, read from the model's Flax partitioning metadata and the logical-axis
rules (``TrainState.create(logical_axis_rules=..., param_axes=...)``), and what it does not
combine with yet.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh

from zeropp_jax.comm.frozen import as_predicate, split_frozen
from zeropp_jax.comm.transports import frozen_format, plan_of
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import MODEL, mesh_shape, model_size
from zeropp_jax.units.adapters import ModelAdapter

PyTree = Any


def layer_dim(dim: int, path: tuple[str, ...]) -> int:
    """A stacked parameter's split dimension (counting the leading layer axis) -> one
    layer's."""
    if dim == 0:
        raise ValueError(
            f"the layer axis of the nn.scan stack {'/'.join(path)!r} maps to {MODEL!r}; "
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


def _model_dim(names: Any, mesh_axes: Any, where: str) -> int:
    """The dimension of a parameter whose sharding names ``mesh_axes`` (one entry per
    dimension) that is split over ``"model"``; -1 if none."""
    found = [i for i, a in enumerate(mesh_axes or ())
             if a == MODEL or (isinstance(a, tuple) and MODEL in a)]
    if len(found) > 1:
        raise ValueError(f"parameter {where} is split over {MODEL!r} on dimensions {found} "
                         f"({names}); at most one dimension can be")
    for i, a in enumerate(mesh_axes or ()):
        if isinstance(a, tuple) and set(a) - {MODEL} and MODEL in a:
            raise ValueError(f"parameter {where}: dimension {i} maps to {a}; ZeRO shards over "
                             f"the data axes itself, so map it to {MODEL!r} alone")
    return found[0] if found else -1


def annotated(raw: PyTree, params: PyTree, adapter: ModelAdapter) -> PyTree:
    """The params tree with its partitioning metadata: ``params`` as the user passed them
    (linen's boxes), else the adapter's (an NNX model's sharding metadata), else the
    plain tree."""
    if raw is not None:
        return raw
    return adapter.partitioning() if hasattr(adapter, "partitioning") else params


def tensor_parallel(raw_params: PyTree, rules: Sequence[tuple[str, Any]] | None,
                    param_axes: Sequence[tuple[str, Sequence[Any]]] | None, mesh: Mesh,
                    config: ZeroPPConfig, frozen: Any) -> TensorParallel | None:
    """The run's tensor parallelism: None on a mesh without a ``"model"`` axis. Each
    parameter's split dimension comes from its Flax partitioning metadata
    (``nn.with_logical_partitioning`` or ``nnx.with_partitioning`` names through ``rules``,
    or ``nn.with_partitioning`` mesh axes), or for a parameter without any from the first
    ``param_axes`` entry ``(regex, names)`` whose regex ``re.search``-matches its
    ``"/"``-joined path. Raises for what tensor parallelism does not support yet, naming
    it."""
    size = model_size(mesh)
    if size == 1:
        return None
    unsupported = [
        ("stage=3", config.stage != 3),
        ("quantize_frozen=False", frozen_format(config) is not None),
        ("qgz_error_feedback=False",
         plan_of(config).feedback(1 << 20, *mesh_shape(mesh))[0] > 0)]
    missing = [need for need, bad in unsupported if bad]
    if missing:
        raise NotImplementedError(
            f"tensor parallelism (a {MODEL!r} mesh axis of size {size}) needs "
            f"{', '.join(missing)} for now")
    if isinstance(raw_params, Mapping) and "params" in raw_params and all(
            isinstance(v, Mapping) for v in raw_params.values()):
        raw_params = raw_params["params"]
    rules = tuple((str(name), axis) for name, axis in (rules or ()))

    patterns = [(re.compile(rx), tuple(names)) for rx, names in (param_axes or ())]

    def dim(path: Any, leaf: Any) -> int:
        where = jax.tree_util.keystr(path)
        if not isinstance(leaf, (nn.LogicallyPartitioned, nn.Partitioned)):
            joined = "/".join(str(getattr(k, "key", k)) for k in path)
            names = next((n for rx, n in patterns if rx.search(joined)), None)
            if names is None:
                return -1
            if len(names) != np.ndim(leaf):
                raise ValueError(f"param_axes gives {joined} the names {names}, one per "
                                 f"dimension, but its shape is {np.shape(leaf)}")
            leaf = nn.LogicallyPartitioned(leaf, names)
        if isinstance(leaf, nn.LogicallyPartitioned):
            axes = nn.logical_to_mesh_axes(leaf.names, rules)
            d = _model_dim(leaf.names, axes, where)
        else:
            d = _model_dim(leaf.names, leaf.names, where)
        shape = np.shape(nn.meta.unbox(leaf))
        if d >= 0 and shape[d] % size:
            raise ValueError(
                f"parameter {where} of shape {shape} is split over {MODEL!r} on dimension {d}, "
                f"which {size} devices do not divide; pick a {MODEL!r} axis size dividing "
                f"{shape[d]}, or map that dimension's logical name to None")
        return d

    dims = jax.tree_util.tree_map_with_path(
        dim, raw_params, is_leaf=lambda x: isinstance(x, nn.meta.AxisMetadata))
    model_rules = tuple((name, MODEL if axis == MODEL or (isinstance(axis, tuple) and
                                                           MODEL in axis) else None)
                        for name, axis in rules)
    frozen_dims = None
    if frozen is not None:
        dims, frozen_dims = split_frozen(dims, as_predicate(frozen))
    return TensorParallel(size, dims, model_rules, frozen_dims)
