"""Checkpoints of a sharded train state, restorable onto any mesh shape (orbax on disk).

A checkpoint stores each unit's parameters and each optimizer-state buffer *without* the
padding and device split of the mesh it was written on: a unit's ``n`` real elements, in
the parameter dtype. Restoring pads them for the new mesh and places every device's
primary shard, so ``2x4 -> 1x8 -> 4x2`` (or 8 devices -> 4) gives identical parameters.
This is DeepSpeed's universal checkpoint, and ``load_params`` is its ``zero_to_fp32``.

Layout of ``directory``::

    step_00000100/          one finished checkpoint
      meta.json             step, units and leaf shapes, optimizer-state leaves, checksums
      arrays/               orbax PyTree checkpoint of the arrays
    .tmp-step_00000200-…/   a save in progress (or one that was interrupted): ignored

A save writes everything into a temporary directory and renames it to ``step_N`` as its
last act (an atomic rename), so an interrupted save never leaves a ``step_N`` behind and the
previous checkpoint stays usable. Every array has a CRC-32 in ``meta.json``, checked on
restore, so a damaged file is an error, never silently different weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import shutil
import uuid
import zlib
import contextlib
from typing import Any, Iterator

import jax
import numpy as np
from jax.sharding import NamedSharding

from zeropp_jax.placement import REPLICATED, SHARDED, ShardedParams, is_prng_key, place_keys
from zeropp_jax.placement import place as _place
from zeropp_jax.placement import to_host as _to_host
from zeropp_jax.state import TrainState
from zeropp_jax.mesh import mesh_shape
from zeropp_jax.partition import REST, UnitLayout, merge_units

PyTree = Any
FORMAT = "zeropp_jax.checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")


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


def _retain(directory: pathlib.Path, step: int, keep: int) -> None:
    """Keeps ``keep`` checkpoints after writing ``step``. Checkpoints of later steps
    written before it belong to a run abandoned by a rollback: they go first (oldest
    written first); then the lowest steps of the current run."""
    steps = available_steps(directory)
    seq = {s: _written(directory, s) for s in steps}
    mine = seq.get(step, 0)
    abandoned = sorted((s for s in steps if s > step and seq[s] < mine), key=lambda s: seq[s])
    current = [s for s in steps if s not in abandoned]
    for old in (abandoned + current)[: max(0, len(steps) - keep)]:
        shutil.rmtree(_step_dir(directory, old), ignore_errors=True)


# -- what a state holds, mesh-independently ----------------------------------------------------


def _check_single_process() -> None:
    if jax.process_count() > 1:
        raise NotImplementedError(
            "zeropp_jax.checkpoint runs in one process for now; with several processes "
            "(jax.distributed) call state.consolidate() on every process and save the "
            "result from process 0"
        )


def _unit_of(path: tuple, layouts: dict[str, UnitLayout]) -> str | None:
    for k in reversed(path):
        key = getattr(k, "key", None)
        if isinstance(key, str) and key in layouts:
            return key
    return None


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
            unit = _unit_of(path, engine.layouts)
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
            "n": lay.n,
            "leaves": [{"path": [str(getattr(k, "key", k)) for k in p], "shape": list(s)}
                       for (p, _), s in zip(paths, lay.shapes)],
        })
    return recs


def _crc(x: np.ndarray) -> str:
    return f"{zlib.crc32(np.ascontiguousarray(x).tobytes()):08x}"


# -- save --------------------------------------------------------------------------------------


def save(directory: str | os.PathLike, state: TrainState, *, keep: int | None = 3) -> pathlib.Path:
    """Writes ``state`` to ``directory/step_<state.step>`` and returns that path.

    Atomic: the checkpoint appears under its final name only once complete. Saves into
    one directory take turns (a lock file; two concurrent saves both succeed), and a
    re-save that dies between its two renames is undone by the next save or restore, so a
    complete checkpoint is never hidden or deleted by a crash. ``keep``: how many finished
    checkpoints to keep after a successful save (None keeps all): checkpoints of later
    steps written earlier (a run abandoned by restoring an older step) go first, then the
    lowest steps. Saving a step that already exists replaces it.
    """
    import orbax.checkpoint as ocp

    _check_single_process()
    if not isinstance(state, TrainState):
        raise TypeError(f"save expects a zeropp_jax.TrainState, got {type(state).__name__}")
    state.engine.check_checkpointable()
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive int or None, got {keep!r}")
    directory = pathlib.Path(directory).absolute()  # orbax wants absolute paths
    directory.mkdir(parents=True, exist_ok=True)
    engine = state.engine
    step = int(_to_host(state.step))
    shards = state.params if state.master is None else state.master

    arrays: dict[str, dict[str, np.ndarray]] = {"params": {}, "opt": {}}
    unit_recs = _unit_records(engine.layouts)
    for i, (name, lay) in enumerate(engine.layouts.items()):
        arrays["params"][f"u{i}"] = _to_host(shards.units[name])[: lay.n]
    opt_recs = _opt_leaves(state)
    for i, (rec, leaf) in enumerate(zip(opt_recs, jax.tree_util.tree_leaves(state.opt_state))):
        x = _to_host(leaf)
        if rec["kind"] == "unit":
            x = x[: engine.layouts[rec["unit"]].n]
        arrays["opt"][f"o{i}"] = np.asarray(x)
    coll_recs = []
    if state.collections:
        arrays["collections"] = {}
        for i, (path, leaf) in enumerate(
                jax.tree_util.tree_flatten_with_path(state.collections)[0]):
            key = is_prng_key(leaf)
            x = _to_host(jax.random.key_data(leaf) if key else leaf)
            arrays["collections"][f"c{i}"] = np.asarray(x)
            coll_recs.append({"key": jax.tree_util.keystr(path), "shape": list(np.shape(x)),
                              "dtype": str(np.asarray(x).dtype),
                              "prng": str(jax.random.key_impl(leaf)) if key else None})
    nodes, local = mesh_shape(engine.mesh)
    meta = {
        "format": FORMAT,
        "step": step,
        "skipped_steps": int(_to_host(state.skipped_steps)) if state.skipped_steps is not None
        else 0,
        "written_on": {"nodes": nodes, "local": local,
                       "config": dataclasses.asdict(engine.config)},
        "units": unit_recs,
        "opt_state": opt_recs,
        "collections": coll_recs,
        "checksums": {f"{group}/{k}": _crc(v) for group, d in arrays.items()
                      for k, v in d.items()},
    }

    with _locked(directory):
        _recover(directory)
        meta["written_seq"] = 1 + max([_written(directory, s)
                                       for s in available_steps(directory)] or [0])
        tmp = directory / f".tmp-step_{step:08d}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        ocp.PyTreeCheckpointer().save(tmp / "arrays", arrays)
        with open(tmp / "meta.json", "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        final = _finalize(tmp, _step_dir(directory, step))
        if keep is not None:
            _retain(directory, step, keep)
    return final


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


# -- restore -----------------------------------------------------------------------------------


def _read(directory: str | os.PathLike, step: int | None) -> tuple[dict, dict, pathlib.Path]:
    """(meta, arrays) of one finished checkpoint, checksums verified."""
    import orbax.checkpoint as ocp

    directory = pathlib.Path(directory).absolute()  # orbax wants absolute paths
    if directory.is_dir() and any(directory.glob(".tmp-replaced-*")):
        with _locked(directory):  # a re-save died between its renames: undo it first
            _recover(directory)
    steps = available_steps(directory)
    if step is None:
        if not steps:
            hint = ""
            if directory.is_dir() and any(directory.glob(".tmp-*")):
                hint = " (only an unfinished save is there: it was interrupted)"
            raise CheckpointError(f"no checkpoint in {directory}{hint}")
        step = latest_step(directory)
    path = _step_dir(directory, step)
    others = [s for s in steps if s != step]
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
        raise CheckpointError(f"{path}: unknown format {meta.get('format')!r}, expected {FORMAT}")
    try:
        arrays = ocp.PyTreeCheckpointer().restore(path / "arrays")
    except Exception as e:  # noqa: BLE001 — any failure to read means a damaged checkpoint
        raise CheckpointError(
            f"{path} is damaged: its arrays cannot be read ({type(e).__name__}: {e}){fallback}"
        ) from e
    for key, crc in meta["checksums"].items():
        group, name = key.split("/")
        x = arrays.get(group, {}).get(name) if isinstance(arrays, dict) else None
        if x is None or _crc(np.asarray(x)) != crc:
            raise CheckpointError(
                f"{path} is damaged: array {key} is missing or fails its checksum{fallback}"
            )
    return meta, arrays, path


def _describe_units(recs: list[dict]) -> dict[str, tuple]:
    return {r["name"]: (r["n"], tuple((tuple(l["path"]), tuple(l["shape"])) for l in r["leaves"]))
            for r in recs}


def restore(
    directory: str | os.PathLike, state: TrainState, *, step: int | None = None
) -> TrainState:
    """Loads a checkpoint into the shape of ``state`` (which fixes model, optimizer, mesh).

    ``state`` is a template, typically fresh from ``TrainState.create`` on the mesh to
    restore onto; its values are replaced. ``step``: which checkpoint (default the newest).
    Raises ``CheckpointError`` if the checkpoint is incomplete, damaged, or was written for
    another model or optimizer.
    """
    _check_single_process()
    if not isinstance(state, TrainState):
        raise TypeError(f"restore expects a zeropp_jax.TrainState template, got "
                        f"{type(state).__name__}")
    state.engine.check_checkpointable()
    meta, arrays, path = _read(directory, step)
    engine = state.engine
    want, have = _describe_units(_unit_records(engine.layouts)), _describe_units(meta["units"])
    if want != have:
        diff = []
        for name in sorted(set(want) | set(have)):
            if want.get(name) != have.get(name):
                w = f"{want[name][0]:,} parameters" if name in want else "absent"
                h = f"{have[name][0]:,} parameters" if name in have else "absent"
                diff.append(f"unit {name!r}: checkpoint {h}, this model {w}")
        raise CheckpointError(
            f"{path} was written for another model: " + "; ".join(diff[:6])
            + ". Build the state with the model configuration the checkpoint was saved with."
        )
    opt_want = _opt_leaves(state)
    strip = lambda recs: [(r["key"], r["kind"], r["unit"], r["shape"]) for r in recs]  # noqa
    if strip(opt_want) != strip(meta["opt_state"]):
        raise CheckpointError(
            f"{path} holds the state of another optimizer ({len(meta['opt_state'])} leaves, "
            f"e.g. {[r['key'] for r in meta['opt_state'][:3]]}) than this state's "
            f"({len(opt_want)} leaves, e.g. {[r['key'] for r in opt_want[:3]]}); create the "
            "template state with the same optax transformation"
        )

    mesh, cfg = engine.mesh, engine.config
    sharded, replicated = NamedSharding(mesh, SHARDED), NamedSharding(mesh, REPLICATED)

    def padded(x: np.ndarray, lay: UnitLayout, dtype: Any) -> np.ndarray:
        out = np.zeros((lay.n_pad,), dtype)
        out[: lay.n] = x
        return out

    pdt = np.dtype(cfg.param_jnp_dtype)
    # Units by name, never by position: the template may list them in another order (a
    # params tree rebuilt with sorted keys, another units= order, another policy's order).
    saved = {r["name"]: i for i, r in enumerate(meta["units"])}
    master = {name: padded(arrays["params"][f"u{saved[name]}"], lay, pdt)
              for name, lay in engine.layouts.items()}
    opt_leaves = []
    for i, rec in enumerate(opt_want):
        x = np.asarray(arrays["opt"][f"o{i}"]).astype(rec["dtype"])
        if rec["kind"] == "unit":
            opt_leaves.append(_place(padded(x, engine.layouts[rec["unit"]], x.dtype), sharded))
        else:
            opt_leaves.append(_place(x.reshape(rec["shape"]), replicated))
    opt_state = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(state.opt_state), opt_leaves
    )
    master_arrays = {k: _place(v, sharded) for k, v in master.items()}
    collections = _restore_collections(state, meta, arrays, path, replicated)
    new = state.replace(
        collections=collections,
        step=_place(np.asarray(meta["step"], np.int32), replicated),
        skipped_steps=_place(np.asarray(meta.get("skipped_steps", 0), np.int32), replicated),
        opt_state=opt_state,
    )
    if cfg.stage == 3:
        return new.replace(params=ShardedParams(master_arrays, True))
    cdt = np.dtype(cfg.compute_jnp_dtype)
    full = {k: _place(v.astype(cdt), replicated) for k, v in master.items()}
    return new.replace(params=ShardedParams(full, False),
                       master=ShardedParams(master_arrays, True))


def _restore_collections(state: TrainState, meta: dict, arrays: dict, path: Any,
                         replicated: NamedSharding) -> Any:
    """The checkpoint's variable collections (batch_stats, NNX state), placed replicated,
    in the structure of ``state.collections``; an error if the two disagree."""
    want = jax.tree_util.tree_flatten_with_path(state.collections or {})[0]
    have = meta.get("collections", [])
    if [jax.tree_util.keystr(p) for p, _ in want] != [r["key"] for r in have]:
        raise CheckpointError(
            f"{path} holds variable collections {[r['key'] for r in have][:4]}... but this "
            f"state has {[jax.tree_util.keystr(p) for p, _ in want][:4]}...: create the "
            "template state from the same model (with its batch_stats / state)"
        )
    if not want:
        return state.collections
    leaves = []
    for i, ((_, leaf), rec) in enumerate(zip(want, have)):
        x = np.asarray(arrays["collections"][f"c{i}"]).astype(rec["dtype"]).reshape(
            rec["shape"])
        leaves.append(place_keys(x, jax.random.key_impl(leaf), replicated) if rec.get("prng")
                      else _place(x, replicated))
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(state.collections),
                                        leaves)


def load_params(directory: str | os.PathLike, *, step: int | None = None) -> PyTree:
    """The checkpoint's parameters as a plain Flax params tree of numpy arrays (param dtype).

    Needs no mesh, model or optimizer (DeepSpeed's ``zero_to_fp32``): usable with
    ``model.apply({"params": load_params(dir)}, ...)`` on any device.
    """
    meta, arrays, _ = _read(directory, step)
    units, rest = {}, {}
    for i, rec in enumerate(meta["units"]):
        flat = np.asarray(arrays["params"][f"u{i}"])
        tree: dict = {}
        offset = 0
        for leaf in rec["leaves"]:
            size = int(np.prod(leaf["shape"], dtype=np.int64))
            node = tree
            for k in leaf["path"][:-1]:
                node = node.setdefault(k, {})
            node[leaf["path"][-1]] = flat[offset: offset + size].reshape(leaf["shape"])
            offset += size
        if rec["name"] == REST:
            rest = tree
        else:
            units[tuple(rec["path"])] = tree
    return merge_units(rest, units)


def consolidate(state: TrainState) -> PyTree:
    """A plain Flax params tree of numpy arrays from a sharded ``state`` (any stage)."""
    return state.consolidate()
