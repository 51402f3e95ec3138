"""The planner on a state trained with an expert axis: priced on the data axes, with each
expert slice's data group sharing the node's link, and a note of what it leaves out."""

import dataclasses

import jax
import numpy as np
import optax

import zeropp_jax as zpp
from zeropp_demo.moe import MOE_RULES, MoEConfig, MoELM
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.plan.auto import plan
from zeropp_jax.plan.workload import config_workload, shape_of_state

MEMO: dict = {}


def _state(shape, config=None):
    model = MoELM(MoEConfig())
    variables = model.init(jax.random.key(0), np.zeros((2, 12), np.int32))
    return zpp.TrainState.create(
        model=model, params=variables, tx=optax.sgd(0.1),
        mesh=zpp.make_mesh(shape[0], shape[1], expert=shape[2]),
        config=config or zpp.ZeroPPConfig.zero3(compute_dtype="float32"),
        logical_axis_rules=MOE_RULES)


def test_an_expert_state_is_planned_on_its_data_axes():
    state = _state((2, 2, 2))
    shape = shape_of_state(state)
    assert (shape.expert_parallel, shape.tensor_parallel) == (2, 1)
    assert shape.units == tuple((n, lay.n) for n, lay in state.engine.layouts.items())
    # Each of the two expert slices has its own data group over both nodes: twice one
    # group's bytes cross each node's link.
    one = dataclasses.replace(shape, expert_parallel=1)
    cfg = zpp.ZeroPPConfig.zeropp()
    two = config_workload(cfg, shape, MeshInfo(2, 2), memo=MEMO).cross_bytes_per_node
    alone = config_workload(cfg, one, MeshInfo(2, 2), memo=MEMO).cross_bytes_per_node
    assert two == 2 * alone > 0
    # And that is what the compiled step moves across nodes (ZeRO's collectives: the
    # expert groups' stay inside nodes), byte for byte, for ZeRO-3 and ZeRO++.
    from zeropp_demo.gpt import lm_train_step
    from zeropp_jax.measure.comm_report import comm_report

    batch = np.random.default_rng(0).integers(0, 64, (16, 13)).astype(np.int32)
    step = lm_train_step()
    for config in (zpp.ZeroPPConfig.zero3(compute_dtype="float32"),
                   zpp.ZeroPPConfig.zeropp(compute_dtype="float32")):
        s = _state((2, 2, 2), config)
        report = comm_report(step.lower(s, batch).compile().as_text(), s.mesh)
        assert report.by_axis()["expert"]["cross_node_bytes"] == 0
        predicted = config_workload(config, shape_of_state(s), MeshInfo(2, 2), memo=MEMO)
        assert predicted.cross_bytes_per_node == report.cross_node_bytes_per_node > 0
    result = plan(state, nodes=2, local=4)
    assert "expert mesh (expert=2)" in result.why and "(2 x 2)" in result.why
    assert "in a slice" in result.table()
    # Candidates are those of a 2 x 2 data mesh (hpZ groups of whole nodes of 2).
    assert all(c.config.hpz_group_size in (None, 2) for c in result.candidates)
