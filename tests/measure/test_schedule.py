"""The schedule replay (``measure.schedule``): exact arithmetic on hand-written scheduled
HLO, and the programs XLA's GPU compiler scheduled for an H100 cluster (fixtures written by
``benchmarks/gpu_cluster/fixtures.py``)."""

import collections
import gzip
import json
import pathlib
import re

import pytest

from zeropp_jax.measure.comm_report import collectives
from zeropp_jax.measure.schedule import (Links, Roofline, parse_module, schedule_report,
                                         unit_of)

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# Prices that make every time a small multiple of one second: memory 8192 B/s, matmuls
# 2**20 FLOP/s; inside a node 1024 B/s per device, across 4096 B/s per node.
ROOF = Roofline({"bf16": 2.0**20, "f32": 2.0**19}, 8192.0)
LINKS = Links(nodes=2, local=2, intra_bytes_per_s=1024.0, inter_bytes_per_s=4096.0)

# One all-gather of f32[256] shards into f32[1024] (4096 bytes) over all 4 devices (2 nodes
# x 2): per ``comm.wire.count_bytes`` each node takes (4 - 2) / 4 * 4096 bytes across (4096
# in all: 0.5 s over two nodes' links) and 2 * 1 / 4 * 4096 inside (4096 in all: 1 s over
# four devices' links): 1.5 s of wire.
AG_WIRE_S = 1.5

MODULE = """HloModule test, is_scheduled=true

%fused_mul (p0: f32[1024]) -> f32[1024] {
  %p0 = f32[1024]{0} parameter(0)
  ROOT %m = f32[1024]{0} multiply(%p0, %p0)
}

%fused_dus (q0: f32[8,1024], q1: s32[], q2: f32[1,1024]) -> f32[8,1024] {
  %q0 = f32[8,1024]{1,0} parameter(0)
  %q2 = f32[1,1024]{1,0} parameter(2)
  %q1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  ROOT %u = f32[8,1024]{1,0} dynamic-update-slice(%q0, %q2, %q1, %zero)
}

%gemm (g0: bf16[64,128], g1: bf16[128,32]) -> bf16[64,32] {
  %g0 = bf16[64,128]{1,0} parameter(0)
  %g1 = bf16[128,32]{1,0} parameter(1)
  ROOT %d = bf16[64,32]{1,0} dot(%g0, %g1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: f32[1024], b: f32[256], buf: f32[8,1024], i: s32[], x: bf16[64,128], w: bf16[128,32]) -> f32[1024] {
  %a = f32[1024]{0} parameter(0)
  %b = f32[256]{0} parameter(1)
  %buf = f32[8,1024]{1,0} parameter(2)
  %i = s32[] parameter(3)
  %x = bf16[64,128]{1,0} parameter(4)
  %w = bf16[128,32]{1,0} parameter(5)
  %ag-start = (f32[256]{0}, f32[1024]{0}) all-gather-start(%b), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}, metadata={op_name="unit/all_gather"}, backend_config={"collective_backend_config":{"is_sync":false}}
  %f = f32[1024]{0} fusion(%a), kind=kLoop, calls=%fused_mul
  %ag-done = f32[1024]{0} all-gather-done(%ag-start)
  %r = f32[1024]{0} add(%f, %ag-done)
  %row = f32[1,1024]{1,0} bitcast(%r)
  %dus = f32[8,1024]{1,0} fusion(%buf, %i, %row), kind=kLoop, calls=%fused_dus
  %mm = bf16[64,32]{1,0} fusion(%x, %w), kind=kCustom, calls=%gemm
  ROOT %out = f32[1024]{0} copy(%r)
}
"""


def _times() -> dict[str, float]:
    """Each instruction's roofline time, from the prices above."""
    return {
        "f": (4096 + 4096) / 8192,  # reads and writes f32[1024]
        "r": 3 * 4096 / 8192,  # two reads, one write
        # In place: reads the f32[1,1024] update and the index, writes the update.
        "dus": (4096 + 4 + 4096) / 8192,
        # 2 * 64 * 32 * 128 FLOPs at 2**20 FLOP/s (0.5 s) against 24576 bytes (3 s).
        "mm": max(2 * 64 * 32 * 128 / 2.0**20, (64 * 128 + 128 * 32 + 64 * 32) * 2 / 8192),
        "out": 2 * 4096 / 8192,
    }


