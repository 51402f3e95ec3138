"""The ZeRO engine: train state on primary shards, and the sharded train step.

A user keeps writing the train step they would write for one device::

    @zeropp_jax.train_step
    def step(state, batch):
        def loss_fn(params):
            logits = state.apply_fn({"params": params}, batch["x"])
            return cross_entropy(logits, batch["y"])
        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

``train_step`` jits the function and runs it inside ``jax.shard_map`` over the
``("node", "local")`` mesh: the batch is split over all devices on its leading dimension,
``state.params`` holds this device's primary shards, and ``state.apply_fn`` runs the Flax
model unit by unit (ZeRO-3) or on replicated weights (stages 1 and 2). Returned train states
keep their shardings; every other returned value is averaged over devices (a per-device
loss becomes the global mean).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax import collectives
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.flax import apply_units
from zeropp_jax.frozen import (
    FrozenFilter,
    FrozenShards,
    as_predicate,
    current_frozen,
    dequantize_frozen_flat,
    frozen_alignment,
    frozen_context,
    merge_trees,
    quantize_frozen_flat,
    split_frozen,
)
from zeropp_jax.hpz import group_nodes
from zeropp_jax.mesh import AXES, mesh_shape
from zeropp_jax.optim import check_elementwise
from zeropp_jax.partition import (
    REST,
    UnitLayout,
    unit_name,
    default_unit_paths,
    make_unit_layout,
    stack_layers,
    merge_units,
    split_units,
)
from zeropp_jax.unit import qgz_schedule
from zeropp_jax.weights import reduce_gradient

PyTree = Any
SHARDED = P(AXES)
REPLICATED = P()


def _place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Puts a host value that every process holds in full onto ``sharding``.

    One process (or a sharding whose devices are all local): ``jax.device_put``. Several
    processes (the mesh spans devices of other processes): every process must pass the
    same global value, and each one places only the slices its own devices hold, so no
    data moves between processes.
    """
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def _to_host(x: jax.Array) -> np.ndarray:
    """The global value of ``x`` as numpy; a collective over processes if it spans several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def global_norm(shards: Any) -> jax.Array:
    """L2 norm of a whole pytree whose leaves are primary shards. Inside ``shard_map``.

    Each device sums the squares of its shards in fp32; a ``psum`` over ``("node",
    "local")`` adds the devices' sums. Accepts a ``ShardedParams`` (as returned for the
    gradient of ``state.params`` in ZeRO-3) or any pytree of sharded leaves.
    """
    if isinstance(shards, ShardedParams):
        if not shards.sharded:
            raise ValueError(
                "global_norm needs primary shards; with ZeRO stages 1 and 2 the gradient "
                "inside the step is each device's unreduced full gradient"
            )
        shards = shards.units
    local = sum(jnp.sum(jnp.square(x.astype(jnp.float32)))
                for x in jax.tree_util.tree_leaves(shards))
    return jnp.sqrt(jax.lax.psum(local, AXES))


def _stack(*xs: Any) -> Any:
    """Stacks layers on a new leading axis: numpy for numpy inputs, else jnp (traced)."""
    if all(isinstance(x, np.ndarray) for x in xs):
        return np.stack(xs)
    return jnp.stack(xs)


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


@struct.dataclass
class ShardedParams:
    """A model's parameters as one flat buffer per unit.

    ``units[name]`` is, outside ``shard_map``, a global ``[n_pad]`` array; inside, the local
    piece. With ``sharded=True`` it is split over ``("node", "local")`` (primary shards,
    ``[n_pad / P]`` per device); with ``sharded=False`` every device holds all of it (ZeRO
    stages 1 and 2 keep full weights in the compute dtype). Use it only through
    ``state.apply_fn``; ``TrainState.consolidate`` turns it back into a Flax params tree.
    """

    units: dict[str, jax.Array]
    sharded: bool = struct.field(pytree_node=False, default=True)

    @property
    def spec(self) -> P:
        return SHARDED if self.sharded else REPLICATED

    def specs(self) -> "ShardedParams":
        return ShardedParams({k: self.spec for k in self.units}, self.sharded)


@dataclasses.dataclass(frozen=True, eq=False)
class Engine:
    """Everything static about a ZeRO run: model, optimizer, mesh, config and unit layouts.

    Compared and hashed by identity: a train state carries its engine as static data, so
    one engine means one compiled step.
    """

    model: nn.Module
    tx: optax.GradientTransformation
    mesh: Mesh
    config: ZeroPPConfig
    layouts: dict[str, UnitLayout]
    opt_specs: PyTree
    # Layouts of the units' frozen parts (``TrainState.create(..., frozen=...)``), keyed by
    # unit name like ``layouts``; a unit may appear in both (LoRA adapters beside frozen
    # weights) or only here (a wholly frozen unit).
    frozen_layouts: dict[str, UnitLayout] = dataclasses.field(default_factory=dict)

    @property
    def has_frozen(self) -> bool:
        """True if some parameters are frozen (kept outside ``params`` and ``opt_state``)."""
        return bool(self.frozen_layouts)

    def check_checkpointable(self) -> None:
        """Raises ``NotImplementedError`` for train states with frozen parameters.

        ``zeropp_jax.checkpoint`` saves ``layouts`` (trainable units) and ``opt_state`` only;
        it would silently drop frozen weights.
        """
        if self.has_frozen:
            raise NotImplementedError(
                "checkpointing a train state with frozen parameters is not supported yet: "
                "the checkpoint would hold only the trainable units. Save the adapters with "
                "state.consolidate() (a plain params tree) and rebuild the state from the "
                "base weights with TrainState.create(..., frozen=...)"
            )

    @property
    def num_devices(self) -> int:
        nodes, local = mesh_shape(self.mesh)
        return nodes * local

    # -- inside shard_map ------------------------------------------------------------------

    def apply(
        self,
        variables: Mapping[str, Any],
        *args: Any,
        method: str | Callable | None = None,
        **kwargs: Any,
    ) -> Any:
        """``model.apply`` on this device's parameters. Call inside ``train_step``.

        ``variables`` is ``{"params": state.params}``; other arguments as for Flax's
        ``Module.apply``.
        """
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise TypeError("apply_fn expects {'params': state.params} as its first argument")
        extra = set(variables) - {"params"} - ({"frozen"} if self.has_frozen else set())
        if extra:
            raise NotImplementedError(
                f"variable collections {sorted(extra)} are not supported yet; zeropp_jax "
                "shards the 'params' collection only"
            )
        params = variables["params"]
        if not isinstance(params, ShardedParams):
            raise TypeError(
                "apply_fn expects state.params (a ShardedParams), got "
                f"{type(params).__name__}. Differentiate with respect to state.params and "
                "pass what you receive to apply_fn; do not build a params dict yourself."
            )
        if kwargs.get("rngs") is not None:
            kwargs["rngs"] = _per_device_rngs(kwargs["rngs"])
        if self.config.stage == 3:
            if not self.has_frozen:
                return apply_units(
                    self.model, self.layouts, params.units, self.config, *args, method=method,
                    **kwargs,
                )
            frozen = variables.get("frozen", current_frozen())
            return apply_units(
                self.model, self.layouts, params.units, self.config, *args, method=method,
                frozen_layouts=self.frozen_layouts, frozen=frozen, **kwargs,
            )
        tree = self.unflatten_full(params.units)
        if method is None:
            return self.model.apply({"params": tree}, *args, **kwargs)
        return self.model.apply({"params": tree}, *args, method=method, **kwargs)

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
            flats[name] = _to_host(params.units[name])[: lay.n]
        frozen_flats = None if frozen is None else self.frozen_full(frozen)
        return jax.tree_util.tree_map(np.asarray, self.unflatten_full(flats, frozen_flats))

    def frozen_full(self, frozen: FrozenShards) -> dict[str, np.ndarray]:
        """Global frozen storage -> full flat fp32 ``[n_pad]`` numpy buffers per unit (the
        dequantized values a forward pass computes with, before the compute-dtype cast)."""
        out = {}
        for name, lay in self.frozen_layouts.items():
            values = _to_host(frozen.values[name])
            if frozen.quantized:
                with jax.default_device(jax.devices("cpu")[0]):
                    values = dequantize_frozen_flat(values, _to_host(frozen.scales[name]),
                                                    self.config, lay)
            out[name] = np.asarray(values, np.float32)
        return out

    def apply_gradients(self, state: "TrainState", grads: ShardedParams) -> "TrainState":
        """One optimizer step on primary shards. Call inside ``train_step``.

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
            master = state.params
            g = grads.units
        else:
            master = state.master
            g = {}
            for name, full in grads.units.items():
                if cfg.stage == 2:
                    g[name] = reduce_gradient(full, cfg.param_jnp_dtype)
                else:
                    summed = jax.lax.psum(full, AXES).astype(jnp.float32) / self.num_devices
                    g[name] = collectives.own_slice(summed, AXES).astype(cfg.param_jnp_dtype)
        g, finite = self._clip_and_check(g)
        updates, opt_state = self.tx.update(g, state.opt_state, master.units)
        new_master = optax.apply_updates(master.units, updates)
        new_master = {k: v.astype(cfg.param_jnp_dtype) for k, v in new_master.items()}
        skipped = state.skipped_steps
        if cfg.skip_nonfinite:
            # Every device decides the same (``finite`` is global), so shards stay in step.
            keep = lambda new, old: jnp.where(finite, new, old)  # noqa: E731
            new_master = jax.tree_util.tree_map(keep, new_master, master.units)
            opt_state = jax.tree_util.tree_map(keep, opt_state, state.opt_state)
            skipped = skipped + jnp.where(finite, 0, 1).astype(skipped.dtype)
        if cfg.stage == 3:
            return state.replace(
                step=state.step + 1, params=ShardedParams(new_master, True), opt_state=opt_state,
                skipped_steps=skipped,
            )
        full = {
            k: collectives.all_gather_flat(v.astype(cfg.compute_jnp_dtype), AXES, invariant=True)
            for k, v in new_master.items()
        }
        return state.replace(
            step=state.step + 1,
            params=ShardedParams(full, False),
            master=ShardedParams(new_master, True),
            opt_state=opt_state,
            skipped_steps=skipped,
        )

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
            bad = sum(jnp.sum(~jnp.isfinite(v)).astype(jnp.int32) for v in g.values())
            finite = jax.lax.psum(bad, AXES) == 0
        if cfg.gradient_clipping is not None:
            norm = global_norm(g)
            max_norm = jnp.float32(cfg.gradient_clipping)
            g = {
                k: jnp.where(norm < max_norm, v, (v / norm.astype(v.dtype)) * max_norm)
                .astype(v.dtype)
                for k, v in g.items()
            }
        return g, finite

    def step_context(self, state: "TrainState") -> Any:
        """Context for tracing one step of ``state``: the qgZ schedule (``qgz_until``) and
        the frozen shards ``apply_fn`` reads."""
        until = self.config.qgz_until_step if self.config.qgz else None
        stack = contextlib.ExitStack()
        if until is not None:
            stack.enter_context(qgz_schedule(state.step < until))
        if state.frozen is not None:
            stack.enter_context(frozen_context(state.frozen))
        return stack

    # -- outside shard_map -----------------------------------------------------------------

    def state_specs(self, state: "TrainState") -> "TrainState":
        return state.replace(
            step=REPLICATED,
            skipped_steps=REPLICATED,
            params=state.params.specs(),
            master=None if state.master is None else state.master.specs(),
            opt_state=self.opt_specs,
            frozen=None if state.frozen is None else state.frozen.specs(),
        )

    def shard_batch(self, batch: PyTree, spec: P = SHARDED) -> PyTree:
        """Places every leaf of ``batch`` with ``PartitionSpec`` ``spec`` on the mesh.

        The default splits the leading (batch) dimension over all devices. Sequence
        parallelism passes ``P("node", "local")``: batch over nodes, sequence over the
        devices of a node. With several processes every process passes the same global
        batch (for example built from the same seed and step); each places only its own
        devices' pieces.
        """
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
            return _place(x, sharding)

        return jax.tree_util.tree_map_with_path(put, batch)


