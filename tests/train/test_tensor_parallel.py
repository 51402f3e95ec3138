"""Tensor parallelism beside ZeRO: a ``(node, local, model)`` mesh, parameters split over
``"model"`` by Flax logical-axis rules, ZeRO's collectives over the data axes only.

The parity tests run the step and its one-device reference both in float64
(``helpers.float64_run``) and allow each ``FLOAT64_RHO`` of the exact values: a derived
bound on the rounding of any summation order, so also of a tensor-parallel step's (the
row-parallel matmuls' partial products summed over "model"), while a slice put in the wrong
place or a gradient summed over the wrong devices is off by the gradient itself, and a
silent fp32 cast by a rounding 30x the allowance. The checkpoint's next step and generation
run in float64 too; ZeRO++'s training run is held to qgZ's derived INT4 error
(``qgz_bound.qgz_error_bounds``). The tests of layouts and transports (bit for bit, or no rounding
tolerance) stay in fp32.
"""

import contextlib
import dataclasses
import functools
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.core.mesh import MeshInfo
from qgz_bound import check_qgz_step, sliced_int_round_trip
from helpers import (
    FLOAT64,
    FLOAT64_RHO,
    SMALL,
    SMALL64,
    U64,
    as_float64,
    assert_leaves_within,
    assert_loss_and_grads_close,
    assert_rounding_close,
    dequantized_params,
    float64_outputs,
    float64_run,
    fresh_seed,
    init_params,
    jitted,
    make_step,
    momentum_sensitivity,
    reference_loss_and_grads,
    seed_on_failure,
    tokens,
    trajectory_tolerances,
    value_and_grad_of,
)
from zeropp_demo.gpt import GPT, MEGATRON_RULES
from zoo import LLAMA_AXES, MAXTEXT_RULES
from zeropp_jax.comm.partition import make_unit_layout
from zeropp_jax.comm.placement import SLICED_SHARDED, to_host
from zeropp_jax.measure.comm_report import collectives

TP_CFG = dataclasses.replace(SMALL, logical_axes=True)
TP_CFG64 = dataclasses.replace(SMALL64, logical_axes=True)  # the parity tests' model
FP32 = dict(compute_dtype="float32")


@functools.lru_cache(maxsize=None)
def _boxes():
    """The test GPT's logical-axis boxes. Only their names and shapes are used (their values
    are replaced), and those depend on no seed: the init is traced once per process, never
    run."""
    return jax.eval_shape(GPT(TP_CFG).init, jax.random.PRNGKey(0),
                          tokens(2, seed=0)[:, :-1])["params"]


def _boxed_params(seed, float64=False):
    """The test GPT's perturbed init (``helpers.init_params``) in its logical-axis boxes
    (``float64``: the same values as float64 arrays), and the values alone. Drawn outside
    ``float64_run``: under x64 the init's ``ones`` (the logit scale) would be float64, and
    the fp32 noise added to it give another value than the references' fp32 init."""
    assert jax.dtypes.canonicalize_dtype(np.float64) == np.float32, "x64 is on"
    values = init_params(seed=seed)
    if float64:
        values = as_float64(values)
    return jax.tree_util.tree_map(
        lambda box, v: box.replace_boxed(v) if hasattr(box, "replace_boxed") else v,
        _boxes(), values, is_leaf=lambda x: hasattr(x, "replace_boxed")), values


def _state(shape, config, tx=None, seed=0, rules=MEGATRON_RULES, boxed=None):
    """A state of the test GPT on ``shape`` at ``_boxed_params(seed)``; with ``boxed``
    (``_boxed_params(seed, float64=True)[0]``, drawn before): the float64 model at those
    parameters (``config`` then a ``FLOAT64`` one, built and run inside ``float64_run``)."""
    model = GPT(TP_CFG if boxed is None else TP_CFG64)
    boxed = _boxed_params(seed)[0] if boxed is None else boxed
    return zpp.TrainState.create(model=model, params=boxed, tx=tx or optax.sgd(0.1),
                                 mesh=zpp.make_mesh(*shape[:2], model=shape[2],
                                                    devices=jax.devices()[:np.prod(shape)]),
                                 config=config, logical_axis_rules=rules)


# States shared by the tests below, and one step function for all of them. A step compiles
# once per state engine (``TrainState.create`` makes a new one), and a step does not donate
# its state: the tests that take a fixture run their steps from the same state, on the
# program the first of them compiled, and leave it as it was. The optimizer is adamw(1e-2)
# wherever a test needs optimizer state (its moments, weight decay reading the parameters);
# the tests that only read a step's loss and gradients do not depend on it. The float64
# states (the parity tests') run their steps inside ``float64_run()``.


@pytest.fixture(scope="module")
def step():
    """``make_step(with_grads=True)``: the gradients come back too, for the tests that read
    them; the others read the loss."""
    return make_step(with_grads=True)


def _sgd_state64(shape):
    """(seed, float64 zero3 state on ``shape`` with sgd(0.1)) at a fresh seed."""
    seed = fresh_seed()
    boxed, _ = _boxed_params(seed, float64=True)
    with float64_run():
        return seed, _state(shape, zpp.ZeroPPConfig.zero3(**FLOAT64), boxed=boxed)


@pytest.fixture(scope="module")
def sgd_state(_seed_round):
    """(seed, float64 zero3 state on (2, 2, 2) with sgd(0.1)) at a fresh seed (again each
    ``--seed-rounds`` round: tests/conftest.py)."""
    return _sgd_state64((2, 2, 2))


@pytest.fixture(scope="module")
def sgd_state_124(_seed_round):
    """(seed, float64 zero3 state on (1, 2, 4) with sgd(0.1)) at a fresh seed (again each
    ``--seed-rounds`` round)."""
    return _sgd_state64((1, 2, 4))


@pytest.fixture(scope="module")
def adamw_state():
    """A zero3 state on (2, 2, 2) with adamw(1e-2), at seed 0."""
    return _state((2, 2, 2), zpp.ZeroPPConfig.zero3(**FP32), tx=optax.adamw(1e-2))


