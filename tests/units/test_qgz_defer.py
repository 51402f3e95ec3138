"""``qgz_defer``: a scanned stack's layers reduce each layer's gradient during later layers'
backward (``units.deferral``: qgZ's three phases in three iterations, or the whole gradient
one iteration later). The same operations run on the same gradient with the same switches,
only later, so every step is bit for bit the step without it (fp32, fresh inputs); and the
reductions do move: what the pipe holds when the loop ends runs after it."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import zeropp_jax as zpp
from helpers import fresh_seed, seed_on_failure

from test_nnx_scan import ScanNet
from test_scan import _Scanned, _step

QGZ = dict(qgz=True, compute_dtype="float32")


def _run(model, params, config, batches):
    """Losses of ``train_step``s of ``model`` with ``config`` on ``batches`` (2x4 mesh,
    Adam), and the final parameters' leaves."""
    state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(1e-2),
                                  mesh=zpp.make_mesh(2, 4), config=config)
    step = _step()
    losses = []
    for b in batches:
        state, out = step(state, b)
        losses.append(np.asarray(out["loss"]))
    return losses, jax.tree_util.tree_leaves(state.consolidate())


def _batches(seed, n=3):
    rng = np.random.default_rng(seed)
    return [{"x": rng.standard_normal((16, 8)).astype(np.float32),
             "y": rng.standard_normal((16, 4)).astype(np.float32)} for _ in range(n)]


@pytest.mark.parametrize("options", [
    {},
    # The flags a layer's reduction takes: the step (per-step signs, stochastic rounding's
    # seeds) and qgZ's on/off switch (qgz_until: a traced bool).
    dict(grad_bits=8, qgz_hadamard=True, stochastic_rounding=True, qgz_signs="per_step",
         qgz_until=2, planned_steps=3),
    dict(qgz_hops="cross", remat="full"),
])
def test_deferred_steps_are_the_same_bits(options):
    seed = fresh_seed()
    model = _Scanned(layers=4)
    batches = _batches(seed)
    params = jax.jit(model.init)(jax.random.PRNGKey(seed % 2**31), batches[0]["x"])["params"]
    plain = _run(model, params, zpp.ZeroPPConfig(**QGZ, **options), batches)
    deferred = _run(model, params, zpp.ZeroPPConfig(**QGZ, **options, qgz_defer=True),
                    batches)
    with seed_on_failure(seed):
        for a, b in zip(plain[0], deferred[0]):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(plain[1], deferred[1]):
            np.testing.assert_array_equal(a, b)


def test_nnx_scan_stack_deferred_is_the_same_bits():
    seed = fresh_seed()
    x = np.random.default_rng(seed).standard_normal((16, 3)).astype(np.float32)
    out = {}
    for defer in (False, True):
        state = zpp.TrainState.create(model=ScanNet(nnx.Rngs(seed % 2**31)), params=None,
                                      tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig(**QGZ, qgz_defer=defer))

        @zpp.train_step
        def step(state, x):
            def loss(p):
                return jnp.mean(state.apply_fn({"params": p, **state.collections}, x) ** 2)

            value, g = jax.value_and_grad(loss)(state.params)
            return state.apply_gradients(grads=g), value

        losses = []
        for _ in range(2):
            state, value = step(state, x)
            losses.append(np.asarray(value))
        out[defer] = losses, jax.tree_util.tree_leaves(state.consolidate())
    with seed_on_failure(seed):
        for a, b in zip(out[False][0] + out[False][1], out[True][0] + out[True][1]):
            np.testing.assert_array_equal(a, b)


def test_accumulated_micro_batches_deferred_are_the_same_bits():
    # Each micro-batch's backward runs through the same pipe: its first iterations reduce
    # what the previous micro-batch left there into slots nobody reads.
    from zeropp_jax.train.accumulate import accumulate_gradients

    seed = fresh_seed()
    model = _Scanned(layers=3)
    batches = _batches(seed, n=2)
    params = jax.jit(model.init)(jax.random.PRNGKey(seed % 2**31), batches[0]["x"])["params"]

    @zpp.train_step
    def step(state, batch):
        def loss_of(p, b):
            return jnp.mean((state.apply_fn({"params": p}, b["x"]) - b["y"]) ** 2)

        loss, g = accumulate_gradients(loss_of, state.params, batch, micro_batches=2)
        return state.apply_gradients(grads=g), loss

    out = {}
    for defer in (False, True):
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(1e-2),
                                      mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig(**QGZ, qgz_defer=defer))
        losses = []
        for b in batches:
            state, loss = step(state, b)
            losses.append(np.asarray(loss))
        out[defer] = losses + jax.tree_util.tree_leaves(state.consolidate())
    with seed_on_failure(seed):
        for a, b in zip(out[False], out[True]):
            np.testing.assert_array_equal(a, b)


