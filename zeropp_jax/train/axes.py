"""The step's collectives: pmap-era axis names, and collectives on reduced gradients.

A ``train_step`` function runs per device inside ``shard_map`` over ``("node", "local")``;
those are the data-parallel axes a collective of the user's names. Code written for
``jax.pmap`` names its own axis (``axis_name="batch"`` in Flax's ImageNet example, for
``nn.BatchNorm(axis_name="batch")`` and ``lax.pmean(grads, "batch")``). Two things here:

* ``bind_axis_names``: runs such a function with its names bound to the data-parallel
  axes. The function is traced once with the names defined (as axes of the mesh's device
  count), then the recorded program is replayed with every collective over them made over
  ``("node", "local")``: a sync BatchNorm then averages over the global batch exactly as it
  did under ``pmap``.
* ``check_gradient_collectives``: a ZeRO-3 step's gradients are already the mean over
  devices, each device holding its own shard; averaging (or summing, gathering) them again
  over devices would mix different shards into a silently wrong update. The program of
  every step is searched, once per compilation, for a collective over the data-parallel
  axes applied to values computed from the reduced gradients, outside the library's own
  optimizer step; one raises an error naming the fix.

Both read the program through ``jax.extend.core`` (equations, their parameters and
name stacks); the version-dependent calls are in ``core.compat``.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable

import jax
from jax.extend import core as jcore

from zeropp_jax.core import compat
from zeropp_jax.core.mesh import AXES
from zeropp_jax.core.scopes import OWN, REDUCED

# Parameters that name the axes a collective spans, by primitive.
_AXIS_PARAMS = ("axes", "axis_name")


def _names(value: Any) -> tuple:
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def _collective_axes(eqn: Any) -> tuple:
    """The axis names ``eqn`` communicates over (empty for a local operation)."""
    for key in _AXIS_PARAMS:
        if key in eqn.params and eqn.primitive.name != "axis_index":
            return tuple(n for n in _names(eqn.params[key]) if isinstance(n, str))
    return ()


# -- binding pmap-era names ------------------------------------------------------------------


def _rename(jaxpr: Any, names: tuple[str, ...]) -> Any:
    """``jaxpr`` with every collective over one of ``names`` made over ``AXES``."""
    eqns = []
    for eqn in jaxpr.eqns:
        params = dict(eqn.params)
        for key in _AXIS_PARAMS:
            if key in params and any(n in names for n in _names(params[key])):
                old = _names(params[key])
                new = tuple(dict.fromkeys(a for n in old for a in (AXES if n in names
                                                                     else (n,))))
                params[key] = new if isinstance(params[key], (tuple, list)) or len(new) > 1 \
                    else new[0]
        for key, index, inner in list(compat.sub_jaxprs(eqn.params)):
            value = params[key]
            item = value[index] if index is not None else value
            renamed = _rename(inner, names)
            item = item.replace(jaxpr=renamed) if isinstance(item, jcore.ClosedJaxpr) \
                else renamed
            if index is None:
                params[key] = item
            else:
                params[key] = type(value)(item if i == index else v
                                          for i, v in enumerate(value))
        eqns.append(compat.replace_eqn_params(eqn, params))
    return compat.replace_jaxpr_eqns(jaxpr, eqns)


def bind_axis_names(fn: Callable[..., Any], names: str | tuple[str, ...],
                    num_devices: int) -> Callable[..., Any]:
    """``fn`` with collectives over ``names`` (a pmap-era axis name or several) made over
    the data-parallel axes ``("node", "local")`` (``num_devices`` devices in all). Call
    inside ``shard_map`` over those axes. ``names`` may not reuse ``"node"`` or ``"local"``.
    """
    names = _names(names)
    clash = [n for n in names if n in AXES or not isinstance(n, str)]
    if clash:
        raise ValueError(f"axis_name={names!r}: give the names your step and model use "
                         f"for the data-parallel axis (strings other than {AXES})")

    def bound(*args: Any) -> Any:
        with compat.named_axes({n: num_devices for n in names}):
            closed, shape = jax.make_jaxpr(fn, return_shape=True)(*args)
        renamed = closed.replace(jaxpr=_rename(closed.jaxpr, names))
        out = compat.eval_jaxpr(renamed, *jax.tree_util.tree_leaves(args))
        return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(shape), out)

    return bound


# -- collectives on reduced gradients ------------------------------------------------------


def _in_scope(eqn: Any, scopes: Iterable[str]) -> bool:
    stack = str(eqn.source_info.name_stack)
    return any(s in stack for s in scopes)


def _find(jaxpr: Any, taint_in: list[bool], found: list, own: bool = False) -> list[bool]:
    """Forward pass over ``jaxpr`` whose inputs are computed from reduced gradients where
    ``taint_in`` says so: which outputs are (equations in the REDUCED scope start it).
    Appends to ``found`` each collective over the data-parallel axes that reads such a
    value, outside the library's scopes (``own``: inside one already)."""
    tainted = {v for v, t in zip(jaxpr.invars, taint_in) if t}
    for eqn in jaxpr.eqns:
        in_t = [isinstance(v, jcore.Var) and v in tainted for v in eqn.invars]
        reduced = _in_scope(eqn, (REDUCED,))
        inner_own = own or reduced or _in_scope(eqn, (OWN,))
        subs = [inner for _, _, inner in compat.sub_jaxprs(eqn.params)]
        if subs:
            out_t = _through(eqn, subs, in_t, found, inner_own)
        else:
            if any(in_t) and set(_collective_axes(eqn)) & set(AXES) and not inner_own:
                found.append(eqn)
            out_t = [any(in_t)] * len(eqn.outvars)
        tainted.update(v for v, t in zip(eqn.outvars, out_t) if t or reduced)
    return [isinstance(v, jcore.Var) and v in tainted for v in jaxpr.outvars]


