"""``zeropp_jax.ulysses``: the path the docs show for
``zeropp_jax.parallel.ulysses``'s public names
(its home in the layer folders)."""

from zeropp_jax.parallel.ulysses import *  # noqa: F401,F403
