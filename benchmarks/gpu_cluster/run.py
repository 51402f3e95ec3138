"""ZeRO-3 and ZeRO++ on a GPU cluster, compiled for it from this host: the real multi-node
program of a Llama-shaped model, its memory, and how much of its communication the
compiled schedule hides.

    make gpu-cluster                          # everything, about 45 minutes
    python -m benchmarks.gpu_cluster.run --models 1.3B --meshes 2x8 --configs zero3
    python -m benchmarks.gpu_cluster.run --update --out benchmarks/results ...  # replace those rows only

Needs JAX's CUDA plugin (``pip install 'jax[cuda12]'`` matching the installed jax), not a
GPU: each program is compiled by XLA's GPU compiler for an H100 SXM cluster of ``nodes x 8``
devices (``compat.gpu_cluster_devices``; one process per node, NCCL collectives), from an
abstract train state (``TrainState.create`` on ``jax.eval_shape`` params), so nothing is
allocated. For every model, mesh, config and set of XLA flags it reports:

* memory: the compiled program's per-device bytes (arguments + outputs + temporaries -
  aliased, the state donated) against the planner's memory model
  (``plan.workload.memory_breakdown``), target within 10%;
* overlap: the scheduled program replayed on two streams (``measure.schedule``; kernels at
  roofline prices, collectives at NVLink 450 GB/s inside a node and 400 or 100 Gbit/s per
  GPU across nodes): the share of the cross-node collectives' wire time hidden behind
  compute, target >= 90% for the 7B at 16x8 and 400 Gbit/s;
* the step's roofline compute and replayed time (not a measurement: no GPU ran);
* per unit and role (gather, regather, gradient), inside and across nodes, the wire time
  and how much of it the compute stream waited for (``units_400g``);
* the compute stream's priced time by kernel class (``compute_by_class_ms``:
  ``measure.schedule.compute_by_class``; matmul, attention, elementwise, optimizer and the
  step's bookkeeping, quantize/dequantize/Hadamard, copies and layout changes);
* the same replay with each kernel class at the time a GPU measured for it (``*_calibrated``:
  ``make gpu-calibrate``'s measured over priced ratios, ``--calibration``; the H200's run
  of the matching config, the peer taking the plain step's): compute, step, hidden share
  and MFU as such a GPU would run the kernels, an estimate where the roofline is a bound;
* whether XLA's collective pipeliner ran (``collective_pipeliner_ran``: a collective of the
  compiled program carries ``"is_pipelined":true`` in its backend config; and how many,
  ``pipelined_collectives``), so a JAX version that accepts the pipelining flags and ignores
  them shows up as a row, not as a slower step.

Beside our configs, the peer a JAX user would run instead (config ``gspmd_fsdp``): the same
Llama under a plain ``jax.jit`` step whose parameters and AdamW state are sharded over all
devices by ``NamedSharding`` (GSPMD FSDP, as MaxText does it: each weight split over the
data axes along one dimension, the layer axis of the scanned stack never split), bf16
compute on fp32 master weights cast before use, compiled and replayed the same way. It has
no planner memory model (``memory_predicted_bytes`` null).

Writes ``gpu_cluster_<device>.json`` (``--out``): ``{"device", "rows": [{"model", "mesh",
"config", "flags", "hidden_fraction_400g", "memory_compiled_bytes",
"memory_predicted_bytes", "compute_ratio_vs_plain", "collective_pipeliner_ran", ...}]}``.
``compute_ratio_vs_plain`` (1.3B rows): the row's priced compute over that of a plain
``jax.jit`` step of the same model, one sequence, on one H100 (``plain_compute_ms``: the
peer's step compiled for a single device, so no collective; same replay), null elsewhere.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pathlib
import sys
import time

# The CUDA plugin must not look for a driver on a host without one; the programs are
# compiled for the cluster's devices, never run here.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.cli import add_out_argument, write_json  # noqa: E402
from zeropp_jax.core.mesh import MeshInfo  # noqa: E402
from zeropp_jax.core.gpu_flags import gpu_overlap_flags  # noqa: E402

SEQ = 2048  # tokens per GPU: one sequence per device

# XLA flags (per compile: ``Lowered.compile(compiler_options)``), by name.
# "pipelined": what ``zpp.gpu_overlap_flags()`` sets (each scanned layer's all-gather moves
# into the previous iteration and its gradient's reduce-scatter into the next: the next
# layer's weights arrive while this one computes; each loop unrolled by two, so the
# buffers carried across iterations alternate; every collective started as early as its
# input allows, three in flight in the schedule); "pipelined_single_buffer": the same
# without the unrolling, where XLA copies those buffers every iteration;
# "pipeliner_scheduler_default": the pipeliner and the unrolling with XLA's default
# scheduling (collectives started late, one at a time).
_DOUBLE_BUFFER = "xla_gpu_enable_while_loop_double_buffering"
_SCHEDULER = ("xla_gpu_experimental_collective_start_as_early_as_possible",
              "xla_gpu_experimental_parallel_collective_overlap_limit")
FLAG_SETS = ("default", "pipelined", "pipelined_single_buffer", "pipeliner_scheduler_default")


def flag_set(name: str) -> dict:
    """The compile options of flag set ``name`` (``FLAG_SETS``), spelt as this jaxlib takes
    them (``zpp.gpu_overlap_flags()`` asks it on first use, starting JAX's backends)."""
    overlap = gpu_overlap_flags()
    return {"default": {},
            "pipelined": overlap,
            "pipelined_single_buffer": {k: v for k, v in overlap.items()
                                        if k != _DOUBLE_BUFFER},
            "pipeliner_scheduler_default": {k: v for k, v in overlap.items()
                                            if k not in _SCHEDULER}}[name]


# The grid's flag sets; the last above only for the 7B at 16x8 (experiment "scheduler").
GRID_FLAGS = ["default", "pipelined", "pipelined_single_buffer"]


def configs() -> dict:
    import zeropp_jax as zpp

    return {
        "zero3": zpp.ZeroPPConfig.zero3(),
        "zeropp": zpp.ZeroPPConfig.zeropp(),
        "qwz_int4_hadamard": zpp.ZeroPPConfig(qwz=True, weight_format="int4",
                                              qwz_hadamard=True),
        "fp8_weights": zpp.ZeroPPConfig(qwz=True, weight_format="fp8"),
        # Activation checkpointing (each block keeps its input alone): the largest models.
        "zero3_remat_full": zpp.ZeroPPConfig.zero3(remat="full"),
        "zeropp_remat_full": zpp.ZeroPPConfig.zeropp(remat="full"),
        # ZeRO++ without qgZ: INT8 weight gathers and hpZ's regather inside the node, the
        # gradient reduce-scattered unquantized (which XLA's pipeliner can move).
        "qwz_hpz": zpp.ZeroPPConfig(qwz=True, hpz=True),
        # ZeRO++ with only qgZ's cross-node hop quantized (16-bit inside the node).
        "zeropp_cross": zpp.ZeroPPConfig.zeropp(qgz_hops="cross"),
        # ZeRO++ with every quantization in the Pallas kernels, where a GPU's default
        # (``quantization_impl=None``) uses XLA's fusions without a Hadamard rotation.
        "zeropp_pallas": zpp.ZeroPPConfig.zeropp(quantization_impl="pallas"),
        # ZeRO++ with each scanned layer's qgZ reduction deferred into the next layer's
        # backward, where its all-to-alls run beside that layer's compute.
        "zeropp_defer": zpp.ZeroPPConfig.zeropp(qgz_defer=True),
    }


PEER = "gspmd_fsdp"  # a plain jax.jit step, state sharded by NamedSharding (no ZeroPPConfig)


def _fsdp_spec(shape: tuple, num: int, stacked: bool):
    """GSPMD FSDP's split of one array: the largest dimension divisible by the ``num``
    devices over both data axes (the first, a scanned stack's layer axis, never), else
    replicated (a norm's scale)."""
    from jax.sharding import PartitionSpec as P

    from zeropp_jax.core.mesh import AXES

    dims = [i for i in range(1 if stacked else 0, len(shape)) if shape[i] % num == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda i: shape[i])
    return P(*[AXES if i == best else None for i in range(len(shape))])


def compile_gspmd_step(shape, nodes: int, local: int, options: dict, seq: int = SEQ,
                       scan: bool = True):
    """``(compiled, None, seconds)``: the peer's donated train step (``PEER``): the Llama
    under ``jax.jit`` with its fp32 parameters and AdamW state split over all devices
    (``_fsdp_spec``), the parameters cast to bf16 before the forward (so XLA gathers 16-bit
    weights), the batch split over all devices; XLA's SPMD partitioner places every
    collective."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.gpu_cluster.llama import Llama
    from benchmarks.gpu_cluster.steps import plain_step
    from benchmarks.gpu_cluster.target import cluster_mesh
    from zeropp_jax.core.mesh import AXES

    mesh = cluster_mesh(nodes, local)
    num = nodes * local
    batch_split = NamedSharding(mesh, P(AXES))
    model = Llama(shape, scan=scan,
                  constrain=lambda x: jax.lax.with_sharding_constraint(x, batch_split))
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                            jnp.zeros((1, seq), jnp.int32))["params"]
    tx = optax.adamw(3e-4)

    def sharded(tree):
        def one(path, x):
            stacked = scan and any(getattr(k, "key", None) == "layers" for k in path)
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(
                mesh, _fsdp_spec(x.shape, num, stacked and x.ndim > 1)))
        return jax.tree_util.tree_map_with_path(one, tree)

    params = sharded(params)
    opt_state = sharded(jax.eval_shape(tx.init, params))

    step = plain_step(model, tx)
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, (params, opt_state))
    batch = jax.ShapeDtypeStruct((num, seq + 1), jnp.int32, sharding=batch_split)
    jitted = jax.jit(step, donate_argnums=(0, 1),
                     out_shardings=(*shardings, NamedSharding(mesh, P())))
    start = time.perf_counter()
    compiled = jitted.lower(params, opt_state, batch).compile(options)
    return compiled, None, time.perf_counter() - start


@functools.lru_cache(maxsize=None)
def plain_compute_ms(model: str, scan: bool) -> float:
    """Priced compute (ms) of a plain ``jax.jit`` train step of ``model`` on one H100, one
    ``SEQ``-token sequence: the peer's step (``compile_gspmd_step``) on a 1 x 1 mesh, where
    nothing is split and nothing communicated; the replay's roofline prices."""
    from benchmarks.gpu_cluster.llama import SHAPES
    from benchmarks.gpu_cluster.target import H100_ROOFLINE, links
    from zeropp_jax.measure.schedule import schedule_report

    compiled, _, _ = compile_gspmd_step(SHAPES[model], 1, 1, {}, scan=scan)
    return schedule_report(compiled.as_text(), H100_ROOFLINE, links(1, 1, 400)).compute_s * 1e3


PLAIN_MODELS = ("1.3B",)  # the rows that get compute_ratio_vs_plain


def pipelined_collectives(text: str) -> int:
    """How many collectives of a compiled GPU program XLA's collective pipeliner moved
    across loop iterations (``"is_pipelined":true`` in their backend config)."""
    return text.count('"is_pipelined":true')


def compile_step(shape, nodes: int, local: int, config, options: dict, seq: int = SEQ,
                 scan: bool = True):
    """``(compiled, state, seconds)``: the donated train step of ``shape`` with ``config``
    on a ``nodes x local`` H100 cluster, one sequence of ``seq`` tokens per device."""
    import jax
    import jax.numpy as jnp
    import optax

    import zeropp_jax as zpp
    from benchmarks.gpu_cluster.llama import Llama
    from benchmarks.gpu_cluster.steps import zero_step
    from benchmarks.gpu_cluster.target import cluster_mesh
    from zeropp_jax.quant.quantization import compiled_kernels

    model = Llama(shape, scan=scan)
    params = jax.eval_shape(model.init, jax.random.PRNGKey(0),
                            jnp.zeros((1, seq), jnp.int32))["params"]
    # The kernels a GPU user gets: compiled_kernels() resolves ``quantization_impl=None``
    # as a GPU does (``quant.quantization.default_implementation``: the Pallas kernels for
    # Hadamard-rotated blocks, XLA's fusions otherwise) and traces Pallas kernels for the
    # GPU rather than for Pallas' interpreter.
    with compiled_kernels():
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adamw(3e-4),
                                      mesh=cluster_mesh(nodes, local), config=config)
        step = zero_step()
        batch = jax.ShapeDtypeStruct((nodes * local, seq + 1), jnp.int32)
        start = time.perf_counter()
        compiled = step.lower(state, batch).compile(options)
    return compiled, state, time.perf_counter() - start


