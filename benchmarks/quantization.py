"""Block vs per-tensor quantization error on real weights, and a block-size sweep.

    python benchmarks/quantization.py            # ~2 minutes on 2 CPU cores

(a) For an initialized GPT, the same GPT briefly trained with zeropp_jax (ZeRO-3 on a 2x4
    simulated mesh), and heavy-tailed synthetic data (Student-t, 2 degrees of freedom):
    relative L2 error ||w - Q^-1(Q(w))|| / ||w|| over all weight tensors, with one scale per
    block vs one scale per tensor, INT8 and INT4. Each tensor is quantized on its own.
(b) Block-size sweep: error vs scale overhead (4 bytes of fp32 scale per block, relative to
    the value bytes). The README's choice of the default block size quotes this table.

Writes JSON (and a PNG of the sweep when matplotlib is installed).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

# Run as a script from anywhere: make the repository root importable (benchmarks.common).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, pyplot, simulate_mesh_devices, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = mesh_parser(__doc__)
    p.add_argument("--train-steps", type=int, default=150)
    p.add_argument("--block-sizes", default="32,64,128,256,512,1024,2048,4096")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    simulate_mesh_devices(args)
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zeropp_jax as zpp
    from benchmarks.common import brief_training, example_model_and_data
    from zeropp_jax.quant.quantization import dequantize_blockwise, quantize_blockwise

    model, init, data, _ = example_model_and_data(args.seed, 32)
    t0 = time.perf_counter()
    trained, losses = brief_training(model, init, data, zpp.make_mesh(args.nodes, args.local),
                                     steps=args.train_steps, seed=args.seed)
    print(f"trained {args.train_steps} steps in {time.perf_counter() - t0:.0f} s: "
          f"loss {losses[0]:.3f} -> {np.mean(losses[-10:]):.3f}")

    rng = np.random.default_rng(args.seed)
    heavy = {f"t{i}": rng.standard_t(2, size=(256, 256)).astype(np.float32) for i in range(4)}
    sources = {
        "gpt_init": jax.tree_util.tree_leaves(init),
        "gpt_trained": jax.tree_util.tree_leaves(trained),
        "student_t2": list(heavy.values()),
    }

    def rel_error(tensors, bits, block_size):
        """||w - deq(q(w))|| / ||w|| over all tensors; block_size None = per tensor."""
        num = den = 0.0
        for w in tensors:
            w = jnp.asarray(w, jnp.float32)
            bs = int(w.size) if block_size is None else block_size
            if bits == 4 and bs % 2:
                bs += 1
            d = dequantize_blockwise(quantize_blockwise(w, bits=bits, block_size=bs), jnp.float32)
            num += float(jnp.sum((w - d) ** 2))
            den += float(jnp.sum(w ** 2))
        return float(np.sqrt(num / den))

    default_block = zpp.ZeroPPConfig().block_size
    block_sizes = [int(b) for b in args.block_sizes.split(",")]
    results = {"default_block_size": default_block, "train_losses": losses,
               "block_vs_tensor": {}, "sweep": {}}
    print()
    print(f"(a) relative L2 error, block {default_block} vs one scale per tensor")
    print(f"{'weights':<12} {'bits':>4} {'block':>10} {'per-tensor':>11} {'ratio':>7}")
    for name, tensors in sources.items():
        for bits in (8, 4):
            e_block = rel_error(tensors, bits, default_block)
            e_tensor = rel_error(tensors, bits, None)
            results["block_vs_tensor"][f"{name}/int{bits}"] = {
                "block": e_block, "per_tensor": e_tensor, "ratio": e_tensor / e_block}
            print(f"{name:<12} {bits:>4} {e_block:>10.5f} {e_tensor:>11.5f} "
                  f"{e_tensor / e_block:>6.2f}x")

    print()
    print("(b) block-size sweep: relative L2 error; overhead = scale bytes / value bytes")
    header = f"{'block':>6} {'ovh int8':>9} {'ovh int4':>9}" + "".join(
        f" {n + '/' + str(b):>17}" for n in sources for b in (8, 4))
    print(header)
    for bs in block_sizes:
        row = {"overhead_int8": 4 / bs, "overhead_int4": 8 / bs}
        line = f"{bs:>6} {4 / bs:>8.2%} {8 / bs:>8.2%}"
        for name, tensors in sources.items():
            for bits in (8, 4):
                e = rel_error(tensors, bits, bs)
                row[f"{name}/int{bits}"] = e
                line += f" {e:>17.5f}"
        results["sweep"][bs] = row
        print(line)

    print()
    write_json(args.out, "quantization.json", results)
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in sources:
        for bits in (8, 4):
            ys = [results["sweep"][bs][f"{name}/int{bits}"] for bs in block_sizes]
            ax.plot([4 / bs for bs in block_sizes], ys, marker="o", label=f"{name} INT{bits}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("scale overhead (fp32 scale bytes / INT8 value bytes)")
    ax.set_ylabel("relative L2 error")
    ax.set_title("Block-size sweep (points: block 4096 ... 32, left to right)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    png = args.out / "quantization_sweep.png"
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
