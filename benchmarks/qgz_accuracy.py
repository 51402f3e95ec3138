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
scheme must come out well ahead of the ring.

Beyond the paper (the "Beyond ZeRO++" issue), on the same gradients and weights:

* ``reduce_scatter``: qgZ with Hadamard smoothing (``hadamard=True``), with stochastic
  rounding, and with both, INT4 and INT8; for stochastic rounding also the error of the
  mean over 8 keys (rounding is unbiased, so the mean moves towards the exact sum, where
  rounding to nearest would keep its error);
* ``gradient_quantization``: one quantization of each device's gradient in each wire
  format (INT4 / INT8, rotated or not, FP8 e4m3 / e5m2 with block scales), relative L2:
  what decides between e4m3 and e5m2 for gradients;
* ``weight_gather``: qwZ's round trip of the trained weights in each format (INT8, INT4,
  FP8 e4m3 / e5m2, each with and without the rotation), relative L2, and of heavy-tailed
  synthetic weights of the same size (the rotation helps heavy tails, hurts light ones).
  A shard is whole blocks, so quantizing the flat weights block by block is exactly what
  the gather delivers.

And error feedback (``error_feedback``): the per-step and accumulated error of qgZ's
reduce-scatter over ``--train-steps`` steps of one training trajectory, with and without
the kept errors added back, with fixed and per-step Hadamard signs (``feedback_study``).

