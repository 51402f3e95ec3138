"""Everything that differs between the JAX versions zeropp_jax supports (0.10.2 to 0.12.x).

One place for version-dependent calls: the rest of the package (and the tests) import them
from here, never from ``jax._src`` or by version checks of their own. Each item says which
versions differ and how. Checked against the sources of jax 0.10.2, 0.11.2 and 0.12.0.1, and
by running the tests that exercise each item on jax 0.10.2 and 0.11.2.

1. ``all_gather_invariant`` (an all-gather typed invariant under ``shard_map``'s
   ``check_vma``). 0.10.2 and 0.11.2 define it in ``jax._src.lax.parallel`` only (not
   exported from ``jax.lax``); 0.12 removed that function. All three accept
   ``jax.lax.all_gather(..., to="invarying")``, which is the same primitive.
2. ``backends_are_initialized``: private (``jax._src.xla_bridge``) in 0.10 to 0.12, with no
   public equivalent; if it disappears we answer False and let ``jax.config.update`` raise.
3. Checkpoint (remat) policies: ``jax.checkpoint_policies`` is a namespace attribute of
   ``jax`` in 0.10.2, 0.11.2 and 0.12 with the same names (0.11 adds the classes
   ``SaveOnlyTheseNames``... to it). Should it become a submodule that ``import jax`` does not
   load, it is imported explicitly as a fallback. ``save_anything_except_these_names`` is still a
   stub that saves everything in 0.10.2 and 0.11.2: use allow-lists.
4. Lowering Pallas kernels for CUDA on a host without a GPU (``lower_for_cuda``). 0.10.2's
   Triton lowering falls back to compute capability 9.0 when no GPU is present. From 0.11 it
   reads the target GPU from the abstract mesh's ``AbstractDevice`` and raises "No supported
   GPU devices found" without one; ``lower_for_cuda`` sets an H100 (the old fallback) for the
   duration of trace and lower. Kernels inside ``shard_map`` over a concrete CPU mesh see
   that mesh's CPU ``AbstractDevice`` instead, so the host's device kind is also registered
   in Pallas Triton's GPU registry (private, ``jax._src.pallas.triton.gpu_info``) meanwhile.
5. Pallas Triton (``jax.experimental.pallas.triton``): imports in 0.10 to 0.12. From 0.11
   lowering a Triton ``pallas_call`` warns (DeprecationWarning, id ``jax-pallas-triton``):
   the backend is deprecated in favour of Mosaic GPU. It still works, so the kernels in
   ``pallas_kernels/`` keep Triton. Its custom-call target is ``TRITON_CALL_TARGET``.
6. Replica groups in program text: jax <= 0.10 prints explicit lists
   (``dense<[[0, 1], ...]>`` / ``{{0,1},...}`` / iota ``[4,2]<=[8]``); jax >= 0.11 prints
   mesh axes (``#stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [...]>`` with an
   ``sdy.mesh`` declaration; compiled: ``mesh['node'=4,'local'=2] {'local'}``). Both are
   parsed by ``zeropp_jax.measure.comm_report.collectives``, the one parser of program text.
7. ``saved_residuals`` (what a function's backward keeps): private
   (``jax._src.ad_checkpoint``) with the same signature in 0.10 to 0.12; the public
   ``jax.ad_checkpoint`` exports only ``print_saved_residuals``.
8. The ``jax.distributed`` coordination client (barriers with a timeout, a key-value
   store): private (``jax._src.distributed.global_state.client``) in 0.10 to 0.12, the
   same object orbax and ``jax.experimental.multihost_utils`` use; ``wait_at_barrier(id,
   timeout_in_ms)``, ``key_value_set(key, value)`` and ``blocking_key_value_get(key,
   timeout_in_ms)`` have the same signatures in all three.
9. orbax's ``ArrayRestoreArgs`` reading an array into another global length (zero
   padding or truncation): orbax >= 0.11.x requires ``strict=False`` for it (0.12.8 raises
   "Truncating/padding is disabled" without); versions before the flag padded silently and
   reject the keyword.
10. Naming an axis while tracing, and rewriting a jaxpr's equations (binding a step's
   pmap-era axis name to the mesh axes): ``extend_axis_env_nd`` is private
   (``jax._src.core``) in 0.10 to 0.12 with the same signature (pairs of name and size);
   ``JaxprEqn.replace`` and ``jax.extend.core.{Jaxpr, ClosedJaxpr}`` are public there;
   ``sub_jaxprs`` is the one walk into the jaxprs an equation holds (the comm report's
   byte count and the step's collective check both use it).
   A ``scan`` equation says how many of its inputs are constants and carry with
   ``num_consts`` / ``num_carry`` in 0.10.2; 0.11.2 drops both for ``ft_in`` / ``ft_out``
   (private flat-tree objects): ``scan_counts`` reads the counts from the shapes there.
11. XLA options for every program compiled in a block (``xla_options``): ``jax.jit``'s
   ``compiler_options`` reach one function's programs only, and ``XLA_FLAGS`` is read once
   per process. ``jax._src.compiler.get_compile_options`` builds every program's
   ``CompileOptions`` (``env_option_overrides`` carry XLA debug options) in 0.10 to 0.12,
   and the persistent compilation cache keys include those overrides. The test suite uses
   it to compile some tests with XLA:CPU's default fusion emitters (tests/conftest.py).
   That choice, ``xla_cpu_use_fusion_emitters``, exists in jaxlib 0.10.2 and is gone in
   0.11.2, where ``XLA_FLAGS`` naming it aborts the process when the backends start (seen
   on the GPU machine): ``cpu_fusion_emitter_options`` gives it where it exists, nothing
   where XLA:CPU has only its fusion emitters.
12. An NNX variable's sharding names (below).
13. Devices of a GPU cluster to compile for, without its GPUs (``gpu_cluster_devices``):
   ``jax.experimental.topologies.get_topology_desc(platform="cuda", topology="SxHxD",
   target_config=...)`` in 0.10.2 to 0.12 (the CUDA plugin, ``jax[cuda12]`` or
   ``jax[cuda13]``, must be installed; no GPU or driver is needed, though the plugin's
   version check must be skipped where no driver exists: ``JAX_PLATFORMS=cpu``). The
   topology string is "<slices>x<hosts per slice>x<devices per host>"; its devices are
   numbered host-major, one process per host.
14. The XLA GPU flags a scanned stack's overlap needs (``gpu_overlap_compile_options``,
   ``GPU_OVERLAP_XLA_FLAGS``): XLA's collective pipeliner for all-gathers, reduce-scatters
   and all-reduces is off by default. jaxlib 0.10.2 switches it on with the boolean fields
   ``xla_gpu_enable_pipelined_{all_gather,reduce_scatter,all_reduce}``; jaxlib 0.11.2 has
   no such compile options ("No such compile option", seen on an H200) and takes
   ``xla_gpu_pipeline_{all_gather,reduce_scatter,all_reduce}`` instead, each a mode
   (``COLLECTIVE_PIPELINING_MODE_{DEFAULT,OFF,ON,EXPLICIT}``; openxla/xla PR #45836), while
   its ``XLA_FLAGS`` parser still reads the boolean spelling (checked there: the 1.3B
   ZeRO-3 step at 16x8 compiled with them in ``XLA_FLAGS`` has 21 pipelined collectives, 4
   without; 22 with the modes and the scheduling options as compile options, as 0.10.2
   gives with the booleans). Which spelling a jaxlib's compile options take is probed
   (``knows_compile_option``), not read from its version: the release that renamed them
   is not known here. An open XLA issue (openxla/xla #44228) reports a GPU plugin
   accepting the booleans and pipelining nothing, so ``make gpu-cluster`` records per row
   whether the pipeliner ran. With the pipeliner
   alone, XLA copies each layer's prefetched weights and its gradient into the loop's
   carried buffers every iteration (three full copies of a layer per iteration, 22 ms of
   the 7B's step at 16x8); ``xla_gpu_enable_while_loop_double_buffering`` unrolls the
   loop by two and the copies go (the replayed step is faster in every row of
   ``make gpu-cluster``). The latency-hiding scheduler, by default, starts a collective
   only a few kernels before its result is needed and keeps one in flight: a layer's
   pipelined gather then starts after that layer's gradient collectives, near the end of
   the iteration. ``xla_gpu_experimental_collective_start_as_early_as_possible`` (proto
   field 476, in jaxlib 0.10.2 and 0.11.2; openxla/xla PR #41799) and
   ``xla_gpu_experimental_parallel_collective_overlap_limit`` (field 336, since 2024)
   move it to the top (checked in 0.10.2 by the compiled schedules; the replayed scanned
   7B ZeRO-3 step at 16x8 goes from 169 to 136 ms). The limit is 3: with ``qgz_defer`` a
   scanned layer's backward has three collectives to overlap (its regather and two
   deferred qgZ hops), and at 2 the regather waited (7B ZeRO++ deferred at 16x8, 400
   Gbit/s: 151 ms at 2, 143 at 3 and at 4; ZeRO-3 and ZeRO++ unchanged within 0.3 ms,
   the GSPMD FSDP peer 160 -> 152 ms; the unrolled 7B's ZeRO-3 144 -> 152 ms, where
   XLA's default flags, 135, are better anyway). Both are "experimental" names: a jaxlib
   that drops one fails ``gpu_overlap_flags``' test ("No such compile option").
15. Whether 64-bit types are on (``x64_enabled``): ``jax.dtypes.canonicalize_dtype`` of
   float64 is float64 exactly then, under ``jax.config.update("jax_enable_x64", True)`` or
   inside ``jax.enable_x64(True)`` alike (checked in 0.10.2; read through that public
   function rather than the config attribute, whose name JAX may change).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
from typing import Any, Iterator

import jax

JAX_VERSION: tuple[int, ...] = tuple(
    int(p) for p in jax.__version__.split(".")[:3] if p.isdigit()
)
# jaxlib's own (the compiler: XLA's options follow it), read without starting a backend.
JAXLIB_VERSION: tuple[int, ...] = tuple(
    int(p) for p in importlib.metadata.version("jaxlib").split(".")[:3] if p.isdigit()
)

# -- 1. all_gather_invariant ------------------------------------------------------------------


def all_gather_invariant(x: Any, axis_name: str | tuple[str, ...], *, axis: int = 0,
                         tiled: bool = False) -> Any:
    """``jax.lax.all_gather`` whose result is typed invariant over ``axis_name``.

    Runs inside ``shard_map``. Its transpose is a slice, not a reduce-scatter.
    """
    return jax.lax.all_gather(x, axis_name, axis=axis, tiled=tiled, to="invarying")


# -- 2. backends_are_initialized ----------------------------------------------------------------


# Memory kinds: where an array lives. ``jax.memory.Space`` moves an array between a device's
# own memory and its host memory inside jit and shard_map (jax >= 0.6; same in 0.11).
HOST_MEMORY = "pinned_host"


def x64_enabled() -> bool:
    """Whether float64 arrays are float64 here (item 15)."""
    import numpy as np

    return jax.dtypes.canonicalize_dtype(np.float64) == np.float64


def on_device(tree: Any) -> Any:
    """The arrays of ``tree`` that live in host memory moved to device memory, the rest as
    they are (inside jit/shard_map; by each array's type, so it costs nothing where
    nothing is offloaded)."""
    def move(x: Any) -> Any:
        space = getattr(jax.typeof(x), "memory_space", None)
        if space == jax.memory.Space.Host:
            return jax.device_put(x, jax.memory.Space.Device)
        return x

    return jax.tree_util.tree_map(move, tree)


def in_host_memory(tree: Any, where: Any = None) -> Any:
    """Every array of ``tree`` moved to its device's pinned host memory (inside
    jit/shard_map); with ``where`` (a tree of bools like ``tree``) only those marked True."""
    host = lambda x: jax.device_put(x, jax.memory.Space.Host)  # noqa: E731
    if where is None:
        return jax.tree_util.tree_map(host, tree)
    return jax.tree_util.tree_map(lambda x, w: host(x) if w else x, tree, where)


def backends_are_initialized() -> bool:
    """True once JAX has created its backends (device count settings come too late then)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # private API gone: let jax.config.update decide
        return False