def _outside_loops(hlo: str, op: str) -> int:
    """How many ``op`` instructions the compiled program's entry computation has."""
    entry = hlo[hlo.index("\nENTRY "):]
    entry = entry[:entry.index("\n}\n")]
    return len(re.findall(rf"= [^=]*\b{op}(-start)?\(", entry))


@pytest.mark.parametrize("options, op, after_loop", [
    # Staged: the pipe still holds layer 0's blocks (both hops to go) and layer 1's
    # partial sums (the node hop): 3 all-to-alls after the loop.
    ({}, "all-to-all", 3),
    # qgz_until can switch qgZ off for a step: the whole flat gradient is carried instead,
    # and the first layer's reduction runs after the loop: one more lax.cond between qgZ
    # and the plain reduce-scatter there.
    (dict(qgz_until=2, planned_steps=3), "conditional", 1),
])
def test_the_first_layers_reductions_run_after_the_loop(options, op, after_loop):
    # Without deferral every layer's qgZ all-to-alls are in the backward loop's body; with
    # it, what the pipe holds when the loop ends is reduced after it, in the entry
    # computation (2 nodes of 4 devices: two hops a reduction).
    model = _Scanned(layers=4)
    x = np.zeros((16, 8), np.float32)
    params = jax.jit(model.init)(jax.random.PRNGKey(0), x)["params"]
    batch = {"x": x, "y": np.zeros((16, 4), np.float32)}
    counts = {}
    for defer in (False, True):
        state = zpp.TrainState.create(
            model=model, params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
            config=zpp.ZeroPPConfig(**QGZ, **options, qgz_defer=defer))
        hlo = _step().lower(state, batch).compile().as_text()
        counts[defer] = _outside_loops(hlo, op)
    assert counts[True] == counts[False] + after_loop, counts


def test_settings_it_needs_are_checked():
    with pytest.raises(ValueError, match="qgz_defer .* needs qgz=True"):
        zpp.ZeroPPConfig(qgz_defer=True)
    with pytest.raises(ValueError, match="qgz_defer and qgz_error_feedback"):
        zpp.ZeroPPConfig(qgz=True, qgz_defer=True, qgz_error_feedback=True)
    assert zpp.ZeroPPConfig(gradients=zpp.Gradients(quantize=True, defer=True)).qgz_defer


@pytest.mark.bitwise_programs
def test_zoo_scan_stack_bf16_zeropp_gradients_are_the_same_bits():
    # The zoo's MaxText-style nn.scan LM under the full ZeRO++ (qwZ, hpZ, qgZ; bf16),
    # compiled with XLA's default fusion emitters: every step's gradients are the same
    # bits. (The optimizer's update after them is XLA's to fuse: with AdamW the two
    # programs' parameters may differ in the last bit, the deferral's arithmetic not.)
    import zoo

    seed = fresh_seed()
    entry = zoo.scan_stack()
    rng = np.random.default_rng(seed)
    batches = [entry.make_batch(rng, 16) for _ in range(2)]
    grads = {}
    for defer in (False, True):
        state = zpp.TrainState.create(model=entry.model, params=entry.params,
                                      tx=optax.sgd(1e-3), mesh=zpp.make_mesh(2, 4),
                                      config=zpp.ZeroPPConfig.zeropp(qgz_defer=defer))

        @zpp.train_step
        def step(state, batch):
            _, g = jax.value_and_grad(
                lambda p: entry.loss(state.apply_fn, p, batch, True))(state.params)
            return state.apply_gradients(grads=g), g

        grads[defer] = []
        for b in batches:
            state, g = step(state, b)
            grads[defer] += jax.tree_util.tree_leaves(state.engine.consolidate(g))
    with seed_on_failure(seed):
        for a, b in zip(grads[False], grads[True]):
            np.testing.assert_array_equal(a, b)