Writes JSON (``--out``/qgz_accuracy.json).
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
    from zeropp_jax.core.mesh import MeshInfo
    from benchmarks.common import brief_training, example_model_and_data
    from pallas_kernels.quantize import dequantize_reference, quantize_reference
    from zeropp_demo.gpt import loss_fn
    from zeropp_jax.comm.qgz import qgz_reduce_scatter
    from zeropp_jax.quant.fp8 import dequantize_fp8_flat, quantize_fp8_flat
    from zeropp_jax.quant.rotation import hadamard_signs

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

    signs = hadamard_signs(None, bs)  # what the transports use (the fixed key)

    def q_dq(v: np.ndarray, bits: int, rotate: bool = False) -> np.ndarray:
        kw = dict(bits=bits, block_size=bs, signs=signs if rotate else None)
        vals, scales = quantize_reference(jnp.asarray(v, jnp.float32), **kw)
        return np.asarray(dequantize_reference(vals, scales, dtype=jnp.float32, **kw),
                          np.float64)

    def fp8_dq(v: np.ndarray, fmt: str, rotate: bool = False) -> np.ndarray:
        from pallas_kernels.hadamard import rotate_reference, unrotate_reference

        x = jnp.asarray(v, jnp.float32)
        if rotate:
            x = rotate_reference(x, signs, block_size=bs)
        y = dequantize_fp8_flat(*quantize_fp8_flat(x, block_size=bs, fmt=fmt), block_size=bs)
        if rotate:
            y = unrotate_reference(y, signs, block_size=bs)
        return np.asarray(y, np.float64)

    def formats(v: np.ndarray) -> dict:
        """Relative L2 error of one quantization of ``v`` in each wire format."""
        ref = np.asarray(v, np.float64)

        def rel1(a):
            return float(np.linalg.norm(a - ref) / np.linalg.norm(ref))

        out = {}
        for rotate in (False, True):
            tag = " + hadamard" if rotate else ""
            out[f"int4{tag}"] = rel1(q_dq(v, 4, rotate))
            out[f"int8{tag}"] = rel1(q_dq(v, 8, rotate))
            out[f"fp8 e4m3{tag}"] = rel1(fp8_dq(v, "e4m3", rotate))
            out[f"fp8 e5m2{tag}"] = rel1(fp8_dq(v, "e5m2", rotate))
        return out

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

    def qgz(g: np.ndarray, bits: int, on=None, single_node="reduce_scatter", *,
            hadamard=False, stochastic_rounding=False, keys=(None,)) -> np.ndarray:
        """qgZ's result; with several ``keys``, the mean of one run per key."""
        on = mesh if on is None else on
        spec = P(("node", "local"))
        fn = jax.jit(jax.shard_map(
            lambda v, k: qgz_reduce_scatter(v, bits=bits, block_size=bs, single_node=single_node,
                                            hadamard=hadamard,
                                            stochastic_rounding=stochastic_rounding,
                                            key=None if k is None else k[0]),
            mesh=on, in_specs=(spec, P()), out_specs=spec))
        x = jax.device_put(jnp.asarray(g, jnp.float32).reshape(-1), NamedSharding(on, spec))
        runs = [np.asarray(fn(x, None if k is None else jax.random.key(k)[None]), np.float64)
                for k in keys]
        return np.mean(runs, axis=0).reshape(num, -1)

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

        # Beyond the paper: smoothing and stochastic rounding in qgZ, on the same gradients.
        variants = {
            "qgz": {},
            "qgz + hadamard": dict(hadamard=True),
            "qgz + stochastic rounding": dict(stochastic_rounding=True),
            "qgz + hadamard + stochastic rounding": dict(hadamard=True,
                                                         stochastic_rounding=True),
            "qgz + stochastic rounding, mean of 8 keys": dict(stochastic_rounding=True,
                                                              keys=tuple(range(8))),
            "qgz + hadamard + stochastic rounding, mean of 8 keys": dict(
                hadamard=True, stochastic_rounding=True, keys=tuple(range(8))),
        }
        rs = {}
        for label, opts in variants.items():
            rs[label] = {bits: rel(qgz(g, bits, **opts)) for bits in (4, 8)}
            print(f"{name:<10} {label:<52} {rs[label][4]:>10.5f} {rs[label][8]:>10.5f}")
        results.setdefault("reduce_scatter", {})[name] = rs
        # One quantization of each device's gradient, per wire format (mean over devices).
        per_device = [formats(g[d]) for d in range(num)]
        gq = {k: float(np.mean([r[k] for r in per_device])) for k in per_device[0]}
        results.setdefault("gradient_quantization", {})[name] = gq
        print(f"{name:<10} one quantization of a device gradient: "
              + ", ".join(f"{k} {v:.5f}" for k, v in gq.items()))

    # qwZ's weight round trip of the trained weights, per format.
    flat = np.concatenate([np.ravel(np.asarray(x, np.float32))
                           for x in jax.tree_util.tree_leaves(trained)])
    flat = np.pad(flat, (0, -flat.size % bs))
    # The rotation makes every block's distribution near-Gaussian: it helps heavy-tailed
    # blocks (outliers) and hurts light-tailed ones (near-uniform blocks, which absmax
    # scaling already suits). Excess kurtosis says which kind the trained weights are; a
    # heavy-tailed synthetic set of the same size shows the other side.
    blocks = flat.reshape(-1, bs).astype(np.float64)
    centred = blocks - blocks.mean(axis=1, keepdims=True)
    var = np.mean(centred**2, axis=1)
    live = var > 0  # all-equal blocks (none expected) have no kurtosis
    kurtosis = float(np.median(np.mean(centred[live] ** 4, axis=1) / var[live] ** 2 - 3))
    heavy = np.random.default_rng(args.seed).standard_t(3, flat.size).astype(np.float32)
    results["weight_gather"] = {"trained": formats(flat),
                                "trained_median_block_excess_kurtosis": kurtosis,
                                "student_t3_synthetic": formats(heavy)}
    for label in ("trained", "student_t3_synthetic"):
        print(f"weights ({label}), relative L2 of qwZ's round trip: "
              + ", ".join(f"{k} {v:.5f}" for k, v in results["weight_gather"][label].items()))
    print(f"trained weights' median excess kurtosis per block: {kurtosis:.2f} "
          "(0: Gaussian, -1.2: uniform, > 0: heavy tails)")

    results["error_feedback"] = feedback_study(args, model, init, data, flat_grad, mesh)
    write_json(args.out, "qgz_accuracy.json", results)


