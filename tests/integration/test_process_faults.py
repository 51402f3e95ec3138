"""Two processes (2 CPU devices each, gloo on loopback) that disagree or fail: every process
gets a clear error within ZEROPP_COLLECTIVE_TIMEOUT_S, never a hang.

One worker run goes through the scenarios in order (each process starting Python, JAX and
``jax.distributed`` costs seconds on 2 cores, so they share it): a batch that differs at the
first step and after it, a save into another directory per process, checkpoints whose shards
process 1 wrote are truncated, deleted or changed, and finally process 1 exiting on an
uncaught error while process 0 waits for it. Each scenario writes one ``CASE name elapsed
message`` line per process (to a file of its own: gloo's lines interleave with the log); the test checks the messages and that each took less than the
collective timeout plus a margin. A regression that hangs shows as the workers' hard
subprocess timeout, a test failure.

Timeouts: ZEROPP_COLLECTIVE_TIMEOUT_S=5 (every wait here that should not happen would run
into it); a scenario may take at most 5 s plus 10 s of slack (2 loaded cores, a compile);
the whole run has 150 s.
"""

from __future__ import annotations

import re

import pytest

from test_multihost import _env, _start_workers

TIMEOUT_S = 5
SLACK_S = 10
RUN_S = 150

_WORKER = r"""
import os, pathlib, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={pid},
                           initialization_timeout=60)
import flax.linen as nn
import numpy as np, optax
import zeropp_jax as zpp
from zeropp_jax.train import checkpoint as ckpt

PID, TMP = {pid}, pathlib.Path({tmp!r})


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, name="out")(nn.relu(nn.Dense(256, name="hidden")(x)))


x0 = np.zeros((8, 6), np.float32)
state = zpp.TrainState.create(model=Net(), params=Net().init(jax.random.PRNGKey(0), x0),
                              tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 2))


@zpp.train_step
def step(state, x):
    loss = lambda p: (state.apply_fn({{"params": p}}, x) ** 2).mean()
    value, g = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=g), value


def case(name, fn):
    t = time.monotonic()
    try:
        fn()
        msg = "NO ERROR"
    except Exception as e:
        msg = f"{{type(e).__name__}}: {{e}}"
    line = f"CASE {{name}} {{time.monotonic() - t:.1f}} {{msg}}".replace("\n", " ")
    print(line, flush=True)
    # The test reads this file, not the log: gloo's own lines share the log's stream and
    # can land in the middle of a printed line.
    with open(TMP / f"cases_{{PID}}.txt", "a") as f:
        f.write(line + "\n")


def at(s, n):
    return s.replace(step=jax.device_put(np.int32(n), s.step.sharding))


# A batch that differs at the very first step (nothing compiled yet), then one that
# differs after a first step both processes agreed on.
case("batch_first", lambda: step(state, np.ones((8 if PID == 0 else 12, 6), np.float32)))
state, _ = step(state, np.ones((8, 6), np.float32))
# One process lowers the step alone (to read its communication report, as the cluster
# benchmark's node 0 does): lowering exchanges nothing, so the next step goes through.
if PID == 0:
    step.lower(state, np.ones((8, 6), np.float32))
case("lower_alone", lambda: step(state, np.ones((8, 6), np.float32)))
case("batch", lambda: step(state, np.ones((8 if PID == 0 else 12, 6), np.float32)))

# One save, another directory per process.
case("dirs", lambda: ckpt.save(TMP / f"own_{{PID}}", state))

# Steps 1..3 into one directory, 1..2 into another; process 0 damages process 1's shards:
# truncated in the newest (3), deleted in 2, changed (same sizes, every byte: with only
# the second half of each file changed, one run on a loaded machine restored without an
# error) in a copy of the other's 2 (a copy: this process's TensorStore cache still holds what it wrote under the old
# name, and would serve it instead of the changed file).
for d, last in (("ck", 3), ("ck2", 2)):
    for n in range(1, last + 1):
        ckpt.save(TMP / d, at(state, n), keep=None)
zpp.processes.rendezvous("test.saved")
DAMAGE = {{"truncate": ("ck", 3), "delete": ("ck", 2), "flip": ("ck3", 2)}}
if PID == 0:
    import shutil
    shutil.copytree(TMP / "ck2", TMP / "ck3")
    for how, (d, n) in DAMAGE.items():
        for f in (TMP / d / f"step_{{n:08d}}" / "arrays" / "ocdbt.process_1" / "d").iterdir():
            raw = bytearray(f.read_bytes())
            if how == "truncate":
                f.write_bytes(bytes(raw[: len(raw) // 2]))
            elif how == "delete":
                f.unlink()
            else:  # every byte: a file's layout (which part a restore reads) varies
                f.write_bytes(bytes(b ^ 0x5A for b in raw))
zpp.processes.rendezvous("test.damaged")
tmpl = lambda: zpp.TrainState.create(model=Net(), params=Net().init(jax.random.PRNGKey(1), x0),
                                     tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 2))
case("truncate", lambda: ckpt.restore(TMP / "ck", tmpl()))  # the latest
case("delete", lambda: ckpt.restore(TMP / "ck", tmpl(), step=2))
case("flip", lambda: ckpt.restore(TMP / "ck3", tmpl()))
case("intact", lambda: ckpt.restore(TMP / "ck", tmpl(), step=1))

# Process 1 fails on its own and exits; process 0 reaches a collective call.
if PID == 1:
    raise RuntimeError("boom: process 1 failed on its own")
case("peer_exited", lambda: state.consolidate())
"""


