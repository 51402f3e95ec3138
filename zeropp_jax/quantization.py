"""``zeropp_jax.quantization``: the documented path of ``zeropp_jax.quant.quantization``'s
public names (its home in the layer folders). Other names of the home module still
answer here, with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.quant.quantization import (
    QuantizedArray, compiled_kernels, dequantize_blockwise, quantize_blockwise,
)

__all__ = [
    "QuantizedArray", "compiled_kernels", "dequantize_blockwise", "quantize_blockwise",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
