"""Frozen (non-trainable) parameters: which ones, and the container of their shards.

How they are stored and gathered is their transport's (``comm.transports``: the
transport plan's ``frozen_alignment``, ``store_frozen``, ``unstore_frozen``;
``stored_quantized`` for the quantized form).

Fine-tuning with LoRA (or RLHF's adapters) keeps most weights frozen. A frozen weight never
gets a gradient or optimizer state, so it need not be kept in the param dtype: with
``ZeroPPConfig(quantize_frozen=True)`` each device stores its primary shard of a unit's
frozen weights already block-quantized (INT8, or INT4 packed two per byte with
``weight_bits=4``) plus one fp32 scale per block, and a gather moves those bytes as they are
— no quantization before each gather (DeepSpeed ZeRO++'s frozen-weight path). Without it,
frozen weights are stored in the param dtype and gathered like trainable ones.

Which parameters are frozen is a filter on the parameter path (a tuple of names from the
root, as in the params dict): a callable ``path -> bool``, or a sequence of path prefixes
(``[("wte",), ("block_0", "attn")]``). A unit may hold both kinds (LoRA adapters inside a
frozen block): it is split into a trainable layout and a frozen layout, gathered together.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
import numpy as np
from flax import struct

from zeropp_jax.core.mesh import AXES

PyTree = Any
FrozenFilter = Callable[[tuple[str, ...]], bool] | Sequence[Sequence[str]]


# -- which parameters ----------------------------------------------------------------------------


def as_predicate(frozen: FrozenFilter) -> Callable[[tuple[str, ...]], bool]:
    """A frozen filter -> ``is_frozen(path) -> bool``.

    A sequence of paths freezes every parameter whose path starts with one of them.
    """
    if callable(frozen):
        return lambda path: bool(frozen(path))
    if isinstance(frozen, (str, bytes)) or not isinstance(frozen, Sequence):
        raise TypeError(
            "frozen must be a callable on the parameter path (a tuple of names, e.g. "
            "lambda path: not path[-1].startswith('lora_')) or a sequence of path prefixes "
            f"(e.g. [('wte',), ('block_0',)]), got {type(frozen).__name__}"
        )
    prefixes = []
    for p in frozen:
        if isinstance(p, str) or not all(isinstance(k, str) for k in p):
            raise TypeError(
                f"frozen path {p!r} must be a tuple of names such as ('block_0', 'attn'), "
                "not a string"
            )
        prefixes.append(tuple(p))
    return lambda path: any(path[: len(p)] == p for p in prefixes)


def split_frozen(
    tree: Mapping[str, Any], is_frozen: Callable[[tuple[str, ...]], bool],
    prefix: tuple[str, ...] = (),
) -> tuple[dict, dict]:
    """A params subtree at ``prefix`` -> (trainable subtree, frozen subtree).

    Nested dicts; empty dicts are dropped, so a part without leaves is ``{}``.
    """
    train, froz = {}, {}
    for k, v in tree.items():
        path = prefix + (k,)
        if isinstance(v, Mapping):
            t, f = split_frozen(v, is_frozen, path)
            if t:
                train[k] = t
            if f:
                froz[k] = f
        elif is_frozen(path):
            froz[k] = v
        else:
            train[k] = v
    return train, froz


def merge_trees(a: Mapping[str, Any], b: Mapping[str, Any]) -> dict:
    """Deep union of two nested dicts with disjoint leaves (inverse of ``split_frozen``)."""
    out = dict(a)
    for k, v in b.items():
        if k in out and isinstance(out[k], Mapping) and isinstance(v, Mapping):
            out[k] = merge_trees(out[k], v)
        elif k in out:
            raise ValueError(f"parameter {k!r} is both frozen and trainable")
        else:
            out[k] = v
    return out


# -- how they are stored -------------------------------------------------------------------------


@struct.dataclass
class FrozenShards:
    """Primary shards of every unit's frozen part.

    ``values[name]``: outside ``shard_map`` a global array split over ``("node", "local")``;
    inside, the local piece: int8 ``[n_pad / P]`` (INT8), uint8 ``[n_pad / (2P)]`` (INT4,
    two per byte), or the param dtype ``[n_pad / P]`` when not quantized. ``scales[name]``:
    fp32 ``[n_pad / (P * block_size)]`` (absent when not quantized). ``n_pad`` is the frozen
    layout's (``engine.frozen_layouts[name]``).
    """

    values: dict[str, jax.Array]
    scales: dict[str, jax.Array]
    quantized: bool = struct.field(pytree_node=False, default=False)
    bits: int = struct.field(pytree_node=False, default=8)
    block_size: int = struct.field(pytree_node=False, default=256)

    def specs(self) -> "FrozenShards":
        """Each buffer's spec inside a step: split over ``("node", "local")`` on its last
        dimension (a tensor-parallel unit's leading slice axis left to XLA)."""
        from jax.sharding import PartitionSpec as P

        def spec(x: Any) -> P:
            return P(AXES) if len(np.shape(x)) <= 1 else P(None, AXES)

        return self.replace(values={k: spec(v) for k, v in self.values.items()},
                            scales={k: spec(v) for k, v in self.scales.items()})

    @property
    def nbytes(self) -> int:
        """Global bytes of the stored frozen weights (values plus scales)."""
        return int(sum(x.size * x.dtype.itemsize
                       for x in jax.tree_util.tree_leaves((self.values, self.scales))))


def frozen_local_shards(frozen: FrozenShards, name: str) -> tuple[jax.Array, ...]:
    """The local storage of unit ``name``: ``(values, scales)`` or ``(values,)``."""
    if frozen.quantized:
        return frozen.values[name], frozen.scales[name]
    return (frozen.values[name],)
