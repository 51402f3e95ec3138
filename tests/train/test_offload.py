"""Optimizer state offloaded to host memory (``offload_optimizer``): the same training bit
for bit, the state's arrays in pinned host memory between steps, checkpoints across the
switch and across meshes, and the DeepSpeed keys."""

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.core.mesh import MeshInfo
from helpers import fresh_seed, SMALL, init_params, make_step, tokens
from zeropp_demo.gpt import GPT

HOST = "pinned_host"

# One train step for the module: a step compiles once per engine (a train state's engine is
# compared by identity), so tests that start from the same cached state (``_initial``) share
# its compiled program instead of tracing and compiling it again.
STEP = make_step()


def _state(config, tx, mesh=(2, 4), seed=0):
    return zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=seed), tx=tx,
                                 mesh=zpp.make_mesh(*mesh), config=config)


_INITIAL: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _forget_initial_states():
    yield
    _INITIAL.clear()


def _initial(name, config):
    """A fresh 2x4 state (seed-0 parameters, optimizer ``TXS[name]``), one per optimizer and
    config in the module. Steps do not donate it, so tests that train from the same
    configuration start from the same state and reuse its compiled step; each test still
    trains on its own fresh batches."""
    key = (name, config)
    if key not in _INITIAL:
        _INITIAL[key] = _state(config, TXS[name]())
    return _INITIAL[key]


def _memory_kinds(tree):
    return {leaf.sharding.memory_kind for leaf in jax.tree_util.tree_leaves(tree)}


def _train(state, steps, seed, step=None):
    step = step or STEP
    losses = []
    for i in range(steps):
        state, out = step(state, state.engine.shard_batch(tokens(16, seed=seed + i)))
        losses.append(np.asarray(out["loss"]))
    return state, losses


