"""The model's call on ZeRO-3 primary shards: every unit through the unit transform.

``apply_units`` is framework-independent: it builds one ``zero_unit`` per unit (gather in
forward, regather and reduce-scatter in backward, through the unit's transports), ties each
gather to an earlier unit's output (``GatherOrder``), finds the units whose weights are read
outside their own calls (``find_resident``: they stay gathered for the step) and the unit
that keeps its weights for backward (``keep_last_unit``), lets the rest unit's collectives
ride in the first unit's (``units.bucket``), and asks the model's adapter to
run the call with unit calls routed to them.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from zeropp_jax.comm.frozen import frozen_local_shards, merge_trees
from zeropp_jax.comm.partition import REST, STACKED_SHARD, UnitLayout, merge_units
from zeropp_jax.comm.transports import TransportPlan, UnitTransports
from zeropp_jax.core import compat
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.units import deferral
from zeropp_jax.units import unit as unit_policies
from zeropp_jax.units.adapters.base import ModelAdapter, Stacked
from zeropp_jax.units.bucket import bucket_gather, bucketable
from zeropp_jax.units.ordering import GatherOrder
from zeropp_jax.units.unit import zero_unit

PyTree = Any


@dataclasses.dataclass(frozen=True, eq=False)
class UnitRun:
    """What ``apply_units`` needs of the run: fixed for as long as the run lives (the
    engine makes one, ``Engine.units_run``).

    Attributes:
      adapter: the model's adapter (``adapters.adapt``).
      plan: how the run's bytes travel (``comm.transports.TransportPlan``); its config is
        the run's settings.
      layouts: unit name -> layout of its trainable part, including the rest unit
        ``REST`` if the model has parameters outside every unit.
      frozen_layouts: unit name -> layout of its frozen part (units with frozen params).
      transports: unit name -> its transports (``TransportPlan.units``).
      warn_resident: warn when units must stay gathered for the whole step (the user
        chose them; the default policy's leftovers are resident without a word).
      memo: where ``find_resident`` keeps its answers for this model (the engine's), so
        a second trace of the same call does not trace the model again; None: no reuse.
    """

    adapter: ModelAdapter
    plan: TransportPlan
    layouts: Mapping[str, UnitLayout]
    frozen_layouts: Mapping[str, UnitLayout]
    transports: Mapping[str, UnitTransports]
    warn_resident: bool = False
    memo: dict | None = None

    @property
    def config(self) -> ZeroPPConfig:
        return self.plan.config


@dataclasses.dataclass(frozen=True)
class UnitInputs:
    """This device's values for one call (traced, inside ``shard_map``).

    Attributes:
      shards: unit name -> this device's primary shard ``[layout.shard_len]``.
      frozen: a ``FrozenShards`` holding this device's frozen storage (for units with
        frozen parts).
      feedback: unit name -> this device's kept qgZ errors (``config.qgz_error_feedback``;
        ``ShardedParams.feedback``); their gradient is the new errors.
      qgz_on: with ``config.qgz_until``, the traced bool choosing qgZ (True) or the plain
        reduce-scatter for this step; None: qgZ whenever ``config.qgz``.
      step: the traced optimizer step, for gradient transports whose randomness follows
        it (``config.qgz_signs="per_step"``); None: they use a fixed key.
      pipes: scanned stack path -> its pipe (``deferral.pipes``; Refs made outside the
        step's differentiation): each layer's gradient is reduced during later layers'
        backward (``config.qgz_defer``, ``units.deferral``). None or a missing path:
        reduced in its own backward.
    """

    shards: Mapping[str, jax.Array]
    frozen: Any = None
    feedback: Mapping[str, tuple] | None = None
    qgz_on: jax.Array | None = None
    step: jax.Array | None = None
    pipes: Mapping[tuple[str, ...], Any] | None = None


def apply_units(
    run: UnitRun,
    inputs: UnitInputs,
    *args: Any,
    method: str | Callable | None = None,
    collections: Mapping[str, PyTree] | None = None,
    **kwargs: Any,
) -> Any:
    """The model's call with ZeRO-3 parameters. Runs inside ``shard_map``.

    Args:
      run: the run's adapter, plan, layouts and transports (``UnitRun``).
      inputs: this device's shards and the step's traced values (``UnitInputs``).
      collections: the model's other variable collections (``batch_stats``), full and
        replicated; with ``mutable=`` the call returns ``(output, updated collections)``.
      *args, method, **kwargs: as for ``model.apply``.
    """
    adapter, config, layouts, transports = run.adapter, run.config, run.layouts, run.transports
    frozen_layouts = run.frozen_layouts or {}
    shards, frozen, qgz_on, step = inputs.shards, inputs.frozen, inputs.qgz_on, inputs.step
    feedback, pipes = inputs.feedback, inputs.pipes
    if frozen_layouts and frozen is None:
        raise ValueError(
            "this model has frozen parameters but apply_fn found no frozen shards: call "
            "state.apply_fn inside a zeropp_jax.train_step, or pass "
            "{'params': state.params, 'frozen': state.frozen}"
        )

    # Each unit's kept errors, handed from one call of the unit to the next (a tied
    # embedding runs twice): backward passes them back along the same chain.
    tokens: dict[str, tuple] = dict(feedback or {})

    def unit_call(name: str, keep: bool = False, arrived: tuple = ()
                  ) -> Callable[[Callable], Callable]:
        layout, flayout = layouts.get(name), frozen_layouts.get(name)
        stored = () if flayout is None else frozen_local_shards(frozen, name)
        shard = shards[name] if layout is not None else None

        def make(fn: Callable) -> Callable:
            unit = zero_unit(fn, layout, config, flayout, keep=keep,
                             transports=transports[name])

            def call(*arrays: Any) -> Any:
                kept = tokens.get(name, ())
                # Offloaded primary shards come to the device after the tie: no earlier
                # than the gather they feed.
                out = unit(compat.on_device(order.tie(shard)) if shard is not None else None,
                           stored, *arrays, qgz_on=qgz_on, step=step, arrived=arrived,
                           feedback=kept, order=order)
                if not kept:
                    return out
                out, tokens[name] = out
                return out

            return call

        return make

    order = GatherOrder(config.prefetch)
    names = {n for n in set(layouts) | set(frozen_layouts)
             if n not in layouts or layouts[n].layer is None}
    path_of = {name: (layouts.get(name) or frozen_layouts[name]).path for name in names}
    rest: PyTree = {}
    if REST in names:
        # Stand-ins with the rest unit's shapes while the model is probed (find_resident):
        # the real gather waits until it is known which unit shares its collectives.
        rest = jax.tree_util.tree_map(
            lambda s: unit_policies.varying(jnp.zeros(s, config.compute_jnp_dtype)),
            _unit_shapes(layouts.get(REST), frozen_layouts.get(REST)),
            is_leaf=lambda x: isinstance(x, tuple))
    stacked_units: dict[tuple[str, ...], Any] = {}
    stacked_shards: dict[tuple[str, ...], Any] = {}
    stacks: dict[tuple[str, ...], list[UnitLayout]] = {}
    for lay in layouts.values():
        if lay.layer is not None:
            stacks.setdefault(lay.path, []).append(lay)
    # Inside nn.scan, remat="minimal" keeps matmul outputs and collective results only
    # (measured: keeping every activation grew compiled temp memory by ~1x a layer's
    # weights per layer in a scan, against 0.6x this way; cause not yet found).
    stack_config = (dataclasses.replace(config, remat=unit_policies.minimal_policy)
                    if config.remat == "minimal" else config)
    if stacks and feedback:
        raise ValueError(
            "qgz_error_feedback does not support scanned layer stacks (nn.scan / "
            "nnx.scan): their layers share one unit call. Unroll the stack, or turn the "
            "feedback off")
    for path, lays in stacks.items():
        lays.sort(key=lambda lay: lay.layer)
        # Every layer has the same layout; nn.scan hands each iteration its row of this.
        rows = [compat.on_device(shards[lay.name]) for lay in lays]
        pipe = (pipes or {}).get(path)
        if pipe is None:
            stacked = jnp.stack(rows)  # [layers, shard_len]
        else:
            stacked = deferral.stack(rows, pipe, transports[lays[0].name].gradients,
                                     lays[0].n_pad, config.param_jnp_dtype, qgz_on, step)
        stacked_shards[path] = {STACKED_SHARD: stacked}
        rest = merge_units(rest, {path: stacked_shards[path]})

        def make(fn: Callable, shard: jax.Array, layout: UnitLayout = lays[0],
                 pipe: Any = pipe) -> Callable:
            unit = zero_unit(fn, layout, stack_config, transports=transports[layout.name])
            return lambda *arrays: unit(shard, (), *arrays, qgz_on=qgz_on, step=step,
                                        pipe=pipe)

        stacked_units[path] = Stacked(make)
    shapes = {path_of[name]: _unit_shapes(layouts.get(name), frozen_layouts.get(name))
              for name in names if name != REST}
    resident, calls = find_resident(adapter, shapes, stacked_units, rest,
                                    config.compute_jnp_dtype, args,
                                    {**kwargs, "collections": collections}, method,
                                    run.memo)
    # Units whose weights are read outside their own calls (a tied head reading
    # ``.variables``, a module passed to another unit as an attribute) are gathered once
    # for the whole step, like the rest unit: the gradient is the exact sum over every use.
    if resident and run.warn_resident:
        warnings.warn(
            f"units {sorted('/'.join(map(str, p)) for p in resident)} are read outside their own "
            "calls (a tied head reading .variables, a module passed to another unit, a "
            "wrapper that reads its weights itself), so they stay gathered for the whole "
            "step; results are exact, only their memory saving is lost. Choose units "
            "around them (TrainState.create(..., units=...)) to avoid it.", stacklevel=2)
    last = kept_unit(calls, {path_of[n]: _unit_size(layouts.get(n), frozen_layouts.get(n))
                              for n in names if n != REST})
    last = last if config.keep_last_unit else None
    partner = None
    if REST in names:
        # The rest unit's weights (outside every unit: small modules the wrap policy left,
        # root-level parameters) are used wherever the model likes: gathered for the step.
        # With config.bucket, the first unit the model calls shares its gather and its
        # gradient's reduce-scatter (units.bucket): both run at the step's two ends anyway.
        partner = _bucket_partner(run, calls, names, path_of, resident, last)
        if partner is None:
            # keep: its full weights are alive for the step anyway; a secondary or a
            # regather would only add to them.
            gathered_rest = unit_call(REST, keep=True)(lambda p: p)()
        else:
            (rest_full, _), (full, moved) = bucket_gather(
                transports[REST],
                compat.on_device((shards[REST], shards[partner])), config, qgz_on)
            gathered_rest, arrived = layouts[REST].unflatten(rest_full), (full, *moved)
        rest = merge_units(gathered_rest, stacked_shards)
    units: dict[tuple[str, ...], Any] = dict(stacked_units)
    for name in sorted(names - {REST}):
        if path_of[name] in resident:
            rest = merge_units(rest, {path_of[name]: unit_call(name)(lambda p: p)()})
        elif name == partner:
            units[path_of[name]] = unit_call(name, arrived=arrived)
        else:
            units[path_of[name]] = unit_call(name, path_of[name] == last)
    return adapter.run_units(units, rest, *args, method=method, order=order,
                             collections=collections, **kwargs)


def apply_from_source(
    adapter: ModelAdapter,
    layouts: Mapping[str, UnitLayout],
    frozen_layouts: Mapping[str, UnitLayout] | None,
    weights: Callable[[str], PyTree],
    dtype: Any,
    *args: Any,
    method: str | Callable | None = None,
    collections: Mapping[str, PyTree] | None = None,
    order: Any = None,
    memo: dict | None = None,
    **kwargs: Any,
) -> Any:
    """The model's call with each unit's full weights from ``weights``, no gradient path
    (generation). Inside ``shard_map``.

    ``weights(name)`` -> that unit's params tree (trainable and frozen parts merged), called
    when the unit runs, so its gather happens there. Units read outside their own calls (a
    tied head: ``find_resident``) and the rest unit are fetched once per call and read by
    the model like any params. ``dtype``: the compute dtype the weights arrive in.
    ``collections`` (e.g. ``{"cache": ...}``) and ``mutable=`` pass on to the model's
    apply. ``order``: a ``GatherOrder`` that records each unit's output. Scanned stacks
    are not supported (NotImplementedError naming the alternative).
    """
    frozen_layouts = frozen_layouts or {}
    if any(lay.layer is not None for lay in layouts.values()):
        raise NotImplementedError(
            "generation does not run nn.scan stacks (stacked=); create the generation "
            "state without stacked= (state.consolidate() gives the params tree), or decode "
            "from state.consolidate() on one device")
    names = set(layouts) | set(frozen_layouts)
    path_of = {name: (layouts.get(name) or frozen_layouts[name]).path for name in names}
    rest: PyTree = weights(REST) if REST in names else {}
    shapes = {path_of[name]: _unit_shapes(layouts.get(name), frozen_layouts.get(name))
              for name in names if name != REST}
    resident, _ = find_resident(adapter, shapes, {}, rest, dtype, args,
                                {**kwargs, "collections": collections}, method, memo)
    units: dict[tuple[str, ...], Any] = {}
    for name in sorted(names - {REST}):
        if path_of[name] in resident:
            rest = merge_units(rest, {path_of[name]: weights(name)})
        else:
            units[path_of[name]] = (
                lambda name: lambda fn: lambda *arrays: fn(weights(name), *arrays))(name)
    return adapter.run_units(units, rest, *args, method=method, order=order,
                             collections=collections, **kwargs)


def first_unit(calls: tuple[tuple[str, ...], ...]) -> tuple[str, ...] | None:
    """The unit (or stack) path called first, if every call of it comes before any other
    unit's call (``find_resident``'s ``calls``), else None: the unit whose gather can
    ride with the rest unit's at the start of the step without holding its weights
    longer."""
    if not calls:
        return None
    lead = next((i for i, path in enumerate(calls) if path != calls[0]), len(calls))
    return calls[0] if calls.count(calls[0]) == lead else None


def _bucket_partner(run: UnitRun, calls: tuple[tuple[str, ...], ...], names: set[str],
                    path_of: Mapping[str, tuple[str, ...]], resident: set[tuple[str, ...]],
                    kept: tuple[str, ...] | None) -> str | None:
    """The unit whose collectives the rest unit shares (``config.bucket``), or None.

    The first unit the model calls, if no other unit is called between its calls (one
    far later would hold its weights from the step's start to then), it is not a scanned stack, not
    resident and not the kept unit, and neither it nor the rest unit has frozen parameters
    or a transport that would change its values in a bucket (``bucket.bucketable``)."""
    layouts, frozen_layouts, transports = run.layouts, run.frozen_layouts, run.transports
    if not calls or REST not in layouts:
        return None
    by_path = {path_of[n]: n for n in names if n != REST}
    first = first_unit(calls)
    name = by_path.get(first)
    if (name is None or first in resident or first == kept or name not in layouts
            or REST in frozen_layouts or name in frozen_layouts):
        return None
    if not bucketable(run.plan, [transports[n] for n in (REST, name)]):
        return None
    if layouts[REST].num_shards != layouts[name].num_shards:
        return None
    return name


def _unit_size(layout: UnitLayout | None, frozen: UnitLayout | None) -> int:
    """A unit's parameter count, trainable and frozen parts together."""
    return sum(lay.n for lay in (layout, frozen) if lay is not None)


def kept_unit(calls: tuple[tuple[str, ...], ...],
               sizes: Mapping[tuple[str, ...], int]) -> tuple[str, ...] | None:
    """The unit that keeps its gathered weights for backward (``config.keep_last_unit``).

    The unit called once whose call comes last among such units: its backward runs first,
    after only the backwards of what was called after it. It keeps its weights only if
    those later calls (a tied head calling the embedding again) hold no more parameters
    than it does, so holding it costs at most what ``prefetch=1`` already holds (about
    two units' weights). None if no unit qualifies. ``calls``: unit and stack paths in
    forward order (``find_resident``); ``sizes``: parameters per unit path (stacks absent).
    """
    once = [i for i, path in enumerate(calls) if calls.count(path) == 1 and path in sizes]
    if not once:
        return None
    path = calls[once[-1]]
    later = set(calls[once[-1] + 1:])
    if any(p not in sizes for p in later):  # a scanned stack after it: its layers are many
        return None
    return path if sum(sizes[p] for p in later) <= sizes[path] else None


def _unit_shapes(layout: UnitLayout | None, frozen: UnitLayout | None) -> PyTree:
    """A unit's params tree of shapes (trainable and frozen parts merged)."""
    trees = [jax.tree_util.tree_unflatten(lay.treedef, lay.shapes)
             for lay in (layout, frozen) if lay is not None]
    return trees[0] if len(trees) == 1 else merge_trees(*trees)


def _resident_key(shapes: Mapping, stacked: Mapping, rest: PyTree, dtype: Any,
                  args: tuple, kwargs: dict, method: Any) -> Any:
    """A hashable description of everything find_resident's answer depends on, or None."""
    def describe(tree: Any) -> Any:
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        return treedef, tuple((tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else x
                              for x in leaves)

    key = (tuple(sorted(map(str, shapes))), tuple(sorted(map(str, stacked))),
           describe(shapes), describe(rest), str(dtype), describe((args, kwargs)), method)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def find_resident(
    adapter: ModelAdapter,
    shapes: Mapping[tuple[str, ...], PyTree],
    stacked: Mapping[tuple[str, ...], Any],
    rest: PyTree,
    dtype: Any,
    args: tuple,
    kwargs: dict,
    method: str | Callable | None,
    memo: dict | None = None,
) -> tuple[set[tuple[str, ...]], tuple[tuple[str, ...], ...]]:
    """The units that must stay gathered for the whole step, and the order of unit calls
    (unit and stack paths, one entry per call, forward order). Inside ``shard_map``.

    Traces the model once more (``jax.make_jaxpr``; nothing runs), with every unit call
    replaced by a call on fresh placeholder weights, and each unit's own weights present
    at its path as other placeholders. A placeholder read outside its unit's calls (a
    tied head reading ``.variables``, ``nn.Embed.attend`` on a path that is not the unit's
    call) shows up as a value the traced program uses: that unit is resident. A unit call
    that uses any parameter from outside itself (a module passed to it as an attribute)
    is resident too, with the unit whose weights it reads (a module passed as an attribute
    is handled by the interceptor instead: its owner becomes resident). Raises ValueError
    if the call reaches no parameter at all: a model that does not read its weights from
    the variables passed to ``apply`` would otherwise train with a zero gradient.

    Args:
      shapes: unit path -> its params tree of shapes (not the stacked units).
      stacked: path -> ``Stacked`` of the scanned stacks (always reached, never resident).
      rest: the gathered rest unit's params tree.
      dtype: the compute dtype the units' weights arrive in.
      memo: answers for this model by the call's static structure (the engine owns it:
        train_step traces its body twice, an abstract pass for the output structure and
        the real one, and the second asks the same question); None: always trace.
    """
    key = None if memo is None else _resident_key(shapes, stacked, rest, dtype, args, kwargs,
                                                  method)
    if key is not None and key in memo:
        resident, calls = memo[key]
        return set(resident), calls
    placeholders = {path: jax.tree_util.tree_map(
        lambda s: jnp.zeros(s, dtype), tree, is_leaf=lambda x: isinstance(x, tuple))
        for path, tree in shapes.items()}
    owner = {id(leaf): path for path, tree in placeholders.items()
             for leaf in jax.tree_util.tree_leaves(tree)}
    params_ids = set(owner) | {id(x) for x in jax.tree_util.tree_leaves(rest)}
    resident: set[tuple[str, ...]] = set()
    reached = [bool(stacked)]
    externals: set[tuple[str, ...]] = set()
    calls: list[tuple[str, ...]] = []

    def owner_of(path: tuple[str, ...]) -> tuple[str, ...] | None:
        return next((u for u in shapes if path[: len(u)] == u), None)

    def probe_unit(path: tuple[str, ...]) -> Callable[[Callable], Callable]:
        def make(fn: Callable) -> Callable:
            def call(*arrays: Any) -> Any:
                reached[0] = True
                calls.append(path)
                # Fresh weights made inside: only what fn reads from outside is a const.
                inner = lambda *a: fn(jax.tree_util.tree_map(  # noqa: E731
                    lambda s: jnp.zeros(s, dtype), shapes[path],
                    is_leaf=lambda x: isinstance(x, tuple)), *a)
                closed, shape = jax.make_jaxpr(inner, return_shape=True)(*arrays)
                outside = [c for c in closed.consts if id(c) in params_ids]
                if outside:
                    resident.add(path)
                    resident.update(owner[id(c)] for c in outside if id(c) in owner)
                # The output, from the recorded program (zeros would lose its device-varying
                # type, which an nn.scan carry must keep; tracing the model again is slow).
                flat = [x for x in jax.tree_util.tree_leaves(arrays)]
                out = compat.eval_jaxpr(closed, *flat)
                return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

            return call

        return make

    def probe_stacked(entry: Any, path: tuple[str, ...]) -> Stacked:
        def make(fn: Callable, shard: jax.Array) -> Callable:
            def call(*arrays: Any) -> Any:
                calls.append(path)
                return entry.make(fn, shard)(*arrays)

            return call

        return Stacked(make)

    probe = {path: probe_unit(path) for path in shapes}
    probe.update({path: probe_stacked(entry, path) for path, entry in stacked.items()})
    tree = merge_units(rest, placeholders)

    def run() -> list[jax.Array]:
        out = adapter.run_units(probe, tree, *args, method=method, externals=externals,
                                **kwargs)
        return [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]

    closed = jax.make_jaxpr(run)()
    # Modules passed to a unit as attributes are read from the outer model (and passed in
    # as arrays), so the units owning them stay gathered.
    resident.update(u for u in map(owner_of, externals) if u is not None)
    for c in closed.consts:
        if id(c) in owner:
            resident.add(owner[id(c)])
        if id(c) in params_ids:
            reached[0] = True
    if not reached[0] and (shapes or jax.tree_util.tree_leaves(rest)):
        raise ValueError(
            "the model's call used none of its parameters: no unit was called and no "
            "parameter was read, so training would see a zero gradient. The model must "
            "read its weights from the variables passed to apply (a wrapper that builds "
            "or keeps its own copy of them, e.g. an NNX module, can be passed to "
            "TrainState.create itself)."
        )
    if key is not None:
        memo[key] = (frozenset(resident), tuple(calls))
    return resident, tuple(calls)