def test_replay_of_a_hand_written_schedule_is_exact():
    r = schedule_report(MODULE, ROOF, LINKS)
    t = _times()
    (ag,) = r.collectives
    assert (ag.kind, ag.bytes, ag.spans_nodes, ag.runs, ag.sync) == (
        "all-gather", 4096, True, 1, False)
    assert ag.op_name == "unit/all_gather"
    assert ag.wire_s == pytest.approx(AG_WIRE_S, rel=1e-12)
    # The gather runs beside the fusion, then the add waits for the rest of its wire time.
    assert ag.exposed_s == pytest.approx(AG_WIRE_S - t["f"], rel=1e-12)
    assert r.compute_s == pytest.approx(sum(t.values()), rel=1e-12)
    assert r.step_s == pytest.approx(sum(t.values()) + AG_WIRE_S - t["f"], rel=1e-12)
    assert r.hidden_fraction(True) == pytest.approx(t["f"] / AG_WIRE_S, rel=1e-12)
    assert r.hidden_fraction(False) is None  # no collective stays inside a node


def test_a_synchronous_collective_hides_nothing():
    sync = MODULE.replace('"is_sync":false', '"is_sync":true')
    r = schedule_report(sync, ROOF, LINKS)
    (ag,) = r.collectives
    assert ag.sync and ag.exposed_s == pytest.approx(AG_WIRE_S, rel=1e-12)
    assert r.hidden_fraction() == pytest.approx(0.0, abs=1e-12)


LOOP_MODULE = MODULE.split("ENTRY")[0] + """%body (p: (s32[], f32[1024], f32[256])) -> (s32[], f32[1024], f32[256]) {
  %p = (s32[], f32[1024]{0}, f32[256]{0}) parameter(0)
  %k = s32[] get-tuple-element(%p), index=0
  %a = f32[1024]{0} get-tuple-element(%p), index=1
  %b = f32[256]{0} get-tuple-element(%p), index=2
  %ag-start = (f32[256]{0}, f32[1024]{0}) all-gather-start(%b), channel_id=1, replica_groups={{0,1},{2,3}}, dimensions={0}, backend_config={"collective_backend_config":{"is_sync":false}}
  %f = f32[1024]{0} fusion(%a), kind=kLoop, calls=%fused_mul
  %ag-done = f32[1024]{0} all-gather-done(%ag-start)
  ROOT %t = (s32[], f32[1024]{0}, f32[256]{0}) tuple(%k, %f, %b)
}

%cond (c: (s32[], f32[1024], f32[256])) -> pred[] {
  %c = (s32[], f32[1024]{0}, f32[256]{0}) parameter(0)
  ROOT %lt = pred[] constant(true)
}

ENTRY %main (a: f32[1024], b: f32[256]) -> (s32[], f32[1024], f32[256]) {
  %a = f32[1024]{0} parameter(0)
  %b = f32[256]{0} parameter(1)
  %zero = s32[] constant(0)
  %init = (s32[], f32[1024]{0}, f32[256]{0}) tuple(%zero, %a, %b)
  ROOT %loop = (s32[], f32[1024]{0}, f32[256]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
}
"""


def test_a_loop_runs_its_body_trip_count_times():
    r = schedule_report(LOOP_MODULE, ROOF, LINKS)
    (ag,) = r.collectives
    # Each group is one node's two devices: count_bytes gives 2 * (2 - 1) / 2 * 4096 bytes
    # inside the node per group, 8192 in all, over four devices' 1024 B/s links: 2 s.
    assert not ag.spans_nodes and ag.runs == 3
    assert ag.wire_s == pytest.approx(2.0, rel=1e-12)
    assert ag.exposed_s == pytest.approx(2.0 - 1.0, rel=1e-12)  # the fusion: 1 s
    assert r.step_s == pytest.approx(3 * 2.0, rel=1e-12)
    assert r.compute_s == pytest.approx(3 * 1.0, rel=1e-12)
    assert r.hidden_fraction(False) == pytest.approx(0.5, rel=1e-12)


