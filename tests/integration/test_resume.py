"""The trainer as a user runs it: kill and resume in new processes, and its new flags."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from helpers import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"
TINY = ["--layers", "2", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch", "8",
        "--no-progress", "--no-comm-summary", "--nodes", "2", "--local", "2",
        "--compute-dtype", "float32",
        "--eval-batches", "2"]


def _run(tmp_path: pathlib.Path, name: str, *args: str) -> dict:
    out = tmp_path / f"{name}.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--json", str(out), *args],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


# Both cases (42 s and 58 s, the suite's slowest) run in `make test-all`, to keep `make
# test` under ten minutes; in `make test` the library-level checkpoint tests cover
# restoring across meshes bit for bit, test_checkpoint.py a save killed midway, and
# test_trainer_flags_accum_clip_schedule_eval_save the CLI's save path.
@pytest.mark.parametrize("mode,resume_mesh", [
    pytest.param("zero3", ("4", "1"), marks=pytest.mark.slow),
    pytest.param("zeropp", ("2", "2"), marks=pytest.mark.slow)])
def test_kill_and_resume_in_a_new_process_equals_one_run(tmp_path, mode, resume_mesh):
    """2N steps in one process == N steps, save, then a new process that restores and runs
    the other N. Bitwise: the restored state is the saved one bit for bit, the data depends
    only on (seed, step), the schedule on the step counter, and qwZ/qgZ quantization is
    deterministic, so nothing may differ at all. fp32 ZeRO-3 resumes on another mesh shape
    (4x1 instead of 2x2: the same 4 devices and sums). ZeRO++ resumes on the same shape: on
    another one its quantization blocks and qgZ hops fall elsewhere, which changes the
    rounding, not the state (the state itself restores exactly on any mesh: see
    test_checkpoint)."""
    common = ["--mode", mode, "--steps", "6", "--accum", "2", "--clip", "0.5"]
    full = _run(tmp_path, "full", *common)
    ck = tmp_path / "ck"
    first = _run(tmp_path, "first", *common, "--stop-after", "3", "--save", str(ck))
    assert (ck / "step_00000003").is_dir()
    second = _run(tmp_path, "second", *common, "--resume", str(ck), "--nodes", resume_mesh[0],
                  "--local", resume_mesh[1])
    assert (first["start_step"], first["end_step"]) == (0, 3)
    assert (second["start_step"], second["end_step"]) == (3, 6)
    assert len(second["losses"]) == 3
    assert first["losses"] + second["losses"] == full["losses"]
    assert second["final_val_loss"] == full["final_val_loss"]


def test_trainer_flags_accum_clip_schedule_eval_save(tmp_path):
    ck = tmp_path / "ck"
    run = _run(tmp_path, "run", "--steps", "6", "--accum", "2", "--clip", "0.5",
               "--lr-schedule", "linear", "--warmup", "2", "--eval-every", "2",
               "--save", str(ck), "--save-every", "2")
    assert [e["step"] for e in run["eval"]] == [2, 4, 6]
    assert all(np.isfinite(e["val_loss"]) for e in run["eval"])
    assert run["accum"] == 2 and run["config"]["gradient_clipping"] == 0.5
    assert (tmp_path / "run.png").stat().st_size > 10_000  # the loss-curve picture
    # Saved every 2 steps, keeping the newest 3; nothing else but the saves' lock file and
    # the file naming the job that writes the directory.
    assert sorted(p.name for p in ck.iterdir()) == [".lock", ".writer", "step_00000002",
                                                     "step_00000004", "step_00000006"]
    # Resuming a finished run runs nothing and says so in its JSON.
    again = _run(tmp_path, "again", "--steps", "6", "--resume", str(ck))
    assert again["losses"] == [] and again["start_step"] == 6


# At library level test_ulysses holds the sequence-parallel step to one-device training, as
# test_engine holds the data-parallel one; this runs the CLI flag end to end.
@pytest.mark.slow
def test_sequence_parallel_cli_equals_data_parallel(tmp_path):
    common = ["--steps", "3", "--nodes", "2", "--local", "2"]
    dp = _run(tmp_path, "dp", *common)
    sp = _run(tmp_path, "sp", *common, "--sequence-parallel")
    assert sp["sequence_parallel"] and not dp["sequence_parallel"]
    # fp32: the same tokens and weights; only the grouping of sums differs (~1e-7), and
    # Adam's eps=1e-8 in the example can amplify tiny gradient differences over 3 steps.
    np.testing.assert_allclose(sp["losses"], dp["losses"], rtol=1e-5)


def test_bad_flags_are_rejected(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--accum", "3"],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=subprocess_env())
    assert proc.returncode != 0 and "divisible by --accum" in proc.stderr
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--resume",
                           str(tmp_path / "nothing")],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=subprocess_env())
    assert proc.returncode != 0 and "no checkpoint" in proc.stderr
