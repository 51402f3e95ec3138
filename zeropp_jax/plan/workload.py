"""What one train step does on each device, for the cost model: from a config and a model.

``ModelShape`` is all the cost model needs of a model: its units' parameter counts in call
order, which units' backward needs no weights, and flops and activation bytes per token.
Get one from a ``TrainState`` (``shape_of_state``), from a params tree and a wrap policy
(``shape_of_params``), or from a transformer's dimensions (``transformer_shape``, for models
too large to build).

``config_workload(config, shape, nodes, local, tokens_per_device)`` lists the step's
collectives the way the engine runs them, each traced from the unit's own transports on an
abstract ``nodes x local`` mesh (``comm.transports.base.weight_collectives``), so the bytes
and the count of collectives between nodes are what the library moves at that mesh size:

* forward: every unit's gather (the rest unit's once for the whole step);
* backward: every unit's regather, except the rest unit (kept for the step), the unit
  called last when ``config.keep_last_unit`` (its weights stay from forward), and units
  whose backward needs no weights (an embedding lookup: XLA drops that gather);
* gradients: every trainable unit's reduce-scatter;
* with ``config.bucket``, the rest unit's gather and reduce-scatter travel inside the first
  unit's (``units.bucket``): the same bytes, two collectives fewer;
* one all-reduce of the step's scalars (loss and metrics share it).

``report_workload`` reads the same from a compiled program's ``CommReport`` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax

from zeropp_jax.comm.frozen import frozen_alignment
from zeropp_jax.comm.hpz import group_nodes
from zeropp_jax.comm.partition import REST, padded_length
from zeropp_jax.comm.transports import (
    gradient_transport,
    weight_transport,
)
from zeropp_jax.comm.transports.base import gradient_collectives, weight_collectives
from zeropp_jax.comm.wire import TracedCollective, axis_groups, count_bytes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import AXES
from zeropp_jax.measure.comm_report import CommReport
from zeropp_jax.plan.cost_model import CollectiveCost, Workload
from zeropp_jax.units.apply import first_unit, kept_unit
from zeropp_jax.units.bucket import config_allows

# Adam's two fp32 moments per parameter.
ADAM_BYTES_PER_PARAM = 8


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the cost model needs of a model.

    Attributes:
      units: ``(name, trainable parameters)`` per unit, in the order forward calls them
        (the rest unit, ``partition.REST``, anywhere: it is gathered once for the step).
      frozen: ``(name, frozen parameters)`` per unit with a frozen part (LoRA bases).
      no_regather: units whose backward needs no weights (embedding lookups).
      kept: the unit ``config.keep_last_unit`` keeps from forward to backward (the
        engine's choice once a step was traced: ``units.apply.kept_unit``), or None.
      first: the unit called first, if no other unit is called between its calls
        (``units.apply.first_unit``): with ``config.bucket`` it shares the rest unit's
        forward gather and gradient reduce-scatter (``units.bucket``); None: no unit.
      flops_per_token: forward + backward flops per token of the whole model.
      activation_bytes_per_token: bytes of saved activations per token (0: not counted).
      name: what model this is.
    """

    units: tuple[tuple[str, int], ...]
    frozen: tuple[tuple[str, int], ...] = ()
    no_regather: frozenset[str] = frozenset()
    kept: str | None = None
    first: str | None = None
    flops_per_token: float = 0.0
    activation_bytes_per_token: float = 0.0
    name: str = ""

    @property
    def params(self) -> int:
        return sum(n for _, n in self.units) + sum(n for _, n in self.frozen)