def feedback_study(args, model, init, data, flat_grad, mesh) -> dict:
    """qgZ's error feedback over a training trajectory: per-step and accumulated error.

    ``--train-steps`` steps of fp32 Adam on the exact mean gradient (one trajectory for
    every variant, so the variants see the same gradients); at each step every device's
    gradient (its own 8 rows) goes through qgZ's transport, with the kept errors carried
    from step to step (stored in FP8, as in training) for the feedback variants. Reported
    per variant: the relative L2 error of the step's reduce-scatter against the exact sum
    (``per_step``), and of the sum of all reduce-scatters so far against the sum of the
    exact ones (``accumulated``: what the parameters integrate; error feedback bounds it by
    one step's kept error, without feedback it grows with the steps).
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeropp_jax as zpp
    from benchmarks.common import EXAMPLE_GPT
    from zeropp_demo.data import sample_batch
    from zeropp_jax.comm.transports import gradient_transport

    num = args.nodes * args.local
    bs = args.block_size
    spec = P(("node", "local"))
    variants = {
        "qgz": {},
        "qgz + hadamard": dict(qgz_hadamard=True),
        "qgz + hadamard, per-step signs": dict(qgz_hadamard=True, qgz_signs="per_step"),
        "qgz + error feedback": dict(qgz_error_feedback=True),
        "qgz + hadamard + error feedback": dict(qgz_hadamard=True, qgz_error_feedback=True),
        "qgz + hadamard + error feedback, per-step signs": dict(
            qgz_hadamard=True, qgz_error_feedback=True, qgz_signs="per_step"),
    }
    n = None
    runs = {}
    for label, opts in variants.items():
        t = gradient_transport(zpp.ZeroPPConfig.zeropp(block_size=bs, **opts))
        runs[label] = {"transport": t, "kept": None, "sum": 0.0, "per_step": [],
                       "accumulated": []}
    params = init
    tx = optax.adam(3e-3)
    opt_state = tx.init(params)
    exact_sum = 0.0
    fns = {}
    for step in range(args.train_steps):
        batch = sample_batch(data, 8 * num, EXAMPLE_GPT.seq_len, seed=args.seed + 100,
                             step=step)
        rows = [np.asarray(flat_grad(params, batch[d * 8:(d + 1) * 8])) for d in range(num)]
        g = np.stack(rows)
        if n is None:
            n = g.shape[1] + (-g.shape[1] % (num * bs))
        g = np.pad(g, ((0, 0), (0, n - g.shape[1])))
        exact = g.astype(np.float64).sum(axis=0)
        exact_sum = exact_sum + exact
        x = jax.device_put(jnp.asarray(g.reshape(-1), jnp.float32), NamedSharding(mesh, spec))
        for label, r in runs.items():
            t = r["transport"]
            if t.error_feedback:
                if r["kept"] is None:
                    per = t.feedback_specs(n, MeshInfo(args.nodes, args.local))
                    r["kept"] = tuple(jax.device_put(jnp.zeros((num * s.shape[0],), s.dtype),
                                                     NamedSharding(mesh, spec)) for s in per)
                if label not in fns:
                    fns[label] = jax.jit(jax.shard_map(
                        lambda v, k, st, t=t: t.reduce_sum_feedback(v, k, None, st[0]),
                        mesh=mesh, in_specs=(spec, spec, P()), out_specs=(spec, spec)))
                out, r["kept"] = fns[label](x, r["kept"], jnp.array([step], jnp.int32))
            else:
                if label not in fns:
                    fns[label] = jax.jit(jax.shard_map(
                        lambda v, st, t=t: t.reduce_sum(v, None, st[0]),
                        mesh=mesh, in_specs=(spec, P()), out_specs=spec))
                out = fns[label](x, jnp.array([step], jnp.int32))
            sent = np.asarray(out, np.float64)
            r["sum"] = r["sum"] + sent
            r["per_step"].append(float(np.linalg.norm(sent - exact) / np.linalg.norm(exact)))
            r["accumulated"].append(float(np.linalg.norm(r["sum"] - exact_sum)
                                          / np.linalg.norm(exact_sum)))
        size = sum(int(np.size(a)) for a in jax.tree_util.tree_leaves(params))
        mean_grad = _unflatten_like(params, exact[:size] / num)
        updates, opt_state = tx.update(mean_grad, opt_state, params)
        params = optax.apply_updates(params, updates)
    last = args.train_steps - 1
    out = {"steps": args.train_steps, "nodes": args.nodes, "local": args.local,
           "block_size": bs, "variants": {}}
    print(f"\nerror feedback over {args.train_steps} steps of one trajectory "
          f"({args.nodes}x{args.local}, INT4, block {bs}): relative L2 error at the last step")
    print(f"{'variant':<50} {'per step':>10} {'accumulated':>12}")
    for label, r in runs.items():
        out["variants"][label] = {"per_step": r["per_step"], "accumulated": r["accumulated"]}
        print(f"{label:<50} {r['per_step'][last]:>10.5f} {r['accumulated'][last]:>12.5f}")
    base = runs["qgz"]
    for label in runs:
        out["variants"][label]["per_step_over_qgz"] = (
            runs[label]["per_step"][last] / base["per_step"][last])
        out["variants"][label]["accumulated_over_qgz"] = (
            runs[label]["accumulated"][last] / base["accumulated"][last])
    return out


def _unflatten_like(tree, flat):
    """A flat fp64 vector -> ``tree``'s structure (leaf order of tree_leaves), fp32."""
    import jax
    import numpy as np

    leaves, treedef = jax.tree_util.tree_flatten(tree)
    out, start = [], 0
    for leaf in leaves:
        size = int(np.size(leaf))
        out.append(np.asarray(flat[start:start + size], np.float32).reshape(np.shape(leaf)))
        start += size
    return jax.tree_util.tree_unflatten(treedef, out)


if __name__ == "__main__":
    main()
