"""The cost model: a train step's time and memory from its collectives, flops and hardware.

Pure arithmetic on frozen dataclasses, so every number can be checked by hand:

* ``Hardware``: the cluster (``nodes`` x ``local`` devices), its two links (``Link``: payload
  bandwidth and a fixed cost per collective), each device's achieved compute throughput and
  quantization-kernel throughput, and how much of the wire time the backend hides behind
  compute (``overlap``).
* ``Workload``: what one step does on each device: its collectives (``CollectiveCost``:
  bytes across nodes per node, bytes inside the node per device, whether it spans nodes),
  its flops, the elements its quantization kernels read, and its memory.
* ``predict_step(workload, hardware) -> StepPrediction``:

  - compute = flops / flops_per_s + weight-path quantized elements / quant_elems_per_s
    + gradient-path quantized elements / grad_quant_elems_per_s
  - intra = sum of intra-node bytes per device / intra bandwidth (each device's own link)
  - cross = sum of cross-node bytes per node / inter bandwidth (the node's network link)
  - fixed = (collectives spanning nodes) x inter latency + (the rest) x intra latency
  - exposed = (intra + cross) - overlap x min(intra + cross, compute)
  - step = compute + exposed + fixed

  The fixed cost is never hidden: it is the time a collective holds its stream before any
  byte moves (rendezvous, launch, the network's round trip), paid in series by collectives
  that follow one another. Links are taken one collective at a time (no two collectives
  share a link at once), which is how both XLA's scheduler and NCCL's single stream run a
  ZeRO step.

``workload.py`` builds workloads from a config and a model's unit sizes (or from a compiled
program's communication report); ``auto.py`` ranks configurations with them.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable


@dataclasses.dataclass(frozen=True)
class Link:
    """One kind of link.

    Attributes:
      bytes_per_s: payload bandwidth, each direction: per device for the link inside a node
        (NVLink, or memory copies between CPU devices of one process), per node for the
        link between nodes (all of the node's NICs together).
      latency_s: the fixed cost of one collective over this link, whatever its size.
    """

    bytes_per_s: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bytes_per_s > 0:
            raise ValueError(f"Link bandwidth must be > 0 bytes/s, got {self.bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"Link latency must be >= 0 s, got {self.latency_s}")

    @classmethod
    def gbps(cls, gbit_per_s: float, latency_s: float = 0.0) -> "Link":
        """A link of ``gbit_per_s`` Gbit/s (10**9 bits per second) of payload."""
        return cls(gbit_per_s * 1e9 / 8, latency_s)


@dataclasses.dataclass(frozen=True)
class Hardware:
    """A cluster of ``nodes`` x ``local`` devices and the constants the model uses.

    Attributes:
      nodes, local: nodes, and devices per node (the mesh's ``("node", "local")``).
      intra: the link between devices of one node (bandwidth per device).
      inter: the link between nodes (bandwidth per node).
      flops_per_s: achieved compute per device on the step's math (not the datasheet peak).
      quant_elems_per_s: elements per second per device through the quantize / dequantize
        kernels (qwZ, qgZ); ``inf`` makes them free.
      grad_quant_elems_per_s: the same for qgZ's gradient path alone (quantize, all-to-all
        reorder, dequantize and sum, twice), where a backend runs it at another rate than
        qwZ's dequantization (XLA's CPU backend: several times slower); None: as
        ``quant_elems_per_s``.
      overlap: fraction in [0, 1] of the wire time the backend hides behind compute
        (0: collectives and compute run one after the other, as on XLA's CPU backend).
      name: what these constants describe, and where they came from.
      host: the link between a device and its host memory (PCIe), bandwidth per device
        each way; None: offloading is not priced (a candidate that offloads is not
        costed on such hardware).
    """

    nodes: int
    local: int
    intra: Link
    inter: Link
    flops_per_s: float
    quant_elems_per_s: float = float("inf")
    overlap: float = 0.0
    name: str = ""
    grad_quant_elems_per_s: float | None = None
    host: Link | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.local < 1:
            raise ValueError(f"Hardware needs nodes >= 1 and local >= 1, got {self.nodes} x "
                             f"{self.local}")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap is a fraction in [0, 1], got {self.overlap}")
        if not self.flops_per_s > 0 or not self.quant_elems_per_s > 0:
            raise ValueError("flops_per_s and quant_elems_per_s must be > 0")
        if self.grad_quant_elems_per_s is not None and not self.grad_quant_elems_per_s > 0:
            raise ValueError("grad_quant_elems_per_s must be > 0 (or None)")

    @property
    def grad_quant_rate(self) -> float:
        """Elements per second per device through qgZ's gradient path."""
        return (self.quant_elems_per_s if self.grad_quant_elems_per_s is None
                else self.grad_quant_elems_per_s)

    @property
    def devices(self) -> int:
        return self.nodes * self.local

    def with_mesh(self, nodes: int, local: int | None = None) -> "Hardware":
        """The same constants on another number of nodes (and devices per node)."""
        return dataclasses.replace(self, nodes=nodes, local=self.local if local is None
                                   else local)


@dataclasses.dataclass(frozen=True)
class CollectiveCost:
    """One collective of a step, as the model sees it.

    Attributes:
      what: a label (``"block_0 forward"``, ``"loss"``...).
      kind: ``all-gather``, ``all-to-all``, ``reduce-scatter``, ``all-reduce``...
      cross_bytes_per_node: bytes each node sends across nodes (the busiest node's share
        when they differ: ``count_bytes``' cross bytes / nodes).
      intra_bytes_per_device: bytes each device moves inside its node.
      spans_nodes: True if it runs between nodes (pays the inter link's fixed cost).
      count: how many times a step runs it.
    """

    what: str
    kind: str
    cross_bytes_per_node: float
    intra_bytes_per_device: float
    spans_nodes: bool
    count: int = 1


@dataclasses.dataclass(frozen=True)
class Workload:
    """One step on each device.

    Attributes:
      collectives: every collective of the step.
      flops_per_device: the step's floating-point operations on one device.
      quant_elems_per_device: elements one device quantizes or dequantizes per step, all
        paths together.
      grad_quant_elems_per_device: the part of them in qgZ's gradient path.
      memory_bytes_per_device: peak bytes one device holds for the step, the state
        donated (``workload.memory_breakdown``: the state, gathered weights, hpZ's
        secondaries, activations, the loss's logits, gradients).
      label: the configuration it belongs to.
      host_bytes_per_device: bytes one device moves between its memory and its host's per
        step, both directions (offloaded optimizer state in and out).
    """

    collectives: tuple[CollectiveCost, ...]
    flops_per_device: float = 0.0
    quant_elems_per_device: float = 0.0
    memory_bytes_per_device: float = 0.0
    label: str = ""
    grad_quant_elems_per_device: float = 0.0
    host_bytes_per_device: float = 0.0

    @property
    def cross_bytes_per_node(self) -> float:
        return sum(c.cross_bytes_per_node * c.count for c in self.collectives)

    @property
    def intra_bytes_per_device(self) -> float:
        return sum(c.intra_bytes_per_device * c.count for c in self.collectives)

    @property
    def cross_node_collectives(self) -> int:
        return sum(c.count for c in self.collectives if c.spans_nodes)

    @property
    def intra_node_collectives(self) -> int:
        return sum(c.count for c in self.collectives if not c.spans_nodes)


@dataclasses.dataclass(frozen=True)
class StepPrediction:
    """Predicted seconds per step, split as ``predict_step`` computes them, and memory."""

    compute_s: float
    intra_s: float
    cross_s: float
    fixed_s: float
    exposed_s: float
    memory_bytes: float
    label: str = ""
    host_s: float = 0.0

    @property
    def step_s(self) -> float:
        return self.compute_s + self.exposed_s + self.fixed_s + self.host_s

    def as_dict(self) -> dict[str, float | str]:
        out = dataclasses.asdict(self)
        out["step_s"] = self.step_s
        return out


def predict_step(workload: Workload, hardware: Hardware) -> StepPrediction:
    """Seconds per step and bytes per device of ``workload`` on ``hardware`` (formulas in
    the module docstring)."""
    weight_quant = workload.quant_elems_per_device - workload.grad_quant_elems_per_device
    compute = (workload.flops_per_device / hardware.flops_per_s
               + weight_quant / hardware.quant_elems_per_s
               + workload.grad_quant_elems_per_device / hardware.grad_quant_rate)
    intra = workload.intra_bytes_per_device / hardware.intra.bytes_per_s
    cross = (workload.cross_bytes_per_node / hardware.inter.bytes_per_s
             if hardware.nodes > 1 else 0.0)
    fixed = (workload.cross_node_collectives * hardware.inter.latency_s
             + workload.intra_node_collectives * hardware.intra.latency_s)
    wire = intra + cross
    exposed = wire - hardware.overlap * min(wire, compute)
    # Offloaded state crosses the device's host link at the update, at the step's end,
    # after the compute it could hide behind: counted in full (not measured on a GPU).
    # In and out use the link's two directions, leaf by leaf: half the bytes each way.
    host = 0.0
    if workload.host_bytes_per_device:
        if hardware.host is None:
            raise ValueError(
                f"{workload.label or 'the workload'} moves state to and from host memory, "
                "but the hardware has no host link: give Hardware(host=Link(...)) (PCIe "
                "bandwidth per device)")
        host = workload.host_bytes_per_device / (2 * hardware.host.bytes_per_s)
    return StepPrediction(compute, intra, cross, fixed, exposed,
                          workload.memory_bytes_per_device, workload.label, host)


def predict_all(workloads: Iterable[Workload], hardware: Hardware) -> list[StepPrediction]:
    """``predict_step`` of each workload, fastest first."""
    return sorted((predict_step(w, hardware) for w in workloads), key=lambda p: p.step_s)


__all__ = ["CollectiveCost", "Hardware", "Link", "StepPrediction", "Workload", "predict_all",
           "predict_step"]