# -- 3. checkpoint policies -----------------------------------------------------------------------

try:
    checkpoint_policies = jax.checkpoint_policies
except AttributeError:  # a submodule that `import jax` does not load
    checkpoint_policies = importlib.import_module("jax.checkpoint_policies")

checkpoint_dots = checkpoint_policies.checkpoint_dots
dots_with_no_batch_dims_saveable = checkpoint_policies.dots_with_no_batch_dims_saveable
nothing_saveable = checkpoint_policies.nothing_saveable
everything_saveable = checkpoint_policies.everything_saveable
save_only_these_names = checkpoint_policies.save_only_these_names
save_from_both_policies = checkpoint_policies.save_from_both_policies

# -- 4. lowering for CUDA without a GPU --------------------------------------------------------

# The GPU a CUDA lowering targets when the host has none: compute capability 9.0, the
# fallback jax 0.10.2's Triton lowering uses by itself.
DEFAULT_CUDA_DEVICE_KIND = "NVIDIA H100"
_H100_SMS = 132


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:  # no GPU backend (none present, or JAX_PLATFORMS=cpu)
        return False


@contextlib.contextmanager
def _host_kind_resolves_to_default_gpu() -> Iterator[None]:
    """Pallas calls traced inside ``shard_map`` over a concrete CPU mesh lower under that
    mesh's abstract mesh (JAX records it per equation), whose ``AbstractDevice`` is the CPU:
    no abstract mesh set around ``lower`` reaches them. Triton's GPU lookup falls back to a
    registry of device kinds, so the host's kind is registered as the default GPU meanwhile.
    """
    try:
        from jax._src.pallas.triton import gpu_info
        registry, lookup = gpu_info.registry, gpu_info.get_gpu_info
        target = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    except (ImportError, AttributeError):  # layout changed: the abstract mesh alone remains
        yield
        return
    kind = jax.local_devices()[0].device_kind
    added = kind not in registry
    if added:
        registry[kind] = lambda: target
    try:
        yield
    finally:
        if added:
            registry.pop(kind, None)
            getattr(lookup, "cache_clear", lambda: None)()  # forget answers given meanwhile


