"""``train_step``: a one-device train step function, run as a ZeRO step.

A user keeps writing the train step they would write for one device::

    @zeropp_jax.train_step
    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return cross_entropy(logits, batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

``train_step`` jits the function and runs it inside ``jax.shard_map`` over the
``("node", "local")`` mesh: the batch is split over all devices on its leading dimension,
``state.params`` holds this device's primary shards, and ``state.apply_fn`` runs the Flax
model unit by unit (ZeRO-3) or on replicated weights (stages 1 and 2). Returned train states
keep their shardings; every other returned value is averaged over devices (a per-device
loss becomes the global mean).
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import PartitionSpec as P

from zeropp_jax.core import compat
from zeropp_jax.comm.placement import REPLICATED, SHARDED, ShardedParams, pin_slices
from zeropp_jax.core.mesh import AXES, manual_axes
from zeropp_jax.train import axes
from zeropp_jax.train.dispatch import StepPacer
from zeropp_jax.train.engine import Engine
from zeropp_jax.train.state import TrainState

PyTree = Any


@struct.dataclass
class PerExample:
    """A step output kept per example (``per_example``): each device's rows, put together
    in batch order, instead of averaged over devices."""

    value: PyTree


def per_example(x: PyTree) -> PerExample:
    """Marks a step output (an array or pytree whose leading dimension is this device's
    batch rows, such as logits or per-example losses) to come back per example: the step
    returns the global batch's rows in the order of the batch passed in (laid out like
    the batch: ``batch_spec``), not the mean over devices. Use inside a ``train_step`` or
    ``eval_step`` function, on what it returns."""
    return PerExample(x)


def _is_container(x: Any) -> bool:
    return isinstance(x, (TrainState, ShardedParams, PerExample))


def _out_specs(out: PyTree, batch_spec: P) -> PyTree:
    def spec(x: Any) -> Any:
        if isinstance(x, TrainState):
            return x.specs()
        if isinstance(x, ShardedParams):
            return x.specs()
        if isinstance(x, PerExample):
            return jax.tree_util.tree_map(lambda _: batch_spec, x)
        return REPLICATED

    return jax.tree_util.tree_map(spec, out, is_leaf=_is_container)


def _unwrap(out: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda x: x.value if isinstance(x, PerExample) else x, out,
                                  is_leaf=lambda x: isinstance(x, PerExample))


def _check_read_only(state: TrainState, out: PyTree) -> None:
    """An eval step's function returns the state it was given, if any: a state whose
    arrays were recomputed (``apply_gradients``, new collections) is refused."""
    given = jax.tree_util.tree_flatten(state)
    for x in jax.tree_util.tree_leaves(out, is_leaf=lambda x: isinstance(x, TrainState)):
        if not isinstance(x, TrainState):
            continue
        leaves, treedef = jax.tree_util.tree_flatten(x)
        if treedef != given[1] or any(a is not b for a, b in zip(leaves, given[0])):
            raise ValueError(
                "an eval_step function returned an updated train state (apply_gradients, "
                "new collections): evaluation only reads the state. Return the metrics "
                "alone (or the state as given), or use zeropp_jax.train_step to train"
            )


def _average_metrics(out: PyTree) -> PyTree:
    def avg(x: Any) -> Any:
        if _is_container(x):
            return x
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.floating):
            # Metrics come back in fp32 at least: a bf16 mean over devices would round a
            # slowly falling loss to the same value step after step.
            wide = jnp.promote_types(x.dtype, jnp.float32)
            return jax.lax.pmean(x.astype(wide), AXES)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, AXES)
        if jnp.issubdtype(x.dtype, jnp.integer) or x.dtype == jnp.bool_:
            # Averaged too, in float32 (lax.pmean's own result for an int): returned as
            # they are, the replicated output would be one device's value (a per-device
            # count of correct predictions came back as device 0's alone).
            return jax.lax.pmean(x.astype(jnp.float32), AXES)
        return x  # typed PRNG keys and other extended dtypes: no mean exists

    return jax.tree_util.tree_map(avg, out, is_leaf=_is_container)


def _traced_as_under_jit(fn: Callable[..., Any], axis_name: Any,
                         num_devices: int) -> Callable[..., Any]:
    """``fn`` as ``train_step`` runs it inside ``shard_map``: with ``axis_name`` bound to the
    data-parallel axes, and an unknown axis name reported with the fix."""
    user = fn if axis_name is None else axes.bind_axis_names(fn, axis_name, num_devices)

    def call(*args: Any) -> Any:
        try:
            return user(*args)
        except NameError as e:
            if "axis name" not in str(e).lower():
                raise
            raise axes.unbound_axis_error(e, axis_name) from None

    return call


def train_step(
    fn: Callable[..., Any] | None = None,
    *,
    donate_state: bool = False,
    batch_spec: P = SHARDED,
    axis_name: str | tuple[str, ...] | None = None,
) -> Callable[..., Any]:
    """Turns a one-device train step ``fn(state, batch, *extra)`` into a ZeRO step.

    ``state`` is a ``zeropp_jax.TrainState``; every leaf of ``batch`` is split over all
    devices on its leading dimension (which must be divisible by the device count);
    ``extra`` arguments (an RNG key, a learning-rate scale) are replicated. Inside, ``fn``
    runs per device under ``jax.shard_map`` over ``("node", "local")``. Of what ``fn``
    returns, train states and ``ShardedParams`` keep their shardings and every other array
    is averaged over devices (``pmean``): floating arrays in their dtype, at least float32;
    integer and bool arrays in float32 (an int32 count of correct predictions comes back
    as the mean count per device, a float32: multiply by ``state.engine.num_devices`` for
    the global count, or return per-example values in ``per_example``). To return a PRNG
    key, split from a replicated one, use a typed key (``jax.random.key``): it comes back
    as it is, where a raw ``uint32`` key (``jax.random.PRNGKey``) would be averaged like
    any integer array.

    The returned function is jitted once per input structure; ``.lower(state, batch,
    *extra)`` gives the lowered program (for HLO inspection). With ``donate_state=True``
    the input state's buffers are donated to the output. ``batch_spec`` is the
    ``PartitionSpec`` of every batch leaf: default ``P(("node", "local"))`` (batch split
    over all devices); ``P("node", "local")`` for sequence parallelism (batch over nodes,
    sequence over each node's devices).

    ``fn`` is traced as under ``jax.jit``: values it builds from constants (a scan's zero
    carry, as ``optax.ctc_loss`` makes) mix freely with per-device values, and gradients
    come out per device, reduced by the step itself. Collectives ``fn`` makes itself span
    the data-parallel axes ``("node", "local")``. Code written for ``jax.pmap`` names its
    own axis (``nn.BatchNorm(axis_name="batch")``): ``axis_name="batch"`` (or a tuple of
    names) binds it to those axes, so a sync BatchNorm averages over the global batch.
    A collective over devices applied to the gradients (``lax.pmean(grads, ...)``) is
    refused: they are already averaged (``train.axes``). Outputs wrapped in
    ``per_example(...)`` come back per example, in batch order, instead of averaged.
    """
    if fn is None:
        return functools.partial(train_step, donate_state=donate_state, batch_spec=batch_spec,
                                 axis_name=axis_name)
    return _make_step(fn, donate_state=donate_state, batch_spec=batch_spec,
                      axis_name=axis_name, read_only=False)


def _per_device_program(traced: Any) -> Callable[..., list[Any]] | None:
    """The per-device program of ``jax.make_jaxpr(jax.shard_map(f, ...))(*args)``, as a
    function of ``args``' leaves (each device's block of them, inside a ``shard_map`` with
    the same specs) returning ``f``'s output leaves; None if the trace is not one
    ``shard_map`` equation (then ``f`` is traced again)."""
    from jax.extend import core as jcore

    eqns = traced.jaxpr.eqns
    if len(eqns) != 1 or eqns[0].primitive.name != "shard_map":
        return None
    eqn = eqns[0]
    program = jcore.ClosedJaxpr(eqn.params["jaxpr"], ())
    position = {v: i for i, v in enumerate(traced.jaxpr.invars)}
    consts = dict(zip(traced.jaxpr.constvars, traced.consts))
    if not all(isinstance(v, jcore.Literal) or v in position or v in consts
               for v in eqn.invars):
        return None

    def replay(*leaves: Any) -> list[Any]:
        # A constant the trace captured enters the shard_map replicated: each device's
        # block of it is the whole value.
        return compat.eval_jaxpr(program, *[
            v.val if isinstance(v, jcore.Literal) else
            leaves[position[v]] if v in position else consts[v] for v in eqn.invars])

    return replay


def _make_step(fn: Callable[..., Any], *, donate_state: bool, batch_spec: P,
               axis_name: str | tuple[str, ...] | None, read_only: bool) -> Callable[..., Any]:
    """``train_step`` (``read_only=False``) and ``eval_step`` (``read_only=True``)."""
    batch_spec = P(*batch_spec) if not isinstance(batch_spec, P) else batch_spec

    def run(state: TrainState, batch: PyTree, *extra: Any) -> Any:
        engine = state.engine
        user = _traced_as_under_jit(fn, axis_name, engine.mesh.devices.size)
        in_specs = (
            state.specs(),
            jax.tree_util.tree_map(lambda _: batch_spec, batch),
            *[jax.tree_util.tree_map(lambda _: REPLICATED, e) for e in extra],
        )
        recorded: dict[str, Any] = {}

        def call_user(state: TrainState, batch: PyTree, *extra: Any) -> Any:
            # qgz_defer's Refs, made here, outside the user's jax.grad; the states the
            # step returns leave them behind.
            pipes = {} if read_only else engine.new_pipes()
            if not pipes:
                return user(state, batch, *extra)
            out = user(state.replace(pipes=pipes), batch, *extra)
            return jax.tree_util.tree_map(
                lambda x: x.replace(pipes=None) if isinstance(x, TrainState) else x, out,
                is_leaf=lambda x: isinstance(x, TrainState))

        def probe(state: TrainState, batch: PyTree, *extra: Any) -> list[jax.Array]:
            out = call_user(state, batch, *extra)
            if read_only:
                _check_read_only(state, out)
            recorded["specs"] = _out_specs(out, batch_spec)
            leaves, recorded["tree"] = jax.tree_util.tree_flatten(out)
            return [jnp.asarray(x) for x in leaves]

        # check_vma=False: the user's step is typed as under jax.jit. With shard_map's
        # replication typing, a constant (invariant) and a per-device value cannot share a
        # scan or while carry, which optax.ctc_loss and any RNN-style loss do, and the user
        # cannot pcast inside optax. The library's own collectives do not rely on the typing:
        # a unit's backward is its own custom_vjp, and replicated stage-1/2 weights get
        # per-device gradients (no implicit psum) that apply_gradients reduces.
        # The user's function runs once, abstractly, per device: that trace gives the output
        # structure (so the real shard_map gets exact out_specs), the program's collectives
        # to check, and the per-device program itself, which the real shard_map replays
        # (binding its equations again: Flax and the units' Python do not run twice).
        traced = jax.make_jaxpr(
            jax.shard_map(probe, mesh=engine.mesh, in_specs=in_specs, out_specs=REPLICATED,
                          check_vma=False, **manual_axes(engine.mesh)))(state, batch, *extra)
        axes.check_gradient_collectives(traced)
        replay = _per_device_program(traced)

        def body(state: TrainState, batch: PyTree, *extra: Any) -> Any:
            args = (state, batch, *extra)
            leaves = (replay(*jax.tree_util.tree_leaves(args)) if replay is not None
                      else jax.tree_util.tree_leaves(call_user(*args)))
            return _average_metrics(jax.tree_util.tree_unflatten(recorded["tree"], leaves))

        out = jax.shard_map(body, mesh=engine.mesh, in_specs=in_specs,
                            out_specs=recorded["specs"], check_vma=False,
                            **manual_axes(engine.mesh))(state, batch, *extra)
        return _unwrap(pin_slices(out, recorded["specs"], engine.mesh))

    jitted = jax.jit(run, donate_argnums=(0,) if donate_state else ())
    # Simulated CPU devices whose thread pool was not sized by simulate_cpu_devices deadlock
    # when the host runs far ahead of them: such meshes keep few steps in flight.
    pacer = StepPacer()

    def _check(state: Any) -> Engine:
        if not isinstance(state, TrainState):
            raise TypeError(
                "a train_step function takes a zeropp_jax.TrainState as its first argument "
                f"(from zeropp_jax.TrainState.create), got {type(state).__name__}"
            )
        # A donated (or deleted) state's buffers are gone; JAX may crash on them instead of
        # raising, so say it here.
        if any(isinstance(x, jax.Array) and x.is_deleted()
               for x in jax.tree_util.tree_leaves(state)):
            raise ValueError(
                "this train state's arrays were deleted: it was passed to a step with "
                "donate_state=True (which reuses its buffers for the new state). Use the "
                "state the step returned: state, metrics = step(state, batch)"
            )
        return state.engine

    def remember(engine: Engine, args: tuple) -> None:
        """Leave on the engine how to lower this step again (abstract arguments: no
        buffers kept), for the planner to read its compiled memory
        (``plan.measured.step_of_state``; the key is its ``LOWERED_KEY``)."""
        if not read_only and engine.memo.get("lowered_step_args") is None:
            shapes = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else x, args)
            engine.memo["lowered_step_args"] = shapes
            engine.memo["lowered_step"] = lambda: jitted.lower(*shapes)

    @functools.wraps(fn)
    def wrapper(state: TrainState, batch: PyTree, *extra: Any) -> Any:
        engine = _check(state)

        def call() -> Any:
            sharded = engine.shard_batch(batch, batch_spec)
            remember(engine, (state, sharded, *extra))
            return jitted(state, sharded, *extra)

        return pacer(engine.mesh, call)

    def lower(state: TrainState, batch: PyTree, *extra: Any) -> Any:
        engine = _check(state)
        # Lowering runs nothing across processes: one process may lower alone (to read its
        # communication report) without the batch check its peers would have to answer.
        sharded = engine.shard_batch(batch, batch_spec, check_processes=False)
        lowered = jitted.lower(state, sharded, *extra)
        if not read_only:
            engine.memo["lowered_step"] = lowered  # the planner's (plan.measured)
        return lowered

    wrapper.lower = lower  # type: ignore[attr-defined]
    wrapper.jitted = jitted  # type: ignore[attr-defined]
    return wrapper


def eval_step(
    fn: Callable[..., Any] | None = None,
    *,
    batch_spec: P = SHARDED,
    axis_name: str | tuple[str, ...] | None = None,
) -> Callable[..., Any]:
    """Turns a one-device evaluation step ``fn(state, batch, *extra)`` into a ZeRO step
    that reads the state and returns metrics.

    Runs like ``train_step`` (same batch split, same unit-by-unit weight gathers, forward
    only): every returned array is averaged over devices (a per-device mean loss comes
    back as the mean over the global batch; integer and bool arrays come back as float32
    means, as for ``train_step``), and outputs wrapped in
    ``zeropp_jax.per_example(...)`` come back per example (logits, per-example losses),
    the global batch's rows in order. ``fn`` returns the metrics, or ``(state, metrics)``
    with the state as given: a state it updated (``apply_gradients``) is refused. Never
    donates the state. ``batch_spec`` and ``axis_name`` as for ``train_step``.
    """
    if fn is None:
        return functools.partial(eval_step, batch_spec=batch_spec, axis_name=axis_name)
    return _make_step(fn, donate_state=False, batch_spec=batch_spec, axis_name=axis_name,
                      read_only=True)
