"""What one train step does on each device, for the cost model: from a config and a model.

``ModelShape`` is all the cost model needs of a model: its units' parameter counts in call
order, which units' backward needs no weights, flops per token, and what backward keeps
per token.
Get one from a ``TrainState`` (``shape_of_state``), from a params tree and a wrap policy
(``shape_of_params``), or from a transformer's dimensions (``transformer_shape``, for models
too large to build).

``config_workload(config, shape, MeshInfo(nodes, local), tokens_per_device)`` lists the step's
collectives the way the engine runs them, each traced from the unit's own transports on an
abstract ``nodes x local`` mesh (``comm.transports.base.weight_collectives``), so the bytes
and the count of collectives between nodes are what the library moves at that mesh size:

* forward: every unit's gather (the rest unit's once for the whole step);
* backward: every unit's regather, except the rest unit (kept for the step), the unit
  called last when ``config.keep_last_unit`` (its weights stay from forward), units
  whose backward needs no weights (an embedding lookup: XLA drops that gather), and
  units that keep their weights' cast copies (``ModelShape.small_weights``);
* gradients: every trainable unit's reduce-scatter;
* with ``config.bucket``, the rest unit's gather and reduce-scatter travel inside the first
  unit's (``units.bucket``): the same bytes, two collectives fewer;
* one all-reduce of the step's scalars (loss and metrics share it).

``memory_breakdown`` follows the same step for the bytes each device holds at its peak:
the state, the gathered weights, hpZ's secondaries, the activations backward keeps
(``decoder_activations`` counts a decoder's), the loss's logits and the gradients, and
with qgZ's error feedback the errors each device keeps (``feedback_sizes``).

``report_workload`` reads the same from a compiled program's ``CommReport`` instead.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax

from zeropp_jax.comm.partition import REST, UnitLayout, padded_length
from zeropp_jax.comm.transports import TransportPlan, plan_of
from zeropp_jax.comm.transports.base import gradient_collectives, weight_collectives
from zeropp_jax.comm.wire import TracedCollective, axis_groups, count_bytes
from zeropp_jax.core.config import ZeroPPConfig
from zeropp_jax.core.mesh import AXES, EXPERT, MeshInfo, slice_axis
from zeropp_jax.measure.comm_report import CommReport
from zeropp_jax.plan.cost_model import CollectiveCost, Workload
from zeropp_jax.units.apply import first_unit, kept_unit

# Adam's two fp32 moments per parameter.
ADAM_BYTES_PER_PARAM = 8
# A train state's int32 scalars: the step, the skipped steps, Adam's count.
STATE_SCALAR_BYTES = 12
# The smallest weight whose cast copy the engine recognizes among a unit's residuals
# (``units.unit._Pullback.holds_copies_of``'s ``min_size``).
COPY_MIN_SIZE = 1024


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
      activation_bytes_per_token: bytes per token the step keeps besides what the fields
        below count (a declared total for a model described no further; 0: none).
      name: what model this is.
      resident: units read outside their own calls (a tied head reading the embedding):
        gathered once for the whole step, like the rest unit (``find_resident``).
      itemsize: bytes per element the model's layers compute in (its activations): 4 for
        a model built with ``dtype=float32`` (transformers' Flax default), 2 for bfloat16;
        0: the config's compute dtype. Wider than the compute dtype, every layer casts its
        gathered weights to it, and backward holds those copies while a unit runs.
      blocks: the units that each hold one block's activations (a decoder's layers).
      block_activations: elements per token one block's backward keeps from its forward
        (remat ``"minimal"``), in ``itemsize``.
      block_recomputed: of those, the ones backward recomputes when the layers cast
        their weights (the engine then keeps matmul outputs only, ``units.unit``): the
        norms' outputs and the like (``decoder_activations``). The kept unit keeps them
        anyway (its backward runs right after its forward, on the same weights).
      block_inputs: elements per token of a block's inputs (all remat ``"full"`` keeps).
      block_matmul_outputs: of ``block_activations``, the matmul outputs alone: what a
        block keeps with remat ``"minimal"`` when it is a layer of a scanned stack
        (``scanned``; ``units.apply``), recomputing the rest in backward.
      scanned: the blocks are the layers of an ``nn.scan`` / ``nnx.scan`` stack.
      block_gradients: elements per token of the gradients live while a block's backward
        runs (the one flowing in, the widest one inside), in ``itemsize``.
      softmax_gradients: float32 elements per token a block's backward holds for a
        materialized softmax on a GPU (the probabilities, their gradient and the scores'
        gradient, ``heads x seq_len`` each); 0 with fused attention.
      activations: elements per token kept outside the blocks, in ``itemsize`` (the
        embedding's output, the final norm's input and output).
      logits: float32 elements per token the loss holds at once (the logits, their
        softmax, their gradient: ``decoder_activations``).
      small_weights: units whose every weight has fewer than 1024 elements, too few for
        the engine to tell a cast copy of one from an activation (``units.unit``): when
        the layers cast their weights, such a unit keeps the copies from forward to
        backward and regathers nothing.
      single_weight: units of one weight array (a head, an embedding), whose flat
        gradient is that weight's gradient reshaped, not a concatenated copy.
      tensor_parallel: the tensor-parallel degree ``T`` the shape describes one rank of
        (``transformer_shape(tensor_parallel=T)``): unit sizes are one rank's slices, flops
        and activations one rank's share; 1: no tensor parallelism.
      tp_allreduces: all-reduces over the tensor-parallel group per step (Megatron's: two
        per block in forward, two in backward, and the embedding's).
      tp_elems_per_token: elements per token each of them reduces (``d_model``).
      expert_parallel: the expert-parallel degree ``E`` the shape describes one device of
        (a state on ``make_mesh(..., expert=E)``): unit sizes are one device's slices
        (its experts, a piece of the dense weights); 1: no expert axis. The expert
        group's own collectives (the tokens' all-to-alls, the dense weights' gathers
        inside the group) are not priced.
    """

    units: tuple[tuple[str, int], ...]
    frozen: tuple[tuple[str, int], ...] = ()
    no_regather: frozenset[str] = frozenset()
    kept: str | None = None
    first: str | None = None
    flops_per_token: float = 0.0
    activation_bytes_per_token: float = 0.0
    name: str = ""
    resident: frozenset[str] = frozenset()
    itemsize: int = 0
    blocks: frozenset[str] = frozenset()
    block_activations: float = 0.0
    block_recomputed: float = 0.0
    block_inputs: float = 0.0
    block_matmul_outputs: float = 0.0
    scanned: bool = False
    block_gradients: float = 0.0
    softmax_gradients: float = 0.0
    activations: float = 0.0
    logits: float = 0.0
    small_weights: frozenset[str] = frozenset()
    single_weight: frozenset[str] = frozenset()
    tensor_parallel: int = 1
    tp_allreduces: int = 0
    tp_elems_per_token: float = 0.0
    expert_parallel: int = 1

    @property
    def params(self) -> int:
        return sum(n for _, n in self.units) + sum(n for _, n in self.frozen)