@contextlib.contextmanager
def abstract_cuda_device() -> Iterator[None]:
    """Makes CUDA the target of Pallas lowering, also on a host without a GPU.

    JAX >= 0.11 reads the target GPU from the abstract mesh's ``AbstractDevice``; without a
    GPU this sets an empty abstract mesh carrying an H100 (tracing is unaffected: the mesh
    has no axes) and resolves the host's device kind to an H100 for kernels inside
    ``shard_map``. With a GPU present, or on JAX 0.10 (whose Triton lowering needs no
    device), it does nothing.
    """
    if JAX_VERSION < (0, 11) or _has_gpu():
        yield
        return
    device = jax.sharding.AbstractDevice(
        device_kind=DEFAULT_CUDA_DEVICE_KIND, num_cores=_H100_SMS, platform="gpu")
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh), _host_kind_resolves_to_default_gpu():
        yield


def lower_for_cuda(jitted: Any, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """``jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))`` on any host.

    Args:
      jitted: a ``jax.jit``-wrapped function (anything with ``.trace``).
      *args, **kwargs: its arguments (arrays or ``jax.ShapeDtypeStruct``).

    For Pallas kernels to lower (not run in interpret mode) on a CPU host, call it under
    ``zeropp_jax.quant.quantization.compiled_kernels()``.
    """
    with abstract_cuda_device():
        return jitted.trace(*args, **kwargs).lower(lowering_platforms=("cuda",))


# -- 5. Pallas Triton ---------------------------------------------------------------------------

# Custom-call target of a Triton pallas_call in lowered StableHLO: XLA's Triton custom call in
# jaxlib 0.10.2 to 0.12 (0.10.2 also carries an unused FFI path, "triton_kernel_call_ffi",
# meant for later jaxlibs; 0.11 dropped it again).
TRITON_CALL_TARGET = "__gpu$xla.gpu.triton"


# -- 7. saved_residuals -------------------------------------------------------------------------


def saved_residuals(f: Any, *args: Any, **kwargs: Any) -> list[tuple[Any, str]]:
    """``(aval, description)`` of every residual ``f``'s backward would keep."""
    from jax._src.ad_checkpoint import saved_residuals as _saved_residuals

    return _saved_residuals(f, *args, **kwargs)


def eval_jaxpr(closed: Any, *args: Any) -> list[Any]:
    """Evaluates a ``ClosedJaxpr`` (from ``jax.make_jaxpr``) on ``args`` in the current
    trace: the recorded equations are bound again, no Python is re-run.
    ``jax.core.eval_jaxpr`` is public in 0.10 to 0.12."""
    from jax import core

    return core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


# -- 8. the jax.distributed coordination client --------------------------------------------------


def distributed_client() -> Any:
    """The coordination-service client of ``jax.distributed.initialize``, or None if this
    process did not join a cluster."""
    from jax._src import distributed

    return distributed.global_state.client


# -- 9. orbax: restoring into another global length ------------------------------------------------


def orbax_resizing_restore_args(sharding: Any, shape: tuple[int, ...], dtype: Any) -> Any:
    """``ArrayRestoreArgs`` reading a stored array into ``shape`` on ``sharding``: zeros
    past the stored end, the stored tail dropped where ``shape`` is shorter."""
    import orbax.checkpoint as ocp

    try:
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype,
                                    strict=False)
    except TypeError:  # an orbax without the flag pads and truncates by itself
        return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)


