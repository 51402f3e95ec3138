"""Hugging Face ``FlaxPreTrainedModel``s: the linen adapter of their module, their call style.

``transformers``' Flax models wrap a linen module (``model.module``) and its parameters
(``model.params``); their ``__call__(input_ids, ..., params=, dropout_rng=, train=)`` builds
default inputs (attention masks, position ids, BERT's float ``head_mask``) and then calls
``self.module.apply({"params": params}, ...)``. ``hf_call`` runs that same ``__call__`` on
a shallow copy whose ``module.apply`` is the engine's sharded apply, so a step written as
in transformers' Flax example scripts (``state.apply_fn(**batch, params=params,
dropout_rng=rng, train=True)``) works unchanged. transformers is not imported here.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable, Mapping

import flax.linen as nn

from zeropp_jax.units.adapters.linen import LinenAdapter

PyTree = Any


def is_hf_model(model: Any) -> bool:
    """True for a transformers ``FlaxPreTrainedModel`` (by its shape, not by import)."""
    # ``params`` on the class: on a model built with ``_do_init=False`` the instance's
    # property raises ValueError (which ``hasattr`` does not catch).
    return (not isinstance(model, nn.Module) and isinstance(getattr(model, "module", None),
                                                            nn.Module)
            and hasattr(type(model), "params") and hasattr(model, "config"))


class _ShardedModule:
    """Stands in for a FlaxPreTrainedModel's ``module``: ``apply`` is the sharded apply."""

    def __init__(self, module: nn.Module, apply: Callable[..., Any]):
        self._module, self._apply = module, apply

    def apply(self, variables: Any, *args: Any, **kwargs: Any) -> Any:
        return self._apply(variables, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def hf_call(wrapper: Any, apply: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``wrapper(*args, **kwargs)`` (a FlaxPreTrainedModel's ``__call__``) with its
    ``module.apply`` replaced by ``apply`` (``{"params": ShardedParams}, ...`` -> output).

    ``params=`` must be the step's ``ShardedParams``: without it the wrapper would fall back
    to its own full ``params``, which are not what the step differentiates."""
    if kwargs.get("params") is None:
        raise TypeError(
            "state.apply_fn(..., params=params) needs the parameters being differentiated "
            "(state.params, or what jax.grad passes): the model's own .params are not "
            "sharded and would receive no gradient"
        )
    shallow = copy.copy(wrapper)
    # FlaxPreTrainedModel.module is a property returning _module.
    object.__setattr__(shallow, "_module", _ShardedModule(wrapper.module, apply))
    return type(wrapper).__call__(shallow, *args, **kwargs)


@dataclasses.dataclass(frozen=True, eq=False)
class TransformersAdapter(LinenAdapter):
    """A ``FlaxPreTrainedModel`` as a ``ModelAdapter``: its ``module`` runs as any linen
    module; ``call`` also takes the model's own call style
    (``apply_fn(**batch, params=params, dropout_rng=rng, train=True)``).

    Attributes:
      wrapper: the ``FlaxPreTrainedModel`` (its ``__call__`` builds default inputs).
    """

    wrapper: Any = None
    kind: str = "transformers"

    @classmethod
    def of(cls, wrapper: Any) -> "TransformersAdapter":
        return cls(wrapper.module, wrapper=wrapper)

    def call(self, apply: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if args and isinstance(args[0], Mapping):  # apply_fn({"params": ...}, ...): as linen
            return apply(*args, **kwargs)
        return hf_call(self.wrapper, apply, *args, **kwargs)
