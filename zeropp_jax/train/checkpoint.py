"""Checkpoints of a sharded train state, written by every process, restorable onto any mesh.

Each process writes only the shards its own devices hold and reads only those its devices
will hold (orbax over TensorStore, OCDBT), so no process ever holds the whole model: a
checkpoint written by 2 processes on a 2x2 mesh restores in 1 process on 1x2, or in 4 on
4x2. What is stored does not depend on the mesh: a unit's flat buffer (``n`` real elements,
then zero padding to the writing mesh's ``n_pad``), the optimizer buffers laid out alike,
the variable collections (batch_stats, NNX state, PRNG keys as key data) and the frozen
weights as stored (block-quantized values and scales: a block never straddles devices, so
its bytes are the same on any mesh). Restoring reads each array with the template's global
length and sharding, padding with zeros or dropping padding as the new mesh needs. Units,
collections and frozen parts are matched by name, never by position. This is DeepSpeed's
universal checkpoint; ``load_params`` is its ``zero_to_fp32``.

Layout of ``directory``::

    step_00000100/          one finished checkpoint
      meta.json             step, units and leaf shapes, optimizer-state leaves, checksums,
                            the size of every file under arrays/ and feedback/
      arrays/               orbax PyTree checkpoint of the global arrays
      feedback/             orbax PyTree checkpoint of the kept qgZ errors (only for a state
                            trained with qgz_error_feedback)
    .tmp-step_00000200-…/   a save in progress (or one that was interrupted): ignored
    .lock                   taken by the saving job's process 0 during a save (flock)
    .writer                 held by the writing job's process 0 from its first save until it
                            exits (flock; the file names that process): another job's save
                            into this directory is refused (``writer_lock``)

Every process must call ``save`` and ``restore`` (they are collective, as a train step is);
a call made on some processes only fails after ``ZEROPP_COLLECTIVE_TIMEOUT_S`` with an
error naming it (``zeropp_jax.core.processes``). Process 0 alone touches the directory's
structure: under the lock it clears debris of dead saves, picks a temporary directory,
writes ``meta.json`` once every process has written its shards, and commits with one
rename, so an interrupted save never leaves a ``step_N`` behind. One job writes a
directory: a save from another process while the writer lives raises ``CheckpointError``
naming it (process id, host, command), and a save never deletes a checkpoint of a later
step than its own, so nothing a save reported written is deleted by another's retention.

Every array has a checksum in ``meta.json`` that does not depend on how it is split: two
sums over its real elements' bits (plain and weighted by global index, mod 2^64). Each
process sums the elements it holds, the processes add their sums, and restore does the
same over what it read, so a damaged file is an error on every process, never silently
different weights. Before
reading, every process checks that each file under ``arrays/`` (and ``feedback/``) is
there with the size ``meta.json`` records, and the processes agree on the verdict: a
truncated or deleted shard is an error naming the file on every process, never one
process failing inside the read while the others wait for it.

Kept qgZ errors (``qgz_error_feedback``). Each device keeps, per unit, what its gradient's
quantizations left out (``state.params.feedback``): gradient not yet sent, which the next
step adds back. They are saved as they are, in ``feedback/`` (each process its own
devices' buffers, with checksums like every other array), apart from the weights, so that
``load_params`` and a restore that does not want them never read them. Restoring:

- onto the same mesh shape (nodes x local) with the same unit layouts, every device gets
  its own errors back, bit for bit, and training continues exactly as it would have;
- onto another mesh, or with other unit layouts, the gradient transport that keeps them
  says what they become (``reshard_feedback``; for qgZ the rule of
  ``comm.transports.kept_errors``: the gradient mass not sent yet, summed over the old
  devices and shared out equally over the new ones);
- a checkpoint without kept errors (saved with the feedback off, or by an older
  zeropp_jax) restores into a state with the feedback on with errors of zero, as a new
  run starts; a state with the feedback off ignores the checkpoint's errors (the
  parameters and optimizer restore as always, and ``feedback/`` is not read).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import pathlib
import re
import shutil
import uuid
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from zeropp_jax.core import compat
from zeropp_jax.core import processes
from zeropp_jax.comm.frozen import merge_trees
from zeropp_jax.core.mesh import MeshInfo, mesh_shape
from zeropp_jax.comm.partition import REST, UnitLayout, merge_units, unit_of
from zeropp_jax.comm.placement import REPLICATED, SHARDED, ShardedParams, is_prng_key, place
from zeropp_jax.train import canonical, writer_lock
from zeropp_jax.train.state import TrainState

PyTree = Any
FORMAT = "zeropp_jax.train.checkpoint/2"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_MASK = (1 << 64) - 1
_CHUNK = 1 << 20  # elements summed at a time (bounds the uint64 temporaries)


class CheckpointError(ValueError):
    """A checkpoint is missing, incomplete, damaged, or does not fit the given state."""


def _step_dir(directory: pathlib.Path, step: int) -> pathlib.Path:
    return directory / f"step_{step:08d}"


def available_steps(directory: str | os.PathLike) -> list[int]:
    """Steps of the finished checkpoints in ``directory`` (ascending; [] if none)."""
    directory = pathlib.Path(directory)
    if not directory.is_dir():
        return []
    steps = []
    for p in directory.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and p.is_dir():
            steps.append(int(m.group(1)))
    return sorted(steps)


def _written(directory: pathlib.Path, step: int) -> int:
    """The checkpoint's place in write order (meta "written_seq"; 0 if unknown)."""
    try:
        return int(json.loads((_step_dir(directory, step) / "meta.json").read_text())
                   .get("written_seq", 0))
    except (OSError, ValueError):
        return 0


def latest_step(directory: str | os.PathLike) -> int | None:
    """The step of the checkpoint written last, or None. After a rollback (restore step
    100 of 300, train, save 110) that is 110, not the abandoned 300."""
    directory = pathlib.Path(directory)
    steps = available_steps(directory)
    if not steps:
        return None
    return max(steps, key=lambda s: (_written(directory, s), s))


