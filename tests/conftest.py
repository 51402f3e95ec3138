"""Test configuration: 8 simulated CPU devices and strict numerics (equinox-style).

The device count must be set before JAX initializes its backend, so it happens at import.
"""

import os

# Compiling is most of the suite's time: with a warm compilation cache the same tests run ~3x
# faster. Most of an XLA CPU compile is LLVM optimising the generated kernels, which the tests
# do not need: they check numerics against references compiled the same way (tolerances are
# derived from the rounding measured under these flags), the HLO XLA emits and its buffer
# assignment, none of which depend on LLVM's optimisation level. -O0 cut a compile-bound test
# file's time by ~25% on a 2-core AMD EPYC. Subprocesses the tests start inherit it
# (helpers.subprocess_env).
COMPILE_FLAGS = "--xla_backend_optimization_level=0"
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), COMPILE_FLAGS]))

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

import zeropp_jax  # noqa: E402

zeropp_jax.simulate_cpu_devices(8)

# Silent broadcasting bugs fail loudly.
jax.config.update("jax_numpy_rank_promotion", "raise")
