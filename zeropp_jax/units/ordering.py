"""Data dependencies that fix when a gather may run (bounded live weights).

XLA schedules a collective whenever its inputs are ready. A unit's gather reads only its
primary shard, ready at the start of the step, so XLA's CPU scheduler issues every unit's
gather up front and all the full weights are live at once. ``jax.lax.optimization_barrier``
does not prevent that on XLA CPU: the barriers are removed before scheduling (measured:
jax 0.10.2, see DESIGN.md). ``after`` adds a real data dependency instead, which no pass
may remove: the value comes back unchanged, but computed from ``dep`` too.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _one_element(dep: Any) -> jax.Array | None:
    leaves = [x for x in jax.tree_util.tree_leaves(dep)
              if isinstance(x, jax.Array) and x.size and jnp.issubdtype(x.dtype, jnp.number)]
    if not leaves:
        return None
    return jnp.ravel(leaves[0])[0].astype(jnp.float32)


def after(x: jax.Array, dep: Any) -> jax.Array:
    """``x``, unchanged in value, but not computable before ``dep`` (any pytree) is.

    ``x + 0 * s`` with ``s`` one element of ``dep``, made finite first (``0 * inf`` would be
    NaN). XLA does not fold ``0 * s`` for floats (it is not an identity under IEEE), so the
    dependency survives every pass. ``x`` keeps its value bit for bit (only the sign of a
    zero may change). Cost: one scalar read and one elementwise add over ``x``. Integer
    ``x`` (quantized storage) is tied through a bitcast-free integer add of ``0 * int(s)``.
    Differentiable: the gradient reaches ``x`` unchanged and ``dep`` gets zero.
    """
    s = _one_element(dep)
    if s is None:
        return x
    s = jax.lax.stop_gradient(jnp.where(jnp.isfinite(s), s, 0.0))
    if jnp.issubdtype(x.dtype, jnp.floating):
        return x + (0.0 * s).astype(x.dtype)
    return x + (s * 0.0).astype(jnp.int32).astype(x.dtype)


class GatherOrder:
    """Orders the units' forward gathers after earlier units' outputs (bounded live weights).

    Unit ``i``'s primary shard is made to depend on the output of the unit called
    ``prefetch + 1`` calls before it (``ordering.after``), so XLA cannot start that gather
    earlier: at most ``prefetch`` units' gathers run ahead of the computation, and
    only about ``prefetch + 1`` units' full weights are live at once. (A data dependency,
    not a scheduling hint: the CPU scheduler otherwise issues every gather at the start.)
    One instance per traced ``apply``; it holds tracers of that trace only.
    """

    def __init__(self, prefetch: int):
        self.prefetch = prefetch
        self.outputs: list[jax.Array] = []

    def record(self, out: Any) -> None:
        leaves = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
        if leaves:
            self.outputs.append(leaves[0])

    def tie(self, shard: Any) -> Any:
        """``shard`` unchanged, but available only once the output it waits for is."""
        if len(self.outputs) <= self.prefetch:
            return shard
        return after(shard, self.outputs[-1 - self.prefetch])