@struct.dataclass
class TrainState:
    """Train state on primary shards; mirrors ``flax.training.train_state.TrainState``.

    Attributes:
      step: number of optimizer steps taken (replicated int32).
      params: the parameters the step differentiates: primary shards (stage 3) or full
        replicated compute-dtype weights (stages 1, 2).
      opt_state: the optax state of the primary shards.
      master: stages 1 and 2: the param-dtype primary shards the optimizer updates; None
        for stage 3, where ``params`` are the primary shards.
      engine: static; the model, optimizer, mesh, config and layouts.
      skipped_steps: steps whose update was skipped because the gradient held inf or NaN
        (``config.skip_nonfinite``); ``step`` counts them too (replicated int32).
      frozen: primary shards of the frozen parameters (``create(..., frozen=...)``), stored
        quantized with ``config.quantize_frozen``; never differentiated or updated. None
        when every parameter trains.
    """

    step: jax.Array
    params: ShardedParams
    opt_state: PyTree
    master: ShardedParams | None
    engine: Engine = struct.field(pytree_node=False)
    skipped_steps: jax.Array | None = None
    frozen: FrozenShards | None = None

    @property
    def apply_fn(self) -> Callable[..., Any]:
        return self.engine.apply

    @property
    def tx(self) -> optax.GradientTransformation:
        return self.engine.tx

    @property
    def mesh(self) -> Mesh:
        return self.engine.mesh

    @property
    def config(self) -> ZeroPPConfig:
        return self.engine.config

    def apply_gradients(self, *, grads: ShardedParams) -> "TrainState":
        """Optimizer step on primary shards. Call inside a ``train_step`` function."""
        return self.engine.apply_gradients(self, grads)

    def consolidate(self) -> PyTree:
        """The full parameters as a plain Flax params tree of numpy arrays (param dtype)."""
        return self.engine.consolidate(self.params if self.master is None else self.master,
                                       self.frozen)

    @classmethod
    def create(
        cls,
        *,
        model: nn.Module,
        params: PyTree,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig | None = None,
        units: Sequence[Sequence[str]] | None = None,
        frozen: FrozenFilter | None = None,
        stacked: Sequence[str | Sequence[str]] = (),
    ) -> "TrainState":
        """Shards ``params`` over ``mesh`` and initializes the optimizer on the shards.

        Args:
          model: the Flax linen model; ``model.apply({"params": params}, ...)`` must work.
          params: its parameters (the ``"params"`` collection of ``model.init``).
            Multi-host: every process passes the same values (same init seed); each places
            only its own devices' shards.
          tx: an optax transformation acting elementwise (checked).
          mesh: a ``("node", "local")`` mesh from ``make_mesh``.
          config: default ``ZeroPPConfig.zero3()``.
          units: module paths of the units (each a tuple of names). Default: every direct
            child module of the root. Parameters outside every unit form one rest unit.
          frozen: which parameters do not train: a callable on the parameter path (tuple of
            names from the root) returning True for frozen ones, or a sequence of path
            prefixes. They get no gradient and no optimizer state, and are stored in
            ``state.frozen`` (quantized with ``config.quantize_frozen``). Stage 3 only.
          stacked: module paths (``"layers"`` or ``("decoder", "layers")``) of ``nn.scan``
            stacks: modules whose parameters carry a leading layer axis. Each layer is its
            own unit, and inside the step every scan iteration gathers only its layer's
            weights (one compiled body; live weights bounded by construction).
        """
        config = ZeroPPConfig.zero3() if config is None else config
        if not isinstance(config, ZeroPPConfig):
            raise TypeError(f"config must be a ZeroPPConfig, got {type(config).__name__}")
        nodes, local = mesh_shape(mesh)
        num_devices = nodes * local
        if isinstance(params, Mapping) and set(params) == {"params"} and isinstance(
            params["params"], Mapping
        ):
            raise ValueError(
                "pass the 'params' collection, not the whole variables dict: "
                "params=variables['params']"
            )
        if not isinstance(params, Mapping) or not jax.tree_util.tree_leaves(params):
            raise ValueError(
                "the model has no parameters, so there is nothing for ZeRO to shard; "
                "check that params comes from model.init(...)['params']"
            )
        check_elementwise(tx)
        if config.hpz:
            group_nodes(config.hpz_group_size, nodes, local)  # raises naming the valid sizes

        unit_paths = (
            default_unit_paths(params) if units is None else tuple(tuple(u) for u in units)
        )
        stacked = tuple(tuple(p.split("/")) if isinstance(p, str) else tuple(p) for p in stacked)
        unit_paths += tuple(p for p in stacked if p not in unit_paths)
        unit_trees, rest = split_units(params, unit_paths)
        frozen_trees: dict[tuple[str, ...], PyTree] = {}
        if stacked and frozen is not None:
            raise NotImplementedError(
                "frozen parameters inside nn.scan stacks are not supported yet; freeze "
                "parameters outside the stacked modules, or pass no stacked= paths"
            )
        if frozen is not None:
            if config.stage != 3:
                raise NotImplementedError(
                    "frozen parameters need ZeRO stage 3 (stages 1 and 2 keep full replicated "
                    "weights, which the frozen layout does not cover); use stage=3"
                )
            is_frozen = as_predicate(frozen)
            split = {p: split_frozen(sub, is_frozen, p) for p, sub in unit_trees.items()}
            split[()] = split_frozen(rest, is_frozen, ())
            unit_trees = {p: t for p, (t, _) in split.items() if p != () and t}
            rest = split[()][0]
            frozen_trees = {p: f for p, (_, f) in split.items() if f}
            if not unit_trees and not jax.tree_util.tree_leaves(rest):
                raise ValueError(
                    "the frozen filter freezes every parameter, so there is nothing to train; "
                    "check the filter (it gets each parameter's path, e.g. ('block_0', 'attn', "
                    "'qkv', 'kernel'), and returns True for frozen ones)"
                )
        elif config.quantize_frozen:
            raise ValueError(
                "config.quantize_frozen=True but no parameters are frozen: pass "
                "TrainState.create(..., frozen=<filter>)"
            )
        layouts: dict[str, UnitLayout] = {}
        trees: dict[str, PyTree] = {}
        align = config.flat_alignment
        for path, sub in unit_trees.items():
            subs = stack_layers(sub, path) if path in stacked else [sub]
            for i, layer_tree in enumerate(subs):
                lay = make_unit_layout(path, layer_tree, num_devices, align,
                                       layer=i if path in stacked else None)
                layouts[lay.name], trees[lay.name] = lay, layer_tree
        if jax.tree_util.tree_leaves(rest):
            layouts[REST], trees[REST] = make_unit_layout((), rest, num_devices, align), rest
        frozen_layouts = {
            unit_name(p): make_unit_layout(p, f, num_devices, frozen_alignment(config))
            for p, f in frozen_trees.items()
        }

        pdt = config.param_jnp_dtype
        sharded = NamedSharding(mesh, SHARDED)
        master = {
            name: _place(
                np.asarray(lay.flatten(jax.tree_util.tree_map(np.asarray, trees[name]), pdt)),
                sharded,
            )
            for name, lay in layouts.items()
        }

        opt_specs = _opt_state_specs(tx, layouts, pdt)
        opt_state = jax.jit(
            jax.shard_map(tx.init, mesh=mesh, in_specs=(SHARDED,), out_specs=opt_specs)
        )(master)

        engine = Engine(model, tx, mesh, config, layouts, opt_specs, frozen_layouts)
        step = _place(np.zeros((), np.int32), NamedSharding(mesh, REPLICATED))
        skipped = _place(np.zeros((), np.int32), NamedSharding(mesh, REPLICATED))
        if config.stage == 3:
            frozen_shards = (
                _store_frozen(frozen_layouts, frozen_trees, config, sharded)
                if frozen_layouts else None
            )
            return cls(step, ShardedParams(master, True), opt_state, None, engine, skipped,
                       frozen_shards)
        cdt = config.compute_jnp_dtype
        replicated = NamedSharding(mesh, REPLICATED)
        full = {
            name: _place(
                np.asarray(lay.flatten(jax.tree_util.tree_map(np.asarray, trees[name]), pdt))
                .astype(cdt),
                replicated,
            )
            for name, lay in layouts.items()
        }
        return cls(step, ShardedParams(full, False), opt_state, ShardedParams(master, True), engine,
                   skipped)


