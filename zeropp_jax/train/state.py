"""``TrainState``: a model's parameters and optimizer state on primary shards.

``TrainState.create`` cuts the params tree into units (flat layouts), places each device's
primary shards, initialises the optimizer on them and builds the run's ``Engine``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from zeropp_jax.core import processes, scopes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.train.engine import Engine
from zeropp_jax.comm.frozen import (
    FrozenFilter,
    FrozenShards,
    as_predicate,
    frozen_alignment,
    quantize_frozen_flat,
    split_frozen,
)
from zeropp_jax.units.adapters import adapt
from zeropp_jax.comm.hpz import group_nodes
from zeropp_jax.core.mesh import mesh_shape
from zeropp_jax.train.optim import check_elementwise
from zeropp_jax.comm.partition import (
    REST,
    UnitLayout,
    make_unit_layout,
    split_units,
    stack_layers,
    unit_name,
)
from zeropp_jax.comm.placement import REPLICATED, SHARDED, ShardedParams, place, place_replicated
from zeropp_jax.units.wrap import describe_units, resolve_units, scan_stacks, warn_if_unbalanced

PyTree = Any


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
      collections: the model's other variable collections (``batch_stats``, ...), full and
        replicated on every device; a step updates them with the mean over devices of what
        each device's call returns (``apply_fn(..., mutable=[...])``). An empty dict if
        there are none, so ``{"params": p, **state.collections}`` works for every model.
        ``state.batch_stats`` reads the BatchNorm statistics.
    """

    step: jax.Array
    params: ShardedParams
    opt_state: PyTree
    master: ShardedParams | None
    engine: Engine = struct.field(pytree_node=False)
    skipped_steps: jax.Array | None = None
    frozen: FrozenShards | None = None
    collections: dict[str, PyTree] = struct.field(default_factory=dict)

    @property
    def batch_stats(self) -> PyTree:
        """The ``batch_stats`` collection (BatchNorm running statistics), replicated."""
        if not self.collections or "batch_stats" not in self.collections:
            raise AttributeError("this state has no batch_stats collection (the model was "
                                 "created without one)")
        return self.collections["batch_stats"]

    @property
    def apply_fn(self) -> Callable[..., Any]:
        """``model.apply`` for this state's params: ``apply_fn({"params": state.params},
        *args, **kwargs)``. Bound to this state's frozen shards and qgZ schedule. For a
        transformers model, also its own call style: ``apply_fn(**batch, params=params,
        dropout_rng=rng, train=True)``."""
        return functools.partial(self.engine.call,
                                 self.engine.step_state(self.frozen, self.step))

    @property
    def tx(self) -> optax.GradientTransformation:
        return self.engine.tx

    @property
    def mesh(self) -> Mesh:
        return self.engine.mesh

    @property
    def config(self) -> ZeroPPConfig:
        return self.engine.config

    def apply_gradients(self, *, grads: ShardedParams, **collections: PyTree) -> "TrainState":
        """Optimizer step on primary shards. Call inside a ``train_step`` function.

        ``collections``: new values of variable collections, as Flax's examples pass
        ``apply_gradients(grads=grads, batch_stats=updates["batch_stats"])``."""
        with jax.named_scope(scopes.OWN):
            new = self.replace(step=self.step + 1, **self.engine.optimizer_step(
                grads, params=self.params, master=self.master, opt_state=self.opt_state,
                skipped_steps=self.skipped_steps))
        if not collections:
            return new
        unknown = set(collections) - set(self.collections or {})
        if unknown:
            raise TypeError(
                f"apply_gradients got {sorted(unknown)}, which are not collections of this "
                f"state ({sorted(self.collections or {})}); create the state with them: "
                "TrainState.create(..., params=variables) with the whole variables dict"
            )
        return new.replace(collections={**self.collections, **collections})

    def specs(self) -> "TrainState":
        """This state with a ``PartitionSpec`` in place of every array: how ``train_step``
        places it on the mesh (shards split over ``("node", "local")``, the rest
        replicated)."""
        return self.replace(
            step=REPLICATED,
            skipped_steps=REPLICATED,
            params=self.params.specs(),
            master=None if self.master is None else self.master.specs(),
            opt_state=self.engine.opt_specs,
            frozen=None if self.frozen is None else self.frozen.specs(),
            collections=jax.tree_util.tree_map(lambda _: REPLICATED, self.collections),
        )

    def describe(self) -> str:
        """A table of the units: parameters, share of the model, shard per device."""
        return describe_units(*self.engine.unit_table())

    def consolidate(self) -> PyTree:
        """The full parameters as a plain Flax params tree of numpy arrays (param dtype);
        for an NNX model, the pure dict ``nnx.State.to_pure_dict()`` gives (list indices
        as int keys), ready for ``nnx.replace_by_pure_dict``."""
        processes.rendezvous("state.consolidate")  # a collective: every process calls it
        tree = self.engine.consolidate(self.params if self.master is None else self.master,
                                       self.frozen)
        return self.engine.adapter.to_pure_dict(tree)

    @classmethod
    def create(
        cls,
        *,
        model: nn.Module,
        params: PyTree = None,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        config: ZeroPPConfig | None = None,
        units: Any = None,
        frozen: FrozenFilter | None = None,
        stacked: Sequence[str | Sequence[str]] = (),
        batch_stats: PyTree = None,
        collections: Mapping[str, PyTree] | None = None,
    ) -> "TrainState":
        """Shards ``params`` over ``mesh`` and initializes the optimizer on the shards.

        Args:
          model: the Flax linen model (``model.apply({"params": params}, ...)`` must work),
            a transformers ``FlaxPreTrainedModel`` (its ``module`` is the model, its
            ``params`` the default ``params``), or an ``nnx.Module`` (``params=None``: its
            ``nnx.Param`` values; its other state becomes ``collections``).
          params: its parameters (the ``"params"`` collection of ``model.init``), or the
            whole variables dict of ``model.init`` (``params`` plus other collections such
            as ``batch_stats``, which then go to ``state.collections``).
            Multi-host: every process passes the same values (same init seed); each places
            only its own devices' shards.
          tx: an optax transformation acting elementwise (checked).
          mesh: a ``("node", "local")`` mesh from ``make_mesh``.
          config: default ``ZeroPPConfig.zero3()``.
          units: which modules are units (gathered together, one at a time). Default
            ``"auto"``: the repeated blocks at any depth (siblings named alike with an
            index: ``h/0, h/1``, ``block_0, block_1``), larger leftover modules as units of
            their own, the rest in one rest unit. Also: module paths (``"a/b"`` or
            tuples), path globs (``"transformer/h/*"``), module classes or class names, an
            int (FSDP's size-based policy: the deepest modules with at least that many
            parameters), or a callable ``(path, subtree) -> bool``. See
            ``zeropp_jax.units.wrap``. ``state.describe()`` prints the resulting table; a unit
            holding over half of the parameters triggers a warning naming the fix.
          frozen: which parameters do not train: a callable on the parameter path (tuple of
            names from the root) returning True for frozen ones, or a sequence of path
            prefixes. They get no gradient and no optimizer state, and are stored in
            ``state.frozen`` (quantized with ``config.quantize_frozen``). Stage 3 only.
          stacked: module paths (``"layers"`` or ``("decoder", "layers")``) of scanned
            stacks (linen ``nn.scan``, or NNX modules made with ``nnx.vmap`` and run with
            ``nnx.scan``): modules whose parameters carry a leading layer axis. The default
            ``units`` policy adds the stacks it recognises (``wrap.scan_stacks``). Each layer is its
            own unit, and inside the step every scan iteration gathers only its layer's
            weights (one compiled body; live weights bounded by construction).
          batch_stats, collections: other variable collections (``batch_stats=`` or
            ``collections={"batch_stats": ...}``), kept full and replicated.
        """
        config = ZeroPPConfig.zero3() if config is None else config
        # The model's kind is decided here, once: everything after asks the adapter.
        adapter, params, collections = adapt(model, params, collections)
        if params is None:
            raise TypeError("TrainState.create needs params= (model.init(...)['params'])")
        if not isinstance(config, ZeroPPConfig):
            raise TypeError(f"config must be a ZeroPPConfig, got {type(config).__name__}")
        nodes, local = mesh_shape(mesh)
        num_devices = nodes * local
        collections = dict(collections or {})
        if batch_stats is not None:
            collections["batch_stats"] = batch_stats
        if isinstance(params, Mapping) and "params" in params and isinstance(
            params["params"], Mapping
        ) and all(isinstance(v, Mapping) for v in params.values()):
            # The whole variables dict of model.init: params plus other collections.
            collections = {**{k: v for k, v in params.items() if k != "params"},
                           **collections}
            params = params["params"]
        collections = {k: v for k, v in collections.items() if jax.tree_util.tree_leaves(v)}
        if not isinstance(params, Mapping) or not jax.tree_util.tree_leaves(params):
            raise ValueError(
                "the model has no parameters, so there is nothing for ZeRO to shard; "
                "check that params comes from model.init(...)['params']"
            )
        check_elementwise(tx)
        if config.hpz:
            group_nodes(config.hpz_group_size, nodes, local)  # raises naming the valid sizes

        stacked = tuple(tuple(p.split("/")) if isinstance(p, str) else tuple(p) for p in stacked)
        if units is None or (isinstance(units, str) and units == "auto"):
            # The default policy also finds nn.scan stacks (each layer its own unit).
            stacked += tuple(p for p in scan_stacks(params) if p not in stacked)
        # A scanned stack is a unit per layer by construction: no policy looks inside it.
        unit_paths = tuple(
            p for p in resolve_units(units, params, adapter)
            if not any(p[: len(s)] == s or s[: len(p)] == p for s in stacked))
        unit_paths += stacked
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
            name: place(
                np.asarray(lay.flatten(jax.tree_util.tree_map(np.asarray, trees[name]), pdt)),
                sharded,
            )
            for name, lay in layouts.items()
        }

        opt_specs = _opt_state_specs(tx, layouts, pdt)
        opt_state = jax.jit(
            jax.shard_map(tx.init, mesh=mesh, in_specs=(SHARDED,), out_specs=opt_specs)
        )(master)

        engine = Engine(adapter, tx, mesh, config, layouts, opt_specs, frozen_layouts,
                        explicit_units=units is not None and units != "auto")
        warn_if_unbalanced(*engine.unit_table(), params)
        step = place(np.zeros((), np.int32), NamedSharding(mesh, REPLICATED))
        placed_collections = jax.tree_util.tree_map(
            lambda x: place_replicated(x, NamedSharding(mesh, REPLICATED)), collections)
        skipped = place(np.zeros((), np.int32), NamedSharding(mesh, REPLICATED))
        if config.stage == 3:
            frozen_shards = (
                _store_frozen(frozen_layouts, frozen_trees, config, sharded)
                if frozen_layouts else None
            )
            if config.qgz and config.qgz_error_feedback and any(
                    lay.layer is not None for lay in layouts.values()):
                raise ValueError(
                    "qgz_error_feedback does not support scanned layer stacks (nn.scan / "
                    "nnx.scan): their layers share one unit call. Unroll the stack, or "
                    "turn the feedback off")
            params = ShardedParams(master, True, engine.zero_feedback())
            return cls(step, params, opt_state, None, engine, skipped, frozen_shards,
                       placed_collections)
        cdt = config.compute_jnp_dtype
        replicated = NamedSharding(mesh, REPLICATED)
        full = {
            name: place(
                np.asarray(lay.flatten(jax.tree_util.tree_map(np.asarray, trees[name]), pdt))
                .astype(cdt),
                replicated,
            )
            for name, lay in layouts.items()
        }
        return cls(step, ShardedParams(full, False), opt_state, ShardedParams(master, True), engine,
                   skipped, None, placed_collections)


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
            values[name], scales[name] = place(v, sharding), place(s, sharding)
        else:
            values[name] = place(flat, sharding)
    return FrozenShards(values, scales, config.quantize_frozen, config.weight_bits,
                        config.block_size)
