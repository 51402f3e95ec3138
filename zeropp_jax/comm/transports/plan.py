"""The plan: how a run's bytes travel, resolved once from its config.

Everything outside the transports asks the plan (or the transports it holds) what the
techniques mean for it — the engine (which transports each unit gets, what the step
needs), the buckets (may units share collectives), generation (does backward regather
inside a group), the comm report and the memory and cost models (hpZ's group, quantization
work, kept errors, the run's name) — instead of reading ``config.qwz`` / ``hpz`` / ``qgz``
and their options.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

from zeropp_jax.comm.offload import OffloadPolicy
from zeropp_jax.comm.transports.hpz import secondary_of
from zeropp_jax.comm.transports.reduce_scatter import FlatReduceScatter
from zeropp_jax.comm.transports.sliced import SlicedGradients, SlicedWeights
from zeropp_jax.comm.transports.base import GradientTransport, WeightTransport
from zeropp_jax.core.mesh import MeshInfo
from zeropp_jax.comm.transports.registry import (
    frozen_alignment,
    gradient_transport,
    weight_transport,
)


@dataclasses.dataclass(frozen=True)
class UnitTransports:
    """How one unit's bytes travel for the whole run; the plan gives one per unit.

    Attributes:
      weights: its trainable part's transport (hpZ-wrapped when configured), or None if
        the unit has no trainable part.
      frozen: its frozen part's transport, or None if it has none.
      gradients: how its trainable part's gradient leaves.
    """

    weights: WeightTransport | None
    frozen: WeightTransport | None
    gradients: GradientTransport


@dataclasses.dataclass(frozen=True)
class TransportPlan:
    """A run's transports and what they imply. Frozen and hashable; ``plan_of(config)``.

    Attributes:
      config: the ``ZeroPPConfig`` it was resolved from (frozen parts' transports depend
        on each frozen layout, so they are resolved per unit from it).
      weights: how trainable weights travel (hpZ-wrapped when configured).
      gradients: how gradients leave.
      offload: what lives in host memory between steps (``comm.offload``).
    """

    config: Any
    weights: WeightTransport
    gradients: GradientTransport
    offload: OffloadPolicy = OffloadPolicy()

    def unit(self, layout: Any = None, frozen_layout: Any = None) -> UnitTransports:
        """The transports of a unit with trainable part ``layout`` and frozen part
        ``frozen_layout`` (either may be None)."""
        return UnitTransports(
            None if layout is None else self.weights,
            None if frozen_layout is None else weight_transport(self.config, frozen_layout),
            self.gradients)

    def units(self, layouts: Mapping[str, Any], frozen_layouts: Mapping[str, Any]
              ) -> dict[str, UnitTransports]:
        """Unit name -> its transports, for every unit of a run (trainable, frozen or
        both). A unit laid out in tensor-parallel slices (``layout.tp > 1``) gets them
        once per slice (``sliced.SlicedWeights`` / ``SlicedGradients``)."""
        out = {}
        for name in (*layouts, *(n for n in frozen_layouts if n not in layouts)):
            t = self.unit(layouts.get(name), frozen_layouts.get(name))
            if getattr(layouts.get(name), "tp", 1) > 1:
                t = UnitTransports(SlicedWeights(t.weights), t.frozen,
                                   SlicedGradients(t.gradients))
            if getattr(frozen_layouts.get(name), "tp", 1) > 1:
                t = UnitTransports(t.weights, SlicedWeights(t.frozen), t.gradients)
            out[name] = t
        return out

    def secondary(self, transport: WeightTransport) -> WeightTransport:
        """``transport`` rebuilding from a secondary partition: itself with hpZ on (its
        configured group), else wrapped to rebuild from one inside the node. Generation
        reads every unit this way, whether training used hpZ or not."""
        return secondary_of(transport)

    def replicated_gradients(self) -> GradientTransport:
        """How stages 1 and 2 reduce-scatter the gradients of replicated weights: one flat
        reduce-scatter over all devices."""
        return FlatReduceScatter()

    def frozen_alignment(self) -> int:
        """Each frozen primary shard's length is a multiple of this."""
        return frozen_alignment(self.config)

    def store_frozen(self, flat: Any, layout: Any) -> tuple[Any, ...]:
        """A frozen part's host ``[n_pad]`` weights (param dtype) -> the buffers it is
        stored in (``(values,)``, or ``(values, scales)`` stored quantized)."""
        return self.unit(None, layout).frozen.store(flat)

    def unstore_frozen(self, stored: tuple[Any, ...], layout: Any) -> Any:
        """``store_frozen``'s buffers (host, global) -> fp32 ``[n_pad]`` values."""
        return self.unit(None, layout).frozen.unstore(stored)

    def label(self) -> str:
        """A short name: ``zero3``, or the techniques on (``qwz-int4+hpz[16]+qgz-int4-had``,
        ``+EF`` for kept errors), ``+offload`` with the optimizer state in host memory
        (``+offload0.5`` for half of it), `` unbucketed`` with buckets turned off."""
        offload = self.offload.label()
        name = "+".join(p for p in (self.weights.label(), self.gradients.label()) if p)
        name = "+".join(p for p in (name or "zero3", offload) if p)
        return name + ("" if self.config.bucket else " unbucketed")

    def buckets(self) -> bool:
        """True if units may share collectives (``units.bucket``): buckets on
        (``config.bucket``) and both transports give a unit in a bucket what it gets
        alone."""
        return (self.config.bucket and self.weights.bucketable()
                and self.gradients.bucketable())

    def secondary_devices(self, mesh: MeshInfo) -> int:
        """Devices in the group backward regathers trainable weights inside (hpZ), on
        ``mesh``; 0 when it regathers over the whole mesh. Raises naming the valid group
        sizes when the mesh cannot hold the configured group."""
        return self.weights.secondary_devices(mesh)

    def feedback(self, n_pad: int, mesh: MeshInfo) -> tuple[int, int, int]:
        """What one device keeps between steps for a trainable unit of padded length
        ``n_pad`` on ``mesh``: (stored bytes, ``h1``, ``h2``), the gradient transport's
        kept errors (``feedback_specs``, ``feedback_lengths``); all 0 when nothing is
        kept."""
        specs = self.gradients.feedback_specs(n_pad, mesh)
        h1, h2 = self.gradients.feedback_lengths(n_pad, mesh)
        return sum(math.prod(s.shape) * s.dtype.itemsize for s in specs), h1, h2

    def quantized_elems(self, n: int, n_pad: int, gathers: int, reduced: bool,
                        mesh: MeshInfo) -> tuple[float, float]:
        """Elements one device runs through quantization kernels for one unit of ``n``
        elements (padded ``n_pad``) per step, (weight path, gradient path): ``gathers``
        gathers, and its gradient's reduce-scatter if ``reduced``, with kept errors decoded
        and the new ones encoded once each (``2 (h1 + h2)``)."""
        weights = gathers * self.weights.quantized_elems(n)
        grads = 0.0
        if reduced:
            _, h1, h2 = self.feedback(n_pad, mesh)
            grads = self.gradients.quantized_elems(n, mesh) + 2 * (h1 + h2)
        return weights, grads


def plan_of(config: Any) -> TransportPlan:
    """The plan of ``config`` (a ``ZeroPPConfig``), resolved from the registry. Cheap (a
    few small dataclasses), so it is not cached: nothing global holds configs."""
    return TransportPlan(config, weight_transport(config), gradient_transport(config),
                         OffloadPolicy.of(config))
