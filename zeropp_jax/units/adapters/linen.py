"""Flax linen models: the ``ModelAdapter`` that runs an unmodified linen module unit by unit.

``LinenAdapter.run_units`` runs ``model.apply`` under ``flax.linen.intercept_methods``. Every
call of a unit's method (a unit is a submodule chosen by the wrap policy) is replaced by
``units[path](fn)``: ``fn`` runs the method on an unbound copy of the module with the weights
it is given, and the caller (the unit transform, or generation) decides where those weights
come from. ``Stacked`` units are the layers of an ``nn.scan`` stack, whose shards ride
through the scan as one ``[layers, shard]`` parameter. Nothing in the model's code changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn
from flax import errors
import jax
import numpy as np

from zeropp_jax.comm.frozen import merge_trees
from zeropp_jax.comm.partition import STACKED_SHARD
from zeropp_jax.units.adapters.base import Path, PyTree, Stacked, UnitCalls, call_with_variables


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _write_back(module: nn.Module, mutable: Any, out: Any) -> Any:
    """A unit call's ``(output, updated collections)`` -> output, with the updates written
    into ``module``'s scope of the outer apply (which returns them); ``out`` as it is if
    no collection is mutable."""
    if mutable is False:
        return out
    result, updates = out
    for col, tree in updates.items():
        if col == "params":  # mutable=True returns the (gathered) weights too: not state
            continue
        for name, value in tree.items():
            module.scope.put_variable(col, name, value)
    return result


def external_modules(module: nn.Module) -> dict[str, nn.Module]:
    """Attribute name -> bound module, for ``module``'s dataclass attributes that are
    modules owned outside ``module`` (a shared ``nn.Embed`` passed to an encoder). A
    sequence attribute's items are named as Flax adopts them (``name_0``, ``name_1``)."""
    own = tuple(module.path)
    out: dict[str, nn.Module] = {}
    for field in dataclasses.fields(module):
        if field.name in ("parent", "name"):
            continue
        value = getattr(module, field.name, None)
        items = ([(field.name, value)] if isinstance(value, nn.Module) else
                 [(f"{field.name}_{i}", v) for i, v in enumerate(value)]
                 if isinstance(value, (list, tuple)) else [])
        for name, sub in items:
            if isinstance(sub, nn.Module) and sub.scope is not None:
                if tuple(sub.path)[: len(own)] != own:
                    out[name] = sub
    return out


