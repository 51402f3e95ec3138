"""The memory model is the compiled step's memory: bytes per device at the step's peak.

What is measured is the compiled program's ``memory_analysis()`` on XLA's CPU backend:
its arguments (the state and the batch) plus its temporaries, for a step that donates its
state (``train_step(donate_state=True)``, the new state in the old one's buffers). Without
donation XLA allocates the new state beside the old and parks temporaries in it until the
update, which ``temp_size_in_bytes`` then leaves out (there the model reads 2 to 15% over
arguments + temporaries on these models).

A GPU compiles the same step to another buffer assignment (other fusions, operands in the
layouts its kernels take, a latency-hiding schedule) and its allocator adds slack of its
own, so these tests pin the model's terms and how they add up on the one backend we can
measure, not a GPU's bytes. ``backend="cpu"`` counts what XLA CPU does that a GPU need
not: a 16-bit flat gradient made and reduced in float32, an embedding's zero-filled
gradient made at the step's start, and copies of Adam's moments before the update.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.core.mesh import MeshInfo
from helpers import zoo_train_step
from zeropp_jax.comm.partition import padded_length
from zeropp_jax.measure.comm_report import comm_report
from zeropp_jax.plan.workload import (
    ModelShape,
    config_workload,
    decoder_activations,
    memory_breakdown,
    report_workload,
    shape_of_state,
    transformer_shape,
)

CONFIGS = {"zero3": zpp.ZeroPPConfig(), "zeropp": zpp.ZeroPPConfig.zeropp()}
# tests/zoo.py's transformers Llama: d_model 16, MLP 32 (SwiGLU), 2 heads (1 for keys and
# values), vocab 64, sequences of 8, 2 layers; float32 layers on bfloat16 weights.
GLOBAL_BATCH = 16
# Traced transports shared by this module's ``config_workload`` calls (its ``memo=``): the
# keys name all a trace depends on (transport, padded length, dtype, mesh), so each
# workload is the same as without it, each transport traced once.
MEMO: dict = {}


@pytest.fixture(scope="module")
def llama_steps():
    """The Llama, the 2x4 mesh, one batch, and ``step_of(name)``: the config's state and
    compiled step, built when a test first asks for it (xdist may run the two configs'
    tests on different workers: each then compiles only its own)."""
    import zoo

    entry = zoo.get("hf_llama")
    mesh = zpp.make_mesh(2, 4)
    batch = entry.make_batch(np.random.default_rng(0), GLOBAL_BATCH)
    out = {}

    def step_of(name):
        if name not in out:
            with zoo.hf_compat():
                state = zpp.TrainState.create(model=entry.model, params=entry.params,
                                              tx=optax.adam(1e-3), mesh=mesh,
                                              config=CONFIGS[name])
                out[name] = (state, zoo_train_step(entry).lower(state, batch).compile(), batch)
        return out[name]

    return entry, mesh, step_of


def _llama_shape(entry, state) -> ModelShape:
    """The state's units (as traced), and what the Llama's blocks keep per token (one
    tensor-parallel rank's share of them on a mesh with a "model" axis)."""
    import zoo

    cfg = entry.model.config
    shape = shape_of_state(state)
    layers = frozenset(name for name, _ in shape.units if name.startswith("model/layers/"))
    return dataclasses.replace(
        shape, blocks=layers, itemsize=4,  # the transformers model computes in float32
        **decoder_activations(cfg.hidden_size, zoo.SEQ, cfg.vocab_size,
                              heads=cfg.num_attention_heads, ffn=cfg.intermediate_size,
                              gated=True, tensor_parallel=shape.tensor_parallel))


def _llama_memory(name, entry, state, batch, nodes, local):
    """``(memory model, tokens, batch bytes)`` per device of a step of the Llama ``state``
    on ``batch``, its rows split over ``nodes x local`` data-parallel ranks."""
    ranks = nodes * local
    tokens = batch["input_ids"].size / ranks
    batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(batch)) / ranks
    model = memory_breakdown(CONFIGS[name], _llama_shape(entry, state), MeshInfo(nodes, local),
                             tokens,
                             backend="cpu", batch_bytes_per_device=batch_bytes)
    return model, tokens, batch_bytes


