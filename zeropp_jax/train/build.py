"""Turning a model's params into a ``TrainState``'s parts: the steps of ``TrainState.create``.

Each function does one step, in the order ``create`` calls them: check the arguments, split
the variables dict, pick the units (scan stacks included), split off the frozen parameters,
lay each unit out flat, place the primary shards on the mesh and initialise the optimizer on
them. Validation lives in the ``check_*`` functions, so ``create`` raises its errors in a
fixed order.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.comm.frozen import (
    FrozenFilter,
    FrozenShards,
    as_predicate,
    split_frozen,
)
from zeropp_jax.comm.offload import OffloadPolicy, offload_mask
from zeropp_jax.comm.transports import TransportPlan, frozen_format
from zeropp_jax.comm.partition import (
    REST,
    UnitLayout,
    make_unit_layout,
    split_units,
    stack_layers,
    unit_name,
)
from zeropp_jax.comm.placement import (
    REPLICATED,
    SHARDED,
    global_spec,
    place,
    place_replicated,
    sharded_spec,
    sliced_sharded,
)
from zeropp_jax.core import compat
from zeropp_jax.core.mesh import MeshInfo, manual_axes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.train.optim import check_elementwise
from zeropp_jax.train.tensor_parallel import TensorParallel, layer_dim
from zeropp_jax.units.adapters import ModelAdapter
from zeropp_jax.units.wrap import resolve_units, scan_stacks

PyTree = Any
Path = tuple[str, ...]


def check_arguments(params: PyTree, config: Any) -> None:
    """Raises TypeError if ``params`` is missing or ``config`` is not a ``ZeroPPConfig``."""
    if params is None:
        raise TypeError("TrainState.create needs params= (model.init(...)['params'])")
    if not isinstance(config, ZeroPPConfig):
        raise TypeError(f"config must be a ZeroPPConfig, got {type(config).__name__}")


def split_variables(
    params: PyTree, collections: Mapping[str, PyTree] | None, batch_stats: PyTree
) -> tuple[PyTree, dict[str, PyTree]]:
    """``(params, collections)``: the ``"params"`` tree, and the other non-empty variable
    collections (from ``collections``, ``batch_stats`` and a whole variables dict)."""
    collections = dict(collections or {})
    if batch_stats is not None:
        collections["batch_stats"] = batch_stats
    if isinstance(params, Mapping) and "params" in params and isinstance(
        params["params"], Mapping
    ) and all(isinstance(v, Mapping) for v in params.values()):
        # The whole variables dict of model.init: params plus other collections.
        collections = {**{k: v for k, v in params.items() if k != "params"},
                       **collections}
        params = params["params"]
    collections = {k: v for k, v in collections.items() if jax.tree_util.tree_leaves(v)}
    return params, collections


def check_setup(params: PyTree, tx: optax.GradientTransformation, plan: TransportPlan,
                mesh: MeshInfo) -> None:
    """Raises if there are no parameters, ``tx`` is not elementwise, or the hpZ group size
    of ``plan`` does not fit ``mesh``."""
    if not isinstance(params, Mapping) or not jax.tree_util.tree_leaves(params):
        raise ValueError(
            "the model has no parameters, so there is nothing for ZeRO to shard; "
            "check that params comes from model.init(...)['params']"
        )
    check_elementwise(tx)
    plan.secondary_devices(mesh)  # raises naming the valid hpZ sizes


def stack_paths(stacked: Sequence[str | Sequence[str]], units: Any,
                params: PyTree) -> tuple[Path, ...]:
    """The module paths of the scanned stacks, as tuples of names: ``stacked``, plus those
    ``wrap.scan_stacks`` finds under the default ``units`` policy."""
    stacked = tuple(tuple(p.split("/")) if isinstance(p, str) else tuple(p) for p in stacked)
    if units is None or (isinstance(units, str) and units == "auto"):
        # The default policy also finds nn.scan stacks (each layer its own unit).
        stacked += tuple(p for p in scan_stacks(params) if p not in stacked)
    return stacked


def split_into_units(
    params: PyTree, units: Any, adapter: ModelAdapter, stacked: tuple[Path, ...]
) -> tuple[dict[Path, PyTree], PyTree]:
    """``(unit_trees, rest)``: each unit's subtree by module path (the ``units`` policy's
    units, then the stacks), and the parameters in no unit."""
    # A scanned stack is a unit per layer by construction: no policy looks inside it.
    unit_paths = tuple(
        p for p in resolve_units(units, params, adapter)
        if not any(p[: len(s)] == s or s[: len(p)] == p for s in stacked))
    return split_units(params, unit_paths + stacked)


def check_frozen(frozen: FrozenFilter | None, stacked: tuple[Path, ...],
                 config: ZeroPPConfig) -> None:
    """Raises if ``frozen`` is given with scan stacks or a stage other than 3, or if
    ``config.quantize_frozen`` is set with no ``frozen`` filter."""
    if stacked and frozen is not None:
        raise NotImplementedError(
            "frozen parameters inside nn.scan stacks are not supported yet; freeze "
            "parameters outside the stacked modules, or pass no stacked= paths"
        )
    if frozen is not None:
        if config.stage != 3:
            raise NotImplementedError(
                "frozen parameters need ZeRO stage 3 (stages 1 and 2 keep full replicated "
                "weights, which the frozen layout does not cover); use stage=3"
            )
    elif frozen_format(config) is not None:  # frozen storage configured, nothing frozen
        raise ValueError(
            "config.quantize_frozen=True but no parameters are frozen: pass "
            "TrainState.create(..., frozen=<filter>)"
        )


def split_frozen_units(
    unit_trees: dict[Path, PyTree], rest: PyTree, frozen: FrozenFilter | None
) -> tuple[dict[Path, PyTree], PyTree, dict[Path, PyTree]]:
    """``(unit_trees, rest, frozen_trees)``: the trainable part of each unit (units left
    empty dropped) and of the rest, and each unit's frozen part by path (``()``: the rest's).
    Raises ValueError if ``frozen`` freezes everything."""
    if frozen is None:
        return unit_trees, rest, {}
    is_frozen = as_predicate(frozen)
    split = {p: split_frozen(sub, is_frozen, p) for p, sub in unit_trees.items()}
    split[()] = split_frozen(rest, is_frozen, ())
    unit_trees = {p: t for p, (t, _) in split.items() if p != () and t}
    rest = split[()][0]
    frozen_trees = {p: f for p, (_, f) in split.items() if f}
    if not unit_trees and not jax.tree_util.tree_leaves(rest):
        raise ValueError(
            "the frozen filter freezes every parameter, so there is nothing to train; "
            "check the filter (it gets each parameter's path, e.g. ('block_0', 'attn', "
            "'qkv', 'kernel'), and returns True for frozen ones)"
        )
    return unit_trees, rest, frozen_trees


def unit_layouts(
    unit_trees: Mapping[Path, PyTree], rest: PyTree, stacked: tuple[Path, ...],
    num_devices: int, align: int, tp: TensorParallel | None = None,
) -> tuple[dict[str, UnitLayout], dict[str, PyTree]]:
    """``(layouts, trees)`` by unit name: each unit's flat layout over ``num_devices``
    shards, one per layer of a stack, then the rest unit (``REST``) if it holds any leaf.
    With ``tp``, each layout holds ``tp.size`` tensor-parallel slices."""
    layouts: dict[str, UnitLayout] = {}
    trees: dict[str, PyTree] = {}
    dims, rest_dims = (split_units(tp.dims, tuple(unit_trees)) if tp is not None
                       else ({}, None))
    size = 1 if tp is None else tp.size
    for path, sub in unit_trees.items():
        subs = stack_layers(sub, path) if path in stacked else [sub]
        layer_dims = dims.get(path)
        if path in stacked and layer_dims is not None:
            layer_dims = jax.tree_util.tree_map(
                lambda d, p=path: layer_dim(d, p), layer_dims)
        for i, layer_tree in enumerate(subs):
            lay = make_unit_layout(path, layer_tree, num_devices, align,
                                   layer=i if path in stacked else None, tp=size,
                                   tp_dims=layer_dims)
            layouts[lay.name], trees[lay.name] = lay, layer_tree
    if jax.tree_util.tree_leaves(rest):
        layouts[REST] = make_unit_layout((), rest, num_devices, align, tp=size,
                                         tp_dims=rest_dims)
        trees[REST] = rest
    return layouts, trees


def frozen_layouts(frozen_trees: Mapping[Path, PyTree], num_devices: int,
                   plan: TransportPlan, tp: TensorParallel | None = None
                   ) -> dict[str, UnitLayout]:
    """The flat layout of each unit's frozen part, by unit name (whole blocks of its
    storage: ``TransportPlan.frozen_alignment``), in ``tp.size`` slices with ``tp``."""
    dims: dict = {}
    if tp is not None and frozen_trees:
        dims, rest = split_units(tp.frozen_dims, tuple(p for p in frozen_trees if p))
        dims[()] = rest
    return {
        unit_name(p): make_unit_layout(p, f, num_devices, plan.frozen_alignment(),
                                       tp=1 if tp is None else tp.size, tp_dims=dims.get(p))
        for p, f in frozen_trees.items()
    }


def is_abstract(tree: PyTree) -> bool:
    """True if ``tree``'s leaves are ``jax.ShapeDtypeStruct`` (``jax.eval_shape(model.init,
    ...)``): ``TrainState.create`` then builds an abstract state, shapes and shardings only,
    for ahead-of-time compilation. Raises if it mixes abstract leaves and arrays."""
    kinds = {isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree)}
    if len(kinds) > 1:
        raise TypeError(
            "params mixes jax.ShapeDtypeStruct leaves and arrays: pass all shapes "
            "(jax.eval_shape(model.init, ...)) for an abstract state, or all arrays")
    return kinds == {True}


def flat_numpy(layout: UnitLayout, tree: PyTree, dtype: Any) -> np.ndarray | jax.ShapeDtypeStruct:
    """A unit's subtree as its flat padded numpy array of ``dtype`` (``layout.global_shape``);
    its shape and dtype only for an abstract tree."""
    if is_abstract(tree):
        return jax.ShapeDtypeStruct(layout.global_shape, np.dtype(dtype))
    return np.asarray(layout.flatten(jax.tree_util.tree_map(np.asarray, tree), dtype))


def cast_to(x: np.ndarray | jax.ShapeDtypeStruct, dtype: Any
            ) -> np.ndarray | jax.ShapeDtypeStruct:
    """``x`` in ``dtype``: a numpy array's values, or an abstract array's dtype."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, np.dtype(dtype))
    return x.astype(dtype)


