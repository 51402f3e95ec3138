"""Running an unmodified Flax linen model unit by unit on primary shards.

``apply_units`` runs ``model.apply`` under ``flax.linen.intercept_methods``. Every call of a
unit's method (a unit is a submodule, by default each direct child of the root) is replaced
by ``zero_unit``: gather that unit's weights, run the method on an unbound copy of the module
with the gathered weights, and let the custom_vjp regather and reduce-scatter in backward.
Nothing in the model's code changes.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import numpy as np

from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.partition import REST, UnitLayout
from zeropp_jax.unit import zero_unit

PyTree = Any


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


class _UnitInterceptor:
    """Routes calls of unit modules through ``zero_unit``; passes every other call through."""

    def __init__(
        self,
        layouts: Mapping[tuple[str, ...], UnitLayout],
        shards: Mapping[str, jax.Array],
        config: ZeroPPConfig,
    ):
        self.layouts = layouts
        self.shards = shards
        self.config = config
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
        layout = self.layouts.get(path)
        if layout is None:
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

        unit = zero_unit(fn, layout, self.config)
        return unit(self.shards[layout.name], *[leaves[i] for i in dynamic])


def apply_units(
    model: nn.Module,
    layouts: Mapping[str, UnitLayout],
    shards: Mapping[str, jax.Array],
    config: ZeroPPConfig,
    *args: Any,
    method: str | Callable | None = None,
    **kwargs: Any,
) -> Any:
    """``model.apply`` with ZeRO-3 parameters. Runs inside ``shard_map``.

    Args:
      model: the (unbound) Flax linen model.
      layouts: unit name -> layout, including the rest unit ``REST`` if the model has
        parameters outside every unit.
      shards: unit name -> this device's primary shard ``[layout.shard_len]``.
      config: the run's settings.
      *args, method, **kwargs: as for ``model.apply``.
    """
    by_path = {lay.path: lay for name, lay in layouts.items() if name != REST}
    rest: PyTree = {}
    if REST in layouts:
        rest_layout = layouts[REST]
        # The rest unit's weights are used wherever the root likes, so they stay gathered
        # for the whole step (they are small by construction: no submodule owns them).
        rest = zero_unit(lambda p: p, rest_layout, config)(shards[REST])
    interceptor = _UnitInterceptor(by_path, shards, config)
    with nn.intercept_methods(interceptor):
        if method is None:
            return model.apply({"params": rest}, *args, **kwargs)
        return model.apply({"params": rest}, *args, method=method, **kwargs)
