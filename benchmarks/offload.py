"""What offloading the optimizer state costs and saves: step time and bytes per memory space.

    python benchmarks/offload.py --out benchmarks/results     # about 2 minutes on 2 cores

The example GPT (4 layers, d_model 256, bf16 compute) with AdamW on the simulated
``--nodes x --local`` CPU mesh, under ZeRO-3 and ZeRO++, each without offload, with
``offload_optimizer`` and with ``offload_params`` too. Per variant: the compiled step's arguments per device split by
memory space (read from the entry layout of the compiled program: ``S(5)`` is host
memory), XLA's temporary bytes, and the step time. Each step is compiled and warmed up
first; then ``--rounds`` interleaved rounds run ``--steps-per-round`` steps of each
variant in turn; the table gives the median step time, half the spread of the round
times and the ratio to the same config without offload.

On XLA's CPU backend host and device memory are the same RAM and a "transfer" is a copy,
so the step-time ratio here says what the copies cost, not what PCIe costs a GPU. Run it
on a quiet machine. Writes ``--out/offload.json``.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import cpu_name, timed_gpt_parser, write_json  # noqa: E402
from zeropp_jax.measure.comm_report import ITEMSIZE  # noqa: E402

# name -> (preset, offload_optimizer, offload_params)
VARIANTS = {
    "zero3": ("zero3", False, False),
    "zero3 + optimizer offload": ("zero3", True, False),
    "zero3 + optimizer and params offload": ("zero3", True, True),
    "zeropp": ("zeropp", False, False),
    "zeropp + optimizer offload": ("zeropp", True, False),
    "zeropp + optimizer and params offload": ("zeropp", True, True),
}


def argument_bytes(compiled_text: str) -> dict[str, int]:
    """Per-device bytes of a compiled program's arguments by memory space
    (``{"device": ..., "host": ...}``), from its entry computation layout."""
    layout = compiled_text.splitlines()[0].split("entry_computation_layout={(", 1)[1]
    args = layout.split(")->", 1)[0]
    out = {"device": 0, "host": 0}
    for dtype, dims, lay in re.findall(r"(\w+)\[([\d,]*)\](\{[^}]*\})?", args):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        out["host" if "S(5)" in (lay or "") else "device"] += int(n * ITEMSIZE[dtype])
    return out


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
    for name, (preset, optimizer, params_off) in VARIANTS.items():
        config = getattr(zpp.ZeroPPConfig, preset)(offload_optimizer=optimizer,
                                                   offload_params=params_off)
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adamw(1e-3),
                                      mesh=mesh, config=config)
        compiled = step.lower(state, batches[0]).compile()
        kinds = sorted({leaf.sharding.memory_kind
                        for leaf in jax.tree_util.tree_leaves(state.opt_state)})
        for i in range(2):  # compile, warm up
            state, m = step(state, batches[i])
        jax.block_until_ready(state)
        states[name] = state
        rows[name] = {"times": [], "arguments": argument_bytes(compiled.as_text()),
                      "temp_bytes": int(compiled.memory_analysis().temp_size_in_bytes),
                      "opt_state_memory_kinds": kinds}
    for name, times in timed_rounds(states, step, batches, args.rounds,
                                    args.steps_per_round).items():
        rows[name]["times"] = times
    n_params = sum(int(np.size(x)) for x in jax.tree_util.tree_leaves(params))
    print(f"{n_params / 1e6:.2f}M-parameter GPT, {args.nodes}x{args.local} CPU devices, "
          f"AdamW, {args.rounds} rounds of {args.steps_per_round} steps")
    print(f"{'variant':<38} {'device args KB':>14} {'host args KB':>12} {'temp KB':>8} "
          f"{'median ms':>10} {'+-':>5} {'ratio':>6}")
    for name, r in rows.items():
        med = statistics.median(r["times"])
        base = statistics.median(rows[VARIANTS[name][0]]["times"])
        r.update(median_s=med, half_spread_s=(max(r["times"]) - min(r["times"])) / 2,
                 ratio=med / base)
        print(f"{name:<38} {r['arguments']['device'] / 1e3:>14.0f} "
              f"{r['arguments']['host'] / 1e3:>12.0f} {r['temp_bytes'] / 1e3:>8.0f} "
              f"{med * 1e3:>10.0f} {r['half_spread_s'] * 1e3:>5.0f} {r['ratio']:>5.2f}x")
    write_json(args.out, "offload.json", {
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "params": n_params, "cpu": cpu_name(), "jax": jax.__version__, "variants": rows,
        "memory_spaces": {"S(5)": "host", "default": "device"}})


if __name__ == "__main__":
    main()
