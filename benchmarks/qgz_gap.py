"""Where the 4-bit gradient loss gap comes from, and a configuration that closes it.

ZeRO++ with Hadamard-smoothed INT4 gradients (qgZ) ends 400 steps of the example GPT
(``benchmarks/convergence.py``'s settings: d256, 4 layers, 2x2 mesh, batch 16 x 128, lr 2e-3,
bf16) about 0.2-0.4% above ZeRO-3 in validation loss. This benchmark splits that gap:

* qgZ's two quantizations apart, on the same 2x2 mesh: only the intra-node hop (each device's
  whole gradient) quantized, only the cross-node hop (each node's partial sums), and INT8
  instead of INT4 on the cross-node hop (``benchmarks/qgz_hops.py``, a gradient transport
  made of the library's qgZ pieces);
* the noise floor: two ZeRO-3 runs that differ only in rounding (the flat reduce-scatter
  against the two-hop one, which rounds the partial sums to bf16);
* AdamW's second moment ``nu`` (and ``mu``) of each run every 100 steps, and the inflation of
  ``nu`` that the quantization error predicts: at ZeRO-3's parameters every 100 steps, the
  per-device gradients go through each variant's reduce-scatter and the squared error is
  compared with the squared gradient;
* each variant's cross-node bytes per step, from the communication report of its lowered
  step (``zeropp_jax.measure.comm_report``), against ZeRO-3's; a run that switches qgZ off
  after a fraction ``f`` of the steps moves ``f`` of qgZ's bytes plus ``1 - f`` of the
  unquantized reduce-scatter's.

Each run is this file in its own process (``--worker``; it simulates its own CPU devices),
replicating ``examples/train_gpt.py``'s training (same data, init, optimizer, schedule and
evaluation), and writes OUT_runs/NAME_sSEED.json; an existing run file is reused, so an
interrupted benchmark continues where it stopped. Tracked runs of ``convergence.py`` are read
where a row names one. Writes OUT.json (default the git-ignored benchmarks/out/qgz_gap.json;
``--out benchmarks/results/qgz_gap.json`` for the tracked one) and prints the table.

    .venv/bin/python benchmarks/qgz_gap.py --out benchmarks/results/qgz_gap.json
    .venv/bin/python benchmarks/qgz_gap.py --quick    # smoke run, numbers meaningless
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.cli import add_convergence_run_arguments  # noqa: E402

DEFAULT_OUT = ROOT / "benchmarks" / "out" / "qgz_gap.json"
RESULTS = ROOT / "benchmarks" / "results"

# Rows: name -> dict(mode, hops (hop1_bits, hop2_bits) or None for the library's transport,
# cfg (ZeroPPConfig overrides), seeds, what (the question the row answers)).
H = {"qgz_hadamard": True}
ROWS = {
    "zero3": dict(mode="zero3", what="baseline"),
    "zero3, two-hop reduce-scatter": dict(
        mode="zero3", cfg={"reduce_scatter": "hierarchical"}, stop_after=200,
        what="noise floor: ZeRO-3 with bf16 partial sums (rounding only), first 200 steps"),
    "qwZ + hpZ": dict(mode="qwz_hpz", what="weights only, no qgZ"),
    "zeropp + Hadamard": dict(mode="zeropp", cfg=H, what="qgZ INT4 on both hops (ZeRO++)"),
    "hop 1 only (INT4 intra, 16-bit cross)": dict(
        mode="zeropp", cfg=H, hops=(4, None), what="the intra-node quantization alone"),
    "hop 2 only (16-bit intra, INT4 cross)": dict(
        mode="zeropp", cfg=H, hops=(None, 4),
        what="the cross-node quantization alone; qgZ's cross-node bytes"),
    "INT4 intra, INT8 cross": dict(
        mode="zeropp", cfg=H, hops=(4, 8), what="INT8 instead of INT4 on the cross-node hop"),
    "hop 2 only, INT8 (16-bit intra, INT8 cross)": dict(
        mode="zeropp", cfg=H, hops=(None, 8),
        what="only the cross-node hop quantized, to INT8"),
    "zeropp + Hadamard, qgZ first 85%": dict(
        mode="zeropp", cfg={**H, "qgz_until": 0.85}, what="full precision for the last 15%"),
    "zero3, lr / 1.016": dict(
        mode="zero3", lr_scale=1 / 1.016,
        what="ZeRO-3 with the step ZeRO++'s larger nu takes (its sqrt(nu) is 1.016x)"),
    "zeropp + Hadamard, lr x 1.016": dict(
        mode="zeropp", cfg=H, lr_scale=1.016,
        what="ZeRO++ with its steps lengthened back by its sqrt(nu) ratio"),
    "hop 2 only, qgZ first 85%": dict(
        mode="zeropp", cfg={**H, "qgz_until": 0.85}, hops=(None, 4),
        what="both fixes together"),
    "hop 2 only, qgZ first 94%": dict(
        mode="zeropp", cfg={**H, "qgz_until": 0.94}, hops=(None, 4),
        what="both, qgZ as long as the 0.30x budget needs (switching's fraction)"),
}
# Runs of convergence.py (tracked) a row may reuse, by (row, seed, steps): (file, run name).
TRACKED = {
    ("zero3", 0, 400): ("convergence_feedback.json", "zero3"),
    ("zero3", 1, 400): ("convergence_feedback_seed1.json", "zero3"),
    ("zero3", 0, 2000): ("convergence_feedback_2000.json", "zero3"),
    ("zeropp + Hadamard", 0, 400): ("convergence_feedback.json", "zeropp + Hadamard"),
    ("zeropp + Hadamard", 1, 400): ("convergence_feedback_seed1.json", "zeropp + Hadamard"),
    ("zeropp + Hadamard", 0, 2000): ("convergence_feedback_2000.json", "zeropp + Hadamard"),
    ("zeropp + Hadamard (tracked run)", 0, 400): ("convergence_feedback.json",
                                                 "zeropp + Hadamard"),
    ("zeropp + Hadamard (tracked run)", 1, 400): ("convergence_feedback_seed1.json",
                                                 "zeropp + Hadamard"),
    ("zeropp + Hadamard + EF", 0, 400): ("convergence_feedback.json", "zeropp + Hadamard + EF"),
    ("zeropp + Hadamard + EF", 1, 400): ("convergence_feedback_seed1.json",
                                         "zeropp + Hadamard + EF"),
    ("zeropp + Hadamard + EF", 0, 2000): ("convergence_feedback_2000.json",
                                          "zeropp + Hadamard + EF"),
    ("zeropp + Hadamard, per-step signs", 0, 400): ("convergence_feedback.json",
                                                    "zeropp + Hadamard, per-step signs"),
    ("zeropp + Hadamard, per-step signs", 1, 400): ("convergence_feedback_seed1.json",
                                                    "zeropp + Hadamard, per-step signs"),
    ("zeropp + Hadamard + EF, per-step signs", 0, 400): (
        "convergence_feedback.json", "zeropp + Hadamard + EF, per-step signs"),
    ("zeropp + Hadamard + EF, per-step signs", 1, 400): (
        "convergence_feedback_seed1.json", "zeropp + Hadamard + EF, per-step signs"),
    ("zeropp (no Hadamard)", 0, 400): ("convergence_feedback.json", "zeropp"),
    ("zeropp + EF (no Hadamard)", 0, 400): ("convergence_feedback.json", "zeropp + EF"),
    ("qwZ + hpZ", 0, 400): ("convergence.json", "qwZ + hpZ"),
}
TRACKED_WHAT = {
    "zeropp + Hadamard (tracked run)": "the ZeRO++ row above, run on another machine",
    "zeropp + Hadamard + EF": "error feedback (tracked run)",
    "zeropp + Hadamard, per-step signs": "new Hadamard signs every step (tracked run)",
    "zeropp + Hadamard + EF, per-step signs": "both (tracked run)",
    "zeropp (no Hadamard)": "plain INT4 qgZ (tracked run)",
    "zeropp + EF (no Hadamard)": "plain INT4 qgZ with error feedback (tracked run)",
}
# The row a qgZ-first-f row runs before it switches (same transport, always on).
ALWAYS_ON = {"zeropp + Hadamard, qgZ first 85%": "zeropp + Hadamard",
             "hop 2 only, qgZ first 85%": "hop 2 only (16-bit intra, INT4 cross)",
             "hop 2 only, qgZ first 94%": "hop 2 only (16-bit intra, INT4 cross)"}
# The 0.30x budget on cross-node bytes per step against ZeRO-3.
BYTES_BUDGET = 0.30
TARGET_PCT = 0.1


def slug(name: str) -> str:
    keep = "".join(c if c.isalnum() else "_" for c in name.lower())
    return "_".join(p for p in keep.split("_") if p)


# -- the worker: one training run in its own process ----------------------------------------


def make_config(mode: str, cfg: dict, steps: int):
    import zeropp_jax as zpp

    kw = dict(compute_dtype="bfloat16", gradient_clipping=None, weight_bits=8,
              weight_format=None, grad_bits=4, blockwise=True, remat="minimal", prefetch=1,
              qgz_hadamard=False, qwz_hadamard=False, stochastic_rounding=False,
              qgz_error_feedback=False, qgz_signs="fixed")
    kw.update(cfg)
    if kw.get("qgz_until") is not None:
        kw["planned_steps"] = steps
    return zpp.ZeroPPConfig.from_mode(mode, **kw)


def adam_state(opt_state):
    """The ``ScaleByAdamState`` (count, mu, nu) inside an optax chain's state."""
    import optax

    found = [s for s in _walk(opt_state) if isinstance(s, optax.ScaleByAdamState)]
    if len(found) != 1:
        raise RuntimeError(f"expected one ScaleByAdamState in the optimizer state, found "
                           f"{len(found)}")
    return found[0]