def test_parse_module_reads_names_types_and_operands():
    comps, entry = parse_module(MODULE)
    assert entry == "main" and set(comps) == {"fused_mul", "fused_dus", "gemm", "main"}
    by_name = {i.name: i for i in comps["main"]}
    assert by_name["ag-start"].opcode == "all-gather-start"
    assert by_name["ag-start"].operands == ("b",)
    assert by_name["dus"].operands == ("buf", "i", "row")
    assert by_name["dus"].attr("calls") == "fused_dus"
    assert by_name["ag-start"].nbytes == 256 * 4 + 1024 * 4
    with pytest.raises(ValueError, match="ENTRY"):
        parse_module(MODULE.replace("ENTRY ", ""))


FIXTURE_FILES = sorted(FIXTURES.glob("tiny_2x4_*.hlo.gz"))


def _fixture(path: pathlib.Path) -> str:
    return gzip.decompress(path.read_bytes()).decode()


def test_fixtures_are_there():
    names = {p.name.removesuffix(".hlo.gz") for p in FIXTURE_FILES}
    assert {"tiny_2x4_zero3_default", "tiny_2x4_zero3_pipelined",
            "tiny_2x4_zeropp_pipelined"} <= names


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.split(".")[0])
def test_gpu_schedules_replay_every_collective(path):
    text = _fixture(path)
    comps, entry = parse_module(text)
    starts = [i for body in comps.values() for i in body if i.opcode.endswith("-start")
              and not i.opcode.startswith(("copy", "send", "recv"))]
    done_of = {i.operands[0] for body in comps.values() for i in body
               if i.opcode.endswith("-done")}
    assert starts and all(s.name in done_of for s in starts)
    r = schedule_report(text, ROOF, Links(2, 4, 1e9, 1e9))
    # Every collective of the program, as the comm report reads it, is replayed, with the
    # same kind and bytes...
    replayed = collections.Counter((c.kind, c.bytes) for c in r.collectives)
    listed = collections.Counter((c.kind, c.bytes) for c in collectives(text, 8))
    assert replayed == listed
    # ...and a loop's once per trip: the scanned layers' loops run 4 times, less the
    # iterations XLA peeled off to pipeline their collectives.
    runs = {c.name: c.runs for c in r.collectives}
    loops = [(i.attr("body"), int(re.search(r'"n":"(\d+)"', i.line).group(1)))
             for body in comps.values() for i in body if i.opcode == "while"]
    assert loops and {n for _, n in loops} <= {2, 3, 4}
    for body, n in loops:
        for s in starts:
            if s in comps[body]:
                assert runs[s.name] == n
    assert 0 < r.compute_s <= r.step_s
    for c in r.collectives:
        assert 0 <= c.exposed_s <= c.wire_s


def test_pipelined_collectives_hide_more_of_the_layers_gathers():
    by_name = {p.name.removesuffix(".hlo.gz"): p for p in FIXTURE_FILES}
    links = Links(2, 4, 450e9, 4 * 50e9)
    roof = Roofline({"bf16": 989e12, "f32": 494e12}, 3.35e12)
    default = schedule_report(_fixture(by_name["tiny_2x4_zero3_default"]), roof, links)
    pipelined = schedule_report(_fixture(by_name["tiny_2x4_zero3_pipelined"]), roof, links)
    assert pipelined.hidden_fraction(True) > default.hidden_fraction(True) + 0.1


def test_cluster_devices_without_the_cuda_plugin_name_the_package():
    import importlib.util

    from zeropp_jax.core import compat

    if importlib.util.find_spec("jax_plugins") is not None:
        pytest.skip("a JAX plugin (CUDA's) is installed here")
    with pytest.raises(ImportError, match=r"jax\[cuda12\]"):
        compat.gpu_cluster_devices('platform_name: "CUDA"', 2, 8)


