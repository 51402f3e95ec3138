"""Generation on a ZeRO train state: KV-cached decoding with hpZ, and the cache-less one.

``generate`` is RLHF's rollout phase: the model decodes one token per step with its KV cache
(``conventions``: Flax's decode convention or transformers' ``init_cache``), the loop runs
on device (``decode_loop``), and each device holds the cache of its own rows only. Every
step runs each unit on its full weights, rebuilt just before the unit runs:

* with hpZ (``config.hpz``): ``gather_secondary`` gathers every unit across nodes once and
  keeps, on every device, its hpZ secondary slice (``n_pad / L`` elements per unit; frozen
  weights stored quantized keep their int8 values plus block scales); each step rebuilds
  the unit with an all-gather over ``"local"`` only, so zero bytes leave the node per token
  (with ``hpz_group_size = k * L``, ``k > 1``, the rebuild also exchanges between the ``k``
  nodes of a group);
* without hpZ: each step gathers the unit from the primary shards over
  ``("node", "local")`` with the unit's own transport (qwZ's INT8/INT4 blocks with
  ``config.qwz``), as ZeRO-3's forward does.

``generate_without_cache`` is the older generator: greedy only, rerunning the whole model
on a fixed-length buffer for every token (its cost grows with the square of the length).
"""

from __future__ import annotations

import contextlib
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.comm.frozen import frozen_local_shards, merge_trees
from zeropp_jax.comm.partition import REST
from zeropp_jax.comm.placement import pin_slices, sharded_spec
from zeropp_jax.comm.transports import WeightTransport
from zeropp_jax.core import compat
from zeropp_jax.core.mesh import AXES, manual_axes
from zeropp_jax.inference.conventions import (
    Convention,
    TransformersCache,
    cache_shapes,
    convention_of,
    init_cache,
    takes_several_tokens,
)
from zeropp_jax.inference.decode_loop import Rollout, decode_loop
from zeropp_jax.inference.sampling import Sampling, checked_int
from zeropp_jax.train.engine import Engine
from zeropp_jax.train.global_batch import batch_offset
from zeropp_jax.train.state import TrainState
from zeropp_jax.units.adapters.linen import LinenAdapter
from zeropp_jax.units.apply import apply_from_source
from zeropp_jax.units.ordering import GatherOrder, after

PyTree = Any
SHARDED = P(AXES)


def _transports(engine: Engine) -> dict[str, WeightTransport]:
    """Per unit part (``"params/<unit>"``, ``"frozen/<unit>"``): the plan's transport,
    rebuilding from hpZ's secondary (over one node unless ``config.hpz`` sets a larger
    group)."""
    out = {}
    for name, t in engine.transports.items():
        for part, transport in (("params/", t.weights), ("frozen/", t.frozen)):
            if transport is not None:
                out[part + name] = engine.plan.secondary(transport)
    return out


def _stored_buffers(engine: Any, name: str) -> int:
    """How many buffers unit ``name``'s frozen part is stored in (its transport's)."""
    layout = engine.frozen_layouts[name]
    return len(engine.transports[name].frozen.stored_specs(layout.n_pad,
                                                          engine.config.param_jnp_dtype))


def _specs(tree: PyTree) -> PyTree:
    """Each buffer's spec inside a generation program: split over the data axes on its
    last dimension (a tensor-parallel unit's leading slice axis left to XLA)."""
    return jax.tree_util.tree_map(lambda x: sharded_spec(np.ndim(x)), tree)