@contextlib.contextmanager
def _locked(directory: pathlib.Path) -> Iterator[None]:
    """Holds ``directory/.lock`` exclusively (``flock``): saves into one directory run
    one after another, and while one holds it every ``.tmp-*`` entry belongs to a save
    that died. The lock goes with the process if it dies."""
    import fcntl

    with open(directory / ".lock", "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _recover(directory: pathlib.Path) -> None:
    """Under the lock: a re-save that died between its two renames left the complete old
    copy as ``.tmp-replaced-step_N-*`` and no ``step_N``: put it back. Other ``.tmp-*``
    entries are debris of dead saves and go."""
    for p in sorted(directory.glob(".tmp-replaced-step_*")):
        m = re.match(r"^\.tmp-replaced-(step_\d+)-", p.name)
        final = directory / m.group(1) if m else None
        if final is not None and not final.exists() and (p / "meta.json").is_file():
            os.rename(p, final)
    for p in directory.glob(".tmp-*"):
        shutil.rmtree(p, ignore_errors=True)


def _to_prune(steps: list[int], step: int, keep: int) -> list[int]:
    """The checkpoints a save of ``step`` deletes, of those in the directory (``steps``,
    with ``step`` among them) keeping ``keep``: the lowest steps below ``step`` beyond the
    ``keep`` highest up to and including it. Never a step above ``step``: one is either
    another writer's (its save reported it written) or a run abandoned by restoring an
    earlier step, which saving that step again replaces, and which ``latest_step`` (the
    checkpoint written last) already passes over."""
    mine = sorted(s for s in steps if s <= step)
    return mine[: max(0, len(mine) - keep)]


def _retain(directory: pathlib.Path, step: int, keep: int) -> None:
    """Keeps ``keep`` checkpoints up to ``step`` after writing it (``_to_prune``)."""
    for old in _to_prune(available_steps(directory), step, keep):
        shutil.rmtree(_step_dir(directory, old), ignore_errors=True)


def _finalize(tmp: pathlib.Path, final: pathlib.Path) -> pathlib.Path:
    """The commit point: one rename makes the checkpoint visible."""
    if final.exists():
        trash = final.parent / f".tmp-replaced-{final.name}-{uuid.uuid4().hex[:8]}"
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    return final


# -- checksums that do not depend on the split --------------------------------------------------


def _sums_of(flat: np.ndarray, start: int) -> tuple[int, int]:
    """(sum of bits, sum of bits x (global index + 1)) of a host slice starting at global
    element ``start``, mod 2^64. Bits as unsigned ints of the element's width."""
    flat = np.ascontiguousarray(flat).reshape(-1)
    if flat.dtype == np.bool_:
        flat = flat.view(np.uint8)
    bits = flat.view(f"u{flat.dtype.itemsize}")
    s1 = s2 = 0
    for lo in range(0, bits.size, _CHUNK):
        v = bits[lo: lo + _CHUNK].astype(np.uint64)
        idx = np.arange(start + lo + 1, start + lo + 1 + v.size, dtype=np.uint64)
        s1 += int(v.sum(dtype=np.uint64))
        s2 += int((v * idx).sum(dtype=np.uint64))  # uint64 products wrap: mod 2^64
    return s1 & _MASK, s2 & _MASK


def _partial_sums(x: jax.Array, n_real: int) -> tuple[int, int]:
    """This process's part of ``x``'s checksum: the elements ``[0, n_real)`` of the
    row-major flattened global array that its devices hold as first replica (so every
    element is counted by exactly one process)."""
    s1 = s2 = 0
    for shard in x.addressable_shards:
        if shard.replica_id != 0:
            continue
        if x.ndim == 1:
            start = shard.index[0].start or 0
        elif all(sl == slice(None) or (sl.start in (None, 0) and sl.stop in (None, d))
                 for sl, d in zip(shard.index, x.shape)):
            start = 0
        else:  # only 1-D buffers are split; everything else is replicated
            raise AssertionError(f"cannot checksum a {x.ndim}-D array split over devices")
        data = np.asarray(shard.data).reshape(-1)[: max(0, n_real - start)]
        a, b = _sums_of(data, start)
        s1, s2 = (s1 + a) & _MASK, (s2 + b) & _MASK
    return s1, s2


def _checksums(name: str, arrays: dict[str, jax.Array], real: dict[str, int]
               ) -> dict[str, str]:
    """Checksums of global arrays, each process adding its part (one small exchange)."""
    mine = {k: _partial_sums(x, real[k]) for k, x in arrays.items()}
    total = {k: [0, 0] for k in arrays}
    for text in processes.allgather(name, json.dumps(mine)):
        for k, (a, b) in json.loads(text).items():
            total[k] = [(total[k][0] + a) & _MASK, (total[k][1] + b) & _MASK]
    return {k: f"{a:016x}{b:016x}" for k, (a, b) in total.items()}


# -- what a state holds, mesh-independently ----------------------------------------------------


def _opt_leaves(state: TrainState) -> list[dict]:
    """One record per optimizer-state leaf: key, whether it is a unit-flat buffer, unit."""
    engine = state.engine
    leaves = jax.tree_util.tree_flatten_with_path(state.opt_state)[0]
    specs = jax.tree_util.tree_leaves(engine.opt_specs)
    if len(specs) != len(leaves):  # opt_specs mirrors opt_state leaf for leaf
        raise AssertionError("optimizer state and its specs differ in structure")
    out = []
    for (path, leaf), spec in zip(leaves, specs):
        rec = {"key": jax.tree_util.keystr(path), "dtype": str(np.dtype(leaf.dtype))}
        if spec == SHARDED:
            unit = unit_of(path, engine.layouts)
            if unit is None or leaf.shape != (engine.layouts[unit].n_pad,):
                raise NotImplementedError(
                    f"optimizer-state leaf {rec['key']} is sharded but not a per-unit flat "
                    "buffer; zeropp_jax cannot checkpoint it mesh-independently"
                )
            rec.update(kind="unit", unit=unit, shape=[engine.layouts[unit].n])
        else:
            rec.update(kind="whole", unit=None, shape=list(leaf.shape))
        out.append(rec)
    return out


def _unit_records(layouts: dict[str, UnitLayout]) -> list[dict]:
    recs = []
    for name, lay in layouts.items():
        paths = jax.tree_util.tree_flatten_with_path(
            jax.tree_util.tree_unflatten(lay.treedef, list(range(len(lay.shapes))))
        )[0]
        recs.append({
            "name": name,
            "path": list(lay.path),
            "layer": lay.layer,
            "n": lay.n,
            "leaves": [{"path": [str(getattr(k, "key", k)) for k in p], "shape": list(s)}
                       for (p, _), s in zip(paths, lay.shapes)],
        })
    return recs


def _frozen_info(state: TrainState) -> dict | None:
    """How the frozen weights are stored (None without frozen weights)."""
    frozen, engine = state.frozen, state.engine
    if frozen is None or not engine.frozen_layouts:
        return None
    cfg = engine.config
    return {
        "quantized": bool(frozen.quantized),
        "bits": int(frozen.bits) if frozen.quantized else None,
        "block_size": int(frozen.block_size) if frozen.quantized and cfg.blockwise else None,
        "blockwise": bool(cfg.blockwise) if frozen.quantized else None,
        "dtype": None if frozen.quantized else str(np.dtype(cfg.param_jnp_dtype)),
        "units": _unit_records(engine.frozen_layouts),
        # Non-blocked quantization has one scale per device's shard: tied to the mesh.
        "n_pad": {k: lay.n_pad for k, lay in engine.frozen_layouts.items()},
        "shards": int(engine.mesh.size),
    }


def _frozen_real(info: dict, n: int, n_pad: int, part: str) -> int:
    """Real (mesh-independent) elements of a frozen unit's stored ``part``: whole blocks
    that hold parameters (their padding inside the last block is the same on any mesh)."""
    if not info["quantized"]:
        return n
    if not info["blockwise"]:  # one scale per device's shard: all of it is mesh-bound
        return n_pad // (2 if info["bits"] == 4 else 1) if part == "v" else info["shards"]
    blocks = math.ceil(n / info["block_size"])
    if part == "s":
        return blocks
    return blocks * info["block_size"] // (2 if info["bits"] == 4 else 1)


def _arrays(state: TrainState) -> tuple[dict[str, dict[str, jax.Array]], dict]:
    """The global arrays to store, grouped, and the records that describe them."""
    engine = state.engine
    shards = state.params if state.master is None else state.master
    arrays: dict[str, dict[str, jax.Array]] = {"params": {}, "opt": {}}
    for i, name in enumerate(engine.layouts):
        arrays["params"][f"u{i}"] = shards.units[name]
    opt_recs = _opt_leaves(state)
    for i, leaf in enumerate(jax.tree_util.tree_leaves(state.opt_state)):
        arrays["opt"][f"o{i}"] = leaf
    coll_recs = []
    if state.collections:
        arrays["collections"] = {}
        for i, (path, leaf) in enumerate(
                jax.tree_util.tree_flatten_with_path(state.collections)[0]):
            key = is_prng_key(leaf)
            x = jax.random.key_data(leaf) if key else leaf
            arrays["collections"][f"c{i}"] = x
            coll_recs.append({"key": jax.tree_util.keystr(path), "shape": list(x.shape),
                              "dtype": str(np.dtype(x.dtype)),
                              "prng": str(jax.random.key_impl(leaf)) if key else None})
    frozen = _frozen_info(state)
    if frozen is not None:
        arrays["frozen"] = {}
        for i, name in enumerate(engine.frozen_layouts):
            arrays["frozen"][f"v{i}"] = state.frozen.values[name]
            if state.frozen.quantized:
                arrays["frozen"][f"s{i}"] = state.frozen.scales[name]
    return arrays, {"opt_state": opt_recs, "collections": coll_recs, "frozen": frozen}


def _real_lengths(arrays: dict, meta: dict) -> dict[str, int]:
    """``"group/key" -> real elements`` (what the checksum covers; the rest is padding)."""
    real = {}
    units = meta["units"]
    for k in arrays.get("params", {}):
        real[f"params/{k}"] = units[int(k[1:])]["n"]
    for k in arrays.get("opt", {}):
        rec = meta["opt_state"][int(k[1:])]
        real[f"opt/{k}"] = int(np.prod(rec["shape"], dtype=np.int64))
    for k in arrays.get("collections", {}):
        real[f"collections/{k}"] = int(np.prod(meta["collections"][int(k[1:])]["shape"],
                                              dtype=np.int64))
    info = meta.get("frozen")
    for k in arrays.get("frozen", {}):
        rec = info["units"][int(k[1:])]
        n_pad = info["n_pad"][rec["name"]]
        real[f"frozen/{k}"] = _frozen_real(info, rec["n"], n_pad, k[0])
    return real


def _flat(arrays: dict) -> dict[str, jax.Array]:
    return {f"{g}/{k}": x for g, d in arrays.items() for k, x in d.items()}


# -- kept gradient-transport state (qgZ's errors) ---------------------------------------------
# Per unit, the buffers its gradient transport keeps between steps (``feedback_specs``),
# each global (the devices' buffers end to end, split over ("node", "local")), and the
# transport's record of them (``feedback_record``). Stored under ``feedback/`` as
# ``feedback/f{i}_{k}`` (unit i of meta["feedback"]["units"], buffer k), empty buffers left
# out: orbax cannot store them. What the buffers mean, and how they move to another mesh
# (``reshard_feedback``), is the transport's business.


def _feedback_units(engine: Any) -> list[dict]:
    """One record per unit that keeps state on this engine's mesh (``[]`` when none does):
    its name and its gradient transport's ``feedback_record``."""
    recs = []
    for name in engine.feedback_specs():
        lay = engine.layouts[name]
        rec = engine.transports[name].gradients.feedback_record(lay.n, lay.n_pad, engine.info)
        if rec is not None:
            recs.append({"name": name, **rec})
    return recs


def _feedback_arrays(state: TrainState) -> tuple[dict[str, jax.Array], dict | None]:
    """The kept buffers to store (``{"f{i}_{k}": global array}``) and their record for
    ``meta["feedback"]`` (None when the state keeps none)."""
    engine = state.engine
    kept = getattr(state.params, "feedback", None) or {}
    recs = _feedback_units(engine)
    if not kept or not recs:
        return {}, None
    arrays = {}
    for i, rec in enumerate(recs):
        bufs = kept[rec["name"]]
        if [tuple(x.shape) for x in bufs] != [(n,) for n in rec["shapes"]]:
            raise AssertionError(f"unit {rec['name']!r}: kept buffers of shapes "
                                 f"{[x.shape for x in bufs]}, expected {rec['shapes']}")
        rec["stored"] = [k for k, n in enumerate(rec["shapes"]) if n]
        for k in rec["stored"]:
            arrays[f"f{i}_{k}"] = bufs[k]
    nodes, local = engine.info.shape
    return arrays, {"nodes": nodes, "local": local, "units": recs}


def _feedback_real(info: dict) -> dict[str, int]:
    """``"feedback/f{i}_{k}" -> elements``: every element of a stored buffer is real (it
    belongs to the writing mesh as a whole)."""
    return {f"feedback/f{i}_{k}": rec["shapes"][k]
            for i, rec in enumerate(info["units"]) for k in rec["stored"]}


def _zeros(shape: int, dtype: Any, sharding: NamedSharding) -> jax.Array:
    return place(np.zeros((shape,), jnp.dtype(dtype)), sharding)


def _stored_record(info: dict, rec: dict) -> dict:
    """A unit's stored record, with the run-wide fields older checkpoints kept beside the
    units (the errors' block and format)."""
    return {**{k: info[k] for k in ("block", "format") if k in info}, **rec}


def _restore_feedback(path: pathlib.Path, meta: dict, state: TrainState) -> dict:
    """The kept buffers for a restore into ``state`` (``ShardedParams.feedback``; ``{}``
    when its config keeps none): the stored ones on the same mesh and layout, else what
    each unit's gradient transport makes of them (``reshard_feedback``); zeros for a unit
    with none stored. Collective, like ``restore``: every process reads its own devices'
    pieces of ``feedback/``."""
    engine = state.engine
    mine = _feedback_units(engine)
    if not mine:
        return {}
    info = meta.get("feedback")
    if not info:
        return engine.zero_feedback()
    sharded = NamedSharding(engine.mesh, SHARDED)
    devices = engine.info.data
    old_mesh = MeshInfo(info["nodes"], info["local"])
    saved = {r["name"]: (i, _stored_record(info, r)) for i, r in enumerate(info["units"])}
    how: dict[str, tuple | None] = {}
    args: dict[str, Any] = {}
    for rec in mine:
        if rec["name"] not in saved:
            how[rec["name"]] = None
            continue
        i, old = saved[rec["name"]]
        try:
            convert = engine.transports[rec["name"]].gradients.reshard_feedback(
                old, old_mesh, rec, engine.info)
        except ValueError as e:
            raise CheckpointError(f"{path}: {e}") from None
        how[rec["name"]] = (i, old, convert)
        for k in old["stored"]:  # all of them (orbax reads whole trees)
            # Onto another mesh: the stored length rounded up to whole shards, zeros after.
            shape = (rec["shapes"][k] if convert is None
                     else -(-old["shapes"][k] // devices) * devices)
            args[f"f{i}_{k}"] = compat.orbax_resizing_restore_args(
                sharded, (shape,), jnp.dtype(old["dtypes"][k]))
    read: dict[str, jax.Array] = {}
    if args:
        read = _read_arrays(path, {"feedback": args}, "checkpoint.restore.feedback",
                            sub="feedback")["feedback"]
        flat = _flat({"feedback": read})
        _verify(path, {"checksums": info["checksums"]},
                _checksums("checkpoint.restore.feedback.checksums", flat,
                           _feedback_real(info)))
    out = {}
    for rec in mine:
        name = rec["name"]
        zeros = [_zeros(n, dt, sharded) for n, dt in zip(rec["shapes"], rec["dtypes"])]
        if how[name] is None:  # nothing stored for this unit: zeros, as a new run's
            out[name] = tuple(zeros)
            continue
        i, old, convert = how[name]
        if convert is None:
            out[name] = tuple(read[f"f{i}_{k}"] if k in old["stored"] else zeros[k]
                              for k in range(len(zeros)))
            continue
        # Global arrays in and out: each process reads and writes only its own devices'
        # pieces, and the sum over the old devices is XLA's to communicate (so its fp32
        # order, and the last bit of a scale, may depend on how the devices are split
        # into processes).
        key = ("checkpoint.feedback", json.dumps([old, old_mesh.shape, rec], sort_keys=True))
        jitted = engine.remembered(key, lambda: jax.jit(
            convert, out_shardings=(sharded,) * len(zeros)))
        out[name] = jitted(*(read.get(f"f{i}_{k}") for k in range(len(old["shapes"]))))
    return out


def _same_arguments(name: str, args: dict) -> None:
    """Every process must pass the same arguments to a collective checkpoint call (one
    directory all of them see, one step): compared through the coordination service
    before anything is written or read, so that each process raises naming the argument
    that differs, instead of each writing its shards under another name (or reading
    another checkpoint). With one process there is nothing to compare."""
    every = [json.loads(v) for v in processes.allgather(name, json.dumps(args, default=str))]
    diff = [k for k in args if len({json.dumps(e.get(k), default=str) for e in every}) > 1]
    if diff:
        detail = "; ".join(
            f"{k}: " + ", ".join(f"process {p} {e.get(k)!s}" for p, e in enumerate(every))
            for k in diff)
        raise CheckpointError(
            f"{name} was called with different arguments on different processes ({detail}). "
            "Every process must pass the same directory (on a filesystem all of them see: "
            "each writes and reads its own shards there) and the same step; build the path "
            "from the same configuration on every process, not from a host name or process "
            "index"
        )


def _file_sizes(arrays_dir: pathlib.Path) -> dict[str, int]:
    """``relative path -> bytes`` of every file orbax wrote for a checkpoint."""
    return {str(p.relative_to(arrays_dir)): p.stat().st_size
            for p in sorted(arrays_dir.rglob("*")) if p.is_file()}


def _damaged_files(path: pathlib.Path, meta: dict) -> list[str]:
    """Files under ``path/arrays`` (and ``path/feedback``) that are missing or not the size
    written, described (``[]`` if all are intact, or the checkpoint predates the file
    record)."""
    out = []
    parts = (("arrays", meta.get("files")), ("feedback", (meta.get("feedback") or {}).get("files")))
    for sub, files in parts:
        for rel, size in (files or {}).items():
            m = re.match(r"^ocdbt\.process_(\d+)/", rel)
            who = f" (shard data written by process {m.group(1)})" if m else ""
            try:
                have = (path / sub / rel).stat().st_size
            except OSError:
                out.append(f"{sub}/{rel}{who} is missing")
                continue
            if have != size:
                out.append(f"{sub}/{rel}{who} has {have:,} bytes, {size:,} were written")
    return out


def _intact_steps(directory: pathlib.Path, bad: int) -> list[int]:
    """Other finished checkpoints in ``directory`` whose meta.json reads and whose files
    are all there at their written sizes, newest written first (a damaged checkpoint's
    error names them; their checksums are checked when one is restored)."""
    out = []
    for s in available_steps(directory):
        if s == bad:
            continue
        try:
            meta = json.loads((_step_dir(directory, s) / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("format") == FORMAT and not _damaged_files(_step_dir(directory, s), meta):
            out.append(s)
    return sorted(out, key=lambda s: (_written(directory, s), s), reverse=True)


def _fallback(path: pathlib.Path, fn: str = "restore") -> str:
    """How to read an intact older checkpoint of the same directory, if there is one
    (``fn``: the call that failed, ``restore`` or ``load_params``)."""
    steps = _intact_steps(path.parent, int(_STEP_DIR.match(path.name).group(1)))
    if not steps:
        return " No other complete checkpoint is in this directory."
    also = f" (also complete: steps {steps[1:]})" if steps[1:] else ""
    args = f"{str(path.parent)!r}, template" if fn == "restore" else f"{str(path.parent)!r}"
    return (f" Step {steps[0]} is complete in the same directory{also}: "
            f"zpp.checkpoint.{fn}({args}, step={steps[0]}) reads it.")


def _short(e: BaseException) -> str:
    """An exception's text, cut before the library internals some of them append
    (TensorStore's JSON spec, orbax's repr of a bound method)."""
    text = str(e).strip()
    for marker in (" See full TensorStore details", " [tensorstore_spec", "<bound method"):
        if marker in text:
            text = text[: text.index(marker)].rstrip()
    return f"{type(e).__name__}: {text[:600]}"


def _local_int(x: Any) -> int:
    """A replicated scalar's value from this process's own copy (no collective)."""
    if isinstance(x, jax.Array):
        return int(np.asarray(x.addressable_shards[0].data))
    return int(x)


def _on_lead(name: str, fn: Any) -> str:
    """Runs ``fn() -> str`` on process 0 only; its result, or its error, reaches every
    process (the others raise ``CheckpointError`` quoting it instead of waiting)."""
    out, err = None, None
    if jax.process_index() == 0:
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 — re-raised below, reported to the others
            err = e
    msg = processes.broadcast(name, json.dumps(
        {"ok": out} if err is None else {"error": f"{type(err).__name__}: {err}"}))
    if err is not None:
        raise err
    got = json.loads(msg)
    if "error" in got:
        raise CheckpointError(f"{name} failed on process 0: {got['error']}")
    return got["ok"]


# -- save --------------------------------------------------------------------------------------


def _refusal(directory: pathlib.Path, holder: writer_lock.Holder) -> str:
    """Why a save into a directory another job writes is refused, and what to do."""
    stop = (f"stop process {holder.pid} on host {holder.host}" if holder.pid is not None
            else "stop the other job")
    return (
        f"checkpoint.save: {directory} is being written by another job: {holder.describe()}. "
        "Two jobs saving into one directory delete each other's checkpoints (each keeps "
        "its own last steps), so this save wrote nothing. Save into a different directory "
        f"(a separate one per run), or {stop} if it should not be running; the directory "
        "is free as soon as that process exits (a crashed job holds nothing).")


def save(directory: str | os.PathLike, state: TrainState, *, keep: int | None = 3) -> pathlib.Path:
    """Writes ``state`` to ``directory/step_<state.step>`` and returns that path.

    Collective: with several processes every process calls it with the same arguments and
    writes only its own devices' shards (the directory must be on a filesystem all of them
    see). Atomic: the checkpoint appears under its final name only once complete. Saves
    of one process into one directory take turns (a lock file; two concurrent saves from
    two threads both succeed), and a re-save that dies between its two renames is undone
    by the next save or restore, so a complete checkpoint is never hidden or deleted by a
    crash.

    One job writes a directory: its first save makes it the directory's writer until it
    exits (``directory/.writer``), and a save from any other job while it lives raises
    ``CheckpointError`` naming it (process id, host, command) before writing anything:
    save into another directory, or stop the other job. A writer that died holds nothing
    (the lock goes with the process), so the next job takes over.

    ``keep``: how many finished checkpoints up to ``state.step`` to keep after a successful
    save (None keeps all): the lowest steps go. Checkpoints of later steps are never
    deleted by a save (after restoring step 100 of a run that went to 300, steps 200 and
    300 stay until the run saves those steps again, which replaces them; ``restore``
    defaults to the checkpoint written last, so it reads the new run's). Saving a step that
    already exists replaces it.

    With ``qgz_error_feedback`` the kept qgZ errors are saved too (under ``feedback/``,
    each process its own devices' buffers); ``restore`` gives them back bit for bit on the
    same mesh shape, and as their total, shared out, on another (see the module docstring).
    """
    import orbax.checkpoint as ocp

    if not isinstance(state, TrainState):
        raise TypeError(f"save expects a zeropp_jax.TrainState, got {type(state).__name__}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int or None, got {keep!r}")
    if canonical.is_sliced(state.engine):  # stored as a run without tensor parallelism
        state = canonical.to_canonical(state)
    directory = pathlib.Path(directory).absolute()  # orbax wants absolute paths
    engine = state.engine
    step = _local_int(state.step)
    # Also the rendezvous: no process writes before every process has arrived.
    _same_arguments("checkpoint.save", {"directory": str(directory), "step": step,
                                        "keep": keep})
    arrays, recs = _arrays(state)
    nodes, local = mesh_shape(engine.mesh)
    meta = {
        "format": FORMAT,
        "step": step,
        "skipped_steps": 0 if state.skipped_steps is None else _local_int(state.skipped_steps),
        "written_on": {"nodes": nodes, "local": local, "processes": jax.process_count(),
                       "config": dataclasses.asdict(engine.config)},
        "units": _unit_records(engine.layouts),
        **recs,
    }
    meta["checksums"] = _checksums("checkpoint.save.checksums", _flat(arrays),
                                   _real_lengths(arrays, meta))
    feedback, meta["feedback"] = _feedback_arrays(state)
    if meta["feedback"] is not None:
        meta["feedback"]["checksums"] = _checksums(
            "checkpoint.save.feedback.checksums", _flat({"feedback": feedback}),
            _feedback_real(meta["feedback"]))

    with contextlib.ExitStack() as lock:  # held by process 0 from cleanup to commit
        def prepare() -> str:
            directory.mkdir(parents=True, exist_ok=True)
            holder = writer_lock.claim(directory)
            if holder is not None:
                raise CheckpointError(_refusal(directory, holder))
            lock.enter_context(_locked(directory))
            _recover(directory)
            meta["written_seq"] = 1 + max([_written(directory, s)
                                           for s in available_steps(directory)] or [0])
            tmp = directory / f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            return str(tmp)

        tmp = pathlib.Path(_on_lead("checkpoint.save.prepare", prepare))
        error = None
        try:
            ocp.PyTreeCheckpointer().save(tmp / "arrays", arrays)
            if feedback:
                ocp.PyTreeCheckpointer().save(tmp / "feedback", {"feedback": feedback})
        except Exception as e:  # noqa: BLE001 — every process must hear of it
            error = e
        processes.agree("checkpoint.save.write", error, CheckpointError)

        def commit() -> str:
            # Every process has finished writing (agreed above): the sizes are final.
            meta["files"] = _file_sizes(tmp / "arrays")
            if feedback:
                meta["feedback"]["files"] = _file_sizes(tmp / "feedback")
            with open(tmp / "meta.json", "w") as f:
                json.dump(meta, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            final = _finalize(tmp, _step_dir(directory, step))
            if keep is not None:
                _retain(directory, step, keep)
            return str(final)

        return pathlib.Path(_on_lead("checkpoint.save.commit", commit))


# -- restore -----------------------------------------------------------------------------------


def _find(directory: pathlib.Path, step: int | None) -> int:
    """The step to read (default the latest written), after undoing a re-save that died
    between its renames. Raises ``CheckpointError`` if there is none."""
    if directory.is_dir() and any(directory.glob(".tmp-replaced-*")):
        with _locked(directory):
            _recover(directory)
    steps = available_steps(directory)
    if step is not None:
        return int(step)
    if not steps:
        hint = ""
        if directory.is_dir() and any(directory.glob(".tmp-*")):
            hint = " (only an unfinished save is there: it was interrupted)"
        raise CheckpointError(f"no checkpoint in {directory}{hint}")
    return int(latest_step(directory))


def _read_meta(directory: pathlib.Path, step: int) -> tuple[dict, pathlib.Path]:
    path = _step_dir(directory, step)
    others = [s for s in available_steps(directory) if s != step]
    fallback = (f"; other checkpoints here: steps {others} (pass step=...)" if others else "")
    if not path.is_dir():
        raise CheckpointError(f"no checkpoint for step {step} in {directory}{fallback}")
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"{path} is not a complete zeropp_jax checkpoint (meta.json unreadable: {e})"
            f"{fallback}"
        ) from e
    if meta.get("format") != FORMAT:
        old = (" (written by an older zeropp_jax, before multi-process checkpoints; load it "
               "with that version and save it again)"
               if meta.get("format") == "zeropp_jax.train.checkpoint/1" else "")
        raise CheckpointError(
            f"{path}: unknown format {meta.get('format')!r}, expected {FORMAT}{old}")
    return meta, path


def _locate(directory: str | os.PathLike, step: int | None, name: str
            ) -> tuple[dict, pathlib.Path]:
    """(meta, path) of one finished checkpoint, the same on every process."""
    directory = pathlib.Path(directory).absolute()  # orbax wants absolute paths
    chosen = int(_on_lead(f"{name}.find", lambda: str(_find(directory, step))))
    meta = path = error = None
    try:
        meta, path = _read_meta(directory, chosen)
    except CheckpointError as e:
        error = e
    processes.agree(f"{name}.meta", error, CheckpointError)
    return meta, path


def _check_files(path: pathlib.Path, meta: dict, name: str) -> None:
    """Raises ``CheckpointError`` on every process if any process finds a file of the
    checkpoint missing or not its written size. Checked before the read, because a read
    that fails on one process only would leave the others waiting for it."""
    bad = _damaged_files(path, meta)
    error = None
    if bad:
        error = CheckpointError(
            f"{path} is damaged: {'; '.join(bad[:4])}"
            + (f" ({len(bad) - 4} more)" if len(bad) > 4 else "") + "."
            + _fallback(path))
    processes.agree(f"{name}.files", error, CheckpointError)


def _read_arrays(path: pathlib.Path, targets: dict, name: str, sub: str = "arrays") -> dict:
    """Reads ``path/<sub>`` (``arrays``, or ``feedback``) into the shape of ``targets``
    (orbax restore args).

    Through orbax's handler, not its ``Checkpointer``: the Checkpointer ends a restore with
    a device-collective barrier that has no timeout, so a read failing on one process would
    leave the others there forever. Here the processes agree on the outcome through the
    coordination service instead (``processes.agree``, with a timeout)."""
    import orbax.checkpoint as ocp

    arrays, error = None, None
    handler = ocp.PyTreeCheckpointHandler()
    try:
        try:
            arrays = handler.restore(path / sub,
                                     args=ocp.args.PyTreeRestore(restore_args=targets))
        finally:
            # Inside the try: closing can raise the read's error too (a damaged OCDBT
            # b-tree node surfaced once as tensorstore's DATA_LOSS ValueError, not as
            # CheckpointError).
            handler.close()
    except Exception as e:  # noqa: BLE001 — any failure to read means a damaged checkpoint
        error = CheckpointError(
            f"{path} is damaged: its arrays cannot be read ({_short(e)}).{_fallback(path)}")
    processes.agree(f"{name}.read", error, CheckpointError)
    return arrays


def _verify(path: pathlib.Path, meta: dict, sums: dict[str, str],
            call: str = "restore") -> None:
    bad = [k for k, v in meta["checksums"].items() if sums.get(k) != v]
    if bad:
        raise CheckpointError(
            f"{path} is damaged: array {bad[0]} fails its checksum"
            + (f" ({len(bad) - 1} more)" if len(bad) > 1 else "") + "." + _fallback(path, call))


def _describe_units(recs: list[dict]) -> dict[str, tuple]:
    return {r["name"]: (r["n"], tuple((tuple(l["path"]), tuple(l["shape"])) for l in r["leaves"]))
            for r in recs}


def _unit_mismatch(path: Any, want: dict, have: dict, what: str) -> CheckpointError | None:
    if want == have:
        return None
    diff = []
    for name in sorted(set(want) | set(have)):
        if want.get(name) != have.get(name):
            w = f"{want[name][0]:,} parameters" if name in want else "absent"
            h = f"{have[name][0]:,} parameters" if name in have else "absent"
            diff.append(f"{what} {name!r}: checkpoint {h}, this model {w}")
    return CheckpointError(
        f"{path} was written for another model: " + "; ".join(diff[:6])
        + ". Build the state with the model configuration (and frozen= filter) the "
        "checkpoint was saved with."
    )


def _regrouped(path: Any, mine: list[dict], theirs: list[dict], what: str
               ) -> CheckpointError | None:
    """The error for a template holding the checkpoint's parameters (the same paths and
    shapes) split into other units (another ``units=`` or wrap policy), else None."""
    def leaves(recs: list[dict]) -> list[tuple]:
        return sorted((tuple(r["path"]) + tuple(l["path"]), r.get("layer"), tuple(l["shape"]))
                      for r in recs for l in r["leaves"])

    def names(recs: list[dict]) -> list[str]:
        return [r["name"] for r in recs]

    if leaves(mine) != leaves(theirs) or sorted(names(mine)) == sorted(names(theirs)):
        return None
    paths = list(dict.fromkeys("/".join(r["path"]) for r in theirs if r["path"]))
    return CheckpointError(
        f"{path} holds this model's parameters (the same paths and shapes), but split into "
        f"other {what}s: the checkpoint was written with {len(theirs)} {what}s "
        f"{names(theirs)[:8]}{'...' if len(theirs) > 8 else ''}, this template has "
        f"{len(mine)}: {names(mine)[:8]}{'...' if len(mine) > 8 else ''}. Create the template "
        "with the units= (or wrap policy) the checkpoint was saved with, e.g. "
        f"TrainState.create(..., units={paths[:8]}{'...' if len(paths) > 8 else ''})"
    )


def _check_fits(state: TrainState, meta: dict, path: pathlib.Path) -> None:
    """Raises ``CheckpointError`` unless the checkpoint holds this state's model,
    optimizer, collections and frozen weights (stored the same way)."""
    engine = state.engine
    mine = _unit_records(engine.layouts)
    err = _regrouped(path, mine, meta["units"], "unit") or _unit_mismatch(
        path, _describe_units(mine), _describe_units(meta["units"]), "unit")
    if err:
        raise err
    opt_want = _opt_leaves(state)
    strip = lambda recs: [(r["key"], r["kind"], r["unit"], r["shape"]) for r in recs]  # noqa
    if strip(opt_want) != strip(meta["opt_state"]):
        raise CheckpointError(
            f"{path} holds the state of another optimizer ({len(meta['opt_state'])} leaves, "
            f"e.g. {[r['key'] for r in meta['opt_state'][:3]]}) than this state's "
            f"({len(opt_want)} leaves, e.g. {[r['key'] for r in opt_want[:3]]}); create the "
            "template state with the same optax transformation"
        )
    want = [jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(state.collections or {})[0]]
    have = [r["key"] for r in meta.get("collections", [])]
    if want != have:
        raise CheckpointError(
            f"{path} holds variable collections {have[:4]}... but this state has "
            f"{want[:4]}...: create the template state from the same model (with its "
            "batch_stats / state)"
        )
    mine, theirs = _frozen_info(state), meta.get("frozen")
    if (mine is None) != (theirs is None):
        raise CheckpointError(
            f"{path} was saved {'with' if theirs else 'without'} frozen parameters and this "
            f"state has {'some' if mine else 'none'}: create the template with the same "
            "TrainState.create(..., frozen=...) filter"
        )
    if mine is None:
        return
    for key in ("quantized", "bits", "block_size", "blockwise", "dtype"):
        if mine[key] != theirs[key]:
            raise CheckpointError(
                f"{path} stores its frozen weights with {key}={theirs[key]!r}, this state "
                f"with {key}={mine[key]!r}: create the template with the config the "
                "checkpoint was saved with (quantize_frozen, weight_bits, block_size, "
                "blockwise, param_dtype)"
            )
    err = _regrouped(path, mine["units"], theirs["units"], "frozen unit") or _unit_mismatch(
        path, _describe_units(mine["units"]), _describe_units(theirs["units"]),
        "frozen part of unit")
    if err:
        raise err
    if mine["quantized"] and not mine["blockwise"] and (
            mine["n_pad"] != theirs["n_pad"] or mine["shards"] != theirs["shards"]):
        raise CheckpointError(
            f"{path} holds frozen weights quantized with one scale per device's shard "
            f"(blockwise=False) on {theirs['shards']} devices; they restore only onto "
            f"{theirs['shards']} devices (this mesh has {mine['shards']}). Use blockwise "
            "quantization (the default) for checkpoints that move between meshes"
        )


def _restore_args(x: jax.Array) -> Any:
    """Read the stored array into ``x``'s global shape, sharding and dtype: zeros where
    the stored one is shorter (this mesh pads more), its tail dropped where longer."""
    return compat.orbax_resizing_restore_args(x.sharding, x.shape, x.dtype)


def _targets(state: TrainState, meta: dict) -> tuple[dict, dict]:
    """(orbax restore args in the checkpoint's tree, the template array for each)."""
    engine = state.engine
    shards = state.params if state.master is None else state.master
    like: dict[str, dict[str, jax.Array]] = {"params": {}, "opt": {}}
    saved = {r["name"]: i for i, r in enumerate(meta["units"])}
    for name in engine.layouts:
        like["params"][f"u{saved[name]}"] = shards.units[name]
    for i, leaf in enumerate(jax.tree_util.tree_leaves(state.opt_state)):
        like["opt"][f"o{i}"] = leaf
    if state.collections:
        like["collections"] = {
            f"c{i}": jax.random.key_data(leaf) if is_prng_key(leaf) else leaf
            for i, leaf in enumerate(jax.tree_util.tree_leaves(state.collections))}
    if meta.get("frozen"):
        like["frozen"] = {}
        saved = {r["name"]: i for i, r in enumerate(meta["frozen"]["units"])}
        for name in engine.frozen_layouts:
            like["frozen"][f"v{saved[name]}"] = state.frozen.values[name]
            if state.frozen.quantized:
                like["frozen"][f"s{saved[name]}"] = state.frozen.scales[name]
    return jax.tree_util.tree_map(_restore_args, like), like


def restore(
    directory: str | os.PathLike, state: TrainState, *, step: int | None = None
) -> TrainState:
    """Loads a checkpoint into the shape of ``state`` (which fixes model, optimizer, mesh).

    ``state`` is a template, typically fresh from ``TrainState.create`` on the mesh to
    restore onto (any mesh shape, device or process count, ZeRO stage); its values are
    replaced. Collective like ``save``: every process calls it and reads only its own
    devices' shards. ``step``: which checkpoint (default the one written last). Raises
    ``CheckpointError`` (on every process) if the checkpoint is incomplete, damaged, or was
    written for another model, optimizer or frozen-weight storage.

    Kept qgZ errors (a ``state`` with ``qgz_error_feedback``): on the mesh shape the
    checkpoint was written on (same nodes x local, same unit layouts), every device's own,
    bit for bit. On another mesh, per unit, the sum of all devices' errors over both hops
    (decoded, in the layout of the unit's flat gradient, fp32, its real elements: the
    gradient not yet sent) is shared out equally: each device keeps total / devices as its
    hop-1 error (FP8 again: within 2^-4 of each element plus 2^-10 of its block's scale),
    none for hop 2; on a single node, where qgZ quantizes nothing, they are dropped. Errors
    of zero if the checkpoint has none; a ``state`` with the feedback off ignores them.
    """
    if not isinstance(state, TrainState):
        raise TypeError(f"restore expects a zeropp_jax.TrainState template, got "
                        f"{type(state).__name__}")
    if canonical.is_sliced(state.engine):  # read as stored, then into tensor slices
        restored = restore(directory, canonical.canonical_template(state), step=step)
        return canonical.from_canonical(restored, state)
    _same_arguments("checkpoint.restore", {
        "directory": str(pathlib.Path(directory).absolute()), "step": step})
    meta, path = _locate(directory, step, "checkpoint.restore")
    _check_fits(state, meta, path)  # the same verdict on every process: same meta, template
    args, _ = _targets(state, meta)
    _check_files(path, meta, "checkpoint.restore")
    arrays = _read_arrays(path, args, "checkpoint.restore")
    _verify(path, meta, _checksums("checkpoint.restore.checksums", _flat(arrays),
                                   _real_lengths(arrays, meta)))

    engine = state.engine
    mesh, cfg = engine.mesh, engine.config
    replicated = NamedSharding(mesh, REPLICATED)
    saved = {r["name"]: i for i, r in enumerate(meta["units"])}
    master = {name: arrays["params"][f"u{saved[name]}"] for name in engine.layouts}
    opt_state = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(state.opt_state),
        [arrays["opt"][f"o{i}"] for i in range(len(meta["opt_state"]))])
    # The counters where the template keeps them (its sharding, memory kind included).
    where = lambda x: getattr(x, "sharding", replicated)  # noqa: E731
    new = state.replace(
        step=_replicated_scalar(meta["step"], where(state.step)),
        skipped_steps=_replicated_scalar(meta.get("skipped_steps", 0),
                                         where(state.skipped_steps)),
        opt_state=opt_state,
    )
    if state.collections:
        leaves = []
        for i, (rec, leaf) in enumerate(zip(meta["collections"],
                                            jax.tree_util.tree_leaves(state.collections))):
            x = arrays["collections"][f"c{i}"]
            if rec.get("prng"):
                impl = jax.random.key_impl(leaf)
                x = jax.jit(lambda d, impl=impl: jax.random.wrap_key_data(d, impl=impl),
                            out_shardings=leaf.sharding)(x)
            leaves.append(x)
        new = new.replace(collections=jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(state.collections), leaves))
    if meta.get("frozen"):
        fsaved = {r["name"]: i for i, r in enumerate(meta["frozen"]["units"])}
        f = state.frozen
        new = new.replace(frozen=f.replace(
            values={k: arrays["frozen"][f"v{fsaved[k]}"] for k in f.values},
            scales={k: arrays["frozen"][f"s{fsaved[k]}"] for k in f.scales}))
    if cfg.stage == 3:
        return new.replace(params=ShardedParams(master, True,
                                                _restore_feedback(path, meta, state)))
    cdt = cfg.compute_jnp_dtype  # stages 1 and 2: replicated compute-dtype weights too
    full = {k: jax.jit(lambda v: v.astype(cdt),
                       out_shardings=state.params.units[k].sharding)(v)
            for k, v in master.items()}
    return new.replace(params=ShardedParams(full, False), master=ShardedParams(master, True))


def _replicated_scalar(value: int, replicated: NamedSharding) -> jax.Array:
    return place(np.asarray(value, np.int32), replicated)


# -- without a mesh ----------------------------------------------------------------------------


def _tree_of(flat: np.ndarray, leaves: list[dict]) -> dict:
    tree: dict = {}
    offset = 0
    for leaf in leaves:
        size = int(np.prod(leaf["shape"], dtype=np.int64))
        node = tree
        for k in leaf["path"][:-1]:
            node = node.setdefault(k, {})
        node[leaf["path"][-1]] = flat[offset: offset + size].reshape(leaf["shape"])
        offset += size
    return tree


def _frozen_flat(arrays: dict, info: dict, j: int, rec: dict) -> np.ndarray:
    """A frozen part as stored -> fp32 ``[n]`` (dequantized if stored quantized)."""
    values = np.asarray(arrays["frozen"][f"v{j}"])
    if not info["quantized"]:
        return values[: rec["n"]]
    from zeropp_jax.quant.quantization import dequantize_flat

    scales = np.asarray(arrays["frozen"][f"s{j}"])
    n_pad = info["n_pad"][rec["name"]]
    block = info["block_size"] or n_pad // info["shards"]
    blocks = values.size * (2 if info["bits"] == 4 else 1) // block
    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        full = dequantize_flat(values, scales[:blocks], bits=info["bits"], block_size=block,
                               dtype=np.float32, implementation="xla")
    return np.asarray(full)[: rec["n"]]


def load_params(directory: str | os.PathLike, *, step: int | None = None) -> PyTree:
    """The checkpoint's parameters as a plain Flax params tree of numpy arrays (param
    dtype; frozen weights dequantized to fp32, as ``state.consolidate()`` gives them).

    Needs no mesh, model or optimizer (DeepSpeed's ``zero_to_fp32``): usable with
    ``model.apply({"params": load_params(dir)}, ...)`` on any device. Reads every array
    whole, in every process that calls it.
    """
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()
    meta, path = _read_meta(directory, _find(directory, step))
    call = "load_params"
    bad = _damaged_files(path, meta)
    if bad:
        raise CheckpointError(f"{path} is damaged: {'; '.join(bad[:4])}."
                              + _fallback(path, call))
    args: dict = {}
    for key in meta["checksums"]:
        group, name = key.split("/")
        args.setdefault(group, {})[name] = ocp.RestoreArgs(restore_type=np.ndarray)
    try:
        arrays = ocp.PyTreeCheckpointer().restore(path / "arrays", restore_args=args)
    except Exception as e:  # noqa: BLE001
        raise CheckpointError(
            f"{path} is damaged: its arrays cannot be read ({_short(e)})."
            + _fallback(path, call)) from e
    real = _real_lengths(arrays, meta)
    _verify(path, meta, {k: "%016x%016x" % _sums_of(np.asarray(x).reshape(-1)[: real[k]], 0)
                         for k, x in _flat(arrays).items()}, call)
    trees = {rec["name"]: _tree_of(np.asarray(arrays["params"][f"u{i}"])[: rec["n"]],
                                   rec["leaves"]) for i, rec in enumerate(meta["units"])}
    recs = {rec["name"]: rec for rec in meta["units"]}
    info = meta.get("frozen")
    for j, rec in enumerate(info["units"] if info else []):
        part = _tree_of(_frozen_flat(arrays, info, j, rec), rec["leaves"])
        trees[rec["name"]] = merge_trees(trees.get(rec["name"], {}), part)
        recs.setdefault(rec["name"], rec)
    rest = trees.pop(REST, {})
    by_path: dict[tuple, Any] = {}
    stacks: dict[tuple, dict[int, Any]] = {}
    for name, tree in trees.items():
        p, layer = tuple(recs[name]["path"]), recs[name].get("layer")
        if layer is None:
            by_path[p] = tree
        else:
            stacks.setdefault(p, {})[layer] = tree
    for p, layers in stacks.items():  # nn.scan stacks: layers back on a leading axis
        by_path[p] = jax.tree_util.tree_map(lambda *xs: np.stack(xs),
                                            *[layers[i] for i in range(len(layers))])
    return merge_units(rest, by_path)


def consolidate(state: TrainState) -> PyTree:
    """A plain Flax params tree of numpy arrays from a sharded ``state`` (any stage)."""
    return state.consolidate()
