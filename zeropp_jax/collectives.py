"""``zeropp_jax.collectives``: the documented path of ``zeropp_jax.comm.collectives``'s
public names (its home in the layer folders). Other names of the home module still
answer here, with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.comm.collectives import (
    qwz_all_gather,
)
from zeropp_jax.comm.qgz import hierarchical_reduce_scatter, qgz_reduce_scatter

__all__ = [
    "hierarchical_reduce_scatter", "qgz_reduce_scatter", "qwz_all_gather",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
