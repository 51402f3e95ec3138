"""Losses over the global batch inside a ``train_step``: ``all_gather_batch``, ``batch_offset``.

A ``train_step`` function runs once per device on that device's slice of the batch, and the
step averages the per-device gradients over devices. For a loss that is a mean of
per-example losses, the mean of the local means is the global mean, so writing the loss over
the local batch is exact. A loss that couples examples (a contrastive loss, whose logits
compare every image with every text of the batch; a batch-wide normalisation) is not a mean
of per-example terms: written over the local batch, it trains another objective (each
device's negatives are only its own rows). ``all_gather_batch`` gives every device the
global batch of an array, so such a loss is written over the global batch and its gradient
is exact.

Why the gradient is exact. Let every device ``d`` compute a loss ``L_d(Z)`` of the gathered
``Z = [z_1; ...; z_P]`` (``z_e`` device ``e``'s rows) and the step report their mean
``R = (1/P) sum_d L_d`` (``train_step`` averages returned metrics; usually every ``L_d`` is
the same global loss ``L`` and ``R = L``). ``jax.lax.all_gather`` of a device-varying value
transposes to ``psum_scatter``: device ``e``'s cotangent for ``z_e`` is
``sum_d dL_d/dz_e``, the whole of ``P dR/dz_e``, and its gradient is
``P dR/dz_e . dz_e/dtheta`` (plus ``dL_e/dtheta`` for parameters the loss uses directly,
such as a learned temperature). The step's mean over devices is then
``sum_e dR/dz_e . dz_e/dtheta + (1/P) sum_e dL_e/dtheta = dR/dtheta`` exactly. An
all-gather typed device-invariant (``jax.lax.all_gather(..., to="invarying")``) transposes
to a plain slice instead: device ``e`` gets only its own ``dL_e/dz_e``, and for a loss every
device computes alike the mean over devices is the gathered rows' part of ``dL/dtheta``
divided by ``P``: off by the device count, so it is not used here
(tests/train/test_global_batch.py checks both). (Under ``shard_map``'s typed mode,
``check_vma=True``, JAX psums the cotangent of a device-invariant value where it meets
device-varying ones, which can hide that error for some losses and not others; the
device-varying all-gather is exact in both modes.)
"""

from __future__ import annotations

from typing import Any

import jax

from zeropp_jax.comm import collectives
from zeropp_jax.core.mesh import AXES

PyTree = Any


def _devices(name: str) -> int:
    try:
        return collectives.axis_size(AXES)
    except NameError:
        raise RuntimeError(
            f"zeropp_jax.{name} must be called inside a zeropp_jax.train_step function: it "
            f"works over the mesh axes {AXES} the step runs on. Outside a step the batch is "
            "already the global batch; use it as it is"
        ) from None


def all_gather_batch(x: PyTree, axis: int = 0) -> PyTree:
    """The global batch of ``x``: every device's ``x`` concatenated on ``axis``, in batch order.

    Call inside a ``zeropp_jax.train_step`` function, on values computed from this device's
    slice of the batch (embeddings, targets, the batch itself). The result is the same on
    every device and its rows are in the order of the batch given to the step (device ``d``
    holds rows ``batch_offset(x) ...``, as ``train_step`` split them), so a loss of it is the
    loss of the whole batch. Gradients are exact: the step's gradient is the gradient of the
    loss it reports (the mean over devices of each device's loss; with a loss every device
    computes alike, that loss itself), whether the loss is a mean or a sum over the global
    batch. A pytree gathers every leaf.

    Args:
      x: an array (or pytree of arrays) with this device's rows on ``axis``.
      axis: the batch dimension of ``x``.

    Returns:
      ``x`` with ``axis`` ``P`` times longer (``P`` the device count).

    With ``train_step(batch_spec=P("node", "local"))`` (sequence parallelism: the batch is
    split over nodes only) the devices of a node hold the same rows, so this does not give the
    global batch there.
    """
    _devices("all_gather_batch")

    def gather(leaf: Any) -> jax.Array:
        ndim = getattr(leaf, "ndim", 0)
        if not -ndim <= axis < ndim:
            raise ValueError(
                f"all_gather_batch(axis={axis}) needs an array with that dimension, got shape "
                f"{getattr(leaf, 'shape', ())}"
            )
        # A device-varying all-gather: its transpose is a psum_scatter, which the step's
        # mean over devices turns into the exact gradient (module docstring).
        return jax.lax.all_gather(leaf, AXES, axis=axis % ndim, tiled=True)

    return jax.tree_util.tree_map(gather, x)


def batch_offset(x: Any, axis: int = 0) -> jax.Array:
    """This device's first row in the global batch: ``device index * x.shape[axis]``.

    Call inside a ``zeropp_jax.train_step`` function, with ``x`` this device's slice of the
    batch (or anything with as many rows on ``axis``). Device ``d`` (counted node by node,
    the order ``train_step`` splits the batch in) holds global rows ``[d * n, (d + 1) * n)``
    for ``n`` local rows, so a contrastive loss that keeps its local rows against the
    gathered ones labels row ``i`` with ``batch_offset(x) + i``.
    """
    _devices("batch_offset")
    rows = x.shape[axis]
    return collectives.axis_index(AXES) * rows  # node * L + local: the batch's order
