"""A derived bound on qgZ's gradient error, for the tests that train with it: how far qgZ's
mean of the devices' gradients may lie from their exact mean (default settings), and the
check of a step's gradients against it."""

from __future__ import annotations

import functools

import jax
import numpy as np

from zeropp_jax.comm.partition import REST, merge_units, split_units

from helpers import FLOAT64_RHO, U32


def unit_trees(tree, layouts):
    """A params-shaped tree -> ``{unit name: its subtree}`` (the rest unit: what no unit
    holds)."""
    units, rest = split_units(tree, [lay.path for n, lay in layouts.items() if n != REST])
    return {n: rest if n == REST else units[lay.path] for n, lay in layouts.items()}


def qgz_error_bounds(layouts, per_device, *, nodes, local, block, bits):
    """Elementwise, per leaf of the params tree: a derived bound on how far qgZ's mean of
    the devices' gradients ``per_device`` (float64 trees, device ``d = node * local +
    j``; default settings: both hops quantized, round to nearest, no rotation, no error
    feedback) lies from their exact mean, ``nodes > 1``.

    Each unit's flat ``[n_pad]`` gradient (``[tp, n_pad]``: each tensor-parallel row on its
    own) is cut into the ``P`` slices of the reduce-scatter, each zero padded to whole
    blocks of ``block`` elements (``comm.qgz``; a bucket gives its members the same,
    ``units.bucket``). One quantization of a block with absmax ``A`` (INT``bits``,
    ``qmax = 2^(bits-1) - 1``, in fp32): the cast to fp32 (``U A``), the scale
    ``s = fl(A fl(1 / qmax))`` (two roundings), ``y = fl(x fl(1 / s))`` (two more, on
    ``|x / s| <= qmax + 1``), rounding ``y`` to an integer (``1 / 2``), the product
    ``fl(q s)`` (one more): ``|deq - x| <= A (1 / (2 qmax) + 6 U)`` (U the fp32 unit
    roundoff). Hop 1: every device quantizes its gradient; each node sums its ``L``
    dequantized contributions in fp32 (``(L - 1) U`` of their magnitudes). Hop 2 quantizes
    those partial sums, whose block absmax is at most the exact partial sums' plus hop 1's
    error; the ``N`` nodes' contributions are summed in fp32 again, and the sum divided
    by ``P``. Standard model, Higham ch. 2; no measured quantity. The devices'
    gradients here and in the step differ by float64 rounding (``FLOAT64_RHO`` of each
    one's largest element): allowed for in the absmaxes and the mean.
    """
    qmax = 2 ** (bits - 1) - 1
    one = 1 / (2 * qmax) + 6 * U32  # one quantization's error per unit of block absmax
    num = nodes * local
    assert len(per_device) == num and nodes > 1
    trees = [unit_trees(x, layouts) for x in per_device]
    units, rest = {}, {}
    for name, lay in layouts.items():
        x = np.stack([np.asarray(lay.flatten(t[name], np.float64)).reshape(-1, lay.n_pad)
                      for t in trees])  # [P devices, rows, n_pad]
        rows, m = x.shape[1], lay.n_pad // num
        m_pad = -(-m // block) * block
        x = x.reshape(num, rows, num, m)  # [device, row, slice, m]
        slack = 2 * FLOAT64_RHO * np.max(np.abs(x), axis=(1, 2, 3))  # per device
        x = np.pad(x, ((0, 0),) * 3 + ((0, m_pad - m),)).reshape(num, rows, num, -1, block)
        a = (np.max(np.abs(x), axis=-1) + slack[:, None, None, None]).reshape(
            nodes, local, rows, num, -1)  # block absmaxes [N, L, row, slice, block]
        hop1 = (one + (local - 1) * U32 * (1 + one)) * a.sum(1)  # per node
        partial = np.max(np.abs(x.reshape(nodes, local, rows, num, -1, block).sum(1)),
                         axis=-1)
        a2 = partial + hop1 + slack.reshape(nodes, local).sum(1)[:, None, None, None]
        err = hop1.sum(0) + (one + (nodes - 1) * U32 * (1 + one)) * a2.sum(0)  # of the sum
        mean = np.max(np.abs(x.sum(0)), axis=-1) / num
        bound = err / num + U32 * (mean + err / num) + slack.sum() / num  # [row, slice, blk]
        flat = np.broadcast_to(bound[..., None], bound.shape + (block,)).reshape(
            rows, num, m_pad)[..., :m].reshape(rows, lay.n_pad)
        tree = lay.unflatten(flat if lay.tp > 1 else flat[0])
        if name == REST:
            rest = tree
        else:
            units[lay.path] = tree
    return merge_units(rest, units)


def assert_within_bound(got, ref, bound, where):
    """Elementwise ``|got - ref| <= bound`` plus the float64 rounding of ``ref`` (within
    ``FLOAT64_RHO`` of each leaf's largest element, as the exact mean the bound is about).
    And the bound can fail a broken reduction: it is below a quarter of the gradient on
    elements holding at least a tenth of its squared norm, where a gradient zeroed, negated
    or doubled (off by ``|g| > 3 * bound`` even with qgZ's own error) breaks it."""
    flat = jax.tree_util.tree_flatten_with_path(got)[0]
    held = total = 0.0
    for (path, a), e, b in zip(flat, *map(jax.tree_util.tree_leaves, (ref, bound))):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        b = np.asarray(b) + FLOAT64_RHO * np.max(np.abs(e), initial=0.0)
        err = np.abs(a - e)
        assert np.all(err <= b), (
            f"{where}, {jax.tree_util.keystr(path)}: error {np.max(err):.3g}, "
            f"{np.max(err / b):.3g}x its derived qgZ bound")
        held += float(np.sum(e[np.abs(e) > 4 * b] ** 2))
        total += float(np.sum(e ** 2))
    assert held >= 0.1 * total, f"{where}: the bound guards {held / total:.2g} of the gradient"


def sliced_int_round_trip(flat, *, bits, block):
    """qwZ's INT``bits`` blocks of ``block`` through Q and Q^-1 (fp32 values) on a unit's
    flat buffer, ``[n_pad]`` or ``[T, n_pad]`` slices (a slice's blocks never straddle
    slices): the weights a qwZ step computes with, as numpy."""
    return np.asarray(_round_trip(jax.numpy.asarray(flat), bits=bits, block=block))


@functools.partial(jax.jit, static_argnames=("bits", "block"))
def _round_trip(flat, *, bits, block):
    # Jitted: one program per unit shape instead of one per primitive.
    import jax.numpy as jnp

    from pallas_kernels.quantize import dequantize_reference, quantize_reference

    kw = dict(bits=bits, block_size=block)
    deq = dequantize_reference(*quantize_reference(flat.reshape(-1), **kw),
                               dtype=jnp.float32, **kw)
    return deq.reshape(flat.shape)


def check_qgz_step(state, out, ref_loss, ref, per_group, config, *, nodes, local, rho, where):
    """One ZeRO++ step's outputs against the one-device float64 reference at the weights
    it computed with: the loss within ``rho`` of ``ref_loss`` (rounding), the consolidated
    gradient within qgZ's derived bound (``qgz_error_bounds`` from ``per_group``, the data
    groups' own gradients) of ``ref``."""
    from helpers import assert_rounding_close

    got = state.engine.consolidate(out["grads"])
    assert_rounding_close(float(out["loss"]), float(ref_loss), rho)
    bound = qgz_error_bounds(state.engine.layouts, per_group, nodes=nodes, local=local,
                             block=config.block_size, bits=config.grad_bits)
    assert_within_bound(got, ref, bound, where)
    return got
