"""``zeropp_jax.analysis``: the path the docs show for
``zeropp_jax.measure.analysis``'s public names
(its home in the layer folders)."""

from zeropp_jax.measure.analysis import *  # noqa: F401,F403