@pytest.fixture(scope="module")
def zeropp_state():
    """A ZeRO++ state (qwZ, hpZ in groups of 2, qgZ) on (2, 2, 2) with adamw(1e-2), at
    seed 0."""
    return _state((2, 2, 2), zpp.ZeroPPConfig.zeropp(hpz_group_size=2, **FP32),
                  tx=optax.adamw(1e-2))


def test_make_mesh_with_a_model_axis():
    mesh = zpp.make_mesh(2, 2, model=2)
    assert mesh.axis_names == ("node", "local", "model")
    assert mesh.devices.shape == (2, 2, 2)
    ids = np.vectorize(lambda d: d.id)(mesh.devices)
    # Tensor-parallel groups are consecutive devices of one node; nodes hold 4 devices.
    np.testing.assert_array_equal(ids.reshape(-1), np.arange(8))
    assert zpp.make_mesh(1, 2, model=4).devices.shape == (1, 2, 4)
    assert zpp.make_mesh(2, model=2).devices.shape == (2, 2, 2)
    assert zpp.make_mesh(2, 4).axis_names == ("node", "local")  # model=1: two axes
    with pytest.raises(ValueError, match="model=3 does not divide"):
        zpp.make_mesh(2, model=3)
    with pytest.raises(ValueError, match="local \\* model"):
        zpp.make_mesh(2, 4, model=2)
    with pytest.raises(ValueError, match="positive int"):
        zpp.make_mesh(2, 2, model=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_sliced_layout_round_trip(seed):
    rng = np.random.default_rng(seed)
    tp = int(rng.choice([2, 4]))
    shapes = {"a": (3, 4 * tp), "b": (2 * tp,), "c": (tp, 5, 3), "d": (7,), "e": ()}
    dims = {"a": 1, "b": 0, "c": 0, "d": -1, "e": -1}
    tree = {k: rng.standard_normal(s).astype(np.float32) for k, s in shapes.items()}
    lay = make_unit_layout(("u",), tree, num_shards=4, align=2, tp=tp, tp_dims=dims)
    flat = np.asarray(lay.flatten(tree, np.float32))
    assert flat.shape == (tp, lay.n_pad) and lay.n_pad % 8 == 0
    back = lay.unflatten(flat)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(back[k]), tree[k])
    # Row t holds slice t of each split leaf: "a" comes first, its t-th column block.
    t = int(rng.integers(tp))
    np.testing.assert_array_equal(flat[t, : 3 * 4], tree["a"][:, 4 * t: 4 * (t + 1)].ravel())
    assert lay.params == sum(int(np.prod(s)) for s in shapes.values())


@pytest.mark.parametrize("shape", [(2, 2, 2), (1, 2, 4)])
def test_step_matches_one_device(shape, step, request):
    """One float64 zero3 step's loss and gradients are the one-device ones within the
    derived float64 rounding (``FLOAT64_RHO`` each). The states are the shared ones at their
    fresh seeds, the batch from the next seed."""
    seed, state = request.getfixturevalue(
        {(2, 2, 2): "sgd_state", (1, 2, 4): "sgd_state_124"}[shape])
    batch = tokens(16, seed=seed + 1)
    params = as_float64(init_params(seed=seed))
    with float64_run():
        _, out = step(state, batch)
        grads = state.engine.consolidate(out["grads"])
        ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), params, batch)
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads, FLOAT64_RHO)


