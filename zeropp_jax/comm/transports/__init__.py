"""Transports: how a unit's weights arrive and how its gradient leaves. Inside ``shard_map``.

One file per way bytes travel; the config picks one weight transport per unit kind
(trainable, frozen) and one gradient transport, once (``registry.py``). Everything that
moves weights asks the transport it was given; nothing else branches on ``config.qwz`` /
``hpz`` / ``qgz``.

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

A run's transports are resolved once from its config into a ``TransportPlan`` (``plan.py``): the
one object the engine, the buckets, generation, the comm report and the memory and cost
models ask (its label, whether units can share collectives, hpZ's group, quantization
work, kept errors).

Adding a transport: a file with a frozen dataclass implementing the interface (the facts
``base.WeightFacts`` / ``GradientFacts`` default) and a ``from_config``, and one entry in
``WEIGHTS``, ``FROZEN`` or ``GRADIENTS`` in ``registry.py``. A weight format's entry is its
name, its kind and its bits per value (``"int8"``, ``"fp8"``): the config takes that name
as ``weight_format`` without a list of its own.
"""


from zeropp_jax.comm.transports.base import (
    GradientTransport,
    WeightTransport,
    gradient_bytes,
    mean_of_sum,
    reduce_gradient,
    weight_bytes,
)
from zeropp_jax.comm.transports.plan import TransportPlan, UnitTransports, plan_of
from zeropp_jax.comm.transports.registry import (
    FROZEN,
    GRADIENTS,
    WEIGHTS,
    frozen_alignment,
    frozen_format,
    gradient_format,
    gradient_transport,
    weight_format,
    weight_transport,
)
from zeropp_jax.comm.transports.sliced import unsliced


__all__ = [
    "FROZEN",
    "GRADIENTS",
    "GradientTransport",
    "TransportPlan",
    "WEIGHTS",
    "WeightTransport",
    "frozen_alignment",
    "frozen_format",
    "UnitTransports",
    "gradient_bytes",
    "gradient_format",
    "gradient_transport",
    "plan_of",
    "mean_of_sum",
    "reduce_gradient",
    "unsliced",
    "weight_bytes",
    "weight_format",
    "weight_transport",
]
