"""The two interfaces every transport implements. Runs inside ``shard_map``.

A unit's weights live on each device as *stored* buffers: ``(values,)``, the flat primary
shard ``[n_pad / P]``, or ``(values, scales)`` for weights stored quantized. A
``WeightTransport`` says how forward turns them into the unit's full flat weights (over the
whole ``("node", "local")`` mesh), what forward keeps for backward, and how backward
rebuilds the full weights from that. A ``GradientTransport`` says how the full flat
gradient ``[n_pad]`` becomes this device's slice of the sum over devices.

Transports are frozen dataclasses: chosen once per unit from the config
(``transports.weight_transport`` / ``gradient_transport``), hashable, and asked by
everything that moves weights (the unit transform, generation) instead of branching on
the config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp

from zeropp_jax.comm.wire import TracedCollective, WireBytes, traced_collectives
from zeropp_jax.core.mesh import AXES, MeshInfo

Buffers = tuple[jax.Array, ...]


class WeightTransport(Protocol):
    """How a unit's weights arrive in forward and are rebuilt in backward."""

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        """Stored buffers -> (full flat ``[n_pad]`` compute-dtype weights, the gathered wire
        buffers). An all-gather over ``("node", "local")``. ``backward=True`` marks a
        regather so XLA cannot merge it with the forward's gather."""
        ...

    def decode(self, moved: Buffers) -> jax.Array:
        """Gathered wire buffers (``gather``'s second result) -> full flat weights."""
        ...

    def keep(self, stored: Buffers, moved: Buffers) -> Buffers:
        """What forward keeps for backward: the stored buffers, or a slice of what moved."""
        ...

    def regather(self, kept: Buffers) -> jax.Array:
        """``keep``'s result -> the full flat compute-dtype weights, in backward."""
        ...

    def stored_specs(self, n_pad: int, param_dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The global shapes and dtypes of the stored buffers of a unit of padded length
        ``n_pad`` (each split over all devices on its first dimension)."""
        ...

    def store(self, flat: Any) -> tuple[Any, ...]:
        """Host ``[n_pad]`` weights in the param dtype -> the host buffers ``stored_specs``
        describes (frozen weights are stored once, at creation)."""
        ...

    def unstore(self, stored: tuple[Any, ...]) -> Any:
        """``store``'s buffers (host, global) -> fp32 ``[n_pad]`` values."""
        ...

    # What the rest of the library asks instead of reading the config (the engine, the
    # buckets, generation, the memory and cost models). ``WeightFacts`` has the defaults of
    # a transport that moves the weights as they are.

    def label(self) -> str:
        """Its part of a run's short name (``"qwz-int8"``, ``"hpz"``); "" for ZeRO-3's."""
        ...

    def quantized_elems(self, n: int) -> float:
        """Elements one device runs through quantization kernels per gather of an
        ``n``-element unit (0 for a transport that quantizes nothing in the step)."""
        ...

    def moved_bytes(self, n_pad: int) -> float:
        """Bytes of the gathered wire buffers held beside the decoded full weights while a
        gather of a unit of padded length ``n_pad`` decodes (0 when what moved is the full
        weights)."""
        ...

    def bucketable(self) -> bool:
        """True if a unit in a bucket (``units.bucket``) gets bit for bit what it gets
        alone: element-wise, or blockwise without position-dependent steps."""
        ...

    def secondary_devices(self, mesh: MeshInfo) -> int:
        """Devices of the group backward regathers inside (hpZ's secondary partition, on
        ``mesh``); 0 when backward regathers over the whole mesh."""
        ...


class GradientTransport(Protocol):
    """How a unit's full flat gradient leaves: a reduce-scatter of its sum."""

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None,
                   step: jax.Array | None = None) -> jax.Array:
        """``[n_pad]`` gradient -> this device's ``[n_pad / P]`` slice of the sum over
        ``("node", "local")``, in fp32. ``on``: a traced bool for transports that can switch
        to a plain reduce-scatter at run time; ``step``: the traced optimizer step, for
        transports whose randomness follows it (both ignored by the others)."""
        ...

    # Asked instead of the config; ``GradientFacts`` has a plain reduce-scatter's defaults.

    def label(self) -> str:
        """Its part of a run's short name (``"qgz-int4-had"``); "" for a plain one."""
        ...

    def quantized_elems(self, n: int, mesh: MeshInfo) -> float:
        """Elements one device runs through quantization kernels per reduce-scatter of an
        ``n``-element gradient on ``mesh``."""
        ...

    def bucketable(self) -> bool:
        """True if gradients reduce-scattered in a bucket get bit for bit what they get
        alone (as ``WeightTransport.bucketable``)."""
        ...

    def switch_step(self) -> int | None:
        """The optimizer step from which ``reduce_sum(on=False)`` applies (its ``on`` is
        ``step < switch_step()``); None: ``on`` is not used."""
        ...

    def follows_step(self) -> bool:
        """True if ``reduce_sum`` needs the traced optimizer step (``step=``)."""
        ...

    def feedback_specs(self, n_pad: int, mesh: MeshInfo) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Per-device shapes of the errors kept for a unit of padded length ``n_pad``
        between steps (error feedback) on ``mesh``; ``()`` when nothing is kept."""
        ...

    def feedback_lengths(self, n_pad: int, mesh: MeshInfo) -> tuple[int, int]:
        """The fp32 lengths ``(h1, h2)`` behind ``feedback_specs`` (``(0, 0)``: none)."""
        ...

    def feedback_record(self, n: int, n_pad: int, mesh: MeshInfo) -> dict[str, Any] | None:
        """A JSON-able description of what is kept for a unit of ``n`` elements (padded
        ``n_pad``) on ``mesh``, which a checkpoint stores beside the buffers and hands back
        to ``reshard_feedback``; None when nothing is kept."""
        ...

    def reshard_feedback(self, old: dict[str, Any], old_mesh: MeshInfo, new: dict[str, Any],
                         mesh: MeshInfo) -> Callable[..., tuple[jax.Array, ...]] | None:
        """How kept buffers written on ``old_mesh`` with record ``old`` become those of
        record ``new`` on ``mesh``: None when they are the same bits, else a pure function
        of the stored global buffers (None for one not stored) -> the new global buffers.
        Raises ``ValueError`` naming the fix for a record it cannot read."""
        ...


class WeightFacts:
    """Defaults of ``WeightTransport``'s questions, for a transport that gathers the
    weights as they are."""

    def label(self) -> str:
        return ""

    def quantized_elems(self, n: int) -> float:
        return 0.0

    def moved_bytes(self, n_pad: int) -> float:
        return 0.0

    def bucketable(self) -> bool:
        return True

    def secondary_devices(self, mesh: MeshInfo) -> int:
        return 0


class GradientFacts:
    """Defaults of ``GradientTransport``'s questions, for a plain reduce-scatter."""

    def label(self) -> str:
        return ""

    def quantized_elems(self, n: int, mesh: MeshInfo) -> float:
        return 0.0

    def bucketable(self) -> bool:
        return True

    def switch_step(self) -> int | None:
        return None

    def follows_step(self) -> bool:
        return False

    def feedback_specs(self, n_pad: int, mesh: MeshInfo) -> tuple[jax.ShapeDtypeStruct, ...]:
        return ()

    def feedback_lengths(self, n_pad: int, mesh: MeshInfo) -> tuple[int, int]:
        return 0, 0

    def feedback_record(self, n: int, n_pad: int, mesh: MeshInfo) -> dict[str, Any] | None:
        return None

    def reshard_feedback(self, old: dict[str, Any], old_mesh: MeshInfo, new: dict[str, Any],
                         mesh: MeshInfo) -> Callable[..., tuple[jax.Array, ...]] | None:
        raise ValueError(f"{type(self).__name__} keeps nothing between steps")


