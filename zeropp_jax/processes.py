"""``zeropp_jax.processes``: the path the docs show for
``zeropp_jax.core.processes``'s public names
(its home in the layer folders)."""

from zeropp_jax.core.processes import *  # noqa: F401,F403
