"""``zeropp_jax.qgz``: the path the docs show for
``zeropp_jax.comm.qgz``'s public names
(its home in the layer folders)."""

from zeropp_jax.comm.qgz import *  # noqa: F401,F403
