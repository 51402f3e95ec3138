"""The main job: a character-level GPT trained with ZeRO-3 / ZeRO++ on a (node, local) mesh.

    python examples/train_gpt.py --nodes 2 --local 4 --mode zero3 --steps 300

On a CPU machine the script simulates exactly ``nodes * local`` CPU devices itself. The data
is the installed Python standard library's source (no download); ``--batch`` is the global
batch, so the same seed trains on the same data for every mesh shape.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2, help="nodes in the mesh (default 2)")
    p.add_argument("--local", type=int, default=4, help="devices per node (default 4)")
    p.add_argument("--mode", default="zero3", choices=["zero3", "qwz", "hpz", "qgz", "zeropp"])
    p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3], help="ZeRO stage")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=32, help="global batch (split over devices)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--compute-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write a run summary here")
    p.add_argument("--dump-hlo", type=pathlib.Path, default=None,
                   help="write DIR/lowered.mlir and DIR/compiled.hlo of the train step")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    # Must run before JAX touches its backend: the script simulates its own devices.
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)

    import jax
    import numpy as np
    import optax
    from tqdm import tqdm

    from zeropp_jax.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split
    from zeropp_jax.models.gpt import GPT, GPTConfig, loss_fn

    mesh = zpp.make_mesh(args.nodes, args.local)
    if args.stage == 3:
        config = zpp.ZeroPPConfig.from_mode(args.mode, compute_dtype=args.compute_dtype)
    elif args.mode != "zero3":
        sys.exit(f"--mode {args.mode} needs --stage 3 (ZeRO++ techniques extend ZeRO-3)")
    else:
        config = zpp.ZeroPPConfig(stage=args.stage, compute_dtype=args.compute_dtype)

    gpt_cfg = GPTConfig(
        vocab_size=VOCAB_SIZE,
        seq_len=args.seq_len,
        layers=args.layers,
        d_model=args.d_model,
        heads=args.heads,
        dtype=args.compute_dtype,
    )
    model = GPT(gpt_cfg)
    train_data, _ = train_val_split(stdlib_corpus())
    first = sample_batch(train_data, args.batch, args.seq_len, seed=args.seed, step=0)
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), first[:, :-1])["params"]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))

    tx = optax.adamw(optax.warmup_cosine_decay_schedule(0.0, args.lr, 20, max(args.steps, 21)),
                     weight_decay=0.01)
    state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=config)

    @zpp.train_step
    def train_step(state, batch):
        def loss_of(p):
            return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    if args.dump_hlo is not None:
        args.dump_hlo.mkdir(parents=True, exist_ok=True)
        lowered = train_step.lower(state, first)
        (args.dump_hlo / "lowered.mlir").write_text(lowered.as_text())
        (args.dump_hlo / "compiled.hlo").write_text(lowered.compile().as_text())

    losses, times = [], []
    bar = tqdm(range(args.steps), disable=args.no_progress, desc=f"{args.mode} {args.nodes}x{args.local}")
    for step in bar:
        batch = sample_batch(train_data, args.batch, args.seq_len, seed=args.seed, step=step)
        t0 = time.perf_counter()
        state, metrics = train_step(state, batch)
        loss = float(metrics["loss"])  # blocks until the step is done
        times.append(time.perf_counter() - t0)
        losses.append(loss)
        bar.set_postfix(loss=f"{loss:.3f}")
    bar.close()

    # The first step includes compilation; the median of the rest is the step time.
    median = statistics.median(times[1:]) if len(times) > 1 else times[0]
    k = max(1, min(10, len(losses) // 5))
    summary = {
        "mode": args.mode,
        "stage": args.stage,
        "nodes": args.nodes,
        "local": args.local,
        "params": n_params,
        "compute_dtype": args.compute_dtype,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "steps": args.steps,
        "losses": losses,
        "step_time_median_s": median,
        "compile_and_first_step_s": times[0],
    }
    print()
    print(f"zeropp_jax train_gpt — {args.mode} (stage {args.stage}) on {args.nodes} node(s) x "
          f"{args.local} device(s), {jax.devices()[0].platform}")
    print(f"  model      {n_params / 1e6:.2f}M params, {args.layers} layers, d_model "
          f"{args.d_model}, {args.heads} heads, seq {args.seq_len}, {args.compute_dtype}")
    print(f"  units      {len(state.engine.layouts)} (each gathered just before use)")
    print(f"  loss       {statistics.mean(losses[:k]):.3f} (first {k} steps) -> "
          f"{statistics.mean(losses[-k:]):.3f} (last {k} steps)")
    print(f"  step time  {median * 1e3:.1f} ms median (first step incl. compile "
          f"{times[0]:.1f} s)")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
        print(f"  wrote      {args.json}")
    return summary


if __name__ == "__main__":
    main()
