"""Any transport, once per tensor-parallel slice. Inside ``shard_map`` over the data axes.

With a ``"model"`` mesh axis the step is manual over ``("node", "local")`` only, and a
unit's local buffers are ``[T, n_pad / P]``: one primary shard per tensor-parallel slice,
the leading axis split over ``"model"`` by XLA. ``SlicedWeights`` and ``SlicedGradients``
run the wrapped transport inside a nested ``shard_map`` that is manual over ``"model"``
too, where each device sees its own slice's buffers (``[n_pad / P]``) and the transport's
collectives span the data axes as usual: a device gathers (and reduce-scatters) only its
own tensor-parallel slice, over the ``P`` devices that hold the same slice. Outside the
nested map the results carry the leading ``[T]`` axis again. Facts (labels, byte counts)
are the wrapped transport's, per slice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
from jax.sharding import PartitionSpec as P

from zeropp_jax.comm.transports.base import Buffers
from zeropp_jax.core.mesh import slice_axis

WHOLE = P()


def per_slice(fn: Callable[..., Any], sliced: tuple, whole: tuple = ()) -> Any:
    """``fn(*sliced_locals, *whole)`` run once per tensor-parallel slice: each array of
    ``sliced`` (``[T, ...]``, split over ``"model"``) enters as this device's slice without
    the leading axis; ``whole`` (scalars) enters as it is. Every output leaf leaves with the
    leading ``[T]`` axis. A nested ``shard_map`` manual over ``"model"``."""
    def inner(*args: Any) -> Any:
        local = [x[0] for x in args[: len(sliced)]]
        out = fn(*local, *args[len(sliced):])
        return jax.tree_util.tree_map(lambda y: y[None], out)

    mesh = jax.sharding.get_abstract_mesh()
    axis = slice_axis(mesh)
    specs = (P(axis),) * len(sliced) + (WHOLE,) * len(whole)
    return jax.shard_map(inner, mesh=mesh, in_specs=specs, out_specs=P(axis),
                         axis_names=frozenset({axis}), check_vma=False)(*sliced, *whole)


@dataclasses.dataclass(frozen=True)
class SlicedWeights:
    """``inner`` (a ``WeightTransport``) applied to each tensor-parallel slice."""

    inner: Any

    def __getattr__(self, name: str) -> Any:  # the facts: the wrapped transport's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def bucketable(self) -> bool:
        return False  # a bucket joins units' 1-D shards; slices stay per unit

    def gather(self, stored: Buffers, *, backward: bool = False) -> tuple[jax.Array, Buffers]:
        return per_slice(lambda *s: self.inner.gather(tuple(s), backward=backward),
                         tuple(stored))

    def decode(self, moved: Buffers) -> jax.Array:
        return per_slice(lambda *m: self.inner.decode(tuple(m)), tuple(moved))

    def keep(self, stored: Buffers, moved: Buffers) -> Buffers:
        n = len(stored)
        return per_slice(lambda *b: self.inner.keep(tuple(b[:n]), tuple(b[n:])),
                         tuple(stored) + tuple(moved))

    def regather(self, kept: Buffers) -> jax.Array:
        return per_slice(lambda *k: self.inner.regather(tuple(k)), tuple(kept))


@dataclasses.dataclass(frozen=True)
class SlicedGradients:
    """``inner`` (a ``GradientTransport``) applied to each tensor-parallel slice."""

    inner: Any

    def __getattr__(self, name: str) -> Any:
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def bucketable(self) -> bool:
        return False

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None,
                   step: jax.Array | None = None) -> jax.Array:
        whole = tuple(x for x in (on, step) if x is not None)

        def one(g: jax.Array, *flags: Any) -> jax.Array:
            it = iter(flags)
            return self.inner.reduce_sum(g, next(it) if on is not None else None,
                                         next(it) if step is not None else None)

        return per_slice(one, (g_full,), whole)


def unsliced(transport: Any) -> Any:
    """The transport one tensor-parallel slice runs (``transport`` itself if it is not
    sliced): what counts one slice's bytes on a ``("node", "local")`` mesh."""
    return transport.inner if isinstance(transport, (SlicedWeights, SlicedGradients)) else transport
