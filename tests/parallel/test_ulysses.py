"""Ulysses sequence parallelism: attention against one device, and the GPT trained with it.

Attention tests run ``ulysses_attention`` inside ``shard_map`` with the sequence split over
``"local"`` (P_sp = local devices) and the batch replicated over ``"node"``, and compare,
forward and gradients, with ``dot_product_attention`` on whole sequences: its float64 values
within a derived bound on fp32 rounding (fp32 attention), or its one-device bf16 evaluation
within that bound scaled to bf16. The GPT tests run both sides in float64 (the derived
tolerance of tests/helpers.py, ``FLOAT64_RHO``), ZeRO++'s gradients within qgZ's derived
INT4 error (``qgz_bound.qgz_error_bounds``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.measure.analysis import comm_report
from zeropp_demo.gpt import GPT, loss_fn
from zeropp_jax.parallel.ulysses import (dot_product_attention, head_plan, pad_sequence,
                                         ulysses_attention)

from running_error import _COMPARE, U32, _sub, running_error_bound

from qgz_bound import assert_within_bound, qgz_error_bounds
from helpers import (FLOAT64, FLOAT64_RHO, SMALL, SMALL64, U64, adam_sensitivity, as_float64,
                     assert_leaves_equal, assert_rounding_close, assert_training_close,
                     dequantized_params, float64_run, fresh_seed, init_params, jitted,
                     reference_loss_and_grads, reference_train, seed_on_failure,
                     trajectory_tolerances)

SEQ = P(None, "local")  # [batch, seq, heads, head_dim]: sequence over "local"


def _put(mesh, x, spec=SEQ):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _qkv(batch, seq, hq, hkv, d, seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq, hq, d)).astype(np.float32)
    k = rng.standard_normal((batch, seq, hkv, d)).astype(np.float32)
    v = rng.standard_normal((batch, seq, hkv, d)).astype(np.float32)
    return q, k, v


def _sp_attention(mesh, attention_fn, **kw):
    body = functools.partial(ulysses_attention, attention_fn=attention_fn, **kw)
    return jax.jit(jax.shard_map(lambda q, k, v: body(q, k, v), mesh=mesh,
                                 in_specs=(SEQ, SEQ, SEQ), out_specs=SEQ))


def _random_mask(seq, seed):
    # A user's own mask on global positions (keys allowed at random, the diagonal always, so
    # no query row is empty).
    # Built in numpy: as jnp ops, each would compile a program of its own.
    rng = np.random.default_rng(seed)
    return jnp.asarray((rng.random((seq, seq)) < 0.5) | np.eye(seq, dtype=bool))


# (batch, P_sp, Hq, Hkv, kind). Heads: MHA even; GQA with Hkv % P == 0; GQA and MQA with
# Hkv < P (key/value heads replicated); Hkv neither a multiple nor a divisor of P; uneven
# query heads (padded), MHA and GQA.
# Every kind of head layout above and every mask kind keeps a case in `make test`; the
# other cases of a kind run in test-all.
_MORE = pytest.mark.slow
CASES = [
    (1, 2, 4, 4, "causal"),
    pytest.param(3, 4, 4, 4, "causal", marks=_MORE),
    pytest.param(1, 4, 8, 8, "dense", marks=_MORE),
    pytest.param(2, 2, 4, 4, "dense", marks=_MORE),
    (2, 2, 8, 2, "causal"),
    pytest.param(2, 4, 8, 2, "causal", marks=_MORE),
    (1, 4, 4, 1, "dense"),
    (2, 4, 12, 6, "masked"),
    (2, 4, 6, 3, "causal"),
    (1, 2, 5, 5, "dense"),
]


# Short sequences and heads: the derived bound takes a row of a Jacobian per output element
# over every [seq, seq] intermediate, ~seq^3 head_dim work per head (8 tokens per device and
# head_dim 8 took 61 s for the make-test cases, these ~14 s).
TOKENS_PER_DEVICE, HEAD_DIM = 4, 4


@pytest.mark.parametrize("batch,sp,hq,hkv,kind", CASES)
def test_attention_matches_single_device(batch, sp, hq, hkv, kind):
    seed = fresh_seed()  # fresh inputs each run
    with seed_on_failure(seed):
        _check_attention(batch, sp, hq, hkv, kind, seed)


def _check_attention(batch, sp, hq, hkv, kind, seed):
    """Sharded attention's output and gradients on inputs drawn from ``seed`` against their
    float64 values, within the derived fp32 rounding bound; returns the largest error /
    bound ratio and the largest bound relative to its leaf's largest element."""
    seq, d = TOKENS_PER_DEVICE * sp, HEAD_DIM
    mesh = zpp.make_mesh(8 // sp, sp)
    q, k, v = _qkv(batch, seq, hq, hkv, d, seed)
    mask = _random_mask(seq, seed) if kind == "masked" else None
    attn = functools.partial(dot_product_attention, causal=kind == "causal", mask=mask)
    sp_attn = _sp_attention(mesh, attn)
    args = [_put(mesh, a) for a in (q, k, v)]

    # Gradients by autodiff through both all-to-alls, for a loss that weighs every output
    # element differently (a plain sum would hide a permutation of tokens or heads). The
    # output comes from the same program (one compile, not two).
    w = np.random.default_rng(seed + 1).standard_normal(q.shape).astype(np.float32)

    def weighted(*a):
        out = sp_attn(*a)
        return jnp.sum(out * w), out

    grads, out = jax.jit(jax.grad(weighted, argnums=(0, 1, 2), has_aux=True))(*args)
    # fp32; per head the sharded program runs dot_product_attention's operations (padding
    # heads with zeros, repeating key/value heads), only XLA's fusion and the
    # order of its sums differ (gradients of k, v sum over the query heads sharing them,
    # GQA, partly across devices): so each element lies within the first-order rounding
    # bound of any fp32 evaluation of those operations (``_reference``; tests/running_error.py:
    # derived, not measured) of its float64 value. A permuted token or head is off by the
    # outputs' own size, far beyond the bound: checked below to stay under 1% of each
    # leaf's largest element (it is ~1e-5 of it; a relative error of 1e-3 is 300x over).
    exact, bound = _attention_bound(kind, q, k, v, w, mask)
    worst = size = 0.0
    for name, a, e, b in zip(("out", "dq", "dk", "dv"), jax.tree_util.tree_leaves((out, grads)),
                             jax.tree_util.tree_leaves(exact), jax.tree_util.tree_leaves(bound)):
        err = np.abs(np.asarray(a, np.float64) - e)
        ratio = float(np.max(err / np.maximum(b, np.finfo(np.float64).tiny)))
        assert np.all(err <= b), (
            f"attention {name}: error {np.max(err):.3g}, {ratio:.3g}x its derived bound")
        worst = max(worst, ratio)
        rel = float(np.max(b) / np.max(np.abs(e)))
        assert rel < 1e-2, f"attention {name}: bound {rel:.3g} of the values' size"
        size = max(size, rel)
    return worst, size


def _attention_bound(kind, q, k, v, w, mask):
    """Float64 ``(out, (dq, dk, dv))`` of ``_reference(kind)`` and, per element, the
    derived bound on any fp32 evaluation's rounding (``running_error_bound``), as numpy
    trees. Attention is independent per batch row and key/value head (with the query heads
    that share it): each such group is bounded on its own slices, by one compiled program
    (the Jacobian of the whole would hold outputs times ``[b, h, s, s]`` sites)."""
    batch, hq, hkv = q.shape[0], q.shape[2], k.shape[2]
    g = hq // hkv
    fn = _reference(kind)
    exact = [np.zeros(q.shape), (np.zeros(q.shape), np.zeros(k.shape), np.zeros(k.shape))]
    bound = jax.tree_util.tree_map(np.zeros_like, exact)
    for b in range(batch):
        for h in range(hkv):
            qs = (slice(b, b + 1), slice(None), slice(h * g, (h + 1) * g))
            ks = (slice(b, b + 1), slice(None), slice(h, h + 1))
            ex, bd, flips = running_error_bound(fn, q[qs], k[ks], v[ks], w[qs], mask,
                                                rows=128)
            assert not flips, flips  # softmax compares no floats; a change would show here
            for full, part in ((exact, ex), (bound, bd)):
                for i, s in enumerate((qs, qs, ks, ks)):
                    leaves = [full[0], *full[1]]
                    leaves[i][s] = jax.tree_util.tree_leaves(part)[i]
    return exact, bound


@functools.cache
def _reference(kind):
    """Attention's output and the gradients of ``sum(out * w)``, ``(q, k, v, w, mask) ->
    (out, (dq, dk, dv))``, for ``_attention_bound``: ``dot_product_attention``'s operations
    (one function per kind: ``running_error_bound`` compiles once per kind and shapes),
    with the query heads that share a key/value head contracted together with the tokens
    in the gradients of k and v. There the single-device reference sums over tokens per
    head, then over heads (the transpose of ``jnp.repeat``), and a sharded program partly
    on other devices, in an order XLA may also merge into one sum: each is one order of
    this joint sum, whose bound covers them all."""
    def attn(q, k, v, mask):
        b, s, hq, d = q.shape
        hkv = k.shape[2]
        q = q.reshape(b, s, hkv, hq // hkv, d)  # query head i uses key/value head i // g
        logits = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) / jnp.sqrt(d).astype(q.dtype)
        allowed = jnp.ones((s, s), bool)
        if kind == "causal":
            allowed = jnp.tril(allowed)
        if mask is not None:
            allowed = allowed & mask
        logits = jnp.where(allowed, logits, jnp.finfo(logits.dtype).min)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1).astype(v.dtype)
        return jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(b, s, hq, d)

    def out_and_grads(q, k, v, w, mask):
        grads = jax.grad(lambda *a: jnp.sum(attn(*a, mask) * w), argnums=(0, 1, 2))(q, k, v)
        return attn(q, k, v, mask), grads

    return out_and_grads


