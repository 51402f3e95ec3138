"""The device mesh, and simulating CPU devices for it.

ZeRO shards over the data-parallel axes ``("node", "local")``. Device ``d = node * L +
local`` sits at ``mesh.devices[node, local]`` (node-major), so the flattened data axes
enumerate devices in the order that owns flat parameter slices: device ``d`` owns slice
``d`` of every unit. A mesh may have a third axis, ``"model"`` (tensor parallelism,
innermost: a tensor-parallel group is ``model`` consecutive devices of one node) or
``"expert"`` (expert parallelism, in the same place), which ZeRO leaves to XLA's
partitioner: the step is manual over the data axes only.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from zeropp_jax.core.compat import backends_are_initialized

NODE = "node"
LOCAL = "local"
MODEL = "model"
EXPERT = "expert"
AXES = (NODE, LOCAL)  # the data-parallel axes ZeRO shards over
# The inner axis a mesh may have beside the data axes, which splits some parameters into
# slices (tensor parallelism's "model", expert parallelism's "expert"); ZeRO leaves it to
# XLA's partitioner. A mesh has at most one.
SLICE_AXES = (MODEL, EXPERT)


def simulate_cpu_devices(n: int) -> None:
    """Makes JAX's CPU backend expose ``n`` devices (for meshes on one CPU machine).

    Must run before anything initializes JAX's backends (``jax.devices()``, creating an
    array, jitting a function). Only the CPU backend is affected, so calling it on a GPU host
    is harmless.

    It also sizes the CPU client's thread pool for ``n`` devices (``PJRT_NPROC``, see
    :func:`cpu_client_threads`): with the default pool a training loop that does not read a
    value every step deadlocks on simulated devices.
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
    _size_cpu_client_pool(n)


# XLA's CPU client (jaxlib 0.10) runs every device's part of a multi-device program on one
# thread pool ("XLAPjRtCpuClient") of max(cores, devices) threads, and uses that same pool to
# *launch* each device's part. A launch first takes a slot of its device's in-flight semaphore
# (32 programs per device) and blocks there when the host has run 32 programs ahead of that
# device, which an asynchronously dispatched training loop that never reads a value does
# within ~32 steps. With cores <= devices the pool then deadlocks: n - 1 threads wait in a
# collective's rendezvous for the n-th device, whose part is queued behind them with no free
# thread, because the last thread is the launch blocked on that device's semaphore (XLA
# aborts after 40 s: "only 3 of 4 threads arrived"). At any moment at most n launches (one
# program's) and n - 1 rendezvous waiters block, so a pool of 2n + 1 threads always keeps
# two free. PJRT_NPROC is the thread count XLA reads for that pool (and its intra-op pool) when
# the CPU client is created.
_PJRT_NPROC = "PJRT_NPROC"


def _schedulable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _nproc_from_env() -> int | None:
    # XLA reads PJRT_NPROC, then NPROC (a CPU reservation some CI systems export).
    for name in (_PJRT_NPROC, "NPROC"):
        value = os.environ.get(name, "").strip()
        if value.isdigit():
            return int(value)
    return None


def cpu_client_threads(n: int) -> int:
    """Threads the CPU client's pool needs so ``n`` simulated devices cannot deadlock.

    ``2 * n + 1`` (a launch and a rendezvous waiter per device, and one thread free), and
    never fewer than XLA would use anyway (the schedulable cores, or a ``PJRT_NPROC`` /
    ``NPROC`` the user set).
    """
    env = _nproc_from_env()
    return max(_schedulable_cores() if env is None else env, 2 * n + 1)


def cpu_pool_threads(n: int) -> int:
    """The pool size XLA gives a CPU client of ``n`` devices created now: ``max(nproc, n)``."""
    env = _nproc_from_env()
    return max(_schedulable_cores() if env is None else env, n)


def _size_cpu_client_pool(n: int) -> None:
    if n < 2:
        return  # one device: its launches run on the calling thread, nothing to starve
    os.environ[_PJRT_NPROC] = str(cpu_client_threads(n))