def _assert_states_equal(a, b):
    for x, y in zip(jax.tree_util.tree_leaves((a.params, a.master, a.opt_state)),
                    jax.tree_util.tree_leaves((b.params, b.master, b.opt_state))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


CASES = [  # (optimizer, config): every optimizer, zero3 and zeropp, clipping, stages
    ("sgd", zpp.ZeroPPConfig.zero3()),
    ("adamw", zpp.ZeroPPConfig.zeropp(gradient_clipping=0.05)),
    ("lion", zpp.ZeroPPConfig.zeropp(qgz_hadamard=True)),
    ("adamw", zpp.ZeroPPConfig(stage=2)),
]


@zpp.train_step
def _accumulating_step(state, batch):
    from zeropp_demo.gpt import loss_fn

    def loss_of(p, b):
        return loss_fn(state.apply_fn({"params": p}, b[:, :-1]), b[:, 1:])

    loss, grads = zpp.accumulate_gradients(loss_of, state.params, batch, micro_batches=2)
    return state.apply_gradients(grads=grads), {"loss": loss}


# Gradient accumulation with clipping, on the device and with both offloads: the
# accumulation test, test_offloaded_parameters_train_bit_for_bit_the_same[zeropp-both] and
# the checkpoint test train this configuration, from the same cached states and compiled
# steps.
ACC = ("adamw-default-decay", zpp.ZeroPPConfig.zeropp(gradient_clipping=0.1))
BOTH = dict(offload_optimizer=True, offload_params=True)


# The primary shards in host memory too (stage 3), alone or with the optimizer state. Each
# trains from a state another test trains too (its on-device run and compiled steps are
# shared): the first from the SGD ZeRO-3 CASES state; the second, both offloads on ZeRO++
# with clipping and AdamW (whose weight decay reads the offloaded parameters), is ACC's
# configuration and accumulating step, whose two programs the accumulation and checkpoint
# tests run too. Lion with both offloads is slow (``make test-all``): its states are two
# more ZeRO++ programs with the Hadamard qgZ, among the costliest to compile, and offload
# moves whatever leaves the optimizer state has ([zeropp-both] moves AdamW's moments;
# SGD's momentum is offloaded in test_offloaded_training_is_bit_for_bit_the_same[sgd-0]).
PARAM_CASES = [
    pytest.param(*CASES[0], {"offload_params": True}, None, id="zero3"),
    pytest.param(*ACC, BOTH, "accumulating", id="zeropp-both"),
    pytest.param(*CASES[2], BOTH, None, id="lion-both", marks=pytest.mark.slow),
]
TXS = {"sgd": lambda: optax.sgd(0.05, momentum=0.9),
       "adamw": lambda: optax.adamw(3e-3, weight_decay=0.1),
       "lion": lambda: optax.lion(1e-3),
       "adamw-default-decay": lambda: optax.adamw(3e-3)}


# Lion with the optimizer state offloaded is slow (``make test-all``): its states are two
# ZeRO++ programs with the Hadamard qgZ, among the costliest to compile, and offload moves
# whatever leaves the optimizer state has: ``make test`` offloads SGD's momentum in
# [sgd-0] and AdamW's moments in [adamw-1] (a ZeRO++ state with only the optimizer state
# offloaded, the parameters on the device) and [adamw-3] (stage 2).
@pytest.mark.parametrize("name,config", [
    pytest.param(n, c, id=f"{n}-{i}", marks=pytest.mark.slow if n == "lion" else ())
    for i, (n, c) in enumerate(CASES)])
def test_offloaded_training_is_bit_for_bit_the_same(name, config):
    seed = fresh_seed()
    base, base_losses = _train(_initial(name, config), 3, seed)
    offloaded = _initial(name, dataclasses.replace(config, offload_optimizer=True))
    assert _memory_kinds(offloaded.opt_state) == {HOST}
    offloaded, losses = _train(offloaded, 3, seed)
    # Between steps the state stays on the host; the parameters stay on the device.
    assert _memory_kinds(offloaded.opt_state) == {HOST}
    assert _memory_kinds(offloaded.params) == {"device"}
    np.testing.assert_array_equal(losses, base_losses)
    _assert_states_equal(offloaded, base)


@pytest.mark.parametrize("name,config,offload,step", PARAM_CASES)
def test_offloaded_parameters_train_bit_for_bit_the_same(name, config, offload, step):
    """The primary shards (and the optimizer state) in host memory between steps: training
    is the same bit for bit, and generation reads the offloaded shards. ``step``: the
    module's plain step, or ``"accumulating"``, two micro-batches per step (each reads the
    offloaded parameters)."""
    step = _accumulating_step if step == "accumulating" else None
    seed = fresh_seed()
    base, base_losses = _train(_initial(name, config), 3, seed, step)
    off = _initial(name, dataclasses.replace(config, **offload))
    want = HOST if offload.get("offload_optimizer") else "device"
    assert _memory_kinds(off.params.units) == {HOST}
    assert _memory_kinds(off.opt_state) == {want}
    off, losses = _train(off, 3, seed, step)
    assert _memory_kinds(off.params.units) == {HOST}
    assert _memory_kinds(off.opt_state) == {want}
    np.testing.assert_array_equal(losses, base_losses)
    _assert_states_equal(off, base)
    # Generation reads the offloaded shards too, and gives the same tokens.
    prompts = tokens(8, 4, seed=seed)[:, :4]
    decode = GPT(dataclasses.replace(SMALL, decode=True))
    np.testing.assert_array_equal(np.asarray(zpp.generate(off, prompts, 3, model=decode)),
                                  np.asarray(zpp.generate(base, prompts, 3, model=decode)))


def test_offloaded_parameters_need_stage_3():
    with pytest.raises(ValueError, match="offload_params.*stage=3.*offload_optimizer"):
        zpp.ZeroPPConfig(stage=2, offload_params=True)


def test_offload_with_gradient_accumulation_is_bit_for_bit_the_same():
    seed = fresh_seed()
    name, config = ACC
    base, base_losses = _train(_initial(name, config), 2, seed, _accumulating_step)
    off, losses = _train(_initial(name, dataclasses.replace(config, **BOTH)), 2, seed,
                         _accumulating_step)
    np.testing.assert_array_equal(losses, base_losses)
    _assert_states_equal(off, base)


def test_the_compiled_step_keeps_the_state_in_host_memory():
    # In the compiled program's entry layout, memory space S(5) (host) marks exactly the
    # optimizer state's arguments and results; the parameters are in device memory. The
    # program is the module's step of CASES' offloaded AdamW state (compiled once, shared
    # with the training test).
    name, config = CASES[1]
    state = _initial(name, dataclasses.replace(config, offload_optimizer=True))
    batch = state.engine.shard_batch(tokens(16, seed=0))
    text = STEP.lower(state, batch).compile().as_text()
    layout = text.splitlines()[0].split("entry_computation_layout={(", 1)[1]
    args, results = layout.split(")->", 1)
    leaves = len(jax.tree_util.tree_leaves(state.opt_state))  # Adam: count, mu, nu per unit
    assert leaves == 1 + 2 * len(state.engine.layouts)
    assert args.count("S(5)") == leaves
    assert results.split("}, allow_", 1)[0].count("S(5)") == leaves


def test_checkpoints_cross_the_switch_and_meshes(tmp_path):
    from zeropp_jax import checkpoint

    seed = fresh_seed()
    name, config = ACC  # zeropp, AdamW; trained with accumulation (the step is incidental)
    # The offloaded state the accumulation test starts from: its step is compiled once.
    fresh = _initial(name, dataclasses.replace(config, **BOTH))
    off, _ = _train(fresh, 2, seed, _accumulating_step)
    checkpoint.save(tmp_path / "a", off)
    # Offloaded -> on the device, another mesh; and back.
    on_device = checkpoint.restore(tmp_path / "a", _state(config, TXS[name](), (4, 2)))
    assert _memory_kinds(on_device.opt_state) == {"device"}
    checkpoint.save(tmp_path / "b", on_device)
    # Back into a fresh offloaded state of the same engine (its values are the untrained
    # ones, so nothing of the checkpoint is there unless restore put it there).
    back = checkpoint.restore(tmp_path / "b", fresh)
    assert _memory_kinds(back.opt_state) == {HOST}
    assert _memory_kinds(back.params.units) == {HOST}
    _assert_states_equal(back, off)
    # Training goes on the same from either.
    cont_off, a = _train(back, 1, seed + 10, _accumulating_step)
    cont_ref, b = _train(off, 1, seed + 10, _accumulating_step)
    np.testing.assert_array_equal(a, b)
    _assert_states_equal(cont_off, cont_ref)


@pytest.mark.parametrize("section,optimizer,params", [
    ({"offload_optimizer": {"device": "cpu", "pin_memory": True}}, True, False),
    ({"offload_optimizer": {"device": "cpu", "ratio": 1.0}}, True, False),
    ({"offload_optimizer": {"device": "none"}}, False, False),
    ({"cpu_offload": True}, True, False),
    ({"offload_param": {"device": "cpu", "pin_memory": True, "max_in_cpu": 1e9}}, False, True),
    ({"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}}, True, True),
    ({"cpu_offload_params": True}, False, True),
])
def test_deepspeed_offload_keys_are_read(section, optimizer, params):
    config = zpp.ZeroPPConfig.from_deepspeed({"zero_optimization": {"stage": 3, **section}})
    assert (config.offload_optimizer, config.offload_params) == (optimizer, params)


@pytest.mark.parametrize("section,match", [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "/x"}},
     "device='nvme'.*'cpu'"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 1.5}}, "ratio=1.5"),
    ({"offload_param": {"device": "cpu", "ratio": 0.5}}, "offload_param.ratio=0.5"),
    ({"offload_optimizer": {"device": "gpu"}}, "device='gpu'"),
    ({"offload_param": {"device": "nvme"}}, "offload_param.device='nvme'"),
    ({"offload_param": {"device": "cpu"}, "stage": 2}, "offload_param.*ZeRO-3.*stage 2"),
    ({"offload_optimizer": {"device": "cpu", "pin_memory": "yes"}}, "pin_memory"),
])
def test_deepspeed_offload_keys_we_cannot_honour_raise_naming_the_fix(section, match):
    ds = {"zero_optimization": {"stage": 3, **section}}  # a section's stage wins
    with pytest.raises((ValueError, NotImplementedError), match=match):
        zpp.ZeroPPConfig.from_deepspeed(ds)


