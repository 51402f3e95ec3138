"""The emulated cluster's node worker: one process per node.

``benchmarks/cluster/run.py`` (the zeropp_jax rows) and ``benchmarks/cluster/checkpoint.py``
start one per node namespace (``ip netns exec``); ``benchmarks/cluster/peers.py`` imports
its model, state, distributed init and stdin protocol, so that every row of a cluster run
trains the same GPT from the same parameters on the same batches.

What it trains: the example GPT (``examples/train_gpt.py``'s model and data, AdamW with
weight decay 0.01 and ``lr_schedule(--lr, --steps)``) with zeropp_jax under
``jax.distributed``: ``--local-devices`` simulated CPU devices per process, gloo CPU
collectives, coordinator on process 0, mesh ``make_mesh()`` (nodes = processes). Every
process builds the same global batch from (seed, step) and places only its own devices'
rows, so the losses equal a one-process ``train_gpt.py --nodes N --local L`` run.
``examples/multihost.py`` is the user-facing version of this run; it hands runs with
``--net-iface``, ``--control`` or ``--comm-report`` to this module (``run``), so the two take
the same flags.

Benchmark hooks:

* ``--control stdin``: after the first (compiling) step each process prints
  ``ZPP-READY {json}``; then every stdin line ``{"steps": k, "warmup": w, "label": ...}``
  runs ``w`` untimed and ``k`` timed steps and each process prints one ``ZPP-PHASE {json}``
  line (``times``, ``losses``, with ``--net-iface`` the bytes between the phase's start and
  end barriers); ``quit`` or end of input stops. ``peers.py`` speaks the same
  protocol.
* ``--net-iface IF``: the bytes this node sends and receives on IF
  (``/sys/class/net/IF/statistics``, in this process's network namespace) over the timed
  steps.
* ``--comm-report``: the cross-node bytes per node that
  ``zeropp_jax.measure.comm_report`` reads from the lowered and the compiled step.

Without ``--control`` it trains up to ``--steps`` (``--stop-after`` stops early,
``--resume`` continues from the latest checkpoint in ``--save``) and process 0 writes the
run's summary to ``--json``; ``checkpoint.py`` runs it that way.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from typing import Any, Iterator

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # benchmarks.common, when run as a script
MODES = ["zero3", "qwz", "hpz", "qgz", "zeropp"]


def add_cluster_arguments(p: argparse.ArgumentParser | Any) -> None:
    """Where this node process stands in the cluster (peers.py takes them too)."""
    p.add_argument("--coordinator", required=True, help="host:port of process 0's coordinator")
    p.add_argument("--num-processes", type=int, required=True, help="processes = nodes")
    p.add_argument("--process-id", type=int, required=True, help="this node, 0 .. n-1")
    p.add_argument("--local-devices", type=int, default=2,
                   help="simulated CPU devices (torch peers: ranks) per node (default 2)")
    p.add_argument("--init-timeout", type=int, default=120,
                   help="seconds to wait for all processes to join (default 120)")


def add_model_arguments(p: argparse.ArgumentParser | Any) -> None:
    """The GPT, its batches and its schedule (peers.py takes them too, so every row
    trains the same)."""
    p.add_argument("--steps", type=int, default=200,
                   help="total steps (the learning-rate schedule's length)")
    p.add_argument("--batch", type=int, default=32, help="global batch (split over all devices)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_cluster_arguments(p.add_argument_group("cluster"))
    t = p.add_argument_group("training")
    t.add_argument("--mode", default="zero3", choices=MODES)
    t.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage")
    t.add_argument("--reduce-scatter", default=None, choices=["flat", "hierarchical"],
                   help="ZeroPPConfig.reduce_scatter (default: the config's)")
    t.add_argument("--all-gather", default=None, choices=["flat", "hierarchical"],
                   help="ZeroPPConfig.all_gather (default: the config's)")
    t.add_argument("--regather-all", action="store_true",
                   help="ZeroPPConfig(keep_last_unit=False)")
    t.add_argument("--unbucketed", action="store_true", help="ZeroPPConfig(bucket=False)")
    t.add_argument("--prefetch", type=int, default=None, help="ZeroPPConfig.prefetch")
    t.add_argument("--hpz-group-size", type=int, default=None,
                   help="ZeroPPConfig.hpz_group_size (devices per hpZ group)")
    add_model_arguments(t)
    r = p.add_argument_group("run without --control")
    r.add_argument("--json", type=pathlib.Path, default=None,
                   help="process 0 writes the run's summary here")
    r.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    r.add_argument("--save", type=pathlib.Path, default=None,
                   help="checkpoint directory: every process saves its own shards at the end")
    r.add_argument("--resume", action="store_true",
                   help="start from the latest checkpoint in --save")
    r.add_argument("--stop-after", type=int, default=None,
                   help="stop (and --save) after this many steps of the --steps schedule")
    r.add_argument("--save-params", type=pathlib.Path, default=None,
                   help="process 0 saves the consolidated params here (.npz)")
    b = p.add_argument_group("benchmark hooks (see above)")
    b.add_argument("--net-iface", default=None,
                   help="count this node's tx/rx bytes on this interface over the timed steps")
    b.add_argument("--control", choices=["none", "stdin"], default="none",
                   help="stdin: after the compiling step, run timed phases read from stdin")
    b.add_argument("--comm-report", action="store_true",
                   help="add comm_report's cross-node bytes of the lowered and compiled step")
    args = p.parse_args(argv)
    if not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id {args.process_id} is not in 0..{args.num_processes - 1}")
    if args.local_devices < 1:
        p.error("--local-devices must be >= 1")
    return args


def commands() -> Iterator[dict]:
    """The protocol's stdin commands (``{"steps": k, ...}`` dicts) until ``quit`` or the end
    of input."""
    for line in sys.stdin:
        line = line.strip()
        if line == "quit":
            return
        if line:
            yield json.loads(line)


def net_counters(iface: str | None) -> tuple[int, int] | None:
    """(tx_bytes, rx_bytes) of ``iface`` in this process's network namespace."""
    if iface is None:
        return None
    base = pathlib.Path("/sys/class/net") / iface / "statistics"
    return int((base / "tx_bytes").read_text()), int((base / "rx_bytes").read_text())


