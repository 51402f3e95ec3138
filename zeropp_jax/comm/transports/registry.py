"""The registry: which transport a config's settings name. Adding a wire format is a file
beside this one and one entry here: ``WEIGHTS["<kind><bits>"] = <its from_config>``; the
config takes the name as it is (its bits read from it)."""

from __future__ import annotations

from typing import Any, Callable

from zeropp_jax.comm.transports import fp8, hpz, plain, qgz, qwz, reduce_scatter, stored_quantized
from zeropp_jax.comm.transports import hierarchical_reduce_scatter as hierarchical
from zeropp_jax.comm.transports.base import GradientTransport, WeightTransport

# Trainable weights, by ``weight_format(config)``: "plain" without qwZ, else the config's
# ``weight_format``, a name ending in its bits per value (the config reads them from it).
WEIGHTS: dict[str, Callable[[Any], WeightTransport]] = {
    "plain": plain.PlainGather.from_config,
    "int8": qwz.QwzGather.from_config,
    "int4": qwz.QwzGather.from_config,
    "fp8": fp8.Fp8Gather.from_config,
}
# Frozen weights stored in another form than the param dtype, by ``frozen_format(config)``
# (frozen weights stored in the param dtype travel like trainable ones): classes with
# ``from_config(config, layout)`` and ``alignment(config)``.
FROZEN: dict[str, Any] = {
    "stored_quantized": stored_quantized.StoredQuantizedGather,
}
# Gradients, by ``gradient_format(config)``. The unquantized reduce-scatters first: qgZ
# falls back to the configured one when switched off at run time (``qgz_until``).
GRADIENTS: dict[str, Callable[[Any], GradientTransport]] = {
    "flat": reduce_scatter.FlatReduceScatter.from_config,
    "hierarchical": hierarchical.HierarchicalReduceScatter.from_config,
}
GRADIENTS["qgz"] = lambda config: qgz.QgzReduceScatter.from_config(
    config, GRADIENTS[config.reduce_scatter](config))


def weight_format(config: Any) -> str:
    """The ``WEIGHTS`` entry of the config: plain without qwZ; with it,
    ``config.weight_format``. Raises naming the registered formats for one without a
    transport."""
    if not config.qwz:
        return "plain"
    fmt = config.weight_format
    if fmt == "plain" or fmt not in WEIGHTS:
        known = ", ".join(repr(f) for f in WEIGHTS if f != "plain")
        raise ValueError(f"weight_format={fmt!r} has no transport; the registered wire "
                         f"formats are {known} (comm/transports/registry.py)")
    return fmt


def frozen_format(config: Any) -> str | None:
    """The ``FROZEN`` entry of the config, or None: frozen weights travel as trainable."""
    return "stored_quantized" if config.quantize_frozen else None


def frozen_alignment(config: Any) -> int:
    """Each frozen primary shard's length is a multiple of this: the frozen storage's, or
    the trainable weights' (``config.flat_alignment``) when frozen weights travel alike."""
    fmt = frozen_format(config)
    return FROZEN[fmt].alignment(config) if fmt is not None else config.flat_alignment


def gradient_format(config: Any) -> str:
    """The ``GRADIENTS`` entry of the config: qgZ, or the unquantized reduce-scatter."""
    return "qgz" if config.qgz else config.reduce_scatter


def value_transport(config: Any, frozen_layout: Any = None) -> WeightTransport:
    """How a unit's trainable weights (or, with ``frozen_layout``, its frozen ones) travel
    in forward, before any hpZ wrapping."""
    fmt = frozen_format(config) if frozen_layout is not None else None
    if fmt is not None:
        return FROZEN[fmt].from_config(config, frozen_layout)
    return WEIGHTS[weight_format(config)](config)


def weight_transport(config: Any, frozen_layout: Any = None) -> WeightTransport:
    """The run's transport for a unit's trainable weights, or its frozen ones: the value
    transport, wrapped by hpZ's secondary regather when ``config.hpz``."""
    inner = value_transport(config, frozen_layout)
    return hpz.wrap(inner, config) if config.hpz else inner


def gradient_transport(config: Any) -> GradientTransport:
    """The run's gradient reduce-scatter (``GRADIENTS[gradient_format(config)]``)."""
    return GRADIENTS[gradient_format(config)](config)
