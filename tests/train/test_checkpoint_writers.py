"""One job writes a checkpoint directory: a second writer (the job started twice) is
refused with an error naming the first, a writer that died holds nothing, and a save never
deletes a checkpoint of a later step than its own. Nothing a save reported written is ever
deleted by another save."""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from helpers import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOCK_MODULE = ROOT / "zeropp_jax" / "train" / "writer_lock.py"


def _writer_lock():
    """``zeropp_jax.train.writer_lock`` (imported the usual way: it needs no JAX)."""
    from zeropp_jax.train import writer_lock

    return writer_lock


# -- the pruning rule --------------------------------------------------------------------------


def test_pruning_never_removes_a_later_step():
    """The pruning rule (``checkpoint._to_prune``) on random directories: only steps below
    the one saved go, the ``keep`` highest up to it stay, and two writers' case (another
    writer's step 4 beside this writer's 1, 2, 3) keeps step 4."""
    from zeropp_jax.train.checkpoint import _to_prune as to_prune

    assert to_prune([1, 2, 3, 4], 3, 3) == []
    assert to_prune([1, 2, 3, 4], 3, 2) == [1]
    seed = secrets.randbelow(1 << 30)
    rng = np.random.default_rng(seed)
    for _ in range(200):
        steps = sorted(set(rng.integers(0, 50, rng.integers(1, 12)).tolist()))
        step = int(rng.choice(steps))
        keep = int(rng.integers(1, 6))
        gone = to_prune(steps, step, keep)
        left = [s for s in steps if s not in gone]
        upto = [s for s in steps if s <= step]
        msg = f"seed {seed}: steps {steps}, saved {step}, keep {keep}: pruned {gone}"
        assert all(s < step for s in gone), msg
        assert [s for s in left if s <= step] == upto[-keep:], msg
        assert [s for s in left if s > step] == [s for s in steps if s > step], msg


# -- the directory lock, without JAX -----------------------------------------------------------

_HOLDER = """
import importlib.util, pathlib, sys
spec = importlib.util.spec_from_file_location("writer_lock", {module!r})
lock = importlib.util.module_from_spec(spec)
sys.modules["writer_lock"] = lock
spec.loader.exec_module(lock)
got = lock.claim(pathlib.Path({directory!r}))
print("held" if got is None else f"refused by {{got.pid}}", flush=True)
sys.stdin.read()  # hold it until the parent closes stdin (or kills this process)
"""


def _claim_elsewhere(directory: pathlib.Path) -> tuple[subprocess.Popen, str]:
    """A process (plain Python, no JAX) that claims ``directory`` and holds it if it got
    it, and what it said (``held``, or ``refused by <pid>``)."""
    code = _HOLDER.format(module=str(LOCK_MODULE), directory=str(directory))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().strip()


def test_a_held_directory_is_refused_naming_the_holder_and_taken_over_when_it_dies(tmp_path):
    from zeropp_jax.train.checkpoint import _refusal

    lock = _writer_lock()
    proc, said = _claim_elsewhere(tmp_path)
    try:
        assert said == "held", said
        holder = lock.claim(tmp_path)
        assert holder is not None and holder.pid == proc.pid, holder
        msg = _refusal(tmp_path, holder)
        assert f"process {proc.pid} on host {socket.gethostname()}" in msg, msg
        assert "different directory" in msg and f"stop process {proc.pid}" in msg, msg
    finally:
        proc.kill()  # SIGKILL: no cleanup runs, the lock file stays behind
        proc.wait()
    assert (tmp_path / lock.WRITER_FILE).exists()
    assert lock.claim(tmp_path) is None  # the dead process held nothing: taken over
    assert lock.claim(tmp_path) is None  # and held: asking again is free
    lock.release(tmp_path)


def test_one_process_holds_a_directory_under_any_spelling(tmp_path):
    """A symlink to a directory this process writes is the same directory: no refusal of
    itself. The directory made anew (removed by hand) is claimed afresh."""
    import shutil

    lock = _writer_lock()
    d = tmp_path / "ck"
    d.mkdir()
    (tmp_path / "link").symlink_to(d)
    assert lock.claim(d) is None
    assert lock.claim(tmp_path / "link") is None
    shutil.rmtree(d)
    d.mkdir()
    assert lock.claim(tmp_path / "link") is None
    assert (d / lock.WRITER_FILE).exists()
    proc, said = _claim_elsewhere(d)  # the new directory is held, by this process
    proc.kill()
    proc.wait()
    assert said == f"refused by {os.getpid()}", said
    lock.release(tmp_path / "link")
    proc, said = _claim_elsewhere(d)  # released: free for another process
    proc.kill()
    proc.wait()
    assert said == "held", said


_FORKER = """
import importlib.util, os, pathlib, sys
spec = importlib.util.spec_from_file_location("writer_lock", {module!r})
lock = importlib.util.module_from_spec(spec)
sys.modules["writer_lock"] = lock
spec.loader.exec_module(lock)
d = pathlib.Path({directory!r})
assert lock.claim(d) is None
pid = os.fork()
if pid == 0:  # a forked worker: not the writer, and its exit leaves the lock in place
    got = lock.claim(d)
    print("held" if got is None else f"refused by {{got.pid}}", flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("held", flush=True)
sys.stdin.read()
"""


