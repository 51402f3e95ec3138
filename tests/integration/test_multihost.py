"""examples/multihost.py: 2 processes x 2 CPU devices joined by jax.distributed (gloo, on
loopback) train exactly like one process with a 2x2 mesh.

Tolerance (fp32, rtol 1e-5): both runs execute the same per-device program on the same
global batches and the same initial parameters; what differs is who sums across devices.
In one process XLA's in-process collectives add the partial gradients; across processes
gloo does, possibly in another order. fp32 addition is not associative, so a gradient can
differ by a few ulps (~1e-7 relative) per step; 4 Adam steps keep that far below 1e-5
(measured: ~1e-7 on the losses). ZeRO++ quantizes in fp32 from identical inputs; a
rounding flip at a block boundary would show up as a larger jump, which has not happened
for this seed but is why the ZeRO++ case checks losses only.
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
from helpers import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
PY = sys.executable
TIMEOUT_S = 300
MODEL = ["--steps", "4", "--batch", "8", "--seq-len", "32", "--layers", "2", "--d-model", "32",
         "--heads", "2", "--compute-dtype", "float32", "--seed", "0", "--no-progress"]


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


def _one_process_run(mode: str) -> tuple[list[float], object]:
    """The same 4 steps in this process on a 2x2 mesh of its devices (the example's own
    ``build``: model, initial parameters, optimizer, config and data): (losses, state)."""
    ex = _load_example()
    args = ex.parse_args(["--coordinator", "unused:0", "--num-processes", "1",
                          "--process-id", "0", "--mode", mode, *MODEL])
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


# zero3 runs in `make test`; the ZeRO++ case adds ~30 s more, so it is slow. The one-process
# reference runs here, in the test's process (the CLI's single-process runs have tests of
# their own: test_example, test_resume).
@pytest.mark.parametrize("mode", ["zero3", pytest.param("zeropp", marks=pytest.mark.slow)])
def test_two_processes_match_one_process(tmp_path, mode):
    extra = (["--save-params", str(tmp_path / "params.npz"), "--save", str(tmp_path / "ck")]
             if mode == "zero3" else [])
    multi = run_multihost(tmp_path, mode, extra)
    single, state = _one_process_run(mode)
    assert (multi["nodes"], multi["local"], multi["processes"]) == (2, 2, 2)
    assert len(multi["losses"]) == len(single) == 4
    np.testing.assert_allclose(multi["losses"], single, rtol=1e-5)
    # Training moved: the comparison is not between two constant sequences.
    assert abs(multi["losses"][-1] - multi["losses"][0]) > 1e-3

    if mode != "zero3":
        return
    # state.consolidate() across processes (process_allgather) gives the parameters of the
    # same 4 steps run here in one process on a 2x2 mesh of this process's devices.
    ref = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
           for path, v in jax.tree_util.tree_leaves_with_path(state.consolidate())}
    got = dict(np.load(tmp_path / "params.npz"))
    assert set(got) == set(ref)
    for name, r in ref.items():
        assert got[name].shape == r.shape and got[name].dtype == r.dtype, name
        # Per tensor against its largest element (Adam normalises tiny gradients).
        g = got[name]
        if name.endswith("qkv/bias"):
            # The key bias gets an exactly-zero gradient in theory (q.b_k shifts all of a
            # query's scores equally; softmax ignores it), so in practice rounding noise,
            # which Adam scales up to +-lr steps. Only its q and v thirds are comparable.
            d = r.shape[-1] // 3
            g, r = np.concatenate([g[..., :d], g[..., 2 * d:]], -1), np.concatenate(
                [r[..., :d], r[..., 2 * d:]], -1)
        # Per tensor against its largest element (measured: <= 3e-7).
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * float(np.max(np.abs(r))),
                                   err_msg=name)
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


def test_checkpoint_one_process_to_two_and_back(tmp_path):
    """1 process (2x4 mesh) saves; 2 processes (2x2, 2 devices each) restore it, train,
    save — each writing only its own shards — and train on; 1 process restores that onto
    1x2 and trains the same steps. Trainable units, AdamW moments, INT8 frozen weights and
    BatchNorm statistics all travel. fp32: only the order of cross-device sums differs
    between meshes (see the module docstring), so rtol 1e-5 on losses and states."""
    import multihost_ckpt as mc

    from zeropp_jax.train import checkpoint as ckpt

    state = mc.build(zpp.make_mesh(2, 4))
    state, _ = mc.step(state, mc.batch(0))
    ckpt.save(tmp_path / "a", state)
    ref_losses = []
    for i in range(1, 5):
        state, value = mc.step(state, mc.batch(i))
        ref_losses.append(float(value))
    ref = mc.flat_state(state)

    out = tmp_path / "final.npz"
    _run_workers(tmp_path, lambda pid, port: [
        str(ROOT / "tests/multihost_ckpt.py"), "--coordinator", f"127.0.0.1:{port}",
        "--process-id", str(pid), "--restore", str(tmp_path / "a"),
        "--save", str(tmp_path / "b"), "--out", str(out)])
    summary = json.loads(pathlib.Path(str(out) + ".json").read_text())
    np.testing.assert_allclose(summary["losses"], ref_losses, rtol=1e-5)
    two = dict(np.load(out))
    assert set(two) == set(ref)
    for k in ref:
        np.testing.assert_allclose(two[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)

    # Written by two processes, each its own shards, then read by one on another mesh.
    step_dir = tmp_path / "b" / "step_00000003"
    meta = json.loads((step_dir / "meta.json").read_text())
    assert meta["written_on"]["processes"] == 2 and meta["frozen"]["quantized"]
    assert {p.name for p in (step_dir / "arrays").glob("ocdbt.process_*")} == {
        "ocdbt.process_0", "ocdbt.process_1"}
    small = zpp.make_mesh(1, 2, devices=jax.devices()[:2])
    back = ckpt.restore(tmp_path / "b", mc.build(small, seed=7))
    assert int(back.step) == 3
    losses = []
    for i in (3, 4):
        back, value = mc.step(back, mc.batch(i))
        losses.append(float(value))
    np.testing.assert_allclose(losses, summary["losses"][2:], rtol=1e-5)
    one = mc.flat_state(back)
    for k in ref:
        np.testing.assert_allclose(one[k], two[k], rtol=1e-5, atol=1e-6, err_msg=k)


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
    losses equal one uninterrupted run (one process, 2 devices; fp32, same mesh: exact up to
    the order of sums, rtol 1e-6)."""
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
    np.testing.assert_allclose(first["losses"] + rest["losses"], whole["losses"], rtol=1e-6)
