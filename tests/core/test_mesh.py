"""make_mesh and simulate_cpu_devices."""

import jax
import pytest

import zeropp_jax as zpp


@pytest.mark.parametrize("nodes,local", [(1, 8), (2, 4), (4, 2), (8, 1)])
def test_node_major_layout(nodes, local):
    mesh = zpp.make_mesh(nodes, local)
    assert mesh.axis_names == ("node", "local")
    assert mesh.devices.shape == (nodes, local)
    devices = sorted(jax.devices(), key=lambda d: d.id)
    for n in range(nodes):
        for l in range(local):
            assert mesh.devices[n, l] == devices[n * local + l]


def test_partial_arguments_and_defaults():
    assert zpp.make_mesh(nodes=2).devices.shape == (2, 4)
    assert zpp.make_mesh(local=2).devices.shape == (4, 2)
    # One process: nodes = process_count() = 1, local = local_device_count() = 8.
    assert zpp.make_mesh().devices.shape == (1, 8)
    assert zpp.make_mesh(2, 2, devices=jax.devices()[:4]).devices.shape == (2, 2)


def test_mismatch_says_how_to_simulate_devices():
    with pytest.raises(ValueError, match=r"simulate_cpu_devices\(12\)") as e:
        zpp.make_mesh(3, 4)
    assert "xla_force_host_platform_device_count=12" in str(e.value)
    with pytest.raises(ValueError, match="does not divide"):
        zpp.make_mesh(nodes=3)
    with pytest.raises(ValueError, match="positive"):
        zpp.make_mesh(0, 8)


def test_mismatch_names_the_subset_and_off_cpu_fixes():
    # More devices than the shape: name the subset that works, and shapes using them all.
    with pytest.raises(ValueError, match=r"devices=jax\.devices\(\)\[:4\]") as e:
        zpp.make_mesh(2, 2)
    assert "make_mesh(2, 4)" in str(e.value)
    # Off CPU there is nothing to simulate: the message says what to run instead.
    from zeropp_jax.core.mesh import _count_mismatch

    class Gpu:
        platform = "gpu"

    msg = _count_mismatch(2, 4, [Gpu()] * 4, given=False)
    assert "simulate" not in msg and "jax.distributed.initialize" in msg
    assert "make_mesh(1, 4)" in msg


def test_simulate_after_backend_init_is_a_clear_error():
    jax.devices()  # backend is up
    zpp.simulate_cpu_devices(8)  # already true: nothing to do
    with pytest.raises(RuntimeError, match="already initialized"):
        zpp.simulate_cpu_devices(4)
    with pytest.raises(ValueError):
        zpp.simulate_cpu_devices(0)
