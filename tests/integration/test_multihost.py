"""examples/multihost.py: 2 processes x 2 CPU devices joined by jax.distributed (gloo, on
loopback) train exactly like one process with a 2x2 mesh.

Both runs execute the same per-device program on the same global batches and the same
initial parameters; what differs is who moves data across devices: XLA's in-process
collectives in one process, gloo across processes. A move is exact, but a sum of more than
two devices' values (an all-reduce or reduce-scatter over the 4 devices) depends on its
order, which gloo's ring need not share with XLA's in-process collectives (fp32 addition is
not associative). So the runs reduce gradients by the two-hop reduce-scatter
(``--reduce-scatter hierarchical``: all-to-alls, then sums in each device's own program,
inside the node and then across nodes; ZeRO++'s qgZ works alike), which no collective
implementation can reorder: the parameters are equal bit for bit after every step. The one
sum left to the collectives is the reported loss, the mean of the 4 devices' losses
(``_loss_bound``). (The default flat reduce-scatter across processes trains in
``test_checkpoint_one_process_to_two_and_back``.)
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import zeropp_jax as zpp
from helpers import U32, fresh_seed, seed_on_failure, subprocess_env
from running_error import assert_within

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
TIMEOUT_S = 300
SEED = fresh_seed()  # the example's parameters and data, fresh each run
MODEL = ["--steps", "4", "--batch", "8", "--seq-len", "32", "--layers", "2", "--d-model", "32",
         "--heads", "2", "--compute-dtype", "float32", "--seed", str(SEED), "--no-progress"]
# Gradients summed by all-to-alls and each device's own adds (the module docstring).
TWO_HOP = ["--reduce-scatter", "hierarchical"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # The workers choose their own device count; drop anything that would override it.
    env = subprocess_env(JAX_PLATFORMS="cpu")
    # The workers import zeropp_jax from this checkout, installed or not.
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()


def run_multihost(tmp: pathlib.Path, mode: str, extra: list[str] = ()) -> dict:
    """2 processes x 2 devices on 127.0.0.1; returns process 0's JSON summary."""
    port = _free_port()
    out = tmp / f"multihost_{mode}.json"
    procs, logs = [], []
    try:
        for pid in range(2):
            log = open(tmp / f"worker{pid}_{mode}.log", "w")
            logs.append(log)
            cmd = [PY, str(ROOT / "examples/multihost.py"), "--coordinator",
                   f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(pid),
                   "--local-devices", "2", "--init-timeout", "60", "--mode", mode, *MODEL,
                   *extra]
            if pid == 0:
                cmd += ["--json", str(out)]
            procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=log,
                                          stderr=subprocess.STDOUT, start_new_session=True))
        for p in procs:
            p.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"multihost workers did not finish within {TIMEOUT_S} s")
    finally:
        _kill(procs)  # no-op when they exited; kills the whole group on failure
        for log in logs:
            log.close()
    for pid, p in enumerate(procs):
        if p.returncode != 0:
            text = (tmp / f"worker{pid}_{mode}.log").read_text()[-3000:]
            pytest.fail(f"worker {pid} exited with {p.returncode}:\n{text}")
    return json.loads(out.read_text())


