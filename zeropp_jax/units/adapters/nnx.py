"""Flax NNX models: an ``nnx.Module`` run unit by unit on primary shards.

``NNXModel.from_module(module)`` splits the module into its graph definition, its
parameters (``nnx.Param``) and its other state (``BatchStat``, RNG counters, ...), as plain
nested dicts with string keys (``blocks/0/lin/kernel``), so the engine cuts and shards them
like a linen params tree; the other state becomes replicated collections (``batch_stats``,
``rngs``, ...). Inside a step, ``run_units`` merges a module whose unit submodules hold no
weights (shape-only stand-ins: reading one outside its unit is an error, never a silent
zero) and reroutes each unit submodule's methods: a call gathers the unit's weights, builds
a fresh copy of the submodule from them and runs the method there (under ``zero_unit``),
then writes the submodule's updated state (BatchNorm statistics, RNG counts) back. A
scanned stack is one unit per layer, in either of Flax's forms: a scanned function calling
each layer, or an ``@nnx.scan``-decorated method of the stack (``_scan_layers``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from zeropp_jax.comm import collectives
from zeropp_jax.core import compat
from zeropp_jax.comm.partition import STACKED_SHARD
from zeropp_jax.core.mesh import AXES
from zeropp_jax.comm.placement import is_prng_key
from zeropp_jax.units.adapters.base import Stacked, call_with_variables

PyTree = Any
Path = tuple[str, ...]


class LayerShards(nnx.Param):
    """This device's primary shards of a scanned stack's layers, ``[layers, shard_len]``,
    attached to the stack module for one step. A parameter, so ``nnx.scan`` slices it on
    its leading axis together with the layers' weights (also under ``StateAxes`` filters
    keyed on ``nnx.Param``): each iteration's unit call reads its own layer's shard."""


def is_nnx(model: Any) -> bool:
    return isinstance(model, nnx.Module)


def _collection(var: Any) -> str:
    """The collection name a non-parameter NNX variable is kept under."""
    if isinstance(var, nnx.BatchStat):
        return "batch_stats"
    if isinstance(var, nnx.RngState):
        return "rngs"
    return type(var).__name__.lower()


def _put(tree: dict, path: Path, value: Any) -> None:
    for k in path[:-1]:
        tree = tree.setdefault(k, {})
    tree[path[-1]] = value


def _get(tree: Mapping[str, Any], path: Path) -> Any:
    for k in path:
        if not isinstance(tree, Mapping) or k not in tree:
            return None
        tree = tree[k]
    return tree


def _to_flat(state: Any) -> Any:
    """(path, variable) pairs of an nnx.State (flax >= 0.12: nnx.to_flat_state)."""
    return nnx.to_flat_state(state) if hasattr(nnx, "to_flat_state") else state.flat_state()


def _from_flat(flat: list) -> Any:
    return (nnx.from_flat_state(flat) if hasattr(nnx, "from_flat_state")
            else nnx.State.from_flat_path(flat))


def _value(var: Any) -> Any:
    return var.get_value() if hasattr(var, "get_value") else var.value


@dataclasses.dataclass(frozen=True, eq=False)
class NNXModel:
    """An ``nnx.Module`` as a ``ModelAdapter`` (compared by identity).

    Attributes:
      graphdef: the module's ``nnx`` graph definition.
      params: the parameters' ``nnx.State`` (shapes only), the template values are put in.
      others: the other state's ``nnx.State`` (shapes only).
      keys: string path -> the original NNX path (attribute names and list indices).
      modules: string path of each submodule -> its original path and class name.
    """

    graphdef: Any
    params: Any
    others: Any
    keys: dict[Path, tuple]
    modules: dict[Path, tuple[tuple, str]]
    kind: str = "nnx"
    # The routed subclass of each unit class (``_route``), made once for this run and kept
    # here, not on the user's class: it is freed with the run.
    routed: dict = dataclasses.field(default_factory=dict, repr=False)

    @property
    def module(self) -> "NNXModel":
        """What runs: this split form (``merge`` rebuilds the module from trees)."""
        return self

    call = staticmethod(call_with_variables)

    def module_classes(self, params: Mapping[str, Any]) -> dict[Path, str]:
        """Every submodule's class, from the graph (no call needed)."""
        return {p: c for p, (_, c) in self.modules.items()}

    @classmethod
    def from_module(cls, module: nnx.Module) -> tuple["NNXModel", dict, dict]:
        """-> (model, params tree, {collection: tree}), trees with string keys."""
        graphdef, params, others = nnx.split(module, nnx.Param, ...)
        keys: dict[Path, tuple] = {}
        tree: dict = {}
        for path, var in _to_flat(params):
            spath = tuple(str(k) for k in path)
            keys[spath] = tuple(path)
            _put(tree, spath, jnp.asarray(_value(var)))
        collections: dict[str, dict] = {}
        for path, var in _to_flat(others):
            spath = tuple(str(k) for k in path)
            keys[spath] = tuple(path)
            _put(collections.setdefault(_collection(var), {}), spath, _value(var))
        modules = {tuple(str(k) for k in path): (tuple(path), type(node).__name__)
                   for path, node in nnx.graph.iter_graph(module)
                   if isinstance(node, nnx.Module) and path}
        abstract = lambda s: jax.tree_util.tree_map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), s)
        return cls(graphdef, abstract(params), abstract(others), keys, modules), tree, collections

    def partitioning(self) -> dict:
        """A string-keyed tree like the params tree: each parameter's shape and dtype,
        boxed in ``nn.LogicallyPartitioned`` with the names of its NNX sharding metadata
        (``nnx.with_partitioning``) where it has them (tensor parallelism reads them)."""
        import flax.linen as nn
        import numpy as np

        tree: dict = {}
        for path, var in _to_flat(self.params):
            value = _value(var)
            shape = jax.ShapeDtypeStruct(np.shape(value), value.dtype)
            names = compat.nnx_sharding_names(var)
            _put(tree, tuple(str(k) for k in path),
                 shape if names is None else nn.LogicallyPartitioned(shape, names))
        return tree

    def to_pure_dict(self, tree: Mapping[str, Any]) -> dict:
        """A string-keyed tree -> the same with NNX's own keys (list indices as ints), as
        ``nnx.State.to_pure_dict()`` gives and ``nnx.replace_by_pure_dict`` takes."""
        out: dict = {}
        for spath, value in _flat(tree):
            _put(out, self.keys.get(spath, spath), value)
        return out

    def params_from(self, given: Any, own: Mapping[str, Any]) -> dict:
        """User-given parameters (an ``nnx.State`` or its pure dict, any key types) -> a
        string-keyed tree like ``own`` (the module's), checked path by path and shape by
        shape."""
        if isinstance(given, nnx.State):
            flat = {tuple(str(k) for k in p): _value(v) for p, v in _to_flat(given)}
        else:
            flat = {tuple(str(k) for k in p): v for p, v in _flat(given)}
        mine = dict(_flat(own))
        if flat.keys() != mine.keys():
            missing = sorted("/".join(p) for p in mine.keys() - flat.keys())[:4]
            extra = sorted("/".join(p) for p in flat.keys() - mine.keys())[:4]
            raise ValueError(f"params do not match the NNX model's parameters: missing "
                             f"{missing}, unexpected {extra}")
        tree: dict = {}
        for p, v in flat.items():
            if jnp.shape(v) != jnp.shape(mine[p]):
                raise ValueError(f"parameter {'/'.join(p)}: shape {jnp.shape(v)}, the model "
                                 f"has {jnp.shape(mine[p])}")
            _put(tree, p, jnp.asarray(v))
        return tree

    # -- building modules from trees ------------------------------------------------------

    def _state(self, template: Any, values: Mapping[Path, Any], prefix: tuple = ()) -> Any:
        """``template`` (an nnx.State below ``prefix``) with each variable's value from
        ``values`` (string path from the root -> value); missing ones keep the template's
        shape-only stand-in."""
        flat = []
        for path, var in _to_flat(template):
            full = tuple(str(k) for k in prefix + tuple(path))
            flat.append((path, var.replace(value=values.get(full, _value(var)))))
        return _from_flat(flat)

    def merge(self, params: Mapping[Any, Any], collections: Mapping[str, Any]) -> nnx.Module:
        """A module from (partial) params and collection trees (string keys, or NNX's own
        as ``state.consolidate()`` returns them)."""
        values = {tuple(map(str, p)): v for p, v in _flat(params)}
        for tree in collections.values():
            values.update({tuple(map(str, p)): v for p, v in _flat(tree)})
        return nnx.merge(self.graphdef, self._state(self.params, values),
                         self._state(self.others, values))

    def state_of(self, module: nnx.Module, prefix: Path = ()) -> dict[str, dict]:
        """{collection: string-keyed tree} of ``module``'s non-parameter state; paths are
        prefixed with ``prefix`` (the module's place in the whole model)."""
        out: dict[str, dict] = {}
        for path, var in _to_flat(nnx.state(module, nnx.Not(nnx.Param))):
            spath = prefix + tuple(str(k) for k in path)
            _put(out.setdefault(_collection(var), {}), spath, _value(var))
        return out

    # -- linen-style apply (stages 1 and 2, one device) -----------------------------------

    def apply(self, variables: Mapping[str, Any], *args: Any, method: Any = None,
              mutable: Any = False, rngs: Any = None, **kwargs: Any) -> Any:
        """``model.apply``-style call: ``variables`` holds "params" and the collections."""
        del rngs  # NNX modules carry their own RNG state (the "rngs" collection)
        collections = {k: v for k, v in variables.items() if k != "params"}
        module = self.merge(variables["params"], _per_device(collections))
        out = _call(module, method, args, kwargs)
        return self._finish(module, out, collections, mutable)

    def _finish(self, module: nnx.Module, out: Any, collections: Mapping[str, Any],
                mutable: Any) -> Any:
        new = self.state_of(module)
        given = {k: dict(_flat(v)) for k, v in collections.items()}
        for k, tree in new.items():
            # RNG keys never change in NNX (counts do); the step folded the device index
            # into them, so give back the replicated ones it received.
            for p, v in _flat(tree):
                if is_prng_key(v) and p in given.get(k, {}):
                    _put(tree, p, given[k][p])
        changed = sorted(k for k, tree in new.items()
                         if any(v is not given.get(k, {}).get(p) for p, v in _flat(tree)))
        if mutable in (False, None):
            if changed:
                raise ValueError(
                    f"this NNX model updated its state {sorted(changed)} during the call "
                    "(BatchNorm statistics, dropout RNG counts). Ask for it: "
                    "out, updates = state.apply_fn(..., mutable=True), and keep it with "
                    "state.apply_gradients(grads=grads, **updates); otherwise every step "
                    "would reuse the old statistics and the same dropout masks"
                )
            return out
        if mutable is not True:
            names = [mutable] if isinstance(mutable, str) else list(mutable)
            new = {k: v for k, v in new.items() if k in names}
        return out, new

    # -- inside a ZeRO-3 step -------------------------------------------------------------

    def run_units(self, units: Mapping[Path, Callable], rest: PyTree, *args: Any,
                  method: Any = None, order: Any = None, externals: Any = None,
                  collections: Mapping[str, Any] | None = None, mutable: Any = False,
                  rngs: Any = None, **kwargs: Any) -> Any:
        """The module's call with every call of a unit submodule's methods routed through
        ``units[path](fn)(*arrays)`` (see ``base.ModelAdapter.run_units``). ``rest`` holds the weights
        outside the routed units (string-keyed, partial)."""
        del rngs, externals
        collections = dict(collections or {})
        module = self.merge(rest, _per_device(collections))
        for path, make_call in units.items():
            if path not in self.modules:
                raise ValueError(f"unit {'/'.join(path)!r} is not a submodule of this NNX model")
            sub = _lookup(module, self.modules[path][0])
            if isinstance(make_call, Stacked):
                setattr(sub, STACKED_SHARD, LayerShards(_get(rest, path + (STACKED_SHARD,))))
            _route(sub, path, make_call, self, order)
        out = _call(module, method, args, kwargs)
        return self._finish(module, out, collections, mutable)