def _walk(tree):
    yield tree
    if isinstance(tree, (tuple, list)):
        for t in tree:
            yield from _walk(t)


def leaf_name(path) -> str:
    import jax

    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def _consolidate(state, units):
    """An optimizer-state entry (a dict of per-unit flat buffers, as the optimizer sees the
    primary shards) -> the model's params tree of numpy arrays."""
    from zeropp_jax.comm.placement import ShardedParams

    if not isinstance(units, ShardedParams):
        units = ShardedParams(units=dict(units))
    return state.engine.consolidate(units)


def moment_stats(state) -> dict:
    """Per parameter leaf (the model's tree): sums of ``nu``, ``sqrt(nu)`` and ``mu**2``."""
    import jax
    import numpy as np

    adam = adam_state(state.opt_state)
    nu = _consolidate(state, adam.nu)
    mu = _consolidate(state, adam.mu)
    out = {}
    for (path, v), m in zip(jax.tree_util.tree_leaves_with_path(nu),
                            jax.tree_util.tree_leaves(mu)):
        v = np.asarray(v, np.float64)
        m = np.asarray(m, np.float64)
        out[leaf_name(path)] = {"n": int(v.size), "nu": float(v.sum()),
                                "sqrt_nu": float(np.sqrt(v).sum()), "mu2": float((m ** 2).sum())}
    return out


