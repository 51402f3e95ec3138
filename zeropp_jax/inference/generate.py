"""Greedy autoregressive generation on a ZeRO train state, with hpZ's secondary partition.

Generation (RLHF's rollout phase) runs the model once per new token. ZeRO-3 would gather
every unit's weights across all nodes at every step. Here the weights cross nodes once:
``gather_secondary`` gathers each unit over ``("node", "local")`` and keeps, on every
device, its hpZ secondary slice (``n_pad / L`` elements per unit; frozen weights stored
quantized keep int8 values plus block scales). Every ``decode_step`` then rebuilds each
unit's weights, just before the unit runs, with an all-gather over ``"local"`` only — zero
bytes leave the node (with ``hpz_group_size = k * L``, ``k > 1``, the rebuild also
exchanges between the ``k`` nodes of a group).

No KV cache: each step reruns the model on a fixed-length token buffer ``[batch, length]``
and reads the logits at the last filled position. A causal model's logits there do not
depend on later (still empty) positions, so the tokens equal those of incremental decoding,
and every step has the same shapes (one compiled program).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.train.engine import Engine
from zeropp_jax.train.state import TrainState

from zeropp_jax.comm.frozen import frozen_local_shards, merge_trees
from zeropp_jax.comm.partition import REST
from zeropp_jax.comm.transports.hpz import SecondaryRegather, secondary_of
from zeropp_jax.core.mesh import AXES

PyTree = Any
SHARDED = P(AXES)


def _transports(engine: Engine) -> dict[str, SecondaryRegather]:
    """Per unit part (``"params/<unit>"``, ``"frozen/<unit>"``): the plan's transport,
    rebuilding from hpZ's secondary (over one node unless ``config.hpz`` sets a larger
    group)."""
    out = {}
    for name, t in engine.transports.items():
        for part, transport in (("params/", t.weights), ("frozen/", t.frozen)):
            if transport is not None:
                out[part + name] = secondary_of(transport)
    return out


def _specs(tree: PyTree) -> PyTree:
    return jax.tree_util.tree_map(lambda _: SHARDED, tree)


def _check(state: Any) -> Engine:
    if not isinstance(state, TrainState):
        raise TypeError(f"expected a zeropp_jax.TrainState, got {type(state).__name__}")
    if state.config.stage != 3:
        raise NotImplementedError(
            "hpZ generation gathers from primary shards (ZeRO stage 3); with stages 1 and 2 "
            "every device already holds the full weights: call model.apply on "
            "state.consolidate()"
        )
    return state.engine


def _gather_program(engine: Engine) -> Any:
    """The jitted program that builds every unit's secondary slice; kept in the engine's
    memo (built once per engine, freed with it)."""
    return engine.remembered(("generate", "gather"), lambda: _build_gather_program(engine))


def _build_gather_program(engine: Engine) -> Any:
    transports = _transports(engine)

    def body(units: dict, frozen: Any) -> dict:
        # Inside shard_map: one all-gather per unit over ("node", "local"), then each
        # device keeps the slice of its position in its hpZ group.
        out = {}
        for key, t in transports.items():
            kind, name = key.split("/", 1)
            stored = (units[name],) if kind == "params" else frozen_local_shards(frozen, name)
            out[key] = t.keep(stored, t.gather(stored)[1])
        return out

    def run(units: dict, frozen: Any) -> dict:
        in_specs = (_specs(units), None if frozen is None else frozen.specs())
        names = [("params/" + n, 1) for n in engine.layouts] + [
            ("frozen/" + n, 2 if engine.config.quantize_frozen else 1)
            for n in engine.frozen_layouts]
        out_specs = {n: (SHARDED,) * c for n, c in names}
        return jax.shard_map(body, mesh=engine.mesh, in_specs=in_specs,
                             out_specs=out_specs)(units, frozen)

    return jax.jit(run)


def gather_secondary(state: TrainState) -> dict[str, tuple[jax.Array, ...]]:
    """Builds the hpZ secondary partition of every unit: the only cross-node traffic.

    Returns ``{"params/<unit>": (w,), "frozen/<unit>": (values, scales) or (w,)}``, each a
    global array split over ``("node", "local")``: device ``d`` holds ``[n_pad / G]``
    elements (compute dtype; int8 / INT4-packed values and fp32 scales for quantized frozen
    weights), the slice of its position in its hpZ group of ``G`` devices (``G = L`` unless
    ``config.hpz`` with a larger ``hpz_group_size``). ``gather_secondary.lower(state)``
    gives the program for ``comm_report``.
    """
    engine = _check(state)
    return _gather_program(engine)(state.params.units, state.frozen)


def _lower_gather(state: TrainState) -> Any:
    engine = _check(state)
    return _gather_program(engine).lower(state.params.units, state.frozen)


gather_secondary.lower = _lower_gather  # type: ignore[attr-defined]


def _decode_program(engine: Engine, method: Any) -> Any:
    """The jitted one-token step for ``method``; kept in the engine's memo."""
    return engine.remembered(("generate", "decode", method),
                             lambda: _build_decode_program(engine, method))


