"""Activations from the compiler: what the planner learns from a compiled step of the state.

A ``TrainState`` tells the planner its units, their sizes and the engine's call order
(``workload.shape_of_state``), not what the model keeps from forward to backward: that is
in the user's step (its model, its loss, its batch), which only tracing or compiling it
shows. So when a step of the state is at hand (``plan(state, lowered=step.lower(state,
batch))``, or the one a train step recorded on the state's engine, ``step_of_state``),
the planner compiles it once, reads XLA's ``memory_analysis()`` (arguments +
temporaries, the bytes each device holds at the step's peak) and keeps the part its own
terms do not explain as **activation bytes per token** (``calibrated_shape``). Every
candidate configuration is then priced with that figure times its tokens per device.

Why one compile and not one per candidate: ranking every candidate by its own compiled
step would be exact, but needs a train state of each configuration (its shards, its
optimizer state) and a compile of each, a dozen compiles of the whole step; on a 7B
model each takes minutes. What changes between ZeRO-3 and the ZeRO++ combinations is what
the memory model counts term by term (hpZ's secondary copies, qwZ's quantized buffers,
qgZ's work and error buffers, offloaded state), while what the model keeps for backward
(its activations, the loss's logits) is the same whatever the transport: it is measured
once, on the configuration that was compiled, and reused. What this leaves out:

* the activations are taken as proportional to the tokens per device at the compiled
  step's sequence length (a batch of longer sequences keeps more per token: attention's
  scores grow with it); plan with the same sequence length, or lower a step at the one
  you will train;
* what the model's layers keep per parameter rather than per token (cast copies of the
  weights, when the layers compute in a wider dtype than the weights arrive in) is
  counted per token too, at the compiled step's tokens;
* the compiled step's own backend (XLA's CPU backend makes some buffers a GPU's need not,
  ``workload.memory_breakdown(backend=)``): the planner prices the candidates for the
  backend the step was compiled on.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.plan.workload import ModelShape, memory_breakdown

# Where a train step leaves a handle on its lowered program in the state's engine memo
# (``Engine.memo``), for ``step_of_state``: a ``jax.stages.Lowered`` or ``Compiled`` of a
# step of this state, or a function of no arguments returning one.
LOWERED_KEY = "lowered_step"


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """What XLA says one device holds at the peak of a compiled step.

    Attributes:
      arguments: ``argument_size_in_bytes``: the state (primary shards, optimizer state,
        scalars) and the device's slice of the batch.
      temporaries: ``temp_size_in_bytes``: everything else live at the peak (gathered
        weights, activations, the loss's arrays, gradients).
      tokens_per_device: tokens each data-parallel rank trains in that step: the model
        call's token ids (``model_call_ids``), else the batch's (``batch_tokens``).
      batch_bytes_per_device: the device's slice of the batch (within ``arguments``).
      backend: ``"cpu"`` or ``"gpu"``: the devices it was compiled for.
    """

    arguments: float
    temporaries: float
    tokens_per_device: float
    batch_bytes_per_device: float
    backend: str
    sequence: int = 0  # the model call's sequence length (0: not known)

    @property
    def total(self) -> float:
        """Arguments + temporaries: what the memory model predicts (the state donated)."""
        return self.arguments + self.temporaries


def batch_tokens(batch: Any, ranks: int) -> tuple[float, float]:
    """``(tokens, bytes)`` per data-parallel rank of a global ``batch`` (arrays,
    ``jax.ShapeDtypeStruct`` s or ``ArgInfo`` s with ``shape`` and ``dtype``) split over
    ``ranks``.

    Tokens: the largest leaf of integer ids of shape ``[batch, seq, ...]`` counts ``batch x
    seq`` (a language model's ``input_ids``); without one, the leading dimension of the
    largest leaf (one token per example: an image, a row of features)."""
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if hasattr(x, "shape")]
    if not leaves:
        return 0.0, 0.0
    size = sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in leaves)
    ids = [x.shape[0] * x.shape[1] for x in leaves
           if len(x.shape) >= 2 and np.issubdtype(np.dtype(x.dtype), np.integer)]
    if ids:
        tokens = max(ids)
    else:
        tokens = max(leaves, key=lambda x: math.prod(x.shape)).shape[0] if leaves[0].shape \
            else 0
    return tokens / ranks, size / ranks


def compiled_memory(step: Any, state: Any) -> CompiledMemory:
    """The compiled memory of ``step``, a step of ``state`` lowered or compiled
    (``train_step``'s ``step.lower(state, batch)``, or ``.compile()`` of it): a
    ``jax.stages.Lowered`` is compiled here (a compile of the whole step: seconds on a
    small model, minutes on a 7B), a ``Compiled`` is read as it is.

    The batch is the step's second argument (``step(state, batch, *extra)``), split
    over the state's data-parallel ranks (``nodes x local``)."""
    compiled = step.compile() if hasattr(step, "compile") else step
    if not hasattr(compiled, "memory_analysis"):
        raise TypeError(
            f"lowered={step!r} is a {type(step).__name__}: give a step of this state lowered "
            "or compiled, step.lower(state, batch) (or its .compile())")
    stats = compiled.memory_analysis()
    if stats is None:
        raise ValueError("the compiled step has no memory analysis on this backend: give "
                         "tokens_per_device and plan without lowered=")
    args = compiled.args_info[0] if compiled.args_info else ()
    devices = state.engine.info.data
    batch = args[1] if len(args) > 1 else ()
    tokens, batch_bytes = batch_tokens(batch, devices)
    leaves = [x for x in jax.tree_util.tree_leaves(batch) if getattr(x, "shape", ())]
    ids = model_call_ids(state.engine, leaves[0].shape[0] / devices) if leaves else None
    if ids is not None:
        tokens = float(ids[0] * ids[1])
    if not tokens:
        raise ValueError("the compiled step's batch (its second argument) has no array to "
                         "count tokens from: give a step called as step(state, batch)")
    platform = state.engine.mesh.devices.flat[0].platform
    return CompiledMemory(float(stats.argument_size_in_bytes), float(stats.temp_size_in_bytes),
                          tokens, batch_bytes, "cpu" if platform == "cpu" else "gpu",
                          ids[1] if ids is not None else 0)


def model_call_ids(engine: Any, rows: float) -> tuple[int, int] | None:
    """``(rows, seq)``: the token ids per device the model was called on in the step
    traced last with ``rows`` rows per device, the largest integer array of shape
    ``[rows, seq, ...]`` among the model call's arguments, as the engine recorded the
    call (the
    ``"resident"`` answers of ``units.apply.find_resident``, keyed by the call's argument
    shapes and dtypes). None if no such call was recorded.

    A language model's batch often holds ``seq + 1`` tokens a row (inputs and targets
    shifted by one) where the model sees ``seq``: the model's call counts what it keeps
    activations for."""
    traced = engine.memo.get("resident") or {}

    def found(x: Any) -> list[int]:
        if (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], str)
                and isinstance(x[0], tuple) and len(x[0]) >= 2
                and all(isinstance(d, int) for d in x[0])):
            try:
                integer = np.issubdtype(np.dtype(x[1]), np.integer)
            except TypeError:
                return []
            return [x[0][:2]] if integer and x[0][0] == rows else []
        if isinstance(x, tuple):
            return [n for y in x for n in found(y)]
        return []

    for key in reversed(list(traced)):
        shapes = found(key)
        if shapes:
            return max(shapes, key=lambda s: s[0] * s[1])
    return None


def step_of_state(state: Any) -> Any:
    """The lowered (or compiled) step a train step of ``state`` left on its engine
    (``LOWERED_KEY`` in ``Engine.memo``), or None if none did."""
    memo = getattr(getattr(state, "engine", None), "memo", None) or {}
    found = memo.get(LOWERED_KEY)
    if found is not None and not hasattr(found, "compile") and not hasattr(
            found, "memory_analysis") and callable(found):
        found = found()
    return found


def calibrated_shape(shape: ModelShape, config: ZeroPPConfig, mesh: MeshInfo,
                     measured: CompiledMemory) -> ModelShape:
    """``shape`` with ``activation_bytes_per_token`` set so that the memory model of the
    compiled step (``config`` on ``mesh``, ``measured.tokens_per_device`` tokens,
    ``measured.backend``) is ``measured.total``: what the compiled step holds beyond the
    model's other terms, per token (the batch's bytes among it).

    The model's total is ``max(A + t x, E)`` in ``x`` = bytes per token: every moment of
    the step but its end (the update, when activations are gone) holds them. With ``A``
    and ``E`` read from the model at ``x = 0`` and at a large ``x``, ``x = (total - A) /
    t``; 0 when the model without activations already reaches the compiled total."""
    t = measured.tokens_per_device
    base = dataclasses.replace(shape, activation_bytes_per_token=0.0)

    def total(x: float) -> float:
        return memory_breakdown(config, dataclasses.replace(base, activation_bytes_per_token=x),
                                mesh, t, backend=measured.backend).total

    at_zero = total(0.0)
    if measured.total <= at_zero or not t:
        return base
    # At t x = measured.total (>= E) the activations' moments are the peak: A + t x.
    probe = measured.total / t
    a = total(probe) - probe * t
    return dataclasses.replace(base, activation_bytes_per_token=(measured.total - a) / t)


__all__ = ["CompiledMemory", "LOWERED_KEY", "batch_tokens", "calibrated_shape",
           "compiled_memory", "model_call_ids", "step_of_state"]