U_BF16 = 2.0**-8  # bf16's unit roundoff: half an ulp of 1.0 (8 significand bits)


def _moves(q, k, v):
    """Attention's data movement without its arithmetic, as an ``attention_fn`` (exact in
    any dtype): each query head's own q beside the k and v of the key/value head it uses
    (GQA), the tokens of k reversed and those of v rotated by one (an output token reads
    others of the whole sequence, as attention does)."""
    g = q.shape[2] // k.shape[2]
    k, v = (jnp.repeat(a, g, axis=2) for a in (k, v))
    third = q.shape[-1] // 3
    return jnp.concatenate([q[..., :third], k[:, ::-1, :, third:2 * third],
                            jnp.roll(v, 1, axis=1)[..., 2 * third:]], axis=-1)


def _float_comparisons(fn, *args) -> list[str]:
    """The comparisons of floats in ``fn``'s program (where rounding could flip a branch
    and the first-order bound of ``running_error_bound`` would not hold)."""
    found = []

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            sub = _sub(eqn)
            if sub is not None:
                walk(sub[0])
            elif eqn.primitive.name in _COMPARE and jnp.issubdtype(
                    eqn.invars[0].aval.dtype, jnp.floating):
                found.append(eqn.primitive.name)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def test_bf16_moves_as_16_bits_and_matches():
    mesh = zpp.make_mesh(2, 4)
    attn = functools.partial(dot_product_attention, causal=True)
    seed = fresh_seed()  # fresh inputs each run
    # 8 tokens, 2 per device: short sums keep the derived bf16 allowance below meaningful
    # (~0.3 of the outputs' size; a sum of n terms may round by (n - 1) U_BF16 of them, and
    # at 32 tokens the allowance neared the outputs' size).
    q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in _qkv(2, 8, 4, 2, 8, seed=seed))
    args = [_put(mesh, a) for a in (q, k, v)]
    with jax.default_device(jax.devices()[0]):
        moved_ref = jitted(_moves)(q, k, v)
        ref = jitted(attn)(q, k, v)
    # The bf16 all-to-alls (as uint16) move values, nothing else: with an attention_fn
    # that only moves data, the sharded output equals the one-device one bit for bit (a
    # permuted token or head, or a value changed in transit, shows here at zero tolerance).
    with seed_on_failure(seed):
        assert_leaves_equal(_sp_attention(mesh, _moves)(*args), moved_ref)
    f = _sp_attention(mesh, attn)
    out = f(*args)
    # Attention itself in bf16, derived: running_error_bound bounds any fp32 evaluation of
    # attn's operations by U32 times a sum over its roundings (weight x |derivative| x
    # magnitude), linear in the unit roundoff. A bf16 evaluation rounds each of those
    # operations by at most U_BF16: the bf16 einsums (accumulated in fp32 or bf16, then
    # rounded: within k U_BF16 of |q|.|k| either way), the fp32 softmax (each fp32
    # rounding below U_BF16), its cast back to bf16 and the bf16 scale sqrt(d) (one
    # rounding after a division or square root, whose weight of 2 covers two). So the
    # bound times U_BF16 / U32 covers both bf16 evaluations (one device, sharded), from
    # the same bf16 inputs (exact), to first order; the products of roundings it leaves
    # out are allowed for as Higham's gamma_n = nU / (1 - nU) does: 1 / (1 - r), r the
    # bound's size relative to the outputs (~0.13). attn compares no floats (a rounding
    # could flip a comparison, where the first-order bound would not hold).
    f32 = [np.asarray(a, np.float32) for a in (q, k, v)]
    assert not _float_comparisons(attn, *f32)
    exact, bound, _ = running_error_bound(attn, *f32, rows=128)
    bound = bound * (U_BF16 / U32)
    r = float(np.max(bound) / np.max(np.abs(exact)))
    allowed = 2 * bound / (1 - r)
    # Below half the outputs' size (~0.3 of it): a broken head (zeros, garbage) fails;
    # routing is checked exactly above, which a bound this loose could not do.
    assert np.max(allowed) < 0.5 * np.max(np.abs(exact)), (r, seed)
    with seed_on_failure(seed):
        for name, a in (("sharded", out), ("one device", ref)):
            err = np.abs(np.asarray(a, np.float64) - exact)
            assert np.all(err <= bound / (1 - r)), (
                f"{name}: error {np.max(err):.3g}, {np.max(err / bound):.3g}x its bound")
        err = np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64))
        assert np.all(err <= allowed), f"{np.max(err):.3g} > {np.max(allowed):.3g}"
    grad = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a).astype(jnp.float32)), argnums=(0, 1, 2)))
    text = grad.lower(*args).compile().as_text()
    # XLA's CPU backend would widen a bf16 all-to-all to f32; the bitcast keeps 2 bytes.
    # (Compiled, the forward output's all-to-all is dead code here: grad discards the sum.)
    a2a = [line for line in text.splitlines() if " all-to-all(" in line]
    assert a2a and all("u16[" in line and "f32[" not in line for line in a2a), a2a