def _load_example():
    spec = importlib.util.spec_from_file_location("multihost_example",
                                                  ROOT / "examples/multihost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _one_process_run(mode: str, extra: list[str] = ()) -> tuple[list[float], object]:
    """The same 4 steps in this process on a 2x2 mesh of its devices (the example's own
    ``build``: model, initial parameters, optimizer, config and data): (losses, state)."""
    ex = _load_example()
    args = ex.parse_args(["--coordinator", "unused:0", "--num-processes", "1",
                          "--process-id", "0", "--mode", mode, *MODEL, *extra])
    parts = ex.build(args)
    mesh = zpp.make_mesh(2, 2, devices=jax.devices()[:4])
    state = zpp.TrainState.create(model=parts["model"], params=parts["params"],
                                  tx=parts["tx"], mesh=mesh, config=parts["config"])
    from zeropp_demo.data import sample_batch
    from zeropp_demo.gpt import lm_train_step

    step = lm_train_step()
    losses = []
    for i in range(4):
        state, metrics = step(state, sample_batch(parts["data"], args.batch, args.seq_len,
                                                  seed=args.seed, step=i))
        losses.append(float(metrics["loss"]))
    return losses, state


def _loss_bound(loss: float) -> float:
    """How far two runs' reported losses may differ when every device's own loss is the
    same float in both: each is the mean of the 4 devices' positive losses, summed in some
    order (then divided by 4, exactly). A sum of n terms in any order is off by at most
    gamma_{n-1} = (n-1) U / (1 - (n-1) U) times the sum of their magnitudes (the standard
    model, Higham ch. 4), so each run's mean lies within gamma_3 L of the exact mean L, and
    the two within 2 gamma_3 L, with L <= loss / (1 - gamma_3) (``loss`` one run's value)."""
    gamma3 = 3 * U32 / (1 - 3 * U32)
    return 2 * gamma3 * abs(loss) / (1 - gamma3)


# zero3 runs in `make test`; the ZeRO++ case adds ~30 s more, so it is slow. The one-process
# reference runs here, in the test's process (the CLI's single-process runs have tests of
# their own: test_example, test_resume).
@pytest.mark.parametrize("mode", ["zero3", pytest.param("zeropp", marks=pytest.mark.slow)])
def test_two_processes_match_one_process(tmp_path, mode):
    extra = ["--save-params", str(tmp_path / "params.npz")]
    if mode == "zero3":
        extra += ["--save", str(tmp_path / "ck")]
    multi = run_multihost(tmp_path, mode, [*TWO_HOP, *extra])
    single, state = _one_process_run(mode, TWO_HOP)
    assert (multi["nodes"], multi["local"], multi["processes"]) == (2, 2, 2)
    assert multi["reduce_scatter"] == "hierarchical"
    assert len(multi["losses"]) == len(single) == 4
    # Training moved: the comparison is not between two constant sequences.
    assert abs(multi["losses"][-1] - multi["losses"][0]) > 1e-3
    # state.consolidate() across processes (process_allgather) gives the parameters of the
    # same 4 steps run here in one process on a 2x2 mesh of this process's devices, bit for
    # bit (the module docstring).
    ref = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
           for path, v in jax.tree_util.tree_leaves_with_path(state.consolidate())}
    got = dict(np.load(tmp_path / "params.npz"))
    assert set(got) == set(ref)
    with seed_on_failure(SEED):
        for name, r in ref.items():
            assert got[name].shape == r.shape and got[name].dtype == r.dtype, name
            np.testing.assert_array_equal(got[name], r, err_msg=name)
        # At equal parameters only the losses' 4-device mean may differ (``_loss_bound``).
        err = np.abs(np.subtract(multi["losses"], single))
        bound = np.array([_loss_bound(x) for x in single])
        assert np.all(err <= bound), (err, bound)

    if mode != "zero3":
        return
    # The checkpoint both processes wrote (each its own shards, `--save`) restores here, in
    # one process, to exactly the parameters they consolidated.
    restored = zpp.checkpoint.restore(tmp_path / "ck", state)
    assert int(restored.step) == 4
    for path, v in jax.tree_util.tree_leaves_with_path(restored.consolidate()):
        name = "/".join(str(getattr(k, "key", k)) for k in path)
        np.testing.assert_array_equal(np.asarray(v), got[name], err_msg=name)


