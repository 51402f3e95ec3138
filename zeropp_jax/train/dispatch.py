"""Pacing for train steps on simulated CPU devices whose thread pool can deadlock.

``zeropp_jax.simulate_cpu_devices`` sizes XLA's CPU client pool so that a multi-device
program can never starve it (see ``zeropp_jax.core.mesh``). A process that simulated its
devices some other way (``XLA_FLAGS=--xla_force_host_platform_device_count=8``) keeps XLA's
default pool of ``max(cores, devices)`` threads, where a loop that never reads a value
deadlocks once the host is 32 programs ahead of a device. For such meshes, ``StepPacer``
keeps at most ``depth`` steps in flight: before dispatching a step it waits for the one
``depth`` steps back (the devices stay busy; the host just cannot run away). Everywhere else
(GPU/TPU, one CPU device, a pool sized by ``simulate_cpu_devices``) it does nothing.
"""

from __future__ import annotations

import collections
from typing import Any, Callable

import jax
from jax.sharding import Mesh

from zeropp_jax.core.mesh import cpu_pool_threads

#: Steps a paced loop keeps in flight (far below XLA's 32 programs per device).
DEPTH = 2
# Output arrays of each step kept to wait on.
KEEP = 8


def needs_pacing(mesh: Mesh) -> bool:
    """True for a multi-device CPU mesh whose CPU client pool has < 2 threads per device."""
    if mesh.devices.size < 2 or any(d.platform != "cpu" for d in mesh.devices.flat):
        return False
    local = sum(1 for d in mesh.devices.flat if d.process_index == jax.process_index())
    return cpu_pool_threads(local) < 2 * local


class StepPacer:
    """Keeps at most ``depth`` dispatched steps of one train-step function in flight."""

    def __init__(self, depth: int = DEPTH):
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.depth = depth
        self._in_flight: collections.deque[list[jax.Array]] = collections.deque()
        self._checked: dict[Mesh, bool] = {}

    def __call__(self, mesh: Mesh, dispatch: Callable[[], Any]) -> Any:
        """Runs ``dispatch()`` (which dispatches one step and returns its outputs), paced."""
        if mesh not in self._checked:
            self._checked[mesh] = needs_pacing(mesh)
        if not self._checked[mesh]:
            return dispatch()
        while len(self._in_flight) >= self.depth:
            # Leaves donated to a later step are gone; the others (metrics at least) are
            # ready when that step is done.
            jax.block_until_ready([x for x in self._in_flight.popleft() if not x.is_deleted()])
        out = dispatch()
        # All outputs of a step are ready together; keep a few of the smallest (metrics,
        # counters), not a whole extra state, and several in case some get donated later.
        leaves = [x for x in jax.tree_util.tree_leaves(out) if isinstance(x, jax.Array)]
        self._in_flight.append(sorted(leaves, key=lambda x: x.size)[:KEEP])
        return out