def test_parameters_and_gathers_are_split(adamw_state, step):
    state = adamw_state
    mesh = state.engine.mesh
    for name, x in state.params.units.items():
        lay = state.engine.layouts[name]
        assert x.shape == (2, lay.n_pad)
        assert x.sharding.spec == SLICED_SHARDED
        # Each device holds 1/(data devices) of one slice: 1/8 of the unit.
        assert {s.data.shape for s in x.addressable_shards} == {(1, lay.n_pad // 4)}
    after, _ = step(state, tokens(16, seed=1))
    for s in (state, after):  # and the step keeps them so
        assert {x.sharding.spec for x in s.opt_state[0].mu.values()} == {SLICED_SHARDED}
        assert {x.sharding.spec for x in s.params.units.values()} == {SLICED_SHARDED}
    # The fc kernel (column parallel) lives in slices: slice t holds columns t*40..t*40+39.
    fc = state.engine.layouts["block_0"]
    host = to_host(state.params.units["block_0"])
    tree = fc.unflatten(host)
    np.testing.assert_array_equal(np.asarray(tree["fc"]["kernel"]),
                                  init_params()["block_0"]["fc"]["kernel"])
    # ZeRO's gathers run over the data axes only: every all-gather of the weights has
    # groups of the 4 devices holding the same slice (same position on "model").
    program = step.lower(state, tokens(16, seed=0)).compile()
    gathers = [c for c in collectives(program, 8) if c.kind == "all-gather"
               and c.shape and c.shape[-1] in {lay.n_pad for lay in
                                               state.engine.layouts.values()}]
    assert gathers
    model_of = np.vectorize(lambda d: d.id)(mesh.devices) % 2
    for c in gathers:
        for g in c.groups:
            assert len(g) == 4 and len({int(model_of.reshape(-1)[d]) for d in g}) == 1, g


def test_zeropp_under_tensor_parallelism_trains(step):
    """ZeRO++ (qwZ, hpZ in groups of 2, qgZ) trains end to end with the weights split:
    three float64 adamw(1e-2) steps on (2, 2, 2) from a fresh seed. At every step the loss
    is the one-device loss at the weights the step computed with (each slice's INT8 blocks,
    dequantized), within the derived float64 rounding, and the gradient the one-device
    gradient there within qgZ's derived INT4 error (``qgz_error_bounds``, from the four
    data groups' gradients), and the step's new weights adamw's update of that gradient
    (from the step's weights and moments, on one device: ``_adamw_rounding``). The
    transports' exactness per slice is pinned bit for bit by
    ``test_sliced_transports_are_the_plain_ones_run_per_slice``, qwZ with hpZ at the
    dequantized weights by
    ``test_qwz_and_hpz_under_tensor_parallelism_are_exact_at_dequantized_weights``."""
    seed = fresh_seed()
    boxed, _ = _boxed_params(seed, float64=True)
    lr, tx = 1e-2, optax.adamw(1e-2)
    with float64_run():
        config = zpp.ZeroPPConfig.zeropp(hpz_group_size=2, **FLOAT64)
        state = _state((2, 2, 2), config, tx=tx, boxed=boxed)
        for t in range(3):
            batch = tokens(16, seed=seed + 1 + t)
            deq = as_float64(dequantized_params(
                state, config.block_size, config.weight_bits, functools.partial(
                    sliced_int_round_trip, bits=config.weight_bits, block=config.block_size)))
            ref_loss, ref = reference_loss_and_grads(GPT(SMALL64), deq, batch)
            # Data group d = (node, local) holds rows 4d..4d+3 (the batch split over the
            # data axes in device order); its tensor-parallel devices compute that
            # group's gradient, which qgZ reduces slice by slice.
            per = [jax.tree_util.tree_map(np.asarray, reference_loss_and_grads(
                GPT(SMALL64), deq, batch[4 * d:4 * d + 4])[1]) for d in range(4)]
            adam = state.opt_state[0]
            moments = [state.engine.consolidate(zpp.ShardedParams(m))
                       for m in (adam.mu, adam.nu)]
            before = state.consolidate()
            state, out = step(state, batch)
            with seed_on_failure(seed):
                got = check_qgz_step(state, out, ref_loss, ref, per, config, nodes=2, local=2,
                                     rho=FLOAT64_RHO, where=f"step {t + 1}")
            # The update: optax's adamw on one device, from the same gradient, weights,
            # moments and count (float64 both).
            with jax.default_device(jax.devices()[0]):
                opt = (optax.ScaleByAdamState(adam.count, *moments), optax.EmptyState(),
                       optax.EmptyState())
                updates, _ = jax.jit(tx.update)(got, opt, before)
                want = jax.tree_util.tree_map(np.asarray,
                                              optax.apply_updates(before, updates))
            tols = _adamw_rounding(got, before, *moments, int(adam.count), lr=lr)
            with seed_on_failure(seed):
                for (path, a), e, tol in zip(
                        jax.tree_util.tree_flatten_with_path(state.consolidate())[0],
                        jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(tols)):
                    err = np.abs(np.asarray(a) - e)
                    assert np.all(err <= tol), (
                        f"step {t + 1}, {jax.tree_util.keystr(path)}: update off by "
                        f"{np.max(err):.3g}, {np.max(err / tol):.3g}x its rounding bound")


def _adamw_rounding(g, p, mu, nu, count, *, lr, b1=0.9, b2=0.999, eps=1e-8, wd=1e-4):
    """Per element, twice the first-order rounding bound of optax's adamw step (its
    defaults but ``lr``; ``eps_root`` 0) from ``g, p, mu, nu`` at ``count``, float64: two
    evaluations of its elementwise formula on the same inputs (the step's on its shards,
    one device's on the consolidated trees) lie within it of each other, in whatever order
    or fusion they round (U the float64 unit roundoff; the constants ``1 - b``, ``1 - b^t``
    are computed alike on both sides). Counted per operation (standard model):
    ``mu' = (1 - b1) g + b1 mu``: 2 U of ``|(1 - b1) g| + |b1 mu|`` (two products, a sum
    that may cancel); ``nu' = (1 - b2) g^2 + b2 nu``: 3 U of itself (no cancellation); the
    bias corrections one division each; ``sqrt(nu_hat)``: half of nu_hat's 4 U plus one,
    3 U; ``+ eps`` one more of the sum; ``m_hat / den``: ``d_m / den + |u| (d_den / den +
    U)``; ``u + wd p``, ``-lr * (.)`` and ``p + (.)`` one each of their results."""
    U = U64

    def one(g, p, mu, nu):
        g, p, mu, nu = (np.asarray(x, np.float64) for x in (g, p, mu, nu))
        t = count + 1
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        m = (1 - b1) * g + b1 * mu
        d_m = 2 * U * ((1 - b1) * np.abs(g) + b1 * np.abs(mu))
        m_hat, d_m_hat = m / bc1, d_m / bc1 + U * np.abs(m / bc1)
        sq = np.sqrt(((1 - b2) * g**2 + b2 * nu) / bc2)
        den = sq + eps
        d_den = 3 * U * sq + U * den
        u = m_hat / den
        d_u = d_m_hat / den + np.abs(u) * (d_den / den + U)
        v = u + wd * p
        d_v = d_u + U * wd * np.abs(p) + U * np.abs(v)
        d_w = lr * d_v + U * lr * np.abs(v)
        d_p = d_w + U * np.abs(p - lr * v)
        return 2 * d_p

    return jax.tree_util.tree_map(one, g, p, mu, nu)


def test_checkpoint_restores_across_tensor_parallel_meshes(tmp_path, step):
    """A float64 adamw state after a step, saved on (2, 2, 2), restores bit for bit (weights
    and moments) on meshes without a "model" axis and on one device, and a checkpoint
    written on (2, 4) on (1, 2, 4); the restored state's next step gives the original's
    loss within the derived float64 rounding."""
    seed = fresh_seed()
    tx = optax.adamw(1e-2)
    boxed, _ = _boxed_params(seed, float64=True)
    # The templates hold other values, which the restore replaces.
    other, _ = _boxed_params(seed + 9, float64=True)
    with float64_run():
        state, _ = step(_state((2, 2, 2), zpp.ZeroPPConfig.zero3(**FLOAT64), tx=tx,
                               boxed=boxed), tokens(16, seed=seed + 1))
        zpp.checkpoint.save(tmp_path, state)
        want = state.consolidate()
        mu = state.engine.consolidate(zpp.ShardedParams(state.opt_state[0].mu))
        # (2, 2, 2) -> a mesh without "model", and one device; then a checkpoint written
        # on (2, 4) without tensor parallelism -> (1, 2, 4).
        plain = tmp_path / "written_without_tp"
        for shape, source in [((2, 4, 1), tmp_path), ((1, 1, 1), tmp_path),
                              ((1, 2, 4), plain)]:
            template = _state(shape, zpp.ZeroPPConfig.zero3(**FLOAT64), tx=tx, boxed=other)
            back = zpp.checkpoint.restore(source, template)
            if shape == (2, 4, 1):
                zpp.checkpoint.save(plain, back)
            assert back.engine is template.engine
            got = back.consolidate()
            for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
                np.testing.assert_array_equal(a, b)
            got_mu = back.engine.consolidate(zpp.ShardedParams(back.opt_state[0].mu))
            for a, b in zip(jax.tree_util.tree_leaves(got_mu), jax.tree_util.tree_leaves(mu)):
                np.testing.assert_array_equal(a, b)
            assert int(back.step) == 1
        # The restored states train on: the next step's loss is the same on every mesh.
        # Both are float64 evaluations of the loss at the same parameters (restored bit for
        # bit, above) on the same batch, in the summation orders of two meshes: each within
        # the derived FLOAT64_RHO of the exact loss.
        back, out = step(back, tokens(16, seed=seed + 2))
        _, ref = step(state, tokens(16, seed=seed + 2))
    with seed_on_failure(seed):
        assert_rounding_close(float(out["loss"]), float(ref["loss"]), FLOAT64_RHO)


def test_what_tensor_parallelism_refuses():
    with pytest.raises(NotImplementedError, match="stage=3"):
        _state((2, 2, 2), zpp.ZeroPPConfig(stage=2, **FP32))
    # heads=4 and d_model=20: a model axis of 8 does not divide the attention output.
    with pytest.raises(ValueError, match="do not divide"):
        _state((1, 1, 8), zpp.ZeroPPConfig.zero3(**FP32))
    with pytest.raises(ValueError, match="alone"):
        _state((2, 2, 2), zpp.ZeroPPConfig.zero3(**FP32),
               rules=(("mlp", ("local", "model")),))


def _nnx_model(seed, dtype=jnp.float32):
    from flax import nnx

    from zoo import D, VOCAB

    named = lambda init, names: nnx.with_partitioning(init, names)  # noqa: E731
    kernel = nnx.initializers.lecun_normal()

    class Mlp(nnx.Module):
        def __init__(self, *, rngs):
            self.norm = nnx.LayerNorm(D, param_dtype=dtype, rngs=rngs)
            self.fc1 = nnx.Linear(D, 4 * D, kernel_init=named(kernel, ("embed", "mlp")),
                                  bias_init=named(nnx.initializers.zeros, ("mlp",)),
                                  param_dtype=dtype, rngs=rngs)
            self.fc2 = nnx.Linear(4 * D, D, kernel_init=named(kernel, ("mlp", "embed")),
                                  param_dtype=dtype, rngs=rngs)

        def __call__(self, x):
            return x + self.fc2(nnx.gelu(self.fc1(self.norm(x))))

    class Lm(nnx.Module):
        def __init__(self, *, rngs):
            self.embed = nnx.Embed(VOCAB, D, rngs=rngs, param_dtype=dtype, embedding_init=named(
                nnx.initializers.normal(1.0), ("vocab", "embed")))
            self.blocks = nnx.List([Mlp(rngs=rngs) for _ in range(2)])
            self.head = nnx.Linear(D, VOCAB, kernel_init=named(kernel, ("embed", "vocab")),
                                   param_dtype=dtype, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            for b in self.blocks:
                x = b(x)
            return self.head(x)

    with nnx.use_eager_sharding(False):
        return Lm(rngs=nnx.Rngs(seed))


def _rope64(num_pos, dim):
    """transformers' Llama RoPE table (``create_sinusoidal_positions``: float32 numpy), its
    same values in float64."""
    inv_freq = 1.0 / (10000 ** (np.arange(0, dim, 2) / dim))
    freqs = np.einsum("i , j -> i j", np.arange(num_pos), inv_freq).astype("float32")
    emb = np.concatenate((freqs, freqs), axis=-1)
    out = np.concatenate((np.sin(emb)[:, None, :], np.cos(emb)[:, None, :]), axis=-1)
    return jnp.asarray(out[:, :, :num_pos].astype(np.float64))


@contextlib.contextmanager
def _llama64():
    """Inside: ``float64_run`` of transformers' Llama module (its explicit fp32 casts read
    as float64), its RoPE table built in float64 (``_rope64``: the same values), and
    ``zoo.hf_compat``: the float64 Llama's construction, its step and its reference."""
    import transformers.models.llama.modeling_flax_llama as llama

    import zoo

    saved = llama.create_sinusoidal_positions
    llama.create_sinusoidal_positions = _rope64
    try:
        with float64_run(llama), zoo.hf_compat():
            yield
    finally:
        llama.create_sinusoidal_positions = saved


class _Foreign(NamedTuple):
    """A model we did not write, set up in float64 for ``test_models_we_did_not_write``."""

    model: Any  # float64
    params: Any  # float64
    make_batch: Any
    loss: Any
    kwargs: dict
    loss64: Any  # (params, batch) -> loss, one device, float64 (the exact reference)
    run: Any  # the context its float64 construction, step and reference run in
    widen: tuple
    exact: tuple
    seed: int  # its inputs' (the NNX weights', the batches')


@functools.lru_cache(maxsize=None)
def _foreign(name, seed_round=0):
    """The model ``name`` in float64 (its weights drawn once per process, and per
    ``--seed-rounds`` round, the NNX model's at a fresh seed), its loss and the one-device
    reference's: both meshes' tests reuse the model and the compiled reference."""
    import zoo

    seed = fresh_seed()
    if name == "nnx":
        from flax import nnx

        run = float64_run
        with run():
            model = _nnx_model(seed, jnp.float64)
            params = as_float64(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
            apply64 = zoo.nnx_apply(model)
        make_batch, loss = zoo._lm_batch, zoo._lm_loss
        kwargs, widen, exact = {}, (), ()
    else:
        import transformers.models.llama.modeling_flax_llama as llama

        with zoo.hf_compat():
            entry = zoo.get(name)  # its fp32 weights (a fixed seed), as float64 below
        make_batch, loss = entry.make_batch, entry.loss
        kwargs, run, widen = {"param_axes": LLAMA_AXES}, _llama64, (llama,)
        params = as_float64(entry.params)
        with run():
            model = type(entry.model)(entry.model.config, input_shape=(1, zoo.SEQ),
                                      dtype=jnp.float64, _do_init=False)
            # As zoo's entries: initialized, its weights the given ones (the library
            # recognizes a transformers model by its ``params``).
            model._is_initialized = True
            model.params = params
        apply64 = model.__call__
        # Its attention mask: booleans made 0/1 fp32 and compared with 0 (exact values).
        exact = ("xi1>) -> tensor<", "dense<0.000000e+00> : tensor<f32>",
                 "(tensor<f32>) -> tensor<", "compare GT")
    return _Foreign(model, params, make_batch, loss, kwargs,
                    lambda p, b: loss(apply64, p, b, False), run, widen, exact, seed)


# Each model on one of the two meshes in `make test`, on the other in test-all: how a model
# names its parameters (NNX's ``with_partitioning``, Llama's ``param_axes``) does not depend
# on the mesh it is split over, and each mesh keeps a model we did not write in `make test`,
# beside the GPT of ``test_step_matches_one_device``: the NNX model split 4 ways on
# (1, 2, 4), Llama 2 ways on (2, 2, 2) (its one key/value head split inside the head, as
# on (1, 2, 4)).
_OTHER_MESH = pytest.mark.slow


@pytest.mark.parametrize("name,shape", [
    pytest.param("nnx", (2, 2, 2), marks=_OTHER_MESH, id="nnx-shape0"),
    pytest.param("nnx", (1, 2, 4), id="nnx-shape1"),
    pytest.param("hf_llama", (2, 2, 2), id="hf_llama-shape0"),
    pytest.param("hf_llama", (1, 2, 4), marks=_OTHER_MESH, id="hf_llama-shape1"),
])
def test_models_we_did_not_write(name, shape, _seed_round):
    """An NNX model annotated with ``nnx.with_partitioning`` and transformers' Flax Llama
    named through ``param_axes`` with MaxText's rules, both in float64: one step on
    ``shape`` gives the one-device loss and gradients within the derived float64
    rounding."""
    import zoo

    if name.startswith("hf_"):
        transformers = pytest.importorskip("transformers")
        if not hasattr(transformers, "FlaxPreTrainedModel"):
            pytest.skip("this transformers has no Flax models")
    foreign = _foreign(name, _seed_round)
    model, params, loss = foreign.model, foreign.params, foreign.loss
    batch = foreign.make_batch(np.random.default_rng(foreign.seed + 1), 16)

    @zpp.train_step
    def step(state, batch):
        value, g = jax.value_and_grad(
            lambda p: loss(state.apply_fn, p, batch, False))(state.params)
        return state.apply_gradients(grads=g), {"loss": value, "grads": g}

    with foreign.run():
        state = zpp.TrainState.create(
            model=model, params=None if name == "nnx" else params, tx=optax.sgd(0.1),
            mesh=zpp.make_mesh(*shape[:2], model=shape[2]),
            config=zpp.ZeroPPConfig.zero3(**FLOAT64),
            logical_axis_rules=MAXTEXT_RULES, **foreign.kwargs)
        split = [lay for lay in state.engine.layouts.values() if max(lay.tp_dims) >= 0]
        assert split, "no parameter was split over 'model'"
        _, out = step(state, batch)
        grads = zoo.flat(state.engine.adapter.to_pure_dict(
            state.engine.consolidate(out["grads"])))
        # The reference holds no fp32 value (``float64_outputs`` checks its program).
        ref_loss, ref_grads = float64_outputs(value_and_grad_of(foreign.loss64), params,
                                              batch, widen=foreign.widen,
                                              exact_f32=foreign.exact)
    ref_grads = zoo.flat(ref_grads)
    with seed_on_failure(foreign.seed):
        assert_rounding_close((out["loss"], [grads[k] for k in sorted(grads)]),
                              (ref_loss, [ref_grads[k] for k in sorted(ref_grads)]),
                              FLOAT64_RHO)


def test_comm_report_separates_tensor_parallel_collectives(zeropp_state, step):
    """On (2, 2, 2) the report splits the step's collectives by the axes they span: ZeRO's
    (over the data axes) move across nodes exactly the bytes the plan's transports count
    for every slice (``Engine.wire_bytes``); tensor parallelism's (XLA's, over "model")
    stay inside the node. The shared ZeRO++ state and step: the program the training tests
    compiled (its gradients come back sharded, as ``ShardedParams``: no collective)."""
    from zeropp_jax.measure.comm_report import CommReport, comm_report

    state = zeropp_state
    program = step.lower(state, tokens(16, seed=0)).compile()
    report = comm_report(program, state.engine.mesh)
    assert report.model == 2 and report.per_node == 4
    axes = report.by_axis()
    assert axes["model"]["count"] > 0 and axes["model"]["cross_node_bytes"] == 0
    zero = sum(r.cross_node_bytes * r.count for r in report.rows
               if r.axis == "data" and r.kind != "all-reduce")  # all-reduce: the metrics
    planned = sum(b.cross for row in state.engine.wire_bytes().values() for b in row.values())
    assert zero == planned > 0
    # The cost model's workload of the state (one rank's shape, two data groups per node)
    # moves across nodes what the compiled step moves, metrics all-reduce included.
    from zeropp_jax.plan.workload import config_workload, shape_of_state

    shape = shape_of_state(state)
    assert shape.tensor_parallel == 2
    work = config_workload(state.engine.config, shape, MeshInfo(2, 2))
    data = sum(r.cross_node_bytes * r.count for r in report.rows if r.axis == "data")
    assert work.cross_bytes_per_node * 2 == data
    assert "over model axes" in report.table()
    assert CommReport.from_json(report.to_json()).by_axis() == axes


def test_eval_step_and_accumulation_under_tensor_parallelism(sgd_state, step):
    """``eval_step`` and ``accumulate_gradients`` take a tensor-parallel state as they
    take any: the evaluated loss is the train step's, and two accumulated half batches
    give the whole batch's step (the same sums, in another order: each run within the
    derived float64 rounding, carried through the sgd step by ``trajectory_tolerances``)."""
    seed, state = sgd_state
    batch = tokens(16, seed=seed + 2)

    @zpp.eval_step
    def evaluate(state, batch):
        from zeropp_demo.gpt import loss_fn
        return {"loss": loss_fn(state.apply_fn({"params": state.params}, batch[:, :-1]),
                                batch[:, 1:])}

    @zpp.train_step
    def accumulated(state, batch):
        from zeropp_demo.gpt import loss_fn

        def loss_of(p, b):
            return loss_fn(state.apply_fn({"params": p}, b[:, :-1]), b[:, 1:])

        loss, grads = zpp.accumulate_gradients(loss_of, state.params, batch, micro_batches=2)
        return state.apply_gradients(grads=grads), {"loss": loss}

    with float64_run():
        want_state, want = step(state, batch)
        evaluated = evaluate(state, batch)
        got_state, got = accumulated(state, batch)
        grads = state.engine.consolidate(want["grads"])
        want_params, got_params = want_state.consolidate(), got_state.consolidate()
    # The whole batch's gradients (within rounding of the exact ones) scale the bound.
    tols = trajectory_tolerances(want_params, grads, rho=FLOAT64_RHO, lr=0.1, steps=1,
                                 sensitivity=momentum_sensitivity())
    with seed_on_failure(seed):
        assert_rounding_close(float(evaluated["loss"]), float(want["loss"]), FLOAT64_RHO)
        assert_rounding_close(float(got["loss"]), float(want["loss"]), FLOAT64_RHO)
        assert_leaves_within(got_params, want_params, tols[-1])


def test_qwz_and_hpz_under_tensor_parallelism_are_exact_at_dequantized_weights():
    """qwZ (INT8 blocks of 64) with hpZ on (2, 2, 2), float64 runs: each slice's shard is
    quantized block by block as without tensor parallelism, so the step's loss and
    gradients are the plain model's at every slice's dequantized weights (forward and
    hpZ's backward see the same weights), within the derived float64 rounding. The INT
    blocks dequantize to fp32 values (fp32 scales), which the model computes with in
    float64."""
    block, seed = 64, fresh_seed()
    boxed, values = _boxed_params(seed, float64=True)
    batch = tokens(16, seed=seed + 1)

    with float64_run():
        cfg = zpp.ZeroPPConfig(qwz=True, weight_bits=8, block_size=block, hpz=True,
                               hpz_group_size=2, **FLOAT64)
        state = _state((2, 2, 2), cfg, boxed=boxed)
        _, out = make_step(with_grads=True)(state, batch)
        # As numpy: the units are cut into their leaves on the host (views, no device
        # programs).
        deq = as_float64(dequantized_params(state, block, 8, functools.partial(
            sliced_int_round_trip, bits=8, block=block)))
        ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), deq, batch)
        grads = state.engine.consolidate(out["grads"])
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads, FLOAT64_RHO)
        # And the quantization did something: the dequantized weights are not the weights.
        assert any(np.max(np.abs(a - b)) > 0 for a, b in zip(
            jax.tree_util.tree_leaves(deq), jax.tree_util.tree_leaves(values)))


def test_ulysses_stays_on_the_data_axes():
    """Sequence parallelism (the demo GPT's Ulysses attention over "local", batch over
    "node") on (2, 2, 2) with the weights split over "model", float64 runs: the one-device
    loss and gradients, within the derived float64 rounding."""
    from jax.sharding import PartitionSpec as P

    from zeropp_demo.gpt import loss_fn

    seed = fresh_seed()
    boxed, values = _boxed_params(seed, float64=True)
    model = GPT(dataclasses.replace(TP_CFG64, sequence_axis="local"))

    @zpp.train_step(batch_spec=P("node", "local"))
    def step(state, batch):
        def loss_of(p):
            return loss_fn(state.apply_fn({"params": p}, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss, "grads": grads}

    # 16 rows, halved over "node": the shapes of ``test_step_matches_one_device`` on
    # (1, 2, 4), whose one-device references compiled them (a process compiles each once).
    batch = tokens(16, seed=seed + 1)
    with float64_run():
        state = zpp.TrainState.create(model=model, params=boxed, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 2, model=2),
                                      config=zpp.ZeroPPConfig.zero3(**FLOAT64),
                                      logical_axis_rules=MEGATRON_RULES)
        _, out = step(state, {"x": batch[:, :-1], "y": batch[:, 1:]})
        ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), values, batch)
        grads = state.engine.consolidate(out["grads"])
    # The step sums the gradient in 4 partials (rows over "node", positions over "local"),
    # another order of the same sums: the derived bound holds for any order.
    with seed_on_failure(seed):
        assert_loss_and_grads_close(out["loss"], grads, ref_loss, ref_grads, FLOAT64_RHO)


