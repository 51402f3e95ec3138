"""Simulated CPU devices must not deadlock when the host runs many steps ahead.

XLA's CPU client launches each device's part of a multi-device program on the same thread
pool that runs those parts, and a launch blocks once its device has 32 programs in flight.
With the default pool (max(cores, devices) threads) a loop that never reads a value then
deadlocks around step 32: n - 1 threads wait in a collective for the last device, whose part
has no thread left to run on (the last thread is its launch, blocked on the semaphore).
``simulate_cpu_devices`` sizes the pool (PJRT_NPROC) so one thread always stays free.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from zeropp_jax.core import mesh as mesh_mod

from helpers import subprocess_env

# A plain shard_map all_gather / matmul / psum_scatter step, slow enough (a few ms) that the
# host dispatches far more than 32 steps ahead of the devices; nothing is read until the end.
# Without the pool sizing it hangs at step ~32 in nearly every run (then XLA aborts after
# 40 s); a watchdog thread turns a hang into exit code 3 after 10 s without progress.
SCRIPT = textwrap.dedent(
    """
    import os, sys, threading, time
    import zeropp_jax as zpp
    zpp.simulate_cpu_devices(4)
    import jax, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = zpp.make_mesh(2, 2)
    axes = ("node", "local")

    def body(x, w):
        for _ in range(3):
            full = jax.lax.all_gather(x, axes, tiled=True)
            x = x + 1e-3 * jax.lax.psum_scatter(jnp.tanh(full @ w), axes, tiled=True)
        return x

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axes), P()),
                                 out_specs=P(axes)))
    x = jax.device_put(jnp.full((256, 256), 0.01), NamedSharding(mesh, P(axes)))
    w = jax.device_put(jnp.eye(256), NamedSharding(mesh, P()))
    x = step(x, w).block_until_ready()  # compiled

    done = [0]
    def watchdog():
        last, since = -1, time.time()
        while True:
            time.sleep(0.5)
            if done[0] != last:
                last, since = done[0], time.time()
            elif time.time() - since > 10:
                print(f"HANG at step {done[0]}", flush=True)
                os._exit(3)
    threading.Thread(target=watchdog, daemon=True).start()
    for i in range(120):
        x = step(x, w)
        done[0] = i + 1
    x.block_until_ready()
    print("PJRT_NPROC", os.environ.get("PJRT_NPROC"), "OK", flush=True)
    """
)


def test_many_steps_in_flight_do_not_deadlock(tmp_path):
    env = subprocess_env()
    for name in ("PJRT_NPROC", "NPROC"):  # the child sizes its own pool
        env.pop(name, None)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
        timeout=120, cwd=tmp_path,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    assert out.stdout.split()[-1] == "OK"
    assert int(out.stdout.split()[1]) >= 2 * 4 + 1  # the child's PJRT_NPROC


def test_pool_sizing_in_effect():
    # conftest simulated 8 devices before the backend started: the pool it asked for has
    # 2 * 8 + 1 threads at least, and XLA reads that value.
    assert int(os.environ["PJRT_NPROC"]) >= 2 * 8 + 1
    assert mesh_mod.cpu_pool_threads(8) >= 2 * 8 + 1


def test_cpu_client_threads(monkeypatch):
    monkeypatch.setattr(mesh_mod, "_schedulable_cores", lambda: 2)
    for name in ("PJRT_NPROC", "NPROC"):
        monkeypatch.delenv(name, raising=False)
    assert mesh_mod.cpu_client_threads(4) == 9
    assert mesh_mod.cpu_client_threads(8) == 17
    monkeypatch.setattr(mesh_mod, "_schedulable_cores", lambda: 64)
    assert mesh_mod.cpu_client_threads(8) == 64  # never below XLA's default
    monkeypatch.setenv("NPROC", "40")
    assert mesh_mod.cpu_client_threads(8) == 40  # a user's reservation is kept
    monkeypatch.setenv("PJRT_NPROC", "3")
    assert mesh_mod.cpu_client_threads(8) == 17  # ... but never too small to be safe


def test_one_device_leaves_the_pool_alone(monkeypatch):
    monkeypatch.delenv("PJRT_NPROC", raising=False)
    mesh_mod._size_cpu_client_pool(1)
    assert "PJRT_NPROC" not in os.environ


def test_pacer_only_where_the_pool_is_too_small(monkeypatch):
    import jax
    import jax.numpy as jnp

    import zeropp_jax as zpp
    from zeropp_jax.train.dispatch import StepPacer, needs_pacing

    mesh = zpp.make_mesh(2, 4)
    assert not needs_pacing(mesh)  # conftest's simulate_cpu_devices sized the pool
    assert not needs_pacing(zpp.make_mesh(1, 1, devices=jax.devices()[:1]))
    monkeypatch.setenv("PJRT_NPROC", "2")  # XLA's default pool on 2 cores
    assert needs_pacing(mesh)

    waited = []
    monkeypatch.setattr(jax, "block_until_ready", lambda xs: waited.append(len(xs)))
    pacer = StepPacer(depth=2)
    outs = [pacer(mesh, lambda: {"loss": jnp.float32(i)}) for i in range(5)]
    assert len(outs) == 5 and waited == [1, 1, 1]  # steps 0..2 waited for before 2..4
    assert len(pacer._in_flight) == 2