def master_sharding(mesh: Mesh, offload: OffloadPolicy) -> NamedSharding:
    """Where the primary shards live: split over ``("node", "local")``, in each device's
    pinned host memory with ``offload.params``."""
    return NamedSharding(mesh, SHARDED,
                         memory_kind=compat.HOST_MEMORY if offload.params else None)


def place_units(layouts: Mapping[str, UnitLayout], trees: Mapping[str, PyTree], dtype: Any,
                sharding: NamedSharding, cast: Any = None) -> dict[str, jax.Array]:
    """Each unit flattened in ``dtype`` (then cast to ``cast`` if given) and placed on
    ``sharding``: primary shards for ``SHARDED``, full copies for ``REPLICATED``."""
    out = {}
    for name, lay in layouts.items():
        flat = flat_numpy(lay, trees[name], dtype)
        where = sharding
        if lay.tp > 1:  # tensor-parallel slices: over "model", each one's shards as usual
            spec = (sliced_sharded(sharding.mesh) if sharding.spec == SHARDED
                    else P(None, *sharding.spec))
            where = NamedSharding(sharding.mesh, spec, memory_kind=sharding.memory_kind)
        out[name] = place(flat if cast is None else cast_to(flat, cast), where)
    return out


def opt_state_specs(tx: optax.GradientTransformation, layouts: Mapping[str, UnitLayout],
                    dtype: Any) -> PyTree:
    """PartitionSpec of each optimizer-state leaf: sharded if it follows the parameters.

    A leaf is per-parameter (Adam's moments) if its shape follows the shard length, and
    global otherwise (a step count). Decided by initialising abstractly at two different
    shard lengths, so it holds on a one-device mesh too, where local and global shapes agree.
    """
    def state_at(scale: int) -> PyTree:
        shapes = {k: jax.ShapeDtypeStruct(lay.global_shape[:-1] + (scale * lay.shard_len,),
                                          dtype)
                  for k, lay in layouts.items()}
        return jax.eval_shape(tx.init, shapes)

    return jax.tree_util.tree_map(
        lambda a, b: REPLICATED if a.shape == b.shape else sharded_spec(len(a.shape)),
        state_at(1), state_at(2))


