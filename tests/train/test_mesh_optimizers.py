"""Every mesh shape (1x1, 1xL, Nx1, NxL) with every common optax optimizer equals plain
single-device training, both in float64 (the parity tests' derived tolerance:
tests/helpers.py, ``FLOAT64_RHO``). The 1x1 mesh is what one GPU gives: there the optimizer
state's local and global shapes agree, which once made its PartitionSpecs undecidable."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_demo.gpt import GPT

from helpers import (FLOAT64, FLOAT64_RHO, SMALL64, U64, adam_sensitivity, as_float64,
                     assert_training_close, float64_run, fresh_seed, init_params, make_step,
                     momentum_sensitivity, reference_train, seed_on_failure, sign_sensitivity,
                     tokens, trajectory_tolerances)

# eps=1e-3 for the adaptive ones: see test_engine.test_three_adam_steps_of_stages_1_2_3_equal_single_device
# (rounding noise in gradients that are zero in exact arithmetic must not become full steps).
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1, momentum=0.9),
    "adam": lambda: optax.adam(1e-2, eps=1e-3),
    "adamw": lambda: optax.adamw(1e-2, eps=1e-3, weight_decay=0.1),
    "lion": lambda: optax.lion(1e-3),
    "adamw_schedule": lambda: optax.adamw(
        optax.warmup_cosine_decay_schedule(0.0, 1e-2, 1, 4), eps=1e-3, weight_decay=0.1),
}
# Each optimizer's largest learning rate and how far its update moves per unit change of the
# gradients (helpers.trajectory_tolerances): the bound on two runs' drift.
SENSITIVITY = {
    "sgd": (0.1, momentum_sensitivity(0.9)),
    "adam": (1e-2, adam_sensitivity(1e-3)),
    "adamw": (1e-2, adam_sensitivity(1e-3)),
    "lion": (1e-3, sign_sensitivity()),
    "adamw_schedule": (1e-2, adam_sensitivity(1e-3)),
}
MESHES = [(1, 1), (1, 4), (4, 1), (2, 4)]
FAST = {((2, 4), "adamw"), ((2, 4), "lion"), ((1, 4), "sgd"), ((4, 1), "adam")}
# The full product in `make test-all`; `make test` runs every optimizer on 1x1 but Adam and
# a few pairs elsewhere. Adam on 1x1 is slow: AdamW's state holds the same leaves (Adam's
# count and two moments per unit) and AdamW runs on 1x1 in `make test` ([mesh_shape2-adamw]),
# Adam itself on 4x1 ([mesh_shape11-adam]).
CASES = [
    pytest.param(m, o, marks=() if (m == (1, 1) and o != "adam") or (m, o) in FAST
                 else pytest.mark.slow, id=f"{m[0]}x{m[1]}-{o}")
    for m in MESHES for o in OPTIMIZERS
]


def _lion_zero_gradient_elements_as_reference(actual, expected, start, lr=1e-3, steps=3,
                                               unit=U64):
    """Lion steps by sign(). Attention's key bias has a gradient that is zero in exact
    arithmetic (softmax is shift invariant), so both runs step it by the sign of rounding
    noise (~1e-19 in float64), which differs with the reduction order: a full +-lr step
    either way. Those elements (qkv bias ``[d:2d]``, the key part) may move by at most
    ``steps`` Lion steps, ``lr * (1 + wd |p|)`` each, plus one ulp (``2 unit`` relative) of
    the parameter per step, since each step rounds the stored parameter; that is checked,
    then they are excluded."""
    def fix(path, a, e, s):
        a, e, s = (np.asarray(x, np.float64) for x in (a, e, s))
        if jax.tree_util.keystr(path).endswith("['qkv']['bias']"):
            d = a.shape[0] // 3
            p = np.abs(s[d:2 * d]) + steps * lr  # |parameter| bound over the steps
            bound = steps * lr * (1 + 1e-3 * p) * (1 + 1e-6) + steps * 2 * unit * p
            assert np.all(np.abs(a - s)[d:2 * d] <= bound)
            a = a.copy()
            a[d:2 * d] = e[d:2 * d]
        return a

    return jax.tree_util.tree_map_with_path(fix, actual, expected, start)


@pytest.mark.parametrize("mesh_shape,opt", CASES)
def test_mesh_and_optimizer_equal_single_device(mesh_shape, opt):
    nodes, local = mesh_shape
    n = nodes * local
    model = GPT(SMALL64)
    seed = fresh_seed()
    params = as_float64(init_params(seed=seed))
    batches = [tokens(8, seed=seed + 1 + i) for i in range(3)]
    mesh = zpp.make_mesh(nodes, local, devices=jax.devices()[:n])
    with float64_run():
        state = zpp.TrainState.create(model=model, params=params, tx=OPTIMIZERS[opt](),
                                      mesh=mesh, config=zpp.ZeroPPConfig.zero3(**FLOAT64))
        step = make_step()
        losses = []
        for b in batches:
            state, out = step(state, b)
            losses.append(float(out["loss"]))
        ref_params, ref_losses, ref_grads = reference_train(model, params, OPTIMIZERS[opt](),
                                                            batches, with_grads=True)
    # Gradients differ by summation order, each within the derived float64 rounding of the
    # exact ones; every optimizer here is Lipschitz in them (Lion's sign() only where a
    # moment sits at exactly zero, which perturbed random inits avoid), which bounds the 3
    # steps' drift (helpers).
    actual = state.consolidate()
    lr, sensitivity = SENSITIVITY[opt]
    rho, g = FLOAT64_RHO, ref_grads[0]
    tols = trajectory_tolerances(ref_params, g, rho=rho, lr=lr, steps=3,
                                 sensitivity=sensitivity)
    with seed_on_failure(seed):
        if opt == "lion":
            actual = _lion_zero_gradient_elements_as_reference(actual, ref_params, params)
        assert_training_close(losses, actual, ref_losses, ref_params, ref_grads, tols, rho,
                              start=params)
    # Optimizer leaves keep the placement their specs say (on 1x1 every placement is
    # equivalent; there the point is that create and the step run at all).
    specs = jax.tree_util.tree_leaves(state.engine.opt_specs,
                                      is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))
    leaves = jax.tree_util.tree_leaves(state.opt_state)
    assert len(specs) == len(leaves)
    for leaf, spec in zip(leaves, specs):
        assert leaf.sharding.is_equivalent_to(jax.sharding.NamedSharding(mesh, spec), leaf.ndim)


def test_one_device_default_mesh_is_1x1():
    mesh = zpp.make_mesh(devices=jax.devices()[:1])
    assert dict(mesh.shape) == {"node": 1, "local": 1}