def _opt_state_specs(tx: optax.GradientTransformation, layouts: Mapping[str, UnitLayout],
                     dtype: Any) -> PyTree:
    """PartitionSpec of each optimizer-state leaf: sharded if it follows the parameters.

    A leaf is per-parameter (Adam's moments) if its shape follows the shard length, and
    global otherwise (a step count). Decided by initialising abstractly at two different
    shard lengths, so it holds on a one-device mesh too, where local and global shapes agree.
    """
    def state_at(scale: int) -> PyTree:
        shapes = {k: jax.ShapeDtypeStruct((scale * lay.shard_len,), dtype)
                  for k, lay in layouts.items()}
        return jax.eval_shape(tx.init, shapes)

    return jax.tree_util.tree_map(
        lambda a, b: REPLICATED if a.shape == b.shape else SHARDED, state_at(1), state_at(2)
    )


def _store_frozen(
    layouts: Mapping[str, UnitLayout],
    trees: Mapping[tuple[str, ...], PyTree],
    config: ZeroPPConfig,
    sharding: NamedSharding,
) -> FrozenShards:
    """Frozen subtrees -> their primary shards on the mesh, quantized if configured."""
    values, scales = {}, {}
    for name, lay in layouts.items():
        flat = np.asarray(lay.flatten(jax.tree_util.tree_map(np.asarray, trees[lay.path]),
                                      config.param_jnp_dtype))
        if config.quantize_frozen:
            v, s = quantize_frozen_flat(flat, config, lay)
            values[name], scales[name] = _place(v, sharding), _place(s, sharding)
        else:
            values[name] = _place(flat, sharding)
    return FrozenShards(values, scales, config.quantize_frozen, config.weight_bits,
                        config.block_size)


