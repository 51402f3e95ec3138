"""A restore puts every leaf exactly where the template has it: the same sharding, memory
kind included (an offloaded optimizer state or unit shard comes back in pinned host memory,
not on the device), on a mesh with and without tensor parallelism and under every offload
setting, the step counts and other small leaves included; the values are the
checkpoint's, bit for bit."""

import dataclasses
import functools

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from helpers import fresh_seed, SMALL, init_params, tokens
from zeropp_demo.gpt import GPT, MEGATRON_RULES

TP_CFG = dataclasses.replace(SMALL, logical_axes=True)
FP32 = dict(compute_dtype="float32")
OFFLOADS = {"none": {}, "optimizer": {"offload_optimizer": True},
            "params": {"offload_params": True},
            "both": {"offload_optimizer": True, "offload_params": True}}
MESHES = ["plain", "tp"]  # (2, 4) without a "model" axis; (2, 2, 2) with one


@functools.lru_cache(maxsize=None)
def _boxes():
    """The test GPT's logical-axis boxes (names and shapes only: traced, never run)."""
    return jax.eval_shape(GPT(TP_CFG).init, jax.random.PRNGKey(0),
                          tokens(2, seed=0)[:, :-1])["params"]


def _template(mesh: str, offload: str, seed: int) -> zpp.TrainState:
    """A fresh AdamW ZeRO-3 state (param init ``seed``) on ``mesh`` with ``offload``."""
    config = zpp.ZeroPPConfig.zero3(**FP32, **OFFLOADS[offload])
    values = init_params(seed=seed)
    if mesh == "plain":
        return zpp.TrainState.create(model=GPT(SMALL), params=values, tx=optax.adamw(1e-2),
                                     mesh=zpp.make_mesh(2, 4), config=config)
    boxed = jax.tree_util.tree_map(
        lambda box, v: box.replace_boxed(v) if hasattr(box, "replace_boxed") else v,
        _boxes(), values, is_leaf=lambda x: hasattr(x, "replace_boxed"))
    return zpp.TrainState.create(model=GPT(TP_CFG), params=boxed, tx=optax.adamw(1e-2),
                                 mesh=zpp.make_mesh(2, 2, model=2), config=config,
                                 logical_axis_rules=MEGATRON_RULES)


def _values(state: zpp.TrainState) -> dict:
    """Mesh-independent values: the parameters, Adam's moments (consolidated), its count,
    the step counts."""
    adam = state.opt_state[0]
    return {"params": state.consolidate(),
            "mu": state.engine.consolidate(zpp.ShardedParams(adam.mu)),
            "nu": state.engine.consolidate(zpp.ShardedParams(adam.nu)),
            "count": np.asarray(adam.count), "step": np.asarray(state.step),
            "skipped": np.asarray(state.skipped_steps)}


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    """(seed, directory, values) of one checkpoint with a fresh seed's parameters, random
    moments and counts (so that a restore that left any template value in place shows),
    written from a plain on-device state: checkpoints do not depend on the mesh."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    src = _template("plain", "none", seed)

    def fill(x):
        v = (rng.standard_normal(x.shape) if x.ndim else rng.integers(1, 1 << 20))
        return jax.device_put(np.asarray(v, x.dtype), x.sharding)

    src = src.replace(opt_state=jax.tree_util.tree_map(fill, src.opt_state),
                      step=fill(src.step), skipped_steps=fill(src.skipped_steps))
    directory = tmp_path_factory.mktemp("memory_kinds")
    zpp.checkpoint.save(directory, src)
    return seed, directory, _values(src)


# Every offload setting on both meshes. Kept in ``make test``: every plain case (a template
# and a restore cost well under a second there) and, on (2, 2, 2), [tp-both] (the unit
# shards and the whole optimizer state offloaded) and [tp-optimizer] (host and device leaves
# side by side: moments and Adam's count in pinned host memory, the unit shards on the
# device). Slow (``make test-all``): [tp-none], whose leaves are all on the device as in
# [tp-optimizer]'s unit shards (and test_tensor_parallel's checkpoint test restores such a
# state), and [tp-params], whose host unit shards and device optimizer state are
# [tp-both]'s and [tp-optimizer]'s.
SLOW = {("tp", "none"), ("tp", "params")}
CASES = [pytest.param(m, o, id=f"{m}-{o}",
                      marks=pytest.mark.slow if (m, o) in SLOW else ())
         for m in MESHES for o in OFFLOADS]


@pytest.mark.parametrize("mesh,offload", CASES)
def test_a_restore_keeps_every_leaf_where_the_template_has_it(checkpoint_dir, mesh, offload):
    seed, directory, want = checkpoint_dir
    template = _template(mesh, offload, seed + 1)
    back = zpp.checkpoint.restore(directory, template)
    got_leaves = jax.tree_util.tree_flatten_with_path(back)[0]
    want_leaves = jax.tree_util.tree_flatten_with_path(template)[0]
    assert [p for p, _ in got_leaves] == [p for p, _ in want_leaves]
    for (path, got), (_, tmpl) in zip(got_leaves, want_leaves):
        if isinstance(tmpl, jax.Array):
            assert got.sharding == tmpl.sharding, (
                f"seed {seed}: {jax.tree_util.keystr(path)} restored on {got.sharding}, "
                f"the template has it on {tmpl.sharding}")
    got = _values(back)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0],
                            jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(a, b, err_msg=f"seed {seed}: {jax.tree_util.keystr(path)}")