class _TPLayer(nn.Module):
    """An MLP block whose weights carry logical names (column then row parallel)."""

    @nn.compact
    def __call__(self, x, _):
        named = nn.with_logical_partitioning
        h = nn.LayerNorm()(x)
        h = nn.Dense(32, kernel_init=named(nn.linear.default_kernel_init, ("embed", "mlp")),
                     bias_init=named(nn.initializers.zeros_init(), ("mlp",)))(h)
        return x + nn.Dense(16, kernel_init=named(nn.linear.default_kernel_init,
                                                  ("mlp", "embed")))(jax.nn.gelu(h)), None


class _TPScanned(nn.Module):
    """Four such blocks in an ``nn.scan`` stack (MaxText's scan_layers), the layer axis
    named "layers"."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(16, name="inp")(x)
        stack = nn.scan(_TPLayer, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=4, metadata_params={nn.PARTITION_NAME: "layers"})
        x, _ = stack(name="layers")(x, None)
        return nn.Dense(4, name="out")(x)


def _mse(apply, p, b):
    return jnp.mean((apply({"params": p}, b["x"]) - b["y"]) ** 2)


def _scanned_loss(p, b):
    """``_TPScanned``'s loss as one device computes it."""
    return _mse(_TPScanned().apply, p, b)


def test_scanned_layer_stacks_split_per_layer():
    """An ``nn.scan`` stack on (2, 2, 2): each layer is a unit of two tensor-parallel
    slices (the layer axis is not a split dimension), and the float64 step gives the
    one-device loss and gradients within the derived float64 rounding (the reference by
    ``float64_outputs``, which also checks that it holds no fp32 value)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    model = _TPScanned()
    batch = {"x": rng.normal(size=(16, 8)), "y": rng.normal(size=(16, 4))}  # float64
    # jitted: one program instead of each of the init's ops compiled and run eagerly. The
    # fp32 init's values as float64: Flax's Dense and LayerNorm compute in the dtype of
    # their float64 parameters and inputs.
    variables = as_float64(jax.jit(model.init)(jax.random.PRNGKey(seed),
                                               batch["x"].astype(np.float32)))
    rules = [("mlp", "model"), ("embed", None), ("layers", None)]

    @zpp.train_step
    def step(state, batch):
        loss, g = jax.value_and_grad(
            lambda p: _mse(state.apply_fn, p, batch))(state.params)
        return state.apply_gradients(grads=g), {"loss": loss, "grads": g}

    params = nn.meta.unbox(variables["params"])
    with float64_run():
        state = zpp.TrainState.create(model=model, params=variables, tx=optax.sgd(0.1),
                                      mesh=zpp.make_mesh(2, 2, model=2),
                                      config=zpp.ZeroPPConfig.zero3(**FLOAT64),
                                      logical_axis_rules=rules)
        layers = [lay for lay in state.engine.layouts.values() if lay.layer is not None]
        assert len(layers) == 4 and all(lay.tp == 2 and max(lay.tp_dims) >= 0
                                        for lay in layers)
        _, out = step(state, batch)
        grads = state.engine.consolidate(out["grads"])
        exact = float64_outputs(value_and_grad_of(_scanned_loss), params, batch)
        with pytest.raises(ValueError, match="layer axis"):
            zpp.TrainState.create(model=model, params=variables, tx=optax.sgd(0.1),
                                  mesh=zpp.make_mesh(2, 2, model=2),
                                  config=zpp.ZeroPPConfig.zero3(**FLOAT64),
                                  logical_axis_rules=[("layers", "model")])
    with seed_on_failure(seed):
        assert_rounding_close((out["loss"], grads), exact, FLOAT64_RHO)


def test_offload_under_tensor_parallelism_is_bit_for_bit_the_same(zeropp_state, step):
    """Optimizer and parameter offload on (2, 2, 2): the slices live in pinned host memory,
    still split over "model", after a step (host -> device -> host), and the step is the
    same bit for bit as on the device (the shared ZeRO++ state, adamw: weight decay reads
    the offloaded parameters)."""
    base = zeropp_state
    off = _state((2, 2, 2), dataclasses.replace(base.config, offload_optimizer=True,
                                                offload_params=True), tx=optax.adamw(1e-2))
    seed = fresh_seed()
    base, want = step(base, tokens(16, seed=seed))
    off, got = step(off, tokens(16, seed=seed))
    with seed_on_failure(seed):
        np.testing.assert_array_equal(got["loss"], want["loss"])
    for tree in (off.params.units, off.opt_state):
        leaves = jax.tree_util.tree_leaves(tree)
        assert {x.sharding.memory_kind for x in leaves} == {"pinned_host"}
        assert {x.sharding.spec for x in leaves if x.ndim == 2} == {SLICED_SHARDED}
    with seed_on_failure(seed):
        for a, b in zip(jax.tree_util.tree_leaves((off.params, off.opt_state)),
                        jax.tree_util.tree_leaves((base.params, base.opt_state))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (1, 2, 4) is slow (``make test-all``): each mesh is a decode program of its own, and
# (2, 2, 2) runs the same code (each slice's shards gathered over the data axes, the
# model's logical-axis constraints over "model"), on a "model" axis of 2 devices instead
# of 4; the (1, 2, 4) mesh trains in ``make test`` (test_step_matches_one_device[shape1]).
@pytest.mark.parametrize("shape", [(2, 2, 2), pytest.param((1, 2, 4), marks=pytest.mark.slow)])
def test_generation_gives_the_same_tokens_with_the_weights_split(shape):
    """``zpp.generate`` (KV cache, greedy) on ``shape`` gives the tokens the model gives
    without a "model" axis: one device's greedy decoding without a cache
    (``greedy_reference``, which ``tests/inference`` holds ``zpp.generate`` to on meshes
    without one), one small program where a ``zpp.generate`` on (2, 4, 1) traced and
    compiled a whole decode loop; both in float64. Their logits differ by rounding only,
    so the tokens must agree wherever the top logit leads the next by more than that
    rounding can move them; a row is compared up to its first step where it does not (a
    near tie, where either token is right), checked by a third evaluation's margins."""
    from zeropp_jax.inference.generate import greedy_reference

    seed = fresh_seed()
    boxed, values = _boxed_params(seed, float64=True)
    prompts = tokens(8, seed=seed + 1)[:, :4]
    new = SMALL.seq_len - 4  # decoded to seq_len: the reference's whole buffer
    with _decode64():
        want = greedy_reference(GPT(SMALL64), values, prompts, SMALL.seq_len)
        # The logits each of the reference's choices came from (causal: position p sees
        # only the tokens up to p, the same as when it was chosen), evaluated again.
        with jax.default_device(jax.devices()[0]):
            logits = np.asarray(jitted(_gpt64_logits)(values, want))
        state = zpp.TrainState.create(
            model=GPT(dataclasses.replace(TP_CFG64, decode=True)), params=boxed,
            tx=optax.sgd(0.1), mesh=zpp.make_mesh(*shape[:2], model=shape[2]),
            config=zpp.ZeroPPConfig.zero3(**FLOAT64), logical_axis_rules=MEGATRON_RULES)
        got = np.asarray(zpp.generate(state, prompts, new))
    np.testing.assert_array_equal(got[:, :4], prompts)
    # Each float64 evaluation of the logits (the reference's, generate's with its KV
    # cache, the one above) lies within FLOAT64_RHO * S of the exact logits (the derived
    # allowance of any summation order, tests/helpers.py; S the largest logit), so where
    # the evaluation above has its top logit ahead of every other by more than
    # 4 FLOAT64_RHO S, the exact top logit leads by more than 2 FLOAT64_RHO S and both
    # decoders pick it. Past a step without that lead a row's tokens may part, rightly.
    lead = 4 * FLOAT64_RHO * float(np.max(np.abs(logits)))
    top2 = np.sort(logits[:, 3:-1], axis=-1)[..., -2:]  # the choices of positions 4..T-1
    certain = top2[..., 1] - top2[..., 0] > lead
    with seed_on_failure(seed):
        for row in range(len(got)):
            upto = 4 + (int(np.argmin(certain[row])) if not certain[row].all() else new)
            np.testing.assert_array_equal(got[row, :upto], want[row, :upto],
                                          err_msg=f"row {row}")


