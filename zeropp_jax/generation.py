"""``zeropp_jax.generation``: the documented path of ``zeropp_jax.inference.generate``'s
public names (its home in the layer folders). Other names of the home module still
answer here, with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.inference.generate import (
    gather_secondary, generate, generate_without_cache, lower_generation_step,
    reference_generate, reference_program,
)

__all__ = [
    "gather_secondary", "generate", "generate_without_cache", "lower_generation_step",
    "reference_generate", "reference_program",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