def init_opt_state(tx: optax.GradientTransformation, mesh: Mesh, specs: PyTree,
                   master: Mapping[str, jax.Array],
                   offloaded: frozenset[str] = frozenset()) -> PyTree:
    """``tx.init`` on each device's primary shards of ``master``; leaves placed per
    ``specs`` over ``("node", "local")``, those of the ``offloaded`` units
    (``offload.offload_mask``; ``OffloadPolicy.units`` picks them) in
    each device's pinned host memory."""
    host = offload_mask(specs, master, offloaded)

    def init(m: Mapping[str, jax.Array]) -> PyTree:
        state = tx.init(compat.on_device(m))  # offloaded shards: the state is the device's
        return compat.in_host_memory(state, host) if offloaded else state

    in_specs = ({k: sharded_spec(len(v.shape)) for k, v in master.items()},)
    # Tensor-parallel slices stay split over "model" (XLA would be free to replicate them).
    out = jax.tree_util.tree_map(
        lambda s, h: NamedSharding(mesh, global_spec(s, mesh),
                                   memory_kind=compat.HOST_MEMORY if h else None),
        specs, host)
    init_all = jax.jit(
        jax.shard_map(init, mesh=mesh, in_specs=in_specs, out_specs=specs, **manual_axes(mesh)),
        out_shardings=out)
    if is_abstract(master):
        return jax.tree_util.tree_map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
            jax.eval_shape(init_all, master), out)
    return init_all(master)


