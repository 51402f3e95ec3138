"""The parity tests' float64 tolerance (``helpers.FLOAT64_RHO``) against the derived
rounding bound of the computation it allows for, at a fresh seed."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from zeropp_demo.gpt import GPT

from helpers import (FLOAT64_RHO, SMALL, U64, fresh_seed, gpt_losses, init_params,
                     leaf_scales, seed_on_failure, tokens, value_and_grad_of)
from running_error import running_error_bound


# 3 to 13 minutes on 2 cores (one reverse pass per output element): `make test-all`.
@pytest.mark.slow
def test_float64_tolerance_covers_the_derived_bound():
    """``running_error_bound`` bounds any evaluation of the test GPT's loss and gradients
    (sums in any order, the sharded step's included) by ``kappa`` unit roundoffs of each
    leaf's scale. In float64 that is ``kappa * U64``, which ``FLOAT64_RHO`` must cover
    with room (10x here; the helpers' comment derives the choice), with no comparison that
    float64 rounding could flip (where one could, the linearization does not hold)."""
    seed = fresh_seed()
    params, batch = init_params(seed=seed), tokens(16, seed=seed + 1)
    loss32, _ = gpt_losses(GPT(SMALL))
    exact, bound, flips = running_error_bound(value_and_grad_of(loss32), params, batch,
                                              rows=256, unit=U64)
    kappa = max(float(np.max(b)) / s / U64 for b, s in zip(
        jax.tree_util.tree_leaves(bound), leaf_scales(exact)))
    with seed_on_failure(seed):
        assert not flips, flips
        assert kappa * U64 <= FLOAT64_RHO / 10, (kappa, kappa * U64)
    print(f"seed {seed}: kappa {kappa:.3g}, float64 bound {kappa * U64:.3g}")
