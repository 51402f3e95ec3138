"""``zeropp_jax.qgz``: deprecated, an old path of ``zeropp_jax.comm.qgz``; importing it
warns (``zeropp_jax/_deprecations.py`` says what to use) and gives the names it gave."""

from zeropp_jax import _deprecations

_deprecations.warn(_deprecations.MOVED[__name__].message)

from zeropp_jax.comm.qgz import *  # noqa: E402,F401,F403
