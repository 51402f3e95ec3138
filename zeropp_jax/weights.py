"""Where a unit's weights come from and where their gradients go. Runs inside ``shard_map``.

The weights layer of DESIGN.md: one place for each technique's gather and its transpose.

* ``gather_weights``: primary shard -> full flat weights (ZeRO-3 all-gather, or qwZ's
  quantized all-gather), over ``("node", "local")``.
* ``gather_frozen``: the same for frozen weights, which may be stored pre-quantized.
* ``backward_weights`` / ``regather``: what a unit keeps for backward (the primary shard, or
  hpZ's secondary slice) and how backward rebuilds the full weights from it.
* ``reduce_gradient``: full flat gradient -> this device's slice of the mean (plain or
  hierarchical reduce-scatter, or qgZ).

Nothing here knows Flax or units; ``unit.py`` composes these.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zeropp_jax.collectives import all_gather_flat, qwz_all_gather, reduce_scatter_flat
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.frozen import all_gather_quantized, dequantize_gathered, frozen_block_size
from zeropp_jax.hpz import group_nodes, hpz_all_gather, secondary_slice
from zeropp_jax.mesh import AXES, LOCAL, NODE
from zeropp_jax.partition import UnitLayout
from zeropp_jax.qgz import hierarchical_reduce_scatter, qgz_reduce_scatter


def gather_weights(
    shard: jax.Array, config: ZeroPPConfig, *, backward: bool = False
) -> jax.Array:
    """Primary shard ``[n_pad / P]`` (param dtype) -> full flat ``[n_pad]`` (compute dtype).

    Inside ``shard_map``; an all-gather over ``("node", "local")`` (two hops, node first,
    with ``config.all_gather="hierarchical"``). ZeRO-3 carries the
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
            hierarchical=config.all_gather == "hierarchical",
        )
    return all_gather_flat(shard.astype(config.compute_jnp_dtype), AXES, distinct=backward,
                           hierarchical=config.all_gather == "hierarchical")


def gather_frozen(stored: tuple[jax.Array, ...], layout: UnitLayout, config: ZeroPPConfig, *,
                  backward: bool = False) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    """Local frozen storage -> (full flat ``[n_pad]`` compute-dtype weights, what moved).

    Inside ``shard_map``; an all-gather over ``("node", "local")``. Quantized storage moves
    as stored (int8 / uint8 values plus fp32 scales) and is dequantized on arrival; the
    second result is then the gathered ``(values, scales)``, else ``(full,)``. Param-dtype
    storage moves like a trainable unit's shard (qwZ if on).
    """
    if config.quantize_frozen:
        gathered = all_gather_quantized(*stored, AXES, distinct=backward,
                                        hierarchical=config.all_gather == "hierarchical")
        return dequantize_gathered(*gathered, config, frozen_block_size(config, layout)), gathered
    full = gather_weights(stored[0], config, backward=backward)
    return full, (full,)


def hpz_nodes(config: ZeroPPConfig) -> int:
    """Nodes per hpZ secondary group (inside ``shard_map``)."""
    return group_nodes(config.hpz_group_size, jax.lax.axis_size(NODE), jax.lax.axis_size(LOCAL))


def backward_weights(stored: tuple[jax.Array, ...], gathered: tuple[jax.Array, ...],
                     config: ZeroPPConfig) -> tuple[jax.Array, ...]:
    """What a unit keeps from forward to rebuild its weights in backward.

    ZeRO-3 / qwZ: the primary storage ``stored`` (held anyway; backward regathers over all
    devices). hpZ: this device's secondary slice ``[n / (k L)]`` of the very buffers that
    forward gathered (``gathered``; int8 values and scales for quantized frozen weights),
    so backward's regather stays inside the hpZ group.
    """
    if not config.hpz:
        return stored
    k = hpz_nodes(config)
    return tuple(secondary_slice(g, k) for g in gathered)


def regather(kept: tuple[jax.Array, ...], config: ZeroPPConfig, *, frozen: UnitLayout | None
             = None) -> jax.Array:
    """``backward_weights``' result -> the full flat compute-dtype weights, in backward.

    hpZ: an all-gather inside the group (``"local"``, plus ppermutes over ``"node"`` for
    groups of several nodes). Otherwise the forward's gather again, under distinct wire
    types so XLA cannot merge the two and keep the full weights alive in between.
    ``frozen`` is the layout when ``kept`` is frozen storage.
    """
    if config.hpz:
        parts = tuple(hpz_all_gather(w, hpz_nodes(config)) for w in kept)
        if frozen is not None and config.quantize_frozen:
            return dequantize_gathered(*parts, config, frozen_block_size(config, frozen))
        return parts[0]
    if frozen is not None:
        return gather_frozen(kept, frozen, config, backward=True)[0]
    return gather_weights(kept[0], config, backward=True)


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