def _rules(engine: Engine) -> Any:
    """The model's logical-axis rules for its tensor-parallel constraints (none without a
    ``"model"`` axis)."""
    return nn.logical_axis_rules(engine.tensor_rules) if engine.tensor_rules else \
        contextlib.nullcontext()


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
            stored = ((compat.on_device(units[name]),) if kind == "params"
                      else frozen_local_shards(frozen, name))
            out[key] = t.keep(stored, t.gather(stored)[1])
        return out

    def run(units: dict, frozen: Any) -> dict:
        in_specs = (_specs(units), None if frozen is None else frozen.specs())
        names = [("params/" + n, (sharded_spec(len(lay.global_shape)),))
                 for n, lay in engine.layouts.items()] + [
            ("frozen/" + n, (SHARDED,) * _stored_buffers(engine, n))
            for n in engine.frozen_layouts]
        out_specs = dict(names)
        out = jax.shard_map(body, mesh=engine.mesh, in_specs=in_specs,
                            out_specs=out_specs, **manual_axes(engine.mesh))(units, frozen)
        return pin_slices(out, out_specs, engine.mesh)

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
        with _rules(engine):
            logits = engine.adapter.run_units(units, rest, buffer, method=method)
        last = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)
        nxt = jnp.argmax(last, axis=-1).astype(buffer.dtype)
        return jax.lax.dynamic_update_slice_in_dim(buffer, nxt[:, None], pos, axis=1)

    def run(secondary: dict, buffer: jax.Array, pos: jax.Array) -> jax.Array:
        return jax.shard_map(body, mesh=engine.mesh,
                             in_specs=(_specs(secondary), SHARDED, P()),
                             out_specs=SHARDED, **manual_axes(engine.mesh))(
                                 secondary, buffer, pos)

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


def _integers(name: str, x: Any, what: str) -> np.ndarray:
    """``x`` (``what``, for the error) as an int32 array of the same shape, refusing what a
    cast would silently change: a non-integer dtype (``np.asarray(x, np.int32)`` truncates
    3.7 to 3) and values outside int32."""
    a = np.asarray(x)
    if a.dtype.kind not in "iu":
        raise ValueError(
            f"{name} must be {what} (an int array), got dtype {a.dtype}; convert with "
            f"np.asarray({name}, np.int32) if they are whole numbers")
    i32 = np.iinfo(np.int32)
    if a.size and (a.min() < i32.min or a.max() > i32.max):
        raise ValueError(f"{name} must fit in int32, got values {a.min()}..{a.max()}")
    return a.astype(np.int32)


def _token_ids(prompts: Any, prompt_lengths: Any = None) -> tuple[np.ndarray, np.ndarray]:
    """Every generator's check of its prompts, before anything is traced or compiled.

    Args:
      prompts: int ``[batch, prompt_len >= 1]`` token ids, rows right-padded.
      prompt_lengths: int ``[batch]`` in ``[1, prompt_len]``, or None (every row full).
    Returns:
      ``(prompts, lengths)``: int32 ``[batch, prompt_len]`` and int32 ``[batch]``.
    Raises:
      ValueError naming the argument and the fix: a wrong shape, a non-integer dtype, a
      length out of range, or a negative token id inside a row's prompt (the padding after
      it is never read, so it may hold anything).
    """
    shape = np.shape(prompts)
    if len(shape) != 2 or shape[1] < 1:
        raise ValueError(f"prompts must be int [batch, prompt_len >= 1], got shape {shape}")
    ids = _integers("prompts", prompts, "integer token ids")
    b, t0 = shape
    if prompt_lengths is None:
        lengths = np.full((b,), t0, np.int32)
    else:
        lengths = _integers("prompt_lengths", prompt_lengths, "integer lengths")
        if lengths.shape != (b,) or lengths.min() < 1 or lengths.max() > t0:
            raise ValueError(
                f"prompt_lengths must be int [{b}] with values in [1, {t0}] (row r's prompt is "
                f"prompts[r, :prompt_lengths[r]], right-padded); got shape {lengths.shape}, "
                f"values {lengths.min()}..{lengths.max()}")
    in_prompt = np.arange(t0)[None, :] < lengths[:, None]
    if (ids[in_prompt] < 0).any():
        raise ValueError(
            f"prompts must be token ids >= 0, got {ids[in_prompt].min()} inside a prompt; "
            "pad rows after their prompt_lengths instead of with negative ids")
    return ids, lengths


def _buffer(state: TrainState, prompts: np.ndarray, length: int) -> jax.Array:
    prompts, _ = _token_ids(prompts)
    b, t0 = prompts.shape
    if not 0 < t0 < length:
        raise ValueError(f"prompt length {t0} must be in [1, {length}) (length={length})")
    n = state.engine.num_devices
    if b % n:
        raise ValueError(f"batch {b} must be a multiple of the {n} devices it is split over")
    buf = np.zeros((b, length), np.int32)
    buf[:, :t0] = prompts
    return jax.device_put(buf, NamedSharding(state.mesh, SHARDED))