def moment_arrays(state) -> dict:
    import jax
    import numpy as np

    adam = adam_state(state.opt_state)
    arrays = {}
    for kind in ("mu", "nu"):
        tree = _consolidate(state, getattr(adam, kind))
        for path, v in jax.tree_util.tree_leaves_with_path(tree):
            arrays[f"{kind}:{leaf_name(path)}"] = np.asarray(v, np.float32)
    return arrays


PROBES = {
    # name -> (library qgZ kwargs) or ("hops", hop1, hop2, hadamard)
    "INT4 both hops, Hadamard (ZeRO++)": ("lib", {"hadamard": True}),
    "INT4 both hops, no Hadamard": ("lib", {"hadamard": False}),
    "hop 1 only": ("hops", 4, None, True),
    "hop 2 only": ("hops", None, 4, True),
    "INT4 intra, INT8 cross": ("hops", 4, 8, True),
    "hop 2 only, INT8": ("hops", None, 8, True),
    "two-hop bf16 (rounding only)": ("hops", None, None, False),
}


# The probe variant that predicts each row's nu (rows not listed: none).
PROBE_OF = {
    "zero3, two-hop reduce-scatter": "two-hop bf16 (rounding only)",
    "zeropp + Hadamard": "INT4 both hops, Hadamard (ZeRO++)",
    "zeropp (no Hadamard)": "INT4 both hops, no Hadamard",
    "hop 1 only (INT4 intra, 16-bit cross)": "hop 1 only",
    "hop 2 only (16-bit intra, INT4 cross)": "hop 2 only",
    "INT4 intra, INT8 cross": "INT4 intra, INT8 cross",
    "hop 2 only, INT8 (16-bit intra, INT8 cross)": "hop 2 only, INT8",
}