def test_collectives_are_named_by_unit_and_role():
    stack = "jit(run)/shard_map/{}(Llama){}/while/body/closed_call/layers/{}"
    assert unit_of(stack.format("jvp", "", "all_gather")) == ("layers", "gather")
    assert unit_of(stack.format("transpose(jvp", ")", "all_gather")) == ("layers", "regather")
    assert unit_of(stack.format("transpose(jvp", ")", "zeropp_reduced_gradient/all_to_all")
                   ) == ("layers", "gradient")
    # XLA's combined collectives list every part; the rest unit rides with the first.
    combined = ("jit(run)/shard_map/(transpose(jvp(Llama))/layers_1/zeropp_reduced_gradient/"
                "reduce_scatter:transpose(jvp(zeropp_reduced_gradient))/reduce_scatter)")
    assert unit_of(combined) == ("layers_1+<rest>", "gradient")
    common = ("jit(run)/shard_map/transpose(jvp(Llama))/(embed/zeropp_reduced_gradient/"
              "reduce_scatter:while/body/closed_call/layers/zeropp_reduced_gradient/"
              "reduce_scatter)")
    assert unit_of(common) == ("embed+layers", "gradient")
    assert unit_of("jit(run)/shard_map/jvp()/all_gather") == ("<rest>", "gather")
    assert unit_of("jit(run)/shard_map/zeropp_own/psum")[1] == "other"
    assert unit_of("jit(run)/shard_map/psum")[1] == "other"


def test_by_unit_adds_up_to_the_step():
    by_name = {p.name.removesuffix(".hlo.gz"): p for p in FIXTURE_FILES}
    links = Links(2, 4, 450e9, 4 * 50e9)
    roof = Roofline({"bf16": 989e12, "f32": 494e12}, 3.35e12)
    r = schedule_report(_fixture(by_name["tiny_2x4_zeropp_pipelined"]), roof, links)
    units = r.by_unit()
    for spans in (True, False):
        part = [u for u in units if u.spans_nodes == spans]
        assert sum(u.wire_s for u in part) == pytest.approx(r.wire_s(spans), rel=1e-12)
        assert sum(u.exposed_s for u in part) == pytest.approx(r.exposed_s(spans), rel=1e-12)
    roles = {(u.unit, u.role, u.spans_nodes): u.runs for u in units}
    # zeropp on the 4-layer scanned stack: each layer's gather crosses nodes, its regather
    # (hpZ) stays inside the node, its qgZ gradient has a hop of each.
    assert roles[("layers", "gather", True)] == 4
    assert roles[("layers", "regather", False)] == 4
    assert ("layers", "regather", True) not in roles
    assert roles[("layers", "gradient", True)] == roles[("layers", "gradient", False)] == 4


def test_compute_by_class_splits_the_replays_compute_exactly():
    """Each kernel of the hand-written module in its class, priced as the replay prices
    it: the multiply and the add elementwise, the in-place update and the copy layout, the
    dot matmul; the name stack marks quantization, the engine's own scope and attention."""
    from zeropp_jax.measure.schedule import KERNEL_CLASSES, compute_by_class

    t = _times()
    got = compute_by_class(MODULE, ROOF)
    assert set(got) == set(KERNEL_CLASSES)
    want = {"elementwise": t["f"] + t["r"], "copies and layout": t["dus"] + t["out"],
            "matmul": t["mm"]}
    assert got == pytest.approx({k: want.get(k, 0.0) for k in KERNEL_CLASSES}, rel=1e-12)
    assert sum(got.values()) == pytest.approx(
        schedule_report(MODULE, ROOF, LINKS).compute_s, rel=1e-12)
    # The other classes, by what marks them: the same instructions renamed.
    quant = MODULE.replace("kind=kLoop, calls=%fused_mul",
                           'kind=kLoop, calls=%fused_mul, metadata={op_name="a/jit(quantize_reference)/mul"}')
    assert compute_by_class(quant, ROOF)["quantize/dequantize/Hadamard"] == \
        pytest.approx(t["f"], rel=1e-12)
    own = MODULE.replace("%r = f32[1024]{0} add(%f, %ag-done)",
                         '%r = f32[1024]{0} add(%f, %ag-done), metadata={op_name="zeropp_own/add"}')
    assert compute_by_class(own, ROOF)["optimizer and bookkeeping"] == \
        pytest.approx(t["r"], rel=1e-12)
    # A dot named as attention's scores is attention, not matmul.
    scores = MODULE.replace("kind=kCustom, calls=%gemm",
                            'kind=kCustom, calls=%gemm, metadata={op_name="l/vmap(BTNH,BSNH->BNTS)/dot_general"}')
    by = compute_by_class(scores, ROOF)
    assert by["attention"] == pytest.approx(t["mm"], rel=1e-12) and by["matmul"] == 0.0


