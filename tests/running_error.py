"""A derived bound on fp32 rounding: first-order error analysis of a traced function.

Measuring one fp32 evaluation against float64 and allowing as much for another that sums
in another order (what the parity tests once did) is no bound: where an output is a sum of
terms that cancel (a bias gradient: ``sum_i dL/dy_i``, small against its terms), the error
scales with the terms, the measured ratio with the result, and a sharded step's error
reached 1.56x such an allowance on a fresh seed. This module bounds every fp32 evaluation
of a function's operations instead, whatever order its sums run in (the standard model of
floating-point arithmetic, Higham, "Accuracy and Stability of Numerical Algorithms",
ch. 2-3, to first order in the unit roundoff U):

- an elementwise operation returns ``v (1 + d)``, ``|d| <= w U``: ``w = 2`` for the
  arithmetic ones (one rounding, and one more for a rewrite XLA may make, e.g. ``x / c``
  into ``x * (1 / c)``), ``8`` for exp, log, rsqrt and tanh (XLA's CPU approximations,
  within a few ulps; rsqrt may be ``1 / sqrt``: two roundings);
- a sum of ``n`` terms in any order (any tree, a sharded program's partial sums added
  across devices included) is off by at most ``(n - 1) U sum |terms|``; a dot product
  with contraction ``k`` by ``k U (|a| . |b|)``;
- moves of data (reshape, broadcast, gather, transpose, select) and max, min, negation
  round nothing.

Each such rounding ``r`` (magnitude ``M_r``, weight ``w_r``) moves an output ``y_j`` by
``(dy_j / dr) r`` to first order, so ``|fl(y_j) - y_j| <= U sum_r w_r |dy_j / dr| M_r``: the
derivatives taken through the whole function by reverse-mode autodiff (one program), with
their signs, so that paths that cancel (BatchNorm's output does not move when its input
shifts) are not counted twice. A sharded step whose operations are those of the traced
function up to the order of its sums and exact scalings by powers of 2 (a mean over 16
rows as a mean over devices of means over 2) is within the bound, as is the one-device fp32
evaluation. Second-order terms (products of two roundings: the bound's own relative size,
~1e-6 here, times the bound) and the float64 evaluation's own rounding (~1e-9 of the
bound) are left out. A comparison (``x > 0`` in
relu's derivative) whose operands lie within their bound of each other could go the other
way in fp32, and the linearization would not hold: those are counted and returned, for the
caller to require none.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

U32 = 2.0**-24
ARITH = 2
TRANSCENDENTAL = 8

_MOVES = {"broadcast_in_dim", "reshape", "transpose", "squeeze", "expand_dims", "slice",
          "dynamic_slice", "concatenate", "rev", "copy", "copy_p", "gather", "reduce_max",
          "reduce_min", "stop_gradient", "dynamic_update_slice", "pad", "neg", "abs",
          "max", "min", "select_n", "is_finite", "sign", "split"}
_ELEMENTWISE = {"add": ARITH, "sub": ARITH, "add_any": ARITH, "mul": ARITH, "div": ARITH,
                "square": ARITH, "sqrt": ARITH, "rsqrt": TRANSCENDENTAL,
                "exp": TRANSCENDENTAL, "log": TRANSCENDENTAL, "tanh": TRANSCENDENTAL,
                "logistic": TRANSCENDENTAL, "log1p": TRANSCENDENTAL,
                "expm1": TRANSCENDENTAL}
_COMPARE = {"eq", "ne", "gt", "ge", "lt", "le"}


def _wide(dtype):
    return jnp.float64 if jnp.issubdtype(dtype, jnp.floating) else dtype


def _params64(params: dict) -> dict:
    """The equation's parameters with fp32 dtypes made float64 (a cast to fp32, a dot's
    fp32 accumulation)."""
    out = dict(params)
    for k in ("new_dtype", "preferred_element_type", "dtype"):
        if out.get(k) is not None:
            out[k] = _wide(out[k])
    return out


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


class _Sites:
    """The roundings met while interpreting: ``site`` adds the next perturbation to a
    result (``eps[i]``, zeros: the derivative with respect to it is ``dy / dr``) and keeps
    its magnitude; ``gap`` keeps a comparison's operand difference."""

    def __init__(self, eps):
        self.eps, self.mags, self.gaps, self.names = eps, [], [], []

    def site(self, out, mag):
        self.mags.append(mag)
        return out + self.eps[len(self.mags) - 1]

    def gap(self, name, diff):
        self.names.append(name)
        self.gaps.append(diff)


