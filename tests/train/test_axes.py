"""The reading of a step's program behind ``train_step``: scan carries, and which
collectives read reduced gradients."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import zeropp_jax as zpp
from zeropp_jax.core import compat
from zeropp_jax.core.scopes import OWN, REDUCED
from zeropp_jax.train import axes

AXES = ("node", "local")


def _scans(closed):
    out = []
    for eqn in closed.jaxpr.eqns:
        if eqn.primitive.name == "scan":
            out.append(eqn)
        for _, _, inner in compat.sub_jaxprs(eqn.params):
            out += _scans(jax.extend.core.ClosedJaxpr(inner, ()))
    return out


def test_scan_counts_from_shapes_equal_the_equations_own():
    """jax >= 0.11 drops num_consts / num_carry; the shapes give the same counts (checked
    here against the counts jax 0.10 records, on forward and transposed scans)."""
    def f(k, c, d, xs):
        def body(carry, x):
            c, d = carry
            return (c * k + x[0], d + jnp.sum(x)), (c.sum(), x * 2)
        return jax.lax.scan(body, (c, d), xs, reverse=True)

    def loss(k):
        (c, d), (s, ys) = f(k, jnp.zeros(3), jnp.zeros(()), jnp.ones((5, 2, 3)))
        return c.sum() + d + s.sum() + ys.sum()

    eqns = _scans(jax.make_jaxpr(f)(jnp.ones(3), jnp.zeros(3), 0.0, jnp.ones((5, 2, 3))))
    eqns += _scans(jax.make_jaxpr(jax.grad(loss))(jnp.ones(3)))
    assert len(eqns) >= 3
    for eqn in eqns:
        if "num_consts" in eqn.params:  # jax 0.10: compare with the recorded counts
            assert compat._scan_counts_from_shapes(eqn) == (eqn.params["num_consts"],
                                                            eqn.params["num_carry"])


def _program(fn, n=8):
    mesh = jax.sharding.AbstractMesh((2, 4), AXES)
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P(AXES), out_specs=P(AXES),
                           check_vma=False)
    sharding = jax.sharding.NamedSharding(mesh, P(AXES))
    return jax.make_jaxpr(mapped)(jax.ShapeDtypeStruct((n * 4,), jnp.float32,
                                                       sharding=sharding))


def _reduced(x):
    with jax.named_scope(REDUCED):
        return jax.lax.psum_scatter(jnp.tile(x, 8), AXES, tiled=True)


def test_collectives_on_reduced_values_are_found_through_a_scan_carry():
    def through_scan(x):
        g = _reduced(x)
        # The reduced value enters a scan's carry on the second iteration only.
        (a, b), _ = jax.lax.scan(lambda c, _: ((c[1], g), None), (x, x), None, length=3)
        return jax.lax.pmean(a, AXES)

    try:
        axes.check_gradient_collectives(_program(through_scan))
    except ValueError as e:
        assert "already the mean over all devices" in str(e)
    else:
        raise AssertionError("a pmean of a reduced value through a scan carry passed")


def test_library_collectives_and_other_values_pass():
    def fine(x):
        g = _reduced(x)
        with jax.named_scope(OWN):
            norm = jnp.sqrt(jax.lax.psum(jnp.sum(g * g), AXES))  # global_norm's way
        (a, _), _ = jax.lax.scan(lambda c, _: ((c[0] * 2, g), None), (x, x), None, length=3)
        return g / norm + jax.lax.pmean(a, AXES)  # a never holds g

    axes.check_gradient_collectives(_program(fine))


def test_bound_names_become_the_mesh_axes():
    def pmap_style(x):
        return jax.lax.pmean(x, "batch") + jax.lax.axis_size("batch") * 0

    mesh = zpp.make_mesh(2, 4)
    bound = jax.shard_map(axes.bind_axis_names(pmap_style, "batch", 8), mesh=mesh,
                          in_specs=P(AXES), out_specs=P(AXES), check_vma=False)
    x = np.arange(16, dtype=np.float32)
    expected = np.repeat(x.reshape(8, 2).mean(0, keepdims=True), 8, 0).reshape(-1)
    np.testing.assert_array_equal(jax.jit(bound)(x), expected)


def test_an_unbound_pmap_axis_names_the_real_axes_and_the_fix():
    """A step written for jax.pmap (Flax's ImageNet ResNet: BatchNorm(axis_name='batch'))
    run without axis_name: the error names the mesh axes and the fix, with no template
    left in it. Traced only, nothing compiled."""
    from zeropp_jax.train.step import _traced_as_under_jit

    def pmap_style(x):
        return x - jax.lax.pmean(x, "batch")

    try:
        _program(_traced_as_under_jit(pmap_style, None, 8))
    except ValueError as e:
        message = str(e)
    else:
        raise AssertionError("a collective over an unbound axis passed")
    assert "{" not in message and "}" not in message, message
    assert f"the data-parallel axes are {AXES}" in message, message
    assert "axis_name='batch'" in message