def test_an_asynchronous_fusion_is_priced_as_its_fusion():
    """XLA's GPU compiler runs a loop's in-place update as ``fusion-start`` /
    ``fusion-done`` (typed ``((operands), output, u32[])``): priced as the same fusion
    run in line (the update's bytes, not the whole buffer and its operands' tuple), in
    the same class, the ``-done`` free."""
    from zeropp_jax.measure.schedule import compute_by_class

    t = _times()
    inline = '%dus = f32[8,1024]{1,0} fusion(%buf, %i, %row), kind=kLoop, calls=%fused_dus'
    assert inline in MODULE
    async_ = MODULE.replace(inline, (
        '%dus-start = ((f32[8,1024]{1,0}, s32[], f32[1,1024]{1,0}), f32[8,1024]{1,0}, u32[]) '
        'fusion-start(%buf, %i, %row), kind=kLoop, calls=%fused_dus\n'
        '  %dus = f32[8,1024]{1,0} fusion-done(%dus-start)'))
    r = schedule_report(async_, ROOF, LINKS)
    assert r.compute_s == pytest.approx(sum(t.values()), rel=1e-12)
    assert compute_by_class(async_, ROOF) == compute_by_class(MODULE, ROOF)
    # Priced as a plain instruction it would read and write the whole buffer, twice over.
    assert (2 * 8 * 4096 + 4096) / 8192 > 8 * t["dus"]


def test_compute_by_instruction_names_each_kernel_with_its_runs():
    """Per instruction: its class, its seconds over a step (a loop body's kernel times the
    trip count) and how often it runs, summing to ``compute_by_class``."""
    from zeropp_jax.measure.schedule import compute_by_class, compute_by_instruction

    t = _times()
    got = compute_by_instruction(MODULE, ROOF)
    assert got == {
        "f": ("elementwise", pytest.approx(t["f"], rel=1e-12), 1),
        "r": ("elementwise", pytest.approx(t["r"], rel=1e-12), 1),
        "dus": ("copies and layout", pytest.approx(t["dus"], rel=1e-12), 1),
        "mm": ("matmul", pytest.approx(t["mm"], rel=1e-12), 1),
        "out": ("copies and layout", pytest.approx(t["out"], rel=1e-12), 1)}
    by_class = compute_by_class(MODULE, ROOF)
    for cls in by_class:
        assert by_class[cls] == pytest.approx(
            sum(s for c, s, _ in got.values() if c == cls), rel=1e-12, abs=0.0)
    looped = compute_by_instruction(LOOP_MODULE, ROOF)
    assert looped == {"f": ("elementwise", pytest.approx(3 * t["f"], rel=1e-12), 3)}


def _fmha_line(name: str, backward: bool, mask: str, b: int, h: int, sq: int, sk: int,
               d: int, dv: int) -> str:
    """A cuDNN fused attention call as XLA's GPU compiler prints it (the fields the replay
    reads, from a compiled ``jax.nn.dot_product_attention(implementation="cudnn")``)."""
    q, k, v = f"bf16[{b},{sq},{h},{d}]", f"bf16[{b},{sk},{h},{d}]", f"bf16[{b},{sk},{h},{dv}]"
    config = ('backend_config={"operation_queue_id": "0", "cudnn_fmha_backend_config": '
              '{"fmha_scale": 0.125, "intermediate_tensor_shape": {"element_type": "BF16", '
              f'"dimensions": ["{b}", "{h}", "{sq}", "{sk}"], "tuple_shapes": [], '
              f'"layout": {{"minor_to_major": ["3", "2", "1", "0"]}}}}, '
              f'"is_flash_attention": true, "mask_type": "{mask}"}}}}')
    if backward:
        out = (f"(bf16[{b},{h},{sq},{d}]{{3,1,2,0}}, bf16[{b},{h},{sk},{d}]{{3,1,2,0}}, "
               f"bf16[{b},{h},{sk},{dv}]{{3,1,2,0}}, u8[0]{{0}})")
        target, operands = "__cudnn$fmhaSoftmaxBackward", "%q, %k, %v, %o, %g"
    else:
        out = f"(bf16[{b},{h},{sq},{dv}]{{3,1,2,0}}, f32[{b},{h},{sq}]{{2,1,0}}, u8[0]{{0}})"
        target, operands = "__cudnn$fmhaSoftmax", "%q, %k, %v"
    return (f"  %{name} = {out} custom-call({operands}), custom_call_target=\"{target}\", "
            f"operand_layout_constraints={{{q}{{3,2,1,0}}, {k}{{3,2,1,0}}, {v}{{3,2,1,0}}}}, "
            f'metadata={{op_name="jit(f)/dot_product_attention_{"bwd" if backward else "fwd"}"}}, '
            + config)


