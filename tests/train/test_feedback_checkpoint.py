"""Checkpoints of qgZ's kept errors (qgz_error_feedback): bit for bit on the same mesh, their
total shared out on another, and checkpoints and states with and without them mixed."""

from __future__ import annotations

import json
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.comm.qgz import hop2_to_flat
from zeropp_jax.comm.transports.kept_errors import FEEDBACK_BLOCK, decode_error
from zeropp_jax.core.mesh import MeshInfo, mesh_shape
from zeropp_jax.train import checkpoint as ckpt

from helpers import U32

TX = optax.adamw(1e-2, weight_decay=0.1)

# A small MLP, not the demo GPT: what is checked here is how the kept errors of each unit
# are saved, restored and shared out, which does not depend on the model; this one has
# units of two padded sizes, each with more than one leaf and padding (two blocks of 2352
# weights, 4096 padded on 8 devices, and a rest unit of 481, 2048 padded), and compiles
# its steps about three times faster.
F, H = 8, 48


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(H)(x))


class _Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(H, name="inp")(x)
        for i in range(2):
            x = _Block(name=f"block_{i}")(x)
        return nn.Dense(1, name="out")(x)[:, 0]


_init = jax.jit(_Net().init)  # one program, not op by op


def _params(seed):
    return _init(jax.random.PRNGKey(seed), jnp.zeros((1, F)))["params"]


def _batch(rows=16, *, seed):
    """Fresh random inputs and targets."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((rows, F)).astype(np.float32),
            rng.standard_normal(rows).astype(np.float32))


@zpp.train_step
def _step(state, batch):
    x, y = batch
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((state.apply_fn({"params": p}, x) - y) ** 2))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _state(shape=(2, 4), feedback=True, devices=None, seed=41):
    cfg = zpp.ZeroPPConfig.zeropp(qgz_error_feedback=feedback)
    return zpp.TrainState.create(model=_Net(), params=_params(seed), tx=TX,
                                 mesh=zpp.make_mesh(nodes=shape[0], local=shape[1],
                                                    devices=devices),
                                 config=cfg)


def _bits(x) -> np.ndarray:
    """An array's elements as unsigned ints of their width (FP8 and fp32 bit for bit)."""
    a = np.asarray(x)
    return a.view(f"u{a.dtype.itemsize}")


def _leaves_equal(a, b) -> None:
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(_bits(x), _bits(y))


def _feedback_equal(a, b) -> None:
    assert set(a.params.feedback) == set(b.params.feedback)
    for name, bufs in a.params.feedback.items():
        other = b.params.feedback[name]
        assert len(bufs) == len(other) == 5
        for x, y in zip(bufs, other):
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert x.sharding.is_equivalent_to(y.sharding, 1), name
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=name)


