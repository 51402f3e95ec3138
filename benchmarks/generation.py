"""KV-cached generation on a sharded state: exactness, bytes per token, one-device speed.

    python benchmarks/generation.py            # ~3 minutes on 2 CPU cores

On ``--nodes x --local`` simulated CPU devices (default 2x4), fp32:

* **exactness**: greedy tokens of ``zpp.generate`` (ZeRO-3 state with hpZ, and without)
  against one device's incremental decoding of the consolidated params
  (``reference_generate``: the same loop, ``model.apply`` with the KV cache) for Flax's
  lm1b model, transformers' GPT-2 and Llama and the demo GPT (tiny random configs), plus
  transformers' own ``generate`` for GPT-2 and Llama; sampling (temperature 1, top-k 20,
  top-p 0.9) with one key on the meshes 2x4, 4x2 and 1x8 must give the same tokens;
* **bytes per token**: cross-node bytes per node of one generated token, read from the
  compiled one-token program (``comm_report``), for the cluster benchmark's GPT (4 layers,
  d 256): ZeRO-3 (every unit gathered across nodes), qwZ (the same in INT8), hpZ (the
  secondary, gathered across nodes once per ``generate`` call: its bytes are given too);
* **speed on one device** (a 1x1 mesh: the gathers are no-ops, so this is the cost of the
  machinery): tokens/s of ``zpp.generate`` ÷ a plain ``jax.jit`` KV decoder on the
  consolidated params (``reference_generate``), and ÷ the cache-less generator, ``--batch``
  prompts of ``--prompt-len`` tokens, ``--new-tokens`` new tokens, median of ``--rounds``
  (all three timed round-robin in each round).

Writes ``OUT/generation.json``. The emulated-cluster speeds are
``benchmarks/cluster/generate.py``'s.
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, simulate_mesh_devices, write_json  # noqa: E402


def parse_args(argv=None):
    p = mesh_parser(__doc__)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    simulate_mesh_devices(args)

    import jax
    import numpy as np
    import optax
    import transformers

    import zeropp_jax as zpp
    from zeropp_demo.gpt import GPT, GPTConfig
    from zeropp_demo.lm1b import TransformerConfig, TransformerLM
    from zeropp_jax.inference.generate import (gather_secondary, generate_without_cache,
                                               lower_generation_step, reference_generate,
                                               reference_program)
    from zeropp_jax.measure.analysis import comm_report

    jax.config.update("jax_default_matmul_precision", "highest")
    rng = np.random.default_rng(args.seed)

    def state_of(model, params, mesh_shape, units=None, **cfg):
        devices = jax.devices()[:mesh_shape[0] * mesh_shape[1]]
        return zpp.TrainState.create(
            model=model, params=params, tx=optax.sgd(0.0),
            mesh=zpp.make_mesh(*mesh_shape, devices=devices),
            config=zpp.ZeroPPConfig(compute_dtype="float32", **cfg), units=units)

    mesh = (args.nodes, args.local)
    n = args.nodes * args.local
    new = 12
    results: dict = {"mesh": list(mesh), "exactness": [], "bytes_per_token": [], "speed": {}}

    # -- exactness ---------------------------------------------------------------------------
    small = GPTConfig(vocab_size=64, seq_len=24, layers=2, d_model=32, heads=4)
    gpt_params = GPT(small).init(jax.random.PRNGKey(args.seed), np.zeros((1, 24), np.int32)
                                 )["params"]
    lm_cfg = TransformerConfig(max_len=24)
    lm_params = TransformerLM(lm_cfg).init(jax.random.PRNGKey(args.seed + 1),
                                           np.zeros((1, 24), np.int32))["params"]
    hf = {
        "transformers GPT-2": transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=24, n_embd=32, n_layer=2, n_head=4), seed=args.seed),
        "transformers Llama": transformers.FlaxLlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24),
            seed=args.seed),
    }
    prompts = rng.integers(1, 64, (n, 6)).astype(np.int32)
    bos_prompts = np.concatenate([np.zeros((n, 1), np.int32), prompts[:, :5]], 1)
    cases = [
        ("demo GPT", GPT(small), GPT(dataclasses.replace(small, decode=True)), gpt_params,
         prompts, None, {}),
        ("Flax lm1b", TransformerLM(lm_cfg), TransformerLM(dataclasses.replace(
            lm_cfg, decode=True)), lm_params, bos_prompts,
         [("decoder", f"encoderdecoderblock_{i}") for i in range(2)], {}),
    ] + [(name, m, None, m.params, prompts, None, {"stop_tokens": [m.config.eos_token_id]})
         for name, m in hf.items()]
    for name, model, twin, params, p, units, kw in cases:
        ref = reference_generate(twin or model, params, p, new, **kw)
        for hpz in (True, False):
            state = state_of(model, params, mesh, units, hpz=hpz)
            out = np.asarray(zpp.generate(state, p, new, model=twin, **kw))
            row = {"model": name, "hpz": hpz, "tokens": int(out[:, p.shape[1]:].size),
                   "mismatches_vs_one_device": int((out != ref).sum())}
            if twin is None:  # transformers' own generate (pads with 0 after eos)
                own = np.asarray(model.generate(p, max_length=p.shape[1] + new,
                                                do_sample=False, pad_token_id=0).sequences)
                row["mismatches_vs_transformers_generate"] = int((out != own).sum())
            results["exactness"].append(row)
            print(row)
    sample = dict(temperature=1.0, top_k=20, top_p=0.9, key=jax.random.PRNGKey(args.seed))
    twin = GPT(dataclasses.replace(small, decode=True))
    ref = reference_generate(twin, gpt_params, prompts, new, **sample)
    for shape in ((args.nodes, args.local), (args.local, args.nodes), (1, n)):
        out = np.asarray(zpp.generate(state_of(GPT(small), gpt_params, shape, hpz=True),
                                      prompts, new, model=twin, **sample))
        row = {"model": "demo GPT, sampled", "mesh": list(shape),
               "mismatches_vs_one_device": int((out != ref).sum()),
               "tokens": int(out[:, 6:].size)}
        results["exactness"].append(row)
        print(row)

    # -- bytes per token -----------------------------------------------------------------------
    big = GPTConfig(vocab_size=256, seq_len=128, layers=4, d_model=256, heads=4)
    big_params = GPT(big).init(jax.random.PRNGKey(0), np.zeros((1, 128), np.int32))["params"]
    big_twin = GPT(dataclasses.replace(big, decode=True))
    big_prompts = rng.integers(0, 256, (args.batch, args.prompt_len)).astype(np.int32)
    for label, cfg in (("zero3", {}), ("qwz", {"qwz": True}), ("hpz", {"hpz": True}),
                       ("qwz+hpz", {"qwz": True, "hpz": True})):
        state = state_of(GPT(big), big_params, mesh, **cfg)
        step = comm_report(lower_generation_step(state, big_prompts, args.new_tokens,
                                                 model=big_twin), state.mesh)
        row = {"config": label, "cross_node_bytes_per_node_per_token":
               step.cross_node_bytes_per_node,
               "intra_node_bytes_per_token": step.intra_node_bytes}
        if cfg.get("hpz"):
            row["secondary_gather_cross_node_bytes_per_node"] = comm_report(
                gather_secondary.lower(state), state.mesh).cross_node_bytes_per_node
        results["bytes_per_token"].append(row)
        print(row)

    # -- one-device speed ----------------------------------------------------------------------
    state = state_of(GPT(big), big_params, (1, 1))
    length = args.prompt_len + args.new_tokens
    # What a user would write without zeropp_jax: one jitted loop of model.apply with the
    # KV cache on the full params, all on the same one device.
    plain = reference_program(big_twin, args.new_tokens)
    one = jax.devices()[0]
    one_params, one_prompts, one_lengths, key0 = jax.device_put(
        (big_params, big_prompts, np.full((args.batch,), args.prompt_len, np.int32),
         jax.random.PRNGKey(0)), one)
    timers = {
        "zpp.generate (KV cache)": lambda: np.asarray(
            zpp.generate(state, big_prompts, args.new_tokens, model=big_twin)),
        "plain jax.jit KV decoder": lambda: np.asarray(plain(
            one_params, one_prompts, one_lengths, key0)),
        "cache-less generator": lambda: generate_without_cache(state, big_prompts, length),
    }
    outs = {k: f() for k, f in timers.items()}  # compile
    agree = all((v == outs["plain jax.jit KV decoder"]).all() for v in outs.values())
    times: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(args.rounds):
        for k, f in timers.items():
            t = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t)
    tokens = args.batch * args.new_tokens
    med = {k: float(np.median(v)) for k, v in times.items()}
    results["speed"] = {
        "batch": args.batch, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
        "times_s": times, "tokens_per_s": {k: tokens / v for k, v in med.items()},
        "same_tokens": bool(agree),
        "kv_over_plain_jit": med["plain jax.jit KV decoder"] / med["zpp.generate (KV cache)"],
        "kv_over_cacheless": med["cache-less generator"] / med["zpp.generate (KV cache)"],
    }
    for k, v in times.items():
        print(f"{k:28s} {tokens / np.median(v):9.1f} tokens/s (rounds {min(v):.3f}-{max(v):.3f} s)")
    print(f"zpp.generate / plain jit: {results['speed']['kv_over_plain_jit']:.2f}x, "
          f"/ cache-less: {results['speed']['kv_over_cacheless']:.2f}x, same tokens: {agree}")
    write_json(args.out, "generation.json", results)
    return results


if __name__ == "__main__":
    main()