def make_probe(model, loss_fn, mesh, nodes: int, local: int):
    """``probe(params, batch) -> {variant: {leaf: (sum err^2, sum g^2)}}``: the gradient of
    each device's share of ``batch`` at ``params`` (full, fp32), cast to bf16 as the step's
    gradients are, reduce-scattered leaf by leaf by each variant in ``PROBES`` (padded to
    whole 256-blocks per device), against the exact fp32 sum."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from benchmarks.qgz_hops import hop_reduce_scatter
    from zeropp_jax.comm.qgz import qgz_reduce_scatter

    num = nodes * local
    axes = ("node", "local")

    def grad_of(params, tokens):
        return jax.grad(lambda p: loss_fn(model.apply({"params": p}, tokens[:, :-1]),
                                          tokens[:, 1:]))(params)

    per_device = jax.jit(jax.vmap(grad_of, in_axes=(None, 0)))
    fns = {}
    for name, spec in PROBES.items():
        if spec[0] == "lib":
            f = (lambda kw: lambda v: qgz_reduce_scatter(v[0], **kw))(spec[1])
        else:
            f = (lambda b1, b2, had: lambda v: hop_reduce_scatter(
                v[0], hop1_bits=b1, hop2_bits=b2, hadamard=had))(*spec[1:])
        fns[name] = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(axes), out_specs=P(axes)))

    def probe(params, batch):
        b = batch.reshape(num, -1, batch.shape[-1])
        grads = per_device(params, jnp.asarray(b))
        out = {name: {} for name in PROBES}
        for path, g in jax.tree_util.tree_leaves_with_path(grads):
            g = np.asarray(g.astype(jnp.bfloat16).astype(jnp.float32)).reshape(num, -1)
            n = g.shape[1]
            quantum = num * 256
            n_pad = -(-n // quantum) * quantum
            g = np.pad(g, ((0, 0), (0, n_pad - n)))
            exact = g.sum(0)
            x = jax.device_put(jnp.asarray(g, jnp.bfloat16), NamedSharding(mesh, P(axes)))
            for name, fn in fns.items():
                err = np.asarray(fn(x), np.float64) - exact
                out[name][leaf_name(path)] = (float((err ** 2).sum()),
                                              float((exact.astype(np.float64) ** 2).sum()))
        return out

    return probe


def setup(spec: dict):
    """The model, data, state and steps of one run (``examples/train_gpt.py``'s)."""
    import zeropp_jax as zpp

    nodes, local = spec["nodes"], spec["local"]
    zpp.simulate_cpu_devices(nodes * local)

    import jax
    import numpy as np
    import optax

    from zeropp_demo.data import VOCAB_SIZE, sample_batch, stdlib_corpus, train_val_split
    from zeropp_demo.gpt import GPT, GPTConfig, loss_fn
    from zeropp_jax.train.optim import lr_schedule

    from benchmarks import qgz_hops

    qgz_hops.install(*spec["hops"]) if spec.get("hops") is not None else qgz_hops.uninstall()
    a = spec["model"]
    steps, seed = spec["steps"], spec["seed"]
    mesh = zpp.make_mesh(nodes, local)
    config = make_config(spec["mode"], spec.get("cfg") or {}, steps)
    gpt_cfg = GPTConfig(vocab_size=VOCAB_SIZE, seq_len=a["seq_len"], layers=a["layers"],
                        d_model=a["d_model"], heads=a["heads"], dtype="bfloat16")
    model = GPT(gpt_cfg)
    train_data, val_data = train_val_split(stdlib_corpus())
    first = sample_batch(train_data, a["batch"], a["seq_len"], seed=seed, step=0)
    params = jax.jit(model.init)(jax.random.PRNGKey(seed), first[:, :-1])["params"]
    lr = a["lr"] * spec.get("lr_scale", 1.0)
    tx = optax.adamw(lr_schedule(lr, steps, kind="cosine", warmup=20), weight_decay=0.01)
    state = zpp.TrainState.create(model=model, params=params, tx=tx, mesh=mesh, config=config)

    @zpp.train_step()
    def train_step(state, batch):
        def loss_of(p):
            return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    @zpp.eval_step()
    def eval_step(state, batch):
        return {"loss": loss_fn(state.apply_fn({"params": state.params}, batch[:, :-1]),
                                batch[:, 1:])}

    def batch_at(step: int):
        return sample_batch(train_data, a["batch"], a["seq_len"], seed=seed, step=step)

    val_batches = [sample_batch(val_data, a["batch"], a["seq_len"], seed=10_000 + seed, step=i)
                   for i in range(a["eval_batches"])]

    def evaluate(state) -> float:
        return float(np.mean([float(eval_step(state, b)["loss"]) for b in val_batches]))

    return dict(mesh=mesh, model=model, loss_fn=loss_fn, state=state, train_step=train_step,
                evaluate=evaluate, batch_at=batch_at, first=first)


def cross_node_bytes(s: dict) -> tuple[float, float]:
    """Cross- and intra-node bytes of one step, all devices, from the lowered program."""
    from zeropp_jax.measure.comm_report import comm_report

    report = comm_report(s["train_step"].lower(s["state"], s["first"]), s["mesh"])
    return report.cross_node_bytes, report.intra_node_bytes


def worker(spec: dict) -> dict:
    """One training run: losses, validation, moments every ``moments_every`` steps."""
    import numpy as np

    s = setup(spec)
    a = spec["model"]
    steps = spec["steps"]
    cross, intra = cross_node_bytes(s)
    state, train_step = s["state"], s["train_step"]
    losses, evals, moments, times = [], [], {}, []
    # stop_after: the schedule of ``steps``, cut short (a noise-floor run for the moments).
    end = min(spec.get("stop_after") or steps, steps)
    for step in range(end):
        t0 = time.perf_counter()
        state, metrics = train_step(state, s["batch_at"](step))
        losses.append(float(metrics["loss"]))
        times.append(time.perf_counter() - t0)
        done = step + 1
        if done % a["eval_every"] == 0 or done == end:
            evals.append({"step": done, "val_loss": s["evaluate"](state)})
            print(f"step {done}: validation loss {evals[-1]['val_loss']:.4f}", flush=True)
        if done % a["moments_every"] == 0 or done == end:
            moments[done] = moment_stats(state)
    if spec.get("arrays"):
        np.savez(spec["arrays"], **moment_arrays(state))
    return {
        "name": spec["name"], "seed": spec["seed"], "steps": steps, "nodes": spec["nodes"],
        "local": spec["local"], "mode": spec["mode"], "cfg": spec.get("cfg") or {},
        "hops": spec.get("hops"), "lr_scale": spec.get("lr_scale", 1.0), "end_step": end,
        "losses": losses, "eval": evals,
        "final_val_loss": evals[-1]["val_loss"] if end == steps else None, "moments": moments,
        "cross_node_bytes_per_step": cross, "intra_node_bytes_per_step": intra,
        "step_time_median_s": float(np.median(times[1:])) if len(times) > 1 else times[0],
    }


def checkpoint_worker(spec: dict) -> dict:
    """A finished ``examples/train_gpt.py`` run (``spec["summary"]``, its ``--json``) with
    checkpoints in ``spec["checkpoints"]``: the moments and gradient probes at each saved
    step, and the step's bytes."""
    from zeropp_jax.train import checkpoint

    s = setup(spec)
    run = json.loads(pathlib.Path(spec["summary"]).read_text())
    cross, intra = cross_node_bytes(s)
    probe = make_probe(s["model"], s["loss_fn"], s["mesh"], spec["nodes"], spec["local"])
    moments, probes = {}, {}
    for step in checkpoint.available_steps(spec["checkpoints"]):
        state = checkpoint.restore(spec["checkpoints"], s["state"], step=step)
        moments[step] = moment_stats(state)
        probes[step] = probe(state.consolidate(), s["batch_at"](step))
        print(f"step {step}: moments and probes", flush=True)
    if spec.get("arrays"):
        import numpy as np

        np.savez(spec["arrays"], **moment_arrays(state))
    return {
        "name": spec["name"], "seed": spec["seed"], "steps": spec["steps"],
        "nodes": spec["nodes"], "local": spec["local"], "mode": spec["mode"],
        "cfg": spec.get("cfg") or {}, "hops": None, "losses": run["losses"],
        "eval": run["eval"], "final_val_loss": run["final_val_loss"], "moments": moments,
        "probes": probes, "cross_node_bytes_per_step": cross,
        "intra_node_bytes_per_step": intra, "source": spec["source"],
    }


def bytes_worker(spec: dict) -> dict:
    """Cross-node bytes per step of every row, from lowered programs (nothing runs)."""
    out = {}
    for name, row in ROWS.items():
        s = setup({**spec, "name": name, "mode": row["mode"], "cfg": row.get("cfg"),
                   "hops": row.get("hops")})
        out[name] = dict(zip(("cross", "intra"), cross_node_bytes(s)))
        print(name, out[name], flush=True)
    return out


# -- the driver ------------------------------------------------------------------------------


def model_args(args) -> dict:
    return {k: getattr(args, k) for k in ("batch", "seq_len", "layers", "d_model", "heads", "lr",
                                          "eval_every", "eval_batches", "moments_every")}


WORK = ROOT / "benchmarks" / "out" / "qgz_gap_work"  # checkpoints, moment arrays (big)


def _subprocess(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, text=True, capture_output=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-4000:]}")


