"""``zeropp_jax.checkpoint``: the path the docs show for
``zeropp_jax.train.checkpoint``'s public names
(its home in the layer folders)."""

from zeropp_jax.train.checkpoint import *  # noqa: F401,F403
