"""Wrap policies: which modules become units (no model call is traced; fast)."""

from __future__ import annotations

import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import zeropp_jax as zpp
from zeropp_jax.units.wrap import auto_units, module_classes, resolve_units

from helpers import SMALL, init_params
from zeropp_demo.gpt import GPT


def _tree(**shapes):
    return {k: (_tree(**v) if isinstance(v, dict) else np.zeros(v, np.float32))
            for k, v in shapes.items()}


def _block(d):
    return {"attn": {"kernel": (d, 3 * d)}, "mlp": {"kernel": (d, 4 * d)},
            "ln": {"scale": (d,)}}


def test_auto_finds_blocks_one_level_down_and_keeps_large_leftovers():
    # HF GPT-2's layout: blocks at transformer/h/N, embeddings beside them.
    d = 16
    params = _tree(transformer={"h": {str(i): _block(d) for i in range(3)},
                                "wte": {"embedding": (64, d)}, "wpe": {"embedding": (8, d)},
                                "ln_f": {"scale": (d,)}})
    units = auto_units(params)
    assert units[:3] == (("transformer", "h", "0"), ("transformer", "h", "1"),
                         ("transformer", "h", "2"))
    # wte (1024) is at least a quarter of a block (7*256+16): its own unit; wpe, ln_f small.
    assert ("transformer", "wte") in units
    assert ("transformer", "wpe") not in units and ("transformer", "ln_f") not in units


def test_auto_lm1b_and_wmt_naming():
    d = 8
    lm1b = _tree(decoder={**{f"encoderdecoderblock_{i}": _block(d) for i in range(4)},
                          "Embed_0": {"embedding": (16, d)}})
    assert [u[-1] for u in auto_units(lm1b)][:4] == [f"encoderdecoderblock_{i}"
                                                      for i in range(4)]
    # Two block lists (encoder and decoder), found at their own depths.
    wmt = _tree(encoder={f"encoderblock_{i}": _block(d) for i in range(2)},
                decoder={f"encoderdecoderblock_{i}": _block(d) for i in range(2)},
                shared_embedding={"embedding": (64, d)})
    units = auto_units(wmt)
    assert {u[0] for u in units} == {"encoder", "decoder", "shared_embedding"}
    assert len(units) == 5


def test_auto_ignores_lists_of_tiny_modules_and_falls_back_to_children():
    d = 16
    params = _tree(norm_0={"scale": (d,)}, norm_1={"scale": (d,)},
                   body={f"layer_{i}": _block(d) for i in range(2)})
    units = auto_units(params)
    assert ("norm_0",) not in units and ("body", "layer_0") in units
    # No block list at all: every direct child, as before.
    flat = _tree(encoder=_block(d), head={"kernel": (d, 4)})
    assert auto_units(flat) == (("encoder",), ("head",))


def test_our_gpt_blocks_are_units_by_default():
    params = init_params()
    assert resolve_units(None, params, GPT(SMALL))[:2] == (("block_0",), ("block_1",))


def test_globs_paths_size_and_callable():
    params = init_params()
    assert resolve_units("block_*", params) == (("block_0",), ("block_1",))
    assert resolve_units(["block_0/attn", ("head",)], params) == (("block_0", "attn"),
                                                                 ("head",))
    by_size = resolve_units(300, params)
    sizes = {u: sum(np.size(x) for x in jax.tree_util.tree_leaves(
        _get(params, u))) for u in by_size}
    assert by_size and all(s >= 300 for s in sizes.values())
    # Deepest: no chosen unit contains another module of at least 300 parameters.
    assert ("block_0",) not in by_size
    picked = resolve_units(lambda path, sub: path[-1] in ("wte", "head"), params)
    assert set(picked) == {("wte",), ("head",)}
    with pytest.raises(ValueError, match="matches no module path"):
        resolve_units("decoder/*", params)


def _get(tree, path):
    for k in path:
        tree = tree[k]
    return tree


class _Block(nn.Module):
    def setup(self):
        self.dense = nn.Dense(4)

    def __call__(self, x):
        return self.dense(x)


class _Net(nn.Module):
    def setup(self):
        self.enc = _Block()
        self.dec = _Block()
        self.out = nn.Dense(2)

    def __call__(self, x):
        return self.out(self.dec(self.enc(x)))


def test_classes_and_class_names_from_setup_modules():
    model = _Net()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 3)))["params"]
    classes = module_classes(model, params)
    assert classes[("enc",)] == "_Block" and classes[("enc", "dense")] == "Dense"
    assert resolve_units([_Block], params, model) == (("enc",), ("dec",))
    assert resolve_units(["_Block"], params, model) == (("enc",), ("dec",))
    # Outermost modules of the class: the Dense inside each _Block is not a unit too.
    assert set(resolve_units(["Dense"], params, model)) == {("enc", "dense"),
                                                            ("dec", "dense"), ("out",)}
    with pytest.raises(ValueError, match="class"):
        resolve_units(["Conv"], params, model)


def test_describe_and_warning_for_one_big_unit():
    model = GPT(SMALL)
    params = init_params()
    mesh = zpp.make_mesh(nodes=2, local=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        state = zpp.TrainState.create(model=model, params=params, tx=optax.sgd(0.1),
                                      mesh=mesh)
    table = state.describe()
    assert "block_0" in table and "share" in table and "<rest>" in table
    total = sum(np.size(x) for x in jax.tree_util.tree_leaves(params))
    assert f"{total:,}" in table
    # Everything but two small modules in one unit: warned, with the fix named.
    nested = {"body": {k: v for k, v in params.items() if k.startswith("block")},
              **{k: v for k, v in params.items() if not k.startswith("block")}}
    with pytest.warns(UserWarning, match=r"holds \d+% of the parameters.*units="):
        zpp.TrainState.create(model=model, params=nested, tx=optax.sgd(0.1), mesh=mesh,
                              units=["body"])