def run(name: str, seed: int, args, runs_dir: pathlib.Path) -> dict:
    """One row's run at one seed, from its file in ``runs_dir`` if there. ZeRO-3 runs as
    ``examples/train_gpt.py`` itself (``benchmarks/convergence.py``'s command, plus
    checkpoints every 100 steps), its moments and probes read from the checkpoints after."""
    row = ROWS[name]
    path = runs_dir / f"{slug(name)}_s{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    WORK.mkdir(parents=True, exist_ok=True)
    tag = f"{runs_dir.name}_{slug(name)}_s{seed}"
    spec = {"name": name, "seed": seed, "steps": args.steps, "nodes": args.nodes,
            "local": args.local, "mode": row["mode"], "cfg": row.get("cfg"),
            "hops": row.get("hops"), "model": model_args(args),
            "lr_scale": row.get("lr_scale", 1.0), "stop_after": row.get("stop_after")}
    print(f"running {name}, seed {seed} ...", flush=True)
    t0 = time.time()
    if name == "zero3":
        summary = WORK / f"{tag}_train_gpt.json"
        ckpt = WORK / f"{tag}_ckpt"
        a = spec["model"]
        cmd = [sys.executable, str(ROOT / "examples" / "train_gpt.py"), "--nodes",
               str(args.nodes), "--local", str(args.local), "--steps", str(args.steps),
               "--batch", str(a["batch"]), "--seq-len", str(a["seq_len"]), "--layers",
               str(a["layers"]), "--d-model", str(a["d_model"]), "--heads", str(a["heads"]),
               "--lr", str(a["lr"]), "--eval-every", str(a["eval_every"]), "--eval-batches",
               str(a["eval_batches"]), "--seed", str(seed), "--compute-dtype", "bfloat16",
               "--no-progress", "--json", str(summary), "--mode", "zero3", "--save",
               str(ckpt), "--save-every", str(a["moments_every"])]
        if not summary.exists():
            _subprocess(cmd, f"{name} seed {seed} (train_gpt.py)")
        spec.update(kind="checkpoints", summary=str(summary), checkpoints=str(ckpt),
                    arrays=str(WORK / f"{tag}_moments.npz"),
                    source=" ".join(["python", "examples/train_gpt.py", *cmd[2:]]))
    else:
        spec["arrays"] = str(WORK / f"{tag}_moments.npz")
    _subprocess([sys.executable, __file__, "--worker", json.dumps(spec), "--out", str(path)],
                f"{name} seed {seed}")
    result = json.loads(path.read_text())
    result["wall_s"] = time.time() - t0
    path.write_text(json.dumps(result))
    print(f"  val loss {result['eval'][-1]['val_loss']:.4f} at step {result['eval'][-1]['step']} "
          f"({result['wall_s']:.0f} s)", flush=True)
    return result


def tracked(name: str, seed: int, steps: int) -> dict | None:
    key = (name, seed, steps)
    if key not in TRACKED:
        return None
    file, run_name = TRACKED[key]
    data = json.loads((RESULTS / file).read_text())
    r = data["runs"][run_name]
    return {"name": name, "seed": seed, "steps": steps, "final_val_loss": r["final_val_loss"],
            "eval": r["eval"], "source": f"benchmarks/results/{file} ({run_name!r})",
            # compared with the ZeRO-3 run of the same file (same machine and code)
            "baseline_val_loss": data["runs"]["zero3"]["final_val_loss"]}


def cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def pct(v: float, base: float) -> float:
    return 100.0 * (v - base) / base


def bytes_ratio(name: str, lowered: dict) -> float | None:
    """Cross-node bytes per step averaged over the run, against ZeRO-3's. A lowered program
    counts both branches of qgZ's on/off switch, so a row that switches qgZ off after a
    fraction ``f`` of the steps is priced as ``f`` of its transport's always-on program plus
    ``1 - f`` of the qwZ + hpZ program (the same weights traffic, the unquantized
    reduce-scatter). Error feedback keeps its errors on the device and per-step signs change
    no byte: those rows move what ZeRO++ with Hadamard moves."""
    z = lowered["zero3"]["cross"]
    if name in ROWS and ROWS[name]["mode"] == "zero3":
        return lowered.get(name, lowered["zero3"])["cross"] / z
    if name == "zeropp + Hadamard, lr x 1.016":  # the learning rate moves no byte
        return lowered["zeropp + Hadamard"]["cross"] / z
    if name in lowered and not (ROWS[name].get("cfg") or {}).get("qgz_until"):
        return lowered[name]["cross"] / z
    if name in ROWS:
        f = ROWS[name]["cfg"]["qgz_until"]
        twin = ALWAYS_ON[name]
        return (f * lowered[twin]["cross"] + (1 - f) * lowered["qwZ + hpZ"]["cross"]) / z
    if name in TRACKED_WHAT:
        return lowered["zeropp + Hadamard"]["cross"] / z
    return None


