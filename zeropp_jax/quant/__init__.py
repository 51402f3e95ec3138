"""Blockwise INT8/INT4 quantization with an implementation switch (XLA reference or the Pallas kernels)."""
