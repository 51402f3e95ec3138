"""The contract every model framework meets: ``ModelAdapter``.

A ZeRO-3 step never runs the user's model directly. It asks the model's adapter, chosen once
when the train state is created (``adapters.adapt``), to:

* ``run_units``: run the model's call with every call of a unit submodule routed through
  ``units[path](fn)(*arrays)``, where ``fn(params_tree, *arrays)`` runs that call on the
  unit's full weights; everything else reads ``rest`` (the weights outside every unit).
  This is the one thing a framework must provide; the unit transform, the gather order
  and generation are built on it and know nothing of the framework.
* ``apply``: run the model on full weights (stages 1 and 2, and references).
* ``call``: turn the user's call style into ``apply``'s (a transformers model is called as
  ``model(**batch, params=..., train=...)``; linen and NNX as ``apply(variables, ...)``).
* ``module_classes``: module path -> class name, for wrap policies given by class.
* ``to_pure_dict``: the consolidated params tree in the form the framework's users load
  (NNX's own keys; linen's tree as it is).

Adding a framework is one file implementing this protocol and one line in ``adapt``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Protocol

import jax

PyTree = Any
Path = tuple[str, ...]
# units[path](fn) -> call(*arrays): runs ``fn(params_tree, *arrays)`` on that unit's weights.
UnitCalls = Mapping[Path, Callable[[Callable], Callable]]


@dataclasses.dataclass(frozen=True)
class Stacked:
    """The unit callable of a scanned stack (``nn.scan``): ``make(fn, shard)`` runs ``fn``
    on the layer whose primary shard ``shard`` the current scan iteration holds."""

    make: Callable[[Callable, jax.Array], Callable]


class ModelAdapter(Protocol):
    """How zeropp_jax runs one framework's models unit by unit. Compared by identity.

    Attributes:
      kind: ``"linen"``, ``"nnx"`` or ``"transformers"``.
      module: what runs: the linen module (a transformers model's ``module``), or the NNX
        model's split form.
    """

    kind: str
    module: Any

    def run_units(self, units: UnitCalls, rest: PyTree, *args: Any, method: Any = None,
                  order: Any = None, externals: set[Path] | None = None,
                  collections: Mapping[str, PyTree] | None = None, **kwargs: Any) -> Any:
        """The model's call with unit calls routed through ``units``. Inside ``shard_map``.

        ``rest``: the params tree outside the routed units. ``order``: a
        ``GatherOrder`` that records each unit's output (bounded live weights).
        ``externals``: receives the paths of modules handed to a unit as attributes.
        ``collections``: the other variable collections (``batch_stats``), full."""
        ...

    def apply(self, variables: Mapping[str, PyTree], *args: Any, **kwargs: Any) -> Any:
        """``model.apply(variables, *args, **kwargs)`` on full weights."""
        ...

    def call(self, apply: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The user's call of ``state.apply_fn`` -> ``apply(variables, *args, **kwargs)``."""
        ...

    def module_classes(self, params: Mapping[str, PyTree]) -> dict[Path, str]:
        """Module path -> class name, as far as known without calling the model."""
        ...

    def to_pure_dict(self, tree: PyTree) -> PyTree:
        """A consolidated params tree in the form this framework's users load."""
        ...


def call_with_variables(apply: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call`` of the frameworks whose step calls ``apply_fn(variables, *args)`` as is."""
    return apply(*args, **kwargs)