@pytest.mark.parametrize("mask", ["CAUSAL", "NO_MASK", "PADDING_CAUSAL"])
def test_fused_attention_is_priced_by_its_matmul_flops(mask):
    """A cuDNN fused attention call costs the FLOPs of the products it runs, counted from
    the shapes (``fused_attention_flops``): the forward's scores and weighted values, the
    backward's recomputed scores and four gradients; half of each under a causal mask. It
    is attention in ``compute_by_class``."""
    from zeropp_jax.measure.schedule import (compute_by_class, fused_attention_flops,
                                             parse_instruction)

    b, h, sq, sk, d, dv = 2, 8, 512, 256, 64, 32
    half = 0.5 if "CAUSAL" in mask else 1.0
    fwd = parse_instruction(_fmha_line("fwd", False, mask, b, h, sq, sk, d, dv))
    bwd = parse_instruction(_fmha_line("bwd", True, mask, b, h, sq, sk, d, dv))
    scores = b * h * sq * sk
    assert fused_attention_flops(fwd) == half * (2 * scores * d + 2 * scores * dv)
    # scores again (d), dV = P^T dO (dv), dP = dO V^T (dv), dQ = dS K (d), dK = dS^T Q (d)
    assert fused_attention_flops(bwd) == half * 2 * scores * (3 * d + 2 * dv)
    assert fused_attention_flops(parse_instruction(MODULE.splitlines()[-3])) == 0.0

    def module(line: str) -> str:
        return ("HloModule m, is_scheduled=true\n\nENTRY %main (q: bf16[1]) -> bf16[1] {\n"
                "  %q = bf16[1]{0} parameter(0)\n" + line + "\n"
                "  ROOT %r = bf16[1]{0} parameter(1)\n}\n")

    for ins, line in ((fwd, _fmha_line("fwd", False, mask, b, h, sq, sk, d, dv)),
                      (bwd, _fmha_line("bwd", True, mask, b, h, sq, sk, d, dv))):
        by = compute_by_class(module(line), ROOF)
        flops_s = fused_attention_flops(ins) / ROOF.flops_rate("bf16")
        assert by["attention"] == pytest.approx(max(flops_s, ins.nbytes / ROOF.memory_bytes_per_s),
                                                rel=1e-12)
        assert flops_s > ins.nbytes / ROOF.memory_bytes_per_s  # priced by its FLOPs here
        assert sum(by.values()) == by["attention"]


def test_a_cublas_matmul_call_is_priced_by_its_flops():
    """A dot XLA hands to cuBLAS (a ``__cublas$lt$matmul`` custom call, not a fused dot)
    costs ``2 * output elements * contracted size`` FLOPs at its operand type's rate, as a
    fused dot does; it is matmul in ``compute_by_class``."""
    from zeropp_jax.measure.schedule import compute_by_class

    m, k, n = 512, 256, 1024
    gemm = (f'  %g = (bf16[{m},{n}]{{1,0}}, s8[4096]{{0}}) custom-call(%x, %w), '
            'custom_call_target="__cublas$lt$matmul", backend_config={"operation_queue_id":'
            '"0","gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":'
            '["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],'
            '"rhs_batch_dimensions":[]}}}')
    module = ("HloModule m, is_scheduled=true\n\n"
              f"ENTRY %main (x: bf16[{m},{k}], w: bf16[{k},{n}]) -> bf16[1] {{\n"
              f"  %x = bf16[{m},{k}]{{1,0}} parameter(0)\n"
              f"  %w = bf16[{k},{n}]{{1,0}} parameter(1)\n{gemm}\n"
              "  ROOT %r = bf16[1]{0} parameter(2)\n}\n")
    flops_s = 2 * m * n * k / ROOF.flops_rate("bf16")
    nbytes = (m * n * 2 + 4096 + m * k * 2 + k * n * 2) / ROOF.memory_bytes_per_s
    assert flops_s > nbytes  # priced by its FLOPs at these prices
    r = schedule_report(module, ROOF, LINKS)
    assert r.compute_s == pytest.approx(flops_s, rel=1e-12)
    by = compute_by_class(module, ROOF)
    assert by["matmul"] == pytest.approx(flops_s, rel=1e-12) and sum(by.values()) == by["matmul"]


