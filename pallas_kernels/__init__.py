"""Pallas kernels for ZeRO++ quantization, each with a plain-jnp reference beside it."""
