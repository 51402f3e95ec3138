"""``zeropp_jax.analysis``: the documented path of ``zeropp_jax.measure.analysis``'s public
names (its home in the layer folders). Other names of the home module still answer here,
with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.measure.analysis import (
    CommReport, MemoryModel, comm_report, memory_model, secondary_bytes,
)

__all__ = [
    "CommReport", "MemoryModel", "comm_report", "memory_model", "secondary_bytes",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