def nu_ratio(run: dict, base: dict) -> dict:
    """sqrt(nu) summed over all elements, run / base, at each step both recorded."""
    out = {}
    for step, stats in run.get("moments", {}).items():
        b = base.get("moments", {}).get(step)
        if b is None:
            continue
        num = sum(s["sqrt_nu"] for s in stats.values())
        den = sum(s["sqrt_nu"] for s in b.values())
        mu_n = sum(s["mu2"] for s in stats.values())
        mu_d = sum(s["mu2"] for s in b.values())
        out[step] = {"sqrt_nu": num / den, "mu_rms": math.sqrt(mu_n / mu_d)}
    return out


def _group(leaf: str) -> str:
    """``block_3/attn/qkv/kernel`` -> ``attn/qkv/kernel``: a leaf's kind over the layers."""
    parts = leaf.split("/")
    return "/".join(parts[1:]) if parts[0].startswith("block_") else leaf


def leaf_groups(run: dict, base: dict, variant: str | None, step: str) -> list[dict]:
    """Per kind of parameter (summed over layers): sqrt(nu) of ``run`` over ``base``'s at
    ``step``, and the ratio the quantization error predicts (``variant``'s probes of
    ``base``, err^2 and g^2 summed over the probed steps)."""
    a, b = run["moments"].get(step), base["moments"].get(step)
    if a is None or b is None:
        return []
    num, den, err, g2 = {}, {}, {}, {}
    for leaf in a:
        k = _group(leaf)
        num[k] = num.get(k, 0.0) + a[leaf]["sqrt_nu"]
        den[k] = den.get(k, 0.0) + b[leaf]["sqrt_nu"]
    for probes in (base.get("probes") or {}).values():
        for leaf, (e, g) in (probes.get(variant) or {}).items():
            k = _group(leaf)
            err[k] = err.get(k, 0.0) + e
            g2[k] = g2.get(k, 0.0) + g
    return [{"group": k, "measured_sqrt_nu": num[k] / den[k] if den[k] else None,
             "predicted_sqrt_nu": math.sqrt(1 + err[k] / g2[k]) if g2.get(k) else None}
            for k in sorted(num)]


def predicted_nu(probes: dict) -> dict:
    """From the probes of the baseline run: per variant, E[err^2] / E[g^2] over the whole
    gradient (the predicted relative inflation of nu), and sqrt(1 + that) (of sqrt(nu))."""
    out = {}
    for step, variants in probes.items():
        for name, leaves in variants.items():
            e = sum(v[0] for v in leaves.values())
            g = sum(v[1] for v in leaves.values())
            worst = max(leaves.items(), key=lambda kv: kv[1][0] / max(kv[1][1], 1e-30))
            out.setdefault(name, {})[step] = {
                "err_over_g2": e / g, "sqrt_nu_ratio": math.sqrt(1 + e / g),
                "worst_leaf": worst[0], "worst_leaf_err_over_g2": worst[1][0] / max(
                    worst[1][1], 1e-30)}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    p.add_argument("--quick", action="store_true", help="tiny model, 20 steps: a smoke run")
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1])
    p.add_argument("--only", nargs="*", default=None, help="run only these rows")
    p.add_argument("--plan", nargs="*", default=None,
                   help="runs in this order, each ROW@SEED (default: every row of --only "
                        "for every seed, ZeRO-3 first)")
    p.add_argument("--tracked-zero3", type=int, nargs="*", default=[],
                   help="seeds whose ZeRO-3 baseline is read from the tracked convergence.py "
                        "run instead of rerun (when reruns reproduce it)")
    p.add_argument("--no-summary", action="store_true", help="only the runs of --plan")
    p.add_argument("--summary-only", action="store_true",
                   help="run nothing: the table from the run files already there")
    add_convergence_run_arguments(p)
    p.add_argument("--moments-every", type=int, default=100)
    args = p.parse_args()
    if args.worker is not None:
        spec = json.loads(args.worker)
        kind = spec.get("kind", "train")
        fn = {"train": worker, "checkpoints": checkpoint_worker, "bytes": bytes_worker}[kind]
        args.out.write_text(json.dumps(fn(spec)))
        return
    if args.quick:
        args.steps, args.layers, args.d_model, args.heads = 20, 2, 64, 4
        args.eval_every, args.eval_batches, args.moments_every = 10, 2, 10
        args.seeds = args.seeds[:1]
        if args.out == DEFAULT_OUT:
            args.out = DEFAULT_OUT.with_name("qgz_gap_quick.json")
    runs_dir = args.out.parent / f"{args.out.stem}_runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    names = args.only or list(ROWS)
    full = not args.quick and (args.nodes, args.local, args.batch, args.seq_len, args.layers,
                               args.d_model, args.heads, args.lr, args.eval_every,
                               args.eval_batches) == (2, 2, 16, 128, 4, 256, 8, 2e-3, 50, 16)
    plan = args.plan or [f"{n}@{seed}" for seed in args.seeds
                         for n in ["zero3", *[n for n in names if n != "zero3"]]]
    for item in plan:
        name, seed = item.rsplit("@", 1)
        if name not in ROWS:
            raise SystemExit(f"--plan {item!r}: unknown row {name!r}; rows: {list(ROWS)}")
        if name == "zero3" and int(seed) in args.tracked_zero3:
            continue
        if not args.summary_only:
            run(name, int(seed), args, runs_dir)
    if args.no_summary:
        return
    # Every finished run of these seeds, in the rows' order; ZeRO-3 of --tracked-zero3 seeds
    # from the tracked convergence.py runs.
    rows: dict[str, dict[int, dict]] = {}
    for name in ROWS:
        for seed in args.seeds:
            path = runs_dir / f"{slug(name)}_s{seed}.json"
            if name == "zero3" and seed in args.tracked_zero3:
                rows.setdefault(name, {})[seed] = tracked(name, seed, args.steps)
            elif path.exists():
                rows.setdefault(name, {})[seed] = json.loads(path.read_text())
    bytes_path = runs_dir / "bytes.json"
    if not bytes_path.exists():
        print("lowering every row's step for its bytes ...", flush=True)
        spec = {"kind": "bytes", "seed": args.seeds[0], "steps": args.steps,
                "nodes": args.nodes, "local": args.local, "model": model_args(args)}
        _subprocess([sys.executable, __file__, "--worker", json.dumps(spec), "--out",
                     str(bytes_path)], "bytes")
    summary = summarize(rows, args, full, json.loads(bytes_path.read_text()))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(summary["table"])
    print(f"wrote {args.out}")


