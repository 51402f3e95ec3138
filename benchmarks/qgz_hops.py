"""qgZ with each hop's quantization chosen apart: INT4, INT8 or none (16-bit on the wire).

A gradient transport for ``benchmarks/qgz_gap.py``, built from ``zeropp_jax.comm.qgz``'s
pieces: the same reordering, all-to-alls, block quantization and Hadamard rotation as
``qgz_reduce_scatter``, but with ``hop1_bits`` (the intra-node hop: each device's whole
gradient) and ``hop2_bits`` (the cross-node hop: each node's partial sums) set separately.
``None`` sends that hop's values in the gradient's dtype, as ``hierarchical_reduce_scatter``
does. ``(4, 4)`` is qgZ (within fp32 rounding: between the hops the partial sums are rotated
back and forth instead of staying rotated); ``(None, 4)`` quantizes only what crosses nodes,
so it moves qgZ's cross-node bytes.

It plugs in by replacing the registry's ``"qgz"`` entry in the benchmark's own process
(``install``); nothing in the library changes.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.reorder import reorder_reference
from zeropp_jax.comm import qgz as _q
from zeropp_jax.comm.collectives import from_wire, to_wire
from zeropp_jax.comm.transports import registry
from zeropp_jax.comm.transports.qgz import QgzReduceScatter
from zeropp_jax.core.mesh import AXES
from zeropp_jax.quant.quantization import _resolve
from zeropp_jax.quant.rotation import hadamard_signs


def hop_reduce_scatter(x: jax.Array, *, hop1_bits: int | None, hop2_bits: int | None,
                       block_size: int = 256, hadamard: bool = False,
                       key: jax.Array | None = None, implementation: str | None = None,
                       node_axis: str = AXES[0], local_axis: str = AXES[1]) -> jax.Array:
    """Inside ``shard_map``: ``x [n]`` this device's gradient -> fp32 ``[n / P]``, this
    device's slice of the sum over ``(node_axis, local_axis)`` (``psum_scatter``'s
    placement), each hop quantized with its own bits (None: not quantized)."""
    nodes = jax.lax.axis_size(node_axis)
    local = jax.lax.axis_size(local_axis)
    num = nodes * local
    (n,) = x.shape
    m = n // num
    m_pad = -(-m // block_size) * block_size
    if m_pad != m:
        x = jnp.pad(x.reshape(num, m), ((0, 0), (0, m_pad - m))).reshape(-1)
    impl = _resolve(implementation, hadamard)
    signs = hadamard_signs(key, block_size) if hadamard else None
    # Hop 1, inside the node: z [nodes * m_pad] fp32, this device's partial sums of the
    # slices i'*L + j for every node i'.
    if hop1_bits is None or local == 1:
        y = reorder_reference(x, nodes=nodes, local=local)
        if local > 1:
            y = from_wire(_q._all_to_all(to_wire(y).reshape(local, -1), local_axis), x.dtype)
            z = _q._sum_rows(y)
        else:
            z = y.astype(jnp.float32)
    else:
        kw = dict(bits=hop1_bits, block_size=block_size)
        values, scales = _q._reorder_quantize(x, impl, nodes=nodes, local=local, stages=1,
                                              stage=0, signs=signs, seed=None, **kw)
        values, scales = _q._exchange(values, scales, local, local_axis)
        z = _q._dequantize_reduce(values, scales, impl, signs=signs, **kw)
    if nodes == 1:
        return z[:m]
    # Hop 2, across nodes.
    if hop2_bits is None:
        y = from_wire(_q._all_to_all(to_wire(z.astype(x.dtype)).reshape(nodes, -1),
                                     node_axis), x.dtype)
        return _q._sum_rows(y)[:m]
    kw = dict(bits=hop2_bits, block_size=block_size)
    values, scales = _q._reorder_quantize(z, impl, nodes=1, local=1, signs=signs, seed=None,
                                          **kw)
    values, scales = _q._exchange(values, scales, nodes, node_axis)
    return _q._dequantize_reduce(values, scales, impl, signs=signs, **kw)[:m]


@dataclasses.dataclass(frozen=True)
class HopQgz(QgzReduceScatter):
    """``QgzReduceScatter`` whose quantized path is ``hop_reduce_scatter`` (no error
    feedback, no stochastic rounding, one pipeline stage)."""

    hop1_bits: int | None = 4
    hop2_bits: int | None = 4

    def label(self) -> str:
        return (f"qgz-hops-{self.hop1_bits or 16}-{self.hop2_bits or 16}"
                + ("-had" if self.hadamard else ""))

    def quantized(self, g: jax.Array, key: jax.Array | None = None) -> jax.Array:
        num = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])
        return hop_reduce_scatter(g, hop1_bits=self.hop1_bits, hop2_bits=self.hop2_bits,
                                  block_size=self._block(g.shape[0], num),
                                  hadamard=self.hadamard, key=key,
                                  implementation=self.implementation)


_LIBRARY_QGZ = registry.GRADIENTS["qgz"]


def uninstall() -> None:
    """The library's qgZ again (undoes ``install``)."""
    registry.GRADIENTS["qgz"] = _LIBRARY_QGZ


def install(hop1_bits: int | None, hop2_bits: int | None) -> None:
    """Make every config with qgZ use ``HopQgz`` with these bits in this process."""

    def make(config):
        if config.stochastic_rounding or config.qgz_error_feedback:
            raise ValueError("HopQgz has neither stochastic rounding nor error feedback")
        base = QgzReduceScatter.from_config(
            config, registry.GRADIENTS[config.reduce_scatter](config))
        fields = {f.name: getattr(base, f.name) for f in dataclasses.fields(base)}
        return HopQgz(**fields, hop1_bits=hop1_bits, hop2_bits=hop2_bits)

    registry.GRADIENTS["qgz"] = make


__all__ = ["HopQgz", "hop_reduce_scatter", "install", "uninstall"]
