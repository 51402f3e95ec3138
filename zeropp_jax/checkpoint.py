"""``zeropp_jax.checkpoint``: the documented path of ``zeropp_jax.train.checkpoint``'s
public names (its home in the layer folders). Other names of the home module still
answer here, with a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.train.checkpoint import (
    CheckpointError, available_steps, latest_step, load_params, restore, save,
)

__all__ = [
    "CheckpointError", "available_steps", "latest_step", "load_params", "restore",
    "save",
]
__getattr__ = _deprecations.short_path_getattr(__name__)