def decoder_activations(d_model: int, seq_len: int, vocab: int, *, heads: int,
                        ffn: int | None = None, gated: bool = False,
                        fused_attention: bool = False, tensor_parallel: int = 1
                        ) -> dict[str, float]:
    """What a pre-norm decoder's step keeps per token, in elements: the ``ModelShape``
    fields ``block_activations``, ``block_recomputed``, ``block_inputs``,
    ``block_matmul_outputs``, ``block_gradients``, ``softmax_gradients``, ``activations``
    and ``logits``
    (``dataclasses.replace(shape, blocks=..., **these)``).

    The tensors XLA keeps from a block's forward for its backward, read from the compiled
    step's buffer assignment (transformers' Flax GPT-2 and Llama, the demo GPT), per token:

    * attention: the query, key and value at full heads (3 ``d_model``), its output
      (``d_model``), and the probabilities and their exponentials, two ``heads x
      seq_len`` (the softmax materialized; with ``fused_attention``, a kernel that
      recomputes them in backward, one log-sum-exp per head instead);
    * the residual stream: the two residual sums (2 ``d_model``) and the two norms'
      outputs (2 ``d_model``, the inputs of the attention's and the MLP's matmuls);
    * the MLP: a GELU MLP its hidden layer's input and the GELU's two intermediates (3
      ``ffn``); a gated one (``gated``, SwiGLU) the gate and up projections, the sigmoid,
      the SiLU and their product (5 ``ffn``);
    * scalars: each norm's two statistics, the softmax's maximum and sum per head.

    ``block_recomputed``: what backward recomputes instead when the layers compute in a
    wider dtype than the weights (they cast them, so the engine keeps only matmul outputs,
    ``units.unit``, and XLA merges back what it can): the norms' outputs, and the GELU's
    intermediates (2 ``d_model`` + 2 ``ffn``; 2 ``d_model`` for a gated MLP, whose SiLU
    terms XLA keeps anyway). ``block_inputs``: a block's input, ``d_model`` (remat
    ``"full"``). ``block_gradients``: while a block's backward runs, the gradient flowing
    in (``d_model``) and the widest one inside (``ffn``); ``softmax_gradients``: with the
    softmax materialized, three float32 ``heads x seq_len`` arrays besides (the
    probabilities, their gradient and the scores', read from GPU-compiled 1.3B and 7B Llama
    steps). Outside the blocks: the
    embedding's output, the final norm's output and statistics. ``logits``: the loss holds
    two float32 ``[tokens, vocab]`` arrays at once (the logits and their softmax in
    forward; in backward the logits' gradient and the transposed copy the head's weight
    gradient reads).

    ``tensor_parallel``: one rank's share under Megatron's split (no sequence
    parallelism): the query, key, value, attention output, the probabilities and the
    MLP's intermediates split over the ``T`` ranks (heads and ``ffn`` columns), the
    residual stream and the norms whole on every rank; the logits split by vocabulary.
    """
    t = tensor_parallel
    ffn = 4 * d_model if ffn is None else ffn
    mlp = 5 * ffn if gated else 3 * ffn
    recomputed = 2 * d_model + (0 if gated else 2 * ffn / t)
    attention = heads if fused_attention else 2 * heads * seq_len + 2 * heads
    block = 4 * d_model + (4 * d_model + attention + mlp) / t + 4
    # Matmul outputs alone (a scanned stack's layers, read from GPU-compiled 7B steps):
    # query, key, value, the attention's output, its projection and the MLP's down
    # projection (6 d_model), the scores (``attention``), the MLP's first matmuls (gate and
    # up: 2 ffn; GELU: ffn).
    matmuls = 2 * d_model + (4 * d_model + attention + (2 if gated else 1) * ffn) / t
    return {"block_activations": float(block), "block_recomputed": float(recomputed),
            "block_matmul_outputs": float(matmuls),
            "block_inputs": float(d_model), "block_gradients": float(d_model + ffn / t),
            "softmax_gradients": 0.0 if fused_attention else float(3 * heads * seq_len / t),
            "activations": float(2 * d_model + 2), "logits": float(2 * vocab / t)}


