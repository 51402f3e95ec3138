"""Tensor parallelism beside ZeRO: a ``(node, local, model)`` mesh, parameters split over
``"model"`` by Flax logical-axis rules, ZeRO's collectives over the data axes only.

The tolerances are the fp32 rounding of the loss and gradients measured against float64
(``helpers.fp32_gradient_rounding``): a tensor-parallel step sums the row-parallel matmuls'
partial products in another order, which stays inside that rounding, while a slice put in
the wrong place or a gradient summed over the wrong devices is off by the gradient itself.
"""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from helpers import (
    SMALL,
    assert_loss_and_grads_close,
    fp32_gradient_rounding,
    init_params,
    make_step,
    reference_loss_and_grads,
    tokens,
)
from zeropp_demo.gpt import GPT, MEGATRON_RULES
from zeropp_jax.comm.partition import make_unit_layout
from zeropp_jax.comm.placement import SLICED_SHARDED, to_host
from zeropp_jax.measure.comm_report import collectives

TP_CFG = dataclasses.replace(SMALL, logical_axes=True)
FP32 = dict(compute_dtype="float32")


def _boxed_params(seed):
    """The test GPT's perturbed init (``helpers.init_params``) in its logical-axis boxes."""
    model = GPT(TP_CFG)
    boxed = model.init(jax.random.PRNGKey(seed), tokens(2, seed=seed)[:, :-1])["params"]
    values = init_params(seed=seed)
    return jax.tree_util.tree_map(
        lambda box, v: box.replace_boxed(v) if hasattr(box, "replace_boxed") else v,
        boxed, values, is_leaf=lambda x: hasattr(x, "replace_boxed")), values


def _state(shape, config, tx=None, seed=0, rules=MEGATRON_RULES):
    boxed, _ = _boxed_params(seed)
    return zpp.TrainState.create(model=GPT(TP_CFG), params=boxed, tx=tx or optax.sgd(0.1),
                                 mesh=zpp.make_mesh(*shape[:2], model=shape[2],
                                                    devices=jax.devices()[:np.prod(shape)]),
                                 config=config, logical_axis_rules=rules)


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
def test_step_matches_one_device(shape):
    seed = int(np.random.default_rng().integers(1 << 16))
    state = _state(shape, zpp.ZeroPPConfig.zero3(**FP32), seed=seed)
    batch = tokens(16, seed=seed)
    _, out = make_step(with_grads=True)(state, batch)
    loss, grads = out["loss"], state.engine.consolidate(out["grads"])
    params = init_params(seed=seed)
    ref_loss, ref_grads = reference_loss_and_grads(GPT(SMALL), params, batch)
    nodes, local, _ = shape
    rho = fp32_gradient_rounding(GPT(SMALL), params, batch, shards=(nodes * local,)).rho
    assert_loss_and_grads_close(loss, grads, ref_loss, ref_grads, rho)


def test_parameters_and_gathers_are_split():
    state = _state((2, 2, 2), zpp.ZeroPPConfig.zero3(**FP32), tx=optax.adam(1e-3))
    mesh = state.engine.mesh
    for name, x in state.params.units.items():
        lay = state.engine.layouts[name]
        assert x.shape == (2, lay.n_pad)
        assert x.sharding.spec == SLICED_SHARDED
        # Each device holds 1/(data devices) of one slice: 1/8 of the unit.
        assert {s.data.shape for s in x.addressable_shards} == {(1, lay.n_pad // 4)}
    after, _ = make_step()(state, tokens(16, seed=1))
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
    program = make_step().lower(state, tokens(16, seed=0)).compile()
    gathers = [c for c in collectives(program, 8) if c.kind == "all-gather"
               and c.shape and c.shape[-1] in {lay.n_pad for lay in
                                               state.engine.layouts.values()}]
    assert gathers
    model_of = np.vectorize(lambda d: d.id)(mesh.devices) % 2
    for c in gathers:
        for g in c.groups:
            assert len(g) == 4 and len({int(model_of.reshape(-1)[d]) for d in g}) == 1, g


def test_zeropp_under_tensor_parallelism_trains():
    """qwZ, hpZ and qgZ run per tensor-parallel slice: the loss falls as it does with zero3
    on the same mesh (within qwZ/qgZ's quantization noise)."""
    config = zpp.ZeroPPConfig.zeropp(hpz_group_size=2, **FP32)
    losses = {}
    for name, cfg in (("zeropp", config), ("zero3", zpp.ZeroPPConfig.zero3(**FP32))):
        state = _state((2, 2, 2), cfg, tx=optax.adam(1e-2))
        step = make_step()
        losses[name] = []
        for i in range(4):
            state, out = step(state, tokens(16, seed=100 + i))
            losses[name].append(float(out["loss"]))
    assert losses["zeropp"][-1] < losses["zeropp"][0] - 0.05, losses
    np.testing.assert_allclose(losses["zeropp"], losses["zero3"], rtol=0.02)


def test_checkpoint_restores_across_tensor_parallel_meshes(tmp_path):
    tx = optax.adamw(1e-2)
    state = _state((2, 2, 2), zpp.ZeroPPConfig.zero3(**FP32), tx=tx)
    state, _ = make_step()(state, tokens(16, seed=3))
    zpp.checkpoint.save(tmp_path, state)
    want = state.consolidate()
    mu = state.engine.consolidate(zpp.ShardedParams(state.opt_state[0].mu))
    for shape in [(2, 4, 1), (1, 1, 1), (1, 2, 4)]:
        template = _state(shape, zpp.ZeroPPConfig.zero3(**FP32), tx=tx, seed=9)
        back = zpp.checkpoint.restore(tmp_path, template)
        assert back.engine is template.engine
        got = back.consolidate()
        for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
            np.testing.assert_array_equal(a, b)
        got_mu = back.engine.consolidate(zpp.ShardedParams(back.opt_state[0].mu))
        for a, b in zip(jax.tree_util.tree_leaves(got_mu), jax.tree_util.tree_leaves(mu)):
            np.testing.assert_array_equal(a, b)
        assert int(back.step) == 1
    # The restored states train on: the next step's loss is the same on every mesh.
    back, out = make_step()(back, tokens(16, seed=4))
    _, ref = make_step()(state, tokens(16, seed=4))
    np.testing.assert_allclose(float(out["loss"]), float(ref["loss"]), rtol=1e-5)


def test_what_tensor_parallelism_refuses():
    with pytest.raises(NotImplementedError, match="stage=3"):
        _state((2, 2, 2), zpp.ZeroPPConfig(stage=2, **FP32))
    with pytest.raises(NotImplementedError, match="no frozen="):
        boxed, _ = _boxed_params(0)
        zpp.TrainState.create(model=GPT(TP_CFG), params=boxed, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 2, model=2), frozen=["wte"],
                              config=zpp.ZeroPPConfig.zero3(**FP32),
                              logical_axis_rules=MEGATRON_RULES)
    # heads=4 and d_model=20: a model axis of 8 does not divide the attention output.
    with pytest.raises(ValueError, match="do not divide"):
        _state((1, 1, 8), zpp.ZeroPPConfig.zero3(**FP32))
    with pytest.raises(ValueError, match="alone"):
        _state((2, 2, 2), zpp.ZeroPPConfig.zero3(**FP32),
               rules=(("mlp", ("local", "model")),))