@dataclasses.dataclass(frozen=True)
class DirectGather(WeightFacts):
    """Base of the transports that keep the stored buffers for backward and regather them
    over the whole mesh (ZeRO-3's regather; hpZ's ``SecondaryRegather`` replaces this)."""

    def keep(self, stored: Buffers, moved: Buffers) -> Buffers:
        return stored

    def regather(self, kept: Buffers) -> jax.Array:
        return self.gather(kept, backward=True)[0]  # type: ignore[attr-defined]

    def stored_specs(self, n_pad: int, param_dtype: Any) -> tuple[jax.ShapeDtypeStruct, ...]:
        """``(shard,)``: the primary shard in the param dtype."""
        return (jax.ShapeDtypeStruct((n_pad,), jnp.dtype(param_dtype)),)

    def store(self, flat: Any) -> tuple[Any, ...]:
        """Host ``[n_pad]`` weights in the param dtype -> the buffers stored (as they
        are)."""
        return (flat,)

    def unstore(self, stored: tuple[Any, ...]) -> Any:
        """``store``'s buffers (host, global) -> fp32 ``[n_pad]`` values."""
        import numpy as np

        return np.asarray(stored[0], np.float32)


def reduce_gradient(transport: GradientTransport, g_full: jax.Array, shard_dtype,
                    on: jax.Array | None = None, step: jax.Array | None = None,
                    feedback: tuple = ()) -> Any:
    """``[n_pad]`` gradient -> this device's ``[n_pad / P]`` slice of the mean over all
    ``P`` devices of ``("node", "local")``, in ``shard_dtype`` (divided in fp32).

    With ``feedback`` (this device's kept errors, for a transport with error feedback):
    ``(slice, new kept errors)``."""
    if feedback:
        summed, kept = transport.reduce_sum_feedback(  # type: ignore[attr-defined]
            g_full, feedback, on, step)
        return mean_of_sum(summed, shard_dtype), kept
    return mean_of_sum(transport.reduce_sum(g_full, on, step), shard_dtype)