# The Llama's compiled steps form a grid of the two configs with and without tensor
# parallelism (this test and test_the_memory_model_counts_a_tensor_parallel_rank), a step
# compile of seconds each. `make test` keeps each config and each mesh once: zero3 here,
# zeropp on the tensor-parallel mesh, where its terms (quantized gathers, hpZ's secondary,
# qgZ's buffers) are counted per rank; the other two cases run in test-all. ZeRO++'s terms
# without tensor parallelism are also checked against a compiled step by
# tests/plan/test_feedback_memory.py (ZeRO++ with error feedback on the demo GPT), its
# collectives by tests/plan/test_workload.py.
@pytest.mark.parametrize("name", ["zero3", pytest.param("zeropp", marks=pytest.mark.slow)])
def test_the_memory_model_is_the_compiled_step_of_a_transformers_llama(name, llama_steps):
    entry, mesh, step_of = llama_steps
    state, compiled, batch = step_of(name)
    stats = compiled.memory_analysis()
    shape = _llama_shape(entry, state)
    model, tokens, batch_bytes = _llama_memory(name, entry, state, batch, 2, 4)
    # The arguments to the byte: every unit's padded primary shard and Adam's moments,
    # the state's three int32 scalars and this device's slice of the batch.
    assert model.states == stats.argument_size_in_bytes
    # The model used to count parameters unpadded, and no activations, cast copies or
    # gradients being reduced: 0.28 of this step (zeropp: 0.26).
    measured = stats.argument_size_in_bytes + stats.temp_size_in_bytes
    assert model.total == pytest.approx(measured, rel=0.10), (model, measured)
    # The workload carries the same bytes (less the batch, which it is not told of).
    assert config_workload(CONFIGS[name], shape, MeshInfo(2, 4), tokens, backend="cpu", memo=MEMO
                           ).memory_bytes_per_device == model.total - batch_bytes
    # Its weights under 1024 elements each, a layer keeps its float32 copies for backward
    # and regathers nothing: the workload's collectives are the compiled step's.
    report = report_workload(comm_report(compiled, mesh))
    work = config_workload(CONFIGS[name], shape, MeshInfo(2, 4), memo=MEMO)
    assert work.cross_node_collectives == report.cross_node_collectives
    assert work.intra_node_collectives == report.intra_node_collectives


