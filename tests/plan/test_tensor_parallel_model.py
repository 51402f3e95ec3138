"""The memory and cost models with tensor parallelism: one rank's shape
(``transformer_shape(tensor_parallel=T)``) and its step on a ``nodes x local/T`` data mesh."""

import dataclasses

import numpy as np
import pytest

import zeropp_jax as zpp
from zeropp_jax.core.mesh import MeshInfo
from helpers import fresh_seed
from zeropp_jax.plan.workload import (
    config_workload,
    decoder_activations,
    memory_breakdown,
    transformer_shape,
)

SHAPE = dict(layers=4, d_model=512, vocab=1024, seq_len=256, heads=8, gated=True, ffn=1408)


@pytest.mark.parametrize("t", [2, 4, 8])
def test_a_rank_holds_a_slice_of_every_unit_and_of_the_flops(t):
    one, rank = transformer_shape(**SHAPE), transformer_shape(**SHAPE, tensor_parallel=t)
    assert [u for u, _ in rank.units] == [u for u, _ in one.units]
    for (_, n1), (_, nt) in zip(one.units, rank.units):
        assert nt == -(-n1 // t)
    assert rank.flops_per_token == pytest.approx(one.flops_per_token / t)
    assert rank.tp_allreduces == 4 * SHAPE["layers"] + 1 and one.tp_allreduces == 0
    # Megatron's split of a block's activations: the residual stream whole, the rest 1/t.
    a1 = decoder_activations(512, 256, 1024, heads=8, ffn=1408, gated=True)
    at = decoder_activations(512, 256, 1024, heads=8, ffn=1408, gated=True,
                             tensor_parallel=t)
    whole = 4 * 512 + 4
    assert at["block_activations"] - whole == pytest.approx(
        (a1["block_activations"] - whole) / t)
    assert at["logits"] == pytest.approx(a1["logits"] / t)


@pytest.mark.parametrize("preset", ["zero3", "zeropp"])
def test_zero_moves_the_same_bytes_across_nodes_whatever_the_split(preset):
    """The parameters cross nodes once per gather either way: t data groups per node, each
    with a 1/t slice, move what one group moves without tensor parallelism (up to padding)."""
    config = getattr(zpp.ZeroPPConfig, preset)()
    rng = np.random.default_rng(fresh_seed())
    nodes, gpus = int(rng.choice([2, 4, 16])), 8
    base = config_workload(config, transformer_shape(**SHAPE), MeshInfo(nodes, gpus),
                           tokens_per_device=256)
    for t in (2, 4):
        work = config_workload(config, transformer_shape(**SHAPE, tensor_parallel=t),
                               MeshInfo(nodes, gpus // t), tokens_per_device=256)
        zero = sum(c.cross_bytes_per_node * c.count for c in work.collectives
                   if c.what != "tensor parallel")
        assert zero == pytest.approx(base.cross_bytes_per_node, rel=1e-3)
        tp = [c for c in work.collectives if c.what == "tensor parallel"]
        assert len(tp) == 1 and tp[0].cross_bytes_per_node == 0 and not tp[0].spans_nodes
        # A ring all-reduce of [tokens, d_model] in the compute dtype (bf16) per use.
        assert tp[0].intra_bytes_per_device == pytest.approx(2 * (t - 1) / t * 256 * 512 * 2)


def test_the_states_stay_a_devices_share_and_the_gathered_weights_shrink():
    config = zpp.ZeroPPConfig.zero3()
    one = memory_breakdown(config, transformer_shape(**SHAPE), MeshInfo(2, 8), 256)
    for t in (2, 4):
        rank = memory_breakdown(config, transformer_shape(**SHAPE, tensor_parallel=t),
                                MeshInfo(2, 8 // t), 256)
        assert rank.states == pytest.approx(one.states, rel=1e-3)
        assert rank.gathered < one.gathered / t * 1.05
        assert rank.activations < one.activations


def test_the_planner_ranks_tensor_parallel_degrees():
    """A 70B-class model keeping every activation of a 3584-token sequence does not fit 80
    GiB per GPU on 16 x 8 H100s without tensor parallelism; given the shapes of degrees 2,
    4 and 8 (each data-parallel rank one sequence) the planner picks a degree whose
    predicted peak fits, and says which mesh to build."""
    from zeropp_jax.plan import auto, presets

    big = dict(layers=80, d_model=8192, vocab=32000, seq_len=3584, ffn=28672, heads=64,
               kv_heads=8, gated=True)
    shapes = {t: transformer_shape(**big, tensor_parallel=t) for t in (2, 4, 8)}
    budget = 80 * 2**30
    no_host = dataclasses.replace(presets.h100(16), host=None)  # no offload candidates
    # Two candidates per degree keep it quick (each is traced); every degree gets them.
    configs = [zpp.ZeroPPConfig.zero3(), zpp.ZeroPPConfig(qwz=True)]
    with pytest.raises(ValueError, match="no configuration fits"):
        auto.plan(transformer_shape(**big), hardware=no_host, memory_budget_bytes=budget,
                  tokens_per_device=3584, configs=configs)
    p = auto.plan(transformer_shape(**big), hardware=no_host, memory_budget_bytes=budget,
                  tokens_per_device=3584, tensor_parallel=shapes, configs=configs)
    assert p.chosen.fits and p.chosen.tensor_parallel > 1
    assert {c.tensor_parallel for c in p.candidates} == {1, 2, 4, 8}
    t = p.chosen.tensor_parallel
    assert f"make_mesh(16, {8 // t}, model={t})" in p.table()
    assert all(not c.fits for c in p.candidates if c.tensor_parallel == 1)
    with pytest.raises(ValueError, match="degree 2"):
        auto.plan(transformer_shape(**big), hardware=presets.h100(16),
                  tensor_parallel={2: shapes[4]}, configs=configs)
