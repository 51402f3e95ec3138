"""Bring your own model: a transformers Flax GPT-2, trained with ZeRO-3 as transformers'
own Flax example scripts train it.

    .venv/bin/pip install 'transformers>=4.44,<5'     # the last series that ships Flax
    .venv/bin/python examples/hf_gpt2.py --nodes 2 --local 4 --steps 30

The model is randomly initialised from a small config (no download). Nothing in the model
changes: ``TrainState.create`` takes the ``FlaxGPT2LMHeadModel`` itself, finds its blocks
(``transformer/h/N``) by the default wrap policy and prints the unit table; the step calls
``state.apply_fn(**batch, params=params, dropout_rng=rng, train=True)`` exactly as
``run_clm_flax.py`` calls ``state.apply_fn``. The tied LM head (which reads
``transformer/wte`` through ``.variables``) gets the exact sum of both gradients.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=32)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--zeropp", action="store_true", help="qwZ + hpZ + qgZ instead of ZeRO-3")
    args = p.parse_args(argv)

    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)  # CPU only; a no-op with real GPUs
    import jax
    import numpy as np
    import optax

    try:
        from transformers import FlaxGPT2LMHeadModel, GPT2Config
    except ImportError:
        print("needs transformers 4.x with Flax: .venv/bin/pip install "
              "'transformers>=4.44,<5'", file=sys.stderr)
        return 2

    config = GPT2Config(vocab_size=256, n_positions=args.seq_len, n_embd=args.d_model,
                        n_layer=args.layers, n_head=4)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    mesh = zpp.make_mesh(nodes=args.nodes, local=args.local)
    cfg = zpp.ZeroPPConfig.zeropp() if args.zeropp else zpp.ZeroPPConfig.zero3()
    state = zpp.TrainState.create(model=model, tx=optax.adamw(args.lr), mesh=mesh, config=cfg)
    print(state.describe())

    @zpp.train_step
    def step(state, batch, rng):
        def loss_fn(params):
            logits = state.apply_fn(input_ids=batch["input_ids"],
                                    attention_mask=batch["attention_mask"],
                                    params=params, dropout_rng=rng, train=True).logits
            losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch["labels"])
            return zpp.token_mean(losses, batch["attention_mask"])

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    # A learnable toy language: each sequence counts up from a random start (mod 256).
    rng = np.random.default_rng(0)

    def batch() -> dict:
        start = rng.integers(0, 256, (args.batch, 1))
        ids = ((start + np.arange(args.seq_len + 1)) % 256).astype(np.int32)
        return {"input_ids": ids[:, :-1], "labels": ids[:, 1:],
                "attention_mask": np.ones((args.batch, args.seq_len), np.int32)}

    key = jax.random.PRNGKey(0)
    first = last = None
    t0 = time.perf_counter()
    for i in range(args.steps):
        key, sub = jax.random.split(key)
        state, metrics = step(state, batch(), sub)
        loss = float(metrics["loss"])
        first = loss if first is None else first
        last = loss
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {loss:.4f}")
    print(f"loss {first:.4f} -> {last:.4f} in {args.steps} steps "
          f"({(time.perf_counter() - t0) / args.steps * 1e3:.0f} ms/step incl. compile)")
    params = state.consolidate()  # plain params: model.save_pretrained works on them
    model.params = params
    return 0 if last < first else 1


if __name__ == "__main__":
    sys.exit(main())
