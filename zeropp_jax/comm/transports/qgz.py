"""qgZ: the gradient block-quantized to INT4/INT8 for two all-to-all hops (optionally
Hadamard-smoothed, optionally rounded stochastically, optionally with error feedback)."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp

from zeropp_jax.comm.qgz import (
    feedback_lengths,
    hop2_to_flat,
    qgz_hop_local,
    qgz_hop_nodes,
    qgz_quantize,
    qgz_reduce_scatter,
    qgz_reduce_scatter_feedback,
    staged,
)
from zeropp_jax.comm.transports import kept_errors
from zeropp_jax.comm.transports.base import GradientFacts, GradientTransport
from zeropp_jax.comm.transports.kept_errors import Feedback, decode_error, encode_error
from zeropp_jax.core.mesh import AXES, MeshInfo
from zeropp_jax.quant.rotation import fixed_key

@dataclasses.dataclass(frozen=True)
class QgzReduceScatter(GradientFacts):
    """qgZ's hierarchical all-to-all (``"local"``, then ``"node"``) carrying quantized
    blocks, dequantized and summed in fp32 at each hop.

    Attributes:
      bits: 4 or 8.
      block_size: elements per scale; None: one scale per stage of a destination slice.
      stages: pipeline stages (``config.qgz_pipeline_stages``).
      implementation: ``"xla"`` or ``"pallas"``.
      fallback: what ``reduce_sum(g, on=False)`` runs (``config.qgz_until_step``): the
        unquantized reduce-scatter, chosen by ``lax.cond`` at run time.
      hadamard: Hadamard smoothing of every block (``config.qgz_hadamard``).
      stochastic_rounding: unbiased rounding of both quantizations
        (``config.stochastic_rounding``).
      per_step_signs: the Hadamard signs (and rounding seeds) drawn from the step counter
        (``config.qgz_signs == "per_step"``) instead of one fixed key for the run.
      error_feedback: each device keeps its quantization errors and adds them back at the
        next reduce-scatter (``config.qgz_error_feedback``; ``reduce_sum_feedback``).
      until: qgZ for optimizer steps ``< until``, ``fallback`` after
        (``config.qgz_until_step``); None: always qgZ.
      hops: ``"both"`` quantizes both hops; ``"cross"`` only the one across nodes
        (``config.qgz_hops``; ``comm.qgz.qgz_reduce_scatter``).
    """

    bits: int
    block_size: int | None
    stages: int
    implementation: str
    fallback: GradientTransport
    hadamard: bool = False
    stochastic_rounding: bool = False
    per_step_signs: bool = False
    error_feedback: bool = False
    until: int | None = None
    hops: str = "both"

    @classmethod
    def from_config(cls, config: Any, fallback: GradientTransport) -> "QgzReduceScatter":
        return cls(config.grad_bits, config.block_size if config.blockwise else None,
                   config.qgz_pipeline_stages, config.quantization_impl, fallback,
                   hadamard=config.qgz_hadamard,
                   stochastic_rounding=config.stochastic_rounding,
                   per_step_signs=config.qgz_signs == "per_step",
                   error_feedback=config.qgz_error_feedback, until=config.qgz_until_step,
                   hops=config.qgz_hops)

    def label(self) -> str:
        name = (f"qgz-int{self.bits}" + ("-cross" if self.hops == "cross" else "")
                + ("-had" if self.hadamard else "")
                + ("-step" if self.per_step_signs else ""))
        return name + ("+EF" if self.error_feedback else "")

    def quantized_elems(self, n: int, mesh: MeshInfo) -> float:
        # The full gradient, then the node's partial sums requantized for the node hop
        # (``2 n / L``); a rotation reads the data once more. Kept errors: see the plan.
        # Cross-node only: just the partial sums (with one node, nothing at all).
        if self.hops == "cross" and mesh.nodes == 1:
            return 0.0
        first = 0 if self.hops == "cross" and mesh.local > 1 else n
        return (first + 2 * n / mesh.local) * (2 if self.hadamard else 1)

    def bucketable(self) -> bool:
        # Blocks never straddle members, but one scale per slice, the rotation's signs,
        # rounding seeds and per-unit kept errors follow a unit's place in the buffer.
        return (self.block_size is not None and not self.hadamard
                and not self.stochastic_rounding and not self.error_feedback)

    def switch_step(self) -> int | None:
        return self.until

    def follows_step(self) -> bool:
        return self.per_step_signs

    def _block(self, n: int, num_devices: int) -> int:
        return self.block_size or n // num_devices // self.stages

    def _key(self, step: jax.Array | None) -> jax.Array | None:
        if not self.per_step_signs or step is None:
            return None
        return jax.random.fold_in(fixed_key(), step)

    def _kwargs(self, n: int, num_devices: int, key: jax.Array | None) -> dict:
        """``qgz_reduce_scatter``'s settings for an ``[n]`` gradient on ``num_devices``."""
        return dict(bits=self.bits, block_size=self._block(n, num_devices), stages=self.stages,
                    implementation=self.implementation, hadamard=self.hadamard,
                    stochastic_rounding=self.stochastic_rounding, key=key, hops=self.hops)

    def quantized(self, g: jax.Array, key: jax.Array | None = None) -> jax.Array:
        num_devices = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])
        return qgz_reduce_scatter(g, **self._kwargs(g.shape[0], num_devices, key))

    # -- in three phases (config.qgz_defer) ---------------------------------------------

    def staged(self, mesh: MeshInfo) -> bool:
        """Whether ``reduce_sum`` (qgZ on, no error feedback) can run as ``phase_quantize``
        -> ``phase_local`` -> ``phase_nodes`` on ``mesh``: both hops quantized and present
        (``comm.qgz.staged``)."""
        return staged(mesh.nodes, mesh.local, self.hops) and not self.error_feedback

    def _phase_kwargs(self, n: int, step: jax.Array | None) -> dict:
        num_devices = jax.lax.axis_size(AXES[0]) * jax.lax.axis_size(AXES[1])
        kw = self._kwargs(n, num_devices, self._key(step))
        kw.pop("hops")
        return kw

    def phase_quantize(self, g_full: jax.Array, step: jax.Array | None = None) -> dict:
        """``comm.qgz.qgz_quantize`` of a ``[n]`` gradient with this transport's settings."""
        return qgz_quantize(g_full, **self._phase_kwargs(g_full.shape[0], step))

    def phase_local(self, q: dict, n: int, step: jax.Array | None = None) -> dict:
        """``comm.qgz.qgz_hop_local`` of ``phase_quantize``'s blocks (``n``: the length)."""
        return qgz_hop_local(q, **self._phase_kwargs(n, step))

    def phase_nodes(self, r: dict, n: int, step: jax.Array | None = None) -> jax.Array:
        """``comm.qgz.qgz_hop_nodes``: fp32 ``[n / P]``, what ``reduce_sum`` returns."""
        return qgz_hop_nodes(r, n, **self._phase_kwargs(n, step))

    def reduce_sum(self, g_full: jax.Array, on: jax.Array | None = None,
                   step: jax.Array | None = None) -> jax.Array:
        """``step``: the optimizer step (traced int), for ``per_step_signs``; without it,
        the fixed key's signs, and rounding seeds from each device's gradient."""
        quantized = functools.partial(self.quantized, key=self._key(step))
        if on is None:
            return quantized(g_full)
        return jax.lax.cond(on, quantized, self.fallback.reduce_sum, g_full)

    # -- error feedback --------------------------------------------------------------------

    def feedback_lengths(self, n_pad: int, mesh: MeshInfo) -> tuple[int, int]:
        """Per-device fp32 lengths ``(h1, h2)`` of the errors kept for a unit of padded
        length ``n_pad`` (``comm.qgz.feedback_lengths``); ``(0, 0)`` without
        ``error_feedback``."""
        if not self.error_feedback:
            return 0, 0
        return feedback_lengths(n_pad, nodes=mesh.nodes, local=mesh.local,
                                block_size=self._block(n_pad, mesh.data),
                                stages=self.stages)

    def feedback_specs(self, n_pad: int, mesh: MeshInfo) -> tuple[jax.ShapeDtypeStruct, ...]:
        """Per-device shapes of a unit's kept errors, as stored: FP8 values and fp32 scales
        of hop 1, the same of hop 2, and an fp32 ``[1]`` use count (``reduce_sum_feedback``);
        none when nothing is quantized (one node: the plain reduce-scatter). Global arrays
        put ``P`` of these end to end, split over ``("node", "local")``."""
        return kept_errors.specs(self.feedback_lengths(n_pad, mesh))

    def feedback_record(self, n: int, n_pad: int, mesh: MeshInfo) -> dict[str, Any] | None:
        """What describes a unit's kept errors on ``mesh`` (``kept_errors.record``): the
        record a checkpoint stores beside them; None when nothing is kept."""
        return kept_errors.record(n, n_pad, self.feedback_lengths(n_pad, mesh), self.stages,
                                  mesh)

    def reshard_feedback(self, old: dict[str, Any], old_mesh: MeshInfo, new: dict[str, Any],
                         mesh: MeshInfo) -> Callable[..., tuple[jax.Array, ...]] | None:
        """Kept errors written on another mesh or layout -> this one's
        (``kept_errors.reshard``): None when the stored buffers are the new ones."""
        return kept_errors.reshard(old, old_mesh, new, mesh)

    def reduce_sum_feedback(self, g_full: jax.Array, kept: Feedback,
                            on: jax.Array | None = None, step: jax.Array | None = None
                            ) -> tuple[jax.Array, Feedback]:
        """``reduce_sum`` with error feedback: ``kept`` (this device's stored errors,
        ``feedback_specs``) is decoded, added before each quantization, and the new errors
        come back encoded, with a use count of 1 (a caller that finds another count knows
        the errors were summed over several uses and are not errors any more).

        When qgZ is off for the step (``on`` False), the kept errors go into the plain
        reduce-scatter's input and the new ones are zero."""
        mesh = MeshInfo.inside()
        num_devices = mesh.data
        (n,) = g_full.shape
        h1, h2 = self.feedback_lengths(n, mesh)
        e1 = decode_error(kept[0], kept[1], h1)
        e2 = decode_error(kept[2], kept[3], h2)
        kw = self._kwargs(n, num_devices, self._key(step))

        def quantized(g, e1, e2):
            out, (e1n, e2n) = qgz_reduce_scatter_feedback(g, (e1, e2), **kw)
            return out, e1n, e2n

        def plain(g, e1, e2):
            x = g.astype(jnp.float32)
            if h1:
                x = x + e1
            if h2:
                x = x + hop2_to_flat(e2, nodes=mesh.nodes, local=mesh.local, stages=self.stages,
                                     m=n // num_devices,
                                     local_index=jax.lax.axis_index(AXES[1]))
            return (self.fallback.reduce_sum(x.astype(g.dtype)), jnp.zeros_like(e1),
                    jnp.zeros_like(e2))

        if on is None:
            out, e1n, e2n = quantized(g_full, e1, e2)
        else:
            out, e1n, e2n = jax.lax.cond(on, quantized, plain, g_full, e1, e2)
        return out, (*encode_error(e1n), *encode_error(e2n), jnp.ones((1,), jnp.float32))
