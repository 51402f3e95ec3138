"""Tensor parallelism beside ZeRO for a 70B-class model on 16 x 8 H100s: predicted memory
per GPU and step time at tensor-parallel degrees 1, 2, 4 and 8.

    python benchmarks/tensor_parallel.py --out benchmarks/results    # a few seconds

Llama-2-70B's shape (80 layers, d_model 8192, SwiGLU MLP of 28672, 64 heads with 8 key and
value heads, 32000-token vocabulary), one 4096-token sequence per data-parallel rank, on the
cost model's H100 cluster (``plan.presets.h100``: 16 nodes of 8 GPUs, 400 Gbit/s of network
per GPU). At degree ``T`` each node holds ``8 / T`` data-parallel ranks of ``T`` GPUs, each
rank one ``1 / T`` slice of every unit (Megatron's split), ZeRO-3 or ZeRO++ shards each slice
over the ``128 / T`` ranks that hold it. Memory is the memory model's peak per GPU
(``plan.workload.memory_breakdown``: states, gathered weights, activations, logits,
gradients), for remat "minimal" (every activation kept) and "full" (block inputs only);
step time and tokens per second per GPU are ``plan.cost_model.predict_step``'s. These are
predictions of the cost and memory models, not measurements: the overlap of 0.8 and the
achieved throughput are the presets' assumptions (``plan.presets``).
"""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import add_out_argument, write_json  # noqa: E402

DEGREES = (1, 2, 4, 8)
SEQ = 4096
NODES, GPUS = 16, 8
LLAMA_70B = dict(layers=80, d_model=8192, vocab=32000, seq_len=SEQ, ffn=28672, heads=64,
                 kv_heads=8, gated=True)


def rows() -> list[dict]:
    """One row per (remat, config, degree)."""
    import zeropp_jax as zpp
    from zeropp_jax.core.mesh import MeshInfo
    from zeropp_jax.plan import presets
    from zeropp_jax.plan.cost_model import predict_step
    from zeropp_jax.plan.workload import config_workload, memory_breakdown, transformer_shape

    hardware = presets.h100(NODES, local=GPUS)
    out = []
    for remat in ("minimal", "full"):
        for name in ("zero3", "zeropp"):
            config = getattr(zpp.ZeroPPConfig, name)(remat=remat)
            for t in DEGREES:
                shape = transformer_shape(**LLAMA_70B, tensor_parallel=t, name="Llama-2-70B")
                local = GPUS // t
                work = config_workload(config, shape, MeshInfo(NODES, local), tokens_per_device=SEQ)
                pred = predict_step(work, hardware)
                mem = memory_breakdown(config, shape, MeshInfo(NODES, local), SEQ)
                out.append({
                    "remat": remat, "config": name, "tensor_parallel": t,
                    "data_parallel": NODES * local, "memory_gib": mem.total / 2**30,
                    "states_gib": mem.states / 2**30, "gathered_gib": mem.gathered / 2**30,
                    "activations_gib": (mem.activations + mem.loss) / 2**30,
                    "step_s": pred.step_s, "compute_s": pred.compute_s,
                    "exposed_s": pred.exposed_s + pred.fixed_s,
                    "tokens_per_s_per_gpu": SEQ / t / pred.step_s,
                    "tp_intra_bytes_per_gpu": sum(
                        c.intra_bytes_per_device * c.count for c in work.collectives
                        if c.what == "tensor parallel"),
                })
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    args = p.parse_args(argv)
    table = rows()
    print(f"{'remat':<8} {'config':<7} {'TP':>3} {'GiB/GPU':>8} {'step s':>7} {'tok/s/GPU':>10}")
    for r in table:
        print(f"{r['remat']:<8} {r['config']:<7} {r['tensor_parallel']:>3} "
              f"{r['memory_gib']:>8.1f} {r['step_s']:>7.2f} {r['tokens_per_s_per_gpu']:>10.0f}")
    write_json(args.out, "tensor_parallel_70b.json", {
        "model": {"name": "Llama-2-70B", **LLAMA_70B},
        "cluster": {"nodes": NODES, "gpus_per_node": GPUS, "preset": "plan.presets.h100"},
        "tokens_per_rank": SEQ, "tp_rows": table, "predicted": True})


if __name__ == "__main__":
    main()
