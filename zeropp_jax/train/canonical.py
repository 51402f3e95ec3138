"""A tensor-parallel train state in the layout of a mesh without a ``"model"`` axis.

On a ``(node, local, model)`` mesh a unit's buffers are ``[T, n_pad]``: one flat buffer per
tensor-parallel slice. What a checkpoint stores must not depend on the mesh, so a save first
rewrites such a state in the *canonical* layout: the same devices seen as a ``(node, local *
model)`` mesh (node-major, so each node keeps its devices), every unit one flat buffer of its
parameters in their natural order, split over all devices, exactly as a run without tensor
parallelism lays it out. A restore reads into the canonical layout and rewrites it into the
template's slices. Optimizer-state buffers laid out like the parameters (Adam's moments)
move with them, element for element; the rewrite is a permutation, so values are bit for bit
the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from zeropp_jax.comm.partition import UnitLayout, padded_length, unit_of
from zeropp_jax.comm.placement import REPLICATED, SHARDED, ShardedParams
from zeropp_jax.core import compat
from zeropp_jax.core.mesh import AXES, slice_axis
from zeropp_jax.train import build
from zeropp_jax.train.engine import Engine
from zeropp_jax.train.state import TrainState

PyTree = Any


def is_sliced(engine: Engine) -> bool:
    """True if the run lays its units out in tensor-parallel slices."""
    return any(lay.tp > 1 for lay in engine.layouts.values())


def data_mesh(mesh: Mesh) -> Mesh:
    """``mesh``'s devices as a ``(node, local * model)`` mesh (``mesh`` itself without a
    ``"model"`` axis)."""
    if not slice_axis(mesh):
        return mesh
    nodes, local, inner = mesh.devices.shape
    return Mesh(mesh.devices.reshape(nodes, local * inner), AXES)


def canonical_engine(engine: Engine) -> Engine:
    """``engine`` on ``data_mesh``: each unit one flat buffer of its parameters, split over
    all devices, with the optimizer-state specs that go with it."""
    mesh = data_mesh(engine.mesh)
    devices = mesh.devices.size
    align = engine.config.flat_alignment
    def whole(lay: UnitLayout, align: int) -> UnitLayout:
        return UnitLayout(lay.name, lay.path, lay.treedef, lay.shapes, lay.params,
                          padded_length(lay.params, devices, align), devices, lay.layer)

    layouts = {name: whole(lay, align) for name, lay in engine.layouts.items()}
    frozen = {name: whole(lay, engine.plan.frozen_alignment())
              for name, lay in engine.frozen_layouts.items()}
    opt_specs = build.opt_state_specs(engine.tx, layouts, engine.config.param_jnp_dtype)
    return dataclasses.replace(engine, mesh=mesh, layouts=layouts, opt_specs=opt_specs,
                               frozen_layouts=frozen, transports={}, tensor_rules=(),
                               memo={})


def _rewriter(source: UnitLayout, target: UnitLayout, sharding: NamedSharding) -> Any:
    """The jitted rewrite of one unit's buffer (the layouts and sharding fix the program:
    ``_rewrite`` keeps it in the target engine's memo, so a unit's moments, and later
    restores into the same template, share it)."""
    host = sharding.memory_kind == compat.HOST_MEMORY

    def rewrite(v: jax.Array) -> jax.Array:
        y = target.flatten(source.unflatten(compat.on_device(v)), v.dtype)
        return compat.in_host_memory(y) if host else y

    return jax.jit(rewrite, out_shardings=sharding)


def _rewrite(x: jax.Array, source: UnitLayout, target: UnitLayout,
             sharding: NamedSharding, memo: dict) -> jax.Array:
    """A unit's global buffer in ``source``'s layout -> the same values in ``target``'s, on
    ``sharding`` (memory kind included). An offloaded buffer is rewritten in device memory,
    one unit at a time, and goes back to pinned host memory if ``sharding`` says so.
    ``memo``: where the rewrite programs are kept (the target engine's)."""
    key = ("canonical_rewrite", source, target, sharding)
    if key not in memo:
        memo[key] = _rewriter(source, target, sharding)
    return memo[key](x)


def _put(x: Any, sharding: NamedSharding) -> Any:
    """A small leaf (a step count, a collection) onto ``sharding``, memory kind included."""
    return jax.device_put(x, sharding) if isinstance(x, jax.Array) else x


def _shape_only(x: jax.Array, source: UnitLayout, target: UnitLayout,
                sharding: NamedSharding, memo: dict) -> jax.ShapeDtypeStruct:
    """What ``_rewrite`` would give, as shape, dtype and sharding only."""
    del source, memo
    return jax.ShapeDtypeStruct(target.global_shape, x.dtype, sharding=sharding)


def _move(state: TrainState, engine: Engine, where: TrainState, rewrite: Any = _rewrite
          ) -> TrainState:
    """``state`` (on its engine's layouts) rewritten onto ``engine``'s layouts, every array
    leaf onto the sharding of the matching leaf of ``where`` (a tree of ``TrainState``'s
    structure whose leaves are ``NamedSharding``s, or arrays carrying them). ``rewrite``
    moves a unit buffer (``_rewrite``; ``_shape_only`` for its shape alone)."""
    old = state.engine
    sharding = lambda s: getattr(s, "sharding", s)  # noqa: E731 — an array, or a sharding

    def leaf(path: tuple, x: Any, spec: Any, to: Any) -> Any:
        name = unit_of(path, old.layouts)
        if name is None or spec == jax.sharding.PartitionSpec():
            return _put(x, sharding(to))
        return rewrite(x, old.layouts[name], engine.layouts[name], sharding(to),
                       engine.memo)

    params = ShardedParams(
        {k: rewrite(v, old.layouts[k], engine.layouts[k], sharding(where.params.units[k]),
                   engine.memo)
         for k, v in state.params.units.items()}, True, state.params.feedback)
    specs = jax.tree_util.tree_leaves(old.opt_specs)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(state.opt_state)
    targets = treedef.flatten_up_to(where.opt_state)
    opt = jax.tree_util.tree_unflatten(treedef, [
        leaf(p, x, s, t) for (p, x), s, t in zip(paths_leaves, specs, targets)])
    frozen = state.frozen
    if frozen is not None:  # stored as they are (not quantized: refused with a model axis)
        frozen = frozen.replace(values={
            k: rewrite(v, old.frozen_layouts[k], engine.frozen_layouts[k],
                       sharding(where.frozen.values[k]), engine.memo)
            for k, v in frozen.values.items()})
    small = lambda x, to: jax.tree_util.tree_map(  # noqa: E731
        lambda a, t: _put(a, sharding(t)), x, to)
    return state.replace(
        engine=engine, params=params, opt_state=opt, frozen=frozen,
        step=small(state.step, where.step),
        skipped_steps=small(state.skipped_steps, where.skipped_steps),
        collections=small(state.collections, where.collections))


def _shardings(state: TrainState, spec_of: Any) -> Any:
    """``state``'s array leaves -> ``spec_of(leaf)``; other leaves as they are."""
    return jax.tree_util.tree_map(
        lambda x: spec_of(x) if isinstance(x, jax.Array) else x, state)


def _canonical_shardings(state: TrainState, engine: Engine) -> TrainState:
    """Where each leaf of ``state`` goes in the canonical layout: a unit buffer (2-D
    tensor-parallel slices, or a 1-D flat buffer) split over all of ``engine``'s devices,
    scalars and collections whole; each in the memory kind it has in ``state``."""

    def spec_of(x: jax.Array) -> NamedSharding:
        split = x.ndim >= 1 and isinstance(x.sharding, NamedSharding) and any(
            a is not None for a in x.sharding.spec)
        return NamedSharding(engine.mesh, SHARDED if split else REPLICATED,
                             memory_kind=x.sharding.memory_kind)

    return _shardings(state, spec_of)


def to_canonical(state: TrainState) -> TrainState:
    """A tensor-parallel ``state`` in the canonical layout (``canonical_engine``), each
    leaf in the memory kind it has in ``state`` (an offloaded buffer stays in pinned host
    memory)."""
    engine = canonical_engine(state.engine)
    return _move(state, engine, _canonical_shardings(state, engine))


def canonical_template(state: TrainState) -> TrainState:
    """``to_canonical(state)`` as a template to restore into, without computing it: its
    unit buffers (parameters, their optimizer buffers, frozen values) are
    ``jax.ShapeDtypeStruct``s carrying their canonical shardings and memory kinds, so a
    restore neither allocates nor rewrites a copy of the template's values; the small
    leaves (counters, collections) are moved as they are."""
    engine = canonical_engine(state.engine)
    return _move(state, engine, _canonical_shardings(state, engine), _shape_only)


def from_canonical(state: TrainState, template: TrainState) -> TrainState:
    """``to_canonical``'s inverse: ``state`` (canonical) onto ``template``'s engine, every
    leaf on exactly the template leaf's sharding, memory kind included (a template whose
    optimizer state or unit shards are offloaded gets them back in pinned host memory, the
    step count where the template keeps it)."""
    return _move(state, template.engine, template)