@contextlib.contextmanager
def _decode64():
    """``float64_run``, and the demo GPT's ``jnp.int32`` (its KV cache's index and position)
    read as int64: under x64 its cache update's other indices are int64, and
    ``dynamic_update_slice`` takes one integer type."""
    import zeropp_demo.gpt as gpt

    with float64_run():
        wide = gpt.jnp

        class Int64:
            def __getattr__(self, name):
                return jnp.int64 if name == "int32" else getattr(wide, name)

        gpt.jnp = Int64()
        try:
            yield
        finally:
            gpt.jnp = wide


def _gpt64_logits(params, tokens):
    """The float64 test GPT's logits on one device (one function: ``jitted`` reuses its
    program)."""
    return GPT(SMALL64).apply({"params": params}, tokens)


def test_frozen_parameters_split_like_the_trainable_ones(tmp_path):
    """Frozen parameters (the embedding and the first block's attention, as a LoRA-style
    run freezes a base) on (2, 2, 2), float64 runs: stored per slice like the trainable
    ones, the step's loss and trainable gradients are the one-device ones within the
    derived float64 rounding, the frozen weights come back unchanged, and a checkpoint
    restores on a mesh without a "model" axis. Quantized frozen storage is refused for
    now."""
    seed = fresh_seed()
    boxed, values = _boxed_params(seed, float64=True)
    frozen = [("wte",), ("block_0", "attn")]

    def create(mesh, config=None):  # inside float64_run (the default config too)
        config = config or zpp.ZeroPPConfig.zero3(**FLOAT64)
        return zpp.TrainState.create(model=GPT(TP_CFG64), params=boxed, tx=optax.sgd(0.1),
                                     mesh=mesh, config=config, frozen=frozen,
                                     logical_axis_rules=MEGATRON_RULES)

    batch = tokens(16, seed=seed + 1)
    with float64_run():
        state = create(zpp.make_mesh(2, 2, model=2))
        assert {lay.tp for lay in state.engine.frozen_layouts.values()} == {2}
        assert {x.sharding.spec for x in state.frozen.values.values()} == {SLICED_SHARDED}
        after, out = make_step(with_grads=True)(state, batch)
        ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL64), values, batch)
        grads = state.engine.consolidate(out["grads"])
        got = after.consolidate()
    trainable = {k: v for k, v in ref_grads.items() if k != "wte"}
    trainable["block_0"] = {k: v for k, v in ref_grads["block_0"].items() if k != "attn"}
    with seed_on_failure(seed):
        assert_rounding_close((out["loss"], grads), (ref_loss, trainable), FLOAT64_RHO)
    for a, b in zip(jax.tree_util.tree_leaves((got["wte"], got["block_0"]["attn"])),
                    jax.tree_util.tree_leaves((values["wte"], values["block_0"]["attn"]))):
        np.testing.assert_array_equal(a, b)
    with float64_run():
        zpp.checkpoint.save(tmp_path, after)
        back = zpp.checkpoint.restore(tmp_path, create(zpp.make_mesh(2, 4))).consolidate()
        with pytest.raises(NotImplementedError, match="quantize_frozen=False"):
            create(zpp.make_mesh(2, 2, model=2),
                   zpp.ZeroPPConfig.zeropp(quantize_frozen=True, **FLOAT64))
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(got)):
        np.testing.assert_array_equal(a, b)


