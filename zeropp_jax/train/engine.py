"""The engine: the static plan of a run, and the functions a step runs with it.

``Engine`` is frozen data fixed for a run: the model, optimizer, mesh, config and unit
layouts (and a memo of what it works out once). Inside ``shard_map`` it runs the model on
primary shards (``call``: unit by unit for stage 3, on replicated weights for stages 1 and
2) and computes the optimizer step on the shards (``optimizer_step``: reduce, clip, check,
update), taking arrays and returning arrays. Outside, it places batches and turns shards back
into a params tree (``consolidate``). It never sees a ``TrainState``: the state carries the
engine as static data and updates itself (``TrainState.apply_gradients`` returns
``self.replace(...)``), as ``flax.training.train_state`` does.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.comm import collectives
from zeropp_jax.core import compat, processes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.dtypes import accumulation_dtype
from zeropp_jax.train import build
from zeropp_jax.units.adapters import ModelAdapter
from zeropp_jax.units import deferral
from zeropp_jax.units.apply import UnitInputs, UnitRun, apply_units
from zeropp_jax.comm.frozen import FrozenShards, frozen_local_shards, merge_trees
from zeropp_jax.core.mesh import AXES, EXPERT, MeshInfo, batch_axes
from zeropp_jax.comm.partition import (
    REST,
    UnitLayout,
    merge_units,
    padded_length,
)
from zeropp_jax.comm.placement import (
    SHARDED,
    ShardedParams,
    global_norm,
    place,
    to_host,
)
from zeropp_jax.comm.offload import offload_mask
from zeropp_jax.comm.transports import (
    TransportPlan,
    UnitTransports,
    gradient_bytes,
    reduce_gradient,
    unsliced,
    weight_bytes,
)
from zeropp_jax.comm.wire import WireBytes

PyTree = Any


@dataclasses.dataclass(frozen=True)
class StepState:
    """What a traced step's ``apply_fn`` uses of the train state besides its params.

    Attributes:
      frozen: the state's frozen shards (``TrainState.frozen``), or None.
      qgz_on: with ``config.qgz_until``, a traced bool: qgZ (True) or the plain
        reduce-scatter for this step; None: qgZ whenever ``config.qgz``.
      step: with ``config.qgz_signs="per_step"``, the traced optimizer step (qgZ's signs
        and seeds follow it); None otherwise.
      pipes: with ``config.qgz_defer``, inside ``train_step``: scanned stack path -> the
        Ref that carries a layer's gradient to the next layer's backward
        (``units.deferral.pipes``); None otherwise.
    """

    frozen: FrozenShards | None = None
    qgz_on: jax.Array | None = None
    step: jax.Array | None = None
    pipes: Mapping[tuple[str, ...], Any] | None = None


def _stack(*xs: Any) -> Any:
    """Stacks layers on a new leading axis: numpy for numpy inputs, else jnp (traced)."""
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs)
    return jnp.stack(xs)


def _check_processes_agree(batch: PyTree) -> None:
    """With several processes, every process must pass the same global batch (each places
    only its own devices' rows of it). Their structures (leaf paths, shapes, dtypes) are
    compared at every step, so a process passing 12 rows where another passes 8 is an
    error on every process, not a silently different step or a device collective waiting
    forever; a cache of structures already seen would let a process skip the comparison
    its peers make, leaving them waiting. The comparison is one exchange of a checksum
    through the coordination service's key-value store (about 1 ms per step for 2
    processes on loopback); the structures themselves travel only when the checksums
    differ, to name them."""
    import zlib

    sig = ", ".join(f"{jax.tree_util.keystr(p) or 'batch'}: {tuple(np.shape(x))} "
                    f"{x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype}"
                    for p, x in jax.tree_util.tree_flatten_with_path(batch)[0])
    every = processes.allgather("batch structure", f"{zlib.crc32(sig.encode()):08x}")
    if len(set(every)) > 1:
        # Every process sees the same checksums, so all of them make this second exchange.
        sigs = processes.allgather("batch structure (differing)", sig[:2000])
        groups: dict[str, list[int]] = {}
        for p, s in enumerate(sigs):
            groups.setdefault(s, []).append(p)
        described = "; ".join(
            f"process{'es' if len(ps) > 1 else ''} {', '.join(map(str, ps))} passed {{{s}}}"
            for s, ps in groups.items())
        raise ValueError(
            f"processes passed different global batches (this is process "
            f"{jax.process_index()}): {described}. Every process must pass the same global "
            "batch at every step, e.g. built from the same seed and step, and each places "
            "only its own devices' rows"
        )


def _mean_over_devices(x: Any) -> Any:
    """Float leaves: mean over ``("node", "local")``; others as they are."""
    x = jnp.asarray(x)
    return jax.lax.pmean(x, AXES) if jnp.issubdtype(x.dtype, jnp.inexact) else x


def _per_device_rngs(rngs: Any) -> Any:
    """Folds this device's index into every RNG key passed to ``apply_fn``. Inside ``shard_map``.

    The step's keys arrive replicated; data-parallel training wants each device's batch
    shard to draw its own dropout masks (as each rank does in DeepSpeed / DDP), and a
    unit's backward reuses the forward's key, so masks stay consistent within a device.
    A dict of keys (``{"dropout": key}``) or a single key (Flax's ``params`` stream).
    """
    index = collectives.axis_index(AXES)
    fold = lambda key: jax.random.fold_in(key, index)  # noqa: E731
    if isinstance(rngs, Mapping):
        return {name: fold(key) for name, key in rngs.items()}
    return fold(rngs)


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """Everything static about a ZeRO run: the model's adapter, optimizer, mesh, config
    and unit layouts.

    Compared and hashed by identity: a train state carries its engine as static data, so
    one engine means one compiled step.
    """

    adapter: ModelAdapter
    tx: optax.GradientTransformation
    mesh: Mesh
    config: ZeroPPConfig
    layouts: dict[str, UnitLayout]
    opt_specs: PyTree
    # Layouts of the units' frozen parts (``TrainState.create(..., frozen=...)``), keyed by
    # unit name like ``layouts``; a unit may appear in both (LoRA adapters beside frozen
    # weights) or only here (a wholly frozen unit).
    frozen_layouts: dict[str, UnitLayout] = dataclasses.field(default_factory=dict)
    # How each unit's weights arrive and its gradient leaves (``comm.transports``), resolved
    # from the config once for the run; given empty, resolved here from the layouts.
    transports: Mapping[str, UnitTransports] = dataclasses.field(default_factory=dict)
    # True when the user chose the units (units=...): then units the call reads outside
    # their own calls are reported (the default policy's leftovers are silently resident).
    explicit_units: bool = False
    # With a "model" mesh axis: the logical-axis rules the model's sharding constraints are
    # read with inside the step (``tensor_parallel.TensorParallel.rules``).
    tensor_rules: tuple = ()
    # What this engine works out once and reuses, for as long as it lives (as long as a
    # train state built on it): the units each call structure keeps gathered
    # (``"resident"``, asked again by train_step's second trace), generation's compiled
    # programs. Nothing
    # outside the engine holds these, so dropping the state frees them with the model.
    memo: dict = dataclasses.field(default_factory=dict, repr=False)
    # How this run's bytes travel (``comm.transports.TransportPlan``), resolved from the
    # config once, when the run is built (``TrainState.create``): what the step,
    # generation and the measurements ask.
    plan: TransportPlan | None = dataclasses.field(default=None, repr=False)

    @property
    def model(self) -> Any:
        """What runs: the linen module (a transformers model's ``module``), or the NNX
        model's split form."""
        return self.adapter.module

    def __post_init__(self) -> None:
        if self.plan is None or self.plan.config is not self.config:
            raise ValueError("Engine needs the plan of its config: "
                             "plan=comm.transports.plan_of(config), resolved once per run")
        if not self.transports:
            object.__setattr__(self, "transports", self.plan.units(self.layouts,
                                                                   self.frozen_layouts))

    @property
    def units_run(self) -> UnitRun:
        """What the unit-by-unit call needs of this run (``units.apply.UnitRun``)."""
        return UnitRun(self.adapter, self.plan, self.layouts, self.frozen_layouts,
                       self.transports, self.explicit_units, self.memo.setdefault("resident", {}))

    @property
    def info(self) -> MeshInfo:
        """This run's mesh as numbers (``core.mesh.MeshInfo``)."""
        return MeshInfo.of(self.mesh)

    def remembered(self, key: Any, build: Callable[[], Any]) -> Any:
        """``memo[key]``, built by ``build()`` the first time it is asked for."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    @property
    def offloaded(self) -> frozenset[str]:
        """The units whose optimizer state lives in host memory (``offload_optimizer``,
        ``offload_ratio``)."""
        return self.plan.offload.units((n, lay.n) for n, lay in self.layouts.items())

    @property
    def has_frozen(self) -> bool:
        """True if some parameters are frozen (kept outside ``params`` and ``opt_state``)."""
        return bool(self.frozen_layouts)

    def unit_table(self) -> tuple[list[tuple[str, int, int]], int]:
        """([(unit name, parameters, shard elements per device)], total parameters),
        trainable and frozen parts of a unit counted together, in unit order."""
        rows: dict[str, list[int]] = {}
        for lays in (self.layouts, self.frozen_layouts):
            for name, lay in lays.items():
                row = rows.setdefault(name, [0, 0])
                row[0] += lay.params
                row[1] += lay.shard_len
        table = [(name, n, shard) for name, (n, shard) in rows.items()]
        return table, sum(r[1] for r in table)

    def wire_bytes(self, nodes: int | None = None, local: int | None = None
                   ) -> dict[str, dict[str, WireBytes]]:
        """Per unit, the bytes its transports move on a ``nodes x local`` mesh (default:
        this run's): ``"forward"`` (the gather), ``"backward"`` (the regather, from the
        primary shard or hpZ's secondary) and ``"gradient"`` (the reduce-scatter; absent
        for a wholly frozen unit); trainable and frozen parts added. Counted from each
        transport's own collectives (``comm.wire``), so it holds at any mesh size: layouts
        are re-padded for ``nodes * local`` devices. With tensor parallelism every slice's
        bytes are counted (each slice moves over the data devices that hold it)."""
        mesh = self.info.resized(nodes, local)
        cfg = self.config
        out: dict[str, dict[str, WireBytes]] = {}
        for name, t in self.transports.items():
            row: dict[str, WireBytes] = {}
            parts = [(t.weights, self.layouts.get(name), cfg.flat_alignment),
                     (t.frozen, self.frozen_layouts.get(name), self.plan.frozen_alignment())]
            for transport, lay, align in parts:
                if transport is None:
                    continue
                n_pad = padded_length(lay.n, mesh.data, align)
                # Tensor-parallel slices: each moves its own buffer over its own data group.
                times = lambda b, k=lay.tp: WireBytes(b.intra * k, b.cross * k)  # noqa: E731
                for k, v in weight_bytes(unsliced(transport), n_pad, cfg.param_jnp_dtype,
                                         mesh).items():
                    row[k] = row.get(k, WireBytes()) + times(v)
                if transport is t.weights:
                    row["gradient"] = times(gradient_bytes(
                        unsliced(t.gradients), n_pad, cfg.compute_jnp_dtype, mesh))
            out[name] = row
        return out

    @property
    def num_devices(self) -> int:
        return self.info.data

    @property
    def secondary_devices(self) -> int:
        """Devices of the group trainable weights are rebuilt inside in backward (hpZ's
        secondary partition, ``TransportPlan.secondary_devices``); 0: the whole mesh."""
        return self.plan.secondary_devices(self.info)

    # -- inside shard_map ------------------------------------------------------------------

    def apply(
        self,
        variables: Mapping[str, Any],
        *args: Any,
        method: str | Callable | None = None,
        **kwargs: Any,
    ) -> Any:
        """``model.apply`` on this device's parameters, without a train state's step state
        (frozen weights must then come as ``variables["frozen"]``; qgZ always on). Prefer
        ``state.apply_fn``, which carries the state's frozen shards and qgZ schedule."""
        return self.apply_step(StepState(), variables, *args, method=method, **kwargs)

    def call(self, step: "StepState", *args: Any, **kwargs: Any) -> Any:
        """``state.apply_fn``: ``apply_step`` in the model's own call style (the adapter's
        ``call``: ``({"params": ...}, *args)``, or a transformers model's
        ``(**batch, params=..., train=...)``)."""
        return self.adapter.call(lambda v, *a, **k: self.apply_step(step, v, *a, **k),
                                 *args, **kwargs)

    def apply_step(
        self,
        step: "StepState",
        variables: Mapping[str, Any],
        *args: Any,
        method: str | Callable | None = None,
        **kwargs: Any,
    ) -> Any:
        """``model.apply`` on this device's parameters. Call inside ``train_step``.

        ``step`` is what the traced step knows besides the params (``state.apply_fn`` binds
        it): the frozen shards and the qgZ schedule flag. ``variables`` is
        ``{"params": state.params}``; other arguments as for Flax's ``Module.apply``.
        """
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise TypeError("apply_fn expects {'params': state.params} as its first argument")
        try:
            collectives.axis_size(AXES)
        except NameError:
            raise RuntimeError(
                "state.apply_fn runs the model on this device's shards, so it works only "
                "inside a step function run over the mesh. To evaluate, decorate the "
                "function with @zeropp_jax.eval_step (metrics averaged over the batch; "
                "zeropp_jax.per_example(x) for per-example outputs), or take plain "
                "parameters with state.consolidate() and call model.apply on them"
            ) from None
        collections = {k: v for k, v in variables.items()
                       if k not in ("params", "frozen")}
        params = variables["params"]
        if not isinstance(params, ShardedParams):
            raise TypeError(
                "apply_fn expects state.params (a ShardedParams), got "
                f"{type(params).__name__}. Differentiate with respect to state.params and "
                "pass what you receive to apply_fn; do not build a params dict yourself."
            )
        if kwargs.get("rngs") is not None:
            kwargs["rngs"] = _per_device_rngs(kwargs["rngs"])
        with nn.logical_axis_rules(self.tensor_rules) if self.tensor_rules else \
                contextlib.nullcontext():
            frozen = variables.get("frozen", step.frozen) if self.has_frozen else None
            out = self._apply_units(step, params, frozen, collections, *args, method=method,
                                    **kwargs)
        if kwargs.get("mutable") not in (None, False):
            # Each device updated the collections from its own batch shard (BatchNorm's
            # running averages): the replicated state keeps their mean over all devices.
            result, updates = out
            return self._cast_output(result), jax.tree_util.tree_map(_mean_over_devices,
                                                                     updates)
        return self._cast_output(out)

    def _apply_units(self, step: "StepState", params: ShardedParams, frozen: Any,
                     collections: dict, *args: Any, method: Any, **kwargs: Any) -> Any:
        """The model's call on this device's shards: unit by unit (stage 3) or on the
        replicated weights (stages 1 and 2)."""
        if self.config.stage == 3:
            inputs = UnitInputs(params.units, frozen, params.feedback, step.qgz_on, step.step,
                                step.pipes)
            return apply_units(self.units_run, inputs, *args, method=method,
                               collections=collections, **kwargs)
        tree = {"params": self.unflatten_full(params.units), **collections}
        return self.adapter.apply(tree, *args, method=method, **kwargs)

    def _cast_output(self, out: Any) -> Any:
        """Floating outputs narrower than ``config.output_dtype`` -> that dtype (fp32), so
        a loss computed from bf16 logits is computed in fp32."""
        dtype = self.config.output_dtype
        if dtype is None:
            return out
        dtype = jnp.dtype(dtype)

        def cast(x: Any) -> Any:
            if (isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)
                    and jnp.finfo(x.dtype).bits < jnp.finfo(dtype).bits):
                return x.astype(dtype)
            return x

        return jax.tree_util.tree_map(cast, out)

    def unflatten_full(
        self, flats: Mapping[str, jax.Array], frozen_flats: Mapping[str, jax.Array] | None = None
    ) -> PyTree:
        """Full flat buffers per unit -> the model's params tree.

        ``frozen_flats`` (full flat frozen parts, per unit) are merged in when given;
        without them the tree holds the trainable parameters only."""
        trees = {name: lay.unflatten(flats[name]) for name, lay in self.layouts.items()}
        paths = {name: lay.path for name, lay in self.layouts.items()}
        for name, lay in self.frozen_layouts.items() if frozen_flats is not None else ():
            trees[name] = merge_trees(trees.get(name, {}), lay.unflatten(frozen_flats[name]))
            paths[name] = lay.path
        rest = trees.pop(REST, {})
        by_path: dict[tuple[str, ...], Any] = {}
        stacks: dict[tuple[str, ...], dict[int, PyTree]] = {}
        for name, t in trees.items():
            layer = self.layouts[name].layer if name in self.layouts else None
            if layer is None:
                by_path[paths[name]] = t
            else:
                stacks.setdefault(paths[name], {})[layer] = t
        for path, layers in stacks.items():  # scanned stacks: layers back on a leading axis
            ordered = [layers[i] for i in range(len(layers))]
            by_path[path] = jax.tree_util.tree_map(_stack, *ordered)
        return merge_units(rest, by_path)

    def consolidate(self, params: ShardedParams, frozen: FrozenShards | None = None) -> PyTree:
        """Global ``ShardedParams`` (outside ``shard_map``) -> plain params tree of numpy
        arrays. Works for parameters and for gradients returned from a ``train_step``.
        With ``frozen`` (``state.frozen``) the frozen parameters are merged in (dequantized
        to fp32 if stored quantized).

        With several processes (multi-host) this is a collective: every process must call
        it, and every process receives the full parameters."""
        flats = {}
        for name, lay in self.layouts.items():
            flats[name] = to_host(params.units[name])[..., : lay.n]
        frozen_flats = None if frozen is None else self.frozen_full(frozen)
        return jax.tree_util.tree_map(np.asarray, self.unflatten_full(flats, frozen_flats))

    def frozen_full(self, frozen: FrozenShards) -> dict[str, np.ndarray]:
        """Global frozen storage -> full flat fp32 ``[n_pad]`` numpy buffers per unit (the
        dequantized values a forward pass computes with, before the compute-dtype cast)."""
        out = {}
        for name, lay in self.frozen_layouts.items():
            stored = tuple(to_host(b) for b in frozen_local_shards(frozen, name))
            out[name] = self.plan.unstore_frozen(stored, lay)
        return out

    def optimizer_step(
        self,
        grads: ShardedParams,
        *,
        params: ShardedParams,
        master: ShardedParams | None,
        opt_state: PyTree,
        skipped_steps: jax.Array | None,
    ) -> dict[str, Any]:
        """One optimizer step on primary shards, inside ``shard_map`` (a train step).

        Takes the train state's fields and returns their new values (``params``,
        ``master``, ``opt_state``, ``skipped_steps``); ``TrainState.apply_gradients``
        puts them in the state it returns. Knows nothing of the state itself.

        Stage 3: ``grads`` are already primary-shard gradients (the units' backward
        reduce-scattered them). Stage 2: full local gradients, reduce-scattered here over
        ``("node", "local")``. Stage 1: full local gradients, all-reduced here, then each
        device keeps its slice. Then the optimizer updates the fp32 primary shards and, for
        stages 1 and 2, an all-gather rebuilds the replicated compute-dtype weights.
        """
        if not isinstance(grads, ShardedParams) or set(grads.units) != set(self.layouts):
            raise TypeError(
                "apply_gradients expects the gradient of the loss with respect to "
                "state.params (a ShardedParams with the same units)"
            )
        cfg = self.config
        if cfg.stage == 3:
            # Offloaded primary shards (and their gradients) come to the device.
            master = params.replace(units=compat.on_device(params.units))
            g = compat.on_device(grads.units)
        else:
            g = {}
            for name, full in grads.units.items():
                if cfg.stage == 2:
                    g[name] = reduce_gradient(self.plan.replicated_gradients(), full,
                                              cfg.param_jnp_dtype)
                else:
                    summed = (jax.lax.psum(full, AXES).astype(accumulation_dtype(full.dtype))
                              / self.num_devices)
                    g[name] = collectives.own_slice(summed, AXES).astype(cfg.param_jnp_dtype)
        g, finite = self._clip_and_check(g)
        # Kept in host memory: the update runs on the device.
        if self.plan.offload.optimizer:
            opt_state = compat.on_device(opt_state)
        old_opt_state = opt_state
        updates, opt_state = self.tx.update(g, opt_state, master.units)
        new_master = optax.apply_updates(master.units, updates)
        new_master = {k: v.astype(cfg.param_jnp_dtype) for k, v in new_master.items()}
        skipped = skipped_steps
        if cfg.skip_nonfinite:
            # Every device decides the same (``finite`` is global), so shards stay in step.
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_master = jax.tree_util.tree_map(keep, new_master, master.units)
            opt_state = jax.tree_util.tree_map(keep, opt_state, old_opt_state)
            skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
        if self.plan.offload.optimizer:  # back to the host: the offloaded units' state
            opt_state = compat.in_host_memory(
                opt_state, offload_mask(opt_state, self.layouts, self.offloaded))
        if self.plan.offload.params:
            new_master = compat.in_host_memory(new_master)
        if cfg.stage == 3:
            feedback = self._next_feedback(grads.feedback, params.feedback, finite)
            return dict(params=ShardedParams(new_master, True, feedback), master=None,
                        opt_state=opt_state, skipped_steps=skipped)
        full = {
            k: collectives.all_gather_flat(v.astype(cfg.compute_jnp_dtype), AXES, invariant=True)
            for k, v in new_master.items()
        }
        return dict(params=ShardedParams(full, False), master=ShardedParams(new_master, True),
                    opt_state=opt_state, skipped_steps=skipped)

    def _next_feedback(self, new: Mapping[str, tuple], old: Mapping[str, tuple],
                       finite: jax.Array) -> dict[str, tuple]:
        """The kept qgZ errors after a step (``config.qgz_error_feedback``). Inside
        ``shard_map``, per device.

        ``new`` is the gradient's ``feedback``: each unit's new errors, with a use count
        (the last buffer) of 1 when the unit's calls handed their errors on as one chain
        (``units.apply``), 0 when the unit did not run. Any other count means the
        gradients of separate chains were added (two ``apply_fn`` calls under one
        ``jax.grad``, a hand-written accumulation loop), which adds the errors' FP8 codes
        and scales too: those errors are dropped (zeros: the next step quantizes without
        feedback, as plain qgZ). A unit that did not run, and every unit in a step skipped
        for a non-finite gradient, keeps its old errors."""
        out = {}
        for name, kept in old.items():
            got = new.get(name)
            if got is None:
                out[name] = kept
                continue
            count = got[-1][0]
            keep_old = (count == 0) | ~finite
            out[name] = tuple(
                jnp.where(keep_old, k, jnp.where(count == 1, g.astype(k.dtype), jnp.zeros_like(k)))
                for g, k in zip(got, kept))
        return out

    def _clip_and_check(self, g: dict[str, jax.Array]) -> tuple[dict[str, jax.Array], jax.Array]:
        """Primary-shard gradients -> (clipped gradients, global "all finite" flag).

        Inside ``shard_map``. Both need the whole gradient, which no device holds: each
        device sums squares (and counts non-finite elements) over its shards, and a
        ``psum`` over ``("node", "local")`` completes them. Padding elements carry zero
        gradient, so they change neither. Clipping follows ``optax.clip_by_global_norm``
        exactly: unchanged if the norm is below the maximum, else scaled to it.
        """
        cfg = self.config
        finite = jnp.array(True)
        if cfg.skip_nonfinite:
            # Counted in f32 (exact up to 2^24 bad elements; any count > 0 means skip), so
            # XLA can combine this psum with the metrics' f32 pmean: one collective, not two.
            bad = sum(jnp.sum(~jnp.isfinite(v), dtype=jnp.float32) for v in g.values())
            finite = jax.lax.psum(bad, AXES) == 0
        if cfg.gradient_clipping is not None:
            norm = global_norm(g)
            max_norm = jnp.asarray(cfg.gradient_clipping, norm.dtype)
            g = {
                k: jnp.where(norm < max_norm, v, (v / norm.astype(v.dtype)) * max_norm)
                .astype(v.dtype)
                for k, v in g.items()
            }
        return g, finite

    def step_state(self, frozen: FrozenShards | None, step: jax.Array,
                   pipes: Mapping[tuple[str, ...], Any] | None = None) -> StepState:
        """What ``apply_fn`` needs of a train state besides the params: its frozen shards,
        with ``qgz_until`` whether qgZ is on at optimizer step ``step`` (a traced bool,
        so one compiled program serves both phases of the run), and the Refs that defer
        scanned layers' gradients (``pipes``, ``new_pipes``)."""
        grads = self.plan.gradients
        until = grads.switch_step()
        return StepState(frozen, None if until is None else step < until,
                         step if grads.follows_step() else None, pipes or None)

    def new_pipes(self) -> dict[tuple[str, ...], Any]:
        """With ``config.qgz_defer``, the Refs that carry each scanned stack's deferred
        layer gradient (``units.deferral.pipes``), to make once per traced step
        outside its differentiation (``train_step`` does); else ``{}``."""
        if not (self.config.qgz_defer and self.config.stage == 3):
            return {}
        return deferral.pipes(self.layouts, self.config, self.transports)

    # -- outside shard_map -----------------------------------------------------------------

    def feedback_specs(self, mesh: MeshInfo | None = None
                       ) -> dict[str, tuple[jax.ShapeDtypeStruct, ...]]:
        """Unit name -> the global shapes of its kept qgZ errors on ``mesh`` (default:
        this run's): each per-device buffer of
        ``QgzReduceScatter.feedback_specs`` put end to end over the devices. Empty without
        ``config.qgz_error_feedback`` or where qgZ quantizes nothing (one node); every
        trainable unit otherwise."""
        cfg = self.config
        mesh = mesh or self.info
        devices = mesh.data
        out = {}
        for name, lay in self.layouts.items():
            n_pad = padded_length(lay.n, devices, cfg.flat_alignment)
            per_device = self.transports[name].gradients.feedback_specs(n_pad, mesh)
            if not per_device:  # nothing quantized on this mesh (one node): nothing kept
                continue
            out[name] = tuple(jax.ShapeDtypeStruct((devices * s.shape[0],), s.dtype)
                              for s in per_device)
        return out

    def zero_feedback(self, abstract: bool = False) -> dict[str, tuple[jax.Array, ...]]:
        """Kept qgZ errors of zero (a new run's), placed on the mesh
        (``feedback_specs``); their shapes only if ``abstract``."""
        sharded = NamedSharding(self.mesh, SHARDED)
        return {name: tuple(place(s if abstract else np.zeros(s.shape, s.dtype), sharded)
                            for s in specs)
                for name, specs in self.feedback_specs().items()}

    def shard_batch(self, batch: PyTree, spec: P = SHARDED, *,
                    check_processes: bool = True) -> PyTree:
        """Places every leaf of ``batch`` with ``PartitionSpec`` ``spec`` on the mesh.

        The default splits the leading (batch) dimension over all devices (on an expert
        mesh over ``("node", "local", "expert")``; on a tensor-parallel mesh a
        ``"model"`` group shares its rows). Sequence
        parallelism passes ``P("node", "local")``: batch over nodes, sequence over the
        devices of a node. With several processes every process passes the same global
        batch (for example built from the same seed and step); each places only its own
        devices' pieces, and (``check_processes``) the processes compare the batch's
        structure, an exchange every process must make: a step's lowering, which one
        process may do alone, skips it.
        """
        if spec == SHARDED and EXPERT in self.mesh.axis_names:
            # Expert parallelism splits the tokens over "expert" too (within each data
            # device's share; the step is manual over the data axes only, and XLA keeps
            # this split and moves the tokens to their experts).
            spec = P(batch_axes(self.mesh))
        sharding = NamedSharding(self.mesh, spec)
        sizes = dict(self.mesh.shape)

        def put(path: Any, x: Any) -> jax.Array:
            shape = np.shape(x)
            name = jax.tree_util.keystr(path) or "batch"
            if not shape:
                raise ValueError(
                    f"{name}: a scalar is not divisible over devices; every batch leaf needs "
                    "a leading batch dimension (pass scalars such as a learning rate as extra "
                    "arguments of the step: step(state, batch, lr))"
                )
            if len(shape) < len(spec):
                raise ValueError(
                    f"{name}: shape {shape} has fewer dimensions than the batch spec {spec}"
                )
            for dim, axes in enumerate(spec):
                if axes is None:
                    continue
                axes = (axes,) if isinstance(axes, str) else tuple(axes)
                n = int(np.prod([sizes[a] for a in axes]))
                if shape[dim] % n:
                    what = "batch" if dim == 0 else f"dimension {dim}"
                    raise ValueError(
                        f"{name}: {what} size {shape[dim]} is not divisible by the {n} "
                        f"devices of mesh axes {axes} it is split over; use a size that is "
                        f"a multiple of {n}"
                    )
            if isinstance(x, jax.Array) and x.sharding == sharding:
                return x
            if isinstance(x, jax.Array) and not x.is_fully_addressable:
                return jax.device_put(x, sharding)  # a global array: reshard it
            return place(x, sharding)

        # Every leaf split on its leading dimension must have the same number of rows, and
        # some: x with 16 rows beside y with 8 would pair each device's x rows with the
        # wrong labels (or broadcast), and an empty batch would count as a step.
        if spec and spec[0] is not None:
            rows = {jax.tree_util.keystr(path) or "batch": np.shape(x)[0]
                    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]
                    if np.ndim(x)}
            if len(set(rows.values())) > 1:
                raise ValueError(
                    f"batch leaves disagree on their leading (batch) size: {rows}; every "
                    "leaf of the batch must hold the same number of examples"
                )
            if 0 in rows.values():
                raise ValueError(f"the batch is empty ({rows}): a step needs examples")
        if check_processes and jax.process_count() > 1:
            _check_processes_agree(batch)
        return jax.tree_util.tree_map_with_path(put, batch)
