"""What qgZ's error feedback and per-step signs cost: step time, bytes on the wire, memory.

    python benchmarks/feedback_cost.py --out benchmarks/results     # about 3 minutes on 2 cores

The example GPT of the convergence study (4 layers, d_model 256, bf16 compute) on the
simulated ``--nodes x --local`` CPU mesh, under zeropp with Hadamard-smoothed INT4
gradients and four gradient options:

  hadamard              ``qgz_hadamard=True`` (the baseline);
  + per-step signs      ``qgz_signs="per_step"``;
  + error feedback      ``qgz_error_feedback=True``;
  + both                the two together.

Each step is compiled and warmed up first; then ``--rounds`` interleaved rounds run
``--steps-per-round`` steps of each variant in turn, and the table gives each variant's
median step time, half the spread of the round times, and the ratio to the baseline. Also
per variant: the bytes each unit's transports move per step (``Engine.wire_bytes``: error
feedback must not change them) and the kept errors' bytes per device
(``state.params.feedback``). Run it on a quiet machine. Writes ``--out/feedback_cost.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import add_out_argument, write_json  # noqa: E402

VARIANTS = {
    "hadamard": {},
    "+ per-step signs": {"qgz_signs": "per_step"},
    "+ error feedback": {"qgz_error_feedback": True},
    "+ both": {"qgz_error_feedback": True, "qgz_signs": "per_step"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--steps-per-round", type=int, default=3)
    add_out_argument(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from benchmarks.common import lm_train_step
    from zeropp_demo.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split
    from zeropp_demo.gpt import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=args.heads, dtype=jnp.bfloat16)
    model = GPT(cfg)
    data, _ = train_val_split(stdlib_corpus())
    batches = [sample_batch(data, args.batch, args.seq_len, seed=0, step=i) for i in range(4)]
    params = jax.jit(model.init)(jax.random.PRNGKey(0), batches[0][:, :-1])["params"]
    mesh = zpp.make_mesh(args.nodes, args.local)
    step = lm_train_step()
    states, rows = {}, {}
    for name, extra in VARIANTS.items():
        config = zpp.ZeroPPConfig.zeropp(qgz_hadamard=True, **extra)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adamw(1e-3),
                                      mesh=mesh, config=config)
        wire = state.engine.wire_bytes()
        kept = sum(int(np.prod(b.shape)) * b.dtype.itemsize
                   for bufs in state.params.feedback.values() for b in bufs)
        for i in range(2):  # compile, warm up
            state, m = step(state, batches[i])
        jax.block_until_ready(state)
        states[name] = state
        rows[name] = {"times": [], "kept_bytes_per_device": kept // (args.nodes * args.local),
                      "wire_bytes": {u: {k: [b.intra, b.cross] for k, b in r.items()}
                                     for u, r in wire.items()}}
    for _ in range(args.rounds):
        for name in VARIANTS:
            state = states[name]
            t0 = time.perf_counter()
            for i in range(args.steps_per_round):
                state, m = step(state, batches[2 + i % 2])
            jax.block_until_ready(state)
            rows[name]["times"].append((time.perf_counter() - t0) / args.steps_per_round)
            states[name] = state
    base = statistics.median(rows["hadamard"]["times"])
    n_params = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))
    print(f"{n_params / 1e6:.2f}M-parameter GPT, {args.nodes}x{args.local} CPU devices, "
          f"{args.rounds} rounds of {args.steps_per_round} steps")
    print(f"{'variant':<20} {'median ms':>10} {'+-':>6} {'ratio':>7} {'kept B/param/dev':>17} "
          f"{'same bytes':>10}")
    for name, r in rows.items():
        med = statistics.median(r["times"])
        r["median_s"] = med
        r["half_spread_s"] = (max(r["times"]) - min(r["times"])) / 2
        r["ratio"] = med / base
        r["kept_bytes_per_param_per_device"] = r["kept_bytes_per_device"] / n_params
        r["same_wire_bytes"] = r["wire_bytes"] == rows["hadamard"]["wire_bytes"]
        print(f"{name:<20} {med * 1e3:>10.0f} {r['half_spread_s'] * 1e3:>6.0f} "
              f"{r['ratio']:>6.2f}x {r['kept_bytes_per_param_per_device']:>17.3f} "
              f"{str(r['same_wire_bytes']):>10}")
    write_json(args.out, "feedback_cost.json", {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "params": n_params, "cpu": _cpu(), "jax": jax.__version__, "variants": rows})


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