def replicated_zero(mesh: Mesh, abstract: bool = False) -> jax.Array | jax.ShapeDtypeStruct:
    """A counter: int32 zero, replicated on every device of ``mesh`` (its shape only if
    ``abstract``)."""
    zero = jax.ShapeDtypeStruct((), np.int32) if abstract else np.zeros((), np.int32)
    return place(zero, NamedSharding(mesh, REPLICATED))


def place_collections(collections: PyTree, mesh: Mesh) -> PyTree:
    """Every leaf of the variable collections, full and replicated on ``mesh``."""
    return jax.tree_util.tree_map(
        lambda x: place_replicated(x, NamedSharding(mesh, REPLICATED)), collections)


def store_frozen(
    layouts: Mapping[str, UnitLayout],
    trees: Mapping[Path, PyTree],
    plan: TransportPlan,
    mesh: Mesh,
) -> FrozenShards:
    """Frozen subtrees -> their primary shards on ``mesh`` (split over the data axes),
    quantized if ``plan``'s config says so."""
    config = plan.config
    values, scales = {}, {}
    for name, lay in layouts.items():
        flat = flat_numpy(lay, trees[lay.path], config.param_jnp_dtype)
        stored = plan.store_frozen(flat, lay)
        sharding = NamedSharding(mesh, sliced_sharded(mesh) if lay.tp > 1 else SHARDED)
        values[name] = place(stored[0], sharding)
        if len(stored) > 1:
            scales[name] = place(stored[1], sharding)
    # bits and block_size describe quantized storage (checkpoint metadata).
    return FrozenShards(values, scales, bool(scales), config.weight_bits, config.block_size)


def check_feedback(plan: TransportPlan, layouts: Mapping[str, UnitLayout],
                   mesh: MeshInfo) -> None:
    """Raises if the gradient transport keeps errors between steps (qgZ's error feedback,
    on a mesh where it quantizes) for a unit that is a layer of a scanned stack."""
    if any(lay.layer is not None and plan.feedback(lay.n_pad, mesh)[0]
           for lay in layouts.values()):
        raise ValueError(
            "qgz_error_feedback does not support scanned layer stacks (nn.scan / "
            "nnx.scan): their layers share one unit call. Unroll the stack, or "
            "turn the feedback off")
