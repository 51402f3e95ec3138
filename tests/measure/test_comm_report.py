"""The communication report on hand-built shard_map programs with known volumes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.measure.analysis import comm_report
from zeropp_jax.measure.comm_report import collectives, mesh_axes_groups

from default_step import default_step

AXES = ("node", "local")


def _programs(mesh, per_device: int, fn):
    num = mesh.devices.size
    x = jax.device_put(jnp.asarray(np.random.default_rng(0).standard_normal(num * per_device),
                                   jnp.float32), NamedSharding(mesh, P(AXES)))
    lowered = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES))).lower(x)
    return lowered, lowered.compile()


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
def test_all_gather_over_local_never_crosses_nodes(nodes, local):
    mesh = zpp.make_mesh(nodes, local)
    for program in _programs(mesh, 64, lambda v: jax.lax.all_gather(v, "local", tiled=True)):
        r = comm_report(program, mesh)
        assert [row.kind for row in r.rows] == ["all-gather"]
        assert r.cross_node_bytes == 0
        # Each device receives (L - 1) chunks of 64 fp32 from its node's peers.
        assert r.intra_node_bytes == nodes * local * (local - 1) * 64 * 4


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2)])
def test_all_to_all_over_node_counts_the_crossing_chunks(nodes, local):
    mesh = zpp.make_mesh(nodes, local)

    def a2a(v):
        return jax.lax.all_to_all(v.reshape(nodes, -1), "node", 0, 0, tiled=True).reshape(-1)

    for program in _programs(mesh, 64 * nodes, a2a):
        r = comm_report(program, mesh)
        # Every device keeps 1 of its `nodes` chunks (64 fp32 each) and sends the rest
        # across nodes.
        assert r.cross_node_bytes == nodes * local * (nodes - 1) * 64 * 4
        assert r.intra_node_bytes == 0


@pytest.mark.parametrize("nodes,local", [(2, 4), (4, 2), (8, 1)])
def test_all_gather_over_both_axes_matches_the_formula(nodes, local):
    mesh = zpp.make_mesh(nodes, local)
    num = nodes * local
    total = num * 64 * 4  # gathered bytes T
    for program in _programs(mesh, 64, lambda v: jax.lax.all_gather(v, AXES, tiled=True)):
        r = comm_report(program, mesh)
        assert r.cross_node_bytes_per_node == pytest.approx((nodes - 1) / nodes * total)


def test_reduce_scatter_and_permute():
    mesh = zpp.make_mesh(2, 4)
    rs = lambda v: jax.lax.psum_scatter(v, AXES, tiled=True)  # noqa: E731
    lowered, compiled = _programs(mesh, 64, rs)
    for r in (comm_report(lowered, mesh), comm_report(compiled, mesh)):
        assert r.cross_node_bytes_per_node == pytest.approx(0.5 * 64 * 4)
    perm = [(0, 4), (4, 0), (1, 2), (2, 1)] + [(d, d) for d in (3, 5, 6, 7)]
    pp = lambda v: jax.lax.ppermute(v, AXES, perm)  # noqa: E731
    for program in _programs(mesh, 64, pp):
        r = comm_report(program, mesh)
        assert r.cross_node_bytes == 2 * 256 and r.intra_node_bytes == 2 * 256


def test_train_step_report_flags_widened_reduce_scatters():
    # bf16 compute (the default config); the step test_memory reads too (default_step.py).
    state, _, lowered, compiled = default_step()
    mesh = state.mesh
    asked, moved = comm_report(lowered, mesh), comm_report(compiled, mesh)
    rs_asked = [r for r in asked.rows if r.kind == "reduce-scatter"]
    rs_moved = [r for r in moved.rows if r.kind == "reduce-scatter"]
    assert {r.dtype for r in rs_asked} == {"bf16"} and not any(r.widened for r in rs_asked)
    assert all(r.dtype == "f32" and r.widened for r in rs_moved)  # XLA CPU widens them
    # All-gathers move 16-bit either way; the widened reduce-scatters double their bytes.
    ag = lambda rep: sum(r.cross_node_bytes for r in rep.rows if r.kind == "all-gather")  # noqa: E731
    assert ag(asked) == ag(moved)
    rs = lambda rep: sum(r.cross_node_bytes for r in rep.rows if r.kind == "reduce-scatter")  # noqa: E731
    assert rs(moved) == 2 * rs(asked)
    assert "cross-node bytes per node" in asked.table()
    assert asked.to_json()["cross_node_bytes"] == asked.cross_node_bytes


# -- the parser, on program text of every supported JAX ------------------------------------
#
# Lines copied from programs lowered and compiled on a 4x2 ("node", "local") mesh: an
# all-gather over "local", an all-to-all over "node" and a 16-bit all-gather over both axes.

_MLIR_JAX_0_10 = """\
module @jit__lambda attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  func.func public @main(%arg0: tensor<512xf32>) -> (tensor<512xf32> {jax.result_info = "result"}) {
      %1 = "stablehlo.all_gather"(%arg1) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1], [2, 3], [4, 5], [6, 7]]> : tensor<4x2xi64>, use_global_device_ids}> : (tensor<64xf32>) -> tensor<128xf32>
      %2 = "stablehlo.all_to_all"(%1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, concat_dimension = 0 : i64, replica_groups = dense<[[0, 2, 4, 6], [1, 3, 5, 7]]> : tensor<2x4xi64>, split_count = 4 : i64, split_dimension = 0 : i64}> : (tensor<4x16xf32>) -> tensor<4x16xf32>
      %3 = "stablehlo.all_gather"(%2) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = dense<[[0, 1, 2, 3, 4, 5, 6, 7]]> : tensor<1x8xi64>, use_global_device_ids}> : (tensor<64xui16>) -> tensor<512xui16>
  }
}
"""

_MLIR_JAX_0_11 = """\
module @jit__lambda attributes {mhlo.num_partitions = 8 : i32, mhlo.num_replicas = 1 : i32} {
  sdy.mesh @mesh = <["node"=4, "local"=2]> {stablehlo.mesh = {axes = [{name = "node", size = 4 : i64}, {name = "local", size = 2 : i64}]}}
  sdy.mesh @mesh_0 = <["node"=4, "local"=2]> {stablehlo.mesh = {axes = [{name = "node", size = 4 : i64}, {name = "local", size = 2 : i64}]}}
  func.func public @main(%arg0: tensor<512xf32>) -> (tensor<512xf32> {jax.result_info = "result"}) {
    %0 = sdy.manual_computation(%arg0) in_shardings=[<@mesh, [{"node", "local"}]>] out_shardings=[<@mesh, [{"node", "local"}]>] manual_axes={"node", "local"} (%arg1: tensor<64xf32>) {
      %1 = "stablehlo.all_gather"(%arg1) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "local">]>, use_global_device_ids}> : (tensor<64xf32>) -> tensor<128xf32>
      %2 = "stablehlo.all_to_all"(%1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, concat_dimension = 0 : i64, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "node">]>, split_count = 4 : i64, split_dimension = 0 : i64}> : (tensor<4x16xf32>) -> tensor<4x16xf32>
      %3 = "stablehlo.all_gather"(%2) <{all_gather_dim = 0 : i64, channel_handle = #stablehlo.channel_handle<handle = 1, type = 1>, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh_0, axes = [#stablehlo.axis_ref<name = "node">, #stablehlo.axis_ref<name = "local">]>, use_global_device_ids}> : (tensor<64xui16>) -> tensor<512xui16>
      sdy.return %3 : tensor<64xf32>
    } : (tensor<512xf32>) -> tensor<512xf32>
    return %0 : tensor<512xf32>
  }
}
"""

_HLO_JAX_0_10 = """\
HloModule jit__lambda, is_scheduled=true, entry_computation_layout={(f32[64]{0})->f32[64]{0}}, num_partitions=8
  %all_gather.3 = f32[128]{0} all-gather(%param.1), channel_id=1, replica_groups={{0,1},{2,3},{4,5},{6,7}}, dimensions={0}, use_global_device_ids=true
  %all-to-all = (f32[1,16]{1,0}, f32[1,16]{1,0}, f32[1,16]{1,0}, f32[1,16]{1,0}) all-to-all(%a, %b, %c, %d), channel_id=1, replica_groups=[2,4]<=[4,2]T(1,0)
  %all_gather.4 = u16[512]{0} all-gather(%fusion), channel_id=1, replica_groups=[1,8]<=[8], dimensions={0}, use_global_device_ids=true