def _flat(tree: Any, prefix: tuple = ()) -> list[tuple[tuple, Any]]:
    """(path, leaf) pairs of a nested dict, keys as they are (strings or list indices)."""
    if isinstance(tree, Mapping):
        return [kv for k, v in tree.items() for kv in _flat(v, prefix + (k,))]
    return [(prefix, tree)]


def _call(module: nnx.Module, method: Any, args: tuple, kwargs: dict) -> Any:
    if method is None:
        return module(*args, **kwargs)
    if callable(method) and not isinstance(method, str):
        return method(module, *args, **kwargs)
    return getattr(module, method)(*args, **kwargs)


def _lookup(module: Any, path: tuple) -> Any:
    for k in path:
        module = module[k] if isinstance(k, int) else getattr(module, k)
    return module


def _per_device(collections: Mapping[str, Any]) -> dict[str, Any]:
    """RNG keys with this device's index folded in (each device draws its own dropout
    masks, as each rank does under DDP/DeepSpeed). Inside ``shard_map``."""
    index = collectives.axis_index(AXES)
    return {k: jax.tree_util.tree_map(
        lambda x: jax.random.fold_in(x, index) if is_prng_key(x) else x, v)
        for k, v in collections.items()}


# At most this many functions are looked through for a method's nnx.scan (its decorators'
# wrappers and their closures are a handful; the bound keeps a strange closure graph cheap).
_SCAN_SEARCH_LIMIT = 256


