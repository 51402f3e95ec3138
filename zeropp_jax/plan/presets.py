"""Hardware constants for the cost model, each with where it came from.

Measured constants say what measured them; the rest are marked as assumptions. A cluster
of your own is best described by calibrating on it (``benchmarks/cluster/run.py --predict``
prints fitted constants for the emulated cluster; on GPUs, ``make gpu-check`` measures
the compute and quantization-kernel throughput of one device).
"""

from __future__ import annotations

import numbers
from typing import Any

from zeropp_jax.plan.cost_model import Hardware, Link

# One H100 SXM (benchmarks/results/gpu_check_h100.json, jax 0.11.2, CUDA 13):
# - compute: a ZeRO-3 train step of a 163M GPT (12L d768, seq 1024, batch 8) ran at
#   0.234 of the 989 TFLOP/s bf16 peak. Larger models reach more; this is the one measured.
# - quantization kernels: quantize / dequantize / reorder ran at about 2.2e12 bytes/s of
#   read + written bytes, about 3 bytes per element (bf16 in, int8 out): 7e11 elements/s.
H100_FLOPS = 0.234 * 989e12
H100_QUANT_ELEMS = 7e11
# NVLink 4 on an 8-GPU HGX node: 450 GB/s per GPU each way.
H100_NVLINK_BYTES = 450e9
# Assumed, not measured here: NCCL's per-collective fixed cost (launch plus round trip),
# about 10 us inside a node over NVLink and 30 us across nodes over InfiniBand/RoCE.
NCCL_INTRA_LATENCY = 10e-6
NCCL_INTER_LATENCY = 30e-6
# Assumed: the share of wire time XLA's GPU latency-hiding scheduler overlaps with compute
# when units are prefetched (the backend runs collectives on their own streams).
GPU_OVERLAP = 0.8

# Assumed, not measured here: a GPU's link to its host memory. PCIe Gen5 x16 (H100 SXM):
# 64 GB/s each way on paper, about 50 effective; Gen3 x16 (V100): 16 on paper, 12
# effective. The emulated cluster's "host" is the same RAM: a memory copy.
H100_PCIE_BYTES = 50e9
V100_PCIE_BYTES = 12e9
CPU_COPY_BYTES = 5e9

# The ZeRO++ paper's cluster: DGX-2 nodes of 16 V100 32GB (NVSwitch: NVLink 2, 6 links of
# 25 GB/s each way per GPU), 125 TFLOP/s fp16 tensor peak per GPU.
V100_NVLINK_BYTES = 150e9
V100_PEAK = 125e12


def h100(nodes: int, *, inter_gbps_per_gpu: float = 400.0, local: int = 8) -> Hardware:
    """``nodes`` HGX H100 nodes of ``local`` GPUs, ``inter_gbps_per_gpu`` Gbit/s of network
    per GPU (400: one NDR InfiniBand NIC per GPU; 100: 100 GbE per GPU)."""
    return Hardware(nodes, local, Link(H100_NVLINK_BYTES, NCCL_INTRA_LATENCY),
                    Link.gbps(inter_gbps_per_gpu * local, NCCL_INTER_LATENCY),
                    H100_FLOPS, H100_QUANT_ELEMS, GPU_OVERLAP,
                    f"H100 x{local} per node, {inter_gbps_per_gpu:g} Gbit/s per GPU between "
                    "nodes (compute and kernel throughput measured on one H100; NCCL "
                    "latencies, overlap and PCIe assumed)", host=Link(H100_PCIE_BYTES))


