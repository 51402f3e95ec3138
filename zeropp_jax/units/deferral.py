"""Deferred gradient reductions of a scanned stack's layers (``config.qgz_defer``).

A scanned stack's backward is one loop whose body runs one layer's backward. XLA moves a
layer's reduce-scatter into the neighbouring iteration, but not qgZ's all-to-alls, so they
end every iteration with nothing left to run beside them. Here each layer hands its
gradient on to later iterations through a *pipe*: mutable arrays (Refs) made once per step
outside the step's ``jax.grad`` (``make_pipe``), passed into each layer's ``custom_vjp``
(``units.unit``), which reads what earlier iterations left and writes its own.

Two depths, chosen per run (``staged``):

* staged (qgZ with both hops quantized, on several nodes of several devices, without
  ``qgz_until``): iteration ``i`` quantizes its own gradient (``q``), sends the blocks
  layer ``i + 1`` quantized across the node and requantizes them (``r``), and sends
  layer ``i + 2``'s across nodes: three independent pieces, so both all-to-alls run beside
  the layer's compute, and what is carried is quantized (a quarter of a 16-bit gradient
  for INT4, and an eighth of that for the node hop). Layer ``i``'s slot of the stacked
  gradient gets layer ``i + 2``'s shard;
* whole (any other gradient transport): the layer's flat gradient is carried as it is and
  reduced by the next iteration; the slot gets layer ``i + 1``'s shard.

``finish`` runs after the loop (the stacked shards' backward, ``stack``): it reduces what
is still in the pipe, the first one or two layers', and puts every shard back in its own
slot. Every layer's reduction is the same operations on the same gradient with the same
switches as ``reduce_gradient``: the same bits. The loop's first one or two iterations
reduce what an earlier backward left in the pipe (zeros at the first) into slots
``finish`` drops: one or two layers' collectives per step that carry nothing used.
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from zeropp_jax.comm.partition import UnitLayout
from zeropp_jax.comm.transports import UnitTransports, mean_of_sum, reduce_gradient
from zeropp_jax.core import compat
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import AXES, MeshInfo


def staged(grads: Any, switched: bool) -> bool:
    """Whether ``grads`` (a gradient transport) defers in three phases on this mesh (inside
    ``shard_map``): qgZ's ``staged`` transports, when no ``qgz_until`` switch (``switched``)
    can turn qgZ off for the step."""
    return (not switched and hasattr(grads, "staged") and grads.staged(MeshInfo.inside()))


def make_pipe(grads: Any, n_pad: int, dtype: Any, switched: bool) -> dict:
    """The pipe of one scanned stack whose layers' flat gradients are ``[n_pad]`` of
    ``dtype``: ``{"q": ..., "r": ...}`` (staged) or ``{"g": ...}`` (whole), Refs of zeros.
    Call inside ``shard_map``, outside the step's differentiation."""
    zeros = jnp.zeros((n_pad,), dtype)
    if not staged(grads, switched):
        return {"g": compat.new_ref(zeros)}
    q = jax.eval_shape(grads.phase_quantize, zeros)
    r = jax.eval_shape(lambda q: grads.phase_local(q, n_pad), q)
    refs = lambda tree: jax.tree_util.tree_map(  # noqa: E731
        lambda s: compat.new_ref(jnp.zeros(s.shape, s.dtype)), tree)
    return {"q": refs(q), "r": refs(r)}


def _read(refs: Any) -> Any:
    return jax.tree_util.tree_map(lambda r: r[...], refs)


def _write(refs: Any, values: Any) -> None:
    def put(ref: Any, value: jax.Array) -> None:
        ref[...] = value

    jax.tree_util.tree_map(put, refs, values)