def _node_major(devices: Sequence[jax.Device]) -> list[jax.Device]:
    # Multi-host: process_index is the node. Stable within a process by device id.
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def make_mesh(
    nodes: int | None = None,
    local: int | None = None,
    devices: Sequence[jax.Device] | None = None,
    *,
    model: int = 1,
    expert: int = 1,
) -> Mesh:
    """Builds the ``("node", "local")`` mesh, node-major, or with ``model > 1`` the
    ``("node", "local", "model")`` mesh for tensor parallelism beside ZeRO, or with
    ``expert > 1`` the ``("node", "local", "expert")`` mesh for expert parallelism.

    Args:
      nodes: number of nodes. Default: ``jax.process_count()`` (one process per node).
      local: data-parallel devices per node. Default: the node's devices divided by
        ``model``.
      devices: the devices to use; default ``jax.devices()``. Their count must be
        ``nodes * local * model``.
      model: tensor-parallel degree: the size of the innermost ``"model"`` axis, whose
        devices (consecutive devices of one node) split each tensor-parallel layer. 1: no
        such axis.
      expert: expert-parallel degree: the size of the innermost ``"expert"`` axis, whose
        devices (consecutive devices of one node, so the tokens' all-to-alls stay inside
        the node) each hold ``1 / expert`` of every mixture-of-experts layer's experts.
        The batch is split over it too. 1: no such axis. Not with ``model > 1``.

    Returns:
      A ``Mesh`` of shape ``(nodes, local)`` with axis names ``("node", "local")``, or of
      shape ``(nodes, local, model)`` with axis names ``("node", "local", "model")``, or
      ``(nodes, local, expert)`` with ``("node", "local", "expert")``.
    """
    for name, v, what in (("model", model, "tensor"), ("expert", expert, "expert")):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be a positive int (the {what}-parallel degree), "
                             f"got {v!r}")
    if model > 1 and expert > 1:
        raise NotImplementedError(
            f"tensor parallelism (model={model}) beside expert parallelism "
            f"(expert={expert}) is not supported yet: choose one inner axis, e.g. "
            f"make_mesh(nodes, local, expert={expert}) with the attention ZeRO-sharded")
    given = devices is not None
    if devices is None:
        devices = jax.devices()
    devices = list(devices)
    if model > 1:
        return _with_inner_axis(nodes, local, devices, model, MODEL, given)
    if expert > 1:
        return _with_inner_axis(nodes, local, devices, expert, EXPERT, given)
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
        raise ValueError(_count_mismatch(nodes, local, devices, given))
    grid = np.array(_node_major(devices), dtype=object).reshape(nodes, local)
    return Mesh(grid, AXES)