DEMAND_MODULE = """HloModule demand, is_scheduled=true

%fused_slice (p0: f32[24,1024], p1: s32[]) -> bf16[1,64] {
  %p0 = f32[24,1024]{1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %row = f32[1,1024]{1,0} dynamic-slice(%p0, %p1, %zero), dynamic_slice_sizes={1,1024}
  %half = bf16[1,1024]{1,0} convert(%row)
  ROOT %s = bf16[1,64]{1,0} slice(%half), slice={[0:1], [0:64]}
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %sum = f32[] add(%x, %y)
}

%fused_count (q0: f32[24,1024]) -> (f32[1024], f32[1024]) {
  %q0 = f32[24,1024]{1,0} parameter(0)
  %bad = pred[24,1024]{1,0} is-finite(%q0)
  %one = f32[24,1024]{1,0} convert(%bad)
  %a = f32[1,1024]{1,0} slice(%one), slice={[2:3], [0:1024]}
  %b = f32[1,1024]{1,0} slice(%one), slice={[5:6], [0:1024]}
  %ra = f32[1024]{0} bitcast(%a)
  %rb = f32[1024]{0} bitcast(%b)
  ROOT %t = (f32[1024]{0}, f32[1024]{0}) tuple(%ra, %rb)
}

%fused_scatter (s0: f32[4096,64], s1: s32[8,1], s2: f32[8,64]) -> f32[4096,64] {
  %s0 = f32[4096,64]{1,0} parameter(0)
  %s1 = s32[8,1]{1,0} parameter(1)
  %s2 = f32[8,64]{1,0} parameter(2)
  ROOT %sc = f32[4096,64]{1,0} scatter(%s0, %s1, %s2), update_window_dims={1}, inserted_window_dims={0}, scatter_dims_to_operand_dims={0}, index_vector_dim=1, to_apply=%add
}

%fused_reduce (r0: f32[24,1024]) -> f32[24] {
  %r0 = f32[24,1024]{1,0} parameter(0)
  %sq = f32[24,1024]{1,0} multiply(%r0, %r0)
  %z = f32[] constant(0)
  ROOT %red = f32[24]{0} reduce(%sq, %z), dimensions={1}, to_apply=%add
}

ENTRY %main (w: f32[24,1024], i: s32[], table: f32[4096,64], ids: s32[8,1], g: f32[8,64]) -> f32[24] {
  %w = f32[24,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %table = f32[4096,64]{1,0} parameter(2)
  %ids = s32[8,1]{1,0} parameter(3)
  %g = f32[8,64]{1,0} parameter(4)
  %sl = bf16[1,64]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %cnt = (f32[1024]{0}, f32[1024]{0}) fusion(%w), kind=kInput, calls=%fused_count
  %upd = f32[4096,64]{1,0} fusion(%table, %ids, %g), kind=kInput, calls=%fused_scatter
  ROOT %nrm = f32[24]{0} fusion(%w), kind=kInput, calls=%fused_reduce
}
"""


def test_a_fusion_reads_only_the_elements_its_outputs_need():
    """Bytes a fusion reads, by what its outputs need of each operand: a row sliced,
    converted and sliced again reads the last slice (64 of 24 x 1024 elements); two rows
    of a converted array read two rows; a scatter into an operand reads and writes its
    updates alone (in place); a reduce of a squared array reads all of it."""
    from zeropp_jax.measure.schedule import compute_by_instruction

    got = {k: v[1] for k, v in compute_by_instruction(DEMAND_MODULE, ROOF).items()}
    assert got["sl"] == pytest.approx((64 * 4 + 4 + 64 * 2) / 8192, rel=1e-12)
    assert got["cnt"] == pytest.approx((2 * 1024 * 4 + 2 * 1024 * 4) / 8192, rel=1e-12)
    assert got["upd"] == pytest.approx((8 * 4 + 8 * 64 * 4 + 8 * 64 * 4) / 8192, rel=1e-12)
    assert got["nrm"] == pytest.approx((24 * 1024 * 4 + 24 * 4) / 8192, rel=1e-12)