def test_the_memory_model_by_hand():
    # A GPT of 2 blocks (d 64, MLP 256, 1 head), vocab 100, 16 tokens a sequence; 2 x 4
    # devices. bfloat16 layers (itemsize 0: the compute dtype), so no cast copies.
    shape = transformer_shape(2, 64, 100, 16, heads=1)
    block = dict(shape.units)["block_0"]
    zero3 = zpp.ZeroPPConfig()
    # The state: fp32 primary shards and Adam's two moments over 8 devices, 3 scalars.
    assert memory_breakdown(zero3, shape, MeshInfo(2, 4)).states == shape.params * 12 / 8 + 12
    # Activations: per block and token 8 d + 2 heads x seq + 3 ffn + 2 heads + 4 elements
    # (8 x 64 + 32 + 768 + 6 = 1318), 2 bytes each; and 2 d + 2 outside the blocks. The
    # peak is the start of the last block's backward, which adds the gradient flowing
    # through it (d + ffn, bfloat16) and, the softmax materialized, three float32
    # heads x seq arrays (its probabilities, their gradient and the scores').
    per_token = 2 * 1318 * 2 + 2 * 130 + (64 + 256) * 2 + 3 * 16 * 4
    a, b = (memory_breakdown(zero3, shape, MeshInfo(2, 4), t) for t in (1000, 2000))
    assert a.moment == b.moment == "backward block_1 (start)"
    assert b.activations - a.activations == pytest.approx(1000 * per_token, rel=1e-12)
    # Its weights: the rest unit's (all step) and the block's, and with backward prefetch
    # (one unit ahead) the block before it, regathered already.
    rest = dict(shape.units)["<rest>"]
    assert b.gathered == 2 * (rest + 2 * block)
    alone = memory_breakdown(dataclasses.replace(zero3, prefetch=0), shape, MeshInfo(2, 4), 2000)
    assert alone.gathered == 2 * (rest + block)
    # A larger vocabulary makes the loss the peak: two float32 [tokens, vocab] arrays.
    wide = memory_breakdown(zero3, transformer_shape(2, 64, 1000, 16, heads=1), MeshInfo(2, 4),
                            2000)
    assert wide.moment == "loss" and wide.loss == 2000 * 2 * 1000 * 4
    # hpZ: each block that regathers holds a bfloat16 secondary over the node's 4 devices
    # from its forward to its regather (the embedding regathers nothing, the head is
    # kept). Without backward prefetch both blocks' are held at the peak (block_1's while
    # it regathers). With it, block_1 regathered during the head's backward and block_0
    # regathers as block_1's backward starts: their full weights are held instead (above),
    # their secondaries are spent.
    hpz = memory_breakdown(zpp.ZeroPPConfig(hpz=True, prefetch=0), shape, MeshInfo(2, 4), 2000)
    assert hpz.moment == "backward block_1 (start)"
    assert hpz.secondary == 2 * (2 * block / 4)
    hpz = memory_breakdown(zpp.ZeroPPConfig(hpz=True), shape, MeshInfo(2, 4), 2000)
    assert hpz.moment == "backward block_1 (start)"
    assert hpz.secondary == 0
    # Remat "full" keeps each block's input (d) and recomputes one block at a time: at the
    # start of the last block's backward, the inputs, that block's 1318 elements a token
    # and the gradients flowing through it (d + ffn), beside the 2 d + 2 outside.
    full = memory_breakdown(zpp.ZeroPPConfig(remat="full"), shape, MeshInfo(2, 4), 2000)
    assert full.moment == "backward block_1 (start)"
    assert full.activations == 2000 * (2 * (2 * 64 + 1318 + 320 + 130) + 3 * 16 * 4)


def test_a_7b_llama_on_128_gpus_is_its_activations():
    # Llama-2-7B's dimensions on 16 nodes x 8 GPUs, one 4096-token sequence per GPU,
    # bfloat16 layers with the softmax materialized (no fused attention): the probabilities
    # and their exponentials alone are 2 x 32 heads x 4096 elements a token and a layer.
    shape = transformer_shape(32, 4096, 32000, 4096, ffn=11008, gated=True, heads=32)
    assert 6.7e9 < shape.params < 6.8e9
    m = memory_breakdown(zpp.ZeroPPConfig(), shape, MeshInfo(16, 8), 4096)
    assert m.states == pytest.approx(shape.params * 12 / 128, rel=0.01)  # 0.59 GiB
    # With the last layer's softmax backward: three float32 32 x 4096 arrays a token.
    attention = 32 * 4096 * 2 * 32 * 4096 * 2 + 3 * 32 * 4096 * 4096 * 4
    assert attention / m.total > 0.7
    # remat "full" keeps each layer's input (4096 bfloat16 a token) and recomputes one
    # layer at a time: at the last layer's backward, 32 inputs, 2 d + 2 outside the layers,
    # the recomputed layer's 4 d + (4 d + 2 x 32 heads x 4096 + 2 x 32 + 5 ffn) + 4 =
    # 350020 and its gradients d + ffn = 15104, in bfloat16; and its softmax's backward,
    # three float32 32 x 4096 arrays. A tenth of the activations without remat, roughly.
    full = memory_breakdown(zpp.ZeroPPConfig(remat="full"), shape, MeshInfo(16, 8), 4096)
    per_token = 2 * (32 * 4096 + 8194 + 350020 + 15104) + 3 * 32 * 4096 * 4
    assert full.activations == 4096 * per_token
    assert full.activations < m.activations / 9
    # hpZ's secondary over a node's 8 GPUs: 2 bytes x the layers / 8 (1.4 GiB), of the 30
    # layers not regathered at the last layer's backward (it regathered during the
    # head's backward, the layer before it regathers now: backward prefetch).
    hpz = memory_breakdown(zpp.ZeroPPConfig(hpz=True, remat="full"), shape, MeshInfo(16, 8), 4096)
    assert hpz.moment == "backward block_31 (start)"
    assert hpz.secondary == pytest.approx(2 * 30 * dict(shape.units)["block_0"] / 8,
                                          rel=1e-3)