def test_missing_cluster_arguments_named():
    env = {k: v for k, v in _env().items() if not k.startswith("ZEROPP_")}
    r = subprocess.run([PY, str(ROOT / "examples/multihost.py"), "--steps", "1"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--coordinator" in r.stderr and "ZEROPP_COORDINATOR" in r.stderr


def test_benchmark_hooks_hand_the_run_to_the_cluster_node_worker():
    """examples/multihost.py --control stdin --comm-report --net-iface lo runs the emulated
    cluster's node worker (benchmarks/cluster/node.py; the cluster itself is test_cluster's):
    one process with 2 devices speaking the cluster's stdin protocol."""
    r = subprocess.run(
        [PY, str(ROOT / "examples/multihost.py"), "--coordinator", f"127.0.0.1:{_free_port()}",
         "--num-processes", "1", "--process-id", "0", "--local-devices", "2", *MODEL,
         "--control", "stdin", "--comm-report", "--net-iface", "lo"],
        input='{"steps": 2, "warmup": 1, "label": "a"}\nquit\n', cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    tagged = dict(line.split(" ", 1) for line in r.stdout.splitlines()
                  if line.startswith("ZPP-"))
    ready, phase = json.loads(tagged["ZPP-READY"]), json.loads(tagged["ZPP-PHASE"])
    assert (ready["nodes"], ready["local"], ready["process"]) == (1, 2, 0)
    assert ready["predicted"]["compiled_cross_node_bytes_per_node"] == 0  # a single node
    assert (phase["label"], phase["steps"], len(phase["times"]), len(phase["losses"])) == (
        "a", 2, 2, 2)
    assert phase["iface"] == "lo" and phase["tx_bytes"] >= 0 and phase["rx_bytes"] >= 0


# Two workers (2 CPU devices each, gloo on loopback) holding a tiny GPT state on 2x2.
_TINY_STATE = r"""
import sys
import jax
jax.config.update("jax_num_cpu_devices", 2)
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize("127.0.0.1:{port}", num_processes=2, process_id={pid},
                           initialization_timeout=60)
import numpy as np, optax
import zeropp_jax as zpp
from zeropp_demo.gpt import GPT, GPTConfig
cfg = GPTConfig(vocab_size=32, seq_len=8, layers=1, d_model=16, heads=2)
model = GPT(cfg)
params = model.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                              mesh=zpp.make_mesh(2, 2))
"""

def _start_workers(argv_of, timeout: float, env: dict | None = None,
                   hung: str = "") -> list[tuple[int, str]]:
    """Starts two processes (``argv_of(pid, port)``), waits, returns each one's (return
    code, log); fails the test if they outlive ``timeout`` (``hung`` says why that
    matters)."""
    port = _free_port()
    procs = [subprocess.Popen([PY, *argv_of(pid, port)], cwd=ROOT, env=env or _env(),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True) for pid in range(2)]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        pytest.fail(f"workers did not finish within {timeout} s{hung}")
    finally:
        _kill(procs)
    return [(p.returncode, out) for p, out in zip(procs, outs)]


def _run_workers(tmp: pathlib.Path, argv_of, timeout: float = TIMEOUT_S,
                 env: dict | None = None) -> list[str]:
    """``_start_workers``, requiring both to succeed: their logs."""
    done = _start_workers(argv_of, timeout, env)
    for pid, (code, out) in enumerate(done):
        assert code == 0, f"worker {pid} exited with {code}:\n{out[-3000:]}"
    return [out for _, out in done]


FROZEN = "params['block_0']['dense']['kernel']"  # multihost_ckpt.frozen: the INT8 weight


def _assert_same_state(got: dict, want: dict, what: str) -> None:
    """Every array of a state (``multihost_ckpt.state_arrays``), bit for bit."""
    assert set(got) == set(want), (what, sorted(set(got) ^ set(want)))
    for k, w in want.items():
        assert got[k].shape == w.shape and got[k].dtype == w.dtype, (what, k)
        np.testing.assert_array_equal(got[k], w, err_msg=f"{what}: {k}")


def _assert_first_steps(bound, runs) -> None:
    """``runs``: ``(label, loss, new batch statistics, devices)`` of steps taken from the
    same state on the same batch on different meshes; each within ``bound``
    (``multihost_ckpt.first_step_bound``) of the exact step."""
    loss, stats, loss_bound, stats_bound_on, flips = bound
    # The bound holds where no comparison has operands within their rounding bound of
    # each other; the step has none (tanh, not relu: multihost_ckpt.Block).
    assert not flips, f"comparisons rounding could flip: {flips}"
    # A bound a wrong step fits in would be no check: it stays below 1e-3 of the loss
    # (derived: 3e-5 to 5e-5 of it on 60 fresh seeds). When tried, one step too many moved
    # the loss by 9e-3 of itself and the head's weights scaled by 1 + 1e-3 by 8e-5 of it
    # (1 + 1e-4 stayed inside: the bit-for-bit restore checks are the ones that see it).
    assert loss_bound < 1e-3 * loss, (loss_bound, loss)
    for label, got, got_stats, n in runs:
        assert abs(got - loss) <= loss_bound, (
            f"{label}: loss {got!r}, exact {loss!r}: off by {abs(got - loss):.3g} > "
            f"{loss_bound:.3g}")
        assert_within(got_stats, stats, stats_bound_on(n), f"{label}: batch_stats")


def test_checkpoint_one_process_to_two_and_back(tmp_path):
    """1 process (2x4 mesh) saves; 2 processes (2x2, 2 devices each) restore it, train,
    save — each writing only its own shards — and train on; 1 process restores that onto
    1x2 and trains on. Trainable units, AdamW moments, INT8 frozen weights and BatchNorm
    statistics all travel.

    What a save and a restore do is move bits, so each restore is compared bit for bit
    with the state that was saved, every array of it (``multihost_ckpt.state_arrays``):
    parameters, frozen weights (dequantized), AdamW's moments and count, BatchNorm
    statistics, step. Training on is then compared without a tolerance measured on a run:
    the first step after each restore starts from that same state (bit for bit) on each
    mesh, so its loss and new statistics lie within a bound derived from the step's
    operations (``multihost_ckpt.first_step_bound``: tests/running_error.py) of the exact
    values, on either mesh. Later steps are not compared across meshes: their parameters
    differ by the earlier updates' rounding (2, 4 and 8 rows on a device sum the gradients
    in other orders), which AdamW amplifies by 1/(sqrt(v_hat) + eps) per element (up to
    1e8 where the gradients so far are ~0). A derived bound on them must differentiate
    through the gradient and the update (tests/running_error.py can: ~8 s to compile for
    one step of this model, about this test's whole time). AdamW's moments are checked
    where they travel, bit for bit in each restore; the library's mesh parity of
    training, with derived float64 bounds, is tests/train's. The checkpoint written after
    two of those steps is checked, bit for bit, against the state that wrote it."""
    seed = fresh_seed()
    with seed_on_failure(seed):
        _checkpoint_travels(tmp_path, seed)


def _checkpoint_travels(tmp_path, seed):
    import multihost_ckpt as mc

    from zeropp_jax.train import checkpoint as ckpt

    state = mc.build(zpp.make_mesh(2, 4), seed)
    state, _ = mc.step(state, mc.batch(0, seed))
    ckpt.save(tmp_path / "a", state)
    at_1 = mc.state_arrays(state)
    assert at_1["step"] == 1 and at_1["count"] == 1
    like = {"params": state.consolidate(), "batch_stats": state.batch_stats}
    after, loss_1 = mc.step(state, mc.batch(1, seed))

    out = tmp_path / "final.npz"
    _run_workers(tmp_path, lambda pid, port: [
        str(ROOT / "tests/multihost_ckpt.py"), "--coordinator", f"127.0.0.1:{port}",
        "--process-id", str(pid), "--seed", str(seed), "--restore", str(tmp_path / "a"),
        "--save", str(tmp_path / "b"), "--out", str(out)])
    summary = json.loads(pathlib.Path(str(out) + ".json").read_text())
    assert summary["step"] == 4
    two = dict(np.load(out))

    def part(prefix):
        return {k[len(prefix) + 1:]: v for k, v in two.items() if k.startswith(prefix + ":")}

    # 1 -> 2 processes: the 2x2 restore is the 2x4 state that was saved.
    assert FROZEN in at_1 and "mu['head']['kernel']" in at_1 and "count" in at_1
    _assert_same_state(part("restored"), at_1, "restored on 2 processes")
    _assert_first_steps(mc.first_step_bound(at_1, mc.batch(1, seed), like), [
        ("2x4, 1 process", float(loss_1), after.batch_stats, 8),
        ("2x2, 2 processes", summary["losses"]["1"],
         mc.tree_of(two, "after_1:batch_stats", like["batch_stats"]), 4)])

    # Written by two processes, each its own shards, then read by one on another mesh.
    step_dir = tmp_path / "b" / "step_00000003"
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["written_on"]["processes"] == 2 and meta["frozen"]["quantized"]
    assert {p.name for p in (step_dir / "arrays").glob("ocdbt.process_*")} == {
        "ocdbt.process_0", "ocdbt.process_1"}
    at_3 = part("saved")
    assert at_3["step"] == 3 and at_3["count"] == 3
    # The frozen weights never train: the same as the first checkpoint's.
    np.testing.assert_array_equal(at_3[FROZEN], at_1[FROZEN])
    small = zpp.make_mesh(1, 2, devices=jax.devices()[:2])
    back = ckpt.restore(tmp_path / "b", mc.build(small, seed + 1))
    _assert_same_state(mc.state_arrays(back), at_3, "restored on 1x2")
    back, loss_3 = mc.step(back, mc.batch(3, seed))
    _assert_first_steps(mc.first_step_bound(at_3, mc.batch(3, seed), like), [
        ("2x2, 2 processes", summary["losses"]["3"],
         mc.tree_of(two, "after_3:batch_stats", like["batch_stats"]), 4),
        ("1x2, 1 process", float(loss_3), back.batch_stats, 2)])


_ONE_PROCESS_ONLY = _TINY_STATE + r"""
if jax.process_index() == 0:  # the misuse: a collective call on one process only
    try:
        state.consolidate()
    except zpp.processes.ProcessesDisagree as e:
        print("REFUSED", e)
        sys.exit(0)
    sys.exit(3)
"""


def test_collective_call_on_one_process_only_times_out_with_a_clear_error(tmp_path):
    env = _env()
    # Short: process 1 never makes the call, so the wait is the timeout, whatever its length.
    env["ZEROPP_COLLECTIVE_TIMEOUT_S"] = "2"
    outs = _run_workers(tmp_path, lambda pid, port: [
        "-c", _ONE_PROCESS_ONLY.format(port=port, pid=pid)], timeout=120, env=env)
    # The message gives the time it measured waiting (at least the timeout) and the setting.
    assert re.search(r"REFUSED state\.consolidate: process 0 of 2 waited ([2-9]|1\d) s here "
                     r"\(ZEROPP_COLLECTIVE_TIMEOUT_S=2\)", outs[0]), outs[0][-3000:]
    assert "not under `if jax.process_index() == 0:`" in outs[0]


@pytest.mark.slow
def test_multihost_cli_stop_and_resume_continues_the_run(tmp_path):
    """examples/multihost.py --stop-after 2 --save, then --resume: the 4-step schedule's
    losses equal one uninterrupted run's bit for bit (one process, 2 devices)."""
    def run(name, *extra):
        out = tmp_path / f"{name}.json"
        subprocess.run([PY, str(ROOT / "examples/multihost.py"), "--coordinator",
                        f"127.0.0.1:{_free_port()}", "--num-processes", "1", "--process-id",
                        "0", "--local-devices", "2", *MODEL, *extra, "--json", str(out)],
                       cwd=ROOT, env=_env(), check=True, timeout=TIMEOUT_S,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        return json.loads(out.read_text())

    whole = run("whole")
    first = run("first", "--stop-after", "2", "--save", str(tmp_path / "ck"))
    rest = run("rest", "--resume", "--save", str(tmp_path / "ck"))
    assert rest["first_step"] == 2
    # The same program on the same mesh, the same batches (a function of seed and step) and
    # schedule (of the restored step count), from the state the checkpoint held bit for bit
    # (a restore moves bits: test_two_processes_match_one_process): the same arithmetic.
    with seed_on_failure(SEED):
        assert first["losses"] + rest["losses"] == whole["losses"]