# -- 10. naming an axis while tracing; rewriting equations -------------------------------------


@contextlib.contextmanager
def named_axes(sizes: dict[str, int]) -> Iterator[None]:
    """Inside, collectives over the names in ``sizes`` trace (each an axis of that size),
    though no mesh or ``vmap`` defines them: what they bind is rewritten afterwards."""
    from jax._src import core as _core

    with _core.extend_axis_env_nd(tuple(sizes.items())):
        yield


def sub_jaxprs(params: Any) -> Iterator[tuple[str, int | None, Any]]:
    """``(param name, index in a tuple or None, Jaxpr)`` of every jaxpr an equation's
    ``params`` hold (a scan's body, a cond's branches, a jit's or a shard_map's program;
    closed jaxprs give their ``Jaxpr``)."""
    from jax.extend import core as jcore

    for key, value in params.items():
        items = value if isinstance(value, (tuple, list)) else (value,)
        for i, item in enumerate(items):
            inner = getattr(item, "jaxpr", item)
            if isinstance(inner, jcore.Jaxpr):
                yield key, (i if isinstance(value, (tuple, list)) else None), inner


def replace_eqn_params(eqn: Any, params: dict[str, Any]) -> Any:
    """``eqn`` with ``params`` (a whole new params dict)."""
    return eqn.replace(params=params)


