"""Test configuration: 8 simulated CPU devices and strict numerics (equinox-style).

The device count must be set before JAX initializes its backend, so it happens at import.
"""

import jax

import zeropp_jax

zeropp_jax.simulate_cpu_devices(8)

# Silent broadcasting bugs fail loudly.
jax.config.update("jax_numpy_rank_promotion", "raise")
