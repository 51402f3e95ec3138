"""Compute overhead of ZeRO-3 on one device with no communication (issue 13).

    python benchmarks/overhead.py                 # about 2 minutes on 2 CPU cores

One device (a 1x1 mesh: every gather and reduce-scatter is over one device, so what is left
is the cost of the unit machinery itself: flattening, casts, remat, the custom gradients).
The same GPT (``zeropp_demo.gpt``), the same data and the same optimizer (SGD) in
four steps:

  plain          ``jax.jit`` of ``value_and_grad(loss(model.apply))`` + the optax update,
                 parameters replicated on the device;
  plain_remat    the same with every transformer block under ``flax.linen.remat`` (nothing
                 saved inside a block: backward recomputes each block's forward);
  zero3_minimal  ``ZeroPPConfig(stage=3, remat="minimal")`` through ``@zpp.train_step``;
  zero3_full     ``ZeroPPConfig(stage=3, remat="full")``.

Each step is compiled and warmed up first; then ``--rounds`` interleaved rounds run
``--steps-per-round`` steps of each variant in turn (``jax.block_until_ready`` after each
variant's steps), and the table reports each variant's median step time. Targets: zero3_minimal
<= 1.05x plain, zero3_full <= 1.05x plain_remat. The matmuls (HLO ``dot`` instructions, or
cuBLAS GEMM custom calls on GPU) in each compiled program are counted as well: zero3_minimal
must run as many as plain (no forward matmul runs twice).

Both sides compute in ``--compute-dtype`` (the model's ``GPTConfig.dtype``; ZeRO-3 also
gathers its weights in it) with fp32 parameters. ZeRO-3 runs with ``skip_nonfinite=False``
(the plain step checks nothing either); ``--skip-nonfinite`` measures the library's default.
Writes JSON to ``--out/--name.json``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import statistics
import sys
import time

# Run as a script from anywhere: make the repository root importable.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import add_out_argument  # noqa: E402

# Results go to --out: by default benchmarks/out/ (git-ignored). The tracked copies in

VARIANTS = ("plain", "plain_remat", "zero3_minimal", "zero3_full")
# (variant, baseline, target ratio)
TARGETS = (("zero3_minimal", "plain", 1.05), ("zero3_full", "plain_remat", 1.05))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=256, help="vocabulary size (default: bytes)")
    p.add_argument("--rounds", type=int, default=20, help="interleaved timing rounds")
    p.add_argument("--steps-per-round", type=int, default=2,
                   help="steps of one variant per round (timed together, then divided)")
    p.add_argument("--compute-dtype", default="float32",
                   choices=["float32", "bfloat16"])
    p.add_argument("--skip-nonfinite", action="store_true",
                   help="ZeRO-3 with skip_nonfinite=True (the library default: a finite check "
                        "over the gradient each step; the plain step has none)")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    p.add_argument("--name", default="overhead", help="JSON file name (without .json)")
    args = p.parse_args(argv)
    for name in ("layers", "d_model", "heads", "seq_len", "batch", "rounds", "steps_per_round"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


_DOT = re.compile(r"\bdot\(")
_GEMM = re.compile(r'custom_call_target="[^"]*(gemm|matmul)[^"]*"', re.IGNORECASE)


def count_matmuls(hlo_text: str) -> dict[str, int]:
    """Matmul instructions in a compiled HLO module's text.

    Compiled HLO spells a matmul ``%name = f32[..] dot(%a, %b), ...``; ``dot_general`` only
    appears there inside ``metadata={op_name=".../dot_general"}`` (of dots and of the fusions
    that hold them), so metadata is cut off before matching. Fusion bodies are printed as
    computations of their own, so a fused dot is counted once. XLA:GPU may instead call
    cuBLAS(Lt): ``custom_call_target="__cublas$gemm"`` (or ``...$lt$matmul``), counted
    separately. ``total`` is the sum.
    """
    dots = gemms = 0
    for line in hlo_text.splitlines():
        code = line.split(", metadata=")[0]
        dots += bool(_DOT.search(code))
        gemms += bool(_GEMM.search(line))
    return {"dot": dots, "gemm_custom_call": gemms, "total": dots + gemms}


def remat_gpt_class():
    """``GPT`` with every block under ``flax.linen.remat`` (default policy: nothing inside a
    block is saved, its forward reruns in backward). Same parameter tree as ``GPT``: the
    lifted ``nn.remat(Block)`` keeps the name ``block_i``. (The model file itself has no
    remat switch; this mirrors ``GPT.__call__`` without the sequence-parallel branch, and
    ``main`` checks that both models give the same loss.)"""
    import flax.linen as nn
    import jax.numpy as jnp

    from zeropp_demo.gpt import GPT, Block

    class RematGPT(GPT):
        @nn.compact
        def __call__(self, tokens):
            cfg = self.config
            t = tokens.shape[1]
            x = nn.Embed(cfg.vocab_size, cfg.d_model, dtype=cfg.dtype, name="wte")(tokens)
            pos = nn.Embed(cfg.seq_len, cfg.d_model, dtype=cfg.dtype, name="wpe")(jnp.arange(t))
            x = x + pos[None]
            remat_block = nn.remat(Block)
            for i in range(cfg.layers):
                x = remat_block(cfg, name=f"block_{i}")(x)
            x = nn.LayerNorm(dtype=cfg.dtype, name="ln_f")(x)
            logits = nn.Dense(cfg.vocab_size, dtype=cfg.dtype, name="head")(x)
            if cfg.logit_scale:
                logits = logits * self.param("logit_scale", nn.initializers.ones, ())
            return logits.astype(jnp.float32)

    return RematGPT


def plain_step(model, tx):
    """``(params, opt_state, batch) -> (params, opt_state, loss)``, jitted, state donated."""
    import jax
    import optax

    from zeropp_demo.gpt import loss_fn

    def step(params, opt_state, batch):
        def loss_of(p):
            return loss_fn(model.apply({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 1))


def zero3_step():
    """The same step written for ``@zpp.train_step`` (state donated, as in ``plain_step``)."""
    from zeropp_demo.gpt import lm_train_step

    return lm_train_step(donate_state=True)


class Runner:
    """One variant: ``compile()`` it once, then ``run(n)`` runs ``n`` steps of the compiled
    executable (state donated) and blocks."""

    def __init__(self, name, step, state, batch, *, zero):
        self.name, self.step, self.state, self.batch, self.zero = name, step, state, batch, zero
        self.call = self.loss = None

    def compile(self):
        args = (self.state, self.batch) if self.zero else (*self.state, self.batch)
        self.call = self.step.lower(*args).compile()
        return self.call

    def run(self, n: int) -> None:
        import jax

        for _ in range(n):
            if self.zero:
                self.state, metrics = self.call(self.state, self.batch)
                self.loss = metrics["loss"]
            else:
                *self.state, self.loss = self.call(*self.state, self.batch)
        jax.block_until_ready((self.state, self.loss))


def time_interleaved(runners: list[Runner], rounds: int, steps: int) -> dict[str, list[float]]:
    """Per variant, the per-step ms of each round; variants take turns within a round."""
    times: dict[str, list[float]] = {r.name: [] for r in runners}
    for _ in range(rounds):
        for r in runners:
            t0 = time.perf_counter()
            r.run(steps)
            times[r.name].append((time.perf_counter() - t0) * 1e3 / steps)
    return times


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    import warnings

    import jax
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from zeropp_demo.gpt import GPT, GPTConfig, loss_fn

    # Donation is a no-op on some backends; say so once, not every step.
    warnings.filterwarnings("ignore", message=".*donated buffers were not usable.*")
    device = jax.devices()[0]
    cfg = GPTConfig(vocab_size=args.vocab, seq_len=args.seq_len, layers=args.layers,
                    d_model=args.d_model, heads=args.heads, dtype=args.compute_dtype)
    model, remat_model = GPT(cfg), remat_gpt_class()(cfg)
    rng = np.random.default_rng(args.seed)
    batch_np = rng.integers(0, cfg.vocab_size, (args.batch, cfg.seq_len + 1)).astype(np.int32)
    params = jax.jit(model.init)(jax.random.PRNGKey(args.seed), batch_np[:, :-1])["params"]
    params = jax.tree_util.tree_map(np.asarray, params)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(params))
    tx = optax.sgd(1e-3)

    # Same parameters, same loss: the remat model is the plain one.
    loss_plain = jax.jit(lambda p, b: loss_fn(model.apply({"params": p}, b[:, :-1]), b[:, 1:]))
    loss_remat = jax.jit(lambda p, b: loss_fn(remat_model.apply({"params": p}, b[:, :-1]),
                                              b[:, 1:]))
    l0, l1 = float(loss_plain(params, batch_np)), float(loss_remat(params, batch_np))
    if not np.isclose(l0, l1, rtol=1e-3):
        raise RuntimeError(f"the remat GPT's loss {l1} differs from GPT's {l0}")

    mesh = zpp.make_mesh(1, 1, devices=[device])
    batch = jax.device_put(batch_np, device)
    runners = []
    for name, m in (("plain", model), ("plain_remat", remat_model)):
        state = jax.device_put((params, tx.init(params)), device)
        runners.append(Runner(name, plain_step(m, tx), list(state), batch, zero=False))
    for remat in ("minimal", "full"):
        config = zpp.ZeroPPConfig(stage=3, compute_dtype=args.compute_dtype, remat=remat,
                                  skip_nonfinite=args.skip_nonfinite)
        state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh,
                                      config=config)
        # Placed once as the step wants it (else every call would place it again).
        placed = state.engine.shard_batch(batch_np)
        runners.append(Runner(f"zero3_{remat}", zero3_step(), state, placed, zero=True))

    print(f"GPT {n_params / 1e6:.2f}M params: {cfg.layers} layers, d_model {cfg.d_model}, "
          f"{cfg.heads} heads, seq {cfg.seq_len}, batch {args.batch}, {cfg.dtype} compute, "
          f"SGD; one {device.platform} device ({device.device_kind}), jax {jax.__version__}")
    results: dict = {
        "model": {"params": n_params, "layers": cfg.layers, "d_model": cfg.d_model,
                  "heads": cfg.heads, "seq_len": cfg.seq_len, "vocab": cfg.vocab_size,
                  "batch": args.batch, "compute_dtype": cfg.dtype},
        "optimizer": "sgd", "rounds": args.rounds, "steps_per_round": args.steps_per_round,
        "skip_nonfinite": args.skip_nonfinite,
        "device": {"platform": device.platform, "kind": device.device_kind},
        "jax": jax.__version__,
        "remat_method": "plain_remat: flax.linen.remat(Block) around every block "
                        "(default policy, prevent_cse=True)",
        "variants": {},
    }
    for r in runners:
        t0 = time.perf_counter()
        compiled = r.compile()
        mem = compiled.memory_analysis()
        results["variants"][r.name] = {
            "matmuls": count_matmuls(compiled.as_text()),
            "compile_s": time.perf_counter() - t0,
            "temp_bytes": getattr(mem, "temp_size_in_bytes", None),
        }
        r.run(2)  # warm up

    times = time_interleaved(runners, args.rounds, args.steps_per_round)
    med = {k: statistics.median(v) for k, v in times.items()}
    for r in runners:
        v = results["variants"][r.name]
        v.update(median_ms=med[r.name], min_ms=min(times[r.name]), times_ms=times[r.name],
                 final_loss=float(r.loss))
        v["vs_plain"] = med[r.name] / med["plain"]
    for variant, base, _ in TARGETS:
        results["variants"][variant][f"vs_{base}"] = med[variant] / med[base]

    plain_dots = results["variants"]["plain"]["matmuls"]["total"]
    print(f"\n{'variant':<14} {'median ms':>10} {'min ms':>8} {'vs plain':>9} "
          f"{'vs plain_remat':>15} {'matmuls':>8} {'temp MB':>8}")
    for r in runners:
        v = results["variants"][r.name]
        vs_remat = f"{med[r.name] / med['plain_remat']:.3f}x"
        temp = "n/a" if v["temp_bytes"] is None else f"{v['temp_bytes'] / 2**20:.1f}"
        print(f"{r.name:<14} {v['median_ms']:>10.2f} {v['min_ms']:>8.2f} "
              f"{v['vs_plain']:>8.3f}x {vs_remat:>15} {v['matmuls']['total']:>8} {temp:>8}")
    print("\ntargets:")
    results["targets"] = {}
    for variant, base, target in TARGETS:
        ratio = med[variant] / med[base]
        ok = ratio <= target
        results["targets"][f"{variant}/{base}"] = {"ratio": ratio, "target": target, "met": ok}
        print(f"  {variant} / {base} = {ratio:.3f}x (target <= {target:.2f}x): "
              f"{'met' if ok else 'NOT met'}")
    minimal_dots = results["variants"]["zero3_minimal"]["matmuls"]["total"]
    same = minimal_dots == plain_dots
    results["targets"]["matmuls zero3_minimal == plain"] = {
        "zero3_minimal": minimal_dots, "plain": plain_dots, "met": same}
    forms = {k: n for k, n in results["variants"]["plain"]["matmuls"].items()
             if k != "total" and n}
    print(f"  matmuls in the compiled program: zero3_minimal {minimal_dots}, plain {plain_dots} "
          f"(as {forms or 'none found'}): {'equal' if same else 'NOT equal'}")

    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.name}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return results


if __name__ == "__main__":
    main()