def test_head_plan():
    # (kv_repeat, padded q heads) for the layouts in the module docstring.
    assert head_plan(8, 8, 4) == (1, 8)
    assert head_plan(8, 2, 4) == (2, 8)  # GQA, Hkv < P: each kv head to 2 devices
    assert head_plan(8, 1, 4) == (4, 8)  # MQA: the one kv head to every device
    assert head_plan(12, 6, 4) == (2, 12)
    assert head_plan(6, 3, 4) == (2, 8)  # uneven: kv expanded to 6, all padded to 8
    with pytest.raises(ValueError, match="multiple of 4"):
        head_plan(6, 3, 4, uneven_heads="error")


def test_bad_input_raises_clear_errors():
    mesh = zpp.make_mesh(2, 4)
    attn = functools.partial(dot_product_attention, causal=True)
    q, k, v = _qkv(1, 16, 4, 4, 8, seed=7)
    put = functools.partial(_put, mesh)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        _sp_attention(mesh, attn)(put(q), put(k), put(v[..., :4]))
    with pytest.raises(ValueError, match=r"agree on \[batch, seq / P\]"):
        _sp_attention(mesh, attn)(put(q), put(k[:, :8]), put(v[:, :8]))
    with pytest.raises(ValueError, match="head_dim"):
        _sp_attention(mesh, attn)(put(q[..., :4]), put(k), put(v))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        _sp_attention(mesh, attn)(put(q[:, :, :3]), put(k[:, :, :2]), put(v[:, :, :2]))
    q6 = np.concatenate([q, q[:, :, :2]], axis=2)
    with pytest.raises(ValueError, match="uneven_heads='pad'"):
        _sp_attention(mesh, attn, uneven_heads="error")(put(q6), put(q6), put(q6))


