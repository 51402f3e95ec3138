"""``zeropp_jax.viz``: the path the docs show for
``zeropp_jax.measure.viz``'s public names
(its home in the layer folders)."""

from zeropp_jax.measure.viz import *  # noqa: F401,F403