def generate_without_cache(state: TrainState, prompts: np.ndarray, length: int, *,
                           secondary: dict | None = None, method: Any = None) -> np.ndarray:
    """Greedy generation without a KV cache: ``prompts`` int32 ``[batch, t0]`` -> tokens
    ``[batch, length]``; every token reruns the model on the whole buffer.

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
    prompts, _ = _token_ids(prompts)
    with jax.default_device(jax.devices()[0]):
        buf = np.zeros((prompts.shape[0], length), np.int32)
        buf[:, : prompts.shape[1]] = prompts
        apply = jax.jit(lambda p, x: model.apply({"params": p}, x))
        for pos in range(prompts.shape[1], length):
            logits = apply(params, buf)
            buf[:, pos] = np.asarray(jnp.argmax(logits[:, pos - 1], axis=-1))
    return buf


# ---------------------------------------------------------------------------------------
# KV-cached generation
# ---------------------------------------------------------------------------------------


def _hashable(x: Any) -> Any:
    try:
        hash(x)
        return x
    except TypeError:
        return id(x)


def _unit_weights(engine: Engine, name: str, source: Any, frozen: Any, hpz: bool,
                  tie: Any) -> PyTree:
    """Inside ``shard_map``: unit ``name``'s full params tree in the compute dtype, rebuilt
    from hpZ's secondary (``source``: ``gather_secondary``'s dict; an all-gather over
    ``"local"``) or gathered from the primary shards (``source``: ``{unit: shard}``; an
    all-gather over ``("node", "local")`` with the unit's transport). ``tie(x)``: the
    stored buffer made to wait for the step's input (no gather is hoisted out of the
    token loop; at most ``prefetch`` gathers run ahead)."""
    cdt = engine.config.compute_jnp_dtype
    t = engine.transports[name]
    tree: PyTree = {}
    parts = []
    if name in engine.layouts:
        parts.append(("params/", t.weights, engine.layouts[name],
                      None if hpz else (source[name],)))
    if name in engine.frozen_layouts:
        parts.append(("frozen/", t.frozen, engine.frozen_layouts[name],
                      None if hpz else frozen_local_shards(frozen, name)))
    for kind, transport, layout, stored in parts:
        if hpz:
            kept = tuple(tie(x) for x in source[kind + name])
            full = engine.plan.secondary(transport).regather(kept)
        else:
            full = transport.gather(tuple(compat.on_device(tie(x)) for x in stored))[0]
        tree = merge_trees(tree, layout.unflatten(full.astype(cdt)))
    return tree


def _model_step(engine: Engine, convention: Convention, source: Any, frozen: Any, hpz: bool,
                length: int, gathered: dict | None = None) -> Any:
    """Inside ``shard_map``: ``step(cache, tokens [b, 1], position)`` -> ``(logits, cache)``
    with every unit's weights from ``_unit_weights`` at the unit's call, or, with
    ``gathered`` (unit name -> params tree, gathered before the token loop), from there."""
    adapter = LinenAdapter(convention.module)

    def step(cache: PyTree, tokens: jax.Array, position: jax.Array) -> tuple:
        order = GatherOrder(engine.config.prefetch)

        def tie(x: jax.Array) -> jax.Array:
            return after(order.tie(x), tokens)

        def weights(name: str) -> PyTree:
            if gathered is not None:
                return gathered[name]
            return _unit_weights(engine, name, source, frozen, hpz, tie)

        args, kwargs = convention.step_args(tokens, position, length)
        with _rules(engine):
            out, mutated = apply_from_source(
                adapter, engine.layouts, engine.frozen_layouts, weights,
                engine.config.compute_jnp_dtype, *args, collections={"cache": cache},
                mutable=["cache"], order=order, **kwargs)
        return convention.logits(out), mutated["cache"]

    return step


def _source(state: TrainState, hpz: bool) -> Any:
    """What the token loop rebuilds weights from: hpZ's secondary (gathered across nodes
    here, once) or the primary shards."""
    return gather_secondary(state) if hpz else dict(state.params.units)


def _generate_program(engine: Engine, convention: Convention, rollout: Rollout,
                      hpz: bool, gather_once: bool = False, prefill: int = 0) -> Any:
    key = ("generate", "kv", type(convention), _hashable(convention.module), rollout, hpz,
           gather_once, prefill)
    return engine.remembered(key, lambda: _build_generate_program(
        engine, convention, rollout, hpz, gather_once, prefill))


def _build_generate_program(engine: Engine, convention: Convention, rollout: Rollout,
                            hpz: bool, gather_once: bool, prefill: int) -> Any:
    def body(source: Any, frozen: Any, prompts: jax.Array, lengths: jax.Array,
             key: jax.Array) -> jax.Array:
        b, t0 = prompts.shape
        length = t0 + rollout.max_new_tokens
        rows = batch_offset(prompts) + jnp.arange(b, dtype=jnp.int32)
        gathered = None
        if gather_once:  # every unit's full weights, before the loop: none per token
            names = set(engine.layouts) | set(engine.frozen_layouts)
            gathered = {n: _unit_weights(engine, n, source, frozen, hpz, lambda x: x)
                        for n in names}
        step = _model_step(engine, convention, source, frozen, hpz, length, gathered)
        return decode_loop(step, init_cache(convention, b, length), prompts, lengths, rows,
                           key, rollout, prefill)

    def run(source: Any, frozen: Any, prompts: jax.Array, lengths: jax.Array,
            key: jax.Array) -> jax.Array:
        in_specs = (_specs(source), None if frozen is None else frozen.specs(), SHARDED,
                    SHARDED, P())
        return jax.shard_map(body, mesh=engine.mesh, in_specs=in_specs,
                             out_specs=SHARDED, check_vma=False, **manual_axes(engine.mesh))(
            source, frozen, prompts, lengths, key)

    return jax.jit(run)


def _prefill(convention: Convention, shape: tuple, prompt_lengths: Any, rollout: Rollout,
              devices: int = 1) -> int:
    """How many prompt positions one step feeds before the token loop: all but the last of a
    full-length prompt batch, when the model takes several tokens per step; else 0 (rows of
    different lengths go one token at a time, so the program does not depend on them)."""
    b, t0 = shape
    if prompt_lengths is not None or t0 < 2:
        return 0
    return t0 - 1 if takes_several_tokens(convention, b // devices,
                                          t0 + rollout.max_new_tokens) else 0


def _check_generate(state: Any, prompts: Any, max_new_tokens: int, model: Any,
                    prompt_lengths: Any, sampling: Sampling, key: Any
                    ) -> tuple[Engine, Convention, jax.Array, jax.Array, jax.Array]:
    engine = _check(state)
    convention = convention_of(engine.adapter, model)
    prompts, lengths = _token_ids(prompts, prompt_lengths)
    b, t0 = prompts.shape
    n = engine.num_devices
    if b % n:
        raise ValueError(
            f"batch {b} must be a multiple of the {n} devices the rows are split over; pad the "
            f"batch with dummy prompts to {-(-b // n) * n} rows")
    if key is None:
        if not sampling.greedy:
            raise ValueError(
                f"temperature={sampling.temperature} samples tokens: pass key=jax.random."
                "key(seed) (or temperature=0.0 for greedy decoding)")
        key = jax.random.PRNGKey(0)
    # A clear error if the model makes no cache (traced once per model and shape).
    engine.remembered(("generate", "cache", _hashable(convention.module), b // n,
                       t0 + max_new_tokens),
                      lambda: cache_shapes(convention, b // n, t0 + max_new_tokens))
    sharded = NamedSharding(engine.mesh, SHARDED)
    put = (lambda x: jax.device_put(x, sharded)) if jax.process_count() == 1 else (
        lambda x: jax.make_array_from_process_local_data(sharded, x, x.shape))
    return (engine, convention, put(prompts), put(lengths),
            jax.device_put(key, NamedSharding(engine.mesh, P())))


def generate(state: TrainState, prompts: Any, max_new_tokens: int, *, model: Any = None,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             key: jax.Array | None = None, stop_tokens: Any = None,
             prompt_lengths: Any = None, pad_token: int = 0,
             secondary: dict | None = None, gather_once: bool = False) -> jax.Array:
    """Decodes ``max_new_tokens`` tokens after each prompt with a KV cache, on the sharded
    state.

    Args:
      state: a ZeRO-3 ``TrainState`` of a linen model in Flax's decode convention or a
        transformers Flax causal LM.
      prompts: int ``[batch, prompt_len]``, rows right-padded; ``batch`` a multiple of the
        device count (each device decodes ``batch / devices`` rows and holds only their
        cache).
      max_new_tokens: tokens generated after each row's prompt.
      model: the decode-mode twin of a linen model (e.g. Flax lm1b's
        ``TransformerLM(config.replace(decode=True))``) sharing the state's params tree;
        None: the state's model (a transformers model, or a linen model already in decode
        mode).
      temperature, top_k, top_p: ``temperature=0`` is greedy; otherwise tokens are sampled
        (``sampling.Sampling``) with ``key``, which is then required. Each row's draw
        depends on the key, the position and the row's index only: the same key gives
        the same tokens on every mesh shape.
      stop_tokens: a row ends after emitting one of these (kept); ``pad_token`` after.
      prompt_lengths: int ``[batch]``, row ``r``'s prompt is ``prompts[r, :len]``
        (default: all of ``prompt_len``); its new tokens follow at positions
        ``len .. len + max_new_tokens - 1``, then ``pad_token``.
      secondary: ``gather_secondary(state)`` already made (hpZ), to reuse it across calls.
      gather_once: gather every unit's full weights once, before the token loop, and keep
        them for the whole call (as DeepSpeed's hybrid engine does for generation): no
        weight traffic per token, at the memory of the whole model on every device for
        the call. Default False: each unit is gathered when it runs, so at most
        ``config.prefetch + 1`` units' full weights are live at once.
    Returns:
      int32 ``[batch, prompt_len + max_new_tokens]``, split over the devices by rows
      (``np.asarray`` it on one process).

    One compiled program per (batch, prompt_len, max_new_tokens) and settings; the tokens
    are decided on device in one loop. Weights: see the module docstring (hpZ: gathered
    across nodes once, then only inside the node).
    """
    rollout = _rollout(max_new_tokens, temperature, top_k, top_p, stop_tokens, pad_token)
    engine, convention, prompts_, lengths, key_ = _check_generate(
        state, prompts, rollout.max_new_tokens, model, prompt_lengths, rollout.sampling, key)
    hpz = engine.secondary_devices > 0
    source = secondary if (hpz and secondary is not None) else _source(state, hpz)
    prefill = engine.remembered(
        ("generate", "prefill", _hashable(convention.module), prompts_.shape,
         prompt_lengths is None, rollout.max_new_tokens),
        lambda: _prefill(convention, prompts_.shape, prompt_lengths, rollout,
                         engine.num_devices))
    program = _generate_program(engine, convention, rollout, hpz, bool(gather_once), prefill)
    return program(source, state.frozen, prompts_, lengths, key_)


def lower_generation_step(state: TrainState, prompts: Any, max_new_tokens: int, *,
                          model: Any = None) -> Any:
    """One token step of ``generate``'s loop as its own lowered program (for
    ``zeropp_jax.measure.analysis.comm_report``: the bytes each generated token moves;
    with hpZ it reads the secondary, whose cross-node gather ``gather_secondary.lower``
    shows)."""
    sampling = Sampling()
    engine, convention, prompts_, _, _ = _check_generate(
        state, prompts, max_new_tokens, model, None, sampling, None)
    hpz = engine.secondary_devices > 0
    source = _source(state, hpz)
    length = prompts_.shape[1] + max_new_tokens

    def body(source: Any, frozen: Any, prompts: jax.Array) -> jax.Array:
        step = _model_step(engine, convention, source, frozen, hpz, length)
        cache = init_cache(convention, prompts.shape[0], length)
        return step(cache, prompts[:, :1], jnp.int32(0))[0]

    def run(source: Any, frozen: Any, prompts: jax.Array) -> jax.Array:
        in_specs = (_specs(source), None if frozen is None else frozen.specs(), SHARDED)
        return jax.shard_map(body, mesh=engine.mesh, in_specs=in_specs, out_specs=SHARDED,
                             check_vma=False, **manual_axes(engine.mesh))(
                                 source, frozen, prompts)

    return jax.jit(run).lower(source, state.frozen, prompts_)


def _rollout(max_new_tokens: int, temperature: float, top_k: int | None,
             top_p: float | None, stop_tokens: Any, pad_token: int) -> Rollout:
    """The static settings, checked before anything is traced (``Sampling`` refuses a
    temperature, top_k or top_p it cannot honour)."""
    new = checked_int("max_new_tokens", max_new_tokens)  # 2.5 refused, not truncated to 2
    stops = np.ravel(stop_tokens if stop_tokens is not None else []).tolist()
    return Rollout(new, Sampling(temperature, top_k, top_p),
                   tuple(int(t) for t in stops), int(pad_token))


def _convention_for(model: Any) -> Convention:
    """The decoding convention of a model outside a train state (a transformers Flax model,
    or a linen module in decode mode)."""
    from zeropp_jax.units.adapters.transformers import is_hf_model

    return TransformersCache(model.module) if is_hf_model(model) else convention_of(
        LinenAdapter(model))


def reference_program(model: Any, max_new_tokens: int, *, temperature: float = 0.0,
                      top_k: int | None = None, top_p: float | None = None,
                      stop_tokens: Any = None, pad_token: int = 0) -> Any:
    """A plain ``jax.jit`` KV-cached decoder on full params (one device, no ZeRO):
    ``program(params, prompts [b, t0], lengths [b], key, prefill=0) -> int32
    [b, t0 + max_new_tokens]``, the same loop and sampling as ``generate`` (``prefill``:
    positions fed in one step first, see ``decode_loop``). Build once, call many times.

    ``model``: a linen module in decode mode, or a transformers Flax model."""
    convention = _convention_for(model)
    rollout = _rollout(max_new_tokens, temperature, top_k, top_p, stop_tokens, pad_token)

    def run(params: PyTree, prompts: jax.Array, lengths: jax.Array, key: jax.Array,
            prefill: int = 0) -> jax.Array:
        b, t0 = prompts.shape
        length = t0 + rollout.max_new_tokens
        cache_shapes(convention, b, length)

        def step(cache: PyTree, tokens: jax.Array, position: jax.Array) -> tuple:
            args, kwargs = convention.step_args(tokens, position, length)
            out, mutated = convention.module.apply({"params": params, "cache": cache}, *args,
                                                   mutable=["cache"], **kwargs)
            return convention.logits(out), mutated["cache"]

        return decode_loop(step, init_cache(convention, b, length), prompts, lengths,
                           jnp.arange(b, dtype=jnp.int32), key, rollout, prefill)

    return jax.jit(run, static_argnames=("prefill",))


def reference_generate(model: Any, params: PyTree, prompts: Any, max_new_tokens: int, *,
                       temperature: float = 0.0, top_k: int | None = None,
                       top_p: float | None = None, key: jax.Array | None = None,
                       stop_tokens: Any = None, prompt_lengths: Any = None,
                       pad_token: int = 0) -> np.ndarray:
    """``generate``'s tokens computed on one device from full params
    (``reference_program``): the reference it is checked against.

    ``model``: a linen module in decode mode, or a transformers Flax model (``params``: its
    params tree)."""
    prompts, lengths = _token_ids(prompts, prompt_lengths)
    program = reference_program(model, max_new_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, stop_tokens=stop_tokens, pad_token=pad_token)
    key = jax.random.PRNGKey(0) if key is None else key
    prefill = _prefill(_convention_for(model), prompts.shape, prompt_lengths,
                       _rollout(max_new_tokens, temperature, top_k, top_p, stop_tokens,
                                pad_token))
    with jax.default_device(jax.devices()[0]):
        return np.asarray(program(params, prompts, lengths, key, prefill=prefill))
