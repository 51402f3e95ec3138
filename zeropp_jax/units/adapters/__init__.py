"""One adapter per model framework: linen, NNX, transformers."""