def _compiled(model: str, config: zpp.ZeroPPConfig):
    """(compiled step, ModelShape, tokens per device, batch bytes per device) of one of
    the validated models: the demo GPT (tests/helpers.SMALL), tests/zoo.py's transformers
    GPT-2 and Llama, each computing in float32 on bfloat16 weights."""
    import zoo
    from helpers import SMALL, init_params, tokens
    from zeropp_demo.gpt import GPT, loss_fn

    mesh = zpp.make_mesh(2, 4)
    if model == "demo_gpt":
        state = zpp.TrainState.create(model=GPT(SMALL), params=init_params(SMALL, 0),
                                      tx=optax.adam(1e-3), mesh=mesh, config=config)
        batch = tokens(GLOBAL_BATCH, seed=0)

        @zpp.train_step(donate_state=True)
        def step(state, batch):
            loss, g = jax.value_and_grad(lambda p: loss_fn(
                state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:]))(state.params)
            return state.apply_gradients(grads=g), {"loss": loss}

        compiled = step.lower(state, batch).compile()
        acts = decoder_activations(SMALL.d_model, SMALL.seq_len, SMALL.vocab_size,
                                   heads=SMALL.heads, ffn=SMALL.mlp_ratio * SMALL.d_model)
        tokens_per_device = batch[:, :-1].size / 8
    else:
        entry = zoo.get(model)
        batch = entry.make_batch(np.random.default_rng(0), GLOBAL_BATCH)
        with zoo.hf_compat():
            state = zpp.TrainState.create(model=entry.model, params=entry.params,
                                          tx=optax.adam(1e-3), mesh=mesh, config=config)
            compiled = zoo_train_step(entry).lower(state, batch).compile()
        c = entry.model.config
        d, heads = c.hidden_size, c.num_attention_heads
        acts = decoder_activations(d, batch["input_ids"].shape[1], c.vocab_size, heads=heads,
                                   ffn=getattr(c, "intermediate_size", None) or getattr(
                                       c, "n_inner", None) or 4 * d,
                                   gated=model == "hf_llama")
        tokens_per_device = batch["input_ids"].size / 8
    shape = shape_of_state(state)
    blocks = frozenset(n for n, _ in shape.units
                       if n.startswith(("block_", "transformer/h/", "model/layers/")))
    shape = dataclasses.replace(shape, blocks=blocks, itemsize=4, **acts)
    batch_bytes = sum(np.asarray(x).nbytes for x in jax.tree_util.tree_leaves(batch)) / 8
    return compiled, shape, tokens_per_device, batch_bytes


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["minimal", "full"])
@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("model", ["demo_gpt", "hf_gpt2", "hf_llama"])
def test_the_memory_model_is_the_compiled_step_of_each_model(model, name, remat):
    config = dataclasses.replace(CONFIGS[name], remat=remat)
    compiled, shape, tokens, batch_bytes = _compiled(model, config)
    stats = compiled.memory_analysis()
    m = memory_breakdown(config, shape, MeshInfo(2, 4), tokens, backend="cpu",
                         batch_bytes_per_device=batch_bytes)
    assert m.states == stats.argument_size_in_bytes
    measured = stats.argument_size_in_bytes + stats.temp_size_in_bytes
    assert m.total == pytest.approx(measured, rel=0.10), (m, measured)