def test_the_memory_model_moves_the_moments_to_the_host():
    from zeropp_jax.plan.workload import ADAM_BYTES_PER_PARAM, memory_breakdown, \
        transformer_shape

    rng = np.random.default_rng(fresh_seed())
    layers, d = int(rng.integers(4, 40)), 128 * int(rng.integers(8, 64))
    shape = transformer_shape(layers=layers, d_model=d, vocab=32000, seq_len=2048)
    nodes, local, tokens = 4, 8, 4096.0
    for base in (zpp.ZeroPPConfig.zero3(), zpp.ZeroPPConfig.zeropp()):
        on = memory_breakdown(dataclasses.replace(base, offload_optimizer=True), shape,
                              MeshInfo(nodes, local), tokens)
        off = memory_breakdown(base, shape, MeshInfo(nodes, local), tokens)
        moments = off.states - on.states
        # Exactly Adam's 8 bytes per (padded) parameter leave the device for the host.
        assert moments == pytest.approx(on.host, rel=1e-12)
        params = sum(n for _, n in shape.units)
        assert on.host == pytest.approx(
            ADAM_BYTES_PER_PARAM * params / (nodes * local), rel=1e-3)
        assert off.host == 0
        # The peak never grows; it drops unless the update (where they are on the device
        # again) sets it.
        assert on.total <= off.total * (1 + 1e-12)
        if on.moment != "end":
            assert on.total < off.total - 0.5 * moments


