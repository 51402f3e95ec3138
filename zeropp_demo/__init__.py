"""The byte-level GPT, its LoRA variant and the data the examples, benchmarks and tests use.

Not part of the library: ``zeropp_jax`` never imports it.
"""
