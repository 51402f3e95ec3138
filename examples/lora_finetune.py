"""LoRA fine-tuning with ZeRO++: a frozen GPT base stored pre-quantized, adapters trained.

    python examples/lora_finetune.py --nodes 2 --local 4 --steps 60

A byte-level GPT base (random, or briefly pre-trained with ``--pretrain-steps``) gets LoRA
adapters on every Dense of its blocks; only the adapters train (only they carry Adam state).
The same fine-tuning runs twice: frozen weights stored as INT8 primary shards
(``quantize_frozen=True``: gathered as stored, no quantization in the step) and stored in
fp32 (gathered as bf16). For each it prints the loss, the per-device bytes of the persistent
state (trainable shards + optimizer state + frozen storage) and the cross-node bytes per step
per node, counted from the lowered step program (``zeropp_jax.measure.analysis.comm_report``). A
third row gives full fine-tuning (nothing frozen) for scale. On a CPU machine the script
simulates exactly ``nodes * local`` devices itself.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=4)
    p.add_argument("--steps", type=int, default=60, help="fine-tuning steps per run")
    p.add_argument("--pretrain-steps", type=int, default=0,
                   help="ZeRO-3 full training of the base before fine-tuning (default 0)")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--rank", type=int, default=4, help="LoRA rank")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-bits", type=int, default=8, choices=[4, 8])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=pathlib.Path, default=None, help="write the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)  # before any other JAX use

    import jax
    import numpy as np
    import optax

    from zeropp_jax.measure.analysis import comm_report
    from zeropp_demo.data import sample_batch, stdlib_corpus, train_val_split
    from zeropp_demo.gpt import GPT, GPTConfig, lm_train_step
    from zeropp_demo.lora_gpt import LoRAGPT, is_adapter, with_base

    cfg = GPTConfig(vocab_size=256, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=4)
    mesh = zpp.make_mesh(args.nodes, args.local)
    train, _ = train_val_split(stdlib_corpus(2_000_000))

    def batch_at(step: int, seed: int) -> np.ndarray:
        return sample_batch(train, args.batch, args.seq_len, seed=seed, step=step)

    step = lm_train_step()

    x0 = batch_at(0, args.seed)[:, :-1]
    base = GPT(cfg).init(jax.random.PRNGKey(args.seed), x0)["params"]
    if args.pretrain_steps:
        st = zpp.TrainState.create(model=GPT(cfg), params=base, tx=optax.adam(3e-3), mesh=mesh)
        for i in range(args.pretrain_steps):
            st, m = step(st, batch_at(i, args.seed + 1))
        print(f"pretrained base: {args.pretrain_steps} steps, loss {float(m['loss']):.3f}")
        base = st.consolidate()
    model = LoRAGPT(cfg, rank=args.rank)
    params = with_base(model.init(jax.random.PRNGKey(args.seed + 2), x0)["params"], base)
    frozen = lambda path: not is_adapter(path)  # noqa: E731

    def per_device_bytes(state) -> dict:
        n = state.engine.num_devices
        size = lambda t: sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(t))  # noqa: E731
        out = {"trainable": size(state.params) / n, "optimizer": size(state.opt_state) / n,
               "frozen": size(state.frozen) / n if state.frozen is not None else 0.0}
        out["total"] = sum(out.values())
        return out

    runs = [("frozen INT%d (quantize_frozen)" % args.weight_bits, True, frozen),
            ("frozen fp32 (unquantized)", False, frozen),
            ("full fine-tuning (nothing frozen)", False, None)]
    results = []
    for label, quantized, filt in runs:
        config = zpp.ZeroPPConfig(quantize_frozen=quantized, weight_bits=args.weight_bits)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(args.lr),
                                      mesh=mesh, config=config, frozen=filt)
        report = comm_report(step.lower(state, batch_at(0, args.seed)), mesh)
        mem = per_device_bytes(state)
        row = {"run": label, "memory_per_device": mem,
               "cross_node_bytes_per_step_per_node": report.cross_node_bytes_per_node}
        if filt is not None:  # the two LoRA runs train; the full row is for scale only
            t0, losses = time.perf_counter(), []
            for i in range(args.steps):
                state, m = step(state, batch_at(i, args.seed))
                losses.append(float(m["loss"]))
            row.update(first_loss=losses[0], last_loss=float(np.mean(losses[-5:])),
                       seconds=time.perf_counter() - t0)
            print(f"{label}: loss {losses[0]:.3f} -> {row['last_loss']:.3f} (mean of last 5) "
                  f"in {args.steps} steps, {row['seconds']:.1f} s")
        results.append(row)

    print(f"\nLoRAGPT {args.layers}x{args.d_model}, rank {args.rank}, mesh "
          f"{args.nodes}x{args.local}; per device, persistent state:")
    print(f"{'run':<36} {'trainable B':>12} {'optimizer B':>12} {'frozen B':>10} "
          f"{'total B':>10} {'cross-node B/step/node':>23}")
    for r in results:
        m = r["memory_per_device"]
        print(f"{r['run']:<36} {m['trainable']:>12,.0f} {m['optimizer']:>12,.0f} "
              f"{m['frozen']:>10,.0f} {m['total']:>10,.0f} "
              f"{r['cross_node_bytes_per_step_per_node']:>23,.0f}")
    q, u = results[0], results[1]
    print(f"quantized frozen storage: {u['memory_per_device']['frozen'] / q['memory_per_device']['frozen']:.2f}x "
          f"smaller than fp32; cross-node bytes per step "
          f"{u['cross_node_bytes_per_step_per_node'] / q['cross_node_bytes_per_step_per_node']:.2f}x fewer")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "runs": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