# -- the GPT with sequence parallelism ------------------------------------------------------

CFG = dataclasses.replace(SMALL, seq_len=16)  # T = 16: 4 tokens per device on 2x4
CFG64 = dataclasses.replace(SMALL64, seq_len=16)  # its float64 twin, for the parity runs
FP32 = dict(compute_dtype="float32")
# eps=1e-3 as in test_engine: identically-zero gradients (attention's key bias) come out as
# rounding noise that a tiny eps would turn into full +-lr steps.
TX = optax.adam(1e-2, eps=1e-3)


def _lm_step(batch_spec):
    @zpp.train_step(batch_spec=batch_spec)
    def step(state, batch):
        def loss_of(p):
            # Each device: mean over its own tokens (equal counts, so the pmean over devices
            # of losses and gradients is the global mean).
            return loss_fn(state.apply_fn({"params": p}, batch["x"]), batch["y"])

        loss, grads = jax.value_and_grad(loss_of)(state.params)
        new = state.apply_gradients(grads=grads)

        # Squared L2 norms of the gradient, of the step's change of the parameters and of
        # the new parameters, in their own dtype (float64 in the parity runs): each device
        # sums its primary shard (padding is zero); the step pmeans metrics, so multiply by
        # the device count afterwards.
        def sq(tree):
            return sum(jnp.sum(x ** 2) for x in tree.values())

        moved = {k: new.params.units[k] - state.params.units[k] for k in grads.units}
        return new, {"loss": loss, "grads": grads, "grad_sq": sq(grads.units),
                     "moved_sq": sq(moved), "param_sq": sq(new.params.units)}

    return step


