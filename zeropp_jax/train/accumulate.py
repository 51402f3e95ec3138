"""Gradient accumulation over micro-batches, inside a ``train_step``.

Each device splits its local batch into ``micro_batches`` equal pieces and runs forward and
backward on one piece at a time (``lax.scan``), so activation memory is that of one
micro-batch. As in DeepSpeed's ZeRO-3, every micro-batch's backward reduce-scatters its
gradient straight into primary-shard form, and the shards are summed in fp32; full-size
gradients never outlive one micro-batch. With equal micro-batches the mean of the
micro-batch means is the mean over the whole batch, so the result equals one large-batch
step (exactly, up to fp32 summation order).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.core import compat
from zeropp_jax.core.dtypes import accumulation_dtype

PyTree = Any


def _split(batch: PyTree, micro_batches: int) -> PyTree:
    def split(path: Any, x: Any) -> jax.Array:
        x = jnp.asarray(x)
        if x.ndim == 0 or x.shape[0] % micro_batches:
            name = jax.tree_util.keystr(path) or "batch"
            got = x.shape[0] if x.ndim else "a scalar"
            raise ValueError(
                f"{name}: the local batch {got} is not divisible into micro_batches="
                f"{micro_batches}; the global batch must be a multiple of devices x "
                "micro_batches"
            )
        return x.reshape(micro_batches, x.shape[0] // micro_batches, *x.shape[1:])

    return jax.tree_util.tree_map_with_path(split, batch)


def accumulate_gradients(
    loss_fn: Callable[..., Any],
    params: PyTree,
    batch: PyTree,
    *,
    micro_batches: int,
    has_aux: bool = False,
) -> tuple[Any, PyTree]:
    """``jax.value_and_grad(loss_fn)(params, batch)``, computed micro-batch by micro-batch.

    Call inside a ``zeropp_jax.train_step`` function, with ``params = state.params``.

    Args:
      loss_fn: ``loss_fn(params, micro_batch) -> loss`` (or ``(loss, aux)`` with
        ``has_aux``): the mean loss over the micro-batch it is given.
      params: what to differentiate, usually ``state.params``.
      batch: this device's batch; every leaf's leading dimension is split into
        ``micro_batches`` equal micro-batches (an error names the fix if it does not divide).
      micro_batches: number of micro-batches (1: plain ``value_and_grad``).
      has_aux: as for ``jax.value_and_grad``; floating aux leaves are averaged over
        micro-batches, other leaves come from the last micro-batch.

    Returns:
      ``(loss, grads)`` or ``((loss, aux), grads)``: the mean over micro-batches of the
      loss and of the gradients, which have the dtypes and structure of ``params``' own
      gradients (accumulated in fp32 in between).
    """
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive int, got {micro_batches!r}")
    grad_fn = jax.value_and_grad(loss_fn, has_aux=has_aux)
    if micro_batches == 1:
        return grad_fn(params, batch)
    micro = _split(batch, micro_batches)
    first = jax.tree_util.tree_map(lambda x: x[0], micro)
    feedback = getattr(params, "feedback", None)
    if feedback:
        return _accumulate_with_feedback(grad_fn, params, micro, first, micro_batches)
    # Shapes and dtypes of one micro-batch's outputs, to build fp32 accumulators.
    out_shape, grad_shape = jax.eval_shape(grad_fn, params, first)

    def body(carry: tuple, mb: PyTree) -> tuple[tuple, None]:
        out_acc, grad_acc = carry
        out, grads = grad_fn(params, mb)
        return (_tree_add(out_acc, out), _tree_add(grad_acc, grads)), None

    # ``init`` is device-invariant but the accumulated values vary per device: make the
    # carry's type match what the body returns.
    init = jax.tree_util.tree_map(_varying, (_zeros(out_shape), _zeros(grad_shape)))
    (out_sum, grad_sum), _ = jax.lax.scan(body, init, micro)
    return (_mean(out_sum, out_shape, micro_batches),
            _mean(grad_sum, grad_shape, micro_batches))


def _zeros(shapes: PyTree) -> PyTree:
    """Zeros in fp32 at least (``accumulation_dtype``: float64 stays float64) for the
    floating leaves of ``shapes`` (accumulators), zeros of their own dtype for the
    others."""
    def zeros(s: jax.ShapeDtypeStruct) -> jax.Array:
        dt = accumulation_dtype(s.dtype) if jnp.issubdtype(s.dtype, jnp.inexact) else s.dtype
        return jnp.zeros(s.shape, dt)

    return jax.tree_util.tree_map(zeros, shapes)


def _tree_add(acc: PyTree, x: PyTree) -> PyTree:
    """Floating leaves added in the accumulator's dtype; integer aux: the last kept."""
    def add(a: jax.Array, b: jax.Array) -> jax.Array:
        return a + b.astype(a.dtype) if jnp.issubdtype(a.dtype, jnp.inexact) else b

    # Gradients of parameters kept in host memory arrive there: summed on the device.
    return jax.tree_util.tree_map(add, acc, compat.on_device(x))


def _mean(acc: PyTree, shapes: PyTree, micro_batches: int) -> PyTree:
    """Accumulated sums -> means over micro-batches, in the dtypes of ``shapes``."""
    def mean(a: jax.Array, s: jax.ShapeDtypeStruct) -> jax.Array:
        if jnp.issubdtype(a.dtype, jnp.inexact):
            return (a / micro_batches).astype(s.dtype)
        return a

    return jax.tree_util.tree_map(mean, acc, shapes)


def _varying(x: jax.Array) -> jax.Array:
    # Inside shard_map every accumulated value varies over the manual mesh axes (adding a
    # varying micro-batch result makes it so), so the initial carry must say so too.
    axes = tuple(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()) or ())
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _accumulate_with_feedback(grad_fn: Callable[..., Any], params: Any, micro: PyTree,
                              first: PyTree, micro_batches: int) -> tuple[Any, PyTree]:
    """``accumulate_gradients`` for ``state.params`` holding qgZ's kept errors
    (``config.qgz_error_feedback``). Every micro-batch's backward reduce-scatters (as
    without feedback), so the kept errors are carried from one micro-batch's
    reduce-scatter to the next: micro-batch ``k`` quantizes its gradient plus the errors
    micro-batch ``k - 1`` left, and the step returns the last micro-batch's errors. Over the
    step, the micro-batches send the sum of their gradients plus the errors kept before the
    step minus those kept after it; the gradients of the parameters are averaged as
    without feedback."""
    no_feedback = lambda g: g.replace(feedback={})  # noqa: E731
    out_shape, grad_shape = jax.eval_shape(
        lambda p, b: (lambda o, g: (o, no_feedback(g)))(*grad_fn(p, b)), params, first)

    def body(carry: tuple, mb: PyTree) -> tuple[tuple, None]:
        out_acc, grad_acc, kept = carry
        out, grads = grad_fn(params.replace(feedback=kept), mb)
        return (_tree_add(out_acc, out), _tree_add(grad_acc, no_feedback(grads)),
                grads.feedback), None

    init = jax.tree_util.tree_map(_varying, (_zeros(out_shape), _zeros(grad_shape)))
    (out_sum, grad_sum, kept), _ = jax.lax.scan(body, (*init, params.feedback), micro)
    grads = _mean(grad_sum, grad_shape, micro_batches)
    return _mean(out_sum, out_shape, micro_batches), grads.replace(feedback=kept)