def _build_decode_program(engine: Engine, method: Any) -> Any:
    transports = _transports(engine)
    cdt = engine.config.compute_jnp_dtype

    def unit_tree(secondary: dict, name: str) -> PyTree:
        # Inside shard_map: rebuild the unit's weights inside the node (all-gather over
        # "local"; with k > 1 also the group's ring over "node").
        tree = {}
        if name in engine.layouts:
            full = transports["params/" + name].regather(secondary["params/" + name])
            tree = engine.layouts[name].unflatten(full.astype(cdt))
        if name in engine.frozen_layouts:
            full = transports["frozen/" + name].regather(secondary["frozen/" + name])
            tree = merge_trees(tree, engine.frozen_layouts[name].unflatten(full.astype(cdt)))
        return tree

    def body(secondary: dict, buffer: jax.Array, pos: jax.Array) -> jax.Array:
        names = set(engine.layouts) | set(engine.frozen_layouts)
        paths = {n: (engine.layouts.get(n) or engine.frozen_layouts[n]).path for n in names}
        units = {
            paths[n]: (lambda n: lambda fn: lambda *arrays: fn(unit_tree(secondary, n), *arrays))(n)
            for n in names if n != REST
        }
        rest = unit_tree(secondary, REST) if REST in names else {}
        logits = engine.adapter.run_units(units, rest, buffer, method=method)
        last = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)
        nxt = jnp.argmax(last, axis=-1).astype(buffer.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buffer, nxt[:, None], pos, axis=1)

    def run(secondary: dict, buffer: jax.Array, pos: jax.Array) -> jax.Array:
        return jax.shard_map(body, mesh=engine.mesh,
                             in_specs=(_specs(secondary), SHARDED, P()),
                             out_specs=SHARDED)(secondary, buffer, pos)

    return jax.jit(run, donate_argnums=(1,))


def decode_step(state: TrainState, secondary: dict, buffer: jax.Array, pos: Any, *,
                method: Any = None) -> jax.Array:
    """One greedy decode step: ``buffer[:, pos] = argmax(model(buffer)[:, pos - 1])``.

    ``buffer``: int32 ``[batch, length]`` split over all devices on the batch dimension
    (``batch`` divisible by the device count); ``pos``: the position to fill (a Python int
    or int32 scalar; traced, so every step runs one compiled program). Weights come from
    ``secondary`` (``gather_secondary``): each unit is rebuilt by an all-gather over
    ``"local"`` just before it runs. ``buffer`` is donated.
    """
    engine = _check(state)
    return _decode_program(engine, method)(secondary, buffer, jnp.asarray(pos, jnp.int32))


def lower_decode_step(state: TrainState, secondary: dict, buffer: jax.Array, pos: Any = 1, *,
                      method: Any = None) -> Any:
    """The lowered decode-step program (for ``zeropp_jax.measure.analysis.comm_report``)."""
    engine = _check(state)
    return _decode_program(engine, method).lower(secondary, buffer, jnp.asarray(pos, jnp.int32))


def _buffer(state: TrainState, prompts: np.ndarray, length: int) -> jax.Array:
    prompts = np.asarray(prompts, np.int32)
    b, t0 = prompts.shape
    if not 0 < t0 < length:
        raise ValueError(f"prompt length {t0} must be in [1, {length}) (length={length})")
    n = state.engine.num_devices
    if b % n:
        raise ValueError(f"batch {b} must be a multiple of the {n} devices it is split over")
    buf = np.zeros((b, length), np.int32)
    buf[:, :t0] = prompts
    return jax.device_put(buf, NamedSharding(state.mesh, SHARDED))


def generate(state: TrainState, prompts: np.ndarray, length: int, *,
             secondary: dict | None = None, method: Any = None) -> np.ndarray:
    """Greedy generation: ``prompts`` int32 ``[batch, t0]`` -> tokens ``[batch, length]``.

    Gathers the secondary partition once (``gather_secondary``, unless given) and runs
    ``length - t0`` decode steps, each communicating only inside the node.
    """
    _check(state)
    buf = _buffer(state, prompts, length)
    secondary = gather_secondary(state) if secondary is None else secondary
    for pos in range(np.shape(prompts)[1], length):
        buf = decode_step(state, secondary, buf, pos, method=method)
    return np.asarray(jax.device_get(buf))


def greedy_reference(model: Any, params: PyTree, prompts: np.ndarray, length: int) -> np.ndarray:
    """Single-device greedy decoding with ``model.apply`` (the same fixed-length buffer)."""
    prompts = np.asarray(prompts, np.int32)
    with jax.default_device(jax.devices()[0]):
        buf = np.zeros((prompts.shape[0], length), np.int32)
        buf[:, : prompts.shape[1]] = prompts
        apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
        for pos in range(prompts.shape[1], length):
            logits = apply(params, buf)
            buf[:, pos] = np.asarray(jnp.argmax(logits[:, pos - 1], axis=-1))
    return buf