def predicted_memory(shape, config, nodes: int, local: int, scanned: bool = True) -> float:
    """The planner's peak bytes per device for this step (``memory_breakdown``)."""
    from benchmarks.gpu_cluster.llama import ATTENTION
    from zeropp_jax.plan.workload import memory_breakdown, transformer_shape

    model = transformer_shape(shape.layers, shape.d_model, shape.vocab, SEQ, ffn=shape.ffn,
                              heads=shape.heads, kv_heads=shape.kv_heads, gated=True,
                              scanned=scanned, fused_attention=ATTENTION is not None)
    return memory_breakdown(config, model, MeshInfo(nodes, local), SEQ, backend="gpu",
                            batch_bytes_per_device=(SEQ + 1) * 4).total


CALIBRATION = pathlib.Path(__file__).resolve().parents[1] / "results" / "gpu_calibrate_h200.json"


def class_factors(calibration: dict | None, config: str) -> tuple[str, dict[str, float]]:
    """``(run, factors)``: measured over priced kernel time by class (``make
    gpu-calibrate``'s ``by_class`` ratios) of the calibration run that matches ``config``
    (the same config; the peer takes the plain ``jax.jit`` step; a config with quantized
    weights or gradients ZeRO++'s, any other ZeRO-3's), a class without a measurement
    keeping 1."""
    runs = {r["config"]: r for r in (calibration or {}).get("runs", []) if "error" not in r}
    if config == PEER:
        name = "plain"
    elif config in runs:
        name = config
    else:
        c = configs()[config]
        name = "zeropp" if (c.qwz and c.weight_format == "int8") or c.qgz else "zero3"
    if name not in runs:
        return "", {}
    by_class = runs[name]["vs_roofline"]["by_class"]
    return name, {c: v["ratio"] for c, v in by_class.items() if v.get("ratio")}


