"""``TrainState.create(logical_axis_rules=, param_axes=)`` checks both before anything is
traced: a rule naming an axis the mesh lacks, a parameter's logical name mapped to a data
axis, a malformed list and a ``param_axes`` entry naming no parameter each get an error (a
warning for the last) naming the argument, the entry and the fix. No step is compiled
here: the checks run on the parameters' logical names and shapes."""

import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import PartitionSpec

import zeropp_jax as zpp
from zeropp_jax.comm.transports import plan_of
from zeropp_jax.train.tensor_parallel import check_rules, tensor_parallel

ZERO3 = zpp.ZeroPPConfig.zero3()


class _Mlp(nn.Module):
    """Two dense layers whose kernels carry logical names ``("embed", "mlp")`` and
    ``("mlp", "embed")``, and a bias without any (a transformers-style unannotated leaf)."""

    @nn.compact
    def __call__(self, x):
        named = nn.with_logical_partitioning
        h = nn.Dense(8, use_bias=False, name="up",
                     kernel_init=named(nn.initializers.lecun_normal(), ("embed", "mlp")))(x)
        h = h + self.param("bias", nn.initializers.zeros, (8,))[None]
        return nn.Dense(4, use_bias=False, name="down",
                        kernel_init=named(nn.initializers.lecun_normal(), ("mlp", "embed")))(h)


def _boxes():
    """The model's params as logical-axis boxes of ``ShapeDtypeStruct``s: names and shapes
    are all the checks read, so nothing is computed."""
    return jax.eval_shape(_Mlp().init, jax.random.key(0), jnp.zeros((1, 4)))["params"]


def _tp_mesh():
    return zpp.make_mesh(2, 2, model=2)


def test_a_rule_naming_an_axis_the_mesh_lacks_is_refused_before_anything_is_traced():
    mesh = _tp_mesh()
    # Through TrainState.create with real parameters: the check runs first, so the error
    # comes before the model is adapted or anything traced.
    params = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), _boxes())
    with pytest.raises(ValueError) as err:
        zpp.TrainState.create(model=_Mlp(), params=params, tx=optax.sgd(0.1), mesh=mesh,
                              logical_axis_rules=[("mlp", "tensor"), ("embed", None)])
    text = str(err.value)
    for needed in ("logical_axis_rules[0]", "'tensor'", "('node', 'local', 'model')",
                   "map 'mlp' to 'model' or to None"):
        assert needed in text, (needed, text)
    with pytest.raises(ValueError, match="did you mean 'model'"):
        check_rules([("mlp", ("modle",))], None, mesh)
    # "model" is accepted on a mesh without it (one list serves every mesh); any other axis
    # the mesh lacks is not.
    plain = zpp.make_mesh(2, 4)
    assert check_rules([("mlp", "model")], None, plain)[0] == (("mlp", "model"),)
    with pytest.raises(ValueError, match=re.escape("its axes: ('node', 'local')")):
        check_rules([("mlp", "tensor")], None, plain)


@pytest.mark.parametrize("rules,says", [
    (("mlp", "model"), "is one pair, not a list of pairs: write "
                       "logical_axis_rules=[('mlp', 'model')]"),
    ((("mlp", ("node", "model")),)[0], "is one pair"),
    ([("mlp", "model", "node")], "logical_axis_rules[0]=('mlp', 'model', 'node') has 3 "
                                 "elements"),
    ([("mlp",)], "has 1 elements"),
    ({"mlp": "model"}, "logical_axis_rules is a dict"),
    ("mlp", "is not a list"),
    ([("mlp", 2)], "a rule is (logical name: str"),
    ([(None, "model")], "a rule is (logical name: str"),
    (["mlp", "embed", "vocab"], "holds strings where pairs go"),
])
def test_malformed_rule_lists_are_refused_naming_the_form(rules, says):
    with pytest.raises(ValueError) as err:
        check_rules(rules, None, _tp_mesh())
    assert says in str(err.value), str(err.value)
    assert "logical_axis_rules=[(\"mlp\", \"model\")" in str(err.value) or "write" in str(
        err.value), str(err.value)