class _UnitInterceptor:
    """Routes calls of unit modules through ``zero_unit``; passes every other call through."""

    def __init__(self, units: Mapping[tuple[str, ...], Callable[[Callable], Callable]],
                 order: Any = None,
                 externals: set[tuple[str, ...]] | None = None):
        # units[path](fn) -> call(*arrays): runs ``fn(params_tree, *arrays)`` on that unit's
        # gathered weights (ZeRO-3: through zero_unit's custom_vjp; generation: a plain
        # gather from the hpZ secondary).
        self.units = units
        self.order = order
        self.externals = externals
        # > 0 while running inside a unit: its own submodules are not units.
        self.depth = 0

    @contextlib.contextmanager
    def _inside_unit(self):
        self.depth += 1
        try:
            yield
        finally:
            self.depth -= 1

    def __call__(self, next_fun: Callable, args: tuple, kwargs: dict, context: Any) -> Any:
        module = context.module
        if self.depth or module.scope is None:
            return next_fun(*args, **kwargs)
        path = tuple(module.path)
        make_call = self.units.get(path)
        if make_call is None:
            return next_fun(*args, **kwargs)

        unbound = module.clone(parent=None)
        method = context.method_name
        # RNG streams the caller passed to apply (e.g. "dropout"): draw one key per stream
        # from the unit's place in the outer model, so the unit gets the keys it would have
        # had, and backward's recomputation reuses them (they are residuals like any input).
        streams = sorted(module.scope.rngs) if module.scope.rngs else []
        rngs = {name: module.make_rng(name) for name in streams}
        # Modules handed to this unit as attributes but owned elsewhere (a shared embedding
        # passed to an encoder): the unbound copy adopts them under the attribute's name,
        # so their weights are read from the outer model here and passed in as arrays
        # (their gradient flows back to their owner; they are resident: find_resident).
        outside = external_modules(module)
        if self.externals is not None:
            self.externals.update(tuple(sub.path) for sub in outside.values())
        shared = {name: sub.variables.get("params", {}) for name, sub in outside.items()}
        # Other collections (BatchNorm's batch_stats) go in as arrays; the mutable ones the
        # outer apply asked for come back out and are written into the outer scope.
        cols = {c: v for c, v in module.variables.items() if c != "params"}
        mutable = module.scope.mutable
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs, rngs, shared, cols))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def fn(params: PyTree, *arrays: jax.Array) -> Any:
            filled = list(leaves)
            for i, a in zip(dynamic, arrays):
                filled[i] = a
            call_args, call_kwargs, call_rngs, call_shared, call_cols = (
                jax.tree_util.tree_unflatten(treedef, filled))
            if call_shared:
                params = merge_trees(params, call_shared)
            with self._inside_unit():
                return unbound.apply(
                    {"params": params, **call_cols}, *call_args, method=method,
                    rngs=call_rngs or None, mutable=mutable, **call_kwargs,
                )

        arrays = [leaves[i] for i in dynamic]
        if isinstance(make_call, Stacked):
            # One iteration of an nn.scan stack: nn.scan has sliced this layer's shard out
            # of the stacked shards. Ordering is the scan's own; tracers of its body must
            # not leak into the order of the units around it.
            shard = module.scope.get_variable("params", STACKED_SHARD)
            return _write_back(module, mutable, make_call.make(fn, shard)(*arrays))
        try:
            out = _write_back(module, mutable, make_call(fn)(*arrays))
        except errors.ScopeParamShapeError as e:
            raise ValueError(
                f"unit {'/'.join(map(str, path))!r} received its weights with another shape than its "
                "call expects. If it is an nn.scan stack (parameters with a leading layer "
                f"axis), pass TrainState.create(..., stacked=[{'/'.join(map(str, path))!r}])."
            ) from e
        if self.order is not None:
            self.order.record(out)
        return out


@dataclasses.dataclass(frozen=True, eq=False)
class LinenAdapter:
    """A Flax linen module as a ``ModelAdapter`` (compared by identity).

    Attributes:
      module: the unbound linen module (``module.apply({"params": ...}, ...)`` works).
    """

    module: nn.Module
    kind: str = "linen"

    def run_units(self, units: UnitCalls, rest: PyTree, *args: Any,
                  method: str | Callable | None = None, order: Any = None,
                  externals: set[Path] | None = None,
                  collections: Mapping[str, PyTree] | None = None, **kwargs: Any) -> Any:
        """``module.apply({"params": rest}, ...)`` with every call of a unit module routed
        through ``units[path](fn)(*arrays)``. Units nested inside another unit's call are
        not intercepted."""
        interceptor = _UnitInterceptor(units, order, externals)
        variables = {"params": rest, **(collections or {})}
        with nn.intercept_methods(interceptor):
            return self.apply(variables, *args, method=method, **kwargs)

    def apply(self, variables: Mapping[str, PyTree], *args: Any,
              method: str | Callable | None = None, **kwargs: Any) -> Any:
        if method is None:
            return self.module.apply(variables, *args, **kwargs)
        return self.module.apply(variables, *args, method=method, **kwargs)

    call = staticmethod(call_with_variables)

    def module_classes(self, params: Mapping[str, PyTree]) -> dict[Path, str]:
        """The modules made in ``setup``, found by binding the module to ``params`` and
        running the setups (inline ``nn.compact`` modules exist only during a call; the
        wrap policy reads their class from Flax's automatic names)."""
        classes: dict[Path, str] = {}
        try:
            bound = self.module.bind({"params": params})

            def walk(mod: Any, path: Path) -> None:
                mod._try_setup()
                for name, child in mod._state.children.items():
                    if isinstance(child, nn.Module):
                        classes[path + (name,)] = type(child).__name__
                        walk(child, path + (name,))

            walk(bound, ())
        except Exception:  # noqa: BLE001 - setup may need call-time state; use names
            pass
        return classes

    def to_pure_dict(self, tree: PyTree) -> PyTree:
        return tree
