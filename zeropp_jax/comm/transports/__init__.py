"""Transports: how a unit's weights arrive and how its gradient leaves. Inside ``shard_map``.

One file per way bytes travel; the config picks one weight transport per unit kind
(trainable, frozen) and one gradient transport, here, once. Everything that moves weights
asks the transport it was given; nothing else branches on ``config.qwz`` / ``hpz`` / ``qgz``.

Weights (``base.WeightTransport``):
  ``plain``             ZeRO-3: the shard in the compute dtype, all-gathered.
  ``qwz``               qwZ: block-quantized INT8/INT4 values plus scales on the wire
                        (optionally Hadamard-rotated blocks).
  ``fp8``               qwZ with block-scaled FP8 (e4m3) values plus scales.
  ``stored_quantized``  frozen weights stored quantized: moved as stored, dequantized after.
  ``hpz``               wraps one of the above: backward regathers inside the node group.
Gradients (``base.GradientTransport``):
  ``flat``              one reduce-scatter over all devices.
  ``hierarchical``      two hops (inside the node, then across), unquantized.
  ``qgz``               two hops carrying quantized blocks (optionally switched at run time,
                        Hadamard-smoothed, rounded stochastically).

Adding a transport: a file with a frozen dataclass implementing the interface and a
``from_config``, and one entry in ``WEIGHTS``, ``FROZEN`` or ``GRADIENTS`` below.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from zeropp_jax.comm.transports import fp8, hpz, plain, qgz, qwz, reduce_scatter, stored_quantized
from zeropp_jax.comm.transports import hierarchical_reduce_scatter as hierarchical
from zeropp_jax.comm.transports.base import (
    GradientTransport,
    WeightTransport,
    reduce_gradient,
)

# Trainable weights, by ``weight_format(config)``.
WEIGHTS: dict[str, Callable[[Any], WeightTransport]] = {
    "plain": plain.PlainGather.from_config,
    "qwz": qwz.QwzGather.from_config,
    "fp8": fp8.Fp8Gather.from_config,
}
# Frozen weights stored in another form than the param dtype, by ``frozen_format(config)``
# (frozen weights stored in the param dtype travel like trainable ones).
FROZEN: dict[str, Callable[[Any, Any], WeightTransport]] = {
    "stored_quantized": stored_quantized.StoredQuantizedGather.from_config,
}
GRADIENTS: dict[str, Callable[[Any], GradientTransport]] = {
    "flat": reduce_scatter.FlatReduceScatter.from_config,
    "hierarchical": hierarchical.HierarchicalReduceScatter.from_config,
}


def weight_format(config: Any) -> str:
    """The ``WEIGHTS`` entry of the config: plain without qwZ; with it, by
    ``config.weight_format`` (INT8 and INT4 are qwZ's, FP8 its own)."""
    if not config.qwz:
        return "plain"
    return "fp8" if config.weight_format == "fp8" else "qwz"


def frozen_format(config: Any) -> str | None:
    return "stored_quantized" if config.quantize_frozen else None


def value_transport(config: Any, frozen_layout: Any = None) -> WeightTransport:
    """How a unit's trainable weights (or, with ``frozen_layout``, its frozen ones) travel
    in forward, before any hpZ wrapping."""
    fmt = frozen_format(config) if frozen_layout is not None else None
    if fmt is not None:
        return FROZEN[fmt](config, frozen_layout)
    return WEIGHTS[weight_format(config)](config)


def weight_transport(config: Any, frozen_layout: Any = None) -> WeightTransport:
    """The run's transport for a unit's trainable weights, or its frozen ones: the value
    transport, wrapped by hpZ's secondary regather when ``config.hpz``."""
    inner = value_transport(config, frozen_layout)
    return hpz.wrap(inner, config) if config.hpz else inner


def gradient_transport(config: Any) -> GradientTransport:
    """The run's gradient reduce-scatter: qgZ (falling back to the configured plain one
    when switched off at run time), or the flat or hierarchical reduce-scatter."""
    plain_rs = GRADIENTS[config.reduce_scatter](config)
    if not config.qgz:
        return plain_rs
    return qgz.QgzReduceScatter(
        config.grad_bits, config.block_size if config.blockwise else None,
        config.qgz_pipeline_stages, config.quantization_impl, plain_rs,
        hadamard=config.qgz_hadamard, stochastic_rounding=config.stochastic_rounding,
        per_step_signs=config.qgz_signs == "per_step",
        error_feedback=config.qgz_error_feedback)


@dataclasses.dataclass(frozen=True)
class UnitTransports:
    """How one unit's bytes travel for the whole run; the plan holds one per unit.

    Attributes:
      weights: its trainable part's transport (hpZ-wrapped when configured), or None if
        the unit has no trainable part.
      frozen: its frozen part's transport, or None if it has none.
      gradients: how its trainable part's gradient leaves.
    """

    weights: WeightTransport | None
    frozen: WeightTransport | None
    gradients: GradientTransport


def unit_transports(config: Any, layout: Any = None, frozen_layout: Any = None
                    ) -> UnitTransports:
    """The transports of a unit with trainable part ``layout`` and frozen part
    ``frozen_layout`` (either may be None)."""
    return UnitTransports(
        None if layout is None else weight_transport(config),
        None if frozen_layout is None else weight_transport(config, frozen_layout),
        gradient_transport(config))


def plan_transports(config: Any, layouts: Mapping[str, Any],
                    frozen_layouts: Mapping[str, Any]) -> dict[str, UnitTransports]:
    """Unit name -> its transports, for every unit of a run (trainable, frozen or both)."""
    return {name: unit_transports(config, layouts.get(name), frozen_layouts.get(name))
            for name in (*layouts, *(n for n in frozen_layouts if n not in layouts))}


__all__ = [
    "FROZEN",
    "GRADIENTS",
    "GradientTransport",
    "WEIGHTS",
    "WeightTransport",
    "frozen_format",
    "UnitTransports",
    "gradient_transport",
    "plan_transports",
    "unit_transports",
    "reduce_gradient",
    "value_transport",
    "weight_format",
    "weight_transport",
]
