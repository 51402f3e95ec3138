"""Measuring a ZeRO run: memory held for hpZ's secondary partition.

(The communication report and the memory model extend this module.)
"""

from __future__ import annotations

from zeropp_jax.train.engine import Engine
from zeropp_jax.comm.partition import REST


def secondary_bytes(engine: Engine) -> int:
    """Bytes of hpZ secondary weights one device holds during a step (0 without hpZ).

    Each unit but the rest unit keeps ``n_pad / G`` elements in the compute dtype from its forward to its
    backward (``G`` = hpZ group size in devices). They are rebuilt in every forward and
    live only until that unit's backward, so the peak is all units at once (the end of
    the forward pass), which is what this returns.
    """
    group = engine.secondary_devices
    if not group:
        return 0
    itemsize = engine.config.compute_jnp_dtype.itemsize
    # The rest unit keeps no secondary: its full weights stay gathered for the step.
    return sum(lay.n_pad // group * itemsize for name, lay in engine.layouts.items()
               if name != REST)


from zeropp_jax.measure.comm_report import (  # noqa: E402,F401
    Collective,
    CollectiveRow,
    CommReport,
    collectives,
    comm_report,
)


# -- memory model (paper Figure 4) --------------------------------------------------------------

import dataclasses as _dataclasses  # noqa: E402


@_dataclasses.dataclass(frozen=True)
class MemoryModel:
    """Per-device bytes of model states (parameters, gradients, optimizer state).

    Paper notation: ``M`` parameters, ``P`` devices, ``K`` optimizer bytes per parameter,
    ``alpha`` devices in an hpZ secondary group. Ours keeps fp32 primary shards (4 bytes)
    and fp32 gradient shards (4) plus the optimizer's ``K`` (Adam: 8); the paper's mixed
    precision keeps fp16 parameters and gradients (2 + 2) and ``K = 12`` (fp32 master, m, v):
    16 bytes per parameter either way.
    """

    params: int
    devices: int
    param_bytes: float = 4.0
    grad_bytes: float = 4.0
    optimizer_bytes: float = 8.0
    secondary_bytes: float = 2.0  # compute dtype of the hpZ secondary copy
    alpha: int | None = None  # hpZ group size in devices

    @property
    def data_parallel(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes) * self.params

    @property
    def zero3(self) -> float:
        return self.data_parallel / self.devices

    @property
    def hpz(self) -> float:
        if self.alpha is None:
            raise ValueError("set alpha (the hpZ group size in devices) for the hpZ figure")
        return self.zero3 + self.secondary_bytes * self.params / self.alpha

    @property
    def zero3_persistent(self) -> float:
        """What lives across steps in ZeRO-3: primary shards and optimizer state (the
        gradient shard exists only inside the step)."""
        return (self.param_bytes + self.optimizer_bytes) * self.params / self.devices

    def table(self) -> str:
        gib = 2.0**30
        rows = [("data parallel", self.data_parallel), ("ZeRO-3", self.zero3)]
        if self.alpha is not None:
            rows.append((f"hpZ (alpha={self.alpha})", self.hpz))
        return "\n".join(f"{name:<20} {v / gib:>12.3f} GiB" for name, v in rows)


def memory_model(
    params: int,
    devices: int,
    *,
    alpha: int | None = None,
    param_bytes: float = 4.0,
    grad_bytes: float = 4.0,
    optimizer_bytes: float = 8.0,
    secondary_bytes: float = 2.0,
) -> MemoryModel:
    """Per-device model-state bytes for data parallelism, ZeRO-3 and hpZ (paper Fig. 4).

    Defaults are zeropp_jax's dtypes with Adam (fp32 shards, fp32 m and v, bf16 secondary).
    For the paper's numbers use ``param_bytes=2, grad_bytes=2, optimizer_bytes=12``.
    """
    return MemoryModel(params, devices, param_bytes, grad_bytes, optimizer_bytes,
                       secondary_bytes, alpha)