def switching(lowered: dict) -> dict:
    """``qgz_until``'s price: cross-node bytes per step against ZeRO-3's when qgZ (with
    Hadamard, both hops) runs for a fraction ``f`` of the steps and the plain reduce-scatter
    after, and the largest ``f`` within the budget."""
    z = lowered["zero3"]["cross"]
    on = lowered["zeropp + Hadamard"]["cross"] / z
    off = lowered["qwZ + hpZ"]["cross"] / z
    return {"qgz_on": on, "qgz_off": off,
            "by_fraction": {f: f * on + (1 - f) * off for f in (0.5, 0.85, 0.9, 0.95)},
            "max_fraction": (off - BYTES_BUDGET) / (off - on) if off > BYTES_BUDGET else 0.0}


def noise_floor(rows: dict, z: dict, args) -> dict:
    """How far ZeRO-3 runs that differ only in floating-point rounding land apart: this
    machine's seed-0 ZeRO-3 against the tracked ones of the same command (written on other
    machines and library versions), and the two-hop reduce-scatter's ZeRO-3 if it ran."""
    seed = args.seeds[0]
    runs = []
    if seed in z:
        runs.append({"run": "zero3, this machine", "val_loss": z[seed]["final_val_loss"]})
    for file in ("convergence_feedback.json", "convergence.json"):
        path = RESULTS / file
        if path.exists():
            data = json.loads(path.read_text())
            if data["settings"].get("seed") == seed and data["settings"]["steps"] == args.steps:
                runs.append({"run": f"zero3, benchmarks/results/{file}",
                             "val_loss": data["runs"]["zero3"]["final_val_loss"]})
    vals = [r["val_loss"] for r in runs]
    two_hop = rows.get("zero3, two-hop reduce-scatter", {}).get(seed)
    at = None
    if two_hop is not None and seed in z:  # a shorter run: compare where both evaluated
        here = {e["step"]: e["val_loss"] for e in z[seed]["eval"]}
        last = two_hop["eval"][-1]
        if last["step"] in here:
            at = {"step": last["step"], "two_hop": last["val_loss"], "zero3": here[last["step"]],
                  "diff_pct": pct(last["val_loss"], here[last["step"]])}
    if len(vals) < 2:
        return {"seed": seed, "runs": runs, "spread_pct": None, "two_hop": at}
    mid = sum(vals) / len(vals)
    return {"seed": seed, "runs": runs, "spread_pct": 100 * (max(vals) - min(vals)) / mid,
            "two_hop": at,
            "std_pct": 100 * (sum((v - mid) ** 2 for v in vals) / (len(vals) - 1)) ** 0.5
            / mid}


def reproduced(rows: dict, args) -> list[dict]:
    """Runs of this benchmark that repeat a tracked convergence.py run: how close they land
    (the first loss differs by ~1e-5 across machines, so the trajectories part)."""
    out = []
    for name in ("zero3", "zeropp + Hadamard"):
        for seed, r in rows.get(name, {}).items():
            t = tracked(name, seed, args.steps)
            if t is None or r.get("source", "").startswith("benchmarks/results"):
                continue
            out.append({"config": name, "seed": seed, "here": r["final_val_loss"],
                        "tracked": t["final_val_loss"], "tracked_source": t["source"],
                        "diff_pct": pct(r["final_val_loss"], t["final_val_loss"])})
    return out


