"""Optax on primary shards: which transforms are allowed there, and why.

Every device updates only its own flat slice of each unit's parameters. That is exact for an
*elementwise* transform (Adam, SGD with momentum, weight decay without a mask, schedules):
element i's update depends only on element i's history. It is wrong for a transform that
looks across elements — a global norm, a per-matrix trust ratio, factored second moments,
a mask chosen by parameter name or shape — because a shard is one flat slice of many tensors.
``check_elementwise`` proves the property on a small probe before training starts.
"""

from __future__ import annotations

import functools

import numpy as np
import optax

NON_ELEMENTWISE_EXAMPLES = (
    "optax.clip_by_global_norm (global norm over all parameters)",
    "optax.scale_by_trust_ratio / lamb / lars (per-tensor norms)",
    "optax.adafactor / scale_by_factored_rms (row and column statistics)",
    "masks that depend on a parameter's name or shape (for example adamw(mask=...))",
    "optax.centralize, normalize_by_update_norm, sm3",
)


def _probe_tree(
    rng: np.random.Generator, scale_b: float, scale_w: float
) -> dict[str, np.ndarray]:
    # Two tensors of different shapes and scales, so per-tensor statistics and global norms
    # both show up when computed over a slice instead of the whole.
    return {
        "b": (3.0 * scale_b * rng.standard_normal((7,))).astype(np.float32),
        "w": (0.5 * scale_w * rng.standard_normal((3, 5))).astype(np.float32),
    }


def _flat(tree: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([np.ravel(np.asarray(tree[k])) for k in sorted(tree)])


# optax transforms that look across elements, by the name of the function that builds them,
# with what to use instead. Found in the transform's structure (``_builders``), so no probe
# value can hide them (a clip threshold larger than the probe's norms would).
_ACROSS_ELEMENTS = {
    "clip_by_global_norm": "ZeroPPConfig(gradient_clipping=max_norm) (the norm over all "
                           "devices' shards, exactly as optax computes it)",
    "adaptive_grad_clip": "ZeroPPConfig(gradient_clipping=...)",
    "per_example_global_norm_clip": "ZeroPPConfig(gradient_clipping=...)",
    "clip_by_block_rms": "an elementwise clip (optax.clip)",
    "apply_if_finite": "ZeroPPConfig(skip_nonfinite=True) (the default: a step whose "
                       "gradient holds inf/NaN on any device is skipped on all)",
    "scale_by_trust_ratio": "adam/adamw (lamb and lars need per-tensor norms)",
    "scale_by_factored_rms": "adam (adafactor factors per-tensor statistics)",
    "masked": "an unmasked transform (a mask by name or shape cannot see flat shards)",
    "multi_transform": "one transform for all parameters",
    "centralize": "an elementwise transform",
    "normalize_by_update_norm": "an elementwise transform",
    "scale_by_sm3": "adam",
}


def _builders(tx: object) -> set[str]:
    """Names of the functions a transform is built from (``clip_by_global_norm``, ...),
    found by walking its ``init``/``update`` functions and what their closures hold
    (``optax.chain`` keeps its parts there)."""
    seen: set[int] = set()
    names: set[str] = set()
    todo: list[object] = [tx]
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, (tuple, list)):
            todo.extend(x)
        elif isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, functools.partial):
            todo.extend([x.func, *x.args, *x.keywords.values()])
        elif callable(x) and hasattr(x, "__code__"):
            names.update(part for part in x.__qualname__.split(".") if part != "<locals>")
            todo.extend(c.cell_contents for c in (x.__closure__ or ())
                        if _has_contents(c))
            todo.extend(v for v in (x.__defaults__ or ()) if callable(v))
    return names


def _has_contents(cell: object) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
        return True
    except ValueError:
        return False


