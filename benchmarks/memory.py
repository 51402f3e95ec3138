"""The memory model (paper Fig. 4) against the compiled program's memory analysis.

    python benchmarks/memory.py --nodes 2 --local 4        # about 30 s

(a) For the example GPT with Adam: the model's persistent per-device state (fp32 primary
    shards + Adam's m and v) next to the compiled train step's argument bytes (state + the
    device's batch), for ZeRO-3 and hpZ; target: within 10%. hpZ's secondary copy lives
    only inside the step (temp memory); its size comes from ``secondary_bytes``.
(b) The paper's example: 100B parameters on 1024 GPUs, 16 per node, mixed precision
    (2 + 2 + K=12 bytes per parameter): data parallel vs ZeRO-3 vs hpZ.
(c) Live weights vs depth: compiled temp bytes of a ZeRO-3 step at 4 and 8 layers (a wide
    GPT, d_model 128, and one 8-token sequence per device, so weights dominate), for each
    remat choice, as unrolled blocks and as an ``nn.scan`` stack. Growth per added layer
    against one layer's gathered (bf16) weights; target <= 0.5x (about one unit's weights
    live at a time, not every unit's).
Writes JSON.
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, simulate_mesh_devices, write_json  # noqa: E402


def main() -> None:
    p = mesh_parser(__doc__)
    p.add_argument("--batch", type=int, default=32)
    args = p.parse_args()
    simulate_mesh_devices(args)
    import jax
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from benchmarks.common import example_model_and_data, lm_train_step
    from zeropp_jax.measure.analysis import memory_model, secondary_bytes

    num = args.nodes * args.local
    model, params, _, batch = example_model_and_data(0, args.batch)
    m = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    results = {"params": m, "devices": num, "modes": {}}
    print(f"(a) example GPT, M = {m:,}, {args.nodes}x{args.local} devices, Adam, bf16 compute")
    print(f"{'mode':<8} {'model state B':>14} {'+ batch B':>10} {'compiled args B':>16} "
          f"{'error':>7} {'secondary B':>12} {'temp B':>12}")
    mm = memory_model(m, num, alpha=args.local)
    batch_bytes = batch.nbytes // num
    for name, cfg in (("zero3", zpp.ZeroPPConfig()), ("hpz", zpp.ZeroPPConfig(hpz=True))):
        state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(1e-3),
                                      mesh=zpp.make_mesh(args.nodes, args.local), config=cfg)
        stats = lm_train_step().lower(state, batch).compile().memory_analysis()
        predicted = mm.zero3_persistent + batch_bytes
        measured = stats.argument_size_in_bytes
        err = abs(measured - predicted) / measured
        sec = secondary_bytes(state.engine)
        results["modes"][name] = {"model_state_bytes": mm.zero3_persistent,
                                  "batch_bytes": batch_bytes,
                                  "compiled_argument_bytes": measured, "relative_error": err,
                                  "secondary_bytes": sec,
                                  "compiled_temp_bytes": stats.temp_size_in_bytes}
        print(f"{name:<8} {mm.zero3_persistent:>14,.0f} {batch_bytes:>10,} {measured:>16,} "
              f"{err:>6.2%} {sec:>12,} {stats.temp_size_in_bytes:>12,}")
    print("  (model-state difference: padding of each unit to whole shards and the step/count "
          "scalars; temp bytes are dominated by activations)")

    paper = memory_model(100 * 10**9, 1024, alpha=16, param_bytes=2, grad_bytes=2,
                         optimizer_bytes=12, secondary_bytes=2)
    print("\n(b) paper example: 100B parameters, 1024 GPUs, alpha = 16 GPUs per node")
    print(paper.table())
    print(f"hpZ / ZeRO-3 = {paper.hpz / paper.zero3:.1f}x; data parallel / hpZ = "
          f"{paper.data_parallel / paper.hpz:.0f}x (paper: 8.9x and 114x)")
    results["paper_example"] = {"data_parallel": paper.data_parallel, "zero3": paper.zero3,
                                "hpz": paper.hpz}
    results["depth"] = depth_growth(args.nodes, args.local)
    write_json(args.out, "memory.json", results)


def depth_growth(nodes: int, local: int) -> dict:
    """(c): temp bytes at 4 and 8 layers -> growth per layer / one layer's bf16 weights."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from zeropp_demo.gpt import GPT, GPTConfig, lm_train_step

    d, seq = 128, 8

    class Layer(nn.Module):  # one pre-norm MLP block, as a scan body
        @nn.compact
        def __call__(self, x, _):
            h = nn.Dense(4 * d)(nn.LayerNorm()(x))
            return x + nn.Dense(d)(jax.nn.gelu(h)), None

    class Scanned(nn.Module):
        layers: int

        @nn.compact
        def __call__(self, tokens):
            x = nn.Embed(64, d)(tokens)
            stack = nn.scan(Layer, variable_axes={"params": 0},
                            split_rngs={"params": True}, length=self.layers)
            x, _ = stack(name="layers")(x, None)
            return nn.Dense(64)(x)

    tokens = np.zeros((nodes * local, seq + 1), np.int32)

    step = lm_train_step()

    def temp(model, layers, remat, stacked):
        params = model.init(jax.random.PRNGKey(0), tokens[:1, :-1])["params"]
        state = zpp.TrainState.create(
            model=model, params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(nodes, local),
            config=zpp.ZeroPPConfig(remat=remat), stacked=stacked)
        lay = state.engine.layouts["layers[0]" if stacked else "block_0"]
        stats = step.lower(state, tokens).compile().memory_analysis()
        return stats.temp_size_in_bytes, lay.n * 2

    rows = {}
    print(f"\n(c) compiled temp bytes vs depth, ZeRO-3 bf16, {nodes}x{local}, one "
          f"{seq}-token sequence per device")
    print(f"{'model':<22} {'remat':<8} {'temp 4 layers':>14} {'temp 8 layers':>14} "
          f"{'growth/layer':>13} {'layer weights':>14} {'ratio':>6}")
    for kind in ("unrolled GPT", "nn.scan stack"):
        for remat in ("minimal", "full"):
            if kind == "unrolled GPT":
                make = lambda n: GPT(GPTConfig(vocab_size=64, seq_len=seq, layers=n,  # noqa: E731
                                               d_model=d, heads=4, dtype=jnp.bfloat16))
                stacked = ()
            else:
                make, stacked = Scanned, ("layers",)
            t4, w = temp(make(4), 4, remat, stacked)
            t8, _ = temp(make(8), 8, remat, stacked)
            growth = (t8 - t4) / 4
            rows[f"{kind}/{remat}"] = {"temp_4": t4, "temp_8": t8, "growth_per_layer": growth,
                                       "layer_weight_bytes_bf16": w, "ratio": growth / w}
            print(f"{kind:<22} {remat:<8} {t4:>14,} {t8:>14,} {growth:>13,.0f} {w:>14,} "
                  f"{growth / w:>6.2f}" + ("" if growth / w <= 0.5 else "  (> 0.5: NOT met)"))
    return rows


if __name__ == "__main__":
    main()