def test_forms_flax_accepts_are_kept_and_made_hashable():
    rules = [["mlp", ["model"]], ("embed", None), ("heads", ("model",)),
             ("batch", ("node", "local")), ("length", PartitionSpec.UNCONSTRAINED)]
    checked, axes = check_rules(rules, [["up/kernel", ["embed", None]]], _tp_mesh())
    assert checked == (("mlp", ("model",)), ("embed", None), ("heads", ("model",)),
                       ("batch", ("node", "local")), ("length", PartitionSpec.UNCONSTRAINED))
    assert axes == (("up/kernel", ("embed", None)),)
    hash((checked, axes))  # the engine keeps the rules in its static data
    assert check_rules(None, None, _tp_mesh()) == ((), ())
    assert check_rules((), [], _tp_mesh()) == ((), ())
    # Nested lists and tuples of axes split the same dimension as Flax reads them.
    tp = tensor_parallel(_boxes(), checked, None, _tp_mesh(), plan_of(ZERO3), None)
    assert tp.dims == {"up": {"kernel": 1}, "down": {"kernel": 0}, "bias": -1}


def test_a_parameter_name_mapped_to_a_data_axis_is_refused():
    with pytest.raises(ValueError) as err:
        tensor_parallel(_boxes(), [("mlp", "model"), ("embed", "node")], None, _tp_mesh(),
                        plan_of(ZERO3), None)
    text = str(err.value)
    for needed in ("logical_axis_rules entry ('embed', 'node')", "data axis 'node'",
                   "['down']['kernel']", "Map 'embed' to None"):
        assert needed in text, (needed, text)
    with pytest.raises(ValueError, match="data axis 'local'"):
        tensor_parallel(_boxes(), [("mlp", ("local",))], None, _tp_mesh(), plan_of(ZERO3), None)
    # A rule for a name no parameter carries (the activations' batch) may name them.
    tp = tensor_parallel(_boxes(), [("batch", ("node", "local")), ("mlp", "model")], None,
                         _tp_mesh(), plan_of(ZERO3), None)
    assert tp.dims["up"]["kernel"] == 1
    assert ("batch", None) in tp.rules  # read inside the step, where the data axes are its own


def test_param_axes_checked_and_an_entry_naming_no_parameter_warns():
    mesh, rules = _tp_mesh(), [("mlp", "model")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a matching entry says nothing
        tp = tensor_parallel(_boxes(), rules, [("^bias$", ("mlp",))], mesh, plan_of(ZERO3), None)
    assert tp.dims["bias"] == 0
    with pytest.warns(UserWarning) as record:
        tp = tensor_parallel(_boxes(), rules,
                             [("^bias$", ("mlp",)), ("bias", ("embed",)), ("ffn/w", ("mlp",))],
                             mesh, plan_of(ZERO3), None)
    texts = [str(w.message) for w in record]
    assert len(texts) == 2, texts
    # Shadowed by the first entry, and matching nothing: both split nothing.
    assert "param_axes entry ('bias', ('embed',)) names no parameter" in texts[0], texts
    assert "param_axes entry ('ffn/w', ('mlp',))" in texts[1] and "bias" in texts[1], texts
    with pytest.raises(ValueError, match=re.escape("param_axes[0]: '(up' is not a valid")):
        check_rules(None, [("(up", ("embed", "mlp"))], mesh)
    with pytest.raises(ValueError, match="param_axes=.* is one pair"):
        check_rules(None, ("bias", ("mlp",)), mesh)
    with pytest.raises(ValueError, match=re.escape("param_axes[0]=('bias', 'mlp')")):
        check_rules(None, [("bias", "mlp")], mesh)
