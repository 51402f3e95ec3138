"""``zero_unit``: one unit of a ZeRO-3 model as a differentiable function of its shards.

Runs inside ``shard_map``. The unit transform composes three separate choices:

* how the weights travel: the unit's ``WeightTransport`` (``comm.transports``) gathers them
  in forward and rebuilds them in backward from what it kept (the primary shard, or hpZ's
  secondary);
* what backward keeps: ``config.remat``. "minimal" (default): every activation backward
  needs, as in a plain step; "full": only the unit's inputs (a ``jax.checkpoint`` with
  nothing saved; backward recomputes the unit); or a ``jax.checkpoint`` policy. The
  gathered weights are not kept, whatever the choice: they leave the residuals here and
  backward regathers them (except with ``keep``, for the unit whose backward runs right
  after its forward);
* where the gradient goes: the run's ``GradientTransport`` (reduce-scatter or qgZ).

Forward runs the unit once under ``jax.vjp`` (of its checkpointed computation, for "full"
and policies) with the unit's weight arrays as inputs, so they appear among the pullback's
residuals as themselves; they are cut out there and replaced by what rebuilds them (the
primary shard, or hpZ's secondary). If a residual is a copy of a weight instead (a cast, a
transpose), "minimal" falls back to keeping only matmul outputs and collective results.
Backward rebuilds the weights, puts them back, and runs the saved pullback: with "minimal",
no forward matmul runs twice.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.core import compat, scopes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.comm.frozen import merge_trees
from zeropp_jax.core.mesh import AXES
from zeropp_jax.units import deferral
from zeropp_jax.units.ordering import GatherOrder, HandedOn, after
from zeropp_jax.comm.partition import UnitLayout
from zeropp_jax.comm.transports import UnitTransports, reduce_gradient

PyTree = Any

# Collectives inside a unit (Ulysses' all-to-alls, a tensor-parallel psum): "minimal" keeps
# their results, so backward never repeats communication.
_COLLECTIVES = frozenset({"all_to_all", "all_gather", "psum", "psum_scatter", "reduce_scatter",
                          "ppermute", "pmax", "pmin"})


def _minimal(prim: Any, *avals: Any, **params: Any) -> bool:
    """Save every matmul output and every collective's result."""
    return bool(compat.checkpoint_dots(prim, *avals, **params)) or prim.name in _COLLECTIVES


minimal_policy = _minimal  # matmul outputs and collective results (a jax.checkpoint policy)


def remat_policy(remat: Any) -> Callable[..., bool]:
    """``config.remat`` -> a ``jax.checkpoint`` policy (a callable passes through).

    "full": nothing saved (only the unit's inputs). "minimal": None, meaning no checkpoint:
    every activation backward needs is kept, as in a plain step, except the weights (cut
    out by identity); if a residual is a copy of a weight, ``_minimal`` (matmul outputs
    and collective results) instead."""
    if remat == "full":
        return compat.nothing_saveable
    if remat == "minimal":
        return None  # no checkpoint: backward keeps what it needs, less the weights
    return remat


@jax.tree_util.register_pytree_node_class
class _Pullback:
    """A unit's saved pullback with its full weights cut out.

    Children: the residual leaves of ``jax.vjp``'s pullback that are not weights. Static:
    the pullback's tree structure and, per leaf, either ``("kept", j)`` or ``("weights", i)``
    (the ``i``-th full weight buffer goes there).
    """

    def __init__(self, kept: tuple, treedef: Any, slots: tuple) -> None:
        self.kept, self.treedef, self.slots = kept, treedef, slots

    def tree_flatten(self) -> tuple[tuple, tuple]:
        return self.kept, (self.treedef, self.slots)

    @classmethod
    def tree_unflatten(cls, aux: tuple, kept: tuple) -> "_Pullback":
        return cls(tuple(kept), *aux)

    @classmethod
    def cut(cls, pullback: Any, weights: tuple) -> "_Pullback":
        leaves, treedef = jax.tree_util.tree_flatten(pullback)
        kept, slots = [], []
        for leaf in leaves:
            i = next((i for i, w in enumerate(weights) if leaf is w), None)
            if i is None:
                slots.append(("kept", len(kept)))
                kept.append(leaf)
            else:
                slots.append(("weights", i))
        return cls(tuple(kept), treedef, tuple(slots))

    def holds_copies_of(self, weights: tuple, min_size: int = 1024) -> bool:
        """True if a kept residual has a weight's shape (or its transpose) without being
        that weight: likely a copy (a cast or a transpose) that would keep the full
        weights alive from forward to backward. Small arrays are ignored."""
        shapes = {tuple(w.shape) for w in weights if w.size >= min_size}
        shapes |= {s[::-1] for s in shapes}
        return any(tuple(r.shape) in shapes for r in self.kept if hasattr(r, "shape"))

    def restore(self, weights: tuple) -> Callable[..., Any]:
        leaves = [self.kept[j] if kind == "kept" else weights[j] for kind, j in self.slots]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)