def test_a_process_forked_by_the_writer_neither_holds_nor_frees_the_directory(tmp_path):
    lock = _writer_lock()
    code = _FORKER.format(module=str(LOCK_MODULE), directory=str(tmp_path))
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == f"refused by {proc.pid}"
        assert proc.stdout.readline().strip() == "held"
        holder = lock.claim(tmp_path)  # the forked child has exited: still held
        assert holder is not None and holder.pid == proc.pid, holder
    finally:
        proc.kill()
        proc.wait()


# -- two real writers racing -------------------------------------------------------------------

# Each writer: a one-device state of a tiny model, one warm-up save (so that the race
# times saves, not compiles), then at each round's start time (its own offset added) it
# saves its steps into that round's directory with keep=3, and reports each save's outcome.
# Both stay alive until both are done: the second writer meets a live first one.
_WRITER = """
import json, os, pathlib, sys, time
os.environ["JAX_PLATFORMS"] = "cpu"
import flax.linen as nn
import jax, numpy as np, optax
import zeropp_jax as zpp
from zeropp_jax.train import checkpoint as ckpt

role, work, rounds = sys.argv[1], pathlib.Path(sys.argv[2]), json.loads(sys.argv[3])
model = nn.Dense(3)
params = model.init(jax.random.PRNGKey(0), np.zeros((1, 2), np.float32))["params"]
state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(1, 1, devices=jax.devices()[:1]),
                              config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"))
at = lambda s: state.replace(step=jax.device_put(np.int32(s), state.step.sharding))
ckpt.save(work / f"warm_{{role}}", at(0))
(work / f"ready_{{role}}").touch()
while not (work / "go").exists():
    time.sleep(0.01)
t0 = float((work / "go").read_text())
out = []
for r in rounds:
    while time.time() < t0 + r["start"] + r["offset"][role]:
        time.sleep(0.002)
    for s in r["steps"][role]:
        try:
            ckpt.save(work / r["dir"], at(s), keep=3)
            out.append({{"dir": r["dir"], "step": s, "saved": time.time()}})
        except ckpt.CheckpointError as e:
            out.append({{"dir": r["dir"], "step": s, "refused": str(e)}})
(work / f"result_{{role}}.json").write_text(json.dumps({{"pid": os.getpid(), "out": out}}))
(work / f"done_{{role}}").touch()
while not all((work / f"done_{{x}}").exists() for x in "AB"):
    time.sleep(0.01)
"""

# B starts 0, 0.1 and 0.3 s after A (0.3 s: B's step 4 lands between A's saves, as in the
# report of two jobs in one directory), and A 0.1 s after B.
OFFSETS = [(0.0, 0.0), (0.0, 0.1), (0.0, 0.3), (0.1, 0.0)]
STEPS = {"A": [1, 2, 3], "B": [4]}
# Between rounds' starts: a round's saves of this state take about 0.2 s (measured: 50-70
# ms a save after the warm-up, on the 2-core CPU with other jobs running), and B's last
# offset is 0.3 s. A round that starts late (a loaded machine) only blurs its offset: each
# round has its own directory, and the checks hold whatever the order.
ROUND_S = 0.6


def test_two_writers_racing_never_lose_a_reported_checkpoint(tmp_path):
    from zeropp_jax.train import checkpoint as ckpt

    rounds = [{"dir": f"race_{i}", "start": i * ROUND_S, "offset": {"A": a, "B": b},
               "steps": STEPS} for i, (a, b) in enumerate(OFFSETS)]
    env = subprocess_env(JAX_NUM_CPU_DEVICES="1")
    procs = {role: subprocess.Popen(
        [sys.executable, "-c", _WRITER.format(), role, str(tmp_path), json.dumps(rounds)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for role in "AB"}
    try:
        deadline = time.time() + 300
        while not all((tmp_path / f"ready_{r}").exists() for r in "AB"):
            for role, p in procs.items():
                assert p.poll() is None, f"writer {role} died: {p.stdout.read()[-3000:]}"
            assert time.time() < deadline, "the writers did not get ready"
            time.sleep(0.05)
        (tmp_path / "go").write_text(str(time.time() + 0.5))
        for role, p in procs.items():
            out, _ = p.communicate(timeout=300)
            assert p.returncode == 0, f"writer {role}: {out[-3000:]}"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
    results = {r: json.loads((tmp_path / f"result_{r}.json").read_text()) for r in "AB"}
    host = socket.gethostname()
    for rnd, (a, b) in zip(rounds, OFFSETS):
        d = tmp_path / rnd["dir"]
        got = {r: [o for o in results[r]["out"] if o["dir"] == rnd["dir"]] for r in "AB"}
        where = f"round {rnd['dir']} (A at +{a} s, B at +{b} s): {got}"
        saved = {r: [o["step"] for o in got[r] if "saved" in o] for r in "AB"}
        # Exactly one writer: every save of the first to claim the directory succeeded,
        # every save of the other was refused, naming the holder.
        winner = [r for r in "AB" if saved[r] == STEPS[r]]
        assert len(winner) == 1, where
        loser = "B" if winner[0] == "A" else "A"
        assert saved[loser] == [], where
        for o in got[loser]:
            assert f"process {results[winner[0]]['pid']} on host {host}" in o["refused"], where
            assert "different directory" in o["refused"], where
        # Nothing reported written is missing, and the refused writer left nothing.
        assert ckpt.available_steps(d) == STEPS[winner[0]], where
        assert not list(d.glob(".tmp-*")), where
    # Both writers exited: the directory is free for the next job.
    lock = _writer_lock()
    assert lock.claim(tmp_path / rounds[0]["dir"]) is None
    lock.release(tmp_path / rounds[0]["dir"])
