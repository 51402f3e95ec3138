"""One node process of the generation benchmark on the emulated cluster (or one process alone).

``benchmarks/cluster/generate.py`` starts one per node namespace. Each process simulates
``--local-devices`` CPU devices and joins the others through ``jax.distributed`` (gloo);
the mesh is ``nodes = processes``. It builds the demo GPT (random weights: the time per
token does not depend on them) as a ZeRO-3 train state with ``--mode``'s config and times,
over ``--rounds`` rounds after one compiling run:

* ``kv``: ``zpp.generate`` (KV cache, greedy) of ``--new-tokens`` tokens after each of
  ``--batch`` prompts of ``--prompt-len`` tokens; with hpZ it includes the one
  ``gather_secondary`` per call (timed alone as ``gather``);
* ``cacheless``: the older generator, ``gather_secondary`` then one
  ``decode_step`` per token over the whole fixed-length buffer.

Process 0 also reads, from the compiled one-token programs, the cross-node bytes per
node that each generated token moves (``comm_report``), and writes the JSON (``--json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--coordinator", default=None)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--local-devices", type=int, default=2)
    p.add_argument("--mode", default="zeropp", choices=["zero3", "zeropp"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128, help="the position table's length")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--no-cacheless", action="store_true")
    p.add_argument("--json", type=pathlib.Path, default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.local_devices)
    import jax

    if args.coordinator is not None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=args.coordinator,
                                   num_processes=args.num_processes,
                                   process_id=args.process_id, initialization_timeout=120)
    import numpy as np
    import optax

    from zeropp_demo.gpt import GPT, GPTConfig
    from zeropp_jax.inference.generate import (decode_step, gather_secondary,
                                               lower_decode_step, lower_generation_step)
    from zeropp_jax.measure.analysis import comm_report

    mesh = zpp.make_mesh()
    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=args.heads, dtype=args.compute_dtype)
    model, twin = GPT(cfg), GPT(dataclasses.replace(cfg, decode=True))
    params = model.init(jax.random.PRNGKey(0), np.zeros((1, args.seq_len), np.int32))["params"]
    zeropp = args.mode == "zeropp"
    config = zpp.ZeroPPConfig(compute_dtype=args.compute_dtype, qwz=zeropp, hpz=zeropp,
                              qgz=zeropp)
    state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.0), mesh=mesh,
                                  config=config)
    prompts = np.random.default_rng(1).integers(0, 256, (args.batch, args.prompt_len)
                                                ).astype(np.int32)
    length = args.prompt_len + args.new_tokens

    def kv() -> float:
        t = time.perf_counter()
        zpp.generate(state, prompts, args.new_tokens, model=twin).block_until_ready()
        return time.perf_counter() - t

    def gather() -> float:
        t = time.perf_counter()
        jax.block_until_ready(gather_secondary(state))
        return time.perf_counter() - t

    buffer = np.zeros((args.batch, length), np.int32)
    buffer[:, :args.prompt_len] = prompts
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(("node", "local")))

    def cacheless() -> float:
        t = time.perf_counter()
        secondary = gather_secondary(state)
        buf = jax.make_array_from_process_local_data(sharded, buffer, buffer.shape)
        for pos in range(args.prompt_len, length):
            buf = decode_step(state, secondary, buf, pos)
        buf.block_until_ready()
        return time.perf_counter() - t

    timers = {"kv": kv, "gather": gather}
    if not args.no_cacheless:
        timers["cacheless"] = cacheless
    for name, fn in timers.items():  # compile
        print(f"{name}: first call {fn():.2f} s", file=sys.stderr, flush=True)
    times: dict[str, list[float]] = {k: [] for k in timers}
    for r in range(args.rounds):
        for name, fn in timers.items():
            times[name].append(fn())
            print(f"round {r} {name}: {times[name][-1]:.3f} s", file=sys.stderr, flush=True)
    out: dict = {"mode": args.mode, "mesh": dict(mesh.shape), "processes": jax.process_count(),
                 "batch": args.batch, "prompt_len": args.prompt_len,
                 "new_tokens": args.new_tokens, "compute_dtype": args.compute_dtype,
                 "params": int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params))),
                 "times_s": times,
                 "tokens_per_s": {k: args.batch * args.new_tokens / float(np.median(v))
                                  for k, v in times.items() if k != "gather"}}
    # Every process lowers the same programs (gather_secondary runs a collective: all of
    # them call it); process 0 reports.
    secondary = gather_secondary(state)
    step = comm_report(lower_generation_step(state, prompts, args.new_tokens, model=twin), mesh)
    old = comm_report(lower_decode_step(state, secondary, buffer, args.prompt_len), mesh)
    once = comm_report(gather_secondary.lower(state), mesh)
    if jax.process_index() == 0:
        out["cross_node_bytes_per_node"] = {
            "kv_token": step.cross_node_bytes / mesh.shape["node"],
            "cacheless_token": old.cross_node_bytes / mesh.shape["node"],
            "secondary_gather": once.cross_node_bytes / mesh.shape["node"]}
        if args.json is not None:
            args.json.write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps(out))
    if args.coordinator is not None:
        jax.distributed.shutdown()
    return out


if __name__ == "__main__":
    main()