def replace_jaxpr_eqns(jaxpr: Any, eqns: list[Any]) -> Any:
    """``jaxpr`` (a ``Jaxpr``) with another equation list of the same signature."""
    return jaxpr.replace(eqns=eqns)


def scan_counts(eqn: Any) -> tuple[int, int]:
    """``(constants, carry)``: how many of a ``scan`` equation's inputs are each (the rest
    are the scanned ``xs``). From ``num_consts`` / ``num_carry`` where the equation has them,
    else from the shapes, which say it in every version: constants and carry enter the
    body with the equation's shapes, the scanned inputs one leading ``length`` axis
    shorter; the carry leaves with the body's shapes, the stacked outputs with that axis."""
    if "num_consts" in eqn.params:
        return eqn.params["num_consts"], eqn.params["num_carry"]
    return _scan_counts_from_shapes(eqn)


def _scan_counts_from_shapes(eqn: Any) -> tuple[int, int]:
    body = eqn.params["jaxpr"].jaxpr
    shape = lambda v: tuple(v.aval.shape)  # noqa: E731

    def leading_same(outer: list, inner: list) -> int:
        n = 0
        while n < min(len(outer), len(inner)) and shape(outer[n]) == shape(inner[n]):
            n += 1
        return n

    carry = leading_same(eqn.outvars, body.outvars)
    consts = leading_same(eqn.invars, body.invars) - carry
    if consts < 0:
        raise ValueError(f"cannot tell a scan's carry from its shapes: {eqn}")
    return consts, carry