def _sub(eqn):
    """``(jaxpr, consts)`` of an equation that calls one (jit, custom_jvp_call), else None."""
    sub = next((eqn.params[k] for k in ("jaxpr", "call_jaxpr") if k in eqn.params), None)
    if sub is None:
        return None
    return (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())


def _weight(eqn) -> int | None:
    """How many U of its magnitude the equation's result may round by (None: exact)."""
    name, out = eqn.primitive.name, eqn.outvars[0].aval
    if eqn.primitive.multiple_results or not jnp.issubdtype(out.dtype, jnp.floating):
        return None
    if name in _ELEMENTWISE:
        return _ELEMENTWISE[name]
    if name == "integer_pow":  # repeated products
        return ARITH * abs(eqn.params["y"])
    if name in ("convert_element_type", "reduce_precision"):
        before = eqn.invars[0].aval.dtype
        narrower = (not jnp.issubdtype(before, jnp.floating)
                    or jnp.finfo(out.dtype).bits < jnp.finfo(before).bits)
        return 1 if narrower else None  # one rounding
    if name == "reduce_sum":
        n = math.prod(eqn.invars[0].aval.shape[i] for i in eqn.params["axes"])
        return n - 1 if n > 1 else None
    if name == "dot_general":
        (contract, _), _ = eqn.params["dimension_numbers"]
        return math.prod(eqn.invars[0].aval.shape[i] for i in contract)
    if name == "scatter-add":
        return 1  # times the count of updates per position, in the magnitude
    return None


def _sites_of(jaxpr, out: list) -> list:
    """``(shape, weight)`` of every rounding, in the order ``_eval`` meets them."""
    for eqn in jaxpr.eqns:
        sub = _sub(eqn)
        if sub is not None:
            _sites_of(sub[0], out)
        elif _weight(eqn) is not None:
            out.append((eqn.outvars[0].aval.shape, _weight(eqn)))
    return out


def _eval(jaxpr, consts, args, sites: _Sites):
    """Interprets ``jaxpr`` on ``args`` in float64, with a perturbation at each rounding."""
    env: dict = {}

    def read(var):
        if hasattr(var, "val"):  # a literal
            val = jnp.asarray(var.val)
            return val.astype(_wide(val.dtype))
        return env[var]

    for var, c in zip(jaxpr.constvars, consts):
        c = jnp.asarray(c)
        env[var] = c.astype(_wide(c.dtype))
    for var, a in zip(jaxpr.invars, args):
        env[var] = a
    for eqn in jaxpr.eqns:
        outs = _rule(eqn, [read(v) for v in eqn.invars], sites)
        for var, o in zip(eqn.outvars, outs):
            env[var] = o
    return [read(v) for v in jaxpr.outvars]


def _scatter_add(params, operand, indices, updates):
    # (not the primitive's bind: its update_jaxpr adds in the traced dtype)
    return jax.lax.scatter_add(operand, indices, updates, params["dimension_numbers"],
                               indices_are_sorted=params["indices_are_sorted"],
                               unique_indices=params["unique_indices"], mode=params["mode"])


