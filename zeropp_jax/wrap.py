"""``zeropp_jax.wrap``: the path the docs show for
``zeropp_jax.units.wrap``'s public names
(its home in the layer folders)."""

from zeropp_jax.units.wrap import *  # noqa: F401,F403