# -- 11. XLA options for every program compiled in a block -------------------------------------


def new_ref(x: jax.Array) -> Any:
    """A mutable array (``jax.new_ref``, checked in 0.10.2): read with ``ref[...]``, write
    with ``ref[...] = x``. Made outside a ``jax.grad`` and passed as an argument, a
    ``custom_vjp``'s backward can write it, and a later backward read it (inside a scan:
    a value carried from one backward iteration to the next)."""
    return jax.new_ref(x)


def cpu_fusion_emitter_options(on: bool) -> dict[str, bool]:
    """XLA:CPU's MLIR fusion emitters on or off (``xla_cpu_use_fusion_emitters``) as XLA
    options, where this jaxlib has that choice (before 0.11); ``{}`` where it has not: the
    emitters are always on there, whatever ``on`` asks."""
    return {"xla_cpu_use_fusion_emitters": on} if JAXLIB_VERSION < (0, 11) else {}


def xla_flags_text(options: dict[str, Any]) -> str:
    """XLA options as ``XLA_FLAGS`` text: ``{"a": True, "b": 2}`` -> ``--a=true --b=2``."""
    return " ".join(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                    for k, v in options.items())


@contextlib.contextmanager
def xla_options(options: dict[str, Any]) -> Iterator[list[int]]:
    """Inside, every program JAX compiles gets the XLA debug ``options`` (e.g.
    ``{"xla_cpu_use_fusion_emitters": True}``) over ``XLA_FLAGS``. Yields a list whose
    length counts the programs whose options were built (a program served by JAX's
    in-memory caches is not compiled again, and keeps the options it was compiled with).
    Not thread-safe: it replaces a module attribute for the duration."""
    from jax._src import compiler

    original = compiler.get_compile_options
    built: list[int] = []

    def with_options(*args: Any, **kwargs: Any) -> Any:
        compile_options = original(*args, **kwargs)
        compile_options.env_option_overrides = [
            *[o for o in compile_options.env_option_overrides if o[0] not in options],
            *options.items()]
        built.append(1)
        return compile_options

    compiler.get_compile_options = with_options
    try:
        yield built
    finally:
        compiler.get_compile_options = original


# -- 12. an NNX variable's sharding names ------------------------------------------------------

# ``nnx.with_partitioning(init, names)`` records the names in the variable's metadata: as
# "out_sharding" from flax 0.12 (eager sharding), "sharding_names" in 0.11, "sharding" before.
_NNX_SHARDING_KEYS = ("out_sharding", "sharding_names", "sharding")


def nnx_sharding_names(var: Any) -> tuple | None:
    """The logical (or mesh) axis names an NNX variable was annotated with, one per
    dimension; None if it has none."""
    meta = var.get_metadata() if hasattr(var, "get_metadata") else vars(var)
    for key in _NNX_SHARDING_KEYS:
        names = meta.get(key)
        if names is not None and not hasattr(names, "mesh"):  # names, not a NamedSharding
            return tuple(names)
    return None


# -- 13. devices of a GPU cluster to compile for ------------------------------------------------


