"""The ("node", "local") device mesh, and simulating CPU devices for it.

Device ``d = node * L + local`` sits at ``mesh.devices[node, local]`` (node-major), so the
flattened mesh axes ``("node", "local")`` enumerate devices in the order that owns flat
parameter slices: device ``d`` owns slice ``d`` of every unit.
"""

from __future__ import annotations

from typing import Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zeropp_jax.core.compat import backends_are_initialized

NODE = "node"
LOCAL = "local"
AXES = (NODE, LOCAL)


def simulate_cpu_devices(n: int) -> None:
    """Makes JAX's CPU backend expose ``n`` devices (for meshes on one CPU machine).

    Must run before anything initializes JAX's backends (``jax.devices()``, creating an
    array, jitting a function). Only the CPU backend is affected, so calling it on a GPU host
    is harmless.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"simulate_cpu_devices needs a positive int, got {n!r}")
    if backends_are_initialized():
        current = len(jax.devices("cpu"))
        if current == n:
            return
        raise RuntimeError(
            f"JAX's backend is already initialized with {current} CPU device(s), so "
            f"simulate_cpu_devices({n}) comes too late. Call it first thing in your program, "
            "before any jax.devices(), jnp array or jit call, or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n} before starting Python."
        )
    jax.config.update("jax_num_cpu_devices", n)


def _node_major(devices: Sequence[jax.Device]) -> list[jax.Device]:
    # Multi-host: process_index is the node. Stable within a process by device id.
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(
    nodes: int | None = None,
    local: int | None = None,
    devices: Sequence[jax.Device] | None = None,
) -> Mesh:
    """Builds the ``("node", "local")`` mesh, node-major.

    Args:
      nodes: number of nodes. Default: ``jax.process_count()`` (one process per node).
      local: devices per node. Default: ``jax.local_device_count()``.
      devices: the devices to use; default ``jax.devices()``. Their count must be
        ``nodes * local``.

    Returns:
      A ``Mesh`` of shape ``(nodes, local)`` with axis names ``("node", "local")``.
    """
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    if nodes is None and local is None:
        nodes, local = jax.process_count(), jax.local_device_count()
        if nodes * local != len(devices):
            # A subset of devices was passed: one node unless processes say otherwise.
            nodes, local = 1, len(devices)
    elif nodes is None:
        if local <= 0 or len(devices) % local:
            raise ValueError(f"local={local} does not divide the {len(devices)} devices")
        nodes = len(devices) // local
    elif local is None:
        if nodes <= 0 or len(devices) % nodes:
            raise ValueError(f"nodes={nodes} does not divide the {len(devices)} devices")
        local = len(devices) // nodes
    for name, v in (("nodes", nodes), ("local", local)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    if nodes * local != len(devices):
        platform = devices[0].platform if devices else "cpu"
        hint = ""
        if platform == "cpu":
            hint = (
                f" To simulate {nodes * local} CPU devices on one machine, call "
                f"zeropp_jax.simulate_cpu_devices({nodes * local}) before any other JAX call, "
                f"or start Python with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={nodes * local}."
            )
        raise ValueError(
            f"a {nodes}x{local} mesh needs {nodes * local} devices but {len(devices)} "
            f"{platform} device(s) are available.{hint}"
        )
    grid = np.array(_node_major(devices), dtype=object).reshape(nodes, local)
    return Mesh(grid, AXES)


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """``(nodes, local)`` of a ``("node", "local")`` mesh."""
    if tuple(mesh.axis_names) != AXES:
        raise ValueError(
            f"zeropp_jax needs a mesh with axes {AXES}, got {tuple(mesh.axis_names)}; "
            "build it with zeropp_jax.make_mesh(nodes, local)"
        )
    return mesh.shape[NODE], mesh.shape[LOCAL]
