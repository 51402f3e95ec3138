"""The example GPT trained across several processes (one per node) with jax.distributed.

Start one process per node; each simulates ``--local-devices`` CPU devices and they join
through ``jax.distributed`` (coordinator on process 0) with gloo CPU collectives::

    # two nodes on one machine (two shells), 2 devices each: a 2x2 mesh
    python examples/multihost.py --coordinator 127.0.0.1:12355 --num-processes 2 \\
        --process-id 0 --local-devices 2 --mode zeropp --steps 50 --json run.json
    python examples/multihost.py --coordinator 127.0.0.1:12355 --num-processes 2 \\
        --process-id 1 --local-devices 2 --mode zeropp --steps 50

``--coordinator``, ``--num-processes`` and ``--process-id`` default to the environment
variables ZEROPP_COORDINATOR, ZEROPP_NUM_PROCESSES and ZEROPP_PROCESS_ID. The mesh is
``make_mesh()``: nodes = processes, local = devices per process. The model, optimizer and
data are those of ``examples/train_gpt.py``; every process builds the same global batch
from (seed, step) and places only its own devices' rows, so the losses equal a one-process
``train_gpt.py --nodes N --local L`` run. Process 0 prints the summary and writes ``--json``.

``--save DIR`` checkpoints at the end (every process writes its own shards), ``--resume``
continues from the latest checkpoint there (written by any process count or mesh) and
``--stop-after K`` stops after K steps of the ``--steps`` schedule.

Gloo binds to the address this machine's hostname resolves to; on a real cluster that is
the node's address. (``benchmarks/cluster/run.py`` runs each process in a network namespace
whose ``/etc/hosts`` maps the hostname to that namespace's address.)

``--net-iface``, ``--control`` and ``--comm-report`` are the emulated cluster's measuring
hooks: with any of them this script hands the run to the cluster's node worker,
``benchmarks/cluster/node.py``, which describes them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]

MODES = ["zero3", "qwz", "hpz", "qgz", "zeropp"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    g = p.add_argument_group("cluster")
    g.add_argument("--coordinator", default=env("ZEROPP_COORDINATOR"),
                   help="host:port of process 0's coordinator (env ZEROPP_COORDINATOR)")
    g.add_argument("--num-processes", type=int, default=env("ZEROPP_NUM_PROCESSES"),
                   help="number of processes = nodes (env ZEROPP_NUM_PROCESSES)")
    g.add_argument("--process-id", type=int, default=env("ZEROPP_PROCESS_ID"),
                   help="this process's index, 0 .. n-1 (env ZEROPP_PROCESS_ID)")
    g.add_argument("--local-devices", type=int, default=int(env("ZEROPP_LOCAL_DEVICES", "2")),
                   help="simulated CPU devices per process (default 2; env ZEROPP_LOCAL_DEVICES)")
    g.add_argument("--init-timeout", type=int, default=120,
                   help="seconds to wait for all processes to join (default 120)")
    t = p.add_argument_group("training (as in train_gpt.py)")
    t.add_argument("--mode", default="zero3", choices=MODES)
    t.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage")
    t.add_argument("--reduce-scatter", default=None, choices=["flat", "hierarchical"],
                   help="unquantized gradient reduce-scatter (ZeroPPConfig.reduce_scatter); "
                        "default: the config's default")
    t.add_argument("--all-gather", default=None, choices=["flat", "hierarchical"],
                   help="weight all-gathers (ZeroPPConfig.all_gather): hierarchical = over "
                        "nodes first, then inside the node (each remote byte crosses once)")
    t.add_argument("--regather-all", action="store_true",
                   help="ZeroPPConfig(keep_last_unit=False): the last unit regathers its "
                        "weights in backward too (the default keeps them)")
    t.add_argument("--steps", type=int, default=200)
    t.add_argument("--batch", type=int, default=32, help="global batch (split over all devices)")
    t.add_argument("--seq-len", type=int, default=128)
    t.add_argument("--layers", type=int, default=4)
    t.add_argument("--d-model", type=int, default=128)
    t.add_argument("--heads", type=int, default=4)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", type=pathlib.Path, default=None,
                   help="process 0 writes a run summary here")
    t.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    t.add_argument("--save-params", type=pathlib.Path, default=None,
                   help="after training, state.consolidate() (a collective over processes) "
                        "and process 0 saves the full params here (.npz, '/'-joined names)")
    t.add_argument("--save", type=pathlib.Path, default=None,
                   help="after training, zeropp_jax.train.checkpoint.save here: every process "
                        "writes its own shards (a directory all processes see)")
    t.add_argument("--resume", action="store_true",
                   help="start from the latest checkpoint in --save (any process count or "
                        "mesh may have written it) and train up to --steps in all")
    t.add_argument("--stop-after", type=int, default=None,
                   help="stop (and --save) after this many steps of the --steps schedule, "
                        "as if interrupted; --resume continues it")
    b = p.add_argument_group("benchmark hooks (run by benchmarks/cluster/node.py)")
    b.add_argument("--net-iface", default=None,
                   help="count this node's tx/rx bytes on this interface over the timed steps")
    b.add_argument("--control", choices=["none", "stdin"], default="none",
                   help="stdin: after the compiling step, run timed phases read from stdin")
    b.add_argument("--comm-report", action="store_true",
                   help="process 0 adds zeropp_jax.measure.analysis.comm_report's predicted bytes")
    args = p.parse_args(argv)
    missing = [f for f, v in (("--coordinator", args.coordinator),
                              ("--num-processes", args.num_processes),
                              ("--process-id", args.process_id)) if v is None]
    if missing:
        p.error(f"{', '.join(missing)} missing (flags or ZEROPP_COORDINATOR, "
                "ZEROPP_NUM_PROCESSES, ZEROPP_PROCESS_ID)")
    args.num_processes, args.process_id = int(args.num_processes), int(args.process_id)
    if not 0 <= args.process_id < args.num_processes:
        p.error(f"--process-id {args.process_id} is not in 0..{args.num_processes - 1}")
    if args.local_devices < 1:
        p.error("--local-devices must be >= 1")
    return args


def build(args: argparse.Namespace) -> dict:
    """Config, model, initial params, optimizer and data exactly as in train_gpt.py.

    Deterministic in ``args``: every process (and a one-process reference) gets the same.
    """
    import jax
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from zeropp_demo.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split
    from zeropp_demo.gpt import GPT, GPTConfig
    from zeropp_jax.train.optim import lr_schedule

    overrides = {} if args.reduce_scatter is None else {"reduce_scatter": args.reduce_scatter}
    if args.all_gather is not None:
        overrides["all_gather"] = args.all_gather
    if args.regather_all:
        overrides["keep_last_unit"] = False
    if args.stage == 3:
        config = zpp.ZeroPPConfig.from_mode(args.mode, compute_dtype=args.compute_dtype,
                                            **overrides)
    elif args.mode != "zero3":
        sys.exit(f"--mode {args.mode} needs --stage 3 (ZeRO++ techniques extend ZeRO-3)")
    else:
        config = zpp.ZeroPPConfig(stage=args.stage, compute_dtype=args.compute_dtype, **overrides)
    model = GPT(GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, layers=args.layers,
                          d_model=args.d_model, heads=args.heads, dtype=args.compute_dtype))
    data, _ = train_val_split(stdlib_corpus())
    first = sample_batch(data, args.batch, args.seq_len, seed=args.seed, step=0)
    # Runs on this process's first device; the same seed gives every process the same values.
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), first[:, :-1])["params"]
    # train_gpt.py's default schedule, so the single-process run is the reference.
    tx = optax.adamw(lr_schedule(args.lr, args.steps), weight_decay=0.01)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    return {"config": config, "model": model, "params": params, "tx": tx, "data": data,
            "first": first, "n_params": n_params}


def main(argv: list[str] | None = None) -> dict | None:
    args = parse_args(argv)
    if args.net_iface or args.control != "none" or args.comm_report:
        # The benchmark hooks: the cluster's node worker runs them (it takes every flag here).
        sys.path.insert(0, str(ROOT))
        from benchmarks.cluster import node

        return node.run(args)

    # Before JAX touches its backend: this process's CPU devices, gloo CPU collectives, and
    # jax.distributed (waits until all --num-processes processes have joined).
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.local_devices)
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=args.coordinator,
                               num_processes=args.num_processes, process_id=args.process_id,
                               initialization_timeout=args.init_timeout)

    import numpy as np
    from tqdm import tqdm

    from zeropp_demo.data import sample_batch
    from zeropp_demo.gpt import lm_train_step

    lead = jax.process_index() == 0
    mesh = zpp.make_mesh()  # nodes = processes, local = devices per process
    nodes, local = mesh.shape["node"], mesh.shape["local"]
    parts = build(args)
    state = zpp.TrainState.create(model=parts["model"], params=parts["params"], tx=parts["tx"],
                                  mesh=mesh, config=parts["config"])
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

    losses, times = [], []
    bar = tqdm(range(first_step, last), disable=not lead or args.no_progress,
               desc=f"{args.mode} {nodes}x{local}")
    for step in bar:
        # Every process builds the same global batch; the step places its own devices' rows.
        batch = sample_batch(parts["data"], args.batch, args.seq_len, seed=args.seed, step=step)
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["loss"]))  # replicated on every device; blocks until done
        times.append(time.perf_counter() - t0)
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    bar.close()

    # The first step includes compilation; the median of the rest is the step time.
    step_time = statistics.median(times[1:]) if len(times) > 1 else times[0]
    summary = {"mode": args.mode, "stage": args.stage, "nodes": nodes, "local": local,
               "processes": jax.process_count(), "coordinator": args.coordinator,
               "params": parts["n_params"], "compute_dtype": args.compute_dtype,
               "reduce_scatter": parts["config"].reduce_scatter,
               "all_gather": parts["config"].all_gather, "batch": args.batch,
               "seq_len": args.seq_len, "steps": args.steps, "first_step": first_step,
               "losses": losses, "step_time_median_s": step_time,
               "compile_and_first_step_s": times[0]}
    if args.save is not None:
        summary["saved"] = str(zpp.checkpoint.save(args.save, state))  # collective
    if args.save_params is not None:
        full = state.consolidate()  # collective: every process gets the full params
        if lead:
            flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
                    for path, v in jax.tree_util.tree_leaves_with_path(full)}
            args.save_params.parent.mkdir(parents=True, exist_ok=True)
            np.savez(args.save_params, **flat)
    if lead:
        k = max(1, min(10, len(losses) // 5))
        print()
        print(f"zeropp_jax multihost — {args.mode} on {nodes} process(es) x {local} "
              f"device(s), {jax.devices()[0].platform}, gloo collectives")
        print(f"  model      {parts['n_params'] / 1e6:.2f}M params, {args.layers} layers, "
              f"d_model {args.d_model}, {args.heads} heads, seq {args.seq_len}, "
              f"{args.compute_dtype}")
        print(f"  loss       {statistics.mean(losses[:k]):.3f} (first {k} steps) -> "
              f"{statistics.mean(losses[-k:]):.3f} (last {k} steps)")
        print(f"  step time  {step_time * 1e3:.1f} ms median (first step incl. compile "
              f"{times[0]:.1f} s)")
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(summary, indent=1))
            print(f"  wrote      {args.json}")
    jax.distributed.shutdown()
    return summary


if __name__ == "__main__":
    main()