def test_the_planner_offloads_only_when_nothing_fits():
    from zeropp_jax.plan import presets
    from zeropp_jax.plan.auto import plan
    from zeropp_jax.plan.workload import ADAM_BYTES_PER_PARAM, transformer_shape

    shape = transformer_shape(layers=32, d_model=4096, vocab=32000, seq_len=4096,
                              gated=True, name="7B")
    hw = presets.h100(1, local=8)
    params = sum(n for _, n in shape.units)
    roomy = plan(shape, hardware=hw, tokens_per_device=4096)
    assert not roomy.chosen.config.offload_optimizer
    assert not any(c.config.offload_optimizer for c in roomy.candidates)
    # A budget half a share of the moments under the on-device peak: offload is chosen.
    on = roomy.chosen.prediction.memory_bytes
    budget = on - 0.5 * ADAM_BYTES_PER_PARAM * params / 8
    tight = plan(shape, hardware=hw, tokens_per_device=4096, memory_budget_bytes=budget)
    assert tight.chosen.config.offload_optimizer
    assert tight.chosen.prediction.memory_bytes <= budget
    # Priced: the moments cross the host link, half the bytes each way, in full.
    p = tight.chosen.prediction
    assert p.host_s == pytest.approx(
        2 * ADAM_BYTES_PER_PARAM * params / 8 / 2 / presets.H100_PCIE_BYTES, rel=0.01)
    assert p.step_s > roomy.chosen.prediction.step_s
    assert "host" in tight.table() and "offload" in tight.chosen.label


def test_the_memory_model_moves_offloaded_shards_to_the_host():
    from zeropp_jax.plan.workload import memory_breakdown, transformer_shape

    rng = np.random.default_rng(fresh_seed())
    shape = transformer_shape(layers=int(rng.integers(4, 40)), d_model=128 * int(
        rng.integers(8, 64)), vocab=32000, seq_len=2048)
    devices = 32
    base = zpp.ZeroPPConfig.zeropp()
    none = memory_breakdown(base, shape, MeshInfo(4, 8), 4096.0)
    both = memory_breakdown(dataclasses.replace(base, offload_optimizer=True,
                                                offload_params=True), shape, MeshInfo(4, 8), 4096.0)
    params = sum(n for _, n in shape.units)
    # fp32 shards (4) and Adam's moments (8) per parameter leave the device.
    assert none.states - both.states == pytest.approx(both.host, rel=1e-12)
    assert both.host == pytest.approx(12 * params / devices, rel=1e-3)
    assert both.total < none.total