def _rule(eqn, vals, sites: _Sites):
    name, params = eqn.primitive.name, eqn.params
    sub = _sub(eqn)
    if sub is not None:  # jit, custom_jvp_call: interpret the body
        return _eval(sub[0], sub[1], vals[:len(sub[0].invars)], sites)
    bind = lambda *xs: eqn.primitive.bind(*xs, **_params64(params))  # noqa: E731
    out = _scatter_add(params, *vals) if name == "scatter-add" else bind(*vals)
    outs = out if eqn.primitive.multiple_results else [out]
    if name in _COMPARE and _is_float(vals[0]):
        sites.gap(name, jnp.broadcast_to(vals[0], out.shape)
                  - jnp.broadcast_to(vals[1], out.shape))
    if name == "sign":
        sites.gap(name, vals[0])
    weight = _weight(eqn)
    if weight is None:
        if name in _MOVES or not any(_is_float(o) for o in outs):
            return outs  # a move of data, a comparison, integer arithmetic: exact
        if name not in ("convert_element_type", "reduce_precision", "reduce_sum"):
            raise NotImplementedError(
                f"running_error_bound: no rule for the primitive {name!r}; add one (its "
                "rounding and magnitude) in tests/running_error.py")
        return outs
    if name == "reduce_sum":
        mag = bind(jnp.abs(vals[0]))
    elif name == "dot_general":
        mag = bind(jnp.abs(vals[0]), jnp.abs(vals[1]))
    elif name == "scatter-add":
        operand, indices, updates = vals
        # Each position adds its c updates to the operand: c roundings of that sum.
        count = _scatter_add(params, jnp.zeros_like(operand), indices, jnp.ones_like(updates))
        mag = count * _scatter_add(params, jnp.abs(operand), indices, jnp.abs(updates))
    else:
        mag = jnp.abs(out)
    return [sites.site(out, mag)]


_PROGRAMS: dict = {}