def _batches(seed, n=3, batch=8, seq=CFG.seq_len):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        t = rng.integers(0, CFG.vocab_size, (batch, seq + 1))
        t = t.astype(np.int32)
        out.append({"x": t[:, :-1], "y": t[:, 1:]})
    return out


def _train(config, sequence_parallel, params, batches, tx):
    """Three float64 steps (inside ``float64_run``): the last state, the step, the losses,
    the norms, and per step the state it started from and its gradients (consolidated)."""
    cfg = dataclasses.replace(CFG64, sequence_axis="local" if sequence_parallel else None)
    state = zpp.TrainState.create(model=GPT(cfg), params=params, tx=tx,
                                  mesh=zpp.make_mesh(2, 4), config=config)
    # Sequence parallel: batch over "node", sequence over "local". Without: the same global
    # batch split over all 8 devices.
    step = _lm_step(P("node", "local") if sequence_parallel else P(("node", "local")))
    losses, norms, history = [], {"grad": [], "moved": [], "param": []}, []
    for b in batches:
        before = state
        state, m = step(state, b)
        losses.append(float(m["loss"]))
        history.append((before, state.engine.consolidate(m["grads"])))
        for k, v in norms.items():
            v.append(float(np.sqrt(8 * np.float64(m[k + "_sq"]))))
    return state, step, losses, norms, history


