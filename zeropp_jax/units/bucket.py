"""One collective for several units: their shards gathered together, their gradients
reduce-scattered together. Runs inside ``shard_map``.

A unit's flat buffer ``[n_pad]`` is split over the ``P`` devices of ``("node", "local")``
in device order, so the full buffer of a *bucket* of units, whose per-device storage is the
concatenation of the members' primary shards ``[s_1 + s_2 + ...]``, is the members' full
buffers interleaved row by row: viewed as ``[P, s_1 + s_2 + ...]``, member ``i`` is the
column range ``s_i`` and ``full_i = rows[:, range_i].reshape(-1)``. A transport that works
element by element (casts, all-gathers, reduce-scatters, block quantization whose blocks
never straddle two members) therefore gives every member bit for bit what it gives the
member alone, with one collective instead of one per member.

The engine uses it for the rest unit (gathered once for the step) and the first unit the
model calls (gathered at about the same time): their forward gathers share one
collective, and so do their gradient reduce-scatters, which both complete at the end of
backward. The first unit still frees its weights after its call and regathers them in
backward from what its transport keeps (its own column of the bucket's gather).
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from zeropp_jax.comm.transports import TransportPlan, UnitTransports, reduce_gradient
from zeropp_jax.core import scopes

Buffers = tuple[jax.Array, ...]


def bucketable(plan: TransportPlan, transports: Sequence[UnitTransports]) -> bool:
    """True if units with ``transports`` can share collectives: the run buckets and its
    transports give a unit in a bucket bit for bit what they give it alone
    (``TransportPlan.buckets``: any quantization blockwise, with no position-dependent step such as
    a Hadamard sign pattern, a rounding seed or kept errors), with one transport for all,
    on trainable parts only."""
    first = transports[0]
    if any(t != first or t.frozen is not None or t.weights is None for t in transports):
        return False
    return plan.buckets() and first.weights.bucketable() and first.gradients.bucketable()


def _join(members: Sequence[jax.Array], devices: int) -> jax.Array:
    """Members' device-major ``[P * l_i]`` buffers -> the bucket's ``[P * sum l_i]``."""
    return jnp.concatenate([m.reshape(devices, -1) for m in members], axis=1).reshape(-1)


def bucket_gather(transports: UnitTransports, shards: Sequence[jax.Array], config: Any,
                  qgz_on: jax.Array | None = None) -> tuple[tuple[jax.Array, Buffers], ...]:
    """Gathers several units' primary shards in one collective.

    Args:
      transports: the members' transports (one for all: ``bucketable``).
      shards: each member's local primary shard ``[s_i]`` (param dtype).
      qgz_on: qgZ's run-time switch (``config.qgz_until``), for the gradients.

    Returns:
      Per member ``(full, moved)``: its full flat weights ``[P * s_i]`` in the compute
      dtype and its part of what moved (for ``WeightTransport.keep``). All-gathers over
      ``("node", "local")`` in forward; backward takes each member's full gradient (the
      cotangent of ``full``, compute dtype) and reduce-scatters their concatenation once
      over ``("node", "local")``, giving each shard its slice of the mean over devices.
    """
    lengths = tuple(int(s.shape[0]) for s in shards)
    total = sum(lengths)
    flags = () if qgz_on is None else (qgz_on,)

    def split(buffer: jax.Array, like: jax.Array) -> list[jax.Array]:
        # Trainable transports move the full buffer itself (unit.zero_unit relies on it
        # too): every moved buffer has the full buffer's [P * total] device-major layout.
        if buffer.shape != like.shape:
            raise ValueError(f"a bucket's moved buffer {buffer.shape} is not laid out like "
                             f"its full buffer {like.shape}; this transport cannot bucket")
        rows = buffer.reshape(-1, total)  # [P, s_1 + s_2 + ...]
        out, start = [], 0
        for n in lengths:
            out.append(rows[:, start:start + n].reshape(-1))
            start += n
        return out

    def gather(stored: tuple) -> tuple:
        full, moved = transports.weights.gather((jnp.concatenate(stored),))
        fulls = split(full, full)
        moveds = [split(m, full) for m in moved]
        return tuple((f, tuple(m[i] for m in moveds)) for i, f in enumerate(fulls))

    @jax.custom_vjp
    def run(stored: tuple, flags: tuple) -> tuple:
        return gather(stored)

    def run_fwd(stored: tuple, flags: tuple) -> tuple:
        return gather(stored), flags

    def run_bwd(flags: tuple, g: tuple) -> tuple:
        grads = [gf for gf, _ in g]
        devices = grads[0].shape[0] // lengths[0]
        g_cat = _join(grads, devices)
        with jax.named_scope(scopes.REDUCED):  # marks the shards for train.axes' check
            summed = reduce_gradient(transports.gradients, g_cat, config.param_jnp_dtype,
                                     flags[0] if flags else None)
        out, start = [], 0
        for n in lengths:
            out.append(summed[start:start + n])
            start += n
        return tuple(out), (None,) * len(flags)

    run.defvjp(run_fwd, run_bwd)
    return run(tuple(shards), flags)
