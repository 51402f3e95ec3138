"""qgZ's one-shot quantization vs a ring that requantizes at every hop, on real gradients.

    python benchmarks/qgz_accuracy.py            # about a minute on 2 CPU cores

Per-device gradients of the example GPT (each device's own micro-batch of stdlib text), at
initialization and after a short ZeRO-3 training run, are reduce-scattered three ways and
compared with the exact fp64 sum (relative L2 error over all slices):

* ``qgz``: zeropp_jax's qgz_reduce_scatter on the simulated ``nodes x local`` mesh: one
  quantization per hop (2 hops), fp32 sums in between;
* ``ring``: a ring reduce-scatter over all P devices that quantizes and dequantizes the
  travelling partial sum at each of its P-1 hops (the naive way to put a quantized collective
  in a ring), simulated on the host with the same quantizer;
* ``bf16 ring``: the same ring carrying bf16 instead of quantized blocks (what a bf16
  reduce-scatter's rounding costs), for scale.

Paper section 3.3.1: error compounds with the number of requantizations, so the one-shot
scheme must come out well ahead of the ring. Writes JSON.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# Run as a script from anywhere: make the repository root importable (benchmarks.common).
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, simulate_mesh_devices, write_json  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = mesh_parser(__doc__)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    simulate_mesh_devices(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeropp_jax as zpp
    from benchmarks.common import brief_training, example_model_and_data
    from pallas_kernels.quantize import dequantize_reference, quantize_reference
    from zeropp_demo.gpt import loss_fn
    from zeropp_jax.comm.qgz import qgz_reduce_scatter

    num = args.nodes * args.local
    bs = args.block_size
    mesh = zpp.make_mesh(args.nodes, args.local)
    model, init, data, batch0 = example_model_and_data(args.seed, 8 * num)
    trained, _ = brief_training(model, init, data, mesh, steps=args.train_steps, seed=args.seed)

    @jax.jit
    def flat_grad(params, batch):
        g = jax.grad(lambda p: loss_fn(model.apply({"params": p}, batch[:, :-1]), batch[:, 1:]))(params)
        return jnp.concatenate([jnp.ravel(x) for x in jax.tree_util.tree_leaves(g)])

    def device_grads(params) -> np.ndarray:
        """[P, n]: device d's gradient on its own micro-batch, n padded to P * block."""
        rows = [np.asarray(flat_grad(params, batch0[d * 8:(d + 1) * 8])) for d in range(num)]
        g = np.stack(rows)
        pad = -g.shape[1] % (num * bs)
        return np.pad(g, ((0, 0), (0, pad)))

    def q_dq(v: np.ndarray, bits: int) -> np.ndarray:
        vals, scales = quantize_reference(jnp.asarray(v, jnp.float32), bits=bits, block_size=bs)
        return np.asarray(dequantize_reference(vals, scales, bits=bits, block_size=bs,
                                               dtype=jnp.float32), np.float64)

    def ring(g: np.ndarray, carry) -> np.ndarray:
        """Ring reduce-scatter; ``carry`` rounds the partial sum before every hop."""
        m = g.shape[1] // num
        chunks = g.reshape(num, num, m).astype(np.float64)  # [device, chunk, m]
        out = np.zeros((num, m))
        for c in range(num):  # chunk c starts at device c+1 and ends at device c
            acc = chunks[(c + 1) % num, c]
            for t in range(2, num + 1):
                acc = carry(acc) + chunks[(c + t) % num, c]
            out[c] = acc
        return out

    def qgz(g: np.ndarray, bits: int, on=None, single_node="reduce_scatter") -> np.ndarray:
        on = mesh if on is None else on
        fn = jax.jit(jax.shard_map(
            lambda v: qgz_reduce_scatter(v, bits=bits, block_size=bs, single_node=single_node),
            mesh=on,
            in_specs=P(("node", "local")), out_specs=P(("node", "local"))))
        x = jax.device_put(jnp.asarray(g, jnp.float32).reshape(-1),
                           NamedSharding(on, P(("node", "local"))))
        return np.asarray(fn(x), np.float64).reshape(num, -1)

    def bf16(v: np.ndarray) -> np.ndarray:
        return np.asarray(jnp.asarray(v, jnp.bfloat16), np.float64)

    results = {"nodes": args.nodes, "local": args.local, "block_size": bs, "errors": {}}
    print(f"relative L2 error of the reduce-scatter vs the exact sum "
          f"({args.nodes}x{args.local} devices, block {bs})")
    print(f"{'gradients':<10} {'scheme':<22} {'INT4':>10} {'INT8':>10}")
    for name, params in (("init", init), (f"step {args.train_steps}", trained)):
        g = device_grads(params)
        exact = g.astype(np.float64).sum(axis=0).reshape(num, -1)

        def rel(a: np.ndarray) -> float:
            return float(np.linalg.norm(a - exact) / np.linalg.norm(exact))

        row = {}
        for scheme in ("qgz (1 quantization/hop)", f"ring ({num - 1} requantizations)"):
            errs = {}
            for bits in (4, 8):
                if scheme.startswith("qgz"):
                    errs[bits] = rel(qgz(g, bits))
                else:
                    errs[bits] = rel(ring(g, lambda v, b=bits: q_dq(v, b)))
            row[scheme] = errs
            print(f"{name:<10} {scheme:<22} {errs[4]:>10.5f} {errs[8]:>10.5f}")
        row["bf16 ring"] = rel(ring(g, bf16))
        print(f"{name:<10} {'bf16 ring':<22} {row['bf16 ring']:>10.5f}")
        ratio4 = row[f"ring ({num - 1} requantizations)"][4] / row["qgz (1 quantization/hop)"][4]
        row["ring_over_qgz_int4"] = ratio4
        print(f"{name:<10} ring / qgz at INT4: {ratio4:.2f}x")
        # One node: what quantizing the only (intra-node) hop would cost in accuracy. The
        # default falls back to the unquantized reduce-scatter (error 0 in fp32).
        one_node = zpp.make_mesh(1, num)
        row["single_node_quantized_int4"] = rel(qgz(g, 4, one_node, "quantize"))
        row["single_node_fallback"] = rel(qgz(g, 4, one_node))
        print(f"{name:<10} 1x{num}: quantized local hop INT4 "
              f"{row['single_node_quantized_int4']:.5f}, fallback "
              f"{row['single_node_fallback']:.5f}")
        results["errors"][name] = row

    write_json(args.out, "qgz_accuracy.json", results)


if __name__ == "__main__":
    main()
