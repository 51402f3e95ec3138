"""What a unit's gather layout costs a scanned stack's compute on an H100 cluster, compiled
from this host (no GPU): one flat all-gather per layer sliced into its weights, as the
engine gathers today, against one all-gather per weight.

    JAX_PLATFORMS=cpu .venv-cuda/bin/python -m benchmarks.gpu_cluster.gather_layout

A bare ZeRO-3 step, not the engine's: 32 scanned layers of a Llama 7B's weight shapes
(four ``d x d`` attention projections, a SwiGLU MLP's three ``d x ffn``), bf16 weights
gathered over all 128 GPUs of 16x8 from fp32 shards, the matmuls kept for backward,
gradients reduce-scattered by the all-gathers' transpose. Each layout's device shard holds
the same elements, ordered differently:

* ``flat``: the layer's weights flattened one after another and cut into 128 equal
  slices; the gathered buffer is sliced back into weights (XLA copies each slice);
* ``per_weight``: each weight cut into 128 slices and device ``d`` holding slice ``d`` of
  every weight; one all-gather per weight, each gathering straight into that weight;
* ``per_weight_combined``: the same with XLA's all-gather combiner allowed to merge them
  (``xla_gpu_all_gather_combine_threshold_bytes``): one collective per layer again, with a
  buffer per weight.

Every program is compiled with ``zpp.gpu_overlap_flags()`` and replayed as
``make gpu-cluster`` replays its rows (``measure.schedule``, 400 Gbit/s per GPU). Writes
``gather_layout_h100.json`` (``--out``) and prints a table.
"""

from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

from benchmarks.cli import add_out_argument, write_json  # noqa: E402

NODES, LOCAL, LAYERS, D, FFN, TOKENS = 16, 8, 32, 4096, 11008, 2048
SHAPES = [(D, D)] * 4 + [(D, FFN), (D, FFN), (FFN, D)]
AXES = ("node", "local")
LAYOUTS = {"flat": {}, "per_weight": {},
           "per_weight_combined": {"xla_gpu_all_gather_combine_threshold_bytes": 1 << 30}}


def compile_layout(layout: str) -> str:
    """The compiled step's HLO text for one layout."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import zeropp_jax as zpp
    from benchmarks.gpu_cluster.target import cluster_mesh

    n = NODES * LOCAL
    sizes = [math.prod(s) for s in SHAPES]
    slices = [s // n for s in sizes]  # every weight splits evenly over 128 devices
    at = np.cumsum([0, *slices])
    flat_at = np.cumsum([0, *sizes])

    def gather(shard: jax.Array) -> list[jax.Array]:
        if layout == "flat":
            full = jax.lax.all_gather(shard, AXES, tiled=True)
            return [full[flat_at[i]:flat_at[i + 1]].reshape(s) for i, s in enumerate(SHAPES)]
        return [jax.lax.all_gather(shard[at[i]:at[i + 1]], AXES, tiled=True).reshape(s)
                for i, s in enumerate(SHAPES)]

    def layer(x: jax.Array, shard: jax.Array) -> tuple[jax.Array, None]:
        q, k, v, o, gate, up, down = gather(shard.astype(jnp.bfloat16))
        x = x + (x @ q + x @ k + x @ v) @ o
        return x + (jax.nn.silu(x @ gate) * (x @ up)) @ down, None

    def loss(stack: jax.Array, x: jax.Array) -> jax.Array:
        body = jax.checkpoint(layer, policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
        x, _ = jax.lax.scan(body, x, stack)
        return jnp.mean(jnp.square(x.astype(jnp.float32)))

    mesh = cluster_mesh(NODES, LOCAL)
    step = jax.jit(jax.shard_map(jax.grad(loss), mesh=mesh, in_specs=(P(None, AXES), P()),
                                 out_specs=P(None, AXES), check_vma=False))
    stack = jax.ShapeDtypeStruct((LAYERS, sum(slices) * n), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, AXES)))
    x = jax.ShapeDtypeStruct((TOKENS, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    options = {**zpp.gpu_overlap_flags(), **LAYOUTS[layout]}
    return step.lower(stack, x).compile(options).as_text()


def measure(layout: str) -> dict:
    from benchmarks.gpu_cluster.target import H100_ROOFLINE, links
    from zeropp_jax.measure.comm_report import collectives
    from zeropp_jax.measure.schedule import compute_by_class, schedule_report

    text = compile_layout(layout)
    report = schedule_report(text, H100_ROOFLINE, links(NODES, LOCAL, 400))
    return {"layout": layout, "step_ms_400g": report.step_s * 1e3,
            "compute_ms": report.compute_s * 1e3,
            "hidden_fraction_400g": report.hidden_fraction(True),
            "all_gathers_in_program": sum(c.kind == "all-gather"
                                          for c in collectives(text, NODES * LOCAL)),
            "compute_by_class_ms": {k: v * 1e3 for k, v in
                                    compute_by_class(text, H100_ROOFLINE).items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_out_argument(p)
    args = p.parse_args()
    from benchmarks.gpu_cluster.target import DEVICE

    rows = [measure(layout) for layout in LAYOUTS]
    print(f"{'layout':<22}{'step ms 400G':>14}{'compute ms':>12}{'copies ms':>11}"
          f"{'hidden 400G':>13}{'all-gathers':>13}")
    for r in rows:
        print(f"{r['layout']:<22}{r['step_ms_400g']:>14.1f}{r['compute_ms']:>12.1f}"
              f"{r['compute_by_class_ms']['copies and layout']:>11.1f}"
              f"{r['hidden_fraction_400g']:>13.1%}{r['all_gathers_in_program']:>13}")
    write_json(args.out, "gather_layout_h100.json",
               {"device": DEVICE, "mesh": f"{NODES}x{LOCAL}", "layers": LAYERS,
                "shapes": SHAPES, "tokens": TOKENS, "rows": rows})


if __name__ == "__main__":
    main()
