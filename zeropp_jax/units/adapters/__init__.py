"""One adapter per model framework (linen, NNX, transformers), chosen once by ``adapt``.

(``flax.nnx`` is not imported here by that name: the submodule ``adapters.nnx`` takes the
name ``nnx`` in this package once it is imported.)

The contract is ``base.ModelAdapter``. ``adapt`` is the only place that looks at what kind
of model it was given; everything after asks the adapter.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.linen as nn

from zeropp_jax.units.adapters.base import ModelAdapter, PyTree, Stacked, UnitCalls
from zeropp_jax.units.adapters.linen import LinenAdapter
from zeropp_jax.units.adapters.nnx import NNXModel, is_nnx
from zeropp_jax.units.adapters.transformers import TransformersAdapter, is_hf_model

ADAPTERS = (LinenAdapter, NNXModel, TransformersAdapter)


def adapt(model: Any, params: PyTree = None, collections: Mapping[str, PyTree] | None = None
          ) -> tuple[ModelAdapter, PyTree, dict[str, PyTree]]:
    """``model`` -> (its adapter, its params tree, its other collections).

    ``model``: a linen ``nn.Module`` (``params`` required), a transformers
    ``FlaxPreTrainedModel`` (``params`` default: its own ``.params``), an ``nnx.Module``
    (``params`` default: its ``nnx.Param`` values; its other state joins ``collections``),
    or an adapter already (returned as it is). Raises TypeError naming what is accepted.
    """
    collections = dict(collections or {})
    if isinstance(model, ADAPTERS):
        return model, params, collections
    if is_hf_model(model):
        return TransformersAdapter.of(model), model.params if params is None else params, \
            collections
    if is_nnx(model):
        adapter, own, others = NNXModel.from_module(model)
        # params=None: the module's own nnx.Param values; else an nnx.State or pure dict
        # of the same parameters (e.g. trained elsewhere), checked path by path.
        params = own if params is None else adapter.params_from(params, own)
        return adapter, params, {**others, **collections}
    if isinstance(model, nn.Module):
        # Boxed parameters (``nn.with_logical_partitioning``, ``nn.Partitioned``; under
        # ``nn.scan(metadata_params=...)`` the box carries the layer axis): ZeRO decides the
        # sharding itself, so the values are what it needs. Unboxed here, once, the trees
        # show their real shapes to the unit policy (a scanned stack's leading layer axis)
        # and the model reads raw arrays as it does from any unboxed tree.
        return (LinenAdapter(model), None if params is None else nn.meta.unbox(params),
                {k: nn.meta.unbox(v) for k, v in collections.items()})
    raise TypeError(
        f"model must be a Flax linen nn.Module, an nnx.Module or a transformers "
        f"FlaxPreTrainedModel, got {type(model).__name__}"
    )


def as_adapter(model: Any) -> ModelAdapter | None:
    """``model``'s adapter (None stays None), for functions that also take a bare model."""
    return None if model is None else adapt(model)[0]


__all__ = [
    "ADAPTERS",
    "LinenAdapter",
    "ModelAdapter",
    "NNXModel",
    "Stacked",
    "TransformersAdapter",
    "UnitCalls",
    "adapt",
    "as_adapter",
]