SGD_LR = 0.05


def _training_runs(seed):
    """Three float64 steps each, from parameters and batches drawn from ``seed``: ZeRO-3
    with Adam, with sequence parallelism (compared with one-device training); ZeRO++
    (float64 compute, quantized weights and gradients) with SGD, with and without it."""
    params = as_float64(init_params(CFG, seed=seed))
    batches = _batches(seed)
    out = {"params": params, "batches": batches, "seed": seed}
    with float64_run():
        out["zero3", True] = _train(zpp.ZeroPPConfig.zero3(**FLOAT64), True, params, batches,
                                    TX)
        for sp in (False, True):
            out["zeropp", sp] = _train(zpp.ZeroPPConfig.zeropp(**FLOAT64), sp, params,
                                       batches, optax.sgd(SGD_LR))
    return out


@pytest.fixture(scope="module")
def runs(_seed_round):  # drawn again each --seed-rounds round (tests/conftest.py)
    return _training_runs(fresh_seed())  # fresh inputs each run


def _windows(batch):
    """A ``{"x", "y"}`` batch as the token windows ``[b, seq + 1]`` of helpers' GPT loss."""
    return np.concatenate([batch["x"], batch["y"][:, -1:]], axis=1)


def test_gpt_sequence_parallel_zero3_equals_single_device(runs):
    with seed_on_failure(runs["seed"]):
        _check_zero3_equals_single_device(runs)


def _check_zero3_equals_single_device(runs):
    sp, _, sp_losses, _, _ = runs["zero3", True]
    # float64 ZeRO-3 with sequence parallelism against plain one-device training (what
    # test_engine checks the data-parallel ZeRO-3 step against, so SP trains as DP does,
    # without compiling a DP step here): the two compute the same sums in different
    # groupings (per-device partial means over different token sets, attention per head
    # group): each within the derived float64 rounding (FLOAT64_RHO), carried through 3
    # Adam steps as in test_engine.
    params, windows = runs["params"], [_windows(b) for b in runs["batches"]]
    with float64_run():
        ref_params, ref_losses, ref_grads = reference_train(
            GPT(CFG64), params, TX, windows, with_grads=True, jit_optimizer=True)
    rho, g = FLOAT64_RHO, ref_grads[0]
    tols = trajectory_tolerances(params, g, rho=rho, lr=1e-2, steps=3,
                                 sensitivity=adam_sensitivity(1e-3))
    # Not comparing constants: assert_training_close checks that every parameter leaf the
    # reference moved (all but those whose gradient cancels exactly) moved by more than 100x
    # its tolerance, so the SP run, within the tolerance of the reference, moved too.
    assert_training_close(sp_losses, sp.consolidate(), ref_losses, ref_params, ref_grads,
                          tols, rho, start=params)


@functools.lru_cache(maxsize=None)
def _per_device_grads(sequence_parallel):
    """``(params, x, y) -> (losses [8], gradients [8, ...])``: each device's loss on its
    batch shard and its gradient (float64 model, inside ``float64_run``), as the ZeRO++
    step computes them before reducing: the parameters made device-varying, so autodiff
    keeps each device's own gradient (with sequence parallelism: of every device's loss
    through this device's computations, as the step's backward through the all-to-alls)."""
    cfg = dataclasses.replace(CFG64, sequence_axis="local" if sequence_parallel else None)
    axes = ("node", "local")
    spec = P("node", "local") if sequence_parallel else P(axes)

    def body(p, x, y):
        p = jax.tree_util.tree_map(lambda a: jax.lax.pcast(a, axes, to="varying"), p)
        loss, g = jax.value_and_grad(
            lambda p: loss_fn(GPT(cfg).apply({"params": p}, x), y))(p)
        return loss[None], jax.tree_util.tree_map(lambda a: a[None], g)

    return jax.jit(jax.shard_map(body, mesh=zpp.make_mesh(2, 4), in_specs=(P(), spec, spec),
                                 out_specs=(P(axes), P(axes))))


