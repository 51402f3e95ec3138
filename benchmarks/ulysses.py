"""Ulysses sequence parallelism with ZeRO-3: all-to-all bytes, longest sequence, step time.

    python benchmarks/ulysses.py --nodes 2 --local 4            # about 3 minutes

The GPT runs with ``sequence_axis="local"`` (sequence over a node's ``P = local`` devices,
batch over nodes) under ZeRO-3 (bf16 compute), against the same model without sequence
parallelism (batch over all devices).

(a) The lowered train step's all-to-alls, from ``comm_report``: count, per-device bytes per
    attention layer in forward, and bytes crossing nodes, against Ulysses' ``4 N h / P``
    (``N`` tokens per node's batch, ``h`` hidden size). The compiled program is reported
    too (what XLA's CPU backend actually moves).
(b) The longest sequence whose compiled train step fits ``--budget-mib`` per device
    (``memory_analysis``: arguments + outputs + temporaries - aliased), found by bisection
    over multiples of ``--granule`` tokens: without SP a device holds one whole sequence;
    with SP each node's ``P`` devices share one. Then the step time of both at one length
    with the same global batch (same tokens and FLOPs per device), and their ratio.
Writes ``OUT/ulysses.json`` (``--out``, default the git-ignored ``benchmarks/out/``).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, simulate_mesh_devices, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = mesh_parser(__doc__, local_help="P: sequence-parallel degree")
    p.add_argument("--batch", type=int, default=8, help="global batch for (a) and timing")
    p.add_argument("--seq", type=int, default=512, help="sequence length for (a)")
    p.add_argument("--budget-mib", type=float, default=512.0, help="per-device memory budget")
    p.add_argument("--granule", type=int, default=128, help="sequence-length step of (b)")
    p.add_argument("--max-seq", type=int, default=16384, help="largest length (b) tries")
    p.add_argument("--time-seq", type=int, default=1024, help="sequence length of timing")
    p.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    simulate_mesh_devices(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import PartitionSpec as P

    import zeropp_jax as zpp
    from zeropp_jax.measure.analysis import comm_report
    from zeropp_demo.gpt import GPT, GPTConfig, loss_fn
    from zeropp_jax.parallel.ulysses import all_to_all_bytes_per_layer

    nodes, sp = args.nodes, args.local
    mesh = zpp.make_mesh(nodes, sp)
    # heads = 8: divisible by P = 2, 4 or 8. The position table holds the longest length (b)
    # tries, so the parameters (and their memory) are the same at every length.
    base = GPTConfig(vocab_size=256, seq_len=args.max_seq, layers=4, d_model=128, heads=8)
    params = jax.jit(GPT(base).init)(jax.random.PRNGKey(0), jnp.zeros((1, 8), jnp.int32))
    params = params["params"]
    config = zpp.ZeroPPConfig.zero3()
    # The all-to-alls carry activations, in the model's dtype (the example's float32; ZeRO's
    # bf16 compute dtype is that of the gathered weights).
    itemsize = np.dtype(base.dtype).itemsize

    def make(seq_par: bool):
        cfg = dataclasses.replace(base, sequence_axis="local" if seq_par else None)
        state = zpp.TrainState.create(model=GPT(cfg), params=params, tx=optax.adam(1e-3),
                                      mesh=mesh, config=config)

        @zpp.train_step(batch_spec=P("node", "local") if seq_par else P(("node", "local")))
        def step(state, batch):
            def loss_of(p):
                return loss_fn(state.apply_fn({"params": p}, batch["x"]), batch["y"])

            loss, grads = jax.value_and_grad(loss_of)(state.params)
            return state.apply_gradients(grads=grads), {"loss": loss}

        return state, step

    def batch_of(b: int, t: int, seed: int = 0) -> dict:
        toks = np.random.default_rng(seed).integers(0, base.vocab_size, (b, t + 1))
        toks = toks.astype(np.int32)
        return {"x": toks[:, :-1], "y": toks[:, 1:]}

    results: dict = {"nodes": nodes, "local": sp, "model": dataclasses.asdict(base),
                     "compute_dtype": config.compute_dtype, "activation_dtype": base.dtype}

    # -- (a) all-to-all bytes ---------------------------------------------------------------
    state, step = make(True)
    batch = batch_of(args.batch, args.seq)
    lowered = step.lower(state, batch)
    rows = {}
    for what, program in (("lowered", lowered), ("compiled", lowered.compile())):
        a2a = [r for r in comm_report(program, mesh).rows if r.kind == "all-to-all"]
        count = sum(r.count for r in a2a)
        total = sum(r.bytes * r.count for r in a2a)  # per device, whole step
        rows[what] = {"count": count, "dtypes": sorted({r.dtype for r in a2a}),
                      "bytes_per_device": total,
                      "intra_node_bytes_per_device": sum(r.intra_node_bytes * r.count
                                                         for r in a2a) / (nodes * sp),
                      "cross_node_bytes": sum(r.cross_node_bytes * r.count for r in a2a)}
    # Forward, per layer: the lowered step runs each layer's pair (q,k,v; output) in forward
    # and as transposes in backward, all of the same sizes: 2 passes of 2. remat="full"
    # would add backward's recomputation (3 passes).
    n_tokens = args.batch // nodes * args.seq
    model = all_to_all_bytes_per_layer(args.batch // nodes, args.seq, base.d_model, sp, itemsize)
    low = rows["lowered"]
    passes = low["count"] / (2 * base.layers)
    results["all_to_all_passes_per_layer"] = passes
    per_layer = low["bytes_per_device"] / (passes * base.layers)
    sent_per_layer = low["intra_node_bytes_per_device"] / (passes * base.layers)
    results["all_to_all"] = {
        "batch": args.batch, "seq": args.seq, "tokens_per_node": n_tokens,
        "hidden": base.d_model, "sp": sp, "itemsize": itemsize,
        "model_4Nh_over_P_bytes": model["result_bytes"],
        "model_sent_bytes": model["sent_bytes"],
        "measured_fwd_bytes_per_layer_per_device": per_layer,
        "measured_fwd_sent_bytes_per_layer_per_device": sent_per_layer,
        "per_step": rows,
    }
    print(f"(a) all-to-alls of one ZeRO-3 + Ulysses train step: GPT {base.layers} layers, "
          f"h = {base.d_model}, {args.batch} x {args.seq} tokens, {nodes} nodes x P = {sp}, "
          f"{base.dtype} activations, {config.compute_dtype} weights")
    print(f"{'program':<9} {'count':>5} {'dtypes':>10} {'B/device/step':>14} "
          f"{'sent B/device':>14} {'cross-node B':>13}")
    for what, r in rows.items():
        print(f"{what:<9} {r['count']:>5} {','.join(r['dtypes']):>10} "
              f"{r['bytes_per_device']:>14,.0f} {r['intra_node_bytes_per_device']:>14,.0f} "
              f"{r['cross_node_bytes']:>13,.0f}")
    print(f"per layer, forward, per device: {per_layer:,.0f} B measured vs 4Nh/P = "
          f"4 x {n_tokens} x {base.d_model} / {sp} x {itemsize} B = "
          f"{model['result_bytes']:,.0f} B ({per_layer / model['result_bytes']:.3f}x); "
          f"leaving the device: {sent_per_layer:,.0f} B vs (P-1)/P of it = "
          f"{model['sent_bytes']:,.0f} B")

    # -- (b) longest sequence under a memory budget ------------------------------------------
    budget = args.budget_mib * 2**20

    def peak_bytes(seq_par: bool, t: int) -> int:
        state, step = make(seq_par)
        b = nodes if seq_par else nodes * sp  # one sequence per node / per device
        m = step.lower(state, batch_of(b, t)).compile().memory_analysis()
        return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                - m.alias_size_in_bytes)

    def longest(seq_par: bool) -> tuple[int, dict[int, int]]:
        g = args.granule
        lo, hi = 0, args.max_seq // g  # in granules: lo fits (0 trivially), hi+1 unknown
        seen: dict[int, int] = {}
        while lo < hi:
            mid = (lo + hi + 1) // 2
            seen[mid * g] = peak_bytes(seq_par, mid * g)
            if seen[mid * g] <= budget:
                lo = mid
            else:
                hi = mid - 1
        return lo * g, dict(sorted(seen.items()))

    print(f"\n(b) longest sequence with a compiled train step <= {args.budget_mib:g} MiB per "
          f"device (bisection over multiples of {args.granule})")
    t0 = time.perf_counter()
    lengths = {}
    for name, seq_par in (("without SP", False), ("Ulysses SP", True)):
        best, seen = longest(seq_par)
        lengths[name] = {"longest_seq": best, "peak_bytes_by_seq": seen}
        print(f"{name:<11} longest {best:>6} tokens   (tried: "
              + ", ".join(f"{t}: {b / 2**20:.0f} MiB" for t, b in seen.items()) + ")")
    ratio = lengths["Ulysses SP"]["longest_seq"] / max(lengths["without SP"]["longest_seq"], 1)
    print(f"longest-sequence ratio SP / no SP: {ratio:.2f}x (P = {sp}; at most P when "
          f"activations are linear in length, sqrt(P) = {sp ** 0.5:.2f} when attention "
          f"scores dominate) [{time.perf_counter() - t0:.0f} s]")
    results["longest_sequence"] = {"budget_mib": args.budget_mib, "granule": args.granule,
                                   **lengths, "ratio": ratio}

    # -- step time ------------------------------------------------------------------------
    t = args.time_seq
    runs = {}
    for name, seq_par in (("without SP", False), ("Ulysses SP", True)):
        state, step = make(seq_par)
        batch = batch_of(args.batch, t, seed=1)
        state, m = step(state, batch)  # compile and warm up
        jax.block_until_ready(m)
        runs[name] = [state, step, batch, []]
    # Alternate the two runs step by step, so load from other processes on this machine
    # hits both alike; report medians.
    for _ in range(args.steps):
        for name, run in runs.items():
            state, step, batch, ts = run
            t1 = time.perf_counter()
            state, m = step(state, batch)
            jax.block_until_ready(m)
            ts.append(time.perf_counter() - t1)
            run[0] = state
    times = {name: statistics.median(run[3]) for name, run in runs.items()}
    step_ratio = times["Ulysses SP"] / times["without SP"]
    print(f"\nstep time, global batch {args.batch} x {t} tokens (same tokens per device): "
          f"without SP {times['without SP']:.3f} s, Ulysses SP {times['Ulysses SP']:.3f} s, "
          f"ratio {step_ratio:.2f}x (median of {args.steps}; {nodes * sp} simulated CPU "
          "devices share this machine's cores, so this is total work, not parallel time)")
    results["step_time"] = {"seq": t, "batch": args.batch, "seconds": times,
                            "ratio_sp_over_no_sp": step_ratio}
    write_json(args.out, "ulysses.json", results)


if __name__ == "__main__":
    main()
