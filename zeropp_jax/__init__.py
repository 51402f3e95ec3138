"""zeropp_jax: ZeRO++ (qwZ, hpZ, qgZ) for JAX and Flax.

The package is layered; each folder imports only from the ones below it (checked by the
import-linter contracts in ``pyproject.toml``):

    plan/                             cost model, memory model, auto_config
    inference/  measure/  parallel/   generation; comm report, memory model, pictures; Ulysses
    train/                            TrainState, the step, optimizer checks, checkpoints
    units/  units/adapters/           the unit transform, ordering, wrap policies; linen/NNX/HF
    comm/                             flat layouts, placement, collectives, hpZ, qgZ, frozen
    quant/                            blockwise quantization over pallas_kernels/
    core/                             config, mesh, version-dependent calls, processes
"""

# The documented import paths (``zeropp_jax.collectives.qwz_all_gather``,
# ``from zeropp_jax.checkpoint import save``, ...) are thin modules beside this one, each
# naming the public names of its home module in a layer folder. Old spellings (moved
# names, the old root modules ``losses``, ``qgz``, ``wrap``) are answered from one table,
# ``_deprecations.py``, with a DeprecationWarning for a release.
from zeropp_jax import (
    _deprecations,
    analysis,
    checkpoint,
    collectives,
    generation,
    processes,
    quantization,
    ulysses,
    viz,
)
from zeropp_jax.comm.frozen import FrozenShards
from zeropp_jax.comm.placement import ShardedParams, global_norm
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import make_mesh, simulate_cpu_devices
from zeropp_jax.core.gpu_flags import gpu_overlap_flags, use_gpu_overlap_flags
from zeropp_jax.core.settings import (
    Gradients,
    Offload,
    Precision,
    Quantization,
    Schedule,
    Secondary,
    Update,
    Weights,
)
from zeropp_jax.inference.generate import generate
from zeropp_jax.plan.auto import auto_config
from zeropp_jax.train.accumulate import accumulate_gradients
from zeropp_jax.train.checkpoint import consolidate
from zeropp_jax.train.engine import Engine
from zeropp_jax.train.global_batch import all_gather_batch, batch_offset
from zeropp_jax.train.losses import token_mean
from zeropp_jax.train.state import TrainState
from zeropp_jax.train.step import eval_step, per_example, train_step


__all__ = [
    "Engine",
    "FrozenShards",
    "Gradients",
    "Offload",
    "Precision",
    "Quantization",
    "Schedule",
    "Secondary",
    "ShardedParams",
    "TrainState",
    "Update",
    "Weights",
    "ZeroPPConfig",
    "accumulate_gradients",
    "all_gather_batch",
    "auto_config",
    "analysis",
    "batch_offset",
    "checkpoint",
    "collectives",
    "consolidate",
    "eval_step",
    "generate",
    "global_norm",
    "gpu_overlap_flags",
    "make_mesh",
    "per_example",
    "processes",
    "quantization",
    "simulate_cpu_devices",
    "token_mean",
    "train_step",
    "ulysses",
    "use_gpu_overlap_flags",
    "viz",
]
__version__ = "0.1.0"
__getattr__ = _deprecations.package_getattr
