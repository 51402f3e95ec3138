"""Checkpoints: save/restore on any mesh, consolidate, and every way a checkpoint can be bad."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.train import checkpoint as ckpt
from zeropp_demo.gpt import GPT, loss_fn

from helpers import subprocess_env, SMALL, U32, init_params, make_step, tokens

ROOT = pathlib.Path(__file__).resolve().parents[2]
FP32 = dict(compute_dtype="float32")
TX = optax.adamw(1e-2, weight_decay=0.1)


def _state(mesh_shape=(2, 4), cfg=None, model=None, params=None, tx=TX, devices=None):
    model = GPT(SMALL) if model is None else model
    params = init_params(seed=31) if params is None else params
    cfg = zpp.ZeroPPConfig.zero3(**FP32) if cfg is None else cfg
    return zpp.TrainState.create(model=model, params=params, tx=tx,
                                 mesh=zpp.make_mesh(*mesh_shape, devices=devices), config=cfg)


def _leaves_equal(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def trained():
    """A 2x4 state after 2 AdamW steps, its checkpoint directory, and the step function."""
    import tempfile

    state = _state()
    step = make_step()
    for i in range(2):
        state, _ = step(state, tokens(16, seed=70 + i))
    d = pathlib.Path(tempfile.mkdtemp()) / "ckpt"
    path = ckpt.save(d, state)
    return state, d, path, step


def test_save_layout_and_restore_on_the_same_mesh(trained):
    state, d, path, _ = trained
    assert path == d.absolute() / "step_00000002"
    assert ckpt.available_steps(d) == [2] and ckpt.latest_step(d) == 2
    meta = json.loads((path / "meta.json").read_text())
    assert meta["step"] == 2 and meta["written_on"]["nodes"] == 2
    restored = ckpt.restore(d, _state())
    assert int(restored.step) == 2
    _leaves_equal(restored.consolidate(), state.consolidate())
    _leaves_equal(restored.opt_state, state.opt_state)
    assert restored.params.units["block_0"].sharding == state.params.units["block_0"].sharding


def test_units_are_restored_by_name_not_position(trained):
    """A template listing the same units in another order (explicit units= reversed, the
    same shapes) gets each unit's own weights back, not its neighbour's."""
    state, d, _, _ = trained
    names = list(state.engine.layouts)
    paths = [state.engine.layouts[n].path for n in names if n != "<rest>"]
    template = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=31), tx=TX,
                                     mesh=zpp.make_mesh(2, 4),
                                     config=zpp.ZeroPPConfig.zero3(**FP32),
                                     units=list(reversed(paths)))
    assert list(template.engine.layouts) != names  # the order really differs
    restored = ckpt.restore(d, template)
    _leaves_equal(restored.consolidate(), state.consolidate())


def test_restore_across_mesh_shapes_and_device_counts(trained):
    """2x4 -> 1x8 -> 4x2 (a checkpoint written on each), then onto 4 devices (other padding)
    and with ZeRO stage 2: identical parameters and optimizer moments, and training
    continues exactly as it would have on the original mesh: the next step's loss on 4x2
    (restored from the checkpoint 1x8 wrote) is the original's. One step program: on 1x8
    the loss would be that of the same parameters, checked bit for bit (one-device
    equality of a mesh's step is test_engine's and test_mesh_optimizers')."""
    import tempfile

    state, d, _, step = trained
    b = tokens(16, seed=99)
    expected, m_exp = step(state, b)
    current = state
    for shape in ((1, 8), (4, 2)):
        current = ckpt.restore(d, _state(shape))
        _leaves_equal(current.consolidate(), state.consolidate())
        # Every mesh of 8 devices pads and cuts the flat units alike (device d holds slice
        # d), so the optimizer state's global arrays compare as they are.
        assert current.engine.layouts == state.engine.layouts
        _leaves_equal(current.opt_state, state.opt_state)
        d = pathlib.Path(tempfile.mkdtemp()) / shape.__repr__()
        ckpt.save(d, current)
    cont, m = step(current, b)
    # fp32, the same parameters (bit for bit) and rows per device: each device's loss is
    # the same computation; only the order in which the mean over the 8 devices adds them
    # may differ. Two fp32 sums of 8 positive terms differ by at most 2 gamma_7,
    # gamma_k = k U32 / (1 - k U32) (any order); a device's loss missing from the mean
    # moves it by an eighth.
    rtol = 2 * 7 * U32 / (1 - 7 * U32)
    assert abs(float(m["loss"]) - float(m_exp["loss"])) <= rtol * float(m_exp["loss"])
    four = ckpt.restore(d, _state((2, 2), devices=jax.devices()[:4]))
    _leaves_equal(four.consolidate(), state.consolidate())
    stage2 = ckpt.restore(d, _state((2, 4), cfg=zpp.ZeroPPConfig(stage=2, **FP32)))
    _leaves_equal(stage2.consolidate(), state.consolidate())
    assert stage2.params.units["block_0"].dtype == np.float32


def test_consolidate_and_load_params_work_with_plain_flax(trained):
    state, d, _, _ = trained
    plain = zpp.consolidate(state)
    loaded = ckpt.load_params(d)
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(plain)
    _leaves_equal(loaded, plain)
    model = GPT(SMALL)
    b = tokens(4, seed=5)
    # Plain flax apply, jitted (op by op it compiles ~40 small programs).
    logits, loss = jax.jit(lambda p, b: (lambda y: (y, loss_fn(y, b[:, 1:])))(
        model.apply({"params": p}, b[:, :-1])))(loaded, b)
    assert logits.shape == (4, SMALL.seq_len, SMALL.vocab_size)
    assert np.isfinite(float(loss))


def test_another_model_shape_is_rejected(trained):
    _, d, _, _ = trained
    other = dataclasses.replace(SMALL, d_model=24)
    model = GPT(other)
    # Only the shapes matter to the check: zeros of init's shapes, without running init.
    params = jax.tree_util.tree_map(
        lambda x: np.zeros(x.shape, x.dtype),
        jax.eval_shape(model.init, jax.random.PRNGKey(0), tokens(2, seed=0)[:, :-1])["params"])
    with pytest.raises(ckpt.CheckpointError, match="another model.*block_0"):
        ckpt.restore(d, _state(model=model, params=params))


def test_another_optimizer_is_rejected(trained):
    _, d, _, _ = trained
    with pytest.raises(ckpt.CheckpointError, match="another optimizer"):
        ckpt.restore(d, _state(tx=optax.sgd(0.1, momentum=0.9)))


def _copy(d: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    import shutil

    dst = tmp_path / "copy"
    shutil.copytree(d, dst)
    return dst


def test_damaged_array_data_is_an_error_not_wrong_weights(trained, tmp_path):
    _, d, _, _ = trained
    d = _copy(d, tmp_path)
    # Every data file (OCDBT's d/ directories), not only the largest: a save that merges
    # per-process files can leave a data file the restore never reads, and damage there
    # alone changes no weight (the test then failed, about one run in five).
    files = [p for p in (d / "step_00000002" / "arrays").rglob("*")
             if p.is_file() and p.parent.name == "d" and p.stat().st_size > 1000]
    assert files
    for path in files:
        raw = bytearray(path.read_bytes())
        for i in range(len(raw) // 2, len(raw) // 2 + 64):
            raw[i] ^= 0xFF
        path.write_bytes(bytes(raw))
    with pytest.raises(ckpt.CheckpointError, match="damaged"):
        ckpt.restore(d, _state())


def test_a_read_error_raised_when_the_reader_closes_is_a_checkpoint_error(
        trained, tmp_path, monkeypatch):
    """Damage tensorstore reports only as orbax's handler closes (seen once: an OCDBT b-tree
    node's CRC-32C failing as a ``ValueError`` after the arrays were read) is a
    ``CheckpointError`` naming the damage, like a failing read."""
    import orbax.checkpoint as ocp

    _, d, _, _ = trained
    message = "DATA_LOSS: Error decoding b-tree node: CRC-32C checksum verification failed"

    def close(self):
        raise ValueError(message)

    monkeypatch.setattr(ocp.PyTreeCheckpointHandler, "close", close)
    with pytest.raises(ckpt.CheckpointError, match="damaged.*CRC-32C"):
        ckpt.restore(d, _state())


def test_partial_checkpoint_directory_is_an_error(trained, tmp_path):
    _, d, _, _ = trained
    d = _copy(d, tmp_path)
    (d / "step_00000002" / "meta.json").unlink()
    with pytest.raises(ckpt.CheckpointError, match="not a complete"):
        ckpt.restore(d, _state())
    with pytest.raises(ckpt.CheckpointError, match="no checkpoint"):
        ckpt.restore(tmp_path / "empty", _state())


_KILLED_SAVE = r"""
import os, sys
sys.path.insert(0, {tests!r})
import zeropp_jax as zpp
zpp.simulate_cpu_devices(8)
import optax
from flax import traverse_util
from zeropp_jax.train import checkpoint as ckpt
from zeropp_demo.gpt import GPT
import jax
import numpy as np
from helpers import SMALL
# The parent's parameters (init_params(seed=31)), read from a file: running the model's
# init here would cost the child a trace and a compile for the same values.
with np.load({params!r}) as f:
    params = traverse_util.unflatten_dict(dict(f), sep="/")
state = zpp.TrainState.create(model=GPT(SMALL), params=params,
    tx=optax.adamw(1e-2, weight_decay=0.1), mesh=zpp.make_mesh(2, 4),
    config=zpp.ZeroPPConfig.zero3(compute_dtype="float32"))
# A save of step 3 (its counter set, as the tests' _at does: what is saved does not matter
# here, only that the save dies; a trained state would cost the child a train-step compile).
state = state.replace(step=jax.device_put(np.int32(3), state.step.sharding))
# The process dies after writing every array, just before the commit rename.
ckpt._finalize = lambda tmp, final: os._exit(17)
ckpt.save({directory!r}, state)
"""


def test_save_killed_midway_leaves_the_previous_checkpoint_usable(trained, tmp_path):
    from flax import traverse_util

    state, d, _, _ = trained
    d = _copy(d, tmp_path)
    params = tmp_path / "params.npz"
    np.savez(params, **traverse_util.flatten_dict(init_params(seed=31), sep="/"))
    code = _KILLED_SAVE.format(tests=str(ROOT / "tests"), directory=str(d), params=str(params))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=600, env=subprocess_env())
    assert proc.returncode == 17, proc.stderr[-2000:]
    assert list(d.glob(".tmp-step_00000003-*")), "the killed save left its temporary directory"
    assert ckpt.available_steps(d) == [2]
    restored = ckpt.restore(d, _state())
    assert int(restored.step) == 2
    _leaves_equal(restored.consolidate(), state.consolidate())
    # The next save clears the debris and commits.
    ckpt.save(d, restored)
    assert not list(d.glob(".tmp-*"))


def _at(state, step):
    return state.replace(step=jax.device_put(np.int32(step), state.step.sharding))


def test_retention_after_a_rollback_keeps_the_later_steps(trained, tmp_path):
    """save 100/200/300, go back to 100, save 110, 120 and 130 (keep=3): the run that went
    on from 100 keeps its 3 last, latest_step follows it, and the abandoned 200 and 300 are
    never deleted by a save (a save deletes no step above its own: such a step may be
    another writer's)."""
    state = trained[0]
    d = tmp_path / "ck"
    for s in (100, 200, 300):
        ckpt.save(d, _at(state, s), keep=3)
    assert ckpt.latest_step(d) == 300
    back = ckpt.restore(d, _state(), step=100)
    ckpt.save(d, _at(back, 110), keep=3)
    assert ckpt.latest_step(d) == 110
    ckpt.save(d, _at(back, 120), keep=3)
    assert ckpt.available_steps(d) == [100, 110, 120, 200, 300]
    ckpt.save(d, _at(back, 130), keep=3)
    assert ckpt.available_steps(d) == [110, 120, 130, 200, 300]
    assert ckpt.latest_step(d) == 130
    assert int(ckpt.restore(d, _state()).step) == 130  # the default is the latest written
    ckpt.save(d, _at(back, 200), keep=3)  # the run reaches 200 again: replaced, 110 goes
    assert ckpt.available_steps(d) == [120, 130, 200, 300]
    assert ckpt.latest_step(d) == 200


def test_resave_dying_between_its_renames_loses_nothing(trained, tmp_path):
    """A re-save of step 2 that died after moving the old copy aside and before moving the
    new one in: the complete old copy is put back, by a restore or by the next save."""
    state, d, _, _ = trained
    d = _copy(d, tmp_path)
    old = ckpt._step_dir(d, 2)
    os.rename(old, d / ".tmp-replaced-step_00000002-deadbeef")
    (d / ".tmp-step_00000002-cafecafe").mkdir()  # the new copy, incomplete
    assert ckpt.available_steps(d) == []
    restored = ckpt.restore(d, _state())  # recovers step 2
    assert int(restored.step) == 2 and ckpt.available_steps(d) == [2]
    _leaves_equal(restored.consolidate(), state.consolidate())
    os.rename(old, d / ".tmp-replaced-step_00000002-deadbeef")
    ckpt.save(d, _at(state, 3), keep=3)  # the next save recovers it too, then cleans up
    assert ckpt.available_steps(d) == [2, 3]
    assert not list(d.glob(".tmp-*"))


def test_concurrent_saves_of_one_process_into_one_directory_both_succeed(trained, tmp_path):
    """Two threads of one process (one job) saving into one directory take turns; another
    process is refused (test_checkpoint_writers)."""
    import threading

    state = trained[0]
    d = tmp_path / "ck"
    errors = []

    def save(step):
        try:
            for i in range(3):
                ckpt.save(d, _at(state, step + i), keep=None)
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=save, args=(s,)) for s in (10, 20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert ckpt.available_steps(d) == [10, 11, 12, 20, 21, 22]
    for s in (12, 22):
        assert int(ckpt.restore(d, _state(), step=s).step) == s


def _frozen_kernels(path):
    return path[-1] == "kernel" or path[0] == "wte"


# INT4 packs two values per byte the same way on every mesh; it runs in `make test-all`
# (the suite's wall time is near its 10-minute budget).
@pytest.mark.parametrize("bits", [8, pytest.param(4, marks=pytest.mark.slow)])
def test_frozen_quantized_weights_restore_onto_other_meshes(bits, tmp_path):
    """Frozen weights stored INT8 / INT4 in blocks: the stored bytes restore exactly onto
    a mesh with other shards and other padding (blocks never straddle devices), and
    load_params dequantizes them as consolidate() does. The template is built from other
    weights, so each value must come from the checkpoint. The state is saved as created,
    untrained: a step leaves frozen weights as they are, and a train step of this config
    would be a program compiled for this test alone (restoring a trained state onto other
    meshes: test_restore_across_mesh_shapes_and_device_counts)."""
    cfg = zpp.ZeroPPConfig.zero3(quantize_frozen=True, weight_bits=bits, block_size=64, **FP32)

    def frozen_state(shape, seed, devices=None):
        return zpp.TrainState.create(
            model=GPT(SMALL), params=init_params(seed=seed), tx=TX, config=cfg,
            mesh=zpp.make_mesh(*shape, devices=devices), frozen=_frozen_kernels)

    state = frozen_state((2, 4), 31)
    ckpt.save(tmp_path, state)
    want = state.consolidate()
    for shape, devices in (((4, 2), None), ((1, 3), jax.devices()[:3])):
        restored = ckpt.restore(tmp_path, frozen_state(shape, 5, devices))
        _leaves_equal(restored.consolidate(), want)
    _leaves_equal(ckpt.load_params(tmp_path), want)
    other = zpp.ZeroPPConfig.zero3(quantize_frozen=True, weight_bits=12 - bits, block_size=64,
                                   **FP32)
    with pytest.raises(ckpt.CheckpointError, match="bits="):
        ckpt.restore(tmp_path, zpp.TrainState.create(
            model=GPT(SMALL), params=init_params(seed=31), tx=TX, config=other,
            mesh=zpp.make_mesh(2, 4), frozen=_frozen_kernels))
    with pytest.raises(ckpt.CheckpointError, match="frozen"):
        ckpt.restore(tmp_path, _state())


def test_changed_array_contents_fail_the_checksum(trained, tmp_path):
    """The arrays are rewritten, readable, with one parameter changed by one ulp (and,
    separately, two parameters swapped): restore and load_params refuse both."""
    import orbax.checkpoint as ocp

    for edit in ("ulp", "swap"):
        d = _copy(trained[1], tmp_path / edit)
        arrays_dir = d / "step_00000002" / "arrays"
        args: dict = {}
        for key in json.loads((arrays_dir.parent / "meta.json").read_text())["checksums"]:
            group, name = key.split("/")
            args.setdefault(group, {})[name] = ocp.RestoreArgs(restore_type=np.ndarray)
        arrays = ocp.PyTreeCheckpointer().restore(arrays_dir, restore_args=args)
        x = np.array(arrays["params"]["u1"])
        if edit == "ulp":
            x[7] = np.nextafter(x[7], np.float32(np.inf))
        else:
            assert x[3] != x[4]
            x[3], x[4] = x[4], x[3]
        arrays["params"]["u1"] = x
        import shutil

        shutil.rmtree(arrays_dir)
        ocp.PyTreeCheckpointer().save(arrays_dir, arrays)
        # The rewrite changes the files' sizes, which restore checks first (see
        # test_missing_or_truncated_files_are_named); record the new ones so that only
        # the contents differ, as after damage that keeps every file's size.
        meta_path = arrays_dir.parent / "meta.json"
        meta = json.loads(meta_path.read_text())
        meta["files"] = ckpt._file_sizes(arrays_dir)
        meta_path.write_text(json.dumps(meta))
        with pytest.raises(ckpt.CheckpointError, match="params/u1 fails its checksum"):
            ckpt.restore(d, _state())
        with pytest.raises(ckpt.CheckpointError, match="params/u1 fails its checksum"):
            ckpt.load_params(d)


def test_another_unit_split_is_named_with_the_units_to_pass(trained):
    """The same parameters grouped into other units (another units=): the error says so and
    names the checkpoint's units, not "another model"."""
    _, d, _, _ = trained
    template = zpp.TrainState.create(model=GPT(SMALL), params=init_params(seed=31), tx=TX,
                                     mesh=zpp.make_mesh(2, 4),
                                     config=zpp.ZeroPPConfig.zero3(**FP32), units=["block_0"])
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(d, template)
    msg = str(e.value)
    assert "another model" not in msg, msg
    assert "same paths and shapes), but split into other units" in msg, msg
    assert "written with 5 units ['block_0', 'block_1', 'head', 'wte', '<rest>']" in msg, msg
    assert "units=['block_0', 'block_1', 'head', 'wte']" in msg, msg


def test_missing_or_truncated_files_are_named_with_the_step_that_restores(trained, tmp_path):
    """A shard file truncated or deleted in the newest checkpoint: restore and load_params
    name the file and the older complete step, with the call that reads it. A checkpoint
    without the file record (or damage the record cannot see) fails in the read, with the
    reader's own text, cut before library internals (no "<bound method ...>")."""
    import shutil

    state, d, _, _ = trained
    d = _copy(d, tmp_path)
    ckpt.save(d, _at(state, 3))
    data = sorted((d / "step_00000003" / "arrays" / "ocdbt.process_0" / "d").iterdir(),
                  key=lambda p: p.stat().st_size)[-1]
    data.write_bytes(data.read_bytes()[:100])
    want = f"zpp.checkpoint.restore('{d.absolute()}', template, step=2) reads it"
    with pytest.raises(ckpt.CheckpointError) as e:
        ckpt.restore(d, _state())
    msg = str(e.value)
    assert f"arrays/ocdbt.process_0/d/{data.name} (shard data written by process 0) has 100 " \
           "bytes" in msg, msg
    assert "Step 2 is complete in the same directory" in msg and want in msg, msg
    with pytest.raises(ckpt.CheckpointError, match=r"load_params\(.*step=2\) reads it"):
        ckpt.load_params(d)
    shutil.rmtree(data.parent.parent)
    meta_path = d / "step_00000003" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["files"]  # as written before files were recorded
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="arrays cannot be read") as e:
        ckpt.restore(d, _state())
    assert "bound method" not in str(e.value) and want in str(e.value), str(e.value)