def measure(model: str, mesh: str, config: str, flags: str, hlo_dir: pathlib.Path | None,
            experiment: str = "grid", scan: bool = True,
            calibration: dict | None = None) -> dict:
    from benchmarks.gpu_cluster.llama import SHAPES
    from benchmarks.gpu_cluster.target import H100_ROOFLINE, MEMORY_BYTES, links
    from zeropp_jax.measure.schedule import compute_by_class, schedule_report

    nodes, local = map(int, mesh.split("x"))
    shape = SHAPES[model]
    if config == PEER:
        compiled, _, seconds = compile_gspmd_step(shape, nodes, local, flag_set(flags),
                                                     scan=scan)
    else:
        compiled, _, seconds = compile_step(shape, nodes, local, configs()[config],
                                            flag_set(flags), scan=scan)
    text = compiled.as_text()
    layers = "scan" if scan else "unrolled"
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{model}_{mesh}_{config}_{flags}_{layers}.hlo").write_text(text)
    m = compiled.memory_analysis()
    used = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)
    predicted = (None if config == PEER else
                 predicted_memory(shape, configs()[config], nodes, local, scanned=scan))
    pipelined = pipelined_collectives(text)
    row = {"experiment": experiment, "model": model, "mesh": mesh, "config": config,
           "flags": flags, "layers": layers, "params": shape.params,
           "compile_s": round(seconds, 2),
           "memory_compiled_bytes": int(used),
           "memory_predicted_bytes": None if predicted is None else int(predicted),
           "memory_error": None if predicted is None else (predicted - used) / used,
           "fits_80gb": used <= MEMORY_BYTES,
           "argument_bytes": int(m.argument_size_in_bytes),
           "temp_bytes": int(m.temp_size_in_bytes),
           "collective_pipeliner_ran": pipelined > 0, "pipelined_collectives": pipelined,
           "compile_options": flag_set(flags),
           "compute_by_class_ms": {k: v * 1e3 for k, v in
                                   compute_by_class(text, H100_ROOFLINE).items()}}
    for gbit in (400, 100):
        r = schedule_report(text, H100_ROOFLINE, links(nodes, local, gbit))
        row[f"hidden_fraction_{gbit}g"] = r.hidden_fraction(spans_nodes=True)
        row[f"hidden_fraction_all_{gbit}g"] = r.hidden_fraction()
        row[f"wire_ms_{gbit}g"] = r.wire_s() * 1e3
        row[f"exposed_ms_{gbit}g"] = r.exposed_s() * 1e3
        row[f"step_ms_{gbit}g"] = r.step_s * 1e3
        row["compute_ms"] = r.compute_s * 1e3
        row["compute_ratio_vs_plain"] = (row["compute_ms"] / plain_compute_ms(model, scan)
                                         if model in PLAIN_MODELS else None)
        row[f"mfu_roofline_{gbit}g"] = (SEQ / r.step_s * shape.train_flops_per_token(SEQ)
                                        / H100_ROOFLINE.flops_rate("bf16"))
        source, factors = class_factors(calibration, config)
        if factors:
            # The same replay with every kernel at the time a GPU measured for its class.
            slow = schedule_report(text, dataclasses.replace(H100_ROOFLINE,
                                                             class_factors=factors),
                                   links(nodes, local, gbit))
            row["calibration"] = {"run": source, "factors": factors,
                                  "device": calibration["device"]}
            row["compute_ms_calibrated"] = slow.compute_s * 1e3
            row[f"step_ms_{gbit}g_calibrated"] = slow.step_s * 1e3
            row[f"hidden_fraction_{gbit}g_calibrated"] = slow.hidden_fraction(spans_nodes=True)
            row[f"mfu_{gbit}g_calibrated"] = (SEQ / slow.step_s
                                              * shape.train_flops_per_token(SEQ)
                                              / H100_ROOFLINE.flops_rate("bf16"))
        if gbit == 400:
            # Each unit's gathers, regathers and gradient reductions: wire and exposed time.
            row["units_400g"] = [
                {"unit": u.unit, "role": u.role, "spans_nodes": u.spans_nodes,
                 "runs": u.runs, "wire_ms": u.wire_s * 1e3, "exposed_ms": u.exposed_s * 1e3}
                for u in r.by_unit()]
    return row


