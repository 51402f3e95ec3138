"""`zero_unit`: the custom_vjp around one unit of a ZeRO-3 model. Runs inside ``shard_map``.

Forward: gather the unit's flat weights from the primary shards (all devices; compute dtype,
or qwZ's quantized blocks), run the unit. Saved for backward: the unit's inputs and either
the primary shard (ZeRO-3) or hpZ's secondary slice of the weights just used — never the
full gathered weights. Backward: regather (over all devices, or with hpZ inside the node),
recompute the unit under ``jax.vjp``, and reduce-scatter the flat weight gradient (plain, or
qgZ's quantized two-hop all-to-all) back to a primary-shard gradient, averaged over devices.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator

import jax
import jax.numpy as jnp

from zeropp_jax.collectives import all_gather_flat, qwz_all_gather, reduce_scatter_flat
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.hpz import group_nodes, hpz_all_gather, secondary_slice
from zeropp_jax.mesh import AXES, LOCAL, NODE
from zeropp_jax.partition import UnitLayout
from zeropp_jax.qgz import hierarchical_reduce_scatter, qgz_reduce_scatter

PyTree = Any

# While a train step is traced: a traced bool, True while qgZ is on (config.qgz_until).
_QGZ_ON: contextvars.ContextVar = contextvars.ContextVar("zeropp_qgz_on", default=None)


@contextlib.contextmanager
def qgz_schedule(qgz_on: jax.Array | None) -> Iterator[None]:
    """Within this context, units choose qgZ or a full-precision reduce-scatter by the
    traced bool ``qgz_on`` (one compiled program serves both phases of the run)."""
    token = _QGZ_ON.set(qgz_on)
    try:
        yield
    finally:
        _QGZ_ON.reset(token)


def gather_weights(
    shard: jax.Array, config: ZeroPPConfig, *, backward: bool = False
) -> jax.Array:
    """Primary shard ``[n_pad / P]`` (param dtype) -> full flat ``[n_pad]`` (compute dtype).

    Inside ``shard_map``; an all-gather over ``("node", "local")``. ZeRO-3 carries the
    compute dtype (as same-width integers); with qwZ, block-quantized values plus fp32
    scales (the fp32 shard is quantized directly: one rounding, not two). ``backward=True``
    marks the regather so XLA keeps it apart from the forward gather. Quantization is
    deterministic, so forward and backward see identical weights.
    """
    if config.qwz:
        return qwz_all_gather(
            shard,
            axis_names=AXES,
            bits=config.weight_bits,
            block_size=config.block_size if config.blockwise else shard.shape[0],
            out_dtype=config.compute_jnp_dtype,
            implementation=config.quantization_impl,
            distinct=backward,
        )
    return all_gather_flat(shard.astype(config.compute_jnp_dtype), AXES, distinct=backward)


def reduce_gradient(
    g_full: jax.Array,
    shard_dtype: Any,
    config: ZeroPPConfig | None = None,
    qgz_on: jax.Array | None = None,
) -> jax.Array:
    """Flat weight gradient ``[n_pad]`` -> this device's ``[n_pad / P]`` slice of the mean.

    Inside ``shard_map``. ZeRO-3: a reduce-scatter over ``("node", "local")`` in
    ``g_full``'s dtype (the compute dtype). With ``config.qgz``: qgZ's two all-to-all hops
    (``"local"``, then ``"node"``) carrying INT4 blocks; if ``qgz_on`` (a traced bool) is
    given, ``lax.cond`` picks qgZ or the plain reduce-scatter at run time. Divided by the
    device count in fp32 afterwards.
    """
    num_devices = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])

    def plain(g: jax.Array) -> jax.Array:
        if config is not None and config.reduce_scatter == "hierarchical":
            return hierarchical_reduce_scatter(g)
        return reduce_scatter_flat(g, AXES).astype(jnp.float32)

    if config is None or not config.qgz:
        summed = plain(g_full)
    else:

        def quantized(g: jax.Array) -> jax.Array:
            # Non-blocked: one scale per stage of a destination slice (its whole message).
            block = config.block_size if config.blockwise else (
                g.shape[0] // num_devices // config.qgz_pipeline_stages)
            return qgz_reduce_scatter(
                g,
                bits=config.grad_bits,
                block_size=block,
                stages=config.qgz_pipeline_stages,
                implementation=config.quantization_impl,
            )

        summed = quantized(g_full) if qgz_on is None else jax.lax.cond(
            qgz_on, quantized, plain, g_full
        )
    return (summed / num_devices).astype(shard_dtype)


def zero_unit(
    fn: Callable[..., Any], layout: UnitLayout, config: ZeroPPConfig
) -> Callable[..., Any]:
    """Wraps ``fn(params_tree, *arrays)`` into ``unit(primary_shard, *arrays)``.

    Args:
      fn: the unit's computation, a pure function of its parameter subtree (in the compute
        dtype) and array inputs.
      layout: the unit's flat layout.
      config: the run's settings (compute dtype).

    Returns:
      ``unit(shard, *arrays)`` with the outputs of ``fn``. To be called inside ``shard_map``
      with ``shard`` the local ``[layout.shard_len]`` primary shard. Its gradient with
      respect to ``shard`` is this device's slice of the gradient averaged over all devices.
    """

    def run(full: jax.Array, arrays: tuple) -> Any:
        return fn(layout.unflatten(full), *arrays)

    @jax.custom_vjp
    def unit(shard: jax.Array, arrays: tuple, flags: tuple) -> Any:
        return run(gather_weights(shard, config), arrays)

    grad_dtype = config.param_jnp_dtype

    def hpz_k() -> int:
        return group_nodes(
            config.hpz_group_size, jax.lax.axis_size(NODE), jax.lax.axis_size(LOCAL)
        )

    def unit_fwd(shard: jax.Array, arrays: tuple, flags: tuple) -> tuple[Any, tuple]:
        full = gather_weights(shard, config)
        out = run(full, arrays)
        # Residuals: the unit's inputs, and either the primary shard (held anyway; ZeRO-3
        # regathers across all devices) or, with hpZ, this device's secondary slice of the
        # very weights just used (dequantized, if qwZ is on). The full gathered weights are
        # dropped here in both cases; that is ZeRO-3's memory saving.
        if config.hpz:
            return out, (secondary_slice(full, hpz_k()), arrays, flags)
        return out, (shard, arrays, flags)

    def unit_bwd(res: tuple, g: Any) -> tuple[jax.Array, tuple, tuple]:
        weights, arrays, flags = res
        # Tie the regather to the incoming cotangent: without the barrier XLA's CSE merges it
        # with the forward gather and keeps the full weights alive from forward to backward.
        weights, arrays, g = jax.lax.optimization_barrier((weights, arrays, g))
        if config.hpz:
            full = hpz_all_gather(weights, hpz_k())
        else:
            full = gather_weights(weights, config, backward=True)
        _, vjp = jax.vjp(run, full, arrays)
        g_full, g_arrays = vjp(g)
        qgz_on = flags[0] if flags else None
        flag_cts = tuple(None for _ in flags)  # a bool schedule has no cotangent
        return reduce_gradient(g_full, grad_dtype, config, qgz_on), g_arrays, flag_cts

    unit.defvjp(unit_fwd, unit_bwd)

    def call(shard: jax.Array, *arrays: Any) -> Any:
        if shard.shape != (layout.shard_len,):
            raise ValueError(
                f"unit {layout.name!r} expects its local primary shard of shape "
                f"({layout.shard_len},) inside shard_map, got {shard.shape}"
            )
        qgz_on = _QGZ_ON.get() if (config.qgz and config.qgz_until is not None) else None
        return unit(shard, tuple(arrays), () if qgz_on is None else (qgz_on,))

    return call


def frozen_zero_unit(
    fn: Callable[..., Any],
    layout: UnitLayout | None,
    frozen_layout: UnitLayout,
    config: ZeroPPConfig,
) -> Callable[..., Any]:
    """``zero_unit`` for a unit with a frozen part: ``unit(shard, frozen, *arrays)``.

    Args:
      fn: the unit's computation on its whole parameter subtree (trainable and frozen
        leaves merged, compute dtype) and array inputs.
      layout: flat layout of the unit's trainable part, or None if all of it is frozen.
      frozen_layout: flat layout of the frozen part.
      config: the run's settings (``quantize_frozen``, ``hpz``, dtypes).

    Returns:
      ``unit(shard, frozen, *arrays)``, to be called inside ``shard_map``: ``shard`` the
      local trainable primary shard (None without a trainable part), ``frozen`` the local
      frozen storage ``(values, scales)`` (quantized) or ``(values,)``. Forward gathers both
      over ``("node", "local")`` — quantized frozen values as stored, no quantization.
      Backward regathers both (hpZ: inside the node, the frozen part from an int8 secondary
      when quantized), recomputes, and reduce-scatters the gradient of the trainable part
      only; the frozen storage gets no cotangent.
    """
    from zeropp_jax.frozen import (
        all_gather_quantized,
        dequantize_gathered,
        frozen_block_size,
        gather_frozen,
        merge_trees,
    )

    quantized = config.quantize_frozen
    block = frozen_block_size(config, frozen_layout)

    def run(full: tuple, ffull: jax.Array, arrays: tuple) -> Any:
        tree = layout.unflatten(full[0]) if full else {}
        return fn(merge_trees(tree, frozen_layout.unflatten(ffull)), *arrays)

    def hpz_k() -> int:
        return group_nodes(
            config.hpz_group_size, jax.lax.axis_size(NODE), jax.lax.axis_size(LOCAL)
        )

    def forward(shard: tuple, frozen: tuple) -> tuple[tuple, jax.Array, tuple]:
        """-> (trainable full weights, frozen full weights, frozen gathered storage)."""
        full = tuple(gather_weights(s, config) for s in shard)
        if quantized:
            gathered = all_gather_quantized(*frozen, AXES)
            return full, dequantize_gathered(*gathered, config, block), gathered
        ffull = gather_frozen(frozen, frozen_layout, config)
        return full, ffull, (ffull,)

    @jax.custom_vjp
    def unit(shard: tuple, frozen: tuple, arrays: tuple, flags: tuple) -> Any:
        full, ffull, _ = forward(shard, frozen)
        return run(full, ffull, arrays)

    def unit_fwd(shard: tuple, frozen: tuple, arrays: tuple, flags: tuple) -> tuple[Any, tuple]:
        full, ffull, gathered = forward(shard, frozen)
        out = run(full, ffull, arrays)
        if config.hpz:
            k = hpz_k()
            # Quantized frozen weights keep an int8 secondary (values and scales sliced at
            # block boundaries: n_pad / (k L) is a multiple of the block), half the bytes of
            # a bf16 one; the backward gather inside the node then moves int8 too.
            weights = tuple(secondary_slice(f, k) for f in full)
            fweights = tuple(secondary_slice(g, k) for g in gathered)
        else:
            weights, fweights = shard, frozen
        return out, (weights, fweights, arrays, flags)

    def unit_bwd(res: tuple, g: Any) -> tuple:
        weights, fweights, arrays, flags = res
        weights, fweights, arrays, g = jax.lax.optimization_barrier((weights, fweights, arrays, g))
        if config.hpz:
            k = hpz_k()
            full = tuple(hpz_all_gather(w, k) for w in weights)
            fparts = tuple(hpz_all_gather(w, k) for w in fweights)
            ffull = dequantize_gathered(*fparts, config, block) if quantized else fparts[0]
        else:
            full = tuple(gather_weights(w, config, backward=True) for w in weights)
            ffull = gather_frozen(fweights, frozen_layout, config, backward=True)
        _, vjp = jax.vjp(lambda f, a: run(f, ffull, a), full, arrays)
        g_full, g_arrays = vjp(g)
        qgz_on = flags[0] if flags else None
        g_shard = tuple(reduce_gradient(gf, config.param_jnp_dtype, config, qgz_on)
                        for gf in g_full)
        return g_shard, tuple(None for _ in fweights), g_arrays, tuple(None for _ in flags)

    unit.defvjp(unit_fwd, unit_bwd)

    def call(shard: jax.Array | None, frozen: tuple, *arrays: Any) -> Any:
        if layout is not None and shard.shape != (layout.shard_len,):
            raise ValueError(
                f"unit {layout.name!r} expects its local primary shard of shape "
                f"({layout.shard_len},) inside shard_map, got {shard.shape}"
            )
        qgz_on = _QGZ_ON.get() if (config.qgz and config.qgz_until is not None) else None
        shard_t = () if shard is None else (shard,)
        return unit(shard_t, tuple(frozen), tuple(arrays), () if qgz_on is None else (qgz_on,))

    return call
