"""Generation with a KV cache and hpZ: weights cross nodes once, every token stays in the node.

    python examples/generate.py --nodes 2 --local 4 --new-tokens 24
    python examples/generate.py --nodes 2 --local 4 --frozen-int8 --temperature 0.8 --top-k 40

Trains a small byte-level GPT for ``--train-steps`` ZeRO-3 steps with hpZ (so it generates
something better than noise), then generates from prompts taken from the data with
``zpp.generate`` and the model's decode-mode twin (``GPTConfig(decode=True)``): the hpZ
secondary is gathered across nodes once, then each token's step rebuilds every unit's weights
with an all-gather over ``"local"`` only, and the KV cache of each device's rows stays on that
device. Prints the comm report of both programs (cross-node bytes: the gather once, zero per
token), checks greedy tokens against one device's KV decoding of the same weights, times the
cache-less generator for comparison and shows the text. With ``--frozen-int8`` the base
weights are stored as INT8 (``quantize_frozen``) and their secondary slices stay INT8. On a CPU
machine the script simulates ``nodes * local`` devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=4)
    p.add_argument("--train-steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16, help="training batch and prompts (x devices)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--frozen-int8", action="store_true",
                   help="store every kernel frozen as INT8 (quantize_frozen) before generating")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import zeropp_jax as zpp

    zpp.simulate_cpu_devices(args.nodes * args.local)  # before any other JAX use

    import jax
    import numpy as np
    import optax

    from zeropp_jax.measure.analysis import comm_report
    from zeropp_demo.data import sample_batch, stdlib_corpus, train_val_split
    from zeropp_jax.inference.generate import (gather_secondary, generate_without_cache,
                                               lower_generation_step, reference_generate)
    from zeropp_demo.gpt import GPT, GPTConfig, lm_train_step

    length = args.prompt_len + args.new_tokens
    cfg = GPTConfig(vocab_size=256, seq_len=length, layers=args.layers, d_model=args.d_model,
                    heads=4)
    mesh = zpp.make_mesh(args.nodes, args.local)
    train, val = train_val_split(stdlib_corpus(2_000_000))
    model = GPT(cfg)
    config = zpp.ZeroPPConfig(compute_dtype=args.compute_dtype, hpz=True)

    step = lm_train_step()

    params = model.init(jax.random.PRNGKey(args.seed), np.zeros((1, length), np.int32))["params"]
    state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(3e-3), mesh=mesh,
                                  config=config)
    for i in range(args.train_steps):
        state, m = step(state, sample_batch(train, args.batch, length - 1, seed=args.seed, step=i))
    if args.train_steps:
        print(f"trained {args.train_steps} steps: loss {float(m['loss']):.3f}")
    if args.frozen_int8:
        config = zpp.ZeroPPConfig(compute_dtype=args.compute_dtype, quantize_frozen=True,
                                  hpz=True)
        state = zpp.TrainState.create(model=model, params=state.consolidate(),
                                      tx=optax.sgd(0.0), mesh=mesh, config=config,
                                      frozen=lambda path: path[-1] == "kernel")

    n = args.nodes * args.local
    prompts = sample_batch(val, n, args.prompt_len - 1, seed=args.seed + 1, step=0)
    twin = GPT(dataclasses.replace(cfg, decode=True))  # same params, KV cache
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    key=jax.random.PRNGKey(args.seed) if args.temperature > 0 else None)
    gather_rep = comm_report(gather_secondary.lower(state), mesh)
    token_rep = comm_report(lower_generation_step(state, prompts, args.new_tokens, model=twin),
                            mesh)
    secondary = gather_secondary(state)
    zpp.generate(state, prompts, args.new_tokens, model=twin, secondary=secondary, **sampling)
    t0 = time.perf_counter()
    out = np.asarray(zpp.generate(state, prompts, args.new_tokens, model=twin,
                                  secondary=secondary, **sampling))
    seconds = time.perf_counter() - t0
    ref = reference_generate(twin, state.consolidate(), prompts, args.new_tokens, **sampling)
    same = bool(np.array_equal(out, ref))
    generate_without_cache(state, prompts, length, secondary=secondary)  # compile
    t0 = time.perf_counter()
    generate_without_cache(state, prompts, length, secondary=secondary)
    cacheless = time.perf_counter() - t0

    sec_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(secondary)) / n
    print(f"\nmesh {args.nodes}x{args.local}, GPT {args.layers}x{args.d_model}, "
          f"{args.compute_dtype}{', frozen kernels INT8' if args.frozen_int8 else ''}")
    print(f"secondary partition: {sec_bytes:,.0f} bytes per device")
    print(f"gather_secondary (once): cross-node {gather_rep.cross_node_bytes_per_node:,.0f} "
          f"B per node, intra-node {gather_rep.intra_node_bytes:,.0f} B")
    print(f"one token (x{args.prompt_len + args.new_tokens - 1} steps): cross-node "
          f"{token_rep.cross_node_bytes_per_node:,.0f} B per node, intra-node "
          f"{token_rep.intra_node_bytes:,.0f} B")
    print(f"generated {args.new_tokens} tokens x {n} prompts in {seconds:.3f} s with the KV "
          f"cache ({cacheless:.3f} s without); equal to one device's decoding: {same}")
    for row in out[:3]:
        text = bytes(int(t) for t in row).decode("utf-8", "replace")
        print(repr(text[: args.prompt_len]), "->", repr(text[args.prompt_len:]))
    return 0 if same and token_rep.cross_node_bytes == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
