"""Optax on primary shards: which transforms are allowed there, and why.

Every device updates only its own flat slice of each unit's parameters. That is exact for an
*elementwise* transform (Adam, SGD with momentum, weight decay without a mask, schedules):
element i's update depends only on element i's history. It is wrong for a transform that
looks across elements — a global norm, a per-matrix trust ratio, factored second moments,
a mask chosen by parameter name or shape — because a shard is one flat slice of many tensors.
``check_elementwise`` proves the property on a small probe before training starts.
"""

from __future__ import annotations

import numpy as np
import optax

NON_ELEMENTWISE_EXAMPLES = (
    "optax.clip_by_global_norm (global norm over all parameters)",
    "optax.scale_by_trust_ratio / lamb / lars (per-tensor norms)",
    "optax.adafactor / scale_by_factored_rms (row and column statistics)",
    "masks that depend on a parameter's name or shape (for example adamw(mask=...))",
    "optax.centralize, normalize_by_update_norm, sm3",
)


def _probe_tree(rng: np.random.Generator) -> dict[str, np.ndarray]:
    # Two tensors of different shapes and scales, so per-tensor statistics and global norms
    # both show up when computed over a slice instead of the whole.
    return {
        "b": (3.0 * rng.standard_normal((7,))).astype(np.float32),
        "w": (0.5 * rng.standard_normal((3, 5))).astype(np.float32),
    }


def _flat(tree: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(tree[k])) for k in sorted(tree)])


def check_elementwise(tx: optax.GradientTransformation, steps: int = 3) -> None:
    """Raises ``ValueError`` unless ``tx`` acts elementwise (so it is exact on shards).

    The probe runs ``steps`` updates on a pytree of two tensors and the same values split
    into two flat chunks at a boundary that cuts through a tensor; an elementwise transform
    gives the same parameters both ways.
    """
    rng = np.random.default_rng(1234)
    tree = _probe_tree(rng)
    flat = _flat(tree)
    cut = 9  # inside "w" (after b's 7 elements): a shard boundary splits a tensor
    chunks = {"c0": flat[:cut].copy(), "c1": flat[cut:].copy()}
    grads = [_probe_tree(rng) for _ in range(steps)]
    try:
        p_tree, s_tree = dict(tree), tx.init(tree)
        p_chunk, s_chunk = dict(chunks), tx.init(chunks)
        for g in grads:
            u, s_tree = tx.update(g, s_tree, p_tree)
            p_tree = optax.apply_updates(p_tree, u)
            gf = _flat(g)
            u, s_chunk = tx.update({"c0": gf[:cut], "c1": gf[cut:]}, s_chunk, p_chunk)
            p_chunk = optax.apply_updates(p_chunk, u)
    except Exception as e:  # noqa: BLE001 — any failure means we cannot vouch for it
        raise ValueError(
            f"could not check that the optimizer is elementwise: {type(e).__name__}: {e}. "
            "zeropp_jax applies the optimizer to flat primary shards; use an optax chain of "
            "elementwise transforms (adam, adamw without mask, sgd, momentum, schedules)."
        ) from e
    a = _flat(p_tree)
    b = np.concatenate([np.asarray(p_chunk["c0"]), np.asarray(p_chunk["c1"])])
    # Elementwise transforms do the same float ops on the same values either way; 1e-6
    # allows only for op-fusion differences between shapes.
    if not np.allclose(a, b, rtol=1e-6, atol=1e-7):
        raise ValueError(
            "the optimizer is not elementwise, so it would compute something else on ZeRO's "
            "flat parameter shards than on the whole parameters. Examples of transforms "
            "that are rejected for this reason: " + "; ".join(NON_ELEMENTWISE_EXAMPLES) + ". "
            "Use elementwise transforms only (adam, adamw without mask, sgd, schedules)."
        )