def _scan_cell(method: Callable) -> Any | None:
    """The closure cell that holds the body of the outermost ``nnx.scan`` among
    ``method``'s decorators, or None if ``method`` does not scan.

    The body holder is Flax's ``ScanFn`` (graph updates on, the default) or
    ``SimpleScanFn``: a dataclass whose ``f`` is what each iteration calls, on the sliced
    arguments. Flax has no public handle on it, so it is found by walking the wrappers
    (``__wrapped__``) and their closures, breadth first (outermost first)."""
    try:
        from flax.nnx.transforms import iteration
    except ImportError:  # a Flax that keeps its scan elsewhere: the caller's error says so
        return None
    kinds = tuple(k for k in (getattr(iteration, n, None) for n in ("ScanFn", "SimpleScanFn"))
                  if isinstance(k, type) and dataclasses.is_dataclass(k))
    todo, seen = [method], set()
    while todo and len(seen) < _SCAN_SEARCH_LIMIT:
        f = todo.pop(0)
        if id(f) in seen:
            continue
        seen.add(id(f))
        for cell in getattr(f, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # a cell not yet filled
                continue
            if isinstance(value, kinds) and callable(getattr(value, "f", None)):
                return cell
            if callable(value) and not isinstance(value, type):
                todo.append(value)
        wrapped = getattr(f, "__wrapped__", None)
        if wrapped is not None:
            todo.append(wrapped)
    return None


def _is_layer(node: Any) -> bool:
    """True if ``node`` is one layer of a routed stack: a module whose layer shards a scan
    sliced to this layer's ``[shard_len]``."""
    return (isinstance(node, nnx.Module) and hasattr(node, STACKED_SHARD)
            and jnp.ndim(_value(getattr(node, STACKED_SHARD))) == 1)


def _scan_layers(me: nnx.Module, path: Path, name: str, method: Callable, args: tuple,
                 kwargs: dict, run_layer: Callable) -> Any:
    """``method(me, *args, **kwargs)`` on a whole scanned stack ``me`` (its weights
    ``[layers, ...]``, its shards ``[layers, shard_len]``), each layer run as its own unit.

    Flax's NNX guide puts the scan on the stack's own method (``@nnx.scan(in_axes=(0,
    nnx.Carry), out_axes=nnx.Carry)`` on ``__call__``, ``@nnx.remat`` below it if you
    like). The routed method is then entered once, outside the scan, with every layer;
    a layer's unit can only run inside the scan's body, after the scan sliced the stack.
    So for this call the body Flax runs each iteration is replaced by one that runs the
    original body (``nnx.remat`` and all) on the iteration's layer as that layer's unit:
    exactly what the other idiom (a scanned function calling ``layer(x)``) does. The
    replacement is a new body holder, put in the scan's closure and taken out afterwards:
    JAX caches traced scan bodies by the body object, so the original one never gets a
    trace that runs units.

    Raises ValueError if ``method`` does not scan over the stack itself (the stack would
    be gathered whole, or its stand-in weights read)."""
    where = "/".join(map(str, path))
    cell = _scan_cell(method)
    if cell is None:
        raise ValueError(
            f"{where}.{name} was called on the whole scanned stack {where!r} (parameters "
            "with a leading layer axis, one unit per layer) but is not an nnx.scan over it, "
            "so its layers cannot be gathered one at a time. Scan over the stack: decorate "
            "the method with @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry), or call "
            "nnx.scan(lambda layer, x: layer(x), in_axes=(0, nnx.Carry), "
            f"out_axes=nnx.Carry)({where}, x); or gather the stack whole as one unit: "
            f"TrainState.create(..., units=[{where!r}, ...])"
            + (f". (It is decorated: if that is an nnx.scan, this Flax ({flax.__version__}) "
               "keeps the scan's body where zeropp_jax does not look, which knows Flax "
               "0.12's; use the scanned-function form above.)"
               if hasattr(method, "__wrapped__") else ""))
    holder = cell.cell_contents
    body = holder.f

    def layer_body(layer: Any, *rest: Any) -> Any:
        # Flax calls the body positionally (keyword arguments were resolved before the
        # scan), the method's ``self`` first: here the iteration's layer.
        if not _is_layer(layer):
            raise ValueError(
                f"{where}.{name}'s nnx.scan does not slice the stack {where!r} itself, so no "
                "iteration holds one layer: scan it on its leading axis, with in_axes=(0, "
                "...) (0 for self)")
        return run_layer(layer, body, rest, {})

    # Swapped for this call's trace only: a concurrent call of the same class's method
    # from another thread would see it (tracing a step is single-threaded).
    cell.cell_contents = dataclasses.replace(holder, f=layer_body)
    try:
        return method(me, *args, **kwargs)
    finally:
        cell.cell_contents = holder


def _route(sub: nnx.Module, path: Path, make_call: Callable, model: NNXModel,
           order: Any) -> None:
    """Makes ``sub``'s public methods run through ``make_call`` (one unit's gather).

    A scanned stack (``make_call`` a ``Stacked``) is routed one layer at a time: a method
    called on one layer (inside the user's ``nnx.scan``) runs as that layer's unit; a
    method called on the whole stack must be an ``nnx.scan`` over the stack itself
    (Flax's guide form, ``@nnx.scan`` on ``__call__``), whose body then runs each layer
    as its unit (``_scan_layers``)."""
    original = type(sub)
    stacked = isinstance(make_call, Stacked)

    def run(me: nnx.Module, name: str, args: tuple, kwargs: dict) -> Any:
        method = getattr(original, name)
        if stacked and jnp.ndim(_value(getattr(me, STACKED_SHARD))) == 2:
            # The whole stack (its shards still ``[layers, shard_len]``): no scan sliced
            # it yet, so the method itself must scan over its layers.
            return _scan_layers(me, path, name, method, args, kwargs, run_layer)
        return run_layer(me, method, args, kwargs)

    def run_layer(me: nnx.Module, method: Callable, args: tuple, kwargs: dict) -> Any:
        """``method(me, *args, **kwargs)`` as ``me``'s unit: ``me`` is ``sub``, or inside
        ``nnx.scan`` / ``nnx.vmap`` the copy the transform made of it (one layer of a
        stack: its weights ``[...]`` and its shard ``[shard_len]`` sliced)."""
        shard = _value(getattr(me, STACKED_SHARD)) if stacked else None
        # Split now, as the original class: the module's flags (``.eval()``, set after
        # the merge) are part of the graph definition a fresh copy is built from. The
        # layer's shard is not part of the module the user wrote.
        object.__setattr__(me, "__class__", original)
        if stacked:
            delattr(me, STACKED_SHARD)
        try:
            graphdef, params, _ = nnx.split(me, nnx.Param, ...)
        finally:
            object.__setattr__(me, "__class__", routed)
            if stacked:
                setattr(me, STACKED_SHARD, LayerShards(shard))
        others = model.state_of(me, path)
        expected = {tuple(str(k) for k in model.modules[path][0] + tuple(p)): jnp.shape(_value(v))
                    for p, v in _to_flat(params)}
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs, others))
        dynamic = [i for i, leaf in enumerate(leaves) if isinstance(leaf, jax.Array)]

        def fn(unit_params: PyTree, *arrays: jax.Array) -> Any:
            filled = list(leaves)
            for i, a in zip(dynamic, arrays):
                filled[i] = a
            call_args, call_kwargs, call_others = jax.tree_util.tree_unflatten(treedef, filled)
            values = {path + p: v for p, v in _flat(unit_params)}
            for key, v in values.items():
                if key in expected and jnp.shape(v) != expected[key]:
                    # A whole nnx.scan stack as one unit: each iteration's layer would
                    # receive every layer's weights.
                    raise ValueError(
                        f"unit {'/'.join(path)!r} received {'/'.join(key)} with shape "
                        f"{jnp.shape(v)} where its call expects {expected[key]}. If it is "
                        "an nnx.scan stack (parameters with a leading layer axis), leave it "
                        "to the default unit policy, which makes each layer a unit, or pass "
                        f"TrainState.create(..., stacked=[{'/'.join(path)!r}])")
            for tree in call_others.values():
                values.update(dict(_flat(tree)))
            fresh = nnx.merge(graphdef, model._state(params, values, model.modules[path][0]),
                              model._state(others_state, values, model.modules[path][0]))
            out = method(fresh, *call_args, **call_kwargs)
            # Only what the call changed goes out (an unchanged variable is the same
            # array object): outputs of the unit are new arrays whether or not they
            # differ, and the caller tells an updating call from a pure one by them.
            given = {p: v for tree in call_others.values() for p, v in _flat(tree)}
            new = {k: {"/".join(p): v for p, v in _flat(tree) if v is not given.get(p)}
                   for k, tree in model.state_of(fresh, path).items()}
            return out, {k: v for k, v in new.items() if v}

        others_state = nnx.state(me, nnx.Not(nnx.Param))
        call = make_call.make(fn, shard) if stacked else make_call(fn)
        out, new = call(*[leaves[i] for i in dynamic])
        values = {tuple(p.split("/")): v for tree in new.values() for p, v in tree.items()}
        if values:
            nnx.update(me, model._state(others_state, values, model.modules[path][0]))
        # Ordering inside a scan is the scan's own: its body's tracers must not leak into
        # the order of the units around it.
        if order is not None and not stacked:
            order.record(out)
        return out

    routed = model.routed.get(original)
    if routed is None:
        def method(name: str) -> Callable:
            def call(self: Any, *args: Any, **kwargs: Any) -> Any:
                return self._zeropp_run(self, name, args, kwargs)
            return call

        names = {n for klass in original.__mro__ if klass not in nnx.Module.__mro__
                 for n, v in vars(klass).items()
                 if callable(v) and (not n.startswith("_") or n == "__call__")}
        routed = type(f"ZeroUnit{original.__name__}", (original,),
                      {n: method(n) for n in names})
        model.routed[original] = routed
    object.__setattr__(sub, "_zeropp_run", run)
    object.__setattr__(sub, "__class__", routed)