def _with_inner_axis(nodes: int | None, local: int | None, devices: list, size: int,
                     name: str, given: bool) -> Mesh:
    """The ``(nodes, local, size)`` mesh with inner axis ``name`` (``"model"`` or
    ``"expert"``): the ``(nodes, local * size)`` grid of ``make_mesh``, each node's devices
    split into ``local`` groups of ``size``."""
    if len(devices) % size:
        raise ValueError(f"{name}={size} does not divide the {len(devices)} devices")
    if local is not None and (not isinstance(local, int) or local < 1):
        raise ValueError(f"local must be a positive int, got {local!r}")
    per_node = None if local is None else local * size
    try:
        grid = make_mesh(nodes, per_node, devices).devices
    except ValueError as e:
        raise ValueError(f"{e} (with {name}={size}: local counts data-parallel devices, "
                         f"so a node holds local * {name} devices)") from None
    n, per = grid.shape
    if per % size:
        raise ValueError(
            f"{name}={size} does not divide the {per} devices of a node; the "
            f"{name} group must sit inside one node")
    return Mesh(grid.reshape(n, per // size, size), AXES + (name,))


def mesh_shape(mesh: Mesh) -> tuple[int, int]:
    """``(nodes, local)`` of a ``("node", "local")`` mesh, or one with an inner
    ``"model"`` or ``"expert"`` axis: the data-parallel axes ZeRO shards over
    (``MeshInfo.of(mesh).shape``)."""
    return MeshInfo.of(mesh).shape


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """A run's mesh, as numbers: what everything that sizes, counts or prices the run asks
    instead of a ``Mesh`` or a ``(nodes, local)`` pair. Built once per run from its mesh
    (``MeshInfo.of(mesh)``) or, for the planner and the cost models, from numbers
    (``MeshInfo(nodes, local)``): no devices needed. Frozen and hashable.

    Attributes:
      nodes: size of the ``"node"`` axis (the outer data-parallel axis; a node's devices
        share fast links).
      local: size of the ``"local"`` axis (data-parallel devices per node).
      model: size of the ``"model"`` axis (tensor-parallel degree), 1 without one.
      expert: size of the ``"expert"`` axis (expert-parallel degree), 1 without one.
    """

    nodes: int
    local: int
    model: int = 1
    expert: int = 1

    def __post_init__(self) -> None:
        for name in ("nodes", "local", "model", "expert"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MeshInfo.{name} must be a positive int, got {v!r}")
            object.__setattr__(self, name, int(v))

    @classmethod
    def of(cls, mesh: Any) -> "MeshInfo":
        """The numbers of ``mesh`` (a ``Mesh`` or an abstract mesh with axes
        ``("node", "local")`` or ``("node", "local", "model")``), or ``mesh`` itself if it
        is a ``MeshInfo`` already."""
        if isinstance(mesh, MeshInfo):
            return mesh
        names = tuple(mesh.axis_names)
        if names not in (AXES, *(AXES + (a,) for a in SLICE_AXES)):
            raise ValueError(
                f"zeropp_jax needs a mesh with axes {AXES}, {AXES + (MODEL,)} or "
                f"{AXES + (EXPERT,)}, got {names}; build it with "
                "zeropp_jax.make_mesh(nodes, local), make_mesh(nodes, local, model=...) or "
                "make_mesh(nodes, local, expert=...)")
        sizes = dict(zip(names, mesh.axis_sizes))
        return cls(sizes[NODE], sizes[LOCAL], sizes.get(MODEL, 1), sizes.get(EXPERT, 1))

    @property
    def shape(self) -> tuple[int, int]:
        """``(nodes, local)``: the data-parallel axes' sizes."""
        return self.nodes, self.local

    @property
    def data(self) -> int:
        """Devices ZeRO shards over: ``nodes * local`` (each tensor-parallel slice's
        group)."""
        return self.nodes * self.local

    @property
    def devices(self) -> int:
        """Every device of the mesh: ``nodes * local * model * expert``."""
        return self.data * self.model * self.expert

    @property
    def slices(self) -> int:
        """The inner axis' size (``model`` or ``expert``; 1 without one): the slices a
        split parameter is stored in."""
        return self.model * self.expert

    @classmethod
    def inside(cls) -> "MeshInfo":
        """The data axes' sizes as seen inside ``shard_map`` (``jax.lax.axis_size``)."""
        return cls(jax.lax.axis_size(NODE), jax.lax.axis_size(LOCAL))

    def node_of(self, device: int) -> int:
        """The node of data-parallel device ``device`` (node-major: ``device // local``)."""
        return device // self.local

    def resized(self, nodes: int | None = None, local: int | None = None) -> "MeshInfo":
        """The same mesh with other data-axis sizes (None keeps one)."""
        return dataclasses.replace(self, nodes=nodes or self.nodes, local=local or self.local)


def slice_axis(mesh: Any) -> str | None:
    """The inner axis of ``mesh`` that splits parameters into slices (``"model"`` or
    ``"expert"``), None without one. Takes a ``Mesh`` or an abstract mesh."""
    names = tuple(mesh.axis_names or ())
    return next((a for a in SLICE_AXES if a in names), None)


def slice_size(mesh: Any) -> int:
    """The size of ``slice_axis(mesh)`` (1 without one). Takes a ``Mesh`` or an abstract
    mesh."""
    axis = slice_axis(mesh)
    return 1 if axis is None else dict(zip(mesh.axis_names, mesh.axis_sizes))[axis]


def batch_axes(mesh: Any) -> tuple[str, ...]:
    """The mesh axes a batch's leading dimension is split over: the data axes, and
    ``"expert"`` on an expert mesh (expert parallelism splits the tokens too; a
    tensor-parallel group shares its batch)."""
    return AXES + ((EXPERT,) if EXPERT in tuple(mesh.axis_names or ()) else ())


def manual_axes(mesh: Mesh) -> dict[str, Any]:
    """``jax.shard_map`` keyword arguments for a step over ``mesh``: manual over the data
    axes only when the mesh has an inner ``"model"`` or ``"expert"`` axis (left to XLA's
    partitioner, so a tensor-parallel model's own collectives, or the tokens' all-to-alls
    to their experts, are XLA's), otherwise nothing (all manual)."""
    return {"axis_names": frozenset(AXES)} if slice_axis(mesh) else {}


def _count_mismatch(nodes: int, local: int, devices: Sequence[jax.Device], given: bool) -> str:
    """The error for a mesh whose shape does not match the devices, with the fixes that
    apply: fewer devices than there are (a subset), more (simulate them on CPU, or use a
    shape that fits), one process of several."""
    need, have = nodes * local, len(devices)
    platform = devices[0].platform if devices else "cpu"
    where = "passed" if given else "available (jax.devices())"
    fixes = []
    if have > need:
        fixes.append(f"use {need} of them: make_mesh({nodes}, {local}, "
                     f"devices=jax.devices()[:{need}])")
    if have:
        shapes = [f"make_mesh({n}, {have // n})" for n in range(1, have + 1) if have % n == 0]
        fixes.append("pick a shape that uses all of them: " + ", ".join(shapes[:4]))
    if platform == "cpu" and need > have:
        fixes.append(f"to simulate {need} CPU devices on one machine, call "
                     f"zeropp_jax.simulate_cpu_devices({need}) before any other JAX call "
                     f"(or start Python with "
                     f"XLA_FLAGS=--xla_force_host_platform_device_count={need})")
    elif need > have and jax.process_count() > 1:
        fixes.append(f"this process sees {jax.local_device_count()} of "
                     f"{jax.device_count()} devices in {jax.process_count()} processes: "
                     "call make_mesh() with no arguments for one node per process")
    elif need > have:
        fixes.append(f"this machine has {have} {platform} device(s): run on {need} "
                     "(e.g. several processes with jax.distributed.initialize, one per node)")
    return (f"a {nodes}x{local} mesh needs {need} devices but {have} {platform} device(s) "
            f"are {where}. To fix it, " + "; or ".join(fixes) + ".")