def test_gpt_sequence_parallel_zeropp_within_quantization_bound(runs):
    with seed_on_failure(runs["seed"]):
        _check_zeropp_within_quantization_bound(runs)


def _check_zeropp_within_quantization_bound(runs):
    _, _, dp, dp_norms, dp_history = runs["zeropp", False]
    _, _, sp, sp_norms, sp_history = runs["zeropp", True]
    # Step 1: qwZ quantizes the same primary shards deterministically, so both runs compute
    # with identical INT8-dequantized weights, in float64: equal up to the derived float64
    # rounding of the loss there (2 FLOAT64_RHO of it).
    assert_rounding_close(sp[0], dp[0], FLOAT64_RHO)
    # Every step of either run, at the weights it computed with (qwZ's INT8 blocks of its
    # primary shards, dequantized): its loss is the one-device float64 loss there, and its
    # gradient the one-device gradient there within qgZ's derived INT4 error
    # (``qgz_error_bounds``, from that run's per-device gradients: with sequence
    # parallelism each device holds other tokens, so its INT4 blocks round otherwise).
    config = runs["zeropp", True][0].config
    windows = [_windows(b) for b in runs["batches"]]
    for sequence_parallel, history, losses in ((False, dp_history, dp),
                                               (True, sp_history, sp)):
        for t, (before, got) in enumerate(history):
            b = runs["batches"][t]
            with float64_run():
                deq = as_float64(dequantized_params(before, config.block_size,
                                                    config.weight_bits))
                ref_loss, ref = reference_loss_and_grads(GPT(CFG64), deq, windows[t])
                _, per = _per_device_grads(sequence_parallel)(deq, b["x"], b["y"])
            per = jax.tree_util.tree_map(np.asarray, per)
            where = f"{'sequence' if sequence_parallel else 'data'} parallel, step {t + 1}"
            assert_rounding_close(losses[t], float(ref_loss), FLOAT64_RHO)
            # The per-device gradients are the step's: their mean is the gradient.
            assert_rounding_close(jax.tree_util.tree_map(lambda a: a.mean(0), per), ref,
                                  FLOAT64_RHO)
            bound = qgz_error_bounds(
                before.engine.layouts, [jax.tree_util.tree_map(lambda a: a[d], per)
                                        for d in range(8)],
                nodes=2, local=4, block=config.block_size, bits=config.grad_bits)
            assert_within_bound(got, ref, bound, where)
    # Training moved (the losses above are not those of constant weights): each step of
    # either run changed the parameters by lr times its (qgZ-reduced) gradient, whose
    # norm is far from 0. SGD's update rounds twice per element (lr * g, then p - lr g):
    # off by at most U (lr |g| + |p_new|); each norm sums n squares (relative error at
    # most (n + 1) U, half that after the square root, for both norms compared). U: the
    # runs' float64 (the update and the norms run in the parameters' dtype).
    n = sum(x.size for x in jax.tree_util.tree_leaves(runs["params"]))
    for norms in (dp_norms, sp_norms):
        for grad, moved, param in zip(norms["grad"], norms["moved"], norms["param"]):
            tol = U64 * (SGD_LR * grad + param) + (n + 1) * U64 * (moved + SGD_LR * grad)
            assert abs(moved - SGD_LR * grad) <= tol, (moved, SGD_LR * grad, tol)
            assert tol < 1e-2 * moved, (tol, moved)


