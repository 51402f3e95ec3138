"""``zeropp_jax.generation``: the path the docs show for
``zeropp_jax.inference.generate``'s public names
(its home in the layer folders)."""

from zeropp_jax.inference.generate import *  # noqa: F401,F403
