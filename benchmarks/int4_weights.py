"""Do INT4 weights train as well as ZeRO-3 on models whose weight blocks have no outliers?

    .venv/bin/python benchmarks/int4_weights.py                        # 9-10 min on 2 CPU cores
    .venv/bin/python benchmarks/int4_weights.py --out benchmarks/results   # the tracked results
    .venv/bin/python benchmarks/int4_weights.py --models opt --only zero3 "INT4 weights"

Three small decoders, none written for this project's quantizers: transformers'
``FlaxOPTForCausalLM`` and ``FlaxLlamaForCausalLM`` (tiny random configs, no download) and
the demo GPT (``zeropp_demo/gpt.py``), each trained ``--steps`` AdamW steps on a copy task
(``--half`` random tokens, then the same tokens again; the loss is the next-token cross
entropy on the copied half, the only learnable part) on a simulated ``--nodes x --local``
mesh, bf16 compute, for each config below and each ``--seeds`` seed (a seed sets the
initialization and the data). The score of a run is the loss of its final fp32 master
weights (``state.consolidate()``) on held-out copy batches, on one device without any
quantization: what the run trained. Per seed the JSON also holds every step's training
loss (through the quantized gathers), ``train_tail`` (the mean of the last 10) and
``train_mean`` (of all steps). The printed table: per model, the final loss over zero3's of
the same seed, mean over seeds [lowest, highest]; docs/hooks.py renders the same.

Configs (``ZeroPPConfig.zeropp`` is qwZ + hpZ + qgZ):

* ``zero3``; ``zeropp`` (INT8 weights); ``zeropp + Hadamard grads`` (``qgz_hadamard``);
* ``INT4 weights`` (``weight_format="int4"``); ``INT4 + Hadamard, Hadamard grads`` (the
  techniques guide's claim); ``FP8 weights, Hadamard grads``; ``INT4, Hadamard grads``
  (isolates the weight rotation);
* candidate fixes, each with Hadamard grads, all measured on the same runs:

  - ``INT4, weight blocks 64`` / ``32``: the library's own qwZ transport with smaller
    weight blocks (gradients keep ``block_size=256``), installed per unit because
    ``ZeroPPConfig.block_size`` is shared by weights and gradients. Scale bytes: 4 per
    block, i.e. 12.5% / 25% of the INT4 payload (3.1% at 256): a gather 9.1% / 21.2%
    larger than INT4's in blocks of 256.
  - ``INT4, rotate where it helps``: every block is quantized both plainly and rotated at
    each gather and the one with the smaller squared error travels (one flag bit per block,
    e.g. in the scale's sign bit: no extra bytes; twice the quantization work).
  - ``INT4, 1-D params bf16``: norm gains and biases (every parameter of fewer than 2
    dimensions) travel in the compute dtype; the matrices are INT4 in blocks of their own
    values only (the 1-D entries are zeroed before quantizing so they set no block's
    scale). Extra bytes: 1.5 per 1-D element, printed per model as a fraction of the
    INT4 payload.
  - ``INT4 blocks, INT8 rest unit``: the repeated blocks INT4, the rest unit (embeddings,
    position table, final norm, head) INT8: what weight-only LLM quantizers (GPTQ, AWQ)
    leave at higher precision. Per-unit transports of the library (exact bytes).
  - ``INT4 blocks of 64, INT8 rest unit``: the two that helped most, together.

  ``rotate where it helps`` and ``1-D params bf16`` are *emulated* here (not library
  features): a per-unit transport that computes, on each device, exactly the values such a
  wire format would deliver and all-gathers them in the compute dtype. Numerically what
  the feature would give; its bytes are not what the emulation moves. ``bucket=False`` for
  every per-unit transport (bucketing changes no value).

Also per model: a weight gather's INT4 round trip (relative L2 error, as the gather sees the
unit's flat buffer, and over the ≥2-D matrices only) of the initial and the zero3-trained
weights under each scheme. Writes ``--out``/int4_weights.json (the CPU from ``lscpu``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from benchmarks.cli import mesh_parser, simulate_mesh_devices, write_json  # noqa: E402

# Accuracy, not speed, is measured: XLA:CPU's fast-compile settings (the test suite's) make
# the ~40 compiles of a run take half the time and change no value that matters here.
_FAST = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"

VOCAB = 64
TAIL = 10  # train_tail: mean training loss of the last TAIL steps

GRAD_H = {"qgz_hadamard": True}
# name -> (ZeroPPConfig.zeropp overrides, or None for zero3; per-unit weight transport or None)
CONFIGS: dict[str, tuple[dict | None, tuple | None]] = {
    "zero3": (None, None),
    "zeropp (INT8 weights)": ({}, None),
    "zeropp + Hadamard grads": (GRAD_H, None),
    "FP8 weights, Hadamard grads": ({"weight_format": "fp8", **GRAD_H}, None),
    "INT4 weights": ({"weight_format": "int4"}, None),
    "INT4, Hadamard grads": ({"weight_format": "int4", **GRAD_H}, None),
    "INT4 + Hadamard, Hadamard grads": (
        {"weight_format": "int4", "qwz_hadamard": True, **GRAD_H}, None),
    "INT4, weight blocks 64": ({"weight_format": "int4", **GRAD_H}, ("blocks", 64)),
    "INT4, weight blocks 32": ({"weight_format": "int4", **GRAD_H}, ("blocks", 32)),
    "INT4, rotate where it helps": ({"weight_format": "int4", **GRAD_H}, ("best_of", None)),
    "INT4, 1-D params bf16": ({"weight_format": "int4", **GRAD_H}, ("vectors", None)),
    "INT4 blocks, INT8 rest unit": ({"weight_format": "int4", **GRAD_H}, ("rest8", None)),
    "INT4 blocks of 64, INT8 rest unit": ({"weight_format": "int4", **GRAD_H}, ("rest8", 64)),
}


def parse_args() -> argparse.Namespace:
    p = mesh_parser(__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--batch", type=int, default=32, help="global batch (sequences)")
    p.add_argument("--half", type=int, default=16, help="tokens to copy (sequence 2x this)")
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--eval-batches", type=int, default=4, help="held-out batches of 64")
    p.add_argument("--models", nargs="+", default=["opt", "gpt", "llama"],
                   choices=["opt", "gpt", "llama"])
    p.add_argument("--only", nargs="+", default=None, help="only these configs (+ zero3)")
    return p.parse_args()


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        return (f"{fields.get('Model name', '?').strip()}, "
                f"{fields.get('CPU(s)', '?').strip()} CPUs")
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"


def main() -> None:
    args = parse_args()
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), _FAST]))
    simulate_mesh_devices(args)
    import warnings

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from benchmarks.common import GPT, GPTConfig
    from zeropp_jax.comm import collectives
    from zeropp_jax.comm.collectives import all_gather_flat
    from zeropp_jax.comm.partition import REST
    from zeropp_jax.comm.transports import UnitTransports, gradient_transport, hpz
    from zeropp_jax.comm.transports.qwz import QwzGather
    from zeropp_jax.core.mesh import AXES
    from zeropp_jax.quant.quantization import dequantize_flat, quantize_flat
    from zeropp_jax.quant.rotation import hadamard_signs

    warnings.filterwarnings("ignore")  # transformers' Flax deprecation notice
    n, d, L = args.half, args.d_model, args.layers

    # ------------------------------------------------------------------ models
    def hf(kind: str):
        import transformers as T

        if kind == "opt":
            cfg = T.OPTConfig(vocab_size=VOCAB, hidden_size=d, num_hidden_layers=L,
                              ffn_dim=4 * d, num_attention_heads=4, word_embed_proj_dim=d,
                              max_position_embeddings=2 * n, dropout=0.0,
                              attention_dropout=0.0, activation_dropout=0.0)
            cls, kw = T.FlaxOPTForCausalLM, {"deterministic": True}
        else:
            cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=d, intermediate_size=4 * d,
                                num_hidden_layers=L, num_attention_heads=4,
                                num_key_value_heads=4, max_position_embeddings=2 * n)
            cls, kw = T.FlaxLlamaForCausalLM, {"train": False}
        model = cls(cfg, input_shape=(1, 2 * n), seed=0)

        def init(seed):
            return model.init_weights(jax.random.PRNGKey(seed), (1, 2 * n))

        def logits(apply, params, ids):
            return apply(input_ids=ids, attention_mask=jnp.ones_like(ids), params=params,
                         **kw)[0]

        return model, init, logits, model.__call__

    def demo_gpt():
        model = GPT(GPTConfig(vocab_size=VOCAB, seq_len=2 * n, layers=L, d_model=d, heads=4))
        ids = jnp.zeros((1, 2 * n), jnp.int32)

        def init(seed):
            return jax.jit(model.init)(jax.random.PRNGKey(seed), ids)["params"]

        def logits(apply, params, x):
            return apply({"params": params}, x)

        return model, init, logits, model.apply

    builders = {"opt": lambda: hf("opt"), "llama": lambda: hf("llama"), "gpt": demo_gpt}
    titles = {"opt": "OPT (transformers)", "gpt": "demo GPT", "llama": "Llama (transformers)"}

    def copy_batch(rng: np.random.Generator, batch: int) -> np.ndarray:
        x = rng.integers(0, VOCAB, (batch, n))
        return np.concatenate([x, x], axis=1).astype(np.int32)

    def copy_loss(logits: jax.Array, ids: jax.Array) -> jax.Array:
        # Positions n-1 .. 2n-2 predict the copied tokens ids[:, n:].
        return optax.softmax_cross_entropy_with_integer_labels(
            logits[:, n - 1:-1].astype(jnp.float32), ids[:, n:]).mean()

    # ------------------------------------------------------------------ transports
    @dataclasses.dataclass(frozen=True)
    class BestOfGather(QwzGather):
        """Each block quantized plainly and rotated; the one with the smaller squared
        error is what arrives (emulated: the chosen dequantized values are gathered)."""

        def gather(self, stored, *, backward=False):
            shard = stored[0].astype(jnp.float32)
            bs = self.block_size
            signs = hadamard_signs(None, bs)
            outs = []
            for s in (None, signs):
                kw = dict(bits=self.bits, block_size=bs, implementation=self.implementation,
                          signs=s)
                v, sc = quantize_flat(shard, **kw)
                outs.append(dequantize_flat(v, sc, dtype=jnp.float32, **kw).reshape(-1, bs))
            blocks = shard.reshape(-1, bs)
            err = [jnp.sum((o - blocks) ** 2, axis=1, keepdims=True) for o in outs]
            chosen = jnp.where(err[1] < err[0], outs[1], outs[0]).reshape(-1)
            full = all_gather_flat(chosen.astype(self.dtype), distinct=backward)
            return full, (full,)

    @dataclasses.dataclass(frozen=True)
    class VectorsExactGather(QwzGather):
        """1-D parameters (``ranges`` of the unit's flat buffer) in the compute dtype, the
        rest INT4 in blocks whose scales the 1-D entries do not set (emulated: two
        gathers, merged)."""

        ranges: tuple = ()

        def gather(self, stored, *, backward=False):
            shard = stored[0]
            k = shard.shape[0]
            mask = np.zeros(k * collectives.axis_size(AXES), bool)
            for a, b in self.ranges:
                mask[a:b] = True
            mine = jax.lax.dynamic_slice(jnp.asarray(mask), (collectives.axis_index(AXES) * k,),
                                         (k,))
            quantized = QwzGather.gather(self, (jnp.where(mine, 0.0, shard),),
                                         backward=backward)[0]
            exact = all_gather_flat(shard.astype(self.dtype), distinct=backward)
            full = jnp.where(jnp.asarray(mask), exact, quantized)
            return full, (full,)

    def vector_ranges(lay) -> tuple:
        out, offset = [], 0
        for shape, size in zip(lay.shapes, lay.sizes):
            if len(shape) < 2:
                out.append((offset, offset + size))
            offset += size
        return tuple(out)

    def install(state, how: tuple):
        """Replace every unit's weight transport (module docstring)."""
        kind, arg = how
        engine, config = state.engine, state.engine.config
        base = QwzGather.from_config(config)
        transports = {}
        for name, lay in engine.layouts.items():
            if kind == "blocks":
                inner = dataclasses.replace(base, block_size=arg)
            elif kind == "best_of":
                inner = BestOfGather(**vars(base))
            elif kind == "rest8" and name == REST:
                inner = dataclasses.replace(base, bits=8)
            elif kind == "rest8":
                inner = dataclasses.replace(base, block_size=arg or base.block_size)
            else:
                inner = VectorsExactGather(**vars(base), ranges=vector_ranges(lay))
            weights = hpz.wrap(inner, config) if config.hpz else inner
            transports[name] = UnitTransports(weights, None, gradient_transport(config))
        object.__setattr__(engine, "transports", transports)

    # ------------------------------------------------------------------ weight round trips
    def unit_buffers(state):
        """Each unit's flat fp32 master buffer (what its gather quantizes) and 1-D mask."""
        out = []
        for name, lay in state.engine.layouts.items():
            flat = np.asarray(state.params.units[name], np.float32)
            flat = np.pad(flat, (0, -flat.shape[0] % 256))  # whole blocks, as qwZ pads
            mask = np.zeros(flat.shape[0], bool)
            for a, b in vector_ranges(lay):
                mask[a:b] = True
            out.append((flat, mask))
        return out

    def round_trip(x: np.ndarray, bs: int, rotate: bool) -> np.ndarray:
        kw = dict(bits=4, block_size=bs, implementation="xla",
                  signs=hadamard_signs(None, bs) if rotate else None)
        v, s = quantize_flat(jnp.asarray(x), **kw)
        return np.asarray(dequantize_flat(v, s, dtype=jnp.float32, **kw))

    def weight_errors(buffers) -> dict:
        schemes = {
            "INT4": lambda x, m: round_trip(x, 256, False),
            "INT4 + Hadamard": lambda x, m: round_trip(x, 256, True),
            "INT4, blocks 64": lambda x, m: round_trip(x, 64, False),
            "INT4, blocks 32": lambda x, m: round_trip(x, 32, False),
            "INT4, rotate where it helps": best_of,
            "INT4, 1-D params bf16": lambda x, m: np.where(
                m, x.astype(jnp.bfloat16).astype(np.float32),
                round_trip(np.where(m, 0.0, x), 256, False)),
        }
        res = {}
        for name, fn in schemes.items():
            num = den = num_m = den_m = 0.0
            for x, m in buffers:
                e = (fn(x, m) - x) ** 2
                num, den = num + e.sum(), den + (x ** 2).sum()
                num_m, den_m = num_m + e[~m].sum(), den_m + (x[~m] ** 2).sum()
            res[name] = {"all": math.sqrt(num / den), "matrices": math.sqrt(num_m / den_m)}
        return res

    def best_of(x, m):
        a, b = round_trip(x, 256, False), round_trip(x, 256, True)
        ea = ((a - x) ** 2).reshape(-1, 256).sum(1, keepdims=True)
        eb = ((b - x) ** 2).reshape(-1, 256).sum(1, keepdims=True)
        return np.where(eb < ea, b.reshape(-1, 256), a.reshape(-1, 256)).reshape(-1)

    # ------------------------------------------------------------------ runs
    mesh = zpp.make_mesh(args.nodes, args.local)
    names = ["zero3", *[c for c in (args.only or CONFIGS) if c != "zero3"]]
    for c in names:
        if c not in CONFIGS:
            raise SystemExit(f"unknown config {c!r}; known: {list(CONFIGS)}")
    eval_ids = copy_batch(np.random.default_rng(10_000), 64 * args.eval_batches)
    results: dict = {}
    t_start = time.time()
    for mname in args.models:
        model, init, logits_of, apply = builders[mname]()
        inits = {s: init(s) for s in args.seeds}

        @jax.jit
        def eval_loss(params):
            losses = [copy_loss(logits_of(apply, params, b), b)
                      for b in jnp.split(jnp.asarray(eval_ids), args.eval_batches)]
            return jnp.mean(jnp.stack(losses))

        @zpp.train_step
        def step(state, ids):
            def loss_of(p):
                return copy_loss(logits_of(state.apply_fn, p, ids), ids)

            loss, grads = jax.value_and_grad(loss_of)(state.params)
            return state.apply_gradients(grads=grads), {"loss": loss}

        runs: dict = {}
        extra = {}
        for cname in names:
            overrides, how = CONFIGS[cname]
            config = (zpp.ZeroPPConfig.zero3() if overrides is None else
                      zpp.ZeroPPConfig.zeropp(**overrides, **({"bucket": False} if how else {})))
            engine_state = None
            per_seed = {}
            t0 = time.time()
            for seed in args.seeds:
                state = zpp.TrainState.create(model=model, params=inits[seed],
                                              tx=optax.adamw(args.lr), mesh=mesh,
                                              config=config)
                if engine_state is None:
                    engine_state = state
                    if how:
                        install(state, how)
                else:  # the first seed's engine: one compiled step for every seed
                    state = state.replace(engine=engine_state.engine)
                if cname == "zero3" and seed == args.seeds[0]:
                    first_buffers = unit_buffers(state)
                rng = np.random.default_rng(seed)
                losses = []
                for _ in range(args.steps):
                    state, m = step(state, copy_batch(rng, args.batch))
                    losses.append(float(m["loss"]))
                if cname == "zero3" and seed == args.seeds[0]:
                    extra["round_trip"] = {"init": weight_errors(first_buffers),
                                           "trained (zero3)": weight_errors(unit_buffers(state))}
                final = state.consolidate()
                per_seed[str(seed)] = {"eval_loss": float(eval_loss(final)),
                                       "train_tail": float(np.mean(losses[-TAIL:])),
                                       "train_mean": float(np.mean(losses)),
                                       "losses": [round(x, 4) for x in losses]}
                if cname == "zero3" and seed == args.seeds[0]:
                    lays = state.engine.layouts.values()
                    vec = sum(b - a for lay in lays for a, b in vector_ranges(lay))
                    total = sum(lay.n for lay in lays)
                    extra["params"] = total
                    extra["one_d_params"] = vec
                    int4 = total * (0.5 + 4 / 256)  # INT4 bytes per gather, blocks of 256
                    # bf16 is 1.5 bytes more per element than INT4, INT8 0.5 more.
                    extra["one_d_extra_bytes_over_int4"] = 1.5 * vec / int4
                    rest = engine_state.engine.layouts.get(REST)
                    extra["rest_params"] = rest.n if rest else 0
                    extra["rest_int8_extra_bytes_over_int4"] = 0.5 * extra["rest_params"] / int4
            runs[cname] = {"seeds": per_seed, "wall_s": time.time() - t0}
            ev = [r["eval_loss"] for r in per_seed.values()]
            print(f"{mname:6s} {cname:34s} eval {' '.join(f'{e:.4f}' for e in ev)}  "
                  f"({time.time() - t0:.0f} s)", flush=True)
        results[mname] = {"title": titles[mname], "runs": runs, **extra}

    summary = summarize(results, names, args.seeds)
    print()
    print(table(summary, results, names))
    out = {
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "only")},
        "cpu": cpu_name(),
        "jax": jax.__version__,
        "wall_s": time.time() - t_start,
        "configs": {c: {"zeropp_overrides": CONFIGS[c][0], "per_unit_transport": CONFIGS[c][1]}
                    for c in names},
        "summary": summary,
        "models": results,
    }
    write_json(args.out, "int4_weights.json", out)