def _cases(out: str) -> dict[str, tuple[float, str]]:
    got = {}
    for line in out.splitlines():
        m = re.match(r"^CASE (\S+) ([\d.]+) (.*)$", line)
        if m:
            got[m.group(1)] = (float(m.group(2)), m.group(3))
    return got


def _run(tmp_path, script: str, env_extra: dict[str, str]) -> list[tuple[int, str]]:
    """Both workers' (return code, output); fails the test if they outlive RUN_S."""
    env = {**_env(), **env_extra}
    return _start_workers(
        lambda pid, port: ["-c", script.format(port=port, pid=pid, tmp=str(tmp_path))],
        RUN_S, env, hung=": a collective call hung")


def test_processes_that_disagree_or_fail_get_clear_errors_in_time(tmp_path):
    (rc0, out0), (rc1, out1) = _run(tmp_path, _WORKER,
                                    {"ZEROPP_COLLECTIVE_TIMEOUT_S": str(TIMEOUT_S)})
    both = [_cases((tmp_path / f"cases_{pid}.txt").read_text()) for pid in range(2)]
    tails = f"\n--- process 0:\n{out0[-4000:]}\n--- process 1:\n{out1[-4000:]}"
    for pid, cases in enumerate(both):
        names = ["batch_first", "lower_alone", "batch", "dirs", "truncate", "delete", "flip",
                 "intact"]
        assert [n for n in names if n not in cases] == [], tails
        for name in names:
            assert cases[name][0] < TIMEOUT_S + SLACK_S, (pid, name, cases[name], tails)
        assert cases["lower_alone"][1] == "NO ERROR", cases["lower_alone"]
        # A batch that differs, at the first step or after it: every process names both
        # structures (and both go on to the next step).
        for name in ("batch_first", "batch"):
            msg = cases[name][1]
            assert msg.startswith("ValueError: processes passed different global batches"), msg
            assert "process 0 passed {batch: (8, 6) float32}" in msg, msg
            assert "process 1 passed {batch: (12, 6) float32}" in msg, msg
        # Another directory per process: refused before anything is written.
        msg = cases["dirs"][1]
        assert msg.startswith("CheckpointError: checkpoint.save was called with different"), msg
        assert f"process 0 {tmp_path / 'own_0'}" in msg and f"process 1 {tmp_path / 'own_1'}" in msg
        # Damaged shards of process 1: the file, and the intact step to restore instead.
        for name, what in (("truncate", "were written"), ("delete", "is missing")):
            msg = cases[name][1]
            assert msg.startswith("CheckpointError: "), msg
            assert "ocdbt.process_1/d/" in msg and what in msg, msg
            assert "(shard data written by process 1)" in msg, msg
            assert "Step 1 is complete in the same directory: " in msg, msg
            assert f"zpp.checkpoint.restore('{tmp_path / 'ck'}', template, step=1)" in msg, msg
        msg = cases["flip"][1]  # same sizes, other bytes: the read or the checksum fails
        assert msg.startswith("CheckpointError: ") and "damaged" in msg, msg
        assert "Step 1 is complete" in msg and "bound method" not in msg, msg
        assert cases["intact"][1] == "NO ERROR", cases["intact"]
    assert not (tmp_path / "own_0").exists() and not (tmp_path / "own_1").exists()
    # Process 1 raised on its own and exited: process 0 names that, not a misplaced call.
    assert rc1 != 0 and "boom: process 1 failed on its own" in out1, tails
    t, msg = both[0]["peer_exited"]
    assert msg.startswith("ProcessesDisagree: state.consolidate: process 0 of 2 stopped "
                          "waiting"), msg
    assert "process 1 exited on an uncaught RuntimeError: boom" in msg, msg
    assert "not under `if jax.process_index() == 0:`" not in msg, msg
    assert t < TIMEOUT_S + SLACK_S, t
    assert rc0 == 0, tails


