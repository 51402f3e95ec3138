"""Models we did not write, unmodified: per-device memory of a ZeRO-3 step with the default
wrap policy, against the previous default (every direct child of the root a unit) and a
plain one-device ``jax.jit`` step (what data parallelism keeps on every device).

    .venv/bin/python benchmarks/models.py --nodes 2 --local 4       # about 2 minutes

For each model (transformers' Flax GPT-2 and BERT, an NNX transformer; 8 layers, d 256,
random init), bf16 compute, AdamW: the compiled step's argument bytes per device
(parameters + optimizer state + the device's batch) and temp bytes (everything the step
allocates: gathered weights, activations, gradients), from ``memory_analysis()``; and the
largest unit's share of the parameters. Writes ``models.json`` to ``--out``.
"""

from __future__ import annotations

import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, simulate_mesh_devices, write_json  # noqa: E402



def main() -> None:
    p = mesh_parser(__doc__)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=64)
    args = p.parse_args()
    simulate_mesh_devices(args)
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import zeropp_jax as zpp

    warnings.filterwarnings("ignore")
    n = args.nodes * args.local
    L, D, S, V = args.layers, args.d_model, args.seq_len, 4096
    B = n  # one sequence per device: weights, not activations, dominate

    def hf_gpt2():
        from transformers import FlaxGPT2LMHeadModel, GPT2Config
        return FlaxGPT2LMHeadModel(GPT2Config(vocab_size=V, n_positions=S, n_embd=D,
                                              n_layer=L, n_head=4), seed=0)

    def hf_bert():
        from transformers import BertConfig, FlaxBertForMaskedLM
        return FlaxBertForMaskedLM(BertConfig(vocab_size=V, hidden_size=D,
                                              num_hidden_layers=L, num_attention_heads=4,
                                              intermediate_size=4 * D,
                                              max_position_embeddings=S), seed=0)

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.norm = nnx.LayerNorm(D, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(4, D, decode=False, rngs=rngs)
            self.up = nnx.Linear(D, 4 * D, rngs=rngs)
            self.down = nnx.Linear(4 * D, D, rngs=rngs)

        def __call__(self, x):
            x = x + self.attn(self.norm(x))
            return x + self.down(jax.nn.gelu(self.up(x)))

    class NNXLM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(V, D, rngs=rngs)
            self.blocks = nnx.List([Block(rngs) for _ in range(L)])

        def __call__(self, ids):
            x = self.embed(ids)
            for b in self.blocks:
                x = b(x)
            return self.embed.attend(x)

    ids = np.random.default_rng(0).integers(0, V, (B, S + 1)).astype(np.int32)
    mesh = zpp.make_mesh(nodes=args.nodes, local=args.local)
    cfg = zpp.ZeroPPConfig.zero3()
    tx = optax.adamw(1e-3)

    def hf_logits(apply, params, x):
        return apply(input_ids=x, params=params, train=False).logits

    def loss_of(logits, y):
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    results = {"devices": n, "layers": L, "d_model": D, "models": {}}
    print(f"{'model':<12} {'units':<10} {'#':>3} {'largest':>8} {'args B/dev':>12} "
          f"{'temp B/dev':>12} {'args+temp':>12} {'vs plain':>9}")
    for name, make in [("hf_gpt2", hf_gpt2), ("hf_bert", hf_bert),
                       ("nnx_lm", lambda: NNXLM(nnx.Rngs(0)))]:
        model = make()
        is_hf = not isinstance(model, nnx.Module)
        rows = {}
        # Plain one-device step: full bf16-compute model, fp32 params and AdamW state.
        if is_hf:
            params = model.params
            plain_apply = lambda p, x: hf_logits(model, p, x)  # noqa: E731
        else:
            graphdef, params, rest = nnx.split(model, nnx.Param, ...)
            plain_apply = lambda p, x: nnx.merge(graphdef, p, rest)(x)  # noqa: E731
        opt = tx.init(params)

        def plain_step(p, o, batch):
            def loss(p):
                half = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), p)
                return loss_of(plain_apply(half, batch[:, :-1]), batch[:, 1:])

            g = jax.grad(loss)(p)
            u, o = tx.update(g, o, p)
            return optax.apply_updates(p, u), o

        with jax.default_device(jax.devices()[0]):
            mem = jax.jit(plain_step).lower(params, opt, ids[:1]).compile().memory_analysis()
        rows["plain (1 device)"] = (1, 1.0, mem.argument_size_in_bytes, mem.temp_size_in_bytes)
        for units in (None, "children"):
            state = zpp.TrainState.create(model=model, tx=tx, mesh=mesh, config=cfg,
                                          units=units)
            table, total = state.engine.unit_table()
            largest = max(r[1] for r in table) / total

            @zpp.train_step
            def step(state, batch):
                def loss(p):
                    if is_hf:
                        logits = hf_logits(state.apply_fn, p, batch[:, :-1])
                    else:
                        logits = state.apply_fn({"params": p}, batch[:, :-1])
                    return loss_of(logits, batch[:, 1:])

                value, g = jax.value_and_grad(loss)(state.params)
                return state.apply_gradients(grads=g), value

            mem = step.lower(state, ids).compile().memory_analysis()
            rows["auto" if units is None else units] = (
                len(table), largest, mem.argument_size_in_bytes, mem.temp_size_in_bytes)
        base = sum(rows["plain (1 device)"][2:])
        for label, (count, largest, a, t) in rows.items():
            print(f"{name:<12} {label:<10} {count:>3} {100 * largest:>7.0f}% {a:>12,} "
                  f"{t:>12,} {a + t:>12,} {(a + t) / base:>8.3f}x")
        results["models"][name] = {k: {"units": c, "largest_share": s, "argument_bytes": a,
                                       "temp_bytes": t}
                                   for k, (c, s, a, t) in rows.items()}
    write_json(args.out, "models.json", results)


if __name__ == "__main__":
    main()
