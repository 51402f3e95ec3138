"""Data dependencies that fix when a gather may run (bounded live weights).

XLA schedules a collective whenever its inputs are ready. A unit's gather reads only its
primary shard, ready at the start of the step, so XLA's CPU scheduler issues every unit's
gather up front and all the full weights are live at once. ``jax.lax.optimization_barrier``
does not prevent that on XLA CPU: the barriers are removed before scheduling (measured:
jax 0.10.2, see DESIGN.md). ``after`` adds a real data dependency instead, which no pass
may remove: the value comes back unchanged, but computed from ``dep`` too.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass
class HandedOn:
    """Whether a later unit took this unit's backward token (``GatherOrder.take``): set
    while the forward is traced, read when the unit's backward is."""

    taken: bool = False


class GatherOrder:
    """Orders the units' gathers: forward gathers after earlier units' outputs, backward
    regathers after later units' cotangents (bounded live weights, prefetch both ways).

    Forward: unit ``i``'s primary shard is made to depend on the output of the unit called
    ``prefetch + 1`` calls before it (``ordering.after``), so XLA cannot start that gather
    earlier: at most ``prefetch`` units' gathers run ahead of the computation, and
    only about ``prefetch + 1`` units' full weights are live at once. (A data dependency,
    not a scheduling hint: the CPU scheduler otherwise issues every gather at the start.)

    Backward, the mirror image: each unit call hands on a token (a scalar zero) that the
    unit called ``prefetch`` calls later takes as an input. That unit's backward returns, as
    the token's cotangent, a scalar made from its own incoming cotangent, and the first
    unit ties its regather to it: the regather may start when the later unit's backward
    starts, ``prefetch`` units ahead, and no earlier. With ``prefetch=0`` no token is
    taken and each regather waits for its own unit's cotangent.

    One instance per traced ``apply``; it holds tracers of that trace only.
    """

    def __init__(self, prefetch: int):
        self.prefetch = prefetch
        self.outputs: list[jax.Array] = []
        self.tokens: list[tuple[jax.Array, HandedOn]] = []
        # The call under way: the token it took and the one it hands on, committed by
        # ``record`` (a call whose output is recorded is one the model's result uses).
        self._taking: tuple[jax.Array, HandedOn] | None = None
        self._pending: tuple[jax.Array, HandedOn] | None = None

    def take(self) -> tuple:
        """``(token,)``: the backward token of the unit called ``prefetch`` calls before the
        one being called, or ``()`` if there is none. Marked taken once ``record`` sees
        this call's output."""
        self._taking = (self.tokens[-self.prefetch]
                        if self.prefetch >= 1 and len(self.tokens) >= self.prefetch else None)
        return () if self._taking is None else (self._taking[0],)

    def hand_on(self, token: jax.Array, handed: HandedOn) -> None:
        """The backward token of the unit being called, for a later unit to take."""
        self._pending = (token, handed)

    def record(self, out: Any) -> None:
        """Records a unit call's output. A call with no array output (flax runs a unit's
        ``setup`` through it too; nothing uses its result) neither orders later gathers
        nor takes or hands on a token: taking one would keep its dead backward alive."""
        leaves = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
        if leaves:
            self.outputs.append(leaves[0])
            if self._pending is not None:
                self.tokens.append(self._pending)
            if self._taking is not None:
                self._taking[1].taken = True
        self._taking = self._pending = None

    def tie(self, shard: Any) -> Any:
        """``shard`` unchanged, but available only once the output it waits for is."""
        if len(self.outputs) <= self.prefetch:
            return shard
        return after(shard, self.outputs[-1 - self.prefetch])