def test_gpt_all_to_alls_in_lowered_step(runs):
    state, step, _, _, _ = runs["zero3", True]
    batch = runs["batches"][0]
    with float64_run():  # the float64 state's step (as it ran)
        report = comm_report(step.lower(state, batch), state.mesh)
    a2a = [r for r in report.rows if r.kind == "all-to-all"]
    # ZeRO-3 (no qgZ) uses no all-to-all of its own, so each one is Ulysses'. Per attention
    # layer: forward 2 (q,k,v fused, then the output), and autodiff transposes those two
    # (2 more). remat="minimal" (the default) keeps the all-to-alls' results, so backward
    # does not repeat them: 4 per layer (remat="full" recomputes them: 6).
    assert sum(r.count for r in a2a) == 4 * CFG.layers
    # All over "local": each replica group is one node's 4 devices, nothing crosses nodes.
    assert all(r.cross_node_bytes == 0 for r in a2a)
    assert all(sorted(g) in ([0, 1, 2, 3], [4, 5, 6, 7]) for r in a2a for g in map(list, r.groups))
    # Bytes: per layer and device, forward carries 4 N h / P elements (N = 4 sequences of
    # 16 tokens per node, h = d_model, P = 4), of the activations' dtype (float64 here: 8
    # bytes); the transposes as much again.
    n_tokens = 8 // 2 * CFG.seq_len
    per_layer_fwd = 4 * n_tokens * CFG.d_model // 4 * np.dtype(CFG64.dtype).itemsize
    assert sum(r.bytes * r.count for r in a2a) == 2 * per_layer_fwd * CFG.layers


def test_gpt_padded_sequence_with_causal_mask_is_exact():
    # Sequence of 13 tokens, not divisible by P_sp = 4: pad to 16 at the end. Causal
    # attention never lets a real token see a later (padded) one, so the real tokens'
    # logits equal the unpadded single-device model's; the padded positions are masked out
    # of the loss with `valid`.
    cfg = dataclasses.replace(CFG64, sequence_axis="local")
    seed = fresh_seed()  # fresh inputs each run
    params = as_float64(init_params(CFG, seed=seed))
    toks = np.random.default_rng(seed).integers(0, CFG.vocab_size, (2, 13)).astype(np.int32)
    padded, valid = pad_sequence(toks, 4)
    assert padded.shape == (2, 16) and valid.sum() == 13
    mesh = zpp.make_mesh(2, 4)
    spec = P("node", "local")
    with float64_run():
        fwd = jax.jit(jax.shard_map(lambda p, x: GPT(cfg).apply({"params": p}, x), mesh=mesh,
                                    in_specs=(P(), spec), out_specs=spec))
        logits = fwd(params, _put(mesh, padded, spec))
        with jax.default_device(jax.devices()[0]):
            ref = jitted(_one_device)(params, toks)
    # float64, same per-token computation; only reduction order differs: each within the
    # derived float64 rounding of the exact logits. A token seeing a padded one is off by
    # the logits' size.
    with seed_on_failure(seed):
        assert_rounding_close(np.asarray(logits)[:, valid], ref, FLOAT64_RHO)


def _one_device(p, t):
    """The unpadded float64 GPT's logits on one device (one function: ``jitted`` reuses
    its program)."""
    return GPT(CFG64).apply({"params": p}, t)


def test_gpt_sequence_parallel_bad_lengths():
    cfg = dataclasses.replace(CFG, sequence_axis="local")
    params = init_params(CFG, seed=9)
    state = zpp.TrainState.create(model=GPT(cfg), params=params, tx=TX,
                                  mesh=zpp.make_mesh(2, 4), config=zpp.ZeroPPConfig.zero3(**FP32))
    step = _lm_step(P("node", "local"))
    toks = np.zeros((2, 14), np.int32)
    # 14 tokens do not split over 4 devices: the batch placement names the fix.
    with pytest.raises(ValueError, match="not divisible by the 4 devices"):
        step(state, {"x": toks, "y": toks})
    # 32 tokens exceed the 16-entry position table.
    toks = np.zeros((2, 32), np.int32)
    with pytest.raises(ValueError, match="exceeds GPTConfig.seq_len=16"):
        step(state, {"x": toks, "y": toks})

