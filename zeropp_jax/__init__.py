"""zeropp_jax: ZeRO++ (qwZ, hpZ, qgZ) for JAX and Flax."""

from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.engine import Engine
from zeropp_jax.engine import ShardedParams
from zeropp_jax.engine import TrainState
from zeropp_jax.engine import train_step
from zeropp_jax.mesh import make_mesh
from zeropp_jax.mesh import simulate_cpu_devices

__all__ = [
    "Engine",
    "ShardedParams",
    "TrainState",
    "ZeroPPConfig",
    "make_mesh",
    "simulate_cpu_devices",
    "train_step",
]
__version__ = "0.1.0"
