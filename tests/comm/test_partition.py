"""Flat unit layouts: round trips, padding, splitting a params tree into units."""

import numpy as np
import pytest

from zeropp_jax.comm.partition import (
    REST,
    default_unit_paths,
    make_unit_layout,
    merge_units,
    split_units,
)


def _tree(rng):
    return {
        "kernel": rng.standard_normal((5, 3)).astype(np.float32),
        "bias": rng.standard_normal((3,)).astype(np.float32),
    }


@pytest.mark.parametrize("num_shards", [1, 3, 8, 32])
def test_flatten_round_trip_with_padding(num_shards):
    rng = np.random.default_rng(num_shards)
    tree = _tree(rng)
    lay = make_unit_layout(("dense",), tree, num_shards)
    assert lay.n == 18
    assert lay.n_pad % num_shards == 0 and lay.n_pad >= max(18, num_shards)
    flat = np.asarray(lay.flatten(tree, np.float32))
    assert flat.shape == (lay.n_pad,)
    np.testing.assert_array_equal(flat[lay.n:], 0.0)
    back = lay.unflatten(flat)
    for k in tree:
        np.testing.assert_array_equal(np.asarray(back[k]), tree[k])


def test_unit_smaller_than_device_count():
    lay = make_unit_layout((), {"s": np.float32(2.5)}, 8)
    assert (lay.n, lay.n_pad, lay.shard_len) == (1, 8, 1)
    assert lay.name == REST


def test_integer_params_rejected():
    with pytest.raises(TypeError, match="floating-point"):
        make_unit_layout(("emb",), {"idx": np.arange(4)}, 2)


def test_split_and_merge():
    rng = np.random.default_rng(0)
    params = {"a": _tree(rng), "b": {"inner": _tree(rng)}, "scale": np.float32(1.0)}
    assert default_unit_paths(params) == (("a",), ("b",))
    units, rest = split_units(params, [("a",), ("b", "inner")])
    assert set(rest) == {"scale"}
    merged = merge_units(rest, units)
    assert set(merged) == {"a", "b", "scale"}
    np.testing.assert_array_equal(merged["b"]["inner"]["bias"], params["b"]["inner"]["bias"])
    with pytest.raises(ValueError, match="not in the model's params"):
        split_units(params, [("c",)])
    with pytest.raises(ValueError, match="nested"):
        split_units(params, [("b",), ("b", "inner")])
