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
scheduler options start each collective as soon as its input is ready, up to three in
flight. ``use_gpu_overlap_flags()`` turns all of them on for the process
(through ``XLA_FLAGS``, read when JAX's GPU backend starts); ``gpu_overlap_flags()`` gives
the same settings as ``compiler_options`` for one ``jax.jit(...).lower(...).compile``,
spelt as the installed jaxlib takes them (its compile options renamed the pipeliner's
switches in 0.11; ``XLA_FLAGS`` reads the older spelling in both). On a host without GPUs
the flags change nothing.
"""

from __future__ import annotations

import os

from zeropp_jax.core.compat import (GPU_OVERLAP_FLAG_ALIASES, GPU_OVERLAP_XLA_FLAGS,
                                    backends_are_initialized, gpu_overlap_compile_options,
                                    xla_flags_text)


def gpu_overlap_flags() -> dict[str, bool | int | str]:
    """XLA options for overlapping a scanned stack's collectives with its compute, as
    ``compiler_options`` (``lowered.compile(gpu_overlap_flags())``): XLA's collective
    pipeliner for all-gathers, reduce-scatters and all-reduces, its while-loop double
    buffering, collectives started as early as their inputs allow and three of them in
    flight in the schedule. The pipeliner's switches are spelt as this jaxlib's compile
    options take them (``xla_gpu_enable_pipelined_*=True`` in jax 0.10,
    ``xla_gpu_pipeline_*="COLLECTIVE_PIPELINING_MODE_ON"`` in 0.11), which the first call
    finds out by compiling a one-element program, so it starts JAX's backends. A new
    dict each call."""
    return gpu_overlap_compile_options()


def use_gpu_overlap_flags() -> str:
    """Adds the settings of ``gpu_overlap_flags()`` to ``XLA_FLAGS`` for this process (a
    setting already there, in either spelling, is left as the user set it) and returns the
    new ``XLA_FLAGS``. The pipeliner's switches go in as booleans
    (``--xla_gpu_enable_pipelined_all_gather=true``), the spelling ``XLA_FLAGS`` reads in
    jax 0.10 and 0.11 alike.

    Call it first thing, as ``simulate_cpu_devices``: XLA reads ``XLA_FLAGS`` when JAX's
    backends start, so after any ``jax.devices()``, array or jitted call it raises (set the
    flags in the environment before starting Python instead, or compile with
    ``compiler_options=gpu_overlap_flags()``)."""
    current = os.environ.get("XLA_FLAGS", "")
    missing = [xla_flags_text({k: v}) for k, v in GPU_OVERLAP_XLA_FLAGS.items()
               if not any(f"--{a}=" in current for a in GPU_OVERLAP_FLAG_ALIASES[k])]
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
