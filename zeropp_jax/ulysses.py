"""``zeropp_jax.ulysses``: the documented path of ``zeropp_jax.parallel.ulysses``'s public
names (its home in the layer folders). Other names of the home module still answer here,
with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.parallel.ulysses import (
    all_to_all_bytes_per_layer, dot_product_attention, head_plan, pad_sequence,
    ulysses_attention,
)

__all__ = [
    "all_to_all_bytes_per_layer", "dot_product_attention", "head_plan", "pad_sequence",
    "ulysses_attention",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