def comm_prediction(lowered: Any, mesh: Any, since: float, *, from_lowered: bool = True) -> dict:
    """``--comm-report``'s entry for a lowered step: the cross-node bytes per node that
    ``comm_report`` reads from the lowered program (None with ``from_lowered=False``: GSPMD
    programs carry their collectives only once compiled) and from the compiled one, and the
    seconds since ``since`` (lowering and compiling). Compiling here fills the cache the
    first step then uses."""
    from zeropp_jax.measure.comm_report import comm_report

    asked = comm_report(lowered, mesh).cross_node_bytes_per_node if from_lowered else None
    moved = comm_report(lowered.compile(), mesh)
    return {"lowered_cross_node_bytes_per_node": asked,
            "compiled_cross_node_bytes_per_node": moved.cross_node_bytes_per_node,
            "compiled_by_kind": moved.by_kind(),
            "compiled_cross_node_collectives": moved.cross_node_collectives,
            "compiled_report": moved.to_json(),
            "lower_and_compile_s": time.perf_counter() - since}


def init_distributed(args: argparse.Namespace) -> None:
    """CPU devices, gloo collectives and jax.distributed, before JAX touches its backend."""
    import jax

    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.local_devices)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
        initialization_timeout=args.init_timeout,
    )


def build(args: argparse.Namespace) -> dict:
    """Config, model, initial params, optimizer and data as in train_gpt.py.

    Deterministic in ``args``: every process (and a one-process reference) gets the same.
    """
    import jax
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from zeropp_demo.data import VOCAB_SIZE
    from zeropp_demo.gpt import GPTConfig
    from benchmarks.common import example_model_and_data
    from zeropp_jax.train.optim import lr_schedule

    overrides = {} if args.reduce_scatter is None else {"reduce_scatter": args.reduce_scatter}
    if args.all_gather is not None:
        overrides["all_gather"] = args.all_gather
    if args.regather_all:
        overrides["keep_last_unit"] = False
    # examples/multihost.py's parser has none of these flags.
    if getattr(args, "unbucketed", False):
        overrides["bucket"] = False
    if getattr(args, "prefetch", None) is not None:
        overrides["prefetch"] = args.prefetch
    if getattr(args, "hpz_group_size", None) is not None:
        overrides["hpz_group_size"] = args.hpz_group_size
    if args.stage == 3:
        config = zpp.ZeroPPConfig.from_mode(args.mode, compute_dtype=args.compute_dtype,
                                            **overrides)
    elif args.mode != "zero3":
        sys.exit(f"--mode {args.mode} needs --stage 3 (ZeRO++ techniques extend ZeRO-3)")
    else:
        config = zpp.ZeroPPConfig(stage=args.stage, compute_dtype=args.compute_dtype, **overrides)
    gpt = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=args.heads, dtype=args.compute_dtype)
    # init runs on this process's first device; the same seed gives every process the same.
    model, params, data, first = example_model_and_data(args.seed, args.batch, gpt)
    # train_gpt.py's default schedule, so the single-process run is the reference.
    tx = optax.adamw(lr_schedule(args.lr, args.steps), weight_decay=0.01)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    return {"config": config, "model": model, "params": params, "tx": tx, "data": data,
            "first": first, "n_params": n_params}


def train_state(parts: dict, mesh: Any) -> Any:
    """``build``'s model, params, optimizer and config as a zeropp_jax TrainState on ``mesh``."""
    import zeropp_jax as zpp

    return zpp.TrainState.create(model=parts["model"], params=parts["params"], tx=parts["tx"],
                                 mesh=mesh, config=parts["config"])