class _Client:
    """A coordination-service client stub holding the exit notes peers left."""

    def __init__(self, notes: dict[int, str]):
        self.notes = notes

    def key_value_try_get(self, key: str) -> str:
        p = int(key.rsplit("/", 1)[1])
        if p not in self.notes:
            raise KeyError(key)  # the runtime's NOT_FOUND
        return self.notes[p]


@pytest.mark.parametrize("elapsed, text, notes, expected, absent", [
    # The wait ran out: a missing call (the misuse), or a process stuck elsewhere.
    (5.01, "DEADLINE_EXCEEDED: Barrier timed out", {},
     "process 0 of 2 waited 5 s here (ZEROPP_COLLECTIVE_TIMEOUT_S=5), but not every "
     "process made this call", "without waiting"),
    # The peer exited cleanly without making the call: the misuse, and that it exited.
    (5.01, "DEADLINE_EXCEEDED: Barrier timed out", {1: "exited"},
     "waited 5 s here (ZEROPP_COLLECTIVE_TIMEOUT_S=5), but process 1 exited without making "
     "this call", "not every process"),
    # The peer died on its own error: that error is the cause, not a misplaced call.
    (5.01, "DEADLINE_EXCEEDED: Barrier timed out",
     {1: "exited on an uncaught OSError: disk full"},
     "stopped waiting after 5.0 s: process 1 exited on an uncaught OSError: disk full",
     "process_index() == 0"),
    # The service failed the call at once: it lost a peer (not a 5 s wait).
    (0.2, "UNAVAILABLE: Task 1 heartbeat timeout", {},
     "failed after 0.2 s, without waiting for the 5 s timeout (ZEROPP_COLLECTIVE_TIMEOUT_S): "
     "the coordination service lost a peer process", "waited"),
    (0.2, "INVALID_ARGUMENT: barrier called with other tasks", {},
     "failed after 0.2 s, without waiting for the 5 s timeout (ZEROPP_COLLECTIVE_TIMEOUT_S): "
     "the coordination service refused the call", "waited"),
])
def test_disagreement_says_whether_it_waited_or_a_peer_is_gone(
        monkeypatch, elapsed, text, notes, expected, absent):
    """ProcessesDisagree tells a real wait (elapsed about the timeout) from a call that
    failed at once and from a peer that exited (its exit note), naming which."""
    from zeropp_jax.core import processes

    monkeypatch.setenv("ZEROPP_COLLECTIVE_TIMEOUT_S", str(TIMEOUT_S))
    monkeypatch.setattr(processes.jax, "process_count", lambda: 2)
    monkeypatch.setattr(processes.jax, "process_index", lambda: 0)
    err = processes._disagree("checkpoint.save", RuntimeError(text), elapsed, _Client(notes))
    assert isinstance(err, processes.ProcessesDisagree)
    assert str(err).startswith("checkpoint.save: process 0 of 2"), str(err)
    assert expected in str(err), str(err)
    assert absent not in str(err), str(err)
