"""``zeropp_jax.processes``: the documented path of ``zeropp_jax.core.processes``'s public
names (its home in the layer folders). Other names of the home module still answer here,
with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.core.processes import (
    DEFAULT_TIMEOUT_S, ProcessesDisagree, TIMEOUT_ENV, agree, allgather, broadcast,
    rendezvous, timeout_s,
)

__all__ = [
    "DEFAULT_TIMEOUT_S", "ProcessesDisagree", "TIMEOUT_ENV", "agree", "allgather",
    "broadcast", "rendezvous", "timeout_s",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
