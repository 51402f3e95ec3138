"""The main job: a byte-level GPT trained with ZeRO-3 / ZeRO++ on a (node, local) mesh.

    python examples/train_gpt.py --nodes 2 --local 4 --mode zero3 --steps 300

On a CPU machine the script simulates exactly ``nodes * local * model`` CPU devices itself
(``--model T``: tensor parallelism, the GPT's weights split over a ``"model"`` mesh axis by
Megatron's rules). The data
is the installed Python standard library's source (no download; the last 5% is held out for
validation); ``--batch`` is the global batch of one optimizer step, so the same seed trains on
the same data for every mesh shape and every ``--accum``.

Long runs: ``--save DIR`` checkpoints at the end (and every ``--save-every`` steps);
``--resume DIR`` continues from the newest checkpoint there up to ``--steps`` (the total),
on any mesh shape. ``--json F`` writes a summary and ``F`` with suffix ``.png`` the loss curves.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import statistics
import time

MODES = ["zero3", "qwz", "hpz", "qgz", "qwz_hpz", "zeropp"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="nodes in the mesh (default 2)")
    p.add_argument("--local", type=int, default=4,
                   help="data-parallel devices per node (default 4)")
    p.add_argument("--model", type=int, default=1,
                   help="tensor-parallel degree: a (node, local, model) mesh, the GPT's "
                        "weights split by Megatron's rules (default 1: none)")
    p.add_argument("--mode", default="zero3", choices=MODES)
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage")
    p.add_argument("--steps", type=int, default=200,
                   help="total optimizer steps of the run (a resumed run continues up to it)")
    p.add_argument("--batch", type=int, default=32,
                   help="global batch of one optimizer step (split over devices and --accum)")
    p.add_argument("--accum", type=int, default=1,
                   help="micro-batches per step (gradient accumulation); default 1")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--lr-schedule", default="cosine", choices=["cosine", "linear", "constant"],
                   help="after --warmup steps of linear warmup (default cosine to 0)")
    p.add_argument("--warmup", type=int, default=20, help="warmup steps (default 20)")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--clip", type=float, default=None,
                   help="clip gradients to this global L2 norm (default: no clipping)")
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--remat", default="minimal", choices=["minimal", "full"],
                   help="what a unit keeps for backward: minimal (matmul outputs; default) "
                        "or full (inputs only; recomputes the unit)")
    p.add_argument("--prefetch", type=int, default=1,
                   help="units whose forward gather may run ahead (default 1)")
    p.add_argument("--weight-bits", type=int, default=8, choices=[4, 8], help="qwZ bits")
    p.add_argument("--grad-bits", type=int, default=4, choices=[4, 8], help="qgZ bits")
    p.add_argument("--weight-format", default=None, choices=["int8", "int4", "fp8"],
                   help="qwZ wire format (overrides --weight-bits)")
    p.add_argument("--qgz-hadamard", action="store_true",
                   help="Hadamard-smoothed qgZ gradient blocks")
    p.add_argument("--qwz-hadamard", action="store_true",
                   help="Hadamard-smoothed qwZ weight blocks")
    p.add_argument("--stochastic-rounding", action="store_true",
                   help="unbiased stochastic rounding of qgZ's quantizations")
    p.add_argument("--qgz-error-feedback", action="store_true",
                   help="qgZ error feedback: each device adds back the error its last "
                        "quantizations left")
    p.add_argument("--qgz-signs", default="fixed", choices=["fixed", "per_step"],
                   help="qgZ's Hadamard signs: one set for the run or new every step")
    p.add_argument("--qgz-hops", default="both", choices=["both", "cross"],
                   help="which of qgZ's hops are quantized: both (ZeRO++) or only the one "
                        "across nodes (16-bit inside the node)")
    p.add_argument("--non-blocked", action="store_true",
                   help="quantize with one scale per message instead of per 256-element "
                        "block (the paper's non-blocked baseline)")
    p.add_argument("--qgz-until", type=float, default=None,
                   help="with qgZ: use it for this fraction of --steps only (e.g. 0.5)")
    p.add_argument("--sequence-parallel", action="store_true",
                   help="Ulysses: split each sequence over a node's devices (--local), the "
                        "batch over nodes; --seq-len must be a multiple of --local, --batch "
                        "of --nodes x --accum")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=0,
                   help="validation loss every N steps and at the end (0: only at the end "
                        "if --eval-batches > 0)")
    p.add_argument("--eval-batches", type=int, default=4,
                   help="held-out batches per validation (default 4; 0: no validation)")
    p.add_argument("--save", type=pathlib.Path, default=None,
                   help="checkpoint directory: save at the end (and every --save-every steps)")
    p.add_argument("--save-every", type=int, default=0)
    p.add_argument("--resume", type=pathlib.Path, default=None,
                   help="continue from the newest checkpoint in DIR up to --steps")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop after this many steps of this invocation (as a job with a time "
                        "limit would); schedules still span --steps, --save still saves")
    p.add_argument("--json", type=pathlib.Path, default=None,
                   help="write a run summary here, and the loss curves next to it (.png)")
    p.add_argument("--dump-hlo", type=pathlib.Path, default=None,
                   help="write DIR/lowered.mlir and DIR/compiled.hlo of the train step")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--no-comm-summary", action="store_true",
                   help="skip the closing line that compares this run's cross-node bytes per "
                        "step with a ZeRO-3 step of the same model and mesh")
    args = p.parse_args(argv)
    if args.accum < 1 or args.batch % args.accum:
        p.error(f"--batch {args.batch} must be divisible by --accum {args.accum}")
    if args.qgz_until is not None and args.mode not in ("qgz", "zeropp"):
        p.error("--qgz-until needs a mode with qgZ (qgz or zeropp)")
    if args.qgz_hops != "both" and args.mode not in ("qgz", "zeropp"):
        p.error("--qgz-hops needs a mode with qgZ (qgz or zeropp)")
    if args.stage != 3 and args.mode != "zero3":
        p.error(f"--mode {args.mode} needs --stage 3 (ZeRO++ techniques extend ZeRO-3)")
    return args


def make_config(args: argparse.Namespace):
    import zeropp_jax as zpp

    kw = dict(compute_dtype=args.compute_dtype, gradient_clipping=args.clip,
              weight_bits=None if args.weight_format else args.weight_bits,
              weight_format=args.weight_format, grad_bits=args.grad_bits,
              blockwise=not args.non_blocked, remat=args.remat, prefetch=args.prefetch,
              qgz_hadamard=args.qgz_hadamard, qwz_hadamard=args.qwz_hadamard,
              stochastic_rounding=args.stochastic_rounding,
              qgz_error_feedback=args.qgz_error_feedback, qgz_signs=args.qgz_signs,
              qgz_hops=args.qgz_hops)
    if args.qgz_until is not None:
        kw.update(qgz_until=float(args.qgz_until), planned_steps=args.steps)
    if args.stage == 3:
        return zpp.ZeroPPConfig.from_mode(args.mode, **kw)
    return zpp.ZeroPPConfig(stage=args.stage, **kw)


def make_schedule(args: argparse.Namespace):
    from zeropp_jax.train.optim import lr_schedule

    return lr_schedule(args.lr, args.steps, kind=args.lr_schedule, warmup=args.warmup)


def plot_losses(path: pathlib.Path, summary: dict) -> None:
    """Train loss per step and validation points, to ``path`` (PNG)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("  (matplotlib not installed: no loss-curve PNG; pip install matplotlib)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    start = summary["start_step"]
    ax.plot(range(start, start + len(summary["losses"])), summary["losses"], lw=0.8,
            label="train (per step)")
    if summary["eval"]:
        ax.plot([e["step"] for e in summary["eval"]], [e["val_loss"] for e in summary["eval"]],
                "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / byte)")
    ax.set_title(f"{summary['mode']} on {summary['nodes']}x{summary['local']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cross_node_bytes(lower_step, state, zero3_state, mesh) -> dict[str, float]:
    """Cross-node bytes one step moves (summed over nodes), for this run's step and for a
    ZeRO-3 step of the same model and mesh, from the communication report of each lowered
    program: what the program asks the network for, before XLA:CPU widens 16-bit
    reductions to 32 bits (a GPU keeps them)."""
    from zeropp_jax.analysis import comm_report

    return {"run": comm_report(lower_step(state), mesh).cross_node_bytes,
            "zero3": comm_report(lower_step(zero3_state), mesh).cross_node_bytes}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # Must run before JAX touches its backend: the script simulates its own devices.
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local * args.model)

    import jax
    import numpy as np
    import optax
    from tqdm import tqdm

    from zeropp_jax.train import checkpoint
    from zeropp_jax.train.accumulate import accumulate_gradients
    from zeropp_demo.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split
    from zeropp_demo.gpt import GPT, MEGATRON_RULES, GPTConfig, loss_fn

    mesh = zpp.make_mesh(args.nodes, args.local, model=args.model)
    config = make_config(args)
    gpt_cfg = GPTConfig(
        vocab_size=VOCAB_SIZE,
        seq_len=args.seq_len,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        dtype=args.compute_dtype,
        sequence_axis="local" if args.sequence_parallel else None,
        logical_axes=args.model > 1,
    )
    model = GPT(gpt_cfg)
    train_data, val_data = train_val_split(stdlib_corpus())
    first = sample_batch(train_data, args.batch, args.seq_len, seed=args.seed, step=0)
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), first[:, :-1])["params"]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))

    tx = optax.adamw(make_schedule(args), weight_decay=args.weight_decay)
    state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=config,
                                  logical_axis_rules=MEGATRON_RULES if args.model > 1 else None)
    start = 0
    if args.resume is not None:
        state = checkpoint.restore(args.resume, state)
        start = int(state.step)
        print(f"resumed from {args.resume} at step {start} (run ends at step {args.steps})")

    from jax.sharding import PartitionSpec as P

    sp = args.sequence_parallel
    # Sequence parallel: every batch leaf is [B, T], B over "node" and T over "local"; inputs
    # and targets are separate arrays (a [B, T + 1] array cannot be cut into equal sequence
    # shards and then shifted). Otherwise one [B, T + 1] array split over all devices.
    batch_spec = P("node", "local") if sp else P(("node", "local"))

    def as_batch(tokens):
        return {"x": tokens[:, :-1], "y": tokens[:, 1:]} if sp else tokens

    def inputs_targets(b):
        return (b["x"], b["y"]) if sp else (b[:, :-1], b[:, 1:])

    @zpp.train_step(batch_spec=batch_spec)
    def train_step(state, batch):
        def loss_of(p, b):
            x, y = inputs_targets(b)
            return loss_fn(state.apply_fn({"params": p}, x), y)

        loss, grads = accumulate_gradients(loss_of, state.params, batch,
                                           micro_batches=args.accum)
        return state.apply_gradients(grads=grads), {"loss": loss}

    @zpp.eval_step(batch_spec=batch_spec)
    def eval_step(state, batch):
        x, y = inputs_targets(batch)
        return {"loss": loss_fn(state.apply_fn({"params": state.params}, x), y)}

    # Fixed held-out batches (their own seed stream), the same for every run and mesh.
    val_batches = [as_batch(sample_batch(val_data, args.batch, args.seq_len,
                                         seed=10_000 + args.seed, step=i))
                   for i in range(args.eval_batches)]

    def evaluate(state) -> float:
        return float(np.mean([float(eval_step(state, b)["loss"]) for b in val_batches]))

    if args.dump_hlo is not None:
        args.dump_hlo.mkdir(parents=True, exist_ok=True)
        lowered = train_step.lower(state, as_batch(first))
        (args.dump_hlo / "lowered.mlir").write_text(lowered.as_text())
        (args.dump_hlo / "compiled.hlo").write_text(lowered.compile().as_text())

    losses, times, evals, skipped_at = [], [], [], []
    skipped = int(state.skipped_steps)
    end = args.steps if args.stop_after is None else min(args.steps, start + args.stop_after)
    bar = tqdm(range(start, end), disable=args.no_progress,
               desc=f"{args.mode} {args.nodes}x{args.local}")
    for step in bar:
        batch = sample_batch(train_data, args.batch, args.seq_len, seed=args.seed, step=step)
        t0 = time.perf_counter()
        state, metrics = train_step(state, as_batch(batch))
        loss = float(metrics["loss"])  # blocks until the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        now_skipped = int(state.skipped_steps)
        if now_skipped != skipped or not math.isfinite(loss):
            skipped_at.append(step)
            what = "update skipped" if now_skipped != skipped else "update applied"
            print(f"step {step}: non-finite loss {loss} or gradients; {what} "
                  f"(parameters {'unchanged' if now_skipped != skipped else 'changed'})")
            skipped = now_skipped
        bar.set_postfix(loss=f"{loss:.3f}")
        done = step + 1
        if val_batches and (
            (args.eval_every and done % args.eval_every == 0) or done == end
        ):
            evals.append({"step": done, "val_loss": evaluate(state)})
            bar.write(f"step {done}: validation loss {evals[-1]['val_loss']:.4f}")
        if args.save is not None and args.save_every and done % args.save_every == 0:
            checkpoint.save(args.save, state)
    bar.close()
    if args.save is not None:
        path = checkpoint.save(args.save, state)
        print(f"saved {path}")

    # What ZeRO++ saved: this step's cross-node bytes against a ZeRO-3 step of the same model
    # and mesh (lowered only, not compiled or run). Stage 3 only: stages 1-2 gather nothing.
    comm = None
    if not args.no_comm_summary and args.stage == 3 and args.nodes > 1:
        zero3_state = zpp.TrainState.create(
            model=model, params=params, tx=tx, mesh=mesh,
            config=zpp.ZeroPPConfig.zero3(compute_dtype=args.compute_dtype, remat=args.remat,
                                          prefetch=args.prefetch),
            logical_axis_rules=MEGATRON_RULES if args.model > 1 else None)
        comm = cross_node_bytes(lambda s: train_step.lower(s, as_batch(first)), state,
                                zero3_state, mesh)
        del zero3_state

    summary = {
        "mode": args.mode,
        "stage": args.stage,
        "nodes": args.nodes,
        "local": args.local,
        "model": args.model,
        "params": n_params,
        "compute_dtype": args.compute_dtype,
        "batch": args.batch,
        "accum": args.accum,
        "seq_len": args.seq_len,
        "sequence_parallel": args.sequence_parallel,
        "steps": args.steps,
        "start_step": start,
        "end_step": end,
        "losses": losses,
        "eval": evals,
        "final_val_loss": evals[-1]["val_loss"] if evals else None,
        "skipped_steps": skipped_at,
        "cross_node_bytes_per_step": comm,
        "step_time_median_s": None,
        "compile_and_first_step_s": times[0] if times else None,
        "config": {k: getattr(config, k) for k in (
            "qwz", "hpz", "qgz", "weight_bits", "grad_bits", "blockwise", "qgz_until",
            "gradient_clipping", "weight_format", "qgz_hadamard", "qwz_hadamard",
            "stochastic_rounding", "qgz_error_feedback", "qgz_signs", "qgz_hops")},
    }
    print()
    print(f"zeropp_jax train_gpt — {args.mode} (stage {args.stage}) on {args.nodes} node(s) x "
          f"{args.local} device(s)" + (f" x {args.model} (tensor parallel)" if args.model > 1
                                       else "") + f", {jax.devices()[0].platform}")
    print(f"  model      {n_params / 1e6:.2f}M params, {args.layers} layers, d_model "
          f"{args.d_model}, {args.heads} heads, seq {args.seq_len}, {args.compute_dtype}")
    print(f"  units      {len(state.engine.layouts)} (each gathered just before use)")
    if losses:
        # The first step includes compilation; the median of the rest is the step time.
        median = statistics.median(times[1:]) if len(times) > 1 else times[0]
        summary["step_time_median_s"] = median
        k = max(1, min(10, len(losses) // 5))
        print(f"  steps      {start} -> {end} of {args.steps}")
        print(f"  loss       {statistics.mean(losses[:k]):.3f} (first {k} steps) -> "
              f"{statistics.mean(losses[-k:]):.3f} (last {k} steps)")
        print(f"  step time  {median * 1e3:.1f} ms median (first step incl. compile "
              f"{times[0]:.1f} s)")
    if evals:
        print(f"  val loss   {evals[-1]['val_loss']:.4f} at step {evals[-1]['step']}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"  wrote      {args.json}")
        if losses:
            png = args.json.with_suffix(".png")
            plot_losses(png, summary)
            if png.exists():
                print(f"  wrote      {png}")
    if comm is not None:
        ratio = comm["run"] / comm["zero3"] if comm["zero3"] else float("nan")
        note = (" (both of qgZ's branches, before and after --qgz-until, counted)"
                if args.qgz_until is not None else "")
        print(f"  cross-node {comm['run'] / 1e6:.2f} MB per step ({args.mode}) vs "
              f"{comm['zero3'] / 1e6:.2f} MB (zero3, same model and mesh): {ratio:.2f}x"
              f"{note}")
    return summary


if __name__ == "__main__":
    main()