def test_sliced_transports_are_the_plain_ones_run_per_slice():
    """Each tensor-parallel slice gets bit for bit what the plain transport gives the same
    buffers on a mesh of only the devices holding that slice: qgZ's two-hop INT4
    reduce-scatter of per-device gradients, and qwZ's INT8 gather with hpZ's secondary
    (kept, then regathered inside the node)."""
    from jax.sharding import PartitionSpec as P

    from zeropp_jax.comm.placement import SHARDED
    from zeropp_jax.comm.transports import plan_of
    from zeropp_jax.comm.transports.sliced import SlicedGradients, SlicedWeights
    from zeropp_jax.core.mesh import AXES

    config = zpp.ZeroPPConfig.zeropp(hpz_group_size=2, block_size=32)
    plan = plan_of(config)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    n_pad, t, d = 4 * 64, 2, 4
    grads = rng.standard_normal((t, d, n_pad)).astype(np.float32)  # [slice, device, n]
    shards = rng.standard_normal((t, d * n_pad // d)).astype(np.float32)
    mesh = zpp.make_mesh(2, 2, model=2)

    def sliced(g, w):
        g = g.reshape(t, n_pad)  # this device's full gradient of each slice
        summed = SlicedGradients(plan.gradients).reduce_sum(g)
        weights = SlicedWeights(plan.weights)
        full, moved = weights.gather((w,))
        again = weights.regather(weights.keep((w,), moved))
        return summed, full, again

    got = jax.jit(jax.shard_map(
        sliced, mesh=mesh, in_specs=(P(None, AXES, None), P(None, AXES)),
        out_specs=(P(None, AXES), P(), P()), axis_names=frozenset(AXES),
        check_vma=False))(grads, shards)

    def plain(g, w):
        summed = plan.gradients.reduce_sum(g.reshape(n_pad))
        full, moved = plan.weights.gather((w,))
        return summed, full, plan.weights.regather(plan.weights.keep((w,), moved))

    for s in range(t):  # the devices holding slice s: model index s of every data group
        devices = np.vectorize(lambda x: x)(mesh.devices)[..., s].reshape(-1)
        sub = zpp.make_mesh(2, 2, devices=list(devices))
        want = jax.jit(jax.shard_map(plain, mesh=sub, in_specs=(P(AXES, None), SHARDED),
                                     out_specs=(SHARDED, P(), P()), check_vma=False))(
            grads[s], shards[s])
        with seed_on_failure(seed):
            for a, b in zip(got, want):
                np.testing.assert_array_equal(np.asarray(a)[s], np.asarray(b))
