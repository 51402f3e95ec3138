"""zeropp_jax: ZeRO++ (qwZ, hpZ, qgZ) for JAX and Flax."""

# Submodules the README names as zeropp_jax.<module>.<function>.
from zeropp_jax import analysis, checkpoint, generate, losses, processes, ulysses, wrap
from zeropp_jax.accumulate import accumulate_gradients
from zeropp_jax.checkpoint import consolidate
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.engine import Engine
from zeropp_jax.placement import ShardedParams
from zeropp_jax.placement import global_norm
from zeropp_jax.state import TrainState
from zeropp_jax.step import train_step
from zeropp_jax.frozen import FrozenShards
from zeropp_jax.losses import token_mean
from zeropp_jax.mesh import make_mesh
from zeropp_jax.mesh import simulate_cpu_devices

__all__ = [
    "Engine",
    "FrozenShards",
    "accumulate_gradients",
    "analysis",
    "checkpoint",
    "consolidate",
    "generate",
    "losses",
    "processes",
    "global_norm",
    "ShardedParams",
    "TrainState",
    "ZeroPPConfig",
    "make_mesh",
    "simulate_cpu_devices",
    "token_mean",
    "train_step",
    "ulysses",
    "wrap",
]
__version__ = "0.1.0"
