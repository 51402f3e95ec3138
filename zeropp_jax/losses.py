"""``zeropp_jax.losses``: the path the docs show for
``zeropp_jax.train.losses``'s public names
(its home in the layer folders)."""

from zeropp_jax.train.losses import *  # noqa: F401,F403