CALIBRATION = pathlib.Path(__file__).parents[2] / "benchmarks" / "results"


@pytest.mark.parametrize("config", ["plain", "zero3", "zeropp", "zeropp_pallas",
                                    "qwz_int4_hadamard"])
def test_no_kernel_of_a_profiled_gpu_step_is_priced_above_its_measured_time(config):
    """The 1.3B's steps profiled on an H200 (``make gpu-calibrate``; the compiled programs
    are fixtures here): a roofline price is a lower bound on a kernel's time, so a price
    well above the measured time is a replay that counts bytes the kernel never moves (as
    it did for asynchronous fusions and for converted-then-sliced operands). Allowed:
    10% above, the datasheet bandwidth against what the profile saw (the worst kernel,
    a 27-output select of the optimizer, is priced at 1.06x its time), and 5 us for the
    smallest kernels' launch-bound times."""
    from benchmarks.gpu_cluster.calibrate import roofline_for
    from zeropp_jax.measure.schedule import compute_by_instruction

    data = json.loads((CALIBRATION / "gpu_calibrate_h200.json").read_text())
    (run,) = [r for r in data["runs"] if r["config"] == config]
    with gzip.open(FIXTURES / f"gpu_calibrate_h200_{config}.hlo.gz", "rt") as f:
        priced = compute_by_instruction(f.read(), roofline_for(data["device"]))
    measured = run["measured_ms_by_op"]
    over = {k: (v[1] * 1e3, measured[k]) for k, v in priced.items()
            if k in measured and v[1] * 1e3 > 1.1 * measured[k] + 5e-3}
    assert not over, over
    # Every kernel priced over 1 us ran under its own name, but the asynchronous fusions
    # (their kernels report the fusion's name before XLA wrapped it).
    unseen = [k for k, v in priced.items() if k not in measured and v[1] > 1e-6
              and not k.startswith("fusion-start")]
    assert not unseen, unseen


def test_the_tracked_calibration_is_priced_by_this_replay():
    """``benchmarks/results/gpu_calibrate_h200.json``'s prices are this checkout's: a change
    to the replay's prices must be followed by ``calibrate --reprice`` (the docs' table
    is rendered from that file)."""
    from benchmarks.gpu_cluster.calibrate import reprice

    data = json.loads((CALIBRATION / "gpu_calibrate_h200.json").read_text())
    again = reprice(json.loads(json.dumps(data)), FIXTURES, "gpu_calibrate_h200", top=15)
    for old, new in zip(data["runs"], again["runs"]):
        for key in ("vs_roofline", "vs_h100_roofline"):
            assert new[key]["priced_ms"] == pytest.approx(old[key]["priced_ms"], rel=1e-9)
            for cls, c in new[key]["by_class"].items():
                assert c["priced_ms"] == pytest.approx(
                    old[key]["by_class"][cls]["priced_ms"], rel=1e-9, abs=1e-12), (key, cls)


def test_class_factors_scale_each_kernel_by_its_class():
    """A roofline with ``class_factors`` (measured over priced, per kernel class) prices
    each kernel at its roofline time times its class's factor; classes it leaves out keep
    factor 1, and the replayed step and overlap follow the scaled kernels."""
    import dataclasses

    from zeropp_jax.measure.schedule import compute_by_class

    factors = {"elementwise": 3.0, "matmul": 1.5}
    scaled = dataclasses.replace(ROOF, class_factors=factors)
    base, got = compute_by_class(MODULE, ROOF), compute_by_class(MODULE, scaled)
    for cls, seconds in base.items():
        assert got[cls] == pytest.approx(factors.get(cls, 1.0) * seconds, rel=1e-12)
    t = _times()
    r = schedule_report(MODULE, scaled, LINKS)
    assert r.compute_s == pytest.approx(sum(got.values()), rel=1e-12)
    # The gather now hides behind 3x the fusion: 1.5 s of wire, 3 * 1 s of fusion.
    (ag,) = r.collectives
    assert ag.exposed_s == pytest.approx(max(0.0, AG_WIRE_S - 3 * t["f"]), abs=1e-12)
