"""One job writes a checkpoint directory: a second writer (the job started twice) is
refused with an error naming the first, a writer that died holds nothing, and a save never
deletes a checkpoint of a later step than its own. Nothing a save reported written is ever
deleted by another save."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from helpers import fresh_seed, subprocess_env

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
    seed = fresh_seed()
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

# B starts 0, 0.1 and 0.3 s after A (0.3 s: B's step 4 lands between A's saves, as when a
# job started twice lost a checkpoint), and A 0.1 s after B.
OFFSETS = [(0.0, 0.0), (0.0, 0.1), (0.0, 0.3), (0.1, 0.0)]
STEPS = {"A": [1, 2, 3], "B": [4]}
# Between rounds' starts: a round's saves of this state take about 0.2 s (measured: 50-70
# ms a save after the warm-up, on the 2-core CPU with other jobs running), and B's last
# offset is 0.3 s. A round that starts late (a loaded machine) only blurs its offset: each
# round has its own directory, and the checks hold whatever the order.
ROUND_S = 0.6


def test_two_writers_racing_never_lose_a_reported_checkpoint(tmp_path):
    """Writer A is this process, writer B another (``checkpoint_race_writer``), both alive
    through every round: in each round's directory exactly one writer's saves land, every
    one of them is there afterwards, and each of the other's is refused naming the
    first."""
    import checkpoint_race_writer as writer
    from zeropp_jax.train import checkpoint as ckpt

    rounds = [{"dir": f"race_{i}", "start": i * ROUND_S, "offset": {"A": a, "B": b},
               "steps": STEPS} for i, (a, b) in enumerate(OFFSETS)]
    proc = subprocess.Popen(
        [sys.executable, writer.__file__, "B", str(tmp_path), json.dumps(rounds)],
        cwd=ROOT, env=subprocess_env(JAX_NUM_CPU_DEVICES="1", JAX_PLATFORMS="cpu"),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        state = writer.tiny_state()  # while B starts
        writer.warm_up("A", tmp_path, state)
        deadline = time.time() + 300
        while not (tmp_path / "ready_B").exists():
            assert proc.poll() is None, f"writer B died: {proc.stdout.read()[-3000:]}"
            assert time.time() < deadline, "writer B did not get ready"
            time.sleep(0.02)
        (tmp_path / "go").write_text(str(time.time() + 0.3))
        results = {"A": writer.run("A", tmp_path, rounds, state)}
        (tmp_path / "done_A").touch()
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"writer B: {out[-3000:]}"
    finally:
        (tmp_path / "done_A").touch()
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    results["B"] = json.loads((tmp_path / "result_B.json").read_text())
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
    # B exited: the directories it held are free for the next job.
    lock = _writer_lock()
    for rnd in rounds:
        if any("saved" in o for o in results["B"]["out"] if o["dir"] == rnd["dir"]):
            assert lock.claim(tmp_path / rnd["dir"]) is None, rnd["dir"]
            lock.release(tmp_path / rnd["dir"])