def check_elementwise(tx: optax.GradientTransformation) -> None:
    """Raises ``ValueError`` unless ``tx`` acts elementwise (so it is exact on shards).

    The probe runs three updates on a pytree of two tensors and on the same values split
    into two flat chunks at a boundary that cuts through a tensor; an elementwise transform
    gives the same updates both ways. The two tensors' gradient scales change by up to 50x
    between steps, each its own way, so that scale-invariant optimizers (Adam) cannot hide
    a clipping or normalizing transform in front of them, and
    parameters are large so that a masked weight decay shows.
    """
    found = sorted(n for n in _builders(tx) if n in _ACROSS_ELEMENTS)
    if found:
        raise ValueError(
            f"the optimizer contains {', '.join(f'optax.{n}' for n in found)}, which is not "
            "elementwise (it looks across elements), so on ZeRO's flat parameter shards it "
            "would compute something else than on the whole parameters. Use instead: "
            + "; ".join(f"for {n}, {_ACROSS_ELEMENTS[n]}" for n in found) + ". "
            "Elementwise transforms are exact on shards (adam, adamw without mask, sgd, "
            "schedules); for global-norm clipping set ZeroPPConfig(gradient_clipping="
            "max_norm), which clips exactly as optax.clip_by_global_norm does."
        )
    rng = np.random.default_rng(1234)
    tree = _probe_tree(rng, 100.0, 100.0)
    flat = _flat(tree)
    cut = 9  # inside "w" (after b's 7 elements): a shard boundary splits a tensor
    # Two "devices", each updating only its own chunk with its own optimizer state.
    chunks = [flat[:cut].copy(), flat[cut:].copy()]
    grads = [_probe_tree(rng, sb, sw) for sb, sw in ((1.0, 1.0), (50.0, 0.1), (0.02, 3.0))]
    u_tree, u_chunk = [], []
    try:
        p_tree, s_tree = dict(tree), tx.init(tree)
        p_dev = [{"shard": c} for c in chunks]
        s_dev = [tx.init(p) for p in p_dev]
        for g in grads:
            u, s_tree = tx.update(g, s_tree, p_tree)
            p_tree = optax.apply_updates(p_tree, u)
            u_tree.append(_flat(u))
            gf = _flat(g)
            parts = []
            for d, g_dev in enumerate((gf[:cut], gf[cut:])):
                u, s_dev[d] = tx.update({"shard": g_dev}, s_dev[d], p_dev[d])
                p_dev[d] = optax.apply_updates(p_dev[d], u)
                parts.append(np.asarray(u["shard"]))
            u_chunk.append(np.concatenate(parts))
    except Exception as e:  # noqa: BLE001 — any failure means we cannot vouch for it
        raise ValueError(
            f"could not check that the optimizer is elementwise: {type(e).__name__}: {e}. "
            "zeropp_jax applies the optimizer to flat primary shards; use an optax chain of "
            "elementwise transforms (adam, adamw without mask, sgd, momentum, schedules)."
        ) from e
    a, b = np.stack(u_tree), np.stack(u_chunk)
    # Elementwise transforms do the same float ops on the same values either way; 1e-5 of
    # the largest update allows only for op-fusion differences between shapes.
    if not np.all(np.abs(a - b) <= 1e-5 * np.max(np.abs(a)) + 1e-30):
        raise ValueError(
            "the optimizer is not elementwise, so it would compute something else on ZeRO's "
            "flat parameter shards than on the whole parameters. Examples of transforms "
            "that are rejected for this reason: " + "; ".join(NON_ELEMENTWISE_EXAMPLES) + ". "
            "Use elementwise transforms only (adam, adamw without mask, sgd, schedules). "
            "For global-norm gradient clipping set ZeroPPConfig(gradient_clipping=max_norm): "
            "the engine computes the norm over all devices' shards and clips exactly as "
            "optax.clip_by_global_norm does."
        )


def lr_schedule(
    peak: float, total_steps: int, *, kind: str = "cosine", warmup: int = 20
) -> optax.Schedule:
    """The examples' learning-rate schedule: linear warmup from 0 over ``warmup`` steps, then
    ``kind`` (``"cosine"`` or ``"linear"`` decay to 0 at ``total_steps``, or ``"constant"``).

    A pure function of the step counter (optax's ``count`` in the optimizer state), so a
    run resumed from a checkpoint continues the same curve.
    """
    kinds = ("cosine", "linear", "constant")
    if kind not in kinds:
        raise ValueError(f"kind={kind!r} is invalid; valid schedules are {kinds}")
    warmup = min(warmup, max(total_steps - 1, 0))
    decay = max(total_steps - warmup, 1)
    if kind == "cosine":
        after = optax.cosine_decay_schedule(peak, decay)
    elif kind == "linear":
        after = optax.linear_schedule(peak, 0.0, decay)
    else:
        after = optax.constant_schedule(peak)
    if warmup == 0:
        return after
    return optax.join_schedules([optax.linear_schedule(0.0, peak, warmup), after], [warmup])
