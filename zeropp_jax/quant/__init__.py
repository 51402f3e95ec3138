"""Blockwise INT8/INT4 quantization with an implementation switch (XLA reference or the
Pallas kernels), optionally Hadamard-rotated or stochastically rounded (``rotation``), and
block-scaled FP8 (``fp8``)."""