# -- the decorator --------------------------------------------------------------------------


def _is_container(x: Any) -> bool:
    return isinstance(x, (TrainState, ShardedParams))


def _out_specs(out: PyTree) -> PyTree:
    def spec(x: Any) -> Any:
        if isinstance(x, TrainState):
            return x.engine.state_specs(x)
        if isinstance(x, ShardedParams):
            return x.specs()
        return REPLICATED

    return jax.tree_util.tree_map(spec, out, is_leaf=_is_container)


def _average_metrics(out: PyTree) -> PyTree:
    def avg(x: Any) -> Any:
        if _is_container(x):
            return x
        x = jnp.asarray(x)
        if jnp.issubdtype(x.dtype, jnp.inexact):
            return jax.lax.pmean(x, AXES)
        return x

    return jax.tree_util.tree_map(avg, out, is_leaf=_is_container)


def _varying_params(state: TrainState) -> TrainState:
    # Stages 1/2: replicated weights enter shard_map invariant, and autodiff would psum their
    # gradient by itself. Marking them device-varying keeps gradients local, so
    # apply_gradients decides the collective (all-reduce vs reduce-scatter) and its dtype.
    if state.params.sharded:
        return state
    units = {k: jax.lax.pcast(v, AXES, to="varying") for k, v in state.params.units.items()}
    return state.replace(params=ShardedParams(units, False))


