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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import cpu_name, timed_gpt_parser, write_json  # noqa: E402

VARIANTS = {
    "hadamard": {},
    "+ per-step signs": {"qgz_signs": "per_step"},
    "+ error feedback": {"qgz_error_feedback": True},
    "+ both": {"qgz_error_feedback": True, "qgz_signs": "per_step"},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return timed_gpt_parser(__doc__).parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)
    import jax
    import numpy as np
    import optax

    from benchmarks.common import bf16_gpt_run, timed_rounds

    model, params, batches, mesh, step = bf16_gpt_run(args)
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
    for name, times in timed_rounds(states, step, batches, args.rounds,
                                    args.steps_per_round).items():
        rows[name]["times"] = times
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
        "params": n_params, "cpu": cpu_name(), "jax": jax.__version__, "variants": rows})


if __name__ == "__main__":
    main()