# zero3 runs in test-all (see test_the_memory_model_is_the_compiled_step_of_a_transformers_
# llama): what tensor parallelism changes (one rank's slice of every unit, its primary
# shards and moments, gathered weights and Megatron's split of the activations) is in
# zeropp's step too, with its own terms on top; zero3's own terms (the CPU's float32 flat
# gradient among them) are checked on this Llama without tensor parallelism there.
@pytest.mark.parametrize("name", [pytest.param("zero3", marks=pytest.mark.slow), "zeropp"])
def test_the_memory_model_counts_a_tensor_parallel_rank(name):
    """The same Llama on (2, 2, 2), split over "model" by MaxText's rules: the state's
    shape is one rank's (every unit one slice), the blocks keep Megatron's split of their
    activations, and the model is the compiled step's arguments to the byte and its peak
    within 10% (0.94 of it for zero3, 1.04 for zeropp when written)."""
    import zoo

    entry = zoo.get("hf_llama")
    batch = entry.make_batch(np.random.default_rng(0), GLOBAL_BATCH)
    with zoo.hf_compat():
        state = zpp.TrainState.create(
            model=entry.model, params=entry.params, tx=optax.adam(1e-3),
            mesh=zpp.make_mesh(2, 2, model=2), config=CONFIGS[name],
            logical_axis_rules=zoo.MAXTEXT_RULES, param_axes=zoo.LLAMA_AXES)
        stats = zoo_train_step(entry).lower(state, batch).compile().memory_analysis()
    assert shape_of_state(state).tensor_parallel == 2
    model, _, _ = _llama_memory(name, entry, state, batch, 2, 2)  # each rank: two devices
    assert model.states == stats.argument_size_in_bytes
    measured = stats.argument_size_in_bytes + stats.temp_size_in_bytes
    assert model.total == pytest.approx(measured, rel=0.10), (model, measured)


def test_scanned_blocks_keep_only_their_matmul_outputs():
    # A scanned stack's layers under remat "minimal" keep their matmul outputs and
    # recompute the rest in backward (units.apply). At the last block's backward, the
    # blocks before it hold their kept activations: the difference from unrolled blocks is
    # that many blocks' recomputed part.
    layers, tokens = 8, 128
    shapes = {s: transformer_shape(layers, 256, 1000, tokens, ffn=688, heads=4, gated=True,
                                   scanned=s) for s in (False, True)}
    unrolled, scanned = (memory_breakdown(zpp.ZeroPPConfig(), shapes[s], MeshInfo(2, 4), tokens)
                         for s in (False, True))
    assert unrolled.moment == scanned.moment == f"backward block_{layers - 1} (end)"
    shape = shapes[True]
    # q, k, v, the attention output, two projections (6 d), the scores (2 heads x seq +
    # 2 heads), gate and up (2 ffn).
    assert shape.block_matmul_outputs == 6 * 256 + 2 * 4 * tokens + 2 * 4 + 2 * 688
    recomputed = shape.block_activations - shape.block_matmul_outputs
    assert unrolled.activations - scanned.activations == pytest.approx(
        (layers - 1) * tokens * 2 * recomputed, rel=1e-12)
    # remat "full" keeps block inputs alone, scanned or not; a scanned stack also holds
    # its layers' fp32 primary shards stacked for the loop (each block padded to the 8
    # devices, an eighth of it per device) until the update.
    full = [memory_breakdown(zpp.ZeroPPConfig(remat="full"), shapes[s], MeshInfo(2, 4), tokens)
            for s in (False, True)]
    shard = padded_length(dict(shape.units)["block_0"], 8,
                          zpp.ZeroPPConfig().flat_alignment) * 4 / 8
    assert full[0].moment == full[1].moment != "end"
    assert full[1].total - full[0].total == pytest.approx(layers * shard, rel=1e-12)
    assert full[1].gathered - full[0].gathered == pytest.approx(layers * shard, rel=1e-12)
