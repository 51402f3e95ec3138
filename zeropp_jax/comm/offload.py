"""Offload to host memory: which of a run's state lives in the host's memory between
steps, resolved once from the config (PyTorch FSDP2's ``OffloadPolicy`` is the pattern).

Everything that places, moves, prices or names offloaded state asks the run's policy
(``TransportPlan.offload``): the builder (where the optimizer state and the primary
shards are put), the engine (what comes to the device for the update and goes back), the
memory and cost models (what the host holds, what crosses the host link), and the run's
label.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterable

import jax

from zeropp_jax.comm.partition import unit_of


@dataclasses.dataclass(frozen=True)
class OffloadPolicy:
    """What a run keeps in host memory between steps.

    Attributes:
      optimizer: the optimizer state of the units ``units`` picks (``offload_optimizer``).
      ratio: the fraction of the parameters whose optimizer state is offloaded, in whole
        units (``offload_ratio``; 1: all of it).
      params: the primary shards too (``offload_params``).
    """

    optimizer: bool = False
    ratio: float = 1.0
    params: bool = False

    @classmethod
    def of(cls, config: Any) -> "OffloadPolicy":
        """The policy a ``ZeroPPConfig`` asks for."""
        return cls(bool(config.offload_optimizer), float(config.offload_ratio),
                   bool(config.offload_params))

    def units(self, sizes: Iterable[tuple[str, int]]) -> frozenset[str]:
        """The units whose optimizer state lives in host memory, from ``(name,
        parameters)`` pairs: none without ``optimizer``; else, taken in name order, each
        while the ones taken so far hold less than ``ratio`` of all the parameters, so
        whole units reach at least that fraction (all of them at 1)."""
        if not self.optimizer:
            return frozenset()
        sizes = sorted(sizes)
        total = sum(n for _, n in sizes)
        taken: list[str] = []
        held = 0
        for name, n in sizes:
            if held >= self.ratio * total:
                break
            taken.append(name)
            held += n
        return frozenset(taken)

    def label(self) -> str:
        """Its part of a run's short name: ``offload`` (``offload0.5`` for half the
        optimizer state), ``offload-params``, joined by ``+``; "" for none."""
        parts = ((f"offload{self.ratio:g}" if self.ratio < 1 else "offload", self.optimizer),
                 ("offload-params", self.params))
        return "+".join(w for w, on in parts if on)


def offload_mask(tree: Any, units: Any, offloaded: frozenset[str]) -> Any:
    """A tree like ``tree`` (an optimizer state, or its specs) of bools: True for the
    leaves kept in host memory, those of the ``offloaded`` units (``unit_of``), and the
    leaves of no unit (a step count) when every one of ``units`` is offloaded."""
    every = set(units) <= set(offloaded)

    def leaf(path: tuple, _: Any) -> bool:
        unit = unit_of(path, units)
        return every if unit is None else unit in offloaded

    return jax.tree_util.tree_map_with_path(leaf, tree)