def running_error_bound(fn, *args, arg_bounds=None, rows: int | None = None,
                        unit: float = U32) -> tuple[Any, Any, dict]:
    """``fn(*args)`` evaluated in float64, a bound per output element on how far any fp32
    evaluation of its operations lies from it (sums in any order), and, by primitive, the
    number of comparisons that rounding could flip: the bound holds where there are none.

    ``args``: the exact inputs (fp32, or float64 values such as an earlier call's
    ``exact``); ``arg_bounds``: per argument, None (exact) or a tree like it of how far the
    fp32 run's input may lie from it (an earlier call's ``bound``), carried
    through ``fn`` by the magnitudes of its first derivatives. So a function applied twice
    (two training steps) is bounded by two calls of one compiled program.

    Returns ``(exact, bound, flips)``: ``exact`` and ``bound`` numpy trees shaped like
    ``fn``'s outputs, ``flips`` ``{primitive: count}`` of the nonzero counts. One compiled
    program per function and argument shapes.

    ``rows``: None takes the whole Jacobian at once (``jax.jacrev``: outputs times rounding
    sites in memory); a number takes it that many output elements at a time (the same
    bound, memory ``rows`` times the sites), for functions with large intermediates
    (attention's ``[batch, heads, seq, seq]``).

    ``unit``: the unit roundoff of the evaluations bounded (fp32's by default; ``2**-53``
    bounds float64 evaluations of the same operations, and judges the comparisons that
    could flip at that precision)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    is_float = [_is_float(np.asarray(x)) for x in leaves]
    key = (fn, rows, unit, treedef, tuple((np.shape(x), f or np.asarray(x).dtype)
                              for x, f in zip(leaves, is_float)))
    if key not in _PROGRAMS:
        narrow = [np.asarray(x, np.float32) if f else np.asarray(x)
                  for x, f in zip(leaves, is_float)]
        closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
            *jax.tree_util.tree_unflatten(treedef, narrow))
        out_tree = jax.tree_util.tree_structure(out_shape)
        names: list = []  # the compared primitives, in order: known once traced
        shapes, weights = zip(*_sites_of(closed.jaxpr, []))

        def program(flat, flat_bounds):
            def perturbed(eps, eps_in):
                sites = _Sites(eps)
                ins = [x + next(it) if f else x
                       for it in [iter(eps_in)] for x, f in zip(flat, is_float)]
                outs = _eval(closed.jaxpr, closed.consts, ins, sites)
                names[:] = sites.names
                vec = jnp.concatenate([o.ravel() for o in outs]
                                      + [g.ravel() for g in sites.gaps])
                return vec, (outs, sites.mags, sites.gaps)

            eps0 = [jnp.zeros(shape, jnp.float64) for shape in shapes]
            eps_in0 = [jnp.zeros_like(b) for b in flat_bounds]

            def spread(j, m):  # sum over the perturbation's elements of |dy / dr| m
                return jnp.sum(jnp.abs(j) * m[None], axis=tuple(range(1, j.ndim)))

            def total(jac, jac_in, mags):
                bound = unit * sum(w * spread(j, m) for j, m, w in zip(jac, mags, weights))
                return bound + sum(spread(j, b) for j, b in zip(jac_in, flat_bounds))

            if rows is None:
                (jac, jac_in), (outs, mags, gaps) = jax.jacrev(
                    perturbed, argnums=(0, 1), has_aux=True)(eps0, eps_in0)
                return outs, total(jac, jac_in, mags), gaps
            vec, pullback, (outs, mags, gaps) = jax.vjp(perturbed, eps0, eps_in0,
                                                        has_aux=True)

            def row(i):  # one output element's row of the Jacobian, then its bound
                jac, jac_in = pullback(jnp.zeros_like(vec).at[i].set(1.0))
                return total([j[None] for j in jac], [j[None] for j in jac_in], mags)[0]

            bound = jax.lax.map(row, jnp.arange(vec.size), batch_size=rows)
            return outs, bound, gaps

        with jax.enable_x64(True):
            _PROGRAMS[key] = (jax.jit(program), names, out_tree)
    compiled, names, out_tree = _PROGRAMS[key]
    bounds = []
    for i, arg in enumerate(args):
        given = None if arg_bounds is None or i >= len(arg_bounds) else arg_bounds[i]
        parts = (jax.tree_util.tree_leaves(given) if given is not None else
                 [np.zeros(np.shape(x)) for x in jax.tree_util.tree_leaves(arg)])
        bounds += [np.asarray(b, np.float64) for b, x in zip(
            parts, jax.tree_util.tree_leaves(arg)) if _is_float(np.asarray(x))]
    with jax.enable_x64(True):
        wide = [np.asarray(x, np.float64) if f else np.asarray(x)
                for x, f in zip(leaves, is_float)]
        outs, bound, gaps = compiled(wide, bounds)
    outs = [np.asarray(o) for o in outs]
    bound = np.asarray(bound)
    sizes = np.cumsum([0] + [o.size for o in outs])
    per_out = [bound[a:b].reshape(o.shape) for a, b, o in zip(sizes[:-1], sizes[1:], outs)]
    flips: dict = {}
    at = sizes[-1]
    for name, g in zip(names, gaps):
        g = np.asarray(g).ravel()
        b = bound[at:at + g.size]
        at += g.size
        near = (np.abs(g) <= b) & (b > 0)
        if name in ("eq", "ne"):
            near &= g != 0  # equal in exact arithmetic: the same value compared
        if near.any():
            flips[name] = flips.get(name, 0) + int(near.sum())
    unflatten = lambda xs: jax.tree_util.tree_unflatten(out_tree, xs)  # noqa: E731
    return unflatten(outs), unflatten(per_out), flips


def assert_within(actual, exact, bound, what: str = "") -> float:
    """Per element ``|actual - exact| <= bound``; returns the largest ratio."""
    worst = 0.0
    flat = jax.tree_util.tree_flatten_with_path(actual)[0]
    for (path, a), x, b in zip(flat, jax.tree_util.tree_leaves(exact),
                               jax.tree_util.tree_leaves(bound)):
        err = np.abs(np.asarray(a, np.float64) - np.asarray(x, np.float64))
        b = np.asarray(b, np.float64)
        # An element with a zero bound and a zero error is exactly right (ratio 0); with a
        # zero bound and any error, infinitely far off. (inf * 0 would make the first nan.)
        over = np.where(err > 0, np.inf, 0.0)
        ratio = float(np.max(np.where(b > 0, err / np.where(b > 0, b, 1), over), initial=0.0))
        assert np.all(err <= b), (
            f"{what}{jax.tree_util.keystr(path)}: error {float(np.max(err)):.3g}, "
            f"{ratio:.3g}x its derived rounding bound")
        worst = max(worst, ratio)
    return worst
