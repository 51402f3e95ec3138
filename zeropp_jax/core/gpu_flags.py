"""The XLA flags a ZeRO step on GPUs needs, in one call.

A scanned stack of layers (``nn.scan``, ``nnx.scan``) compiles to one loop whose body runs
one layer, and with XLA's default flags each layer's gather waits at the top of its
iteration. XLA's collective pipeliner moves each layer's all-gather into the previous
iteration and its gradient's reduce-scatter into the next, so they run while a layer
computes; it is off by default. Alone it copies the buffers it carries across iterations
(a layer's prefetched weights, its gradient) every iteration; unrolling the loop by two
(double buffering) lets them alternate instead. And XLA's scheduler, by default, starts a
collective only shortly before its result is needed, one at a time, which puts the next
layer's gather behind this layer's gradient at the end of the iteration; two experimental
scheduler options start each collective as soon as its input is ready, up to two in
flight. ``use_gpu_overlap_flags()`` turns all of them on for the process
(through ``XLA_FLAGS``, read when JAX's GPU backend starts); ``gpu_overlap_flags()`` gives
the same settings as ``compiler_options`` for one ``jax.jit(...).lower(...).compile``.
On a host without GPUs the flags change nothing.
"""

from __future__ import annotations

import os

from zeropp_jax.core.compat import GPU_OVERLAP_FLAGS, backends_are_initialized


def gpu_overlap_flags() -> dict[str, bool | int]:
    """XLA options for overlapping a scanned stack's collectives with its compute, as
    ``compiler_options`` (``lowered.compile(gpu_overlap_flags())``): XLA's collective
    pipeliner for all-gathers, reduce-scatters and all-reduces, its while-loop double
    buffering, collectives started as early as their inputs allow and two of them in
    flight in the schedule. A new dict each call."""
    return dict(GPU_OVERLAP_FLAGS)


def _flag(name: str, value: bool | int) -> str:
    text = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return f"--{name}={text}"


def use_gpu_overlap_flags() -> str:
    """Adds ``gpu_overlap_flags()`` to ``XLA_FLAGS`` for this process (a flag already set
    there is left as the user set it) and returns the new ``XLA_FLAGS``.

    Call it first thing, as ``simulate_cpu_devices``: XLA reads ``XLA_FLAGS`` when JAX's
    backends start, so after any ``jax.devices()``, array or jitted call it raises (set the
    flags in the environment before starting Python instead, or compile with
    ``compiler_options=gpu_overlap_flags()``)."""
    current = os.environ.get("XLA_FLAGS", "")
    missing = [_flag(k, v) for k, v in GPU_OVERLAP_FLAGS.items() if f"--{k}=" not in current]
    if missing and backends_are_initialized():
        raise RuntimeError(
            "use_gpu_overlap_flags() comes too late: JAX's backends are already initialized "
            "and have read XLA_FLAGS. Call it first thing in your program, before any "
            "jax.devices(), array or jit call; or export XLA_FLAGS=\""
            + " ".join(missing) + "\" before starting Python; or pass "
            "compiler_options=zpp.gpu_overlap_flags() to your step's .compile().")
    flags = " ".join([current, *missing]).strip()
    os.environ["XLA_FLAGS"] = flags
    return flags


__all__ = ["gpu_overlap_flags", "use_gpu_overlap_flags"]
