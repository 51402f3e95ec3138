"""Running an unmodified Flax linen model unit by unit on primary shards.

``apply_units`` runs ``model.apply`` under ``flax.linen.intercept_methods``. Every call of a
unit's method (a unit is a submodule, by default each direct child of the root) is replaced
by ``zero_unit``: gather that unit's weights, run the method on an unbound copy of the module
with the gathered weights, and let the custom_vjp regather and reduce-scatter in backward.
Nothing in the model's code changes.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import numpy as np

from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.partition import REST, UnitLayout
from zeropp_jax.unit import frozen_zero_unit, zero_unit

PyTree = Any


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _UnitInterceptor:
    """Routes calls of unit modules through ``zero_unit``; passes every other call through."""

    def __init__(self, units: Mapping[tuple[str, ...], Callable[[Callable], Callable]]):
        # units[path](fn) -> call(*arrays): runs ``fn(params_tree, *arrays)`` on that unit's
        # gathered weights (ZeRO-3: through zero_unit's custom_vjp; generation: a plain
        # gather from the hpZ secondary).
        self.units = units
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
        leaves, treedef = jax.tree_util.tree_flatten((args, kwargs, rngs))
        dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

        def fn(params: PyTree, *arrays: jax.Array) -> Any:
            filled = list(leaves)
            for i, a in zip(dynamic, arrays):
                filled[i] = a
            call_args, call_kwargs, call_rngs = jax.tree_util.tree_unflatten(treedef, filled)
            with self._inside_unit():
                return unbound.apply(
                    {"params": params}, *call_args, method=method, rngs=call_rngs or None,
                    **call_kwargs,
                )

        return make_call(fn)(*[leaves[i] for i in dynamic])


def run_units(
    model: nn.Module,
    units: Mapping[tuple[str, ...], Callable[[Callable], Callable]],
    rest: PyTree,
    *args: Any,
    method: str | Callable | None = None,
    **kwargs: Any,
) -> Any:
    """``model.apply({"params": rest}, ...)`` with every call of a unit module routed through
    ``units[path](fn)(*arrays)``, where ``fn(params_tree, *arrays)`` runs that call on the
    unit's weights. Units nested inside another unit's call are not intercepted."""
    interceptor = _UnitInterceptor(units)
    with nn.intercept_methods(interceptor):
        if method is None:
            return model.apply({"params": rest}, *args, **kwargs)
        return model.apply({"params": rest}, *args, method=method, **kwargs)


def apply_units(
    model: nn.Module,
    layouts: Mapping[str, UnitLayout],
    shards: Mapping[str, jax.Array],
    config: ZeroPPConfig,
    *args: Any,
    method: str | Callable | None = None,
    frozen_layouts: Mapping[str, UnitLayout] | None = None,
    frozen: Any = None,
    **kwargs: Any,
) -> Any:
    """``model.apply`` with ZeRO-3 parameters. Runs inside ``shard_map``.

    Args:
      model: the (unbound) Flax linen model.
      layouts: unit name -> layout of its trainable part, including the rest unit ``REST``
        if the model has parameters outside every unit.
      shards: unit name -> this device's primary shard ``[layout.shard_len]``.
      config: the run's settings.
      frozen_layouts: unit name -> layout of its frozen part (units with frozen params).
      frozen: a ``FrozenShards`` holding this device's frozen storage (with
        ``frozen_layouts``).
      *args, method, **kwargs: as for ``model.apply``.
    """
    frozen_layouts = frozen_layouts or {}
    if frozen_layouts and frozen is None:
        raise ValueError(
            "this model has frozen parameters but apply_fn found no frozen shards: call "
            "state.apply_fn inside a zeropp_jax.train_step, or pass "
            "{'params': state.params, 'frozen': state.frozen}"
        )

    def unit_call(name: str) -> Callable[[Callable], Callable]:
        layout, flayout = layouts.get(name), frozen_layouts.get(name)
        if flayout is None:
            return lambda fn: functools.partial(zero_unit(fn, layout, config), shards[name])
        from zeropp_jax.frozen import frozen_local_shards

        stored = frozen_local_shards(frozen, name)
        shard = shards[name] if layout is not None else None
        return lambda fn: functools.partial(
            frozen_zero_unit(fn, layout, flayout, config), shard, stored
        )

    names = set(layouts) | set(frozen_layouts)
    path_of = {name: (layouts.get(name) or frozen_layouts[name]).path for name in names}
    units = {path_of[name]: unit_call(name) for name in names if name != REST}
    rest: PyTree = {}
    if REST in names:
        # The rest unit's weights are used wherever the root likes, so they stay gathered
        # for the whole step (they are small by construction: no submodule owns them).
        rest = unit_call(REST)(lambda p: p)()
    return run_units(model, units, rest, *args, method=method, **kwargs)