def transformer_shape(layers: int, d_model: int, vocab: int, seq_len: int, *,
                      ffn: int | None = None, tied: bool = False, name: str = "",
                      heads: int | None = None, kv_heads: int | None = None,
                      gated: bool = False, itemsize: int = 0,
                      fused_attention: bool = False, tensor_parallel: int = 1,
                      scanned: bool = False) -> ModelShape:
    """A decoder: token embedding, ``layers`` blocks, a final norm and an output head
    (shared with the embedding when ``tied``). ``scanned``: the blocks are an ``nn.scan``
    stack (each layer its own unit; with remat ``"minimal"`` they keep their matmul
    outputs only).

    GPT-style by default: attention (4 d^2) and an MLP (2 d ffn, ``ffn`` = 4 d by
    default) with biases and two LayerNorms. ``gated``: Llama-style, an MLP of three
    ``d x ffn`` matrices (SwiGLU), key and value projections for ``kv_heads`` of the
    ``heads`` heads (default all), RMSNorms, no biases.

    Flops per token: 6 x the matmul parameters (forward 2, backward 4) plus attention's
    scores and weighted sum, 12 x layers x d_model x seq_len (forward + backward), as in the
    ZeRO, Megatron and PaLM papers' accounting. Units: the blocks; the embedding and the
    head are units of their own (each at least a quarter of a block at these sizes), and
    the final norm is the rest unit. The embedding's backward needs no weights.

    Activations: with ``heads`` given, what the blocks keep for backward is counted
    (``decoder_activations``, with ``fused_attention``); without, none (declare
    ``activation_bytes_per_token`` instead). ``itemsize``: the bytes per element the
    model computes in (0: the config's compute dtype).

    ``tensor_parallel``: the shape of one of ``T`` tensor-parallel ranks, as the engine
    splits a model over a ``"model"`` mesh axis with Megatron's rules: every unit stores
    ``ceil(n / T)`` parameters (split weights by their slices, whole ones in equal
    pieces), the flops are a rank's ``1 / T``, the activations ``decoder_activations``'
    split, and each step all-reduces ``d_model`` elements per token over the group four
    times per block and once for the embedding."""
    t = tensor_parallel
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"tensor_parallel must be a positive int, got {t!r}")
    ffn = 4 * d_model if ffn is None else ffn
    if gated:
        kv = d_model if kv_heads is None or heads is None else d_model * kv_heads // heads
        attn = 2 * d_model * d_model + 2 * d_model * kv
        block = attn + 3 * d_model * ffn + 2 * d_model
        matmul_block = attn + 3 * d_model * ffn
        final_norm = d_model
    else:
        # Weights, then biases (qkv 3d, proj d, fc ffn, out d) and two LayerNorms (4d).
        block = 4 * d_model * d_model + 2 * d_model * ffn + 9 * d_model + ffn
        matmul_block = 4 * d_model * d_model + 2 * d_model * ffn
        final_norm = 2 * d_model
    embed = vocab * d_model
    blocks = [f"block_{i}" for i in range(layers)]
    small = set(blocks) if max(d_model, ffn) * d_model < COPY_MIN_SIZE else set()
    small |= {"wte", "head"} if embed < COPY_MIN_SIZE else set()
    units = [("wte", embed)] + [(b, block) for b in blocks]
    if not tied:
        units.append(("head", embed))
    units.append((REST, final_norm))
    total = sum(n for _, n in units)
    units = [(u, -(-n // t)) for u, n in units]
    matmul = layers * matmul_block + embed
    flops = (6.0 * matmul + 12.0 * layers * d_model * seq_len) / t
    return ModelShape(tuple(units), no_regather=frozenset({"wte"} if not tied else ()),
                      kept=_last_called(units), first=None if tied else "wte",
                      flops_per_token=flops,
                      name=name or (f"GPT {layers}L d{d_model} ({total:,})"
                                    + (f", tensor parallel {t}" if t > 1 else "")),
                      resident=frozenset({"wte"} if tied else ()), itemsize=itemsize,
                      blocks=frozenset(blocks), small_weights=frozenset(small),
                      single_weight=frozenset({"wte", "head"}),
                      tensor_parallel=t, tp_allreduces=(4 * layers + 1) if t > 1 else 0,
                      tp_elems_per_token=float(d_model) if t > 1 else 0.0,
                      scanned=scanned,
                      **({} if heads is None else decoder_activations(
                          d_model, seq_len, vocab, heads=heads, ffn=ffn, gated=gated,
                          fused_attention=fused_attention, tensor_parallel=t)))


def shape_of_state(state: Any, *, flops_per_token: float | None = None,
                   activation_bytes_per_token: float = 0.0) -> ModelShape:
    """The ``ModelShape`` of a ``TrainState``'s units.

    Once a step of this state has been traced (lowered or run), units are ordered as
    forward calls them and the kept unit is the engine's own choice; before that, the
    engine's order and its last unit stand in, so the kept unit may be guessed wrong (one
    unit's regather), and the units read outside their own calls (``resident``) are the
    engine's. Units holding only ``embedding``
    leaves need no weights in backward. ``flops_per_token`` defaults to 6 x the trainable
    parameters (forward 2, backward 4). A tensor-parallel state gives one rank's shape
    (every unit one slice). Activations: ``activation_bytes_per_token`` as given (0: none
    counted); the state does not say what its model keeps for backward, which
    ``plan(state, lowered=step.lower(state, batch))`` measures from the compiled step
    (``plan.measured.calibrated_shape``)."""
    engine = state.engine
    units = [(name, lay.n) for name, lay in engine.layouts.items()]
    frozen = tuple((name, lay.n) for name, lay in engine.frozen_layouts.items())
    kept, first_called = _last_called(units), _first_called(units)
    resident_names: frozenset[str] = frozenset()
    traced = engine.memo.get("resident") or {}
    if traced:
        resident, calls = list(traced.values())[-1]
        resident_names = frozenset("/".join(map(str, p)) for p in resident)
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
    small = frozenset(name for name, lay in engine.layouts.items()
                      if name != REST and max(map(math.prod, lay.shapes), default=0)
                      < COPY_MIN_SIZE)
    shape = _shape(tuple(units), frozen, embeddings, kept, flops_per_token,
                   activation_bytes_per_token, first_called)
    single = frozenset(name for name, lay in engine.layouts.items() if len(lay.shapes) == 1)
    # A tensor-parallel state's units are one slice each (``lay.n``): one rank's shape.
    # The model's own tensor-parallel all-reduces are not known from the state (0 here;
    # ``transformer_shape(tensor_parallel=T)`` counts a decoder's). On an expert mesh the
    # slices are one device's experts (and a piece of the dense weights).
    slices = max((lay.tp for lay in engine.layouts.values()), default=1)
    expert = slice_axis(engine.mesh) == EXPERT
    return dataclasses.replace(shape, resident=resident_names, small_weights=small,
                               single_weight=single,
                               tensor_parallel=1 if expert else slices,
                               expert_parallel=slices if expert else 1,
                               scanned=any(lay.layer is not None
                                           for lay in engine.layouts.values()))


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
    small = frozenset(unit_name(p) for p, sub in units.items()
                      if max((math.prod(jax.numpy.shape(x))
                              for x in jax.tree_util.tree_leaves(sub)), default=0)
                      < COPY_MIN_SIZE)
    shape = _shape(sizes, (), embeddings, _last_called(sizes), flops_per_token,
                   activation_bytes_per_token, _first_called(sizes))
    single = frozenset(unit_name(p) for p, sub in units.items()
                       if len(jax.tree_util.tree_leaves(sub)) == 1)
    return dataclasses.replace(shape, small_weights=small, single_weight=single)


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


def _traced(memo: dict, key: tuple, trace: Any) -> Any:
    """``trace()``, kept in ``memo`` under ``key``."""
    if key not in memo:
        memo[key] = trace()
    return memo[key]


def _unit_phases(plan: TransportPlan, n: int, mesh: MeshInfo,
                 memo: dict) -> tuple[tuple[TracedCollective, ...], ...]:
    """(forward, backward, gradient) collectives of a trainable unit of ``n`` parameters.

    The traces depend on the transports only (hashable frozen dataclasses), so a caller
    that prices many configurations passes one ``memo`` and traces each transport, unit
    size and mesh once."""
    config = plan.config
    n_pad = padded_length(n, mesh.data, config.flat_alignment)
    w = _traced(memo, ("weights", plan.weights, n_pad, config.param_jnp_dtype, mesh),
                  lambda: weight_collectives(plan.weights, n_pad, config.param_jnp_dtype,
                                             mesh))
    g = _traced(memo, ("gradients", plan.gradients, n_pad, config.compute_jnp_dtype, mesh),
                  lambda: gradient_collectives(plan.gradients, n_pad,
                                               config.compute_jnp_dtype, mesh))
    return w["forward"], w["backward"], g


def _frozen_transport(plan: TransportPlan, n: int, devices: int) -> tuple[Any, int]:
    """(transport, padded length) of a frozen part of ``n`` parameters on ``devices``."""
    n_pad = padded_length(n, devices, plan.frozen_alignment())
    layout = UnitLayout("frozen", (), None, ((n,),), n, n_pad, devices)
    return plan.unit(None, layout).frozen, n_pad


def _frozen_phases(plan: TransportPlan, n: int, mesh: MeshInfo,
                   memo: dict) -> tuple[tuple[TracedCollective, ...], ...]:
    transport, n_pad = _frozen_transport(plan, n, mesh.data)
    dtype = plan.config.param_jnp_dtype
    w = _traced(memo, ("weights", transport, n_pad, dtype, mesh),
                  lambda: weight_collectives(transport, n_pad, dtype, mesh))
    return w["forward"], w["backward"]


def _costs(what: str, traced: tuple[TracedCollective, ...], mesh: MeshInfo
           ) -> list[CollectiveCost]:
    return [CollectiveCost(what, c.kind, c.bytes.cross / mesh.nodes,
                           c.bytes.intra / mesh.data, c.spans_nodes) for c in traced]


def feedback_sizes(plan: TransportPlan, n_pad: int, mesh: MeshInfo) -> tuple[int, int, int]:
    """What qgZ's error feedback (``config.qgz_error_feedback``) keeps per device for a
    trainable unit of padded length ``n_pad`` on ``mesh``: (stored bytes,
    ``h1``, ``h2``), read from the run's gradient transport
    (``QgzReduceScatter.feedback_specs`` and ``feedback_lengths``, as
    ``Engine.feedback_specs`` lays them out).

    Stored: each quantizing hop's error as FP8 values (1 byte each, rounded up to whole
    blocks of ``FEEDBACK_BLOCK`` = 256) and one fp32 scale per block, and a 4-byte use
    count: hop 1 the unit's whole gradient (``h1 = n_pad``: every device keeps the error
    of its own full gradient, before the reduce-scatter), hop 2 (two nodes or more and
    two devices a node or more) ``h2 = nodes x m_pad`` (about ``n_pad / local``). With
    one node qgZ does not quantize (``h1 = h2 = 0``): nothing is kept.
    (0, 0, 0) without error feedback (``TransportPlan.feedback``)."""
    return plan.feedback(n_pad, mesh)


@dataclasses.dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per device at the peak of one step, by what holds them (``memory_breakdown``).

    Attributes:
      states: the step's arguments in device memory but the kept errors: every unit's
        primary shard (param dtype, padded as the engine pads it) and Adam's two moments
        (not with ``config.offload_optimizer``: see ``host``), frozen storage, the state's
        scalars, the batch.
      gathered: full weights live at the peak: the rest unit's and the resident units'
        (all step), the units at work then (with those prefetched, or held from forward),
        each in the compute dtype plus the copies the layers cast them to, and qwZ's
        quantized buffers while a gather decodes; for a scanned stack, its layers'
        primary shards stacked into one array for the loop (param dtype).
      secondary: hpZ's secondary slices of the units whose backward is still to come.
      activations: what backward keeps from forward, the gradients flowing through the
        block at work, and with remat ``"full"`` that block's recomputed activations.
      loss: the loss's float32 ``[tokens, vocab]`` arrays.
      gradients: gradient shards already reduced, the rest and resident units'
        gradients summed over the step, and the full gradient of the unit being reduced
        at the peak (its weights' gradients and the flat buffer made of them). With
        ``config.qgz_error_feedback`` also the new errors of the units reduced so far
        (held to the step's end, where they replace the kept ones) and, for the unit
        being reduced, its errors in fp32 beside its flat gradient: the gradient plus its
        decoded error, hop 2's decoded and new errors, ``4 (h1 + 2 h2)`` bytes
        (``feedback_sizes``).
      backend: what XLA's CPU backend adds (``backend="cpu"``): the zero-filled gradient
        of an embedding made at the step's start, and its copies of Adam's moments.
      moment: the moment of the step that sets the peak (``"forward <unit> (start)"``,
        ``"loss"``, ``"backward <unit> (end)"``, ``"end"``...).
      feedback: with ``config.qgz_error_feedback``, the qgZ errors the state keeps (an
        argument of the step, like ``states``): every trainable unit's
        ``feedback_sizes`` bytes, about ``n_pad (1 + 1 / local)`` bytes per device for a
        unit of ``n_pad`` padded parameters on two nodes or more, whatever the device
        count; 0 without.
      host: with ``config.offload_optimizer``, Adam's two moments in the device's host
        memory between steps (not in ``total``), with ``config.offload_params`` the
        primary shards too (each unit's shard comes to the device for its gathers: a
        ``1 / P`` slice of the weights gathered then, not counted apart). At the update
        (moment ``"end"``) they come to the device unit by unit: two units' worth is
        counted there (one arriving while the one before is updated). An assumption about XLA's schedule,
        not yet measured on a GPU (XLA's CPU backend keeps host and device in one RAM).
    """

    states: float
    gathered: float
    secondary: float
    activations: float
    loss: float
    gradients: float
    backend: float
    moment: str
    feedback: float = 0.0
    host: float = 0.0

    @property
    def total(self) -> float:
        return (self.states + self.feedback + self.gathered + self.secondary
                + self.activations + self.loss + self.gradients + self.backend)

    @property
    def arguments(self) -> float:
        """The step's arguments: the state with its kept errors, and the batch (XLA's
        ``argument_size_in_bytes``)."""
        return self.states + self.feedback

    @property
    def temporaries(self) -> float:
        """Everything but the arguments (XLA's ``temp_size_in_bytes`` counts these)."""
        return self.total - self.arguments


def memory_breakdown(config: ZeroPPConfig, shape: ModelShape, mesh: MeshInfo,
                     tokens_per_device: float = 0.0, *, backend: str = "gpu",
                     batch_bytes_per_device: float = 0.0) -> MemoryBreakdown:
    """Peak bytes one device holds in a step of ``config`` training ``shape`` on ``mesh``
    (its data axes) with ``tokens_per_device`` tokens per device, the state donated
    (``train_step(donate_state=True)``: the new state takes the old one's buffers).

    The step is followed unit by unit as the engine runs it, and the peak is the largest
    of these moments, each the sum of what is live then beside the arguments (``states``)
    and the rest and resident units' weights (live throughout):

    * forward, at the start and the end of each unit: its full weights and the next
      ``prefetch`` units' (gathered ahead); the activations kept so far (and its own, at
      its end); hpZ's secondaries made so far; the weights held by units before it;
    * the loss: every activation, the held weights (the kept unit's), the logits arrays;
    * backward, at the start and the end of each unit that needs its weights: at the
      start its weights (regathered, or held since forward), the activations of the units
      before it and its own with the gradients flowing through it; at the end, in place
      of its activations and cast copies, its weights' gradients and the flat gradient
      made of them; with the gradient shards reduced before it;
    * the end: every gradient shard, and the first unit's gradient with the rest unit's
      (the bucket) reduced together.

    With qgZ's error feedback (``config.qgz_error_feedback``) each device keeps, per
    trainable unit, the errors its gradient's quantizations left (``feedback_sizes``:
    about ``n_pad (1 + 1/local)`` bytes for a unit of ``n_pad`` padded parameters, on two
    nodes or more), counted apart (``feedback``), as an argument of the step; at the end of
    each unit's backward its errors in fp32 beside its flat gradient (``4 (h1 + 2 h2)``
    bytes: the gradient plus its decoded error, hop 2's decoded and new errors); and from
    then to the step's end its new errors (``gradients``).

    Sizes: units padded as the engine pads them; full weights in the compute dtype, plus,
    when the model computes in a wider dtype (``shape.itemsize``), the copies its layers
    cast them to; activations in ``shape.itemsize`` (``decoder_activations`` counts a
    decoder's); the loss in float32. What is counted is what is live: a backend's
    allocation adds its own (fragmentation, a GPU allocator's slack). Without donation the
    step also allocates the new state (``states`` less the batch) beside the old.

    ``backend``: ``"gpu"`` or ``"cpu"``, for three things XLA's CPU backend does that a
    GPU's need not: it makes and reduces a 16-bit flat gradient in float32; it makes an
    embedding's zero-filled gradient (its scatter-add target) at the start of the step;
    and with the state donated, its copy insertion copies Adam's moments (the updates of
    the parameters and of the moments read the old moments, after the new ones took their
    buffers) at the start of the step. Not counted on either: XLA CPU computes 16-bit
    layers in float32 (a model computing in bfloat16 gets float32 copies of its
    activations there, so measure models that compute in float32 on CPU).
    ``batch_bytes_per_device``: the batch's arrays, counted in ``states``. On XLA CPU the
    new errors are held as their quantizer's inputs until the step's end (5 bytes an
    element of hop 1, 4 of hop 2, read from the compiled step's buffer assignment), not
    encoded (about 1 byte an element): a GPU's compiler may do the same (not measured).
    """
    if backend not in ("gpu", "cpu"):
        raise ValueError(f"backend is 'gpu' or 'cpu', got {backend!r}")
    plan = plan_of(config)
    devices = mesh.data
    c = config.compute_jnp_dtype.itemsize
    p = config.param_jnp_dtype.itemsize
    m = shape.itemsize or c
    cast = m if m > c else 0
    tokens = float(tokens_per_device)
    pad = functools.partial(padded_length, num_shards=devices, align=config.flat_alignment)
    sizes = dict(shape.units)
    kept = shape.kept if config.keep_last_unit else None
    rest = sizes.get(REST, 0)

    # The arguments: primary shards and Adam's moments (fp32 each), frozen storage, batch.
    frozen_sizes = dict(shape.frozen)
    pad_frozen = functools.partial(padded_length, num_shards=devices,
                                   align=plan.frozen_alignment())
    trainable = sum(pad(n) for _, n in shape.units)

    def frozen_storage(n: int) -> float:
        """Bytes a frozen part of ``n`` parameters is stored in, over all devices."""
        transport, n_pad = _frozen_transport(plan, n, devices)
        specs = transport.stored_specs(n_pad, config.param_jnp_dtype)
        return float(sum(math.prod(s.shape) * s.dtype.itemsize for s in specs))

    # Offloaded: Adam's moments (of the units ``offload_ratio`` picks) and/or the primary
    # shards, in host memory between steps; at the update two units' worth on the device
    # at once (streamed, ``host``).
    off = plan.offload.units(shape.units)
    hosted = {u: pad(n) * (ADAM_BYTES_PER_PARAM * (u in off) + p * config.offload_params)
              for u, n in shape.units}
    host = sum(hosted.values()) / devices
    streamed = sum(sorted(hosted.values(), reverse=True)[:2]) / devices
    states = ((trainable * (p + ADAM_BYTES_PER_PARAM) - sum(hosted.values())
               + sum(map(frozen_storage, frozen_sizes.values()))) / devices
              + STATE_SCALAR_BYTES + batch_bytes_per_device)
    shards = trainable * p / devices

    # qgZ's error feedback: the errors each device keeps per trainable unit (arguments),
    # what the step holds of a unit's new ones once it is reduced, and the fp32 errors
    # while it is reduced (``feedback_sizes``; all 0 without error feedback).
    def kept_errors(u: str) -> float:
        return feedback_sizes(plan, pad(sizes[u]), mesh)[0] if u in sizes else 0.0

    def new_errors(u: str) -> float:
        """Unit ``u``'s new errors, from its reduce-scatter to the step's end: as stored.
        XLA CPU fuses their encoding into the step's last update of the kept errors, so
        it holds the quantizer's inputs instead: hop 1's fp32 sum and its codes (a byte
        each), hop 2's fp32 error."""
        if u not in sizes:
            return 0.0
        stored, h1, h2 = feedback_sizes(plan, pad(sizes[u]), mesh)
        if backend == "cpu" and stored:
            return 5.0 * h1 + 4.0 * h2 + 4
        return float(stored)

    def error_work(u: str) -> float:
        """What unit ``u``'s errors add in fp32 while it is reduced, beside its flat
        gradient: hop 1's input, the flat gradient plus its kept error decoded (a second
        full-length buffer; XLA fuses the decoding into the sum, and the new error into
        its encoding), and hop 2's kept error decoded and its new one."""
        if u not in sizes:
            return 0.0
        _, h1, h2 = feedback_sizes(plan, pad(sizes[u]), mesh)
        return 4.0 * (h1 + 2 * h2)

    feedback = float(sum(kept_errors(u) for u in sizes))

    def n_of(u: str) -> int:
        """A unit's parameters, trainable and frozen."""
        return sizes.get(u, 0) + frozen_sizes.get(u, 0)

    def gathered(u: str) -> float:
        """A unit's gathered buffers (trainable and frozen parts), in the compute dtype."""
        return ((pad(sizes[u]) if u in sizes else 0)
                + (pad_frozen(frozen_sizes[u]) if u in frozen_sizes else 0)) * c

    def full(u: str) -> float:
        """A unit's full weights: the gathered buffers and the layers' cast copies."""
        return gathered(u) + n_of(u) * cast

    def decoding(u: str) -> float:
        """qwZ's quantized buffer (values and one fp32 scale per block) beside the decoded
        weights while a gather runs (a frozen part stored quantized, likewise)."""
        q = plan.weights.moved_bytes(pad(sizes[u])) if u in sizes else 0.0
        if u in frozen_sizes:
            transport, n_pad = _frozen_transport(config, frozen_sizes[u], devices)
            q += transport.moved_bytes(n_pad)
        return q

    resident = [u for u in shape.resident if u in sizes or u in frozen_sizes]
    # The rest unit's and the resident units' gathered weights (all step), the copies the
    # layers cast them to (the head among them: at the loss), and their gradients, summed
    # over every use from the head's backward to the step's end.
    shared = rest + sum(n_of(u) for u in resident)
    persistent = pad(rest) * c + sum(gathered(u) for u in resident)
    shared_grads = (rest + sum(sizes.get(u, 0) for u in resident)) * max(m, c)
    order = [name for name, _ in shape.units if name != REST and name not in shape.resident]
    order += [name for name, _ in shape.frozen if name not in sizes and name != REST
              and name not in shape.resident]
    # Units that keep their full weights from forward to backward: the kept unit, and,
    # when the layers cast the weights, a unit whose every weight is too small for the
    # engine to tell its cast copies from activations (``units.unit``: under 1024
    # elements; remat "minimal" only, the one that keeps what backward needs as it is):
    # backward keeps the copies, needs no weights, and XLA drops the regather.
    holds = {u for u in order if u == kept or (cast and config.remat == "minimal"
                                               and u in shape.small_weights)}
    regathered = [u for u in order if u not in holds and u not in shape.no_regather]
    group = plan.secondary_devices(mesh)
    sec = {u: gathered(u) / group for u in regathered} if group else {}

    # Activations kept from forward to backward.
    full_remat = config.remat == "full"
    saved = shape.block_activations - (shape.block_recomputed if cast else 0.0)
    # A scanned stack's layers keep their matmul outputs only, and recompute the rest in
    # backward (units.apply).
    recomputed = shape.block_activations - saved
    if shape.scanned and config.remat == "minimal":
        saved, recomputed = shape.block_matmul_outputs, (shape.block_activations
                                                         - shape.block_matmul_outputs)

    def kept_by(u: str) -> float:
        """What unit ``u`` keeps from its forward for its backward: a block its
        activations (all of them if it holds its weights: its backward reads the very
        weights its forward did), or with remat "full" its inputs."""
        if u not in shape.blocks:
            return 0.0
        if full_remat:
            return tokens * m * shape.block_inputs
        return tokens * m * (shape.block_activations if u in holds else saved)

    outside = tokens * m * shape.activations + tokens * shape.activation_bytes_per_token
    loss = tokens * 4 * shape.logits

    def held(u: str) -> float:
        """The weights a unit that holds them keeps for its backward: the gathered buffer
        and the cast copies; once its layers have cast them, a unit other than a block
        keeps the copies alone (a block's norms read the gathered buffer to the end)."""
        return n_of(u) * cast if cast and u not in shape.blocks else full(u)

    def until(i: int) -> tuple[float, float, float]:
        """What units ``order[:i]`` keep for their backward: (activations, full weights,
        hpZ secondaries)."""
        done = order[:i]
        return (outside + sum(kept_by(u) for u in done),
                sum(held(u) for u in done if u in holds),
                sum(sec.get(u, 0.0) for u in done))

    # A flat gradient is made and reduced in the compute dtype (XLA CPU widens it to
    # float32, whichever way it is reduced).
    g = 4 if backend == "cpu" else c

    def gradient(u: str) -> float:
        """A unit's full gradient while it is reduced: its weights' gradients (in the
        dtype its layers compute in) and the flat buffer they are concatenated into (of
        a unit of one weight, its gradient reshaped: no copy)."""
        n = sizes.get(u, 0)
        if not n:
            return 0.0
        return (0.0 if u in shape.single_weight else n * max(m, c)) + pad(n) * g

    moments = []
    # Forward, at each unit, with the next `prefetch` units' weights gathered ahead: at
    # its start its weights (and their cast copies), at its end its activations in place
    # of the copies its layers are done with.
    for i, u in enumerate(order):
        acts, weights, secs = until(i)
        ahead = sum(full(v) for v in order[i + 1:i + 1 + config.prefetch])
        moments.append((f"forward {u} (start)", weights + full(u) + decoding(u) + ahead,
                        secs + sec.get(u, 0.0), acts, 0.0, 0.0))
        moments.append((f"forward {u} (end)",
                        weights + (held(u) if u in holds else gathered(u)) + ahead,
                        secs + sec.get(u, 0.0), acts + kept_by(u), 0.0, 0.0))
    # The loss: every unit's activations, the held weights (the kept unit's: the head's).
    acts, weights, secs = until(len(order))
    moments.append(("loss", weights + shared * cast, secs, acts, loss, 0.0))
    # Backward, unit by unit in reverse (an embedding's at the end, below). At its start:
    # its weights (regathered, or held since forward) and their cast copies, its
    # activations (with remat "full", recomputed; when the weights are cast, the ones
    # recomputed from them) and the gradients flowing through it. At its end: the gathered
    # buffer (its norms read it to the last), its weights' gradients and the flat
    # gradient made of them to be reduced. The next `prefetch` units to be regathered
    # (backward prefetch, ``units.ordering``) have their weights already.
    reduced = shared_grads
    reduced_here = set()  # units reduced in the loop (the others, at the step's end)
    regathering = set(regathered)
    for i in reversed(range(len(order))):
        u = order[i]
        if u in shape.no_regather:
            continue
        acts, weights, secs = until(i)
        ahead = [v for v in order[max(0, i - config.prefetch):i] if v in regathering]
        weights += sum(full(v) for v in ahead)
        # Their regathers have run, and so has this unit's (during an earlier backward)
        # if a unit called after it took its token (``units.ordering``): a later unit in
        # the order, or, for the last, a unit called again (a tied head: the reason
        # keep_last_unit kept no unit): those hpZ secondaries are spent, and so are qwZ's
        # quantized buffers.
        secs -= sum(sec.get(v, 0.0) for v in ahead)
        prefetched = bool(config.prefetch) and (
            i + 1 < len(order) or (config.keep_last_unit and shape.kept != u))
        own = kept_by(u)
        if u in shape.blocks:
            own += tokens * m * shape.block_gradients
            if backend != "cpu":
                # XLA:CPU fuses the softmax's backward instead: with these arrays the
                # model reads 12% over a compiled CPU step of the demo GPT.
                own += tokens * 4 * shape.softmax_gradients
            if full_remat:  # recomputed on the regathered weights: all of them
                own += tokens * m * shape.block_activations
            elif u not in holds:
                own += tokens * m * recomputed
        mine = held(u) if u in holds else full(u) + (0.0 if prefetched else decoding(u))
        moments.append((f"backward {u} (start)", weights + mine,
                        secs + (0.0 if prefetched else sec.get(u, 0.0)), acts + own, 0.0,
                        reduced))
        moments.append((f"backward {u} (end)", weights + min(mine, gathered(u)), secs, acts,
                        0.0, gradient(u) + reduced + error_work(u)))
        reduced += pad(sizes[u]) * p / devices if u in sizes else 0.0
        reduced += new_errors(u)
        reduced_here.add(u)
    # The end: the first unit's gradient, bucketed with the rest unit's, and every shard.
    first = order[0] if order else None
    bucket = (plan.buckets() and rest and shape.first == first
              and first in sizes and first not in frozen_sizes)
    end_grad = shared_grads + pad(rest) * g
    if first is not None:
        # Its weights' gradients become its flat gradient; with the bucket, that and the
        # rest unit's are laid out together (one more flat buffer) and reduced at once.
        flat = (pad(sizes[first]) if first in sizes else 0) + (pad(rest) if bucket else 0)
        end_grad = max(shared_grads + gradient(first), flat * g * (2 if bucket else 1))
    # Every unit's new errors, one of those reduced at the end in fp32 in their place.
    end_grad += sum(new_errors(u) for u in sizes) + max(
        [0.0, *(error_work(u) - new_errors(u) for u in sizes if u not in reduced_here)])
    # A scanned stack's layers' primary shards, stacked into one [layers, shard] array for
    # the loop (units.apply): a second copy of them in the param dtype, live from the first
    # layer's forward to the last layer's backward (read from the buffer assignment of
    # GPU-compiled Llama steps; their gradient shards form such an array too, but counting
    # it moved the model further from those steps, 61 rows off by more than 10% against 45).
    stacked = (sum(pad(n) for u, n in shape.units if u in shape.blocks) * p / devices
               if shape.scanned else 0.0)
    moments = [(what, weights + stacked, *rest_of) for what, weights, *rest_of in moments]
    # The update: offloaded moments come to the device unit by unit (see ``host``).
    moments.append(("end", 0.0, 0.0, 0.0, 0.0, shards + end_grad + streamed))
    extra = {what: 0.0 for what, *_ in moments}
    if backend == "cpu":
        # XLA CPU makes the zero-filled gradient of each unit whose backward needs no
        # weights (an embedding's scatter-add target) at the start of the step (counted
        # at the end already), and copies Adam's moments and count at its start too.
        early = sum(sizes.get(u, 0) * max(m, c) for u in order if u in shape.no_regather)
        copies = trainable * ADAM_BYTES_PER_PARAM / devices + 4
        extra = {what: copies + (early if what != "end" else 0.0) for what in extra}
    moment, gathered, secs, acts, lo, grads = max(
        moments, key=lambda x: sum(x[1:]) + extra[x[0]])
    return MemoryBreakdown(states, persistent + gathered, secs, acts, lo, grads,
                           extra[moment], moment, feedback, host)


def config_workload(config: ZeroPPConfig, shape: ModelShape, mesh: MeshInfo,
                    tokens_per_device: float = 0.0, label: str = "", scalar_bytes: int = 8,
                    *, backend: str = "gpu", memo: dict | None = None) -> Workload:
    """One step of ``config`` training ``shape`` on ``mesh`` (its data axes) with
    ``tokens_per_device`` tokens per device (rules in the module docstring).
    ``scalar_bytes``: the step's scalar outputs (loss and metrics), all-reduced together.
    ``memo``: a dict the caller keeps across calls (a planner pricing many configurations),
    where each transport's traced collectives are kept."""
    if config.stage != 3:
        raise ValueError("the cost model covers ZeRO-3 and ZeRO++ (stage=3) configurations; "
                         f"got stage={config.stage}")
    plan = plan_of(config)
    devices = mesh.data
    kept = shape.kept if config.keep_last_unit else None
    costs: list[CollectiveCost] = []
    quant = grad_quant = 0.0
    sizes, frozen_names = dict(shape.units), dict(shape.frozen)
    # The unit whose forward gather and gradient reduce-scatter carry the rest unit's too.
    partner = shape.first if (
        plan.buckets() and REST in sizes and REST not in frozen_names
        and shape.first in sizes and shape.first != kept
        and shape.first not in frozen_names) else None
    # A unit that keeps its weights' cast copies for backward regathers nothing
    # (``memory_breakdown``).
    copies = (shape.small_weights if config.remat == "minimal"
              and (shape.itemsize or 0) > config.compute_jnp_dtype.itemsize else frozenset())
    # Traced once per unit size (a model's layers share one); with the caller's ``memo``,
    # once per transport across every configuration it prices.
    memo = {} if memo is None else memo
    for name, n in shape.units:
        fwd, bwd, grad = _unit_phases(plan, n, mesh, memo)
        if name == partner:  # one collective moves both: the padded lengths add up
            pad = functools.partial(padded_length, num_shards=devices,
                                    align=config.flat_alignment)
            fwd, _, grad = _unit_phases(plan, pad(n) + pad(sizes[REST]), mesh, memo)
        regathers = (name not in (REST, kept) and name not in shape.no_regather
                     and name not in copies)
        if not (name == REST and partner):
            costs += _costs(f"{name} forward", fwd, mesh)
        if regathers:
            costs += _costs(f"{name} backward", bwd, mesh)
        if not (name == REST and partner):
            costs += _costs(f"{name} gradient", grad, mesh)
        w_elems, g_elems = plan.quantized_elems(
            n, padded_length(n, devices, config.flat_alignment), 1 + regathers, True, mesh)
        quant, grad_quant = quant + w_elems + g_elems, grad_quant + g_elems
    for name, n in shape.frozen:
        fwd, bwd = _frozen_phases(plan, n, mesh, memo)
        regathers = name != kept and name not in shape.no_regather
        costs += _costs(f"{name} frozen forward", fwd, mesh)
        if regathers:
            costs += _costs(f"{name} frozen backward", bwd, mesh)
    # The step's scalars (loss, metrics) share one all-reduce over every device.
    intra, cross = count_bytes("all-reduce", scalar_bytes, axis_groups(AXES, mesh),
                               mesh.local)
    costs.append(CollectiveCost("loss and metrics", "all-reduce", cross / mesh.nodes,
                                intra / devices, mesh.nodes > 1))
    t = shape.tensor_parallel
    groups = t * shape.expert_parallel
    if groups > 1:
        # ``local`` counts data-parallel devices: a node holds ``groups`` data groups (one
        # per tensor-parallel or expert slice), whose cross-node bytes share its link.
        costs = [dataclasses.replace(c, cross_bytes_per_node=c.cross_bytes_per_node
                                     * groups) for c in costs]
    if t > 1:
        # Tensor parallelism's own all-reduces, inside the node (a ring: each device
        # sends and receives 2 (t - 1) / t of the buffer).
        size = tokens_per_device * shape.tp_elems_per_token * config.compute_jnp_dtype.itemsize
        costs.append(CollectiveCost("tensor parallel", "all-reduce", 0.0,
                                    2 * (t - 1) / t * size, False, shape.tp_allreduces))
    memory = memory_breakdown(config, shape, mesh, tokens_per_device,
                              backend=backend).total
    # Offloaded state over the host link per step: Adam's moments in and out at the
    # update; primary shards to the device for each gather (forward, backward's regather:
    # 2) and for the update, the new ones back, their gradient out and in again (6 in all).
    off = plan.offload.units(shape.units)
    host = sum(padded_length(n, devices, config.flat_alignment)
               * (2 * ADAM_BYTES_PER_PARAM * (u in off)
                  + 6 * config.param_jnp_dtype.itemsize * config.offload_params)
               for u, n in shape.units) / devices
    return Workload(tuple(costs), tokens_per_device * shape.flops_per_token, quant, memory,
                    label or plan.label(), grad_quant, host)


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
    """A short name: ``zero3``, or the ZeRO++ techniques on (``qwz-int4+hpz2+qgz``...).
    qgZ's options: ``-had`` Hadamard smoothing, ``-step`` signs (and rounding seeds)
    drawn from the step (``qgz_signs="per_step"``), ``+EF`` error feedback
    (``TransportPlan.label``)."""
    return plan_of(config).label()


__all__ = ["MemoryBreakdown", "ModelShape", "config_label", "config_workload",
           "decoder_activations", "feedback_sizes", "memory_breakdown", "report_workload",
           "shape_of_params", "shape_of_state", "transformer_shape"]
