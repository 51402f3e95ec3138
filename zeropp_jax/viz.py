"""``zeropp_jax.viz``: the documented path of ``zeropp_jax.measure.viz``'s public names
(its home in the layer folders). Other names of the home module still answer here, with
a warning (``zeropp_jax/_deprecations.py``)."""

from zeropp_jax import _deprecations
from zeropp_jax.measure.viz import *  # noqa: F401,F403  (its __all__)
from zeropp_jax.measure.viz import __all__  # noqa: F401
__getattr__ = _deprecations.short_path_getattr(__name__)
