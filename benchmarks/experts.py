"""Expert parallelism beside ZeRO on 8 simulated CPU devices: what each device holds and
what the step moves, against the steps a user would pick instead.

    python benchmarks/experts.py --out benchmarks/results    # about a minute

A top-2 mixture-of-experts LM (``zeropp_demo.moe``: 8 experts a layer, 2 MoE layers) is
compiled, not timed (XLA:CPU has no asynchronous collectives: overlap shows only on a GPU),
for:

* a plain ``jax.jit`` data-parallel step (parameters and Adam state replicated, batch split);
* ZeRO-3 on ``(2, 4)``: every expert gathered on every device for its layer;
* ZeRO-3 with experts on ``(2, 2, 2)`` and ``(2, 1, 4)`` (2 or 4 devices an expert group);
* ZeRO++ (qwZ, hpZ, qgZ) with experts on ``(2, 2, 2)``.

Per device: the compiled step's argument and temporary bytes (XLA's memory analysis), and
one MoE layer's expert weights it holds gathered while the layer runs; per step: the bytes
moved inside and across nodes, from the compiled program (``comm_report``), split by the
axes the collectives span (``"data"``: ZeRO's, ``"expert"``: the tokens' all-to-alls and
the dense weights' gathers inside an expert group).
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import add_out_argument, write_json  # noqa: E402

MODEL = dict(vocab_size=256, seq_len=64, d_model=64, hidden=256, experts=8, capacity=20,
             layers=2)
BATCH = 32  # sequences per step: 4 a device


def _step_memory(compiled) -> tuple[float, float]:
    stats = compiled.memory_analysis()
    return float(stats.argument_size_in_bytes), float(stats.temp_size_in_bytes)


def rows() -> list[dict]:
    import jax
    import numpy as np
    import optax
    import flax.linen as nn

    import zeropp_jax as zpp
    from zeropp_demo.gpt import lm_train_step, loss_fn
    from zeropp_demo.moe import MOE_RULES, MoEConfig, MoELM
    from zeropp_jax.measure.comm_report import comm_report

    cfg = MoEConfig(**MODEL)
    model = MoELM(cfg)
    batch = np.random.default_rng(0).integers(
        0, cfg.vocab_size, (BATCH, cfg.seq_len + 1)).astype(np.int32)
    variables = model.init(jax.random.key(0), batch[:2, :-1])
    plain = nn.meta.unbox(variables["params"])
    expert_bytes = sum(x.size * 4 for p, x in jax.tree_util.tree_leaves_with_path(plain)
                       if jax.tree_util.keystr(p).endswith(("'wi']", "'wo']")))
    out = []

    # The plain jax.jit data-parallel step.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("data",))
    rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    tx = optax.adamw(3e-4)
    params = jax.device_put(plain, rep)
    opt = jax.device_put(tx.init(plain), rep)
    data = jax.device_put(batch, jax.sharding.NamedSharding(
        mesh, jax.sharding.PartitionSpec("data")))

    @jax.jit
    def dp_step(params, opt, batch):
        loss, g = jax.value_and_grad(lambda p: loss_fn(
            model.apply({"params": p}, batch[:, :-1]), batch[:, 1:]))(params)
        updates, opt = tx.update(g, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    compiled = dp_step.lower(params, opt, data).compile()
    args, temp = _step_memory(compiled)
    report = comm_report(compiled.as_text(), (2, 4))
    layer_experts = expert_bytes / cfg.layers  # one MoE layer's experts, fp32
    out.append(dict(setup="jax.jit data parallel", mesh="8", arguments=args, temporaries=temp,
                    gathered_experts=float(layer_experts), by_axis=report.by_axis(),
                    cross_node_bytes_per_node=report.cross_node_bytes_per_node,
                    intra_node_bytes=report.intra_node_bytes))

    setups = [("ZeRO-3", (2, 4, 1), zpp.ZeroPPConfig.zero3()),
              ("ZeRO-3 + experts", (2, 2, 2), zpp.ZeroPPConfig.zero3()),
              ("ZeRO-3 + experts", (2, 1, 4), zpp.ZeroPPConfig.zero3()),
              ("ZeRO++ + experts", (2, 2, 2), zpp.ZeroPPConfig.zeropp())]
    step = lm_train_step()
    for name, shape, config in setups:
        mesh = zpp.make_mesh(shape[0], shape[1], expert=shape[2])
        config = dataclasses.replace(config, compute_dtype="float32")
        state = zpp.TrainState.create(model=model, params=variables, tx=tx, mesh=mesh,
                                      config=config, logical_axis_rules=MOE_RULES)
        compiled = step.lower(state, batch).compile()
        args, temp = _step_memory(compiled)
        report = comm_report(compiled.as_text(), mesh)
        # A layer's experts a device holds gathered while it runs: its 1/E of them.
        out.append(dict(setup=name, mesh="x".join(map(str, shape)), arguments=args,
                        temporaries=temp, gathered_experts=layer_experts / shape[2],
                        by_axis=report.by_axis(),
                        cross_node_bytes_per_node=report.cross_node_bytes_per_node,
                        intra_node_bytes=report.intra_node_bytes))
    return out


def table(rows: list[dict]) -> str:
    head = (f"{'setup':<24} {'mesh':>6} {'args MiB':>9} {'temp MiB':>9} {'experts KiB':>12} "
            f"{'cross B/node':>13} {'intra B':>12} {'expert-axis B':>14}")
    lines = [head]
    for r in rows:
        ex = r["by_axis"].get("expert", {}).get("intra_node_bytes", 0.0)
        lines.append(f"{r['setup']:<24} {r['mesh']:>6} {r['arguments'] / 2**20:>9.2f} "
                     f"{r['temporaries'] / 2**20:>9.2f} {r['gathered_experts'] / 2**10:>12.1f} "
                     f"{r['cross_node_bytes_per_node']:>13,.0f} {r['intra_node_bytes']:>12,.0f} "
                     f"{ex:>14,.0f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_out_argument(parser)
    args = parser.parse_args()
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(8)
    import jax

    result = {"model": MODEL, "batch": BATCH, "devices": 8,
              "platform": jax.devices()[0].platform, "jax": jax.__version__,
              "experts_rows": rows()}
    print(table(result["experts_rows"]))
    write_json(args.out, "experts.json", result)


if __name__ == "__main__":
    main()