# transformers' Llama is slow (``make test-all``): offload moves the units' flat buffers,
# whatever model they came from, and the NNX model (tied head) proves the same property in
# ``make test``; transformers' Llama under ZeRO is tested there in
# tests/train/test_tensor_parallel.py (test_models_we_did_not_write).
@pytest.mark.parametrize("name", ["nnx_tied",
                                  pytest.param("hf_llama", marks=pytest.mark.slow)])
def test_models_we_did_not_write_train_the_same_offloaded(name):
    """Both offloads on an NNX model with a tied head and transformers' Flax Llama: two
    steps bit for bit the same as without offload."""
    import contextlib

    import zoo

    if name.startswith("hf_"):
        transformers = pytest.importorskip("transformers")
        if not hasattr(transformers, "FlaxPreTrainedModel"):
            pytest.skip("this transformers has no Flax models")

    def compat():
        return zoo.hf_compat() if name.startswith("hf_") else contextlib.nullcontext()

    with compat():
        entry = zoo.get(name)

    @zpp.train_step
    def step(state, batch, rng):
        loss, g = jax.value_and_grad(
            lambda p: entry.loss(state.apply_fn, p, batch, True, rng=rng))(state.params)
        return state.apply_gradients(grads=g), {"loss": loss}

    seed = fresh_seed()
    runs = []
    for offload in ({}, {"offload_optimizer": True, "offload_params": True}):
        rng = np.random.default_rng(seed)
        with compat():
            state = zpp.TrainState.create(
                model=entry.model, params=entry.params, tx=optax.adamw(1e-2),
                mesh=zpp.make_mesh(2, 4),
                config=zpp.ZeroPPConfig.zeropp(compute_dtype="float32", block_size=32,
                                               **offload))
            losses = []
            for i in range(2):
                state, out = step(state, entry.make_batch(rng, 16), jax.random.PRNGKey(i))
                losses.append(np.asarray(out["loss"]))
        if offload:
            assert _memory_kinds(state.params.units) == {HOST}
            assert _memory_kinds(state.opt_state) == {HOST}
        runs.append((state, losses))
    np.testing.assert_array_equal(runs[1][1], runs[0][1])
    _assert_states_equal(runs[1][0], runs[0][0])


# 0.3 is slow (``make test-all``): each ratio is its own engine and compiled step, and 0.5
# splits the same way (the root unit and a first block in host memory, a later unit and
# the step count on the device), so [0.5] proves the same properties in ``make test``.
@pytest.mark.parametrize("ratio", [0.5, pytest.param(0.3, marks=pytest.mark.slow)])
def test_a_fraction_of_the_optimizer_state_offloaded_trains_bit_for_bit_the_same(ratio,
                                                                                   tmp_path):
    """``offload_ratio`` (DeepSpeed's ``offload_optimizer.ratio``, ZeRO-Offload++): whole
    units' state in host memory until their parameters reach the fraction, the rest (and
    the step count) on the device, before and after steps; training is the same bit for
    bit, and a checkpoint restores into the same split."""
    seed = fresh_seed()
    config = zpp.ZeroPPConfig.zeropp(gradient_clipping=0.05)  # as CASES' adamw-1: same base
    base, base_losses = _train(_initial("adamw", config), 3, seed)
    fresh = _initial("adamw", dataclasses.replace(config, offload_optimizer=True,
                                                  offload_ratio=ratio))
    part = fresh
    engine = part.engine
    sizes = {name: lay.n for name, lay in engine.layouts.items()}
    off = engine.offloaded
    assert 0 < len(off) < len(sizes)
    share = sum(sizes[u] for u in off) / sum(sizes.values())
    # At least the ratio, and less without the last unit taken (name order).
    assert share >= ratio and share - sizes[max(off)] / sum(sizes.values()) < ratio

    part, losses = _train(part, 3, seed)
    split = dataclasses.replace(config, offload_optimizer=True, offload_ratio=ratio)
    zpp.checkpoint.save(tmp_path, part)
    back = zpp.checkpoint.restore(tmp_path, _state(split, TXS["adamw"](), seed=seed + 1))
    _assert_states_equal(back, part)
    for state in (fresh, part, back):
        for path, leaf in jax.tree_util.tree_leaves_with_path(state.opt_state):
            unit = next((getattr(k, "key", None) for k in reversed(path)
                         if getattr(k, "key", None) in sizes), None)
            want = "device" if unit is None or unit not in off else HOST
            assert leaf.sharding.memory_kind == want, (jax.tree_util.keystr(path), want)
    np.testing.assert_array_equal(losses, base_losses)
    _assert_states_equal(part, base)
    assert f"offload{ratio:g}" in engine.plan.label()