def transformer_shape(layers: int, d_model: int, vocab: int, seq_len: int, *,
                      ffn: int | None = None, tied: bool = False, name: str = ""
                      ) -> ModelShape:
    """A GPT-style decoder: token embedding, ``layers`` blocks of attention (4 d^2) and an
    MLP (2 d ffn, ``ffn`` = 4 d by default) with two LayerNorms, a final norm, and an
    output head (shared with the embedding when ``tied``).

    Flops per token: 6 x the matmul parameters (forward 2, backward 4) plus attention's
    scores and weighted sum, 12 x layers x d_model x seq_len (forward + backward), as in the
    ZeRO, Megatron and PaLM papers' accounting. Units: the blocks; the embedding and the
    head are units of their own (each at least a quarter of a block at these sizes), and
    the final norm is the rest unit. The embedding's backward needs no weights."""
    ffn = 4 * d_model if ffn is None else ffn
    # Weights, then biases (qkv 3d, proj d, fc ffn, out d) and two LayerNorms (4d).
    block = 4 * d_model * d_model + 2 * d_model * ffn + 9 * d_model + ffn
    embed = vocab * d_model
    units = [("wte", embed)] + [(f"block_{i}", block) for i in range(layers)]
    if not tied:
        units.append(("head", embed))
    units.append((REST, 2 * d_model))
    matmul = layers * (4 * d_model * d_model + 2 * d_model * ffn) + embed
    flops = 6.0 * matmul + 12.0 * layers * d_model * seq_len
    return ModelShape(tuple(units), no_regather=frozenset({"wte"} if not tied else ()),
                      kept=_last_called(units), first=None if tied else "wte",
                      flops_per_token=flops,
                      name=name or f"GPT {layers}L d{d_model} ({sum(n for _, n in units):,})")


def shape_of_state(state: Any, *, flops_per_token: float | None = None,
                   activation_bytes_per_token: float = 0.0) -> ModelShape:
    """The ``ModelShape`` of a ``TrainState``'s units.

    Once a step of this state has been traced (lowered or run), units are ordered as
    forward calls them and the kept unit is the engine's own choice; before that, the
    engine's order and its last unit stand in, so the kept unit may be guessed wrong (one
    unit's regather). Units holding only ``embedding``
    leaves need no weights in backward. ``flops_per_token`` defaults to 6 x the trainable
    parameters (forward 2, backward 4)."""
    engine = state.engine
    units = [(name, lay.n) for name, lay in engine.layouts.items()]
    frozen = tuple((name, lay.n) for name, lay in engine.frozen_layouts.items())
    kept, first_called = _last_called(units), _first_called(units)
    traced = engine.memo.get("resident") or {}
    if traced:
        resident, calls = list(traced.values())[-1]
        path = first_unit(calls)
        first_called = (None if path is None or path in resident
                        else "/".join(map(str, path)))
        first = {}
        for path in calls:
            first.setdefault("/".join(map(str, path)), len(first))
        units.sort(key=lambda u: first.get(u[0], len(first)))
        sizes: dict[tuple, int] = {}
        for lays in (engine.layouts, engine.frozen_layouts):
            for name, lay in lays.items():
                if name != REST:
                    sizes[tuple(lay.path)] = sizes.get(tuple(lay.path), 0) + lay.n
        path = kept_unit(calls, sizes)
        kept = None if path is None else "/".join(map(str, path))
    embeddings = frozenset(
        name for name, lay in engine.layouts.items()
        if name != REST and _only_embeddings(
            jax.tree_util.tree_unflatten(lay.treedef, [0] * len(lay.shapes))))
    return _shape(tuple(units), frozen, embeddings, kept, flops_per_token,
                  activation_bytes_per_token, first_called)


def shape_of_params(params: Mapping[str, Any], units: Any = None, model: Any = None, *,
                    flops_per_token: float | None = None,
                    activation_bytes_per_token: float = 0.0) -> ModelShape:
    """The ``ModelShape`` of a params tree (arrays or ``jax.ShapeDtypeStruct``) under the
    wrap policy ``units`` (as ``TrainState.create`` takes it; default: auto)."""
    from zeropp_jax.comm.partition import split_units, unit_name
    from zeropp_jax.units.wrap import resolve_units

    params = dict(params["params"]) if "params" in params else dict(params)
    count = lambda tree: sum(int(math.prod(jax.numpy.shape(x)))  # noqa: E731
                             for x in jax.tree_util.tree_leaves(tree))
    units, rest = split_units(params, resolve_units(units, params, model))
    sizes = tuple((unit_name(p), count(sub)) for p, sub in units.items())
    if count(rest):
        sizes += ((REST, count(rest)),)
    embeddings = frozenset(unit_name(p) for p, sub in units.items() if _only_embeddings(sub))
    return _shape(sizes, (), embeddings, _last_called(sizes), flops_per_token,
                  activation_bytes_per_token, _first_called(sizes))


def _shape(units: tuple[tuple[str, int], ...], frozen: tuple[tuple[str, int], ...],
           embeddings: frozenset[str], kept: str | None, flops_per_token: float | None,
           activation_bytes_per_token: float, first: str | None = None) -> ModelShape:
    trainable = sum(n for _, n in units)
    return ModelShape(units, frozen, embeddings, kept, first,
                      6.0 * trainable if flops_per_token is None else flops_per_token,
                      activation_bytes_per_token)


