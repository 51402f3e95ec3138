"""KV-cached generation on a sharded state (``zpp.generate``).

Exactness: the sharded program runs each unit on its full weights (gathered, or rebuilt from
hpZ's secondary) in fp32, so its logits equal one device's up to summation order; greedy
tokens must then be identical to ``reference_generate`` (the same loop on one device with
full params), to the cache-less full-sequence argmax (``greedy_reference``: checks the cache
itself), and, for transformers models, to transformers' own ``generate``. A tie between the
two best logits within rounding could flip a token; the tests draw fresh random models and
check the continuations are not degenerate, and a flip would fail loudly.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.inference.generate import (
    gather_secondary,
    greedy_reference,
    lower_generation_step,
    reference_generate,
)
from zeropp_jax.inference.conventions import FlaxCache, takes_several_tokens
from zeropp_jax.inference.sampling import Sampling, filtered_logits
from zeropp_jax.measure.analysis import comm_report
from zeropp_demo.gpt import GPT
from zeropp_demo.lm1b import TransformerConfig, TransformerLM

from helpers import SMALL, init_params, tokens
from zoo import hf_compat

DECODE = dataclasses.replace(SMALL, decode=True)


@pytest.fixture(scope="module", autouse=True)
def _one_reference_program_per_setting():
    """``reference_generate`` builds a new ``jax.jit`` on every call, and tracing its decode
    loop is most of a call's time. Here each model and settings get one program, which
    jit then reuses for every call of the same shapes: the greedy tests' references
    (hpZ and ZeRO-3, hpZ groups, frozen INT8: one model, 4-token prompts, 8 new tokens)
    and the sampling test's on each mesh. ``reference_generate`` itself is unchanged: it
    still checks the prompts, picks the prefill and runs the program."""
    from zeropp_jax.inference import generate as generation

    original = generation.reference_program
    programs: dict = {}

    def program(model, max_new_tokens, **settings):
        key = (model, max_new_tokens, repr(sorted(settings.items())))
        if key not in programs:
            programs[key] = original(model, max_new_tokens, **settings)
        return programs[key]

    generation.reference_program = program
    yield
    generation.reference_program = original


def _state(model, params, mesh_shape=(2, 4), **cfg):
    cfg.setdefault("compute_dtype", "float32")
    return zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                 mesh=zpp.make_mesh(*mesh_shape), config=zpp.ZeroPPConfig(**cfg))


# hpz=False (ZeRO-3) runs in test-all: its greedy tokens are checked against one device's
# by the lm1b and Bloom tests (ZeRO-3 states), its cache against the cache-less argmax by
# the lm1b test, its bytes per token (equal to the forward gathers', above zero) by the hpZ
# group test's plain state; gather_once calls the per-token path's own weight rebuild
# (``_unit_weights``) once, which hpz=True runs here.
@pytest.mark.parametrize("hpz", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_gpt_greedy_equals_one_device_with_and_without_cache(hpz):
    seed = np.random.SeedSequence().entropy % 10_000
    params = init_params(seed=seed)
    state = _state(GPT(SMALL), params, hpz=hpz)
    prompts = tokens(8, 4, seed=seed + 1)[:, :4]
    new = SMALL.seq_len - 4
    out = np.asarray(zpp.generate(state, prompts, new, model=GPT(DECODE)))
    assert out.shape == (8, SMALL.seq_len) and out.dtype == np.int32
    np.testing.assert_array_equal(out[:, :4], prompts)
    np.testing.assert_array_equal(out, reference_generate(GPT(DECODE), params, prompts, new))
    # The cache-less argmax over the whole sequence: the cache holds the right keys/values.
    np.testing.assert_array_equal(out, greedy_reference(GPT(SMALL), params, prompts,
                                                        SMALL.seq_len))
    assert len(np.unique(out[:, 4:])) > 2, f"seed {seed}: degenerate continuation"
    # Every unit gathered once before the loop: the same weights, the same tokens.
    np.testing.assert_array_equal(
        out, np.asarray(zpp.generate(state, prompts, new, model=GPT(DECODE), gather_once=True)))

    # Bytes per generated token, from the compiled one-token step: hpZ reads the secondary
    # inside the node only; ZeRO-3 gathers every unit across nodes.
    step = comm_report(lower_generation_step(state, prompts, new, model=GPT(DECODE)),
                       state.mesh)
    assert step.intra_node_bytes > 0
    if hpz:
        assert step.cross_node_bytes == 0, step.table()
        assert comm_report(gather_secondary.lower(state), state.mesh).cross_node_bytes > 0
    else:
        # fp32 weights, 2 nodes: each device receives the other node's half of every unit.
        n_pad = sum(lay.n_pad for lay in state.engine.layouts.values())
        assert step.cross_node_bytes >= 4 * n_pad / 2, step.table()


def test_hpz_groups_of_two_nodes_exchange_inside_the_group_only():
    """hpz_group_size = 2 nodes: each token rebuilds every unit from the group's secondary
    slices, the very exchange training's backward regather does, so its cross-node bytes per
    token equal the sum of the units' backward bytes (``Engine.wire_bytes``, counted from
    the transports) and are above zero; ZeRO-3's per token equal its forward gathers'. The
    tokens are the same."""
    params = init_params(seed=41)
    prompts = tokens(8, 4, seed=42)[:, :4]
    grouped = _state(GPT(SMALL), params, (4, 2), hpz=True, hpz_group_size=4)
    plain = _state(GPT(SMALL), params, (4, 2))
    new = SMALL.seq_len - 4  # the greedy test's shapes: its reference program
    out = np.asarray(zpp.generate(grouped, prompts, new, model=GPT(DECODE)))
    np.testing.assert_array_equal(out, reference_generate(GPT(DECODE), params, prompts, new))
    for state, part in ((grouped, "backward"), (plain, "forward")):
        per_token = comm_report(lower_generation_step(state, prompts, new, model=GPT(DECODE)),
                                state.mesh).cross_node_bytes
        expected = sum(row[part].cross for row in state.engine.wire_bytes().values())
        assert per_token == expected > 0, (part, per_token, expected)


# 8 rows on 8 devices: each device decodes one row, at the same row index, on every mesh;
# only the weight gathers differ. (2, 4) runs in `make test`: against the reference (one
# device decoding all 8 rows) it checks that a row's draws follow its index, not where it
# is decoded. (1, 8) (ZeRO-3's flat gather of (2, 4), over a "node" axis of size 1) and
# (4, 2) (greedy tokens checked there by the hpZ group test) run in test-all.
@pytest.mark.parametrize("mesh_shape", [(2, 4), pytest.param((1, 8), marks=pytest.mark.slow),
                                        pytest.param((4, 2), marks=pytest.mark.slow)])
def test_sampling_is_the_same_on_every_mesh_and_follows_lengths_and_stops(mesh_shape):
    params = init_params(seed=11)
    state = _state(GPT(SMALL), params, mesh_shape)
    prompts = tokens(8, 5, seed=12)[:, :5]
    lengths = np.array([1, 5, 3, 2, 5, 4, 1, 2], np.int32)
    kw = dict(temperature=1.3, top_k=20, top_p=0.9, key=jax.random.PRNGKey(7),
              stop_tokens=[3, 9], prompt_lengths=lengths, pad_token=63)
    out = np.asarray(zpp.generate(state, prompts, 6, model=GPT(DECODE), **kw))
    ref = reference_generate(GPT(DECODE), params, prompts, 6, **kw)
    np.testing.assert_array_equal(out, ref)
    for row, n in zip(out, lengths):
        gen = row[n:n + 6]
        stop = [i for i, t in enumerate(gen) if t in (3, 9)]
        end = stop[0] + 1 if stop else 6
        assert (row[n + end:] == 63).all()  # padding after the stop / after 6 new tokens
    for row, p, n in zip(out, prompts, lengths):
        np.testing.assert_array_equal(row[:n], p[:n])
    # Another key draws other tokens, from the same compiled program (one per shape).
    other = np.asarray(zpp.generate(state, prompts, 6, model=GPT(DECODE),
                                    **{**kw, "key": jax.random.PRNGKey(8)}))
    assert (other != out).any()
    programs = [v for k, v in state.engine.memo.items()
                if isinstance(k, tuple) and k[:2] == ("generate", "kv")]
    assert len(programs) == 1 and programs[0]._cache_size() == 1


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = np.log(np.array([[0.5, 0.3, 0.15, 0.05], [0.05, 0.15, 0.3, 0.5]], np.float32))
    # Jitted, as generate's loop runs it: one program per setting instead of its ops one by
    # one (each a small compile).
    filtered = jax.jit(filtered_logits, static_argnums=1)
    kept = lambda s: np.isfinite(np.asarray(filtered(logits, s)))  # noqa: E731
    np.testing.assert_array_equal(kept(Sampling(1.0, top_k=2)),
                                  [[1, 1, 0, 0], [0, 0, 1, 1]])
    # top_p=0.8: 0.5 + 0.3 reaches it, so the third is dropped; 0.81 needs the third.
    np.testing.assert_array_equal(kept(Sampling(1.0, top_p=0.8)), [[1, 1, 0, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(kept(Sampling(1.0, top_p=0.81)), [[1, 1, 1, 0], [0, 1, 1, 1]])
    np.testing.assert_array_equal(kept(Sampling(1.0, top_p=0.01)), [[1, 0, 0, 0], [0, 0, 0, 1]])
    # The temperature divides the logits.
    np.testing.assert_allclose(np.asarray(filtered(logits, Sampling(2.0))), logits / 2)


def test_frozen_int8_weights_stay_quantized_and_match_their_dequantized_reference():
    """Frozen kernels stored as INT8: the secondary keeps int8 values, and the tokens are
    those of one device at the dequantized weights (state.consolidate())."""
    params = init_params(seed=21)
    state = zpp.TrainState.create(
        model=GPT(SMALL), params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig(compute_dtype="float32", quantize_frozen=True, hpz=True,
                                block_size=64),
        frozen=lambda path: path[-1] == "kernel")
    secondary = gather_secondary(state)
    assert any(v[0].dtype == np.int8 for k, v in secondary.items() if k.startswith("frozen/"))
    prompts = tokens(8, 4, seed=22)[:, :4]
    new = SMALL.seq_len - 4  # the greedy test's shapes: its reference program
    out = np.asarray(zpp.generate(state, prompts, new, model=GPT(DECODE), secondary=secondary))
    np.testing.assert_array_equal(
        out, reference_generate(GPT(DECODE), state.consolidate(), prompts, new))


def test_flax_lm1b_decode_convention():
    """Flax's lm1b model: its decode twin (Flax's own attention cache and cache_index) on the
    trained model's params; greedy tokens equal one device's and the training-mode model's
    argmax (which shifts right: its position j predicts token j + 1 of the BOS-led row)."""
    cfg = TransformerConfig(max_len=16)
    model, twin = TransformerLM(cfg), TransformerLM(dataclasses.replace(cfg, decode=True))
    # Flax's init and apply, jitted: one program each instead of one per op.
    params = jax.jit(model.init)(jax.random.PRNGKey(3), np.zeros((1, 16), np.int32))["params"]
    state = zpp.TrainState.create(
        model=model, params=params, tx=optax.sgd(0.1), mesh=zpp.make_mesh(2, 4),
        config=zpp.ZeroPPConfig(compute_dtype="float32"),
        units=[("decoder", f"encoderdecoderblock_{i}") for i in range(2)])
    prompts = np.concatenate([np.zeros((8, 1), np.int32), tokens(8, 3, seed=4)[:, :3]], 1)
    out = np.asarray(zpp.generate(state, prompts, 8, model=twin))
    np.testing.assert_array_equal(out, reference_generate(twin, params, prompts, 8))
    # Flax's decode-mode attention takes one token per call: no prefill, one at a time; the
    # demo GPT's cache takes a whole prompt prefix in one step.
    assert not takes_several_tokens(FlaxCache(twin), 1, 12)
    assert takes_several_tokens(FlaxCache(GPT(DECODE)), 1, 12)
    logits = np.asarray(jax.jit(model.apply)({"params": params}, out[:, 1:]))
    np.testing.assert_array_equal(np.argmax(logits[:, 3:], -1), out[:, 4:])
    assert len(np.unique(out[:, 4:])) > 2


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_transformers_causal_lms_match_their_own_generate(arch):
    transformers = pytest.importorskip("transformers")
    with hf_compat():
        _check_transformers(transformers, arch)


def _check_transformers(transformers, arch):
    seed = int(np.random.SeedSequence().entropy % 1000)
    if arch == "gpt2":
        model = transformers.FlaxGPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=4), _do_init=False)
    else:
        model = transformers.FlaxLlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16),
            _do_init=False)
    # The model's own random init (what seed=seed would run), as one jitted program instead
    # of op by op (which compiles each op of the init).
    params = jax.jit(model.init_weights, static_argnums=1)(jax.random.PRNGKey(seed),
                                                           model.input_shape)
    model._is_initialized = True  # what _do_init=True sets, without its eager init
    model.params = params
    state = _state(model, None, hpz=True)
    prompts = np.random.default_rng(seed).integers(1, 64, (8, 4)).astype(np.int32)
    # transformers stops a row at the config's eos token and pads it with pad_token_id.
    out = np.asarray(zpp.generate(state, prompts, 8, stop_tokens=[model.config.eos_token_id],
                                  pad_token=0))
    # transformers' own greedy search, under one jax.jit (run op by op it compiles each op).
    own = np.asarray(jax.jit(lambda p, x: model.generate(
        x, params=p, max_length=12, do_sample=False, pad_token_id=0).sequences)(
            model.params, prompts))
    np.testing.assert_array_equal(out, own)
    assert len(np.unique(out[:, 4:])) > 2, f"seed {seed}: degenerate continuation"


def test_bad_input_is_refused_with_the_fix():
    params = init_params(seed=31)
    state = _state(GPT(SMALL), params)
    prompts = tokens(8, 3, seed=32)[:, :3]
    with pytest.raises(ValueError, match="decode-mode twin"):
        zpp.generate(state, prompts, 4)  # GPT(SMALL) is not in decode mode
    with pytest.raises(ValueError, match="multiple of the 8 devices"):
        zpp.generate(state, prompts[:6], 4, model=GPT(DECODE))
    with pytest.raises(ValueError, match="pass key="):
        zpp.generate(state, prompts, 4, model=GPT(DECODE), temperature=0.7)
    with pytest.raises(ValueError, match="prompt_lengths"):
        zpp.generate(state, prompts, 4, model=GPT(DECODE), prompt_lengths=[0] * 8)
    with pytest.raises(ValueError, match="top_p"):
        zpp.generate(state, prompts, 4, model=GPT(DECODE), temperature=1.0, top_p=1.5,
                     key=jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="max_new_tokens"):
        zpp.generate(state, prompts, 0, model=GPT(DECODE))


def test_bloom_without_position_ids_matches_its_own_generate():
    """Bloom (ALiBi) takes no position ids: its module's third parameter is
    ``deterministic``, so the convention passes its inputs by name, and only those the
    module takes. Kept cheap: one layer of width 16, params drawn in numpy (no init
    program), 4 new tokens, Bloom's own ``generate`` under one ``jax.jit``."""
    transformers = pytest.importorskip("transformers")
    with hf_compat():
        model = transformers.FlaxBloomForCausalLM(transformers.BloomConfig(
            vocab_size=64, hidden_size=16, n_layer=1, n_head=2), _do_init=False)
        # Wide random matrices (std 0.5, not the config's 0.02; layer norms as initialized)
        # so the tokens depend on attention, not only on the last token's own embedding.
        rng = np.random.default_rng(2)

        def draw(path: tuple, s: jax.ShapeDtypeStruct) -> np.ndarray:
            name = path[-1].key
            if name in ("scale", "bias"):
                return (np.ones if name == "scale" else np.zeros)(s.shape, s.dtype)
            return rng.normal(0, 0.5, s.shape).astype(s.dtype)

        params = jax.tree_util.tree_map_with_path(draw, model.params_shape_tree)
        model._is_initialized = True  # what _do_init=True would set, without its eager init
        model.params = params
        state = _state(model, None)
        prompts = rng.integers(3, 64, (8, 3)).astype(np.int32)
        out = np.asarray(zpp.generate(state, prompts, 4, stop_tokens=[model.config.eos_token_id],
                                      pad_token=0))
        own = jax.jit(lambda p, x: model.generate(x, params=p, max_length=7, do_sample=False,
                                                  pad_token_id=0).sequences)(params, prompts)
    np.testing.assert_array_equal(out, np.asarray(own))
    assert len(np.unique(out[:, 3:])) > 2 and (out[:, 4:] != out[:, 3:-1]).any(), out