def _loop(body: Any, consts: list[bool], carry: list[bool], xs: list[bool], found: list,
          own: bool) -> list[bool]:
    """A loop body's outputs (carry first) at the fixpoint of its carry's taint."""
    while True:
        out = _find(body, consts + carry + xs, found, own)
        new = [a or b for a, b in zip(carry, out[:len(carry)])]
        if new == carry:
            return out
        carry = new


def _through(eqn: Any, subs: list, in_t: list[bool], found: list, own: bool) -> list[bool]:
    """Which outputs of ``eqn`` (an equation holding jaxprs: scan, while, cond, jit,
    remat, custom derivatives, ...) are computed from tainted inputs."""
    name, params = eqn.primitive.name, eqn.params
    if name == "scan":
        c, k = compat.scan_counts(eqn)
        return _loop(subs[0], in_t[:c], in_t[c:c + k], in_t[c + k:], found, own)
    if name == "while":
        cc, bc = params["cond_nconsts"], params["body_nconsts"]
        carry = _loop(params["body_jaxpr"].jaxpr, in_t[cc:cc + bc], in_t[cc + bc:], [],
                      found, own)
        _find(params["cond_jaxpr"].jaxpr, in_t[:cc] + carry, found, own)
        return carry
    if name == "cond":  # index, then the operands every branch takes
        outs = [_find(b, in_t[1:], found, own) for b in subs]
        return [any(ts) for ts in zip(*outs)]
    if len(subs) == 1 and len(subs[0].invars) == len(in_t) \
            and len(subs[0].outvars) == len(eqn.outvars):
        return _find(subs[0], in_t, found, own)
    # Anything else: every inner input is tainted if one outer input is, and so is every
    # output.
    for inner in subs:
        _find(inner, [any(in_t)] * len(inner.invars), found, own)
    return [any(in_t)] * len(eqn.outvars)


def check_gradient_collectives(closed: Any) -> None:
    """Raises if the step's program (``closed``, a ``ClosedJaxpr``) applies a collective
    over the data-parallel axes to values computed from ZeRO's reduced gradient shards."""
    found: list = []
    try:
        _find(closed.jaxpr, [False] * len(closed.jaxpr.invars), found)
    except Exception as e:  # noqa: BLE001 - any failure of the reading itself
        # A program form this reading does not know (a newer JAX's control flow): the
        # step still runs; only this check is skipped, and says so.
        warnings.warn(f"zeropp_jax could not check this step's collectives on gradients "
                      f"({type(e).__name__}: {e}); the step runs unchecked", stacklevel=3)
        return
    if found:
        eqn = found[0]
        raise ValueError(
            f"this step applies {eqn.primitive.name} over {_collective_axes(eqn)} to values "
            "computed from the gradients (e.g. lax.pmean(grads, ...), as steps written for "
            "jax.pmap do). Under ZeRO-3 the gradients jax.grad returns in a train_step are "
            "already the mean over all devices, each device holding its own shard of it: "
            "averaging them again would mix different shards into a wrong update. Remove "
            "the collective and pass the gradients to state.apply_gradients as they are "
            "(for a global gradient norm use zeropp_jax.global_norm)"
        )


def unbound_axis_error(error: NameError, bound: tuple) -> ValueError:
    """The error for a collective over an axis name the step does not define."""
    return ValueError(
        f"a collective names an axis this step does not define ({str(error).rstrip('.')}). "
        f"Inside a zeropp_jax.train_step or eval_step the data-parallel axes are {AXES} (the "
        "step runs per device in shard_map over them). For code written for jax.pmap "
        "(nn.BatchNorm(axis_name='batch'), lax.pmean(x, 'batch')), either name those "
        f"axes (axis_name={AXES}) or bind your name to them: "
        "zeropp_jax.train_step(fn, axis_name='batch'). Drop any lax.pmean of the "
        "gradients: a train_step's gradients are already averaged over devices"
        + (f" (bound now: {bound})" if bound else "")
    )