def table(rows: list[dict]) -> str:
    head = (f"{'model':<5} {'mesh':<5} {'config':<18} {'flags':<24} {'layers':<8} "
            f"{'memory GB':>9} {'model GB':>8} {'err':>6} {'hidden 400G':>11} "
            f"{'hidden 100G':>11} {'step ms 400G':>12} {'compute ms':>10}")
    lines = [head]
    for r in rows:
        def pct(v):
            return "-" if v is None else f"{v:.1%}"
        predicted = ("-" if r["memory_predicted_bytes"] is None
                     else f"{r['memory_predicted_bytes'] / 1e9:.2f}")
        err = "-" if r["memory_error"] is None else f"{r['memory_error']:+.1%}"
        lines.append(
            f"{r['model']:<5} {r['mesh']:<5} {r['config']:<18} {r['flags']:<24} "
            f"{r['layers']:<8} {r['memory_compiled_bytes'] / 1e9:9.2f} "
            f"{predicted:>8} {err:>6} "
            f"{pct(r['hidden_fraction_400g']):>11} {pct(r['hidden_fraction_100g']):>11} "
            f"{r['step_ms_400g']:12.1f} {r['compute_ms']:10.1f}")
    return "\n".join(lines)


def plan(args: argparse.Namespace) -> list[tuple]:
    """The rows to measure: ``(model, mesh, config, flags, experiment, scan)``."""
    rows = []
    if "grid" in args.experiments:
        rows += [(model, mesh, config, flags, "grid", True) for model in args.models
                 for mesh in args.meshes for config in args.configs for flags in args.flags]
    if "unrolled" in args.experiments:
        # The same 7B at 16x8 with its blocks unrolled: no loop, so the pipeliner has
        # nothing to move; the engine's gather order and XLA's scheduler decide (default
        # scheduling, and the scheduler options of the pipelined set).
        rows += [("7B", "16x8", config, flags, "unrolled", False)
                 for config in ("zero3", "zeropp", PEER) for flags in ("default", "pipelined")]
    if "scheduler" in args.experiments:
        # The scanned 7B at 16x8 with XLA's default scheduling beside the pipeliner: what
        # the scheduler flags of ``zpp.gpu_overlap_flags()`` change.
        rows += [("7B", "16x8", config, "pipeliner_scheduler_default", "grid", True)
                 for config in args.configs]
    if "largest" in args.experiments:
        # The largest Llama shapes at 16x8 against 80 GB per H100: the default remat, and
        # activation checkpointing, which big models train with.
        rows += [(model, "16x8", config, "pipelined", "largest", True)
                 for model in ("13B", "34B", "70B", "405B")
                 for config in ("zero3", "zeropp", "zero3_remat_full", "zeropp_remat_full")
                 if not (model == "13B" and config.endswith("full"))]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["1.3B", "7B"])
    p.add_argument("--meshes", nargs="+", default=["2x8", "4x8", "16x8"])
    p.add_argument("--configs", nargs="+", default=[*configs(), PEER])
    p.add_argument("--flags", nargs="+", default=GRID_FLAGS, choices=list(FLAG_SETS))
    p.add_argument("--experiments", nargs="+",
                   default=["grid", "unrolled", "largest", "scheduler"],
                   choices=["grid", "unrolled", "largest", "scheduler"],
                   help="the grid (models x meshes x configs x flags), the 7B at 16x8 with "
                        "unrolled blocks, the largest models at 16x8, the scanned 7B at "
                        "16x8 with XLA's default scheduling")
    p.add_argument("--update", action="store_true",
                   help="replace only the rows measured now in the JSON already in --out "
                        "(same experiment, model, mesh, config, flags and layers), keeping "
                        "the others")
    p.add_argument("--hlo-dir", type=pathlib.Path, default=None,
                   help="also write each compiled program's HLO text here")
    p.add_argument("--calibration", type=pathlib.Path, default=CALIBRATION,
                   help="make gpu-calibrate's JSON: each row is also replayed with every "
                        "kernel class at the time that GPU measured for it (*_calibrated "
                        "keys); 'none' to skip")
    p.add_argument("--name", default="gpu_cluster_h100.json",
                   help="the JSON's file name in --out (another name keeps a run on another "
                        "JAX version beside the tracked one)")
    add_out_argument(p)
    args = p.parse_args()
    import importlib.metadata

    import jax

    from benchmarks.gpu_cluster.target import DEVICE

    calibration = (json.loads(args.calibration.read_text())
                   if str(args.calibration) != "none" else None)
    rows = []
    for model, mesh, config, flags, experiment, scan in plan(args):
        rows.append(measure(model, mesh, config, flags, args.hlo_dir, experiment, scan,
                            calibration))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(table(rows))
    path = args.out / args.name
    if args.update and path.exists():
        rows = updated(json.loads(path.read_text())["rows"], rows)
    # The compiler's version: which XLA options exist and what they do change with it.
    write_json(args.out, args.name, {"device": DEVICE, "seq_len": SEQ,
                                     "jax": jax.__version__,
                                     "jaxlib": importlib.metadata.version("jaxlib"),
                                     "rows": rows})


def _row_key(r: dict) -> tuple:
    return (r["experiment"], r["model"], r["mesh"], r["config"], r["flags"], r["layers"])


def updated(old: list[dict], new: list[dict]) -> list[dict]:
    """``old`` with each row that ``new`` measured again replaced in place, and ``new``'s
    other rows after them (``--update``)."""
    fresh = {_row_key(r): r for r in new}
    out = [fresh.pop(_row_key(r), r) for r in old]
    return out + [r for r in new if _row_key(r) in fresh]


if __name__ == "__main__":
    main()