def _kept(state):
    """Per unit: (the sum over devices and hops of the decoded kept errors in the unit's
    flat gradient layout, float64 over its real elements; the sum of their magnitudes;
    how many terms were added), computed here device by device."""
    engine = state.engine
    nodes, local = mesh_shape(engine.mesh)
    devices = nodes * local
    out = {}
    for name, bufs in state.params.feedback.items():
        lay = engine.layouts[name]
        transport = engine.transports[name].gradients
        h1, h2 = transport.feedback_lengths(lay.n_pad, MeshInfo(nodes, local))
        v1, s1, v2, s2 = (np.asarray(b) for b in bufs[:4])
        total = np.zeros(lay.n_pad)
        size = np.zeros(lay.n_pad)
        terms = 0
        for p in range(devices):
            parts = []
            if h1:
                w, b = len(v1) // devices, len(s1) // devices
                parts.append(np.asarray(decode_error(v1[p * w:(p + 1) * w],
                                                     s1[p * b:(p + 1) * b], h1), np.float64))
            if h2:
                w, b = len(v2) // devices, len(s2) // devices
                e2 = np.asarray(decode_error(v2[p * w:(p + 1) * w], s2[p * b:(p + 1) * b], h2),
                                np.float64)
                parts.append(hop2_to_flat(e2, nodes=nodes, local=local,
                                          stages=transport.stages, m=lay.n_pad // devices,
                                          local_index=p % local))
            for e in parts:
                total += e
                size += np.abs(e)
                terms += 1
        out[name] = (total[:lay.n], size[:lay.n], terms)
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2x4 zeropp state with kept errors after 2 steps, its checkpoint, the step, and the
    untrained state it started from (a template for restores on the same mesh: its engine
    is the trained state's, so the step does not compile again for what is restored into
    it, and its values, the initial parameters and no kept errors, are not the
    checkpoint's)."""
    start = _state()
    state = start
    step = _step
    for i in range(2):
        state, _ = step(state, _batch(seed=9100 + i))
    for name, bufs in state.params.feedback.items():  # errors really are kept
        assert np.any(np.asarray(bufs[0]).astype(np.float32) != 0), name
        assert np.all(np.asarray(bufs[4]) == 1), name
    d = tmp_path_factory.mktemp("feedback") / "ckpt"
    ckpt.save(d, state)
    return state, d, step, start


def test_same_mesh_restores_the_errors_bit_for_bit(trained):
    state, d, step, start = trained
    meta = json.loads((d / "step_00000002" / "meta.json").read_text())
    assert meta["feedback"]["nodes"] == 2 and meta["feedback"]["local"] == 4
    assert (d / "step_00000002" / "feedback").is_dir()
    for bufs in start.params.feedback.values():  # the template keeps no errors
        assert not np.any(np.asarray(bufs[0]).astype(np.float32))
    restored = ckpt.restore(d, start)
    _feedback_equal(restored, state)
    _leaves_equal(restored.consolidate(), state.consolidate())
    _leaves_equal(restored.opt_state, state.opt_state)
    # One more step from each: the same loss, parameters and kept errors, bit for bit.
    b = _batch(seed=9200)
    expected, m_exp = step(state, b)
    got, m = step(restored, b)
    assert _bits(m["loss"]) == _bits(m_exp["loss"])
    _leaves_equal(got.consolidate(), expected.consolidate())
    _leaves_equal(got.opt_state, expected.opt_state)
    _feedback_equal(got, expected)


def _assert_total_kept(before, restored) -> None:
    """The restored errors add up to the checkpoint's, within one FP8 rounding.

    Restore sums the old errors in fp32: ``T32``, off the exact sum ``T`` by at most
    gamma_K sum|terms| for K terms (gamma_K = K U32 / (1 - K U32), any order). Each of the
    P new devices keeps ``x = T32 / P`` (exact: P is a power of two), so ``|x| <= xb =
    (|T| + gamma_K sum|terms|) / P``, as e4m3 with one scale per 256 elements, ``s = max|x|
    / 448`` over the block (``s <= sb``: that of ``xb``, with fp32's rounding of the
    product). Each element decodes to within ``2^-4 |x| + 2^-10 s``: half an ulp of a
    normal e4m3 value (3 mantissa bits), or half the subnormal spacing (2^-9, below 2^-6)
    times s; plus the fp32 rounding of the scaling and the products (a few U32 of |x| and of
    448 s; 8 allowed). The P copies add up to ``P`` times that, so
    ``|restored - T| <= P (2^-4 xb + 2^-10 sb + 8 U32 (xb + 448 sb)) + gamma_K sum|terms|``."""
    engine = restored.engine
    nodes, local = mesh_shape(engine.mesh)
    devices = nodes * local
    after = _kept(restored)
    for name, (total, size, terms) in before.items():
        got = after[name][0]
        gamma = terms * U32 / (1 - terms * U32)
        xb = (np.abs(total) + gamma * size) / devices
        blocks = -(-xb.size // FEEDBACK_BLOCK) * FEEDBACK_BLOCK
        sb = np.repeat(np.pad(xb, (0, blocks - xb.size)).reshape(-1, FEEDBACK_BLOCK)
                       .max(axis=1) / 448 * (1 + 4 * U32), FEEDBACK_BLOCK)[: xb.size]
        bound = (devices * (2.0**-4 * xb + 2.0**-10 * sb + 8 * U32 * (xb + 448 * sb))
                 + gamma * size)
        err = np.abs(got - total)
        assert np.all(err <= bound), (name, float(np.max(err - bound)))
        # Not vacuous: the bound is an FP8 rounding of the errors, far below the errors.
        assert np.sum(bound) < 0.1 * np.sum(np.abs(total)), name
        bufs = restored.params.feedback[name]
        hop1 = _bits(bufs[0]).reshape(devices, -1)
        assert np.all(hop1 == hop1[0]), name  # every device an equal share
        assert not np.any(np.asarray(bufs[2]).astype(np.float32)), name  # nothing for hop 2
        assert not np.any(np.asarray(bufs[3])), name
        np.testing.assert_array_equal(np.asarray(bufs[4]), np.ones(devices, np.float32))


def _restore_elsewhere(trained, shape, devices, *, train: bool, before=None):
    """Restores the checkpoint onto a ``shape`` mesh: the weights as saved, the errors'
    total (``before``: ``_kept`` of the trained state) shared out; with ``train``, one step
    on it (a program of its own per mesh)."""
    state, d, step, _ = trained
    restored = ckpt.restore(d, _state(shape, devices=devices, seed=6))
    _leaves_equal(restored.consolidate(), state.consolidate())
    _assert_total_kept(_kept(state) if before is None else before, restored)
    if train:
        # It trains: the errors go into the next reduce-scatter and new ones are kept.
        new, m = step(restored, _batch(seed=9300))
        assert np.isfinite(float(m["loss"])) and int(new.step) == 3
        for name, bufs in new.params.feedback.items():
            assert np.any(np.asarray(bufs[0]).astype(np.float32) != 0), name


def test_other_meshes_get_the_total_error_shared_out(trained):
    # 4x2 (as many devices, other hops) and 2x2 (fewer devices: larger shares). The step
    # on the restored state runs on the 2x2 mesh here; on the 4x2 mesh (the same property,
    # one more compiled step) in test_restored_4x2_state_trains (test-all).
    before = _kept(trained[0])
    _restore_elsewhere(trained, (4, 2), None, train=False, before=before)
    _restore_elsewhere(trained, (2, 2), jax.devices()[:4], train=True, before=before)
    # One node: qgZ quantizes nothing there and keeps nothing; the errors are dropped.
    one = ckpt.restore(trained[1], _state((1, 8), seed=7))
    for name, bufs in one.params.feedback.items():
        assert [x.shape for x in bufs] == [(0,), (0,), (0,), (0,), (8,)], name
        np.testing.assert_array_equal(np.asarray(bufs[4]), np.ones(8, np.float32))


@pytest.mark.slow
def test_restored_4x2_state_trains(trained):
    """test_other_meshes_get_the_total_error_shared_out's step, on its 4x2 mesh."""
    _restore_elsewhere(trained, (4, 2), None, train=True)


def test_feedback_checkpoints_and_states_mix(trained, tmp_path, monkeypatch):
    """A checkpoint with kept errors into a state without (ignored, feedback/ not read),
    and one without into a state with (errors of zero, as a new run's)."""
    state, d, step, _ = trained
    subs = []
    read = ckpt._read_arrays

    def spy(path, targets, name, sub="arrays"):
        subs.append(sub)
        return read(path, targets, name, sub)

    monkeypatch.setattr(ckpt, "_read_arrays", spy)
    off = ckpt.restore(d, _state(feedback=False, seed=8))
    assert off.params.feedback == {} and subs == ["arrays"]
    _leaves_equal(off.consolidate(), state.consolidate())
    _leaves_equal(off.opt_state, state.opt_state)

    # Without: the errors restore as zeros, then training keeps new ones.
    plain = _state(feedback=False, seed=12)
    ckpt.save(tmp_path / "plain", plain)
    assert json.loads((tmp_path / "plain" / "step_00000000" / "meta.json").read_text()
                      )["feedback"] is None
    assert not (tmp_path / "plain" / "step_00000000" / "feedback").exists()
    on = ckpt.restore(tmp_path / "plain", state)  # a template whose errors are not zero
    _leaves_equal(on.consolidate(), plain.consolidate())
    _feedback_equal(on, _state(seed=12))
    new, m = step(on, _batch(seed=9400))
    assert np.isfinite(float(m["loss"]))
    for name, bufs in new.params.feedback.items():
        assert np.any(np.asarray(bufs[0]).astype(np.float32) != 0), name


def test_changed_kept_errors_fail_the_checksum(trained, tmp_path):
    """The kept errors are rewritten, readable, with one FP8 value changed: restore
    refuses them, naming the array."""
    import orbax.checkpoint as ocp

    _, d, _, start = trained
    d2 = tmp_path / "ckpt"
    shutil.copytree(d, d2)
    fb_dir = d2 / "step_00000002" / "feedback"
    meta_path = fb_dir.parent / "meta.json"
    meta = json.loads(meta_path.read_text())
    args = {"feedback": {k.split("/")[1]: ocp.RestoreArgs(restore_type=np.ndarray)
                         for k in meta["feedback"]["checksums"]}}
    arrays = ocp.PyTreeCheckpointer().restore(fb_dir, restore_args=args)
    x = np.array(arrays["feedback"]["f1_0"])
    i = int(np.flatnonzero(x.astype(np.float32))[0])
    x[i] = -x[i]
    arrays["feedback"]["f1_0"] = x
    shutil.rmtree(fb_dir)
    ocp.PyTreeCheckpointer().save(fb_dir, arrays)
    meta["feedback"]["files"] = ckpt._file_sizes(fb_dir)  # only the contents differ
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(ckpt.CheckpointError, match="feedback/f1_0 fails its checksum"):
        ckpt.restore(d2, start)
    ckpt.load_params(d2)  # the weights do not depend on the kept errors


def test_the_transport_describes_what_the_checkpoint_stores(trained, tmp_path):
    """The checkpoint stores the gradient transport's own record of its kept buffers
    (``feedback_record``) and hands it back for the restore (``reshard_feedback``): a
    record in a format this version cannot decode is refused naming the fix, and a
    checkpoint written before the records carried their format (block and format beside
    the units) still restores bit for bit."""
    state, d, _, start = trained
    step_dir = d / "step_00000002"
    meta = json.loads((step_dir / "meta.json").read_text())
    engine = state.engine
    for rec in meta["feedback"]["units"]:
        lay = engine.layouts[rec["name"]]
        said = engine.transports[rec["name"]].gradients.feedback_record(lay.n, lay.n_pad,
                                                                         engine.info)
        assert {k: rec[k] for k in said} == said
        # Same mesh, same layout: the stored buffers are the new ones (nothing to convert).
        assert engine.transports[rec["name"]].gradients.reshard_feedback(
            rec, engine.info, said, engine.info) is None

    def rewritten(edit) -> pathlib.Path:
        d2 = tmp_path / f"ckpt{len(list(tmp_path.iterdir()))}"
        shutil.copytree(d, d2)
        path = d2 / "step_00000002" / "meta.json"
        m = json.loads(path.read_text())
        edit(m["feedback"])
        path.write_text(json.dumps(m))
        return d2

    def other_format(info):
        info["units"][0]["format"] = "e5m2"

    with pytest.raises(ckpt.CheckpointError, match="qgz_error_feedback=False"):
        ckpt.restore(rewritten(other_format), start)

    def older_layout(info):  # the run-wide fields of earlier checkpoints
        for rec in info["units"]:
            info["block"], info["format"] = rec.pop("block"), rec.pop("format")

    back = ckpt.restore(rewritten(older_layout), start)
    for name, bufs in state.params.feedback.items():
        for x, y in zip(bufs, back.params.feedback[name]):
            np.testing.assert_array_equal(_bits(x), _bits(y), err_msg=name)