"""

_HLO_JAX_0_11 = """\
HloModule jit__lambda, is_scheduled=true, entry_computation_layout={(f32[64]{0})->f32[64]{0}}, allow_spmd_sharding_propagation_to_parameters={true}, allow_spmd_sharding_propagation_to_output={true}, num_partitions=8
  %param.1 = f32[64]{0} parameter(0), sharding={mesh['node'=4,'local'=2], [{'node', 'local'}]}, metadata={op_name="v"}
  %all_gather.3 = f32[128]{0} all-gather(%param.1), channel_id=1, replica_groups=mesh['node'=4,'local'=2] {'local'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(<lambda>)/shard_map/all_gather" stack_frame_id=4}
  %all-to-all = (f32[1,16]{1,0}, f32[1,16]{1,0}, f32[1,16]{1,0}, f32[1,16]{1,0}) all-to-all(%slice_bitcast_fusion.3, %slice_bitcast_fusion.2, %slice_bitcast_fusion.1, %slice_bitcast_fusion), channel_id=1, replica_groups=mesh['node'=4,'local'=2] {'node'}, metadata={op_name="jit(<lambda>)/shard_map/all_to_all" stack_frame_id=6}
  %all_gather.3 = u16[512]{0} all-gather(%convert_bitcast-convert_fusion), channel_id=1, replica_groups=mesh['node'=4,'local'=2] {'node','local'}, dimensions={0}, use_global_device_ids=true, metadata={op_name="jit(<lambda>)/shard_map/all_gather" stack_frame_id=8}
"""

_LOCAL_GROUPS = ((0, 1), (2, 3), (4, 5), (6, 7))
_NODE_GROUPS = ((0, 2, 4, 6), (1, 3, 5, 7))
_ALL = (tuple(range(8)),)


@pytest.mark.parametrize("text,u16", [(_MLIR_JAX_0_10, "ui16"), (_MLIR_JAX_0_11, "ui16"),
                                      (_HLO_JAX_0_10, "u16"), (_HLO_JAX_0_11, "u16")],
                         ids=["mlir-0.10", "mlir-0.11", "hlo-0.10", "hlo-0.11"])
def test_collectives_read_replica_groups_in_every_printed_form(text, u16):
    ops = collectives(text)
    assert [(c.kind, c.groups) for c in ops] == [
        ("all-gather", _LOCAL_GROUPS), ("all-to-all", _NODE_GROUPS), ("all-gather", _ALL)]
    assert [c.dtype for c in ops] == ["f32", "f32", u16]
    assert ops[0].shape == (128,) and ops[0].bytes == 128 * 4
    assert ops[2].bytes == 512 * 2
    r = comm_report(text, (4, 2))
    assert r.rows[0].cross_node_bytes == 0 and r.rows[1].intra_node_bytes == 0
    assert r.rows[2].cross_node_bytes == 4 * (3 / 4) * 512 * 2  # (n-1)/n * T per node


def test_mesh_device_ids_place_groups():
    # Device ids listed: position (node, local) holds device_ids[node * 4 + local].
    mlir = """\
  sdy.mesh @m = <["node"=2, "local"=4], device_ids=[0, 2, 4, 6, 1, 3, 5, 7]>
  func.func public @main(%arg0: tensor<8xf32>) -> tensor<32xf32> {
      %1 = "stablehlo.all_gather"(%arg0) <{all_gather_dim = 0 : i64, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @m, axes = [#stablehlo.axis_ref<name = "local">]>, use_global_device_ids}> : (tensor<8xf32>) -> tensor<32xf32>
"""
    hlo = ("  %ag = f32[32]{0} all-gather(%p), channel_id=1, replica_groups=mesh['node'=2,"
           "'local'=4], device_ids=([2,4]<=[4,2]T(1,0)) {'local'}, dimensions={0}\n")
    hlo_list = hlo.replace("([2,4]<=[4,2]T(1,0))", "(0,2,4,6,1,3,5,7)")
    for text in (mlir, hlo, hlo_list):
        [c] = collectives(text)
        assert c.groups == _NODE_GROUPS, text


def test_sub_axes_inline_meshes_and_reduction_regions():
    # Shardy's "y":(1)2 is the major half of axis y (size 4): stride 2 inside y.
    assert mesh_axes_groups([("x", 2), ("y", 4)], [("y", 1, 2)]) == [[0, 2], [1, 3], [4, 6],
                                                                     [5, 7]]
    assert mesh_axes_groups([("x", 2), ("y", 4)], [("y", 2, 2)]) == [[0, 1], [2, 3], [4, 5],
                                                                     [6, 7]]
    assert mesh_axes_groups([("x", 2), ("y", 4)], ["y", "x"]) == [[0, 4, 1, 5, 2, 6, 3, 7]]
    text = """\
  sdy.mesh @mesh = <["x"=2, "y"=4]>
  func.func public @main(%arg1: tensor<4x8xf32>) -> tensor<4x8xf32> {
    %1 = "stablehlo.all_reduce"(%arg1) <{channel_handle = #stablehlo.channel_handle<handle = 1, type = 0>, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = @mesh, axes = [#stablehlo.axis_ref<name = "y", sub_axis_info = (1)2>]>, use_global_device_ids}> ({
    ^bb0(%arg2: tensor<f32>, %arg3: tensor<f32>):
      %2 = "stablehlo.add"(%arg2, %arg3) : (tensor<f32>, tensor<f32>) -> tensor<f32>
      "stablehlo.return"(%2) : (tensor<f32>) -> ()
    }) : (tensor<4x8xf32>) -> tensor<4x8xbf16>
    %3 = "stablehlo.all_gather"(%1) {all_gather_dim = 0 : i64, replica_groups = #stablehlo.replica_group_mesh_axes<mesh = #stablehlo.mesh<axes = [#stablehlo.mesh_axis<name = "x", size = 2>, #stablehlo.mesh_axis<name = "y", size = 4>]>, axes = [#stablehlo.axis_ref<name = "x">]>} : (tensor<4x8xbf16>) -> tensor<8x8xbf16>
"""
    reduce, gather = collectives(text)
    assert (reduce.kind, reduce.dtype, reduce.shape) == ("all-reduce", "bf16", (4, 8))
    assert reduce.groups == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert (gather.kind, gather.shape) == ("all-gather", (8, 8))
    assert gather.groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    hlo = "  %ar = f32[8]{0} all-reduce(%p), replica_groups=mesh['x'=2,'y'=4] {'y':(2)2}\n"
    assert collectives(hlo)[0].groups == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_groups_on_an_undeclared_mesh_raise():
    text = _MLIR_JAX_0_11.replace("sdy.mesh @mesh_0", "sdy.mesh @other")
    with pytest.raises(ValueError, match="@mesh_0"):
        collectives(text)


def test_combined_all_reduce_with_many_operands_is_counted():
    """XLA's all-reduce combiner merges a step's all-reduces into one tuple-shaped op, and
    HLO prints ``/*index=5*/`` inside a tuple type of more than five elements: all seven
    operands' bytes are counted (a parser that stopped at the comment saw no all-reduce)."""
    mesh = zpp.make_mesh(2, 4)
    widths = [16 * (i + 1) for i in range(7)]
    xs = [np.ones((8, w), np.float32) for w in widths]
    f = jax.jit(jax.shard_map(lambda *a: tuple(jax.lax.psum(x, AXES) for x in a), mesh=mesh,
                              in_specs=P(AXES), out_specs=P(AXES)))
    text = f.lower(*xs).compile().as_text()
    assert "/*index=5*/" in text  # the case this test is about is really printed
    reduces = [c for c in collectives(text) if c.kind == "all-reduce"]
    assert sum(c.bytes for c in reduces) == 4 * sum(widths)


def test_gpu_async_starts_count_their_results():
    # XLA's GPU compiler prints an async start's operands before its results, the
    # operands as a nested tuple for reduce-scatter and all-to-all.
    lines = {
        "reduce-scatter": "  %rs = ((bf16[64]{0}), bf16[8]{0}) reduce-scatter-start(%g), "
                          "channel_id=4, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
        "all-to-all": "  %a2a = ((u8[8,12]{1,0}), u8[8,12]{1,0}) all-to-all-start(%q), "
                      "channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
        "all-gather": "  %ag = (s16[8]{0}, s16[64]{0}) all-gather-start(%w), channel_id=1, "
                      "replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}",
        "all-reduce": "  %ar = f32[2]{0} all-reduce-start(%l), channel_id=2, "
                      "replica_groups={{0,1,2,3,4,5,6,7}}, to_apply=%add",
    }
    expected = {"reduce-scatter": ("bf16", (8,), 16), "all-to-all": ("u8", (8, 12), 96),
                "all-gather": ("s16", (64,), 128), "all-reduce": ("f32", (2,), 8)}
    for kind, line in lines.items():
        (c,) = collectives("HloModule m\n" + line, 8)
        assert (c.kind, c.dtype, c.shape, c.bytes) == (kind, *expected[kind])
    (c,) = collectives("HloModule m\n" + lines["all-to-all"], 8)
    assert c.groups == ((0, 1, 2, 3), (4, 5, 6, 7))