def v100_dgx2(nodes: int, *, inter_gbps_per_node: float, mfu: float = 0.45,
              overlap: float = GPU_OVERLAP, local: int = 16) -> Hardware:
    """The ZeRO++ paper's DGX-2 cluster: ``local`` V100s per node, ``inter_gbps_per_node``
    Gbit/s between nodes (the paper's 100 to 800). ``mfu``: achieved fraction of the fp16
    peak on the step's math (assumed; the paper reports about 0.39 for ZeRO-3 at 800 Gbit/s,
    wire time included). The quantization kernels are taken at the H100's elements per
    second scaled by HBM2 / HBM3 bandwidth (0.9 / 3.35 TB/s)."""
    return Hardware(nodes, local, Link(V100_NVLINK_BYTES, NCCL_INTRA_LATENCY),
                    Link.gbps(inter_gbps_per_node, NCCL_INTER_LATENCY), mfu * V100_PEAK,
                    H100_QUANT_ELEMS * 0.9 / 3.35, overlap,
                    f"DGX-2 (16 V100) nodes, {inter_gbps_per_node:g} Gbit/s per node, "
                    f"compute {mfu:.2f} of peak (assumed)", host=Link(V100_PCIE_BYTES))


def emulated_cpu(nodes: int, local: int, *, inter_gbps: float = 1.0,
                 constants: dict[str, float] | None = None) -> Hardware:
    """The emulated cluster of ``benchmarks/cluster/run.py`` (node processes on one machine's
    CPU cores, links shaped with ``tc``). ``constants``: what ``run.py --predict``
    printed for your machine (``flops_per_s``, ``inter_latency_s``, ``intra_latency_s``,
    ``intra_bytes_per_s``, ``quant_elems_per_s``, ``grad_quant_elems_per_s``); without
    them, rough values of a 2-core machine, good for a ranking only (qgZ's gradient path
    runs several times slower than qwZ's dequantization on XLA's CPU backend)."""
    c = {"flops_per_s": 1e10, "inter_latency_s": 3e-3, "intra_latency_s": 2e-4,
         "intra_bytes_per_s": 2e9, "quant_elems_per_s": 2e8, "grad_quant_elems_per_s": 1e8,
         **(constants or {})}
    return Hardware(nodes, local, Link(c["intra_bytes_per_s"], c["intra_latency_s"]),
                    Link.gbps(inter_gbps, c["inter_latency_s"]), c["flops_per_s"],
                    c["quant_elems_per_s"], 0.0,
                    "emulated cluster on CPU " + ("(calibrated)" if constants else
                                                  "(uncalibrated defaults)"),
                    c["grad_quant_elems_per_s"], host=Link(CPU_COPY_BYTES))


def check_count(name: str, value: Any) -> int | None:
    """A node or device count as given by a user: None (not given: the caller's default)
    or an int >= 1 (a numpy integer becomes an int). 0 is refused, not read as "not
    given": ``nodes or default`` would plan silently for another cluster."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}={value!r} is a {type(value).__name__}: give an int >= 1, "
                        "or None for the default")
    if value < 1:
        raise ValueError(f"{name}={value!r} is not a count: give an int >= 1, or None for "
                         "the default")
    return int(value)


def for_devices(nodes: int | None = None, local: int | None = None,
                devices: Any = None) -> Hardware:
    """Constants for the devices JAX sees: nodes = processes, local = devices per process
    unless given (None). H100/H200 GPUs get ``h100``; CPU devices get ``emulated_cpu``."""
    import jax

    nodes, local = check_count("nodes", nodes), check_count("local", local)
    devices = jax.devices() if devices is None else devices
    if nodes is None:
        nodes = jax.process_count()
    if local is None:
        local = max(1, len(devices) // max(1, jax.process_count()))
    kind = str(getattr(devices[0], "device_kind", "")).upper()
    platform = getattr(devices[0], "platform", "")
    if platform == "gpu" and ("H100" in kind or "H200" in kind):
        return h100(nodes, local=local)
    if platform == "cpu":
        return emulated_cpu(nodes, local)
    raise ValueError(
        f"no cost-model constants for {kind or platform!r} devices: pass hardware= "
        "(zeropp_jax.plan.cost_model.Hardware, or a preset from zeropp_jax.plan.presets "
        "with your link speeds)")


__all__ = ["emulated_cpu", "for_devices", "h100", "v100_dgx2"]
