"""``zeropp_jax.quantization``: the path the docs show for
``zeropp_jax.quant.quantization``'s public names
(its home in the layer folders)."""

from zeropp_jax.quant.quantization import *  # noqa: F401,F403
