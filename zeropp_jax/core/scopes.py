"""Names of the ``jax.named_scope``s the library's own code runs under.

They mark equations in a step's program, so a check reading the program
(``train.axes.check_gradient_collectives``) can tell the library's collectives from the
user's: ``REDUCED`` wraps the reduction that produces a unit's gradient shard (mean over
devices), ``OWN`` the library's code that reads those shards with collectives of its own
(the optimizer step's global norm and finite checks, ``global_norm``, the metrics' mean).
"""

REDUCED = "zeropp_reduced_gradient"
OWN = "zeropp_own"