def test_bad_token_ids_and_sampling_settings_are_refused_before_tracing():
    """Fractional prompts were truncated to ints and temperature=nan sampled token 0 for
    every row. Every refusal names the argument and comes before anything is traced or
    compiled (zero params, never run: no program is built)."""
    shapes = jax.eval_shape(GPT(SMALL).init, jax.random.PRNGKey(0),
                            np.zeros((1, SMALL.seq_len), np.int32))["params"]
    params = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    state = _state(GPT(SMALL), params)
    prompts = tokens(8, 3, seed=33)[:, :3]
    twin = GPT(DECODE)

    def refused(match: str, error: type = ValueError, prompts: object = prompts,
                new: object = 4, **kw: object) -> None:
        with pytest.raises(error, match=match):
            zpp.generate(state, prompts, new, model=twin, **kw)

    refused(r"prompts must be integer token ids .*got dtype float32.*np\.asarray\(prompts, "
            r"np\.int32\)", prompts=prompts.astype(np.float32) + np.float32(0.5))
    refused("prompts must be integer token ids", prompts=prompts.astype(np.float64))
    refused("prompts must be integer token ids", prompts=prompts > 3)  # bool
    refused("prompts must be token ids >= 0", prompts=-prompts)
    refused("prompt_lengths must be integer lengths", prompt_lengths=np.full(8, 2.5))
    refused("max_new_tokens must be an int", TypeError, new=4.5)
    key = jax.random.PRNGKey(0)
    for value in (float("nan"), float("inf")):
        refused("temperature=.* must be a finite number", temperature=value, key=key)
        refused("top_p=.* must be a finite number", temperature=1.0, top_p=value, key=key)
    refused("top_k must be an int", TypeError, temperature=1.0, top_k=2.5, key=key)
    refused("top_k must be an int", TypeError, temperature=1.0, top_k=True, key=key)
    refused("temperature must be a float", TypeError, temperature="0.7", key=key)
    # The single-device references share the checks.
    with pytest.raises(ValueError, match="prompts must be integer token ids"):
        reference_generate(twin, params, prompts + 0.5, 4)
    with pytest.raises(ValueError, match="prompts must be integer token ids"):
        greedy_reference(GPT(SMALL), params, prompts + 0.5, SMALL.seq_len)
    with pytest.raises(ValueError, match="temperature"):
        reference_generate(twin, params, prompts, 4, temperature=float("nan"), key=key)
    assert not [k for k in state.engine.memo if isinstance(k, tuple) and k[0] == "generate"]
    # Still accepted: numpy and jax integer scalars, ints of any width.
    assert Sampling(np.float32(0.5), top_k=np.int64(3), top_p=jax.numpy.float32(0.5)) == \
        Sampling(0.5, 3, 0.5)