def defer(pipe: dict, grads: Any, g_full: jax.Array, shard_dtype: Any,
          on: jax.Array | None, step: jax.Array | None) -> jax.Array:
    """One layer's backward with its reduction deferred: ``g_full`` (its ``[n_pad]`` flat
    gradient) goes into the pipe, and the shard of a later layer (by the pipe's depth) is
    reduced and returned in its place."""
    if "g" in pipe:
        waiting = pipe["g"][...]
        if waiting.shape != g_full.shape or waiting.dtype != g_full.dtype:
            raise ValueError(f"a deferred layer gradient is {g_full.dtype}{list(g_full.shape)}"
                             f", its pipe holds {waiting.dtype}{list(waiting.shape)}")
        pipe["g"][...] = g_full
        return reduce_gradient(grads, waiting, shard_dtype, on, step)
    if on is not None:
        raise ValueError("a staged pipe defers qgZ itself: it cannot follow qgz_until's switch")
    n = g_full.shape[0]
    q_in, r_in = _read(pipe["q"]), _read(pipe["r"])
    _write(pipe["q"], grads.phase_quantize(g_full, step))
    _write(pipe["r"], grads.phase_local(q_in, n, step))
    return mean_of_sum(grads.phase_nodes(r_in, n, step), shard_dtype)


def finish(pipe: dict, grads: Any, g_stacked: jax.Array, n_pad: int, shard_dtype: Any,
           on: jax.Array | None, step: jax.Array | None) -> tuple[jax.Array, ...]:
    """After the loop: the stacked cotangent ``[layers, shard_len]`` (slot ``i`` holding
    layer ``i + depth``'s shard) -> every layer's own shard, the first ``depth`` layers'
    reduced here from what the pipe still holds."""
    layers = g_stacked.shape[0]
    if "g" in pipe:
        first = (reduce_gradient(grads, pipe["g"][...], shard_dtype, on, step),)
    else:
        # The pipe holds layer 0's quantized gradient and layer 1's requantized partial
        # sums (with one layer, stale blocks no layer needs).
        q, r = _read(pipe["q"]), _read(pipe["r"])
        r0 = grads.phase_local(q, n_pad, step)
        first = (mean_of_sum(grads.phase_nodes(r0, n_pad, step), shard_dtype),)
        if layers > 1:
            first += (mean_of_sum(grads.phase_nodes(r, n_pad, step), shard_dtype),)
    depth = len(first)
    return first + tuple(g_stacked[i - depth] for i in range(depth, layers))


def stack(rows: list[jax.Array], pipe: dict, grads: Any, n_pad: int, shard_dtype: Any,
          qgz_on: jax.Array | None, step: jax.Array | None) -> jax.Array:
    """The layers' primary shards stacked ``[layers, shard_len]`` for a scan whose layers
    defer their gradient's reduction (``zero_unit(..., pipe=)``): backward puts each
    layer's shard back in its slot and reduces what the pipe still holds (``finish``)."""
    flags = {k: v for k, v in (("on", qgz_on), ("step", step)) if v is not None}

    @jax.custom_vjp
    def stacked(rows: tuple, pipe: dict, flags: dict) -> jax.Array:
        return jnp.stack(rows)

    def stack_fwd(rows: tuple, pipe: dict, flags: dict) -> tuple[jax.Array, tuple]:
        return jnp.stack(rows), (pipe, flags)

    def stack_bwd(res: tuple, g: jax.Array) -> tuple:
        pipe, flags = res
        shards = finish(pipe, grads, g, n_pad, shard_dtype, flags.get("on"),
                        flags.get("step"))
        return (shards, jax.tree_util.tree_map(lambda _: None, pipe),
                {k: None for k in flags})

    stacked.defvjp(stack_fwd, stack_bwd)
    return stacked(tuple(rows), pipe, flags)


def pipes(layouts: Mapping[str, UnitLayout], config: ZeroPPConfig,
          transports: Mapping[str, UnitTransports]) -> dict[tuple[str, ...], Any]:
    """One pipe per scanned stack (``make_pipe``), for ``units.apply.apply_units(pipes=)``.
    Make them in the step, inside ``shard_map`` and outside its ``jax.grad``: a Ref made
    inside a differentiated function cannot cross into a ``custom_vjp``'s backward."""
    stacks: dict[tuple[str, ...], UnitLayout] = {}
    for lay in layouts.values():
        if lay.layer is not None:
            stacks.setdefault(lay.path, lay)
    # A transport with a switch step (qgz_until) gets qgZ's on/off flag in every step.
    return {path: make_pipe(transports[lay.name].gradients, lay.n_pad,
                            config.compute_jnp_dtype,
                            switched=transports[lay.name].gradients.switch_step() is not None)
            for path, lay in stacks.items()}
