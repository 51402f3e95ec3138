"""One table of the package's old spellings: public names that were renamed or moved, and
the short import paths (``zeropp_jax.checkpoint``, ...) that stay.

An old spelling keeps working for one release and warns (``DeprecationWarning``, pointed at
the user's line) naming the new one: optax's and JAX's pattern, a module-level
``__getattr__`` built from a table. Everything here is plain data and the standard
library: ``core/config.py`` reads it for ``ZeroPPConfig.auto`` without importing the
layers above it (the new names are looked up by their dotted path when an old one is
used, long after the package has been imported).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
import warnings
from typing import Any, Callable

# The release that removes the old spellings below.
REMOVED_IN = "0.2.0"


@dataclasses.dataclass(frozen=True)
class Moved:
    """A public name that moved: ``old`` still works until ``REMOVED_IN``, warning.

    Attributes:
      old: the old dotted spelling (``"zeropp_jax.ZeroPPConfig.auto"``).
      new: the dotted spelling to use instead; the old one returns what it names.
      note: what else a user needs to know to move, or "".
    """

    old: str
    new: str
    note: str = ""

    @property
    def message(self) -> str:
        return (f"{self.old} is deprecated and will be removed in zeropp_jax {REMOVED_IN}: "
                f"use {self.new}" + (f" ({self.note})" if self.note else ""))


# Renamed and moved public names. An entry whose old spelling is a module is the module
# at the package root (kept as a thin module that warns when imported).
MOVED: dict[str, Moved] = {m.old: m for m in (
    Moved("zeropp_jax.ZeroPPConfig.auto", "zeropp_jax.auto_config",
          "same arguments: zpp.auto_config(state, nodes=..., local=..., ...)"),
    Moved("zeropp_jax.losses", "zeropp_jax.train.losses",
          "its one public name is zeropp_jax.token_mean"),
    Moved("zeropp_jax.wrap", "zeropp_jax.units.wrap",
          "TrainState.create(units=...) takes the wrap policies"),
    Moved("zeropp_jax.qgz", "zeropp_jax.collectives",
          "qgz_reduce_scatter and hierarchical_reduce_scatter are there; the rest of "
          "zeropp_jax.comm.qgz is internal"),
)}

# The documented short paths and the module each gives the public names of. They are the
# public spelling (silent); any other name of the home module read through them is an
# old spelling and warns (see ``short_path_getattr``).
SHORT_PATHS: dict[str, str] = {
    "zeropp_jax.analysis": "zeropp_jax.measure.analysis",
    "zeropp_jax.checkpoint": "zeropp_jax.train.checkpoint",
    "zeropp_jax.collectives": "zeropp_jax.comm.collectives",
    "zeropp_jax.generation": "zeropp_jax.inference.generate",
    "zeropp_jax.processes": "zeropp_jax.core.processes",
    "zeropp_jax.quantization": "zeropp_jax.quant.quantization",
    "zeropp_jax.ulysses": "zeropp_jax.parallel.ulysses",
    "zeropp_jax.viz": "zeropp_jax.measure.viz",
}

_ROOT = os.path.dirname(os.path.abspath(__file__))


_IMPORTLIB = os.path.dirname(os.path.abspath(importlib.__file__))


def _skipped_by_warnings(filename: str) -> bool:
    # warnings.warn leaves the import system's bootstrap frames out when it counts
    # stacklevel (CPython's ``_is_internal_frame``).
    return "importlib" in filename and "_bootstrap" in filename


def _internal(filename: str) -> bool:
    """A frame of the deprecation machinery: this package's root modules (this one, the
    thin modules, ``__init__``) or Python's import system."""
    return (_skipped_by_warnings(filename) or os.path.dirname(os.path.abspath(filename))
            in (_ROOT, _IMPORTLIB))


def warn(message: str) -> None:
    """``DeprecationWarning(message)`` attributed to the first frame outside the package
    root and the import system: the user's line (so Python's default filter shows it when
    that line is in ``__main__``)."""
    level, frame = 1, sys._getframe(0)
    while frame is not None and _internal(frame.f_code.co_filename):
        frame = frame.f_back
        level += frame is not None and not _skipped_by_warnings(frame.f_code.co_filename)
    warnings.warn(message, DeprecationWarning, stacklevel=level)


def resolve(dotted: str) -> Any:
    """The object a dotted path names: its longest importable module prefix, then
    attributes (``"zeropp_jax.auto_config"`` -> the package's ``auto_config``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def moved(old: str) -> Any:
    """``MOVED[old]``'s new object, warning that ``old`` is deprecated."""
    entry = MOVED[old]
    warn(entry.message)
    return resolve(entry.new)


class MovedAttribute:
    """A class attribute that moved (``ZeroPPConfig.auto = MovedAttribute(
    "zeropp_jax.ZeroPPConfig.auto")``): reading it, on the class or an instance, warns
    and returns what its ``MOVED`` entry's new spelling names. Not a dataclass field (it
    has no annotation)."""

    def __init__(self, old: str):
        if old not in MOVED:
            raise KeyError(f"{old!r} is not in zeropp_jax._deprecations.MOVED")
        self.old = old

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        return moved(self.old)


def package_getattr(name: str) -> Any:
    """The package root's ``__getattr__``: a moved root module (``zpp.losses``) is
    imported on first use, and warns as it is."""
    if f"zeropp_jax.{name}" in MOVED:
        return importlib.import_module(f"zeropp_jax.{name}")
    raise AttributeError(f"module 'zeropp_jax' has no attribute {name!r}")


def short_path_getattr(path: str) -> Callable[[str], Any]:
    """The ``__getattr__`` of the short path ``path``: its public names are imported into
    it; any other public name of its home module is forwarded with a warning naming the
    home (the one spelling of an internal name)."""
    home = SHORT_PATHS[path]

    def __getattr__(name: str) -> Any:
        module = importlib.import_module(home)
        if name.startswith("_") or not hasattr(module, name):
            raise AttributeError(f"module {path!r} has no attribute {name!r}")
        warn(f"{path}.{name} is not part of {path}'s public names and will stop working "
             f"in zeropp_jax {REMOVED_IN}: import it from {home} (internal, may change "
             f"between releases), or use {path}'s public names: see the API reference")
        return getattr(module, name)

    return __getattr__