def run(args: argparse.Namespace) -> dict | None:
    """One node's run (``parse_args``'s arguments, or ``examples/multihost.py``'s): the
    summary on process 0 of a run without ``--control``, else None."""
    init_distributed(args)

    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from tqdm import tqdm

    import zeropp_jax as zpp
    from zeropp_demo.data import sample_batch
    from zeropp_demo.gpt import lm_train_step

    lead = jax.process_index() == 0
    mesh = zpp.make_mesh()  # nodes = processes, local = devices per process
    nodes, local = mesh.shape["node"], mesh.shape["local"]
    parts = build(args)
    config, train_data, n_params = parts["config"], parts["data"], parts["n_params"]
    state = train_state(parts, mesh)
    train_step = lm_train_step()
    if args.resume:
        if args.save is None:
            raise SystemExit("--resume needs --save DIR (the checkpoint directory)")
        state = zpp.checkpoint.restore(args.save, state)  # collective: every process
    first_step = int(np.asarray(state.step.addressable_shards[0].data))
    # --steps is the schedule's length; this invocation runs up to --stop-after of it.
    last = args.steps if args.stop_after is None else min(args.stop_after, args.steps)
    if last - first_step < 1:
        raise SystemExit(f"nothing to train: the state is at step {first_step} and this run "
                         f"stops at {last} (--steps/--stop-after)")
    predicted = None
    if args.comm_report:
        t0 = time.perf_counter()
        predicted = comm_prediction(train_step.lower(state, parts["first"]), mesh, t0)

    step_no = first_step  # batches continue where a resumed run left off
    losses: list[float] = []

    def one_step() -> tuple[float, float]:
        nonlocal state, step_no
        batch = sample_batch(train_data, args.batch, args.seq_len, seed=args.seed, step=step_no)
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        loss = float(metrics["loss"])  # replicated on every device; blocks until done
        dt = time.perf_counter() - t0
        step_no += 1
        losses.append(loss)
        return loss, dt

    def phase(steps: int, warmup: int = 0, progress: bool = False) -> dict:
        for _ in range(warmup):
            one_step()
        multihost_utils.sync_global_devices(f"zpp-phase-start-{step_no}")
        c0 = net_counters(args.net_iface)
        times = []
        bar = tqdm(range(steps), disable=not progress, desc=f"{args.mode} {nodes}x{local}")
        for _ in bar:
            loss, dt = one_step()
            times.append(dt)
            bar.set_postfix(loss=f"{loss:.3f}")
        bar.close()
        c1 = net_counters(args.net_iface)
        multihost_utils.sync_global_devices(f"zpp-phase-end-{step_no}")
        out = {"process": jax.process_index(), "steps": steps, "times": times,
               "step_time_median_s": statistics.median(times) if times else None,
               "losses": losses[-steps:] if steps else []}
        if c0 is not None:
            out["iface"] = args.net_iface
            out["tx_bytes"] = c1[0] - c0[0]
            out["rx_bytes"] = c1[1] - c0[1]
        return out

    # Step 0 compiles the step (every process compiles its own copy).
    _, compile_s = one_step()
    info = {"mode": args.mode, "stage": args.stage, "nodes": nodes, "local": local,
            "params": n_params, "compute_dtype": args.compute_dtype,
            "reduce_scatter": config.reduce_scatter, "all_gather": config.all_gather,
            "batch": args.batch, "seq_len": args.seq_len,
            "compile_and_first_step_s": compile_s, "predicted": predicted}

    if args.control == "stdin":
        print("ZPP-READY " + json.dumps({**info, "process": jax.process_index()}), flush=True)
        for cmd in commands():
            result = phase(int(cmd["steps"]), int(cmd.get("warmup", 0)))
            result["label"] = cmd.get("label")
            print("ZPP-PHASE " + json.dumps(result), flush=True)
        jax.distributed.shutdown()
        return None

    timed = phase(last - first_step - 1, progress=lead and not args.no_progress)
    summary = {**info, "steps": args.steps, "first_step": first_step, "losses": losses,
               "step_time_median_s": timed["step_time_median_s"] or compile_s,
               "processes": jax.process_count(), "coordinator": args.coordinator}
    if args.save is not None:
        summary["saved"] = str(zpp.checkpoint.save(args.save, state))  # collective
    if args.save_params is not None:
        full = state.consolidate()  # every process takes part and gets the full params
        if lead:
            flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                    for path, v in jax.tree_util.tree_leaves_with_path(full)}
            args.save_params.parent.mkdir(parents=True, exist_ok=True)
            np.savez(args.save_params, **flat)
    if "tx_bytes" in timed:
        summary["net"] = {"iface": args.net_iface, "timed_steps": last - first_step - 1,
                          "tx_bytes": timed["tx_bytes"], "rx_bytes": timed["rx_bytes"]}
    if lead:
        print(f"node 0 of {nodes}: {args.mode} on {nodes}x{local}, steps {first_step} -> "
              f"{last}, loss {losses[0]:.3f} -> {losses[-1]:.3f}, step time "
              f"{summary['step_time_median_s'] * 1e3:.1f} ms median")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=1))
    jax.distributed.shutdown()
    return summary


def main(argv: list[str] | None = None) -> dict | None:
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
