"""Deadlock of async-dispatched training on simulated CPU devices: hang counts per variant.

    python benchmarks/deadlock_repro.py --runs 10 --steps 300 --nodes 2 --local 2 \
        --json benchmarks/out/deadlock_2x2.json

Each run is a fresh process: ZeRO-3 fp32 on a small GPT (``zeropp_demo.gpt``), a loop of
``--steps`` steps that reads nothing until the end (so the host dispatches far ahead of the
devices). A watchdog thread reports a hang after ``--hang-s`` seconds without a step being
dispatched (the first, compiling step excluded) and ends the run. Variants, interleaved:

  nofix   the CPU client's default pool (``simulate_cpu_devices``'s sizing switched off):
          XLA's launches block on the per-device in-flight semaphore (32 programs) inside the
          pool that must run the programs, and the pool deadlocks (most runs, by step ~100);
  fix     ``simulate_cpu_devices`` as shipped (PJRT_NPROC = 2 * devices + 1);
  pacer   default pool, steps paced by ``zeropp_jax.train.dispatch.StepPacer`` (at most 2
          steps in flight), the fallback for devices simulated without simulate_cpu_devices.

A benchmark, not a test: a hang-free run of the ``nofix`` variant is possible, and the rate
depends on the machine's load (measured on 2 shared cores).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

VARIANTS = ["nofix", "fix", "pacer"]


def child(a: argparse.Namespace) -> None:
    import threading

    import zeropp_jax as zpp
    import zeropp_jax.core.mesh as mesh_mod

    if a.variant != "fix":
        mesh_mod._size_cpu_client_pool = lambda n: None
    zpp.simulate_cpu_devices(a.nodes * a.local)
    import jax
    import numpy as np
    import optax

    from zeropp_demo.gpt import GPT, GPTConfig, loss_fn

    model = GPT(GPTConfig(vocab_size=64, seq_len=16, layers=2, d_model=32, heads=4,
                          dtype="float32"))
    mesh = zpp.make_mesh(a.nodes, a.local)
    tok = np.random.default_rng(0).integers(0, 64, (4 * a.nodes * a.local, 17)).astype(np.int32)
    params = model.init(jax.random.PRNGKey(0), tok[:2, :-1])["params"]
    state = zpp.TrainState.create(model=model, params=params, tx=optax.adam(1e-3), mesh=mesh,
                                  config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"))

    @zpp.train_step
    def step(state, batch):
        def loss_of(p):
            return loss_fn(state.apply_fn({"params": p}, batch[:, :-1]), batch[:, 1:])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    if a.variant == "pacer":
        from zeropp_jax.train.dispatch import StepPacer

        pacer, raw = StepPacer(), step

        def step(state, batch):  # noqa: F811
            return pacer(state.engine.mesh, lambda: raw(state, batch))

    done = [0]

    def watchdog() -> None:
        last, since = -1, time.time()
        while True:
            time.sleep(0.5)
            if done[0] != last:
                last, since = done[0], time.time()
            elif done[0] >= 1 and time.time() - since > a.hang_s:
                print(f"HANG at step {done[0]}", flush=True)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    t0 = time.perf_counter()
    for i in range(a.steps):
        state, metrics = step(state, tok)
        done[0] = i + 1
    loss = float(metrics["loss"])
    print(f"OK loss {loss:.4f} {time.perf_counter() - t0:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="runs per variant (default 10)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--local", type=int, default=2)
    p.add_argument("--variants", nargs="+", default=VARIANTS, choices=VARIANTS)
    p.add_argument("--hang-s", type=float, default=12.0)
    p.add_argument("--json", default=None, help="also write the counts here")
    p.add_argument("--child", dest="variant", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.variant is not None:
        child(a)
        return {}
    env = {k: v for k, v in os.environ.items() if k not in ("PJRT_NPROC", "XLA_FLAGS")}
    counts = {v: {"ok": 0, "hang": 0, "other": 0} for v in a.variants}
    for r in range(a.runs):
        for v in a.variants:
            cmd = [sys.executable, __file__, "--child", v, "--steps", str(a.steps),
                   "--nodes", str(a.nodes), "--local", str(a.local), "--hang-s", str(a.hang_s)]
            try:
                out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                     timeout=300).stdout
            except subprocess.TimeoutExpired:
                out = ""
            kind = "ok" if out.startswith("OK") else "hang" if "HANG" in out else "other"
            counts[v][kind] += 1
            print(f"run {r + 1} {v:6s} {out.strip() or kind}", flush=True)
    print(f"\n{a.nodes}x{a.local}, {a.steps} steps, {a.runs} runs per variant:")
    for v, c in counts.items():
        print(f"  {v:6s} ok {c['ok']:3d}  hang {c['hang']:3d}  other {c['other']:3d}")
    if a.json:
        import json
        import pathlib

        path = pathlib.Path(a.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"nodes": a.nodes, "local": a.local, "steps": a.steps,
                                    "runs": a.runs, "hang_s": a.hang_s, "counts": counts,
                                    "cpus": os.cpu_count()}, indent=1))
        print(f"wrote {path}")
    return counts


if __name__ == "__main__":
    main()