def train_step(
    fn: Callable[..., Any] | None = None,
    *,
    donate_state: bool = False,
    batch_spec: P = SHARDED,
) -> Callable[..., Any]:
    """Turns a one-device train step ``fn(state, batch, *extra)`` into a ZeRO step.

    ``state`` is a ``zeropp_jax.TrainState``; every leaf of ``batch`` is split over all
    devices on its leading dimension (which must be divisible by the device count);
    ``extra`` arguments (an RNG key, a learning-rate scale) are replicated. Inside, ``fn``
    runs per device under ``jax.shard_map`` over ``("node", "local")``. Of what ``fn``
    returns, train states and ``ShardedParams`` keep their shardings and every other array
    is averaged over devices (``pmean``; integer arrays are returned as they are).

    The returned function is jitted once per input structure; ``.lower(state, batch,
    *extra)`` gives the lowered program (for HLO inspection). With ``donate_state=True``
    the input state's buffers are donated to the output. ``batch_spec`` is the
    ``PartitionSpec`` of every batch leaf: default ``P(("node", "local"))`` (batch split
    over all devices); ``P("node", "local")`` for sequence parallelism (batch over nodes,
    sequence over each node's devices).
    """
    if fn is None:
        return functools.partial(train_step, donate_state=donate_state, batch_spec=batch_spec)
    batch_spec = P(*batch_spec) if not isinstance(batch_spec, P) else batch_spec

    def run(state: TrainState, batch: PyTree, *extra: Any) -> Any:
        engine = state.engine
        in_specs = (
            engine.state_specs(state),
            jax.tree_util.tree_map(lambda _: batch_spec, batch),
            *[jax.tree_util.tree_map(lambda _: REPLICATED, e) for e in extra],
        )
        recorded: dict[str, Any] = {}

        def probe(state: TrainState, batch: PyTree, *extra: Any) -> jax.Array:
            with engine.step_context(state):
                recorded["specs"] = _out_specs(fn(_varying_params(state), batch, *extra))
            return jnp.zeros((), jnp.float32)

        # First pass (abstract): learn the output structure, so the real shard_map can be
        # given exact out_specs. Runs once per compilation.
        jax.eval_shape(
            jax.shard_map(probe, mesh=engine.mesh, in_specs=in_specs, out_specs=REPLICATED),
            state,
            batch,
            *extra,
        )

        def body(state: TrainState, batch: PyTree, *extra: Any) -> Any:
            with engine.step_context(state):
                return _average_metrics(fn(_varying_params(state), batch, *extra))

        return jax.shard_map(
            body, mesh=engine.mesh, in_specs=in_specs, out_specs=recorded["specs"]
        )(state, batch, *extra)

    jitted = jax.jit(run, donate_argnums=(0,) if donate_state else ())

    def _check(state: Any) -> Engine:
        if not isinstance(state, TrainState):
            raise TypeError(
                "a train_step function takes a zeropp_jax.TrainState as its first argument "
                f"(from zeropp_jax.TrainState.create), got {type(state).__name__}"
            )
        return state.engine

    @functools.wraps(fn)
    def wrapper(state: TrainState, batch: PyTree, *extra: Any) -> Any:
        engine = _check(state)
        return jitted(state, engine.shard_batch(batch, batch_spec), *extra)

    def lower(state: TrainState, batch: PyTree, *extra: Any) -> Any:
        engine = _check(state)
        return jitted.lower(state, engine.shard_batch(batch, batch_spec), *extra)

    wrapper.lower = lower  # type: ignore[attr-defined]
    wrapper.jitted = jitted  # type: ignore[attr-defined]
    return wrapper