def summarize(results: dict, names: list[str], seeds: list[int]) -> dict:
    """Per model and config: the mean eval loss over seeds; per seed its ratio to zero3's
    (same seed), their mean, min and max; the same of the mean training loss over all
    steps (how fast the copy was learned)."""
    out: dict = {}
    for mname, r in results.items():
        base = r["runs"]["zero3"]["seeds"]
        out[mname] = {}
        for c in names:
            s = r["runs"][c]["seeds"]
            ratios = [s[str(k)]["eval_loss"] / base[str(k)]["eval_loss"] for k in seeds]
            means = [s[str(k)]["train_mean"] / base[str(k)]["train_mean"] for k in seeds]
            out[mname][c] = {
                "eval_loss": sum(s[str(k)]["eval_loss"] for k in seeds) / len(seeds),
                "ratios": ratios, "ratio": sum(ratios) / len(ratios),
                "ratio_min": min(ratios), "ratio_max": max(ratios),
                "train_mean_ratio": sum(means) / len(means)}
    every: dict = {}
    for c in names:  # over every model and seed
        ratios = [x for m in out.values() for x in m[c]["ratios"]]
        every[c] = {"ratio": sum(ratios) / len(ratios), "ratio_min": min(ratios),
                    "ratio_max": max(ratios)}
    out["all models"] = every
    return out


def _pct(r: float) -> str:
    return f"{100 * (r - 1):+.0f}%"


def table(summary: dict, results: dict, names: list[str]) -> str:
    """Final eval loss / zero3's (same seed): the mean over seeds [min, max]."""
    models = [m for m in summary if m != "all models"]
    lines = ["| config | " + " | ".join(results[m]["title"] for m in models)
             + " | all models |", "|" + " --- |" * (len(models) + 2)]
    for c in names:
        cells = [f"{summary[m][c]['eval_loss']:.3f}: {_pct(summary[m][c]['ratio'])} "
                 f"[{_pct(summary[m][c]['ratio_min'])}, {_pct(summary[m][c]['ratio_max'])}]"
                 for m in models]
        a = summary["all models"][c]
        cells.append(f"{_pct(a['ratio'])} [{_pct(a['ratio_min'])}, {_pct(a['ratio_max'])}]")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
