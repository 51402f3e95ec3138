"""The GPU cluster the programs are compiled for: its devices (``compat.gpu_cluster_devices``:
no GPU needed) and the constants the schedule replay prices them with.

``H100_SXM``: XLA's description of an H100 SXM 80GB (``GpuTargetConfigProto``, the fields
XLA's GPU compiler reads when no device is attached: SM count and limits, memory size and
bandwidth, clock, compute capability 9.0, CUDA 12.9 and cuDNN 9.8 as the jax[cuda12] wheel
ships them). The roofline uses the datasheet's dense peaks (bf16 989 TFLOP/s, fp8 1979,
TF32 494) and 3.35 TB/s of HBM3; the links NVLink 4's 450 GB/s per GPU and direction inside
a node and one NIC per GPU across nodes (400 or 100 Gbit/s), as a DGX H100 cluster has.
"""

from __future__ import annotations

import numpy as np
from jax.sharding import Mesh

from zeropp_jax.core import compat
from zeropp_jax.core.mesh import AXES
from zeropp_jax.measure.schedule import Links, Roofline

H100_SXM = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 8 }
runtime_version { major: 12 minor: 9 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""

DEVICE = "NVIDIA H100 80GB HBM3 (compiled for, deviceless)"
MEMORY_BYTES = 80 * 10**9  # what a user can count on of the 84.9e9 XLA reports

H100_ROOFLINE = Roofline(
    matmul_flops_per_s={"bf16": 989e12, "f16": 989e12, "f32": 494e12, "f8e4m3fn": 1979e12,
                        "f8e5m2": 1979e12, "s8": 1979e12},
    memory_bytes_per_s=3.35e12)

NVLINK_BYTES_PER_S = 450e9


def links(nodes: int, local: int, gbit_per_gpu: float) -> Links:
    """The wire of a ``nodes x local`` H100 cluster with ``gbit_per_gpu`` Gbit/s per GPU
    across nodes (the node's ``local`` NICs together)."""
    return Links(nodes, local, NVLINK_BYTES_PER_S, local * gbit_per_gpu * 1e9 / 8)


def cluster_mesh(nodes: int, local: int) -> Mesh:
    """A ``("node", "local")`` mesh of an H100 cluster's devices, for compiling only."""
    devices = compat.gpu_cluster_devices(H100_SXM, nodes, local)
    return Mesh(np.array(devices).reshape(nodes, local), AXES)