def mean_of_sum(summed: jax.Array, shard_dtype: Any) -> jax.Array:
    """A slice summed over all ``P`` devices of ``("node", "local")`` -> their mean, in
    ``shard_dtype`` (divided in the sum's dtype, fp32). Inside ``shard_map``."""
    num_devices = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])
    return (summed / num_devices).astype(shard_dtype)


def weight_collectives(transport: WeightTransport, n_pad: int, param_dtype: Any,
                       mesh: MeshInfo) -> dict[str, tuple[TracedCollective, ...]]:
    """The collectives ``transport`` runs for one unit of padded length ``n_pad`` on
    ``mesh``: ``{"forward": the gather's, "backward": the regather's}``.

    Traced on an abstract mesh (``wire.traced_collectives``), so it is what the transport
    does, at any mesh size."""
    specs = transport.stored_specs(n_pad, param_dtype)

    def forward(*stored: jax.Array) -> jax.Array:
        return transport.gather(stored)[0]

    def both(*stored: jax.Array) -> jax.Array:
        _, moved = transport.gather(stored)
        return transport.regather(transport.keep(stored, moved))

    fwd = traced_collectives(forward, specs, mesh)
    # The forward gather's collectives come first in program order; the rest regather.
    return {"forward": fwd, "backward": traced_collectives(both, specs, mesh)[len(fwd):]}


def gradient_collectives(transport: GradientTransport, n_pad: int, grad_dtype: Any,
                         mesh: MeshInfo) -> tuple[TracedCollective, ...]:
    """The collectives ``transport`` runs to reduce-scatter one unit's ``[n_pad]`` gradient
    of ``grad_dtype`` on ``mesh`` (traced, as ``weight_collectives``)."""
    full = jax.ShapeDtypeStruct((n_pad * mesh.data,), jnp.dtype(grad_dtype))
    return traced_collectives(lambda g: transport.reduce_sum(g), (full,), mesh)


def _total(collectives: tuple[TracedCollective, ...]) -> WireBytes:
    return sum((c.bytes for c in collectives), WireBytes())


def weight_bytes(transport: WeightTransport, n_pad: int, param_dtype: Any,
                 mesh: MeshInfo) -> dict[str, WireBytes]:
    """What ``transport`` moves for one unit of padded length ``n_pad`` on ``mesh``:
    ``{"forward": the gather, "backward": the regather}`` (``weight_collectives``' bytes,
    summed)."""
    return {k: _total(v) for k, v in
            weight_collectives(transport, n_pad, param_dtype, mesh).items()}


def gradient_bytes(transport: GradientTransport, n_pad: int, grad_dtype: Any,
                   mesh: MeshInfo) -> WireBytes:
    """What ``transport`` moves to reduce-scatter one unit's ``[n_pad]`` gradient of
    ``grad_dtype`` on ``mesh`` (``gradient_collectives``' bytes, summed)."""
    return _total(gradient_collectives(transport, n_pad, grad_dtype, mesh))
