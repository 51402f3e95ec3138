"""Wrap policies: which modules of a model are units (gathered together, one at a time).

A *unit* is a module subtree of the params tree whose weights are one flat buffer, gathered
just before the module's call and freed after it. ``resolve_units(spec, params, model)``
turns the user's ``units=`` into module paths:

- ``None`` / ``"auto"`` (default): the repeated blocks at any depth, the way PyTorch FSDP's
  ``transformer_auto_wrap_policy`` wraps each transformer layer, found without naming the
  class: sibling modules named alike with a trailing index (``h/0, h/1``; ``block_0,
  block_1``; ``layer/0``; ``encoderdecoderblock_0``) are a block list, and each member is a
  unit. Modules outside every block (embeddings, heads, final norms) become units of their
  own if they are at least a quarter of a block, else join the *rest* unit (gathered for the
  whole step, as FSDP's root unit is). A model with no block list falls back to its direct
  children.
- ``"children"``: every direct child module of the root.
- a sequence of entries, each a module path (``("decoder", "layers_0")`` or
  ``"decoder/layers_0"``), a path glob (``"transformer/h/*"``), a module class or a class
  name (``FlaxGPT2Block`` / ``"FlaxGPT2Block"``: every module of that class, outermost).
- an ``int``: a size threshold, like FSDP's ``size_based_auto_wrap_policy``: the deepest
  modules holding at least that many parameters.
- a callable ``policy(path, subtree) -> bool`` called top-down on every module: True makes
  that module a unit (its submodules are then not asked).

Parameters outside every unit form the rest unit (``partition.REST``). Only params-tree
structure and module classes are used: no call of the model is traced here.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from zeropp_jax.units.adapters import as_adapter

PyTree = Any
Path = tuple[str, ...]

# Sibling names that differ only by a trailing index are one block list.
_INDEXED = re.compile(r"^(.*?)[_\-.]?(\d+)$")


def _size(tree: Any) -> int:
    if isinstance(tree, Mapping):
        return sum(_size(v) for v in tree.values())
    return int(math.prod(np.shape(tree)))


def module_paths(params: Mapping[str, Any]) -> list[Path]:
    """Every module path of a params tree (each dict node below the root), top-down."""
    out: list[Path] = []

    def walk(tree: Mapping[str, Any], path: Path) -> None:
        for k, v in tree.items():
            if isinstance(v, Mapping):
                out.append(path + (k,))
                walk(v, path + (k,))

    walk(params, ())
    return out


def _subtree(params: Mapping[str, Any], path: Path) -> Any:
    for k in path:
        params = params[k]
    return params


def module_classes(model: Any, params: Mapping[str, Any]) -> dict[Path, str]:
    """Module path -> class name, as far as it is known without calling the model.

    ``model``: the model or its adapter (None: names only). The adapter knows what its
    framework can tell without a call (linen: the modules made in ``setup``; NNX: every
    submodule); modules made inline (``nn.compact``) exist only during a call, so their
    class is read from Flax's automatic name (``Dense_0`` -> ``"Dense"``). Paths of
    neither kind are missing from the result.
    """
    adapter = as_adapter(model)
    classes = {} if adapter is None else dict(adapter.module_classes(params))
    for path in module_paths(params):
        if path not in classes:
            m = re.match(r"^([A-Z]\w*?)_\d+$", str(path[-1]))
            if m:
                classes[path] = m.group(1)
    return classes


def _block_lists(params: Mapping[str, Any]) -> list[list[Path]]:
    """Outermost groups of sibling modules named alike with a trailing index."""
    groups: list[list[Path]] = []

    def walk(tree: Mapping[str, Any], path: Path) -> None:
        by_stem: dict[str, list[str]] = {}
        for k, v in tree.items():
            if isinstance(v, Mapping) and _size(v):
                m = _INDEXED.match(str(k))
                if m:
                    by_stem.setdefault(m.group(1), []).append(k)
        members = set()
        for keys in by_stem.values():
            if len(keys) >= 2:
                groups.append([path + (k,) for k in keys])
                members.update(keys)
        for k, v in tree.items():
            if isinstance(v, Mapping) and k not in members:
                walk(v, path + (k,))

    walk(params, ())
    return groups


def scan_stacks(params: Mapping[str, Any]) -> tuple[Path, ...]:
    """Modules that look like ``nn.scan`` stacks (``variable_axes={"params": 0}``): every
    parameter below them has a leading layer axis of one common length ``L``.

    The test is strict, so ordinary modules do not pass it: at least two parameters, all
    of rank >= 2 (a stacked bias or norm scale is ``[L, d]``; an unstacked one is 1-D),
    below a module with submodules, and ``L`` smaller than each parameter's largest other
    dimension (attention's four ``[d, d]`` kernels share a leading ``d`` but are not
    smaller than themselves). Outermost matches only."""
    found: list[Path] = []

    def looks_stacked(tree: Mapping[str, Any]) -> bool:
        shapes = [np.shape(x) for x in _leaves(tree)]
        if len(shapes) < 2 or any(len(sh) < 2 for sh in shapes):
            return False
        lead = {sh[0] for sh in shapes}
        if len(lead) != 1:
            return False
        (layers,) = lead
        return layers >= 2 and all(layers < max(sh[1:]) for sh in shapes)

    def walk(tree: Mapping[str, Any], path: Path) -> None:
        for k, v in tree.items():
            if not isinstance(v, Mapping):
                continue
            nested = any(isinstance(c, Mapping) for c in v.values())
            if nested and looks_stacked(v):
                found.append(path + (k,))
            else:
                walk(v, path + (k,))

    walk(params, ())
    return tuple(found)


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, Mapping):
        return [x for v in tree.values() for x in _leaves(v)]
    return [tree]


def children_units(params: Mapping[str, Any]) -> tuple[Path, ...]:
    """Every direct child module of the root (``units="children"``)."""
    return tuple((k,) for k, v in params.items() if isinstance(v, Mapping) and _size(v))


def auto_units(params: Mapping[str, Any]) -> tuple[Path, ...]:
    """The default policy: repeated blocks at any depth, large leftovers as own units."""
    groups = _block_lists(params)
    if not groups:
        return children_units(params)
    block = max(float(np.median([_size(_subtree(params, p)) for p in g])) for g in groups)
    # A list of tiny modules (two norms named norm_0, norm_1) is not a list of blocks.
    blocks = [p for g in groups
              if np.median([_size(_subtree(params, p)) for p in g]) >= block / 8 for p in g]
    chosen = set(blocks)
    units = list(blocks)

    def leftovers(tree: Mapping[str, Any], path: Path) -> None:
        # Maximal modules containing no unit: a unit if large, else the rest unit.
        for k, v in tree.items():
            if not isinstance(v, Mapping) or path + (k,) in chosen:
                continue
            sub = path + (k,)
            if any(c[: len(sub)] == sub for c in chosen):
                leftovers(v, sub)
            elif _size(v) >= block / 4:
                units.append(sub)

    leftovers(params, ())
    return tuple(units)


def _outermost(paths: Iterable[Path]) -> list[Path]:
    """The paths not inside another of them, in their given order."""
    paths = list(dict.fromkeys(paths))
    return [p for p in paths if not any(q != p and p[: len(q)] == q for q in paths)]


def _by_size(params: Mapping[str, Any], threshold: int) -> list[Path]:
    """The deepest modules holding at least ``threshold`` parameters."""
    out: list[Path] = []

    def walk(tree: Mapping[str, Any], path: Path) -> bool:
        found = False
        for k, v in tree.items():
            if isinstance(v, Mapping):
                found |= walk(v, path + (k,))
        if not found and path and _size(tree) >= threshold:
            out.append(path)
            return True
        return found

    walk(params, ())
    return out


def _by_callable(params: Mapping[str, Any], policy: Callable[[Path, Any], bool]) -> list[Path]:
    out: list[Path] = []

    def walk(tree: Mapping[str, Any], path: Path) -> None:
        for k, v in tree.items():
            if isinstance(v, Mapping):
                if policy(path + (k,), v):
                    out.append(path + (k,))
                else:
                    walk(v, path + (k,))

    walk(params, ())
    return out


def resolve_units(spec: Any, params: Mapping[str, Any], model: Any = None) -> tuple[Path, ...]:
    """``units=`` (see the module docstring) -> the unit module paths, outermost first.

    Raises ValueError naming the available paths when an entry matches nothing."""
    if spec is None or (isinstance(spec, str) and spec == "auto"):
        return auto_units(params)
    if isinstance(spec, str) and spec == "children":
        return children_units(params)
    if isinstance(spec, bool):
        raise TypeError("units= takes paths, globs, classes, an int or a callable, not a bool")
    if isinstance(spec, int):
        if spec <= 0:
            raise ValueError(f"a size threshold units={spec} must be positive")
        return tuple(_by_size(params, spec))
    if callable(spec) and not isinstance(spec, type):
        return tuple(_by_callable(params, spec))
    if isinstance(spec, (str, type)):
        spec = [spec]
    paths = module_paths(params)
    known = set(paths)
    classes: dict[Path, str] | None = None
    chosen: list[Path] = []
    for entry in spec:
        if isinstance(entry, type) or (isinstance(entry, str) and "/" not in entry
                                       and not any(c in entry for c in "*?[")
                                       and (entry,) not in known):
            name = entry.__name__ if isinstance(entry, type) else entry
            if classes is None:
                classes = module_classes(model, params)
            hits = _outermost(p for p, c in classes.items() if c == name)
            if not hits:
                raise ValueError(
                    f"units entry {name!r} is neither a top-level module nor the class of "
                    f"any module found (classes: {sorted(set(classes.values()))}; top-level "
                    f"modules: {[p[0] for p in paths if len(p) == 1]}). Classes are known "
                    "for modules made in setup() and for inline (nn.compact) modules with "
                    "Flax's automatic names (Dense_0); an inline module given name= has no "
                    "class until the model runs: select it by path glob, e.g. 'block_*'"
                )
            chosen.extend(hits)
        elif isinstance(entry, str) and any(c in entry for c in "*?["):
            hits = [p for p in paths if fnmatch.fnmatchcase("/".join(map(str, p)), entry)]
            if not hits:
                raise ValueError(
                    f"units glob {entry!r} matches no module path; paths look like "
                    f"{['/'.join(map(str, p)) for p in paths[:8]]}"
                )
            chosen.extend(_outermost(hits))
        else:
            want = tuple(entry.split("/")) if isinstance(entry, str) else tuple(entry)
            # Keys may be ints (an NNX list through nnx.bridge): match by their text.
            by_text = {tuple(map(str, p)): p for p in paths}
            chosen.append(by_text.get(tuple(map(str, want)), want))
    seen: set[Path] = set()
    return tuple(p for p in chosen if not (p in seen or seen.add(p)))


def describe_units(rows: Sequence[tuple[str, int, int]], total: int) -> str:
    """A table of units: name, parameters, share of all parameters, per-device shard."""
    width = max([len("unit")] + [len(r[0]) for r in rows])
    lines = [f"{'unit':<{width}}  {'params':>12}  {'share':>6}  {'shard/device':>12}"]
    for name, n, shard in rows:
        lines.append(f"{name:<{width}}  {n:>12,}  {100 * n / max(total, 1):>5.1f}%  {shard:>12,}")
    lines.append(f"{'total':<{width}}  {total:>12,}  {len(rows):>5} units")
    return "\n".join(lines)


def warn_if_unbalanced(rows: Sequence[tuple[str, int, int]], total: int,
                       params: Mapping[str, Any]) -> None:
    """Warns when one unit holds more than half of all parameters: its gathered weights
    are then most of the model, and ZeRO-3 saves little memory on weights."""
    if len(rows) <= 1 and total < 2:
        return
    name, n, _ = max(rows, key=lambda r: r[1])
    if n * 2 <= total:
        return
    hint = ""
    inner = [p for p in module_paths(params) if "/".join(map(str, p)).startswith(name + "/")
             or name == "<rest>"]
    if inner:
        hint = (f" Modules inside it include {['/'.join(map(str, p)) for p in inner[:4]]}; e.g. "
                f"units=['{'/'.join(map(str, inner[0][:-1] + ('*',))) if len(inner[0]) > 1 else inner[0][0]}']")
    warnings.warn(
        f"unit {name!r} holds {100 * n / total:.0f}% of the parameters, so ZeRO-3 saves "
        "little weight memory: choose smaller units with TrainState.create(..., units=...) "
        "(module paths, globs like 'decoder/*', module classes, or a size threshold), or "
        "for an nn.scan stack pass stacked=[path]." + hint,
        stacklevel=3,
    )
