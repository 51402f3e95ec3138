"""``zeropp_jax.collectives``: the path the docs show for
``zeropp_jax.comm.collectives``'s public names
(its home in the layer folders)."""

from zeropp_jax.comm.collectives import *  # noqa: F401,F403
from zeropp_jax.comm.qgz import hierarchical_reduce_scatter, qgz_reduce_scatter  # noqa: F401
