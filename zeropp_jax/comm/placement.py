"""Where arrays live: primary shards and replicated values on the ("node", "local") mesh.

``ShardedParams`` is a model's parameters as one flat buffer per unit; ``place`` puts host
values onto the mesh (each process only its own devices' pieces), ``to_host`` brings global
values back; ``global_norm`` is the L2 norm of sharded leaves (a ``psum`` over the mesh).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeropp_jax.core import scopes
from zeropp_jax.core.dtypes import accumulation_dtype
from zeropp_jax.core.mesh import AXES, MODEL, slice_axis

PyTree = Any


SHARDED = P(AXES)
REPLICATED = P()
# A tensor-parallel unit's global ``[T, n_pad]`` buffer: slices over "model", each slice's
# primary shards over the data axes (``sliced_sharded`` for any mesh's inner axis).
SLICED_SHARDED = P(MODEL, AXES)


def sliced_sharded(mesh: Any) -> P:
    """A sliced unit's global ``[T, n_pad]`` buffer on ``mesh``: slices over its inner axis
    (``"model"`` or ``"expert"``), each slice's primary shards over the data axes."""
    return P(slice_axis(mesh), AXES)


def sharded_spec(ndim: int) -> P:
    """How a step (manual over the data axes) takes a primary-shard buffer of ``ndim``
    dimensions: the last split over ``("node", "local")``, a leading tensor-parallel
    axis left to XLA."""
    return SHARDED if ndim <= 1 else P(*([None] * (ndim - 1)), AXES)


def global_spec(spec: P, mesh: Any) -> P:
    """The global ``PartitionSpec`` of a buffer a step takes with ``spec`` (its in/out
    spec, manual over the data axes): a leading tensor-parallel axis (``sharded_spec`` of a
    2-D buffer) is split over ``"model"`` on a mesh that has one."""
    if slice_axis(mesh) and len(spec) == 2 and spec[0] is None and spec[1] == AXES:
        return sliced_sharded(mesh)
    return spec


def pin_slices(out: Any, specs: Any, mesh: Any) -> Any:
    """``out`` (the global result of a ``shard_map`` manual over the data axes, with
    out_specs ``specs``, a tree prefix of it) with every tensor-parallel buffer (spec
    ``sharded_spec(2)``) constrained to stay split over ``"model"``, as the state came in:
    XLA would be free to replicate the axis it partitions. Inside ``jit``; ``out`` as it
    is on a mesh without a ``"model"`` axis."""
    if not slice_axis(mesh):
        return out

    def pin(spec: P, x: Any) -> Any:
        wanted = global_spec(spec, mesh)
        if wanted == spec:
            return x
        return jax.tree_util.tree_map(
            lambda y: jax.lax.with_sharding_constraint(y, NamedSharding(mesh, wanted)), x)

    return jax.tree_util.tree_map(pin, specs, out, is_leaf=lambda x: isinstance(x, P))


def place(x: Any, sharding: NamedSharding) -> jax.Array:
    """Puts a host value that every process holds in full onto ``sharding``; a
    ``jax.ShapeDtypeStruct`` becomes one that carries ``sharding`` (nothing is placed).

    One process (or a sharding whose devices are all local): ``jax.device_put``. Several
    processes (the mesh spans devices of other processes): every process must pass the
    same global value, and each one places only the slices its own devices hold, so no
    data moves between processes.
    """
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract state: shapes and places only
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if sharding.is_fully_addressable:
        return jax.device_put(x, sharding)
    x = np.asarray(x)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])


def is_prng_key(x: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``; NNX's RNG state holds them)."""
    return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def place_keys(data: Any, impl: Any, sharding: NamedSharding) -> jax.Array:
    """Typed PRNG keys of ``impl`` from their raw ``key_data``, placed on ``sharding``
    (numpy cannot hold keys, so they travel as their data)."""
    placed = place(np.asarray(data), sharding)
    return jax.jit(lambda d: jax.random.wrap_key_data(d, impl=impl),
                   out_shardings=sharding)(placed)


def place_replicated(x: Any, sharding: NamedSharding) -> jax.Array:
    """A host value (or typed PRNG keys) on every device of ``sharding``."""
    if is_prng_key(x):
        return place_keys(jax.random.key_data(x), jax.random.key_impl(x), sharding)
    return place(np.asarray(x), sharding)


def to_host(x: jax.Array) -> np.ndarray:
    """The global value of ``x`` as numpy; a collective over processes if it spans several."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def global_norm(shards: Any) -> jax.Array:
    """L2 norm of a whole pytree whose leaves are primary shards. Inside ``shard_map``.

    Each device sums the squares of its shards in fp32 (float64 ones in float64); a ``psum``
    over ``("node", "local")`` adds the devices' sums. Accepts a ``ShardedParams`` (as
    returned for the gradient of ``state.params`` in ZeRO-3) or any pytree of sharded
    leaves.
    """
    if isinstance(shards, ShardedParams):
        if not shards.sharded:
            raise ValueError(
                "global_norm needs primary shards; with ZeRO stages 1 and 2 the gradient "
                "inside the step is each device's unreduced full gradient"
            )
        shards = shards.units
    with jax.named_scope(scopes.OWN):
        local = sum(jnp.sum(jnp.square(x.astype(accumulation_dtype(x.dtype))))
                    for x in jax.tree_util.tree_leaves(shards))
        return jnp.sqrt(jax.lax.psum(local, AXES))


@struct.dataclass
class ShardedParams:
    """A model's parameters as one flat buffer per unit.

    ``units[name]`` is, outside ``shard_map``, a global ``[n_pad]`` array; inside, the local
    piece. With ``sharded=True`` it is split over ``("node", "local")`` (primary shards,
    ``[n_pad / P]`` per device); with ``sharded=False`` every device holds all of it (ZeRO
    stages 1 and 2 keep full weights in the compute dtype). Use it only through
    ``state.apply_fn``; ``TrainState.consolidate`` turns it back into a Flax params tree.

    ``feedback[name]`` (with ``config.qgz_error_feedback``, else empty) holds unit
    ``name``'s kept qgZ errors: per device, ``QgzReduceScatter.feedback_specs``' buffers
    (FP8 values and fp32 scales of each quantizing hop, and an fp32 use count), put end to
    end over devices and split over ``("node", "local")``. They are not parameters: the
    step differentiates them only to carry their new values out of backward (the gradient
    of ``state.params`` holds the new errors in its ``feedback``), and
    ``apply_gradients`` stores those.
    """

    units: dict[str, jax.Array]
    sharded: bool = struct.field(pytree_node=False, default=True)
    feedback: dict[str, tuple] = struct.field(default_factory=dict)

    @property
    def spec(self) -> P:
        return SHARDED if self.sharded else REPLICATED

    def specs(self) -> "ShardedParams":
        if self.sharded:
            return ShardedParams({k: sharded_spec(len(np.shape(v))) for k, v in self.units.items()},
                                 True, {k: tuple(SHARDED for _ in v)
                                        for k, v in self.feedback.items()})
        return ShardedParams({k: self.spec for k in self.units}, self.sharded,
                             {k: tuple(SHARDED for _ in v) for k, v in self.feedback.items()})