def test_deepspeed_offload_ratio_is_read():
    config = zpp.ZeroPPConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})
    assert config.offload_optimizer and config.offload_ratio == 0.3
    with pytest.raises(ValueError, match="needs offload_optimizer=True"):
        zpp.ZeroPPConfig(offload_ratio=0.5)
    with pytest.raises(ValueError, match="in \\(0, 1\\]"):
        zpp.ZeroPPConfig(offload_optimizer=True, offload_ratio=0.0)
    assert zpp.ZeroPPConfig(offload=zpp.Offload(optimizer=True, ratio=0.4)).offload_ratio == 0.4


def test_the_memory_model_counts_the_offloaded_fraction():
    from zeropp_jax.plan.workload import ADAM_BYTES_PER_PARAM, memory_breakdown, \
        transformer_shape

    shape = transformer_shape(layers=8, d_model=1024, vocab=32000, seq_len=2048)
    full = memory_breakdown(zpp.ZeroPPConfig(offload_optimizer=True), shape, MeshInfo(2, 8), 2048.0)
    for ratio in (0.25, 0.5, 0.75):
        part = memory_breakdown(zpp.ZeroPPConfig(offload_optimizer=True, offload_ratio=ratio),
                                shape, MeshInfo(2, 8), 2048.0)
        # Whole units: at least the ratio of the moments, at most one unit more.
        biggest = max(n for _, n in shape.units) * ADAM_BYTES_PER_PARAM / 16
        assert ratio * full.host <= part.host <= ratio * full.host + biggest * 1.01
        assert part.states + part.host == pytest.approx(full.states + full.host, rel=1e-12)


def test_the_planner_offloads_the_parameters_when_the_state_alone_is_not_enough():
    from zeropp_jax.plan import presets
    from zeropp_jax.plan.auto import plan
    from zeropp_jax.plan.workload import transformer_shape

    shape = transformer_shape(layers=32, d_model=4096, vocab=32000, seq_len=4096,
                              gated=True, name="7B")
    hw = presets.h100(1, local=8)
    configs = dict(hardware=hw, tokens_per_device=4096)
    roomy = plan(shape, **configs)
    params = sum(n for _, n in shape.units)
    # Under the optimizer-offloaded peak by half a device's share of the fp32 shards.
    opt_only = roomy.chosen.prediction.memory_bytes - 8 * params / 8
    budget = opt_only - 0.5 * 4 * params / 8
    tight = plan(shape, memory_budget_bytes=budget, **configs)
    chosen = tight.chosen.config
    assert chosen.offload_optimizer and chosen.offload_params
    assert tight.chosen.prediction.memory_bytes <= budget
    assert not any(c.fits for c in tight.candidates if not c.config.offload_params)
    assert "offload-params" in tight.chosen.label