def summarize(rows, args, full: bool, lowered: dict) -> dict:
    seeds = args.seeds
    if full:  # the tracked convergence.py runs with these settings
        for name in TRACKED_WHAT:
            for seed in seeds:
                t = tracked(name, seed, args.steps)
                if t is not None:
                    rows.setdefault(name, {})[seed] = t
    z = {s: r for s, r in rows.get("zero3", {}).items() if s in seeds}
    table_rows = []
    for name, by_seed in rows.items():
        entry = {"config": name,
                 "what": ROWS[name]["what"] if name in ROWS else TRACKED_WHAT.get(name, ""),
                 "val_loss": {}, "vs_zero3_pct": {}}
        for s, r in by_seed.items():
            if s not in z or r["final_val_loss"] is None:
                continue
            entry["val_loss"][s] = r["final_val_loss"]
            base = r.get("baseline_val_loss", z[s]["final_val_loss"])
            entry["vs_zero3_pct"][s] = pct(r["final_val_loss"], base)
        vals = list(entry["vs_zero3_pct"].values())
        entry["mean_vs_zero3_pct"] = sum(vals) / len(vals) if vals else None
        entry["seeds"] = sorted(entry["val_loss"])
        any_run = next(iter(by_seed.values()))
        entry["bytes_vs_zero3"] = bytes_ratio(name, lowered)
        entry["source"] = any_run.get("source", "this benchmark")
        entry["nu_vs_zero3"] = {s: nu_ratio(r, z[s]) for s, r in by_seed.items()
                                if "moments" in r and "moments" in z.get(s, {})}
        table_rows.append(entry)
    predicted = {s: predicted_nu(z[s].get("probes", {})) for s in z}
    for entry in table_rows:  # nu's predicted inflation: the mean over the probed steps
        variant = PROBE_OF.get(entry["config"])
        by_step = predicted.get(args.seeds[0], {}).get(variant, {}) if variant else {}
        entry["predicted_err_over_g2"] = (
            sum(v["err_over_g2"] for v in by_step.values()) / len(by_step) if by_step else None)
        entry["predicted_sqrt_nu"] = (math.sqrt(1 + entry["predicted_err_over_g2"])
                                      if by_step else None)
        seed = args.seeds[0]
        run0 = rows.get(entry["config"], {}).get(seed)
        entry["leaf_groups"] = (leaf_groups(run0, z[seed], variant, str(args.steps))
                                if run0 is not None and "moments" in run0 and seed in z
                                and "moments" in z[seed] else [])
    lines = ["| config | what it isolates | " + " | ".join(f"seed {s} vs ZeRO-3" for s in seeds)
             + " | mean | cross-node bytes vs ZeRO-3 | sqrt(nu) vs ZeRO-3 at the end "
             "| predicted from the error |",
             "| --- | --- | " + " | ".join("---" for _ in seeds) + " | --- | --- | --- | --- |"]
    for e in table_rows:
        cells = [f"{e['vs_zero3_pct'][s]:+.2f}%" if s in e["vs_zero3_pct"] else "—"
                 for s in seeds]
        b = e["bytes_vs_zero3"]
        nu = [v[str(args.steps)]["sqrt_nu"] for v in e["nu_vs_zero3"].values()
              if str(args.steps) in v]
        nu_cell = " / ".join(f"{x:.4f}" for x in nu) if nu else "—"
        mean = e["mean_vs_zero3_pct"]
        lines.append(f"| {e['config']} | {e['what']} | " + " | ".join(cells)
                     + (f" | {mean:+.2f}% | " if mean is not None else " | — | ")
                     + (f"{b:.3f}x" if b is not None else "—") + f" | {nu_cell} | "
                     + (f"{e['predicted_sqrt_nu']:.4f}" if e["predicted_sqrt_nu"] else "—")
                     + " |")
    return {"settings": {k: v for k, v in vars(args).items()
                         if k not in ("out", "worker", "only", "plan", "no_summary",
                                      "summary_only")},
            "noise_floor": noise_floor(rows, z, args) if full else None,
            "reproduced": reproduced(rows, args) if full else [],
            "machine": {"cpu": cpu_model(), "cores": os.cpu_count(),
                        "python": platform.python_version()},
            "bytes_budget": BYTES_BUDGET, "target_pct": TARGET_PCT,
            "rows": table_rows, "predicted_nu": predicted,
            # a switching row's program holds both branches: priced in "switching" instead
            "lowered_bytes_per_step": {k: v for k, v in lowered.items()
                                       if not (ROWS.get(k, {}).get("cfg") or {}).get("qgz_until")},
            "switching": switching(lowered),
            "targets": [
                {"config": e["config"], "vs_zero3_pct": e["vs_zero3_pct"],
                 "bytes_vs_zero3": e["bytes_vs_zero3"],
                 "met": all(v <= TARGET_PCT for v in e["vs_zero3_pct"].values())}
                for e in table_rows
                if e["config"] != "zero3" and ROWS.get(e["config"], {}).get("mode") != "zero3"
                and e["bytes_vs_zero3"] is not None and e["bytes_vs_zero3"] <= BYTES_BUDGET
                and len(e["vs_zero3_pct"]) >= 2],
            "zero3_val_loss": {s: z[s]["final_val_loss"] for s in z},
            "zero3_source": {s: z[s].get("source", "") for s in z},
            "table": "\n".join(lines)}


if __name__ == "__main__":
    main()