def _is_float_array(x: Any) -> bool:
    return isinstance(x, jax.Array) and jnp.issubdtype(x.dtype, jnp.floating)


def _token() -> jax.Array:
    """A unit's backward token (``GatherOrder.take``): a float32 zero, device-varying."""
    return varying(jnp.zeros((), jnp.float32))


def varying(x: Any) -> Any:
    """``x`` typed device-varying over ``("node", "local")``.

    A unit's array argument may be invariant (a RoPE table or float mask built from
    constants): its cotangent from the unit is per device, so the argument must enter as
    varying; autodiff then sums the cotangent over devices (``pcast``'s transpose).
    """
    vma = getattr(jax.typeof(x), "vma", None) if isinstance(x, jax.Array) else None
    if vma is None:  # not a typed array inside shard_map: nothing to mark
        return x
    missing = tuple(a for a in AXES if a not in vma)
    return jax.lax.pcast(x, missing, to="varying") if missing else x


def zero_unit(
    fn: Callable[..., Any],
    layout: UnitLayout | None,
    config: ZeroPPConfig,
    frozen_layout: UnitLayout | None = None,
    keep: bool = False,
    *,
    transports: UnitTransports,
) -> Callable[..., Any]:
    """Wraps ``fn(params_tree, *arrays)`` into ``unit(shard, frozen, *arrays)``.

    Args:
      fn: the unit's computation, a pure function of its whole parameter subtree (compute
        dtype; trainable and frozen leaves merged) and its array inputs.
      layout: flat layout of the unit's trainable part, or None if it has none.
      config: the run's settings (techniques, dtypes, ``remat``).
      frozen_layout: flat layout of the unit's frozen part, or None.
      keep: keep the forward's gathered weights for backward instead of regathering them
        (``config.keep_last_unit``: the unit called last in forward, whose backward runs
        next). Same weights bit for bit (gathers are deterministic); one all-gather less.
        The returned ``unit`` also takes ``step=`` (the traced optimizer step, for a
        gradient transport whose randomness follows it) and ``feedback=`` (this device's
        kept quantization errors, ``QgzReduceScatter.feedback_specs``): their gradient is
        the new kept errors, not a derivative. With ``feedback`` the unit returns ``(outputs,
        token)``: pass ``token`` as the ``feedback`` of the unit's next call in the step, so
        backward hands the errors from one call to the next.
      transports: how the unit's weights arrive and its gradient leaves (the plan's,
        ``Engine.transports[name]``).

    Returns:
      ``unit(shard, frozen, *arrays)`` with the outputs of ``fn``, to be called inside
      ``shard_map``: ``shard`` the local ``[layout.shard_len]`` primary shard (None without a
      trainable part), ``frozen`` the local frozen storage, ``(values, scales)`` or
      ``(values,)`` (``()`` without a frozen part). Forward gathers over ``("node",
      "local")``; backward regathers (hpZ: inside the group) and reduce-scatters. The
      gradient with respect to ``shard`` is this device's slice of the gradient averaged
      over all devices; frozen storage gets none. ``arrived=(full, *moved)``: the unit's
      trainable weights already gathered by a bucket (``units.bucket``), so forward runs
      no gather of its own and backward hands the full gradient back to the bucket as the
      cotangent of ``full`` (the bucket reduce-scatters it); the regather is unchanged.
    """
    policy = remat_policy(config.remat)
    stacked_layer = layout is not None and layout.layer is not None
    # Chosen once per run, by the plan: how the weights travel, and the gradient.
    weights, frozen_weights, grads = transports.weights, transports.frozen, transports.gradients
    # Frozen storage: as many buffers as its transport stores ((values, scales) when
    # stored quantized, else (values,)).
    n_stored = 0 if frozen_layout is None else len(
        frozen_weights.stored_specs(frozen_layout.n_pad, config.param_jnp_dtype))

    def split(full: tuple, ffull: tuple) -> tuple[tuple, tuple]:
        """Full flat buffers -> the unit's weight arrays (trainable, frozen), in leaf order.
        Outside the differentiated function, so the pullback holds the very arrays the
        unit computes with and they can be cut out by identity."""
        w = jax.tree_util.tree_leaves(layout.unflatten(full[0])) if full else []
        f = jax.tree_util.tree_leaves(frozen_layout.unflatten(ffull[0])) if ffull else []
        return tuple(w), tuple(f)

    def run(w: tuple, f: tuple, arrays: tuple) -> Any:
        tree = jax.tree_util.tree_unflatten(layout.treedef, list(w)) if w else {}
        if f:
            tree = merge_trees(tree, jax.tree_util.tree_unflatten(frozen_layout.treedef, list(f)))
        return fn(tree, *arrays)

    def flat(gw: tuple) -> tuple:
        """Weight-array gradients -> the flat ``[n_pad]`` gradient (zero padded)."""
        if not gw:
            return ()
        return (layout.flatten(jax.tree_util.tree_unflatten(layout.treedef, list(gw)),
                               gw[0].dtype),)

    # prevent_cse=False: the replay in backward runs on the regathered weights, which XLA
    # cannot identify with the forward's, so no matmul is merged away (the compiled step of
    # remat="full" recomputes them: tests/units/test_units.py), and without the barriers XLA may
    # fuse across the replay.
    def pullback_of(policy: Any, weights: tuple, frozen: tuple, arrays: tuple) -> tuple:
        f = run if policy is None else jax.checkpoint(run, policy=policy, prevent_cse=False)
        out, pullback = jax.vjp(f, weights, frozen, arrays)
        return out, _Pullback.cut(pullback, weights + frozen)

    def gather(shard: tuple, frozen: tuple, arrived: tuple) -> tuple[tuple, tuple, tuple]:
        """-> (trainable full weights, frozen full weights, what backward keeps): the full
        flat buffers themselves with ``keep``, else what rebuilds them. ``arrived``: the
        trainable weights already gathered in a bucket, ``(full, *moved)``, or ()."""
        if arrived:
            full, moved = arrived[:1], arrived[1:]
        else:
            full = tuple(weights.gather((s,))[0] for s in shard)
            moved = full  # every trainable transport moves the full buffer itself
        # A wholly frozen unit has no trainable shard (and no trainable transport).
        kept = full if keep or not shard else weights.keep(shard, moved)
        if not frozen:
            return full, (), (kept, ())
        ffull, moved = frozen_weights.gather(frozen)
        return full, (ffull,), (kept, (ffull,) if keep else frozen_weights.keep(frozen, moved))

    # Backward prefetch (``ordering.GatherOrder``): the unit hands a token on to the unit
    # called ``prefetch`` calls after it, whose backward hands a scalar made from its own
    # incoming cotangent back as the token's cotangent. Tying the regather to that scalar
    # lets it start when the later unit's backward starts; a token nobody took (the last
    # units called) leaves the regather tied to this unit's own cotangent.
    handed_on = HandedOn()

    @jax.custom_vjp
    def unit(shard: tuple, frozen: tuple, arrays: tuple, flags: dict, arrived: tuple,
             feedback: tuple, prev: tuple, pipe: tuple) -> Any:
        full, ffull, _ = gather(shard, frozen, arrived)
        return run(*split(full, ffull), arrays), feedback, _token()

    def unit_fwd(shard: tuple, frozen: tuple, arrays: tuple, flags: dict,
                 arrived: tuple, feedback: tuple, prev: tuple,
                 pipe: tuple) -> tuple[Any, tuple]:
        full, ffull, kept = gather(shard, frozen, arrived)
        w, f = split(full, ffull)
        # The pullback's residuals: what backward needs (all of it with "minimal", what the
        # policy saved plus the inputs otherwise). The weight arrays among them are dropped
        # here (ZeRO-3's memory saving) and rebuilt in backward from ``kept`` (primary
        # shards, or hpZ secondaries).
        out, pullback = pullback_of(policy, w, f, arrays)
        if policy is None and pullback.holds_copies_of(w + f):
            # A residual is a copy of a weight (a cast, a transpose: a tied head's
            # ``embedding.T``): keep only matmul outputs and collectives instead, which
            # never holds weights, and recompute the elementwise rest.
            out, pullback = pullback_of(_minimal, w, f, arrays)
        return (out, feedback, _token()), (pullback, kept, flags, len(arrived), feedback,
                                           len(prev), pipe)

    def unit_bwd(res: tuple, cotangents: Any) -> tuple:
        pullback, kept, flags, n_arrived, feedback, n_prev, pipe = res
        no_pipe = jax.tree_util.tree_map(lambda _: None, pipe)
        g, token, handed = cotangents
        no_flags = {k: None for k in flags}
        # The cotangent of the token this unit took: ready as soon as this backward starts.
        prev_ct = (after(_token(), g),) if n_prev else ()
        if keep:  # the forward's full weights, held since: nothing to gather
            full, ffull = kept
        else:
            # The regather depends on a cotangent, so it runs when backward reaches the
            # unit ``prefetch`` calls later (or this one), not at the start of the step
            # (see ordering.py). A layer of a scanned stack needs no tie: the loop runs
            # one layer's backward at a time, and the tie (on this iteration's cotangent)
            # would stop XLA's GPU pipeliner from starting the next layer's regather
            # during this one.
            start = handed if handed_on.taken else g
            trainable, frozen = kept if stacked_layer else jax.tree_util.tree_map(
                lambda w: after(w, start), kept)
            full = tuple(weights.regather((w,)) for w in trainable)
            ffull = (frozen_weights.regather(frozen),) if frozen else ()
            if handed_on.taken and not stacked_layer and policy is not None:
                # The regather now runs during a later unit's backward, and with it
                # everything that needs only the weights and the saved residuals: the
                # remat replay of this unit's forward, whose activations would then be
                # live beside the later unit's (measured: a transformers GPT-2 under remat
                # "full" on 2x4 compiled 41 KB more temporaries, two blocks' replays at
                # once, 1.23x the memory model). The residuals wait for this unit's own
                # cotangent, so only the gather moves. Without a replay (remat
                # "minimal") nothing waits on them but the cotangent itself.
                pullback = jax.tree_util.tree_map(
                    lambda r: after(r, g) if _is_float_array(r) else r, pullback)
        w, f = split(full, ffull)
        g_w, _, g_arrays = pullback.restore(w + f)(g)
        g_full = flat(g_w)
        if n_arrived:  # the bucket reduce-scatters this gradient with its other members'
            return ((None,), (None,) * n_stored, g_arrays,
                    no_flags, g_full + (None,) * (n_arrived - 1), (), prev_ct, no_pipe)
        on, step = flags.get("on"), flags.get("step")
        if pipe:
            # A scanned layer with its reduction deferred (``units.deferral``): its gradient
            # goes into the pipe, and a later layer's shard, reduced now beside this
            # layer's compute, goes out in its place (the stacked shards' backward puts
            # every shard back in its slot).
            with jax.named_scope(scopes.REDUCED):
                shard = deferral.defer(pipe[0], grads, g_full[0], config.param_jnp_dtype,
                                       on, step)
            return ((shard,), (None,) * n_stored, g_arrays, no_flags, (), (), prev_ct,
                    no_pipe)
        with jax.named_scope(scopes.REDUCED):  # marks the shards for train.axes' check
            if feedback:
                # Error feedback: the kept errors go in, the new ones come back as their
                # "cotangent" (what the train state stores next: engine.optimizer_step).
                # A unit called k times passes its errors from one call's backward to the
                # next (``token``: the cotangent of the errors this call handed on, with a
                # use count of 1 once a later call's backward has run; 0: none has, so
                # these are the step's kept errors).
                later = token[-1][0] > 0
                incoming = tuple(jnp.where(later, t.astype(k.dtype), k)
                                 for t, k in zip(token, feedback))
                shard, new_kept = reduce_gradient(grads, g_full[0], config.param_jnp_dtype,
                                                  on, step, incoming)
                return ((shard,), (None,) * n_stored, g_arrays, no_flags, (),
                        tuple(new_kept), prev_ct, no_pipe)
            g_shard = tuple(reduce_gradient(grads, gf, config.param_jnp_dtype, on, step)
                            for gf in g_full)
        return g_shard, (None,) * n_stored, g_arrays, no_flags, (), (), prev_ct, no_pipe

    unit.defvjp(unit_fwd, unit_bwd)

    def call(shard: jax.Array | None, frozen: tuple, *arrays: Any,
             qgz_on: jax.Array | None = None, step: jax.Array | None = None,
             arrived: tuple = (), feedback: tuple = (),
             order: GatherOrder | None = None, pipe: Any = None) -> Any:
        expected = None if layout is None else layout.global_shape[:-1] + (layout.shard_len,)
        if layout is not None and shard.shape != expected:
            raise ValueError(
                f"unit {layout.name!r} expects its local primary shard of shape "
                f"{expected} inside shard_map, got {shard.shape}"
            )
        if feedback and (shard is None or arrived):
            raise ValueError(f"unit {layout.name if layout else '?'!r}: error feedback needs "
                             "a trainable unit that reduce-scatters its own gradient")
        if pipe is not None and (not stacked_layer or feedback or arrived or shard is None):
            raise ValueError(f"unit {layout.name if layout else '?'!r}: a deferred gradient "
                             "reduction (pipe=) is for a scanned layer's own gradient, "
                             "without error feedback or a bucket")
        shard_t = () if shard is None else (shard,)
        flags = {k: v for k, v in (("on", qgz_on), ("step", step)) if v is not None}
        prev = order.take() if order is not None else ()
        out, token, handed = unit(shard_t, tuple(frozen), tuple(varying(a) for a in arrays),
                                  flags, tuple(arrived), tuple(feedback), prev,
                                  () if pipe is None else (pipe,))
        if order is not None:
            order.hand_on(handed, handed_on)
        return (out, token) if feedback else out

    return call
