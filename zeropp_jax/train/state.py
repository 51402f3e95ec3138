"""``TrainState``: a model's parameters and optimizer state on primary shards.

``TrainState.create`` cuts the params tree into units (flat layouts), places each device's
primary shards, initialises the optimizer on them and builds the run's ``Engine``.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Mapping, Sequence

import flax.linen as nn
import jax
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding

from zeropp_jax.core import processes, scopes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.comm.transports import plan_of
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.train import build
from zeropp_jax.train.engine import Engine
from zeropp_jax.train.tensor_parallel import annotated, check_rules, tensor_parallel
from zeropp_jax.comm.frozen import FrozenFilter, FrozenShards
from zeropp_jax.units.adapters import adapt
from zeropp_jax.comm.placement import REPLICATED, ShardedParams
from zeropp_jax.units.wrap import describe_units, warn_if_unbalanced

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
    # Inside a train_step with config.qgz_defer: the Refs that carry a scanned layer's
    # gradient to the next layer's backward (Engine.new_pipes); None outside one.
    pipes: dict | None = None

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
                                 self.engine.step_state(self.frozen, self.step, self.pipes))

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
        logical_axis_rules: Sequence[tuple[str, Any]] | None = None,
        param_axes: Sequence[tuple[str, Sequence[Any]]] | None = None,
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
            ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape(model.init, ...)``) give an
            abstract state: every array a ``ShapeDtypeStruct`` carrying its sharding,
            nothing allocated, for ``train_step.lower(state, batch).compile()`` ahead of
            time (a model too large for this host, or a mesh of another machine's devices,
            ``jax.experimental.topologies``).
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
          logical_axis_rules: on a mesh with a ``"model"`` axis (``make_mesh(...,
            model=T)``), the list you would pass to ``nn.logical_axis_rules``: parameters
            annotated with ``nn.with_logical_partitioning`` split over ``"model"`` where their
            logical names map to it (``nn.with_partitioning``'s mesh axes need no rules), and
            the model's ``nn.with_logical_constraint`` calls read them inside the step. NNX
            parameters annotated with ``nnx.with_partitioning`` are read the same way.
            Checked before anything is traced (``ValueError`` naming the entry and the
            fix): each entry is one ``(logical name, mesh axes)`` pair, every axis it
            names is an axis of ``mesh`` (or ``"model"``), and no parameter's logical name
            maps to a data axis (``"node"``, ``"local"``: ZeRO shards every parameter over
            those itself). Rules for activation names no parameter uses (MaxText's
            ``("batch", ("node", "local"))``) may name the data axes.
          param_axes: logical names for parameters the model does not annotate (a
            transformers Flax model): ``(regex, names)`` pairs, the first whose regex
            matches a parameter's ``"/"``-joined path (``re.search``) giving one name per
            dimension, e.g. ``[("mlp/(gate|up)_proj/kernel", ("embed", "mlp"))]``. A
            malformed entry or regex raises; on a mesh with a ``"model"`` axis, an entry
            that names no parameter warns (``UserWarning``).
        """
        config = ZeroPPConfig.zero3() if config is None else config
        # Checked first, before the model is adapted or anything traced: a rule naming an
        # axis the mesh lacks, or a malformed list, fails at once naming the entry.
        logical_axis_rules, param_axes = check_rules(logical_axis_rules, param_axes, mesh)
        # The model's kind is decided here, once: everything after asks the adapter.
        raw, (adapter, params, collections) = params, adapt(model, params, collections)
        build.check_arguments(params, config)
        # The run, resolved once: its mesh as numbers and how its bytes travel.
        info, plan = MeshInfo.of(mesh), plan_of(config)
        params, collections = build.split_variables(params, collections, batch_stats)
        build.check_setup(params, tx, plan, info)
        abstract = build.is_abstract(params)
        if abstract and (frozen is not None or jax.tree_util.tree_leaves(collections)):
            raise NotImplementedError(
                "an abstract state (params of jax.ShapeDtypeStruct) supports neither "
                "frozen= nor other variable collections yet; pass arrays for those models")

        stacked = build.stack_paths(stacked, units, params)
        tp = tensor_parallel(annotated(raw, params, adapter), logical_axis_rules,
                             param_axes, mesh, plan, frozen)
        unit_trees, rest = build.split_into_units(params, units, adapter, stacked)
        build.check_frozen(frozen, stacked, config)
        unit_trees, rest, frozen_trees = build.split_frozen_units(unit_trees, rest, frozen)
        layouts, trees = build.unit_layouts(unit_trees, rest, stacked, info.data,
                                            config.flat_alignment, tp)
        frozen_layouts = build.frozen_layouts(frozen_trees, info.data, plan, tp)

        pdt = config.param_jnp_dtype
        master = build.place_units(layouts, trees, pdt,
                                   build.master_sharding(mesh, plan.offload))
        opt_specs = build.opt_state_specs(tx, layouts, pdt)
        opt_state = build.init_opt_state(tx, mesh, opt_specs, master,
                                         plan.offload.units(
                                             (n, lay.n) for n, lay in layouts.items()))
        engine = Engine(adapter, tx, mesh, config, layouts, opt_specs, frozen_layouts,
                        explicit_units=units is not None and units != "auto",
                        tensor_rules=() if tp is None else tp.rules, plan=plan)
        warn_if_unbalanced(*engine.unit_table(), params)
        step = build.replicated_zero(mesh, abstract)
        placed_collections = build.place_collections(collections, mesh)
        skipped = build.replicated_zero(mesh, abstract)
        if config.stage == 3:
            frozen_shards = (build.store_frozen(frozen_layouts, frozen_trees, plan, mesh)
                             if frozen_layouts else None)
            build.check_feedback(plan, layouts, info)
            params = ShardedParams(master, True, engine.zero_feedback(abstract))
            return cls(step, params, opt_state, None, engine, skipped, frozen_shards,
                       placed_collections)
        # Stages 1 and 2: the step differentiates full replicated compute-dtype weights.
        full = build.place_units(layouts, trees, pdt, NamedSharding(mesh, REPLICATED),
                                 cast=config.compute_jnp_dtype)
        return cls(step, ShardedParams(full, False), opt_state, ShardedParams(master, True), engine,
                   skipped, None, placed_collections)