def gpu_cluster_devices(target_config: str, nodes: int, local: int) -> list[Any]:
    """The ``nodes x local`` devices of a GPU cluster described by ``target_config`` (a
    ``stream_executor.GpuTargetConfigProto`` in text form), for compiling its programs
    ahead of time on a host with no GPU: ``Mesh(np.array(devices).reshape(nodes, local),
    ...)``, then ``jit(...).lower(<ShapeDtypeStructs on that mesh>).compile()``. Device
    ``i`` is process ``i // local``'s, as on the real cluster. Raises ImportError naming
    the package when the CUDA plugin is missing."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", topology_name="", target_config=target_config,
            topology=f"{nodes}x1x{local}")
    except (NotImplementedError, RuntimeError) as e:
        raise ImportError(
            "compiling for a GPU cluster needs JAX's CUDA plugin: pip install "
            "'jax[cuda12]' (or cuda13) matching this jax; on a host without a GPU run with "
            f"JAX_PLATFORMS=cpu ({e})") from e
    return sorted(topology.devices, key=lambda d: d.id)


# XLA GPU flags for a scanned stack's overlap (note 14): each layer's all-gather moves into
# the previous loop iteration, its reduce-scatter (and all-reduce) into the next; the loop
# unrolled by two, so the buffers those collectives carry across iterations alternate
# instead of being copied each iteration; and the latency-hiding scheduler starts each
# collective as early as its operands allow, with three in flight at once (they still run
# one after another on the collective stream), so the next layer's gather no longer waits
# behind this layer's gradient.
_PIPELINED_COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")
_SCHEDULING_FLAGS: dict[str, bool | int] = {
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_experimental_collective_start_as_early_as_possible": True,
    "xla_gpu_experimental_parallel_collective_overlap_limit": 3,
}
# The pipeliner's switches by spelling: the boolean fields of jaxlib 0.10.2, which
# ``XLA_FLAGS`` still accepts in 0.11.2; the per-collective modes that replaced those
# fields as compile options in 0.11.2 (openxla/xla PR #45836).
_PIPELINER_BOOLEAN = {f"xla_gpu_enable_pipelined_{c}": True for c in _PIPELINED_COLLECTIVES}
_PIPELINER_MODE = {f"xla_gpu_pipeline_{c}": "COLLECTIVE_PIPELINING_MODE_ON"
                   for c in _PIPELINED_COLLECTIVES}
# The settings as ``XLA_FLAGS`` takes them (one spelling that jaxlib 0.10.2 and 0.11.2 read).
GPU_OVERLAP_XLA_FLAGS: dict[str, bool | int] = {**_PIPELINER_BOOLEAN, **_SCHEDULING_FLAGS}
# Each ``XLA_FLAGS`` name with the other spelling of the same setting, so a user's own
# setting in either spelling is kept.
GPU_OVERLAP_FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    **{b: (b, m) for b, m in zip(_PIPELINER_BOOLEAN, _PIPELINER_MODE)},
    **{k: (k,) for k in _SCHEDULING_FLAGS}}


def knows_compile_option(name: str, value: bool | int | str) -> bool:
    """Whether this jaxlib takes ``{name: value}`` as a compile option: XLA's DebugOptions
    are one proto for every backend, and an unknown field raises "No such compile option"
    before anything is compiled (checked in 0.10.2 and 0.11.2). Compiles a one-element
    program on the default backend (milliseconds; starts JAX's backends)."""
    lowered = jax.jit(lambda x: x + 1).lower(jax.ShapeDtypeStruct((), jax.numpy.float32))
    try:
        lowered.compile({name: value})
    except Exception as e:  # noqa: BLE001 - XLA raises its own runtime error types
        if "No such compile option" in str(e):
            return False
        raise
    return True


def gpu_overlap_compile_options(knows=knows_compile_option) -> dict[str, bool | int | str]:
    """The overlap settings as compile options of this jaxlib: the pipeliner's per-collective
    modes where ``knows(name, value)`` says it takes them (0.11.2), else its boolean fields
    (0.10.2); the scheduling options, which both spell alike. A new dict each call."""
    mode = next(iter(_PIPELINER_MODE.items()))
    pipeliner = _PIPELINER_MODE if knows(*mode) else _PIPELINER_BOOLEAN
    return {**pipeliner, **_SCHEDULING_FLAGS}