def _last_called(units: Any) -> str | None:
    """The last unit of ``(name, size)`` pairs other than the rest unit (the one
    ``keep_last_unit`` keeps when the units are in call order and each is called once)."""
    called = [name for name, _ in units if name != REST]
    return called[-1] if called else None


def _first_called(units: Any) -> str | None:
    """The first unit of ``(name, size)`` pairs other than the rest unit."""
    called = [name for name, _ in units if name != REST]
    return called[0] if called else None


def _only_embeddings(tree: Any) -> bool:
    """True if every leaf of ``tree`` is named ``embedding`` (an embedding table: its
    backward needs no weights)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return bool(leaves) and all(str(getattr(p[-1], "key", p[-1])) == "embedding"
                                for p, _ in leaves)


@functools.lru_cache(maxsize=4096)
def _unit_phases(config: ZeroPPConfig, n: int, nodes: int, local: int
                 ) -> tuple[tuple[TracedCollective, ...], ...]:
    """(forward, backward, gradient) collectives of a trainable unit of ``n`` parameters."""
    n_pad = padded_length(n, nodes * local, config.flat_alignment)
    w = weight_collectives(weight_transport(config), n_pad, config.param_jnp_dtype, nodes,
                           local)
    g = gradient_collectives(gradient_transport(config), n_pad, config.compute_jnp_dtype,
                             nodes, local)
    return w["forward"], w["backward"], g


def _frozen_phases(config: ZeroPPConfig, n: int, nodes: int, local: int
                   ) -> tuple[tuple[TracedCollective, ...], ...]:
    from zeropp_jax.comm.partition import UnitLayout

    devices = nodes * local
    n_pad = padded_length(n, devices, frozen_alignment(config))
    layout = UnitLayout("frozen", (), None, ((n,),), n, n_pad, devices)
    w = weight_collectives(weight_transport(config, layout), n_pad, config.param_jnp_dtype,
                           nodes, local)
    return w["forward"], w["backward"]


def _costs(what: str, traced: tuple[TracedCollective, ...], nodes: int, local: int
           ) -> list[CollectiveCost]:
    return [CollectiveCost(what, c.kind, c.bytes.cross / nodes,
                           c.bytes.intra / (nodes * local), c.spans_nodes) for c in traced]


def _quantized_elems(config: ZeroPPConfig, n: int, gathers: int, reduced: bool,
                     local: int) -> tuple[float, float]:
    """Elements one device runs through quantization kernels for one unit per step, (weight
    path, gradient path): qwZ dequantizes the whole unit per gather (quantizing its own
    shard is 1/P of that); qgZ quantizes the full gradient and requantizes the node's
    partial sums (``n + 2 n / L``); a Hadamard rotation reads the data once more."""
    weights = grads = 0.0
    if config.qwz:
        weights = gathers * n * (2 if config.qwz_hadamard else 1)
    if config.qgz and reduced:
        grads = (n + 2 * n / local) * (2 if config.qgz_hadamard else 1)
    return weights, grads


def config_workload(config: ZeroPPConfig, shape: ModelShape, nodes: int, local: int,
                    tokens_per_device: float = 0.0, label: str = "", scalar_bytes: int = 8
                    ) -> Workload:
    """One step of ``config`` training ``shape`` on a ``nodes x local`` mesh with
    ``tokens_per_device`` tokens per device (rules in the module docstring).
    ``scalar_bytes``: the step's scalar outputs (loss and metrics), all-reduced together."""
    if config.stage != 3:
        raise ValueError("the cost model covers ZeRO-3 and ZeRO++ (stage=3) configurations; "
                         f"got stage={config.stage}")
    devices = nodes * local
    itemsize = config.compute_jnp_dtype.itemsize
    p_item = config.param_jnp_dtype.itemsize
    kept = shape.kept if config.keep_last_unit else None
    costs: list[CollectiveCost] = []
    quant = grad_quant = 0.0
    largest = 0
    sizes, frozen_names = dict(shape.units), dict(shape.frozen)
    # The unit whose forward gather and gradient reduce-scatter carry the rest unit's too.
    partner = shape.first if (
        config_allows(config) and REST in sizes and REST not in frozen_names
        and shape.first in sizes and shape.first != kept
        and shape.first not in frozen_names) else None
    for name, n in shape.units:
        fwd, bwd, grad = _unit_phases(config, n, nodes, local)
        if name == partner:  # one collective moves both: the padded lengths add up
            pad = functools.partial(padded_length, num_shards=devices,
                                    align=config.flat_alignment)
            fwd, _, grad = _unit_phases(config, pad(n) + pad(sizes[REST]), nodes, local)
        regathers = name not in (REST, kept) and name not in shape.no_regather
        if not (name == REST and partner):
            costs += _costs(f"{name} forward", fwd, nodes, local)
        if regathers:
            costs += _costs(f"{name} backward", bwd, nodes, local)
        if not (name == REST and partner):
            costs += _costs(f"{name} gradient", grad, nodes, local)
        w_elems, g_elems = _quantized_elems(config, n, 1 + regathers, True, local)
        quant, grad_quant = quant + w_elems + g_elems, grad_quant + g_elems
        if name != REST:
            largest = max(largest, n)
    for name, n in shape.frozen:
        fwd, bwd = _frozen_phases(config, n, nodes, local)
        regathers = name != kept and name not in shape.no_regather
        costs += _costs(f"{name} frozen forward", fwd, nodes, local)
        if regathers:
            costs += _costs(f"{name} frozen backward", bwd, nodes, local)
        largest = max(largest, n)
    # The step's scalars (loss, metrics) share one all-reduce over every device.
    intra, cross = count_bytes("all-reduce", scalar_bytes, axis_groups(AXES, nodes, local),
                               local)
    costs.append(CollectiveCost("loss and metrics", "all-reduce", cross / nodes,
                                intra / devices, nodes > 1))
    trainable = sum(n for _, n in shape.units)
    frozen = sum(n for _, n in shape.frozen)
    rest = dict(shape.units).get(REST, 0)
    states = (trainable * (p_item + 4 + ADAM_BYTES_PER_PARAM)
              + frozen * (1 if config.quantize_frozen else p_item)) / devices
    # Live full weights: the rest unit for the step, the kept unit, and the unit being used
    # plus ``prefetch`` gathered ahead; one unit's full gradient while it is reduced.
    kept_n = dict(shape.units).get(kept, 0) if kept else 0
    live = (rest + kept_n + (1 + config.prefetch) * largest) * itemsize + largest * itemsize
    secondary = 0.0
    if config.hpz:
        group = group_nodes(config.hpz_group_size, nodes, local) * local
        secondary = sum(padded_length(n, devices, config.flat_alignment) / group * itemsize
                        for name, n in shape.units + shape.frozen if name != REST)
    memory = states + live + secondary + tokens_per_device * shape.activation_bytes_per_token
    return Workload(tuple(costs), tokens_per_device * shape.flops_per_token, quant, memory,
                    label or config_label(config), grad_quant)


