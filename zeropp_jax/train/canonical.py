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
from zeropp_jax.comm.placement import SHARDED, SLICED_SHARDED, ShardedParams
from zeropp_jax.core.mesh import AXES, MODEL
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
    if MODEL not in mesh.axis_names:
        return mesh
    nodes, local, model = mesh.devices.shape
    return Mesh(mesh.devices.reshape(nodes, local * model), AXES)


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


def _rewrite(x: jax.Array, source: UnitLayout, target: UnitLayout,
             sharding: NamedSharding) -> jax.Array:
    """A unit's global buffer in ``source``'s layout -> the same values in ``target``'s."""
    return jax.jit(lambda v: target.flatten(source.unflatten(v), v.dtype),
                   out_shardings=sharding)(x)


def _move(state: TrainState, engine: Engine, shardings: dict[str, NamedSharding]
          ) -> TrainState:
    """``state`` (on its engine's layouts) rewritten onto ``engine``'s layouts."""
    old = state.engine
    replicated = NamedSharding(engine.mesh, jax.sharding.PartitionSpec())

    def unit(name: str, x: jax.Array) -> jax.Array:
        return _rewrite(x, old.layouts[name], engine.layouts[name], shardings[name])

    def leaf(path: tuple, x: Any, spec: Any) -> Any:
        name = unit_of(path, old.layouts)
        if name is None or spec == jax.sharding.PartitionSpec():
            return jax.device_put(x, replicated) if isinstance(x, jax.Array) else x
        return unit(name, x)

    params = ShardedParams({k: unit(k, v) for k, v in state.params.units.items()}, True,
                           state.params.feedback)
    specs = jax.tree_util.tree_leaves(old.opt_specs)
    paths_leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)
    opt = jax.tree_util.tree_unflatten(paths_leaves[1], [
        leaf(p, x, s) for (p, x), s in zip(paths_leaves[0], specs)])
    frozen = state.frozen
    if frozen is not None:  # stored as they are (not quantized: refused with a model axis)
        frozen = frozen.replace(values={
            k: _rewrite(v, old.frozen_layouts[k], engine.frozen_layouts[k], shardings[k])
            for k, v in frozen.values.items()})
    return state.replace(
        engine=engine, params=params, opt_state=opt, frozen=frozen,
        step=jax.device_put(state.step, replicated),
        skipped_steps=jax.device_put(state.skipped_steps, replicated),
        collections=jax.device_put(state.collections, replicated))


def to_canonical(state: TrainState) -> TrainState:
    """A tensor-parallel ``state`` in the canonical layout (``canonical_engine``)."""
    engine = canonical_engine(state.engine)
    sharded = NamedSharding(engine.mesh, SHARDED)
    return _move(state, engine, {k: sharded for k in (*engine.layouts,
                                                      *engine.frozen_layouts)})


def from_canonical(state: TrainState, template: TrainState) -> TrainState:
    """``to_canonical``'s inverse: ``state`` (canonical) onto ``template``'s engine."""
    engine = template.engine
    sliced = {k: NamedSharding(engine.mesh, SLICED_SHARDED if lay.tp > 1 else SHARDED)
              for k, lay in (*engine.layouts.items(), *engine.frozen_layouts.items())}
    return _move(state, engine, sliced)
