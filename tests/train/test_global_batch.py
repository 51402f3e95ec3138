"""Global-batch losses: a CLIP-style contrastive loss over all devices' embeddings
(``zpp.all_gather_batch``) trains exactly as the same loss on one device, for ZeRO-3 and
stages 1 and 2; written over the local batch, it trains another objective. The parity
checks run both sides in float64 (the derived tolerance: tests/helpers.py,
``FLOAT64_RHO``)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp

from helpers import (FLOAT64, FLOAT64_RHO, as_float64, assert_rounding_close,
                     assert_training_close, float64_run, fresh_seed, momentum_sensitivity,
                     seed_on_failure, trajectory_tolerances)

DEVICES = 8
ROWS = 2 * DEVICES  # global batch: two rows per device
LR = 0.5
UNITS = ["img/*", "txt/*"]  # ZeRO-3: each dense layer its own unit


class Tower(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(6, name="out")(jnp.tanh(nn.Dense(12, name="hidden")(x)))


class Clip(nn.Module):
    """Two towers and a learned temperature (a parameter the loss uses directly)."""

    @nn.compact
    def __call__(self, img, txt):
        scale = self.param("logit_scale", lambda _: jnp.asarray(1.5, jnp.float32))
        return Tower(name="img")(img), Tower(name="txt")(txt), scale


def contrastive(zi, zt, scale):
    """Symmetric InfoNCE of the rows of ``zi`` against the rows of ``zt`` (row ``i`` matches
    row ``i``)."""
    zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
    zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
    logits = jnp.exp(scale) * zi @ zt.T
    labels = jnp.arange(zi.shape[0])
    ce = optax.softmax_cross_entropy_with_integer_labels
    return (ce(logits, labels).mean() + ce(logits.T, labels).mean()) / 2


def _batch(seed):
    """Float64 inputs (the towers' nn.Dense compute in the dtype of their float64
    parameters and inputs)."""
    rng = np.random.default_rng(seed)
    return {"img": rng.standard_normal((ROWS, 5)), "txt": rng.standard_normal((ROWS, 7))}


def _gather_invarying(x):
    # The device-invariant all-gather (its transpose is a slice): what all_gather_batch
    # must not be.
    return jax.lax.all_gather(x, ("node", "local"), tiled=True, to="invarying")


def _step(how):
    """``how``: "global" (zpp.all_gather_batch) or "local" (the loss over the local batch,
    as for a per-example loss)."""

    @zpp.train_step
    def step(state, batch):
        def loss_of(p):
            zi, zt, scale = state.apply_fn({"params": p}, batch["img"], batch["txt"])
            if how == "global":
                zi, zt = zpp.all_gather_batch((zi, zt))
            return contrastive(zi, zt, scale)

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), loss

    return step


@pytest.fixture(scope="module")
def setup(_seed_round):  # drawn again each --seed-rounds round (tests/conftest.py)
    """The model, float64 parameters and batches at a fresh seed, and the one-device float64
    SGD trajectory on them: ``(losses, final params, gradients, tolerances, rho)``."""
    model = Clip()
    seed = fresh_seed()
    b = _batch(seed)
    batches = [_batch(seed + 1), _batch(seed + 2)]
    with float64_run():
        params = as_float64(model.init(jax.random.PRNGKey(seed), b["img"], b["txt"])["params"])

        def ref_loss(p, batch):
            return contrastive(*model.apply({"params": p}, batch["img"], batch["txt"]))

        # One-device SGD: the reference trajectory.
        value_and_grad = jax.jit(jax.value_and_grad(ref_loss))
        losses, grads, p = [], [], params
        for batch in batches:
            value, g = value_and_grad(p, batch)
            losses.append(float(value))
            grads.append(g)
            p = jax.tree_util.tree_map(lambda a, b: a - LR * b, p, g)
    # Each run (any summation order: one device, or per device and then over devices)
    # within the derived float64 rounding of the exact values: running_error_bound gives
    # this model's loss and gradients kappa ~3e3 unit roundoffs (three seeds), FLOAT64_RHO
    # allows 9e6.
    rho = FLOAT64_RHO
    tols = trajectory_tolerances(p, grads[0], rho=rho, lr=LR, steps=len(batches),
                                 sensitivity=momentum_sensitivity())
    return model, params, batches, (losses, p, grads, tols, rho), seed


def _train(model, params, batches, stage, how):
    mesh = zpp.make_mesh(nodes=2, local=4)
    with float64_run():
        config = zpp.ZeroPPConfig(stage=stage, **FLOAT64)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(LR), mesh=mesh,
                                      config=config, units=UNITS)
        step, losses = _step(how), []
        for batch in batches:
            state, loss = step(state, batch)
            losses.append(float(loss))
    return losses, state.consolidate()


@pytest.mark.parametrize("stage", [3, 2, 1])
def test_global_contrastive_loss_trains_as_on_one_device(setup, stage):
    model, params, batches, (ref_losses, ref_params, ref_grads, tols, rho), seed = setup
    losses, trained = _train(model, params, batches, stage, "global")
    # Same loss values and the same SGD trajectory, to the derived float64 rounding of both
    # runs (the one-device order and the per-device order the sharded step sums in).
    with seed_on_failure(seed):
        assert_training_close(losses, trained, ref_losses, ref_params, ref_grads, tols, rho,
                              start=params)
    if stage == 3:
        # Written over the local batch (2 rows per device: one negative instead of 15), the
        # loss is another objective: the test above fails for it by far more than rounding.
        local_losses, local_params = _train(model, params, batches, stage, "local")
        bound = 2 * rho * abs(ref_losses[0])
        with seed_on_failure(seed):
            assert abs(local_losses[0] - ref_losses[0]) > 1e3 * bound
            with pytest.raises(AssertionError):
                assert_training_close(local_losses, local_params, ref_losses, ref_params,
                                      ref_grads, tols, rho, start=params)


@pytest.mark.parametrize("check_vma", [False, True])
def test_gradient_math_varying_gather_is_exact_invariant_one_is_off_by_the_device_count(
        setup, check_vma):
    """The model a train step follows, spelled out: each device differentiates its own loss
    with respect to device-varying parameters, then the gradients are averaged over devices.
    all_gather_batch's all-gather (device-varying, transposed by a psum_scatter) gives the
    exact gradient; a device-invariant all-gather (transposed by a slice) gives the towers'
    gradient divided by the device count, while the temperature, which every device's
    identical loss uses directly, is right either way. train_step's shard_map runs untyped
    (check_vma=False); all_gather_batch is exact under the typed mode too, where JAX itself
    psums the cotangent of an invariant value that meets device-varying ones (here the
    temperature), so whether the invariant all-gather is off there depends on the loss."""
    model, params, batches, (ref_losses, _, ref_grads, _, rho), seed = setup
    mesh = zpp.make_mesh(nodes=2, local=4)
    axes = ("node", "local")

    def per_device(gather):
        def body(params, batch):
            params = jax.tree_util.tree_map(lambda p: jax.lax.pcast(p, axes, to="varying"),
                                            params)

            def loss_of(p):
                zi, zt, scale = model.apply({"params": p}, batch["img"], batch["txt"])
                return contrastive(gather(zi), gather(zt), scale)

            loss, grads = jax.value_and_grad(loss_of)(params)
            return jax.lax.pmean((loss, grads), axes)

        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P(axes)),
                                     out_specs=P(), check_vma=check_vma))

    with float64_run():
        got = per_device(zpp.all_gather_batch)(params, batches[0])
    with seed_on_failure(seed):
        assert_rounding_close(got, (ref_losses[0], ref_grads[0]), rho)
    if check_vma:
        return
    with float64_run():
        got = per_device(_gather_invarying)(params, batches[0])
    divided = {**ref_grads[0],
               **{t: jax.tree_util.tree_map(lambda g: np.asarray(g) / DEVICES, ref_grads[0][t])
                  for t in ("img", "txt")}}
    with seed_on_failure(seed):
        assert_rounding_close(got, (ref_losses[0], divided), rho)


def test_batch_offset_labels_local_rows_against_the_global_batch(setup):
    """Local image rows against the gathered texts, labelled from batch_offset: the
    image-to-text half of the contrastive loss, with each device computing only its rows'
    logits. Its reported loss (the mean over devices) is the global image-to-text loss."""
    model, params, batches, (*_, rho), seed = setup
    mesh = zpp.make_mesh(nodes=2, local=4)

    def half(zi, zt, scale, offset=0):
        zi = zi / jnp.linalg.norm(zi, axis=-1, keepdims=True)
        zt = zt / jnp.linalg.norm(zt, axis=-1, keepdims=True)
        labels = offset + jnp.arange(zi.shape[0])
        return optax.softmax_cross_entropy_with_integer_labels(
            jnp.exp(scale) * zi @ zt.T, labels).mean()

    @zpp.train_step
    def step(state, batch):
        zi, zt, scale = state.apply_fn({"params": state.params}, batch["img"], batch["txt"])
        offset = zpp.batch_offset(zi)
        return state, {"loss": half(zi, zpp.all_gather_batch(zt), scale, offset),
                       "offset": offset[None].astype(jnp.float32)}

    def ref_half(p, batch):
        return half(*model.apply({"params": p}, batch["img"], batch["txt"]))

    with float64_run():
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(LR), mesh=mesh,
                                      config=zpp.ZeroPPConfig(**FLOAT64), units=UNITS)
        _, out = step(state, batches[0])
        want = jax.jit(ref_half)(params, batches[0])
    with seed_on_failure(seed):
        assert_rounding_close(out["loss"], want, rho)
    # The mean of the offsets 0, 2, ..., 14: device d starts at row 2 d.
    assert float(out["offset"][0]) == 2 * (DEVICES - 1) / 2


def test_outside_a_train_step_it_says_where_it_belongs():
    x = jnp.ones((4, 3))
    with pytest.raises(RuntimeError, match="inside a zeropp_jax.train_step"):
        zpp.all_gather_batch(x)
    with pytest.raises(RuntimeError, match="inside a zeropp_jax.train_step"):
        jax.jit(zpp.batch_offset)(x)