def report_workload(report: CommReport, flops_per_device: float = 0.0,
                    quant_elems_per_device: float = 0.0, memory_bytes_per_device: float = 0.0,
                    label: str = "") -> Workload:
    """The workload of a compiled step: its collectives read from ``report``
    (``measure.comm_report``), with flops, quantized elements and memory given."""
    devices = report.nodes * report.local
    costs = tuple(CollectiveCost(f"{r.kind} {r.dtype}{list(r.shape)}", r.kind,
                                 r.cross_node_bytes / report.nodes,
                                 r.intra_node_bytes / devices, r.spans_nodes(report.local),
                                 r.count)
                  for r in report.rows)
    return Workload(costs, flops_per_device, quant_elems_per_device, memory_bytes_per_device,
                    label)


def config_label(config: ZeroPPConfig) -> str:
    """A short name: ``zero3``, or the ZeRO++ techniques on (``qwz-int4+hpz2+qgz``...)."""
    parts = []
    if config.qwz:
        fmt = config.weight_format or f"int{config.weight_bits or 8}"
        parts.append(f"qwz-{fmt}" + ("-had" if config.qwz_hadamard else ""))
    if config.hpz:
        parts.append("hpz" if config.hpz_group_size is None
                     else f"hpz[{config.hpz_group_size}]")
    if config.qgz:
        parts.append(f"qgz-int{config.grad_bits}" + ("-had" if config.qgz_hadamard else ""))
    label = "+".join(parts) or "zero3"
    return label if config.bucket else label + " unbucketed"


__all__ = ["ModelShape", "config_label", "config_workload", "report_workload",
           "shape_of_params", "shape_of_state", "transformer_shape"]
