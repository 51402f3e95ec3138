"""``zpp.gpu_overlap_flags`` / ``zpp.use_gpu_overlap_flags``: the names are XLA options this
jaxlib knows, the call sets ``XLA_FLAGS`` before the backends start and refuses after."""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

import zeropp_jax as zpp

from helpers import subprocess_env


def test_every_flag_is_an_option_this_jaxlib_compiles_with():
    # XLA's DebugOptions are one proto for every backend: a misspelt or removed GPU flag
    # fails a CPU compile too ("No such compile option"); the check below shows it would.
    flags = zpp.gpu_overlap_flags()
    assert len(flags) == 6
    assert all(v is True or type(v) is int or v == "COLLECTIVE_PIPELINING_MODE_ON"
               for v in flags.values())
    lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(3))
    lowered.compile(flags)
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile({"xla_gpu_enable_pipelined_all_gathers": True})
    flags["changed"] = True
    assert "changed" not in zpp.gpu_overlap_flags()  # a new dict each call


def test_the_pipeliners_switches_are_spelt_as_this_jaxlib_takes_them():
    # jaxlib 0.11 replaced the boolean fields by one mode per collective; which one a
    # jaxlib takes is probed. Both spellings, with a stand-in for the probe:
    from zeropp_jax.core.compat import gpu_overlap_compile_options, knows_compile_option

    modes = gpu_overlap_compile_options(knows=lambda name, value: True)
    booleans = gpu_overlap_compile_options(knows=lambda name, value: False)
    for c in ("all_gather", "reduce_scatter", "all_reduce"):
        assert modes[f"xla_gpu_pipeline_{c}"] == "COLLECTIVE_PIPELINING_MODE_ON"
        assert f"xla_gpu_enable_pipelined_{c}" not in modes
        assert booleans[f"xla_gpu_enable_pipelined_{c}"] is True
        assert f"xla_gpu_pipeline_{c}" not in booleans
    assert {k: v for k, v in modes.items() if "pipeline" not in k} == {
        k: v for k, v in booleans.items() if "pipelined" not in k}
    # ... and the real probe, on this jaxlib: it takes the spelling the probe chose and
    # refuses the other.
    chosen = zpp.gpu_overlap_flags()
    other = booleans if chosen == modes else modes
    assert chosen in (modes, booleans)
    assert all(knows_compile_option(k, v) for k, v in chosen.items())
    assert not all(knows_compile_option(k, v) for k, v in other.items())
    with pytest.raises(Exception, match="not a valid"):  # a known name's bad value raises
        knows_compile_option("xla_gpu_enable_while_loop_double_buffering", "ON")


def test_refused_once_the_backends_started():
    jax.devices()  # the test process has started them
    with pytest.raises(RuntimeError, match="comes too late.*compiler_options"):
        zpp.use_gpu_overlap_flags()


def _xla_flags_after(users: str, code: str) -> list[str]:
    """``XLA_FLAGS``, split, in a fresh process that set it to ``users`` and then ran
    ``code`` (after ``import zeropp_jax as zpp``)."""
    script = ("import os, json\n"
              f"os.environ['XLA_FLAGS'] = {users!r}\n"
              "import zeropp_jax as zpp\n"
              + code +
              "print(json.dumps(os.environ['XLA_FLAGS'].split()))\n")
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_sets_xla_flags_first_thing_and_keeps_the_users():
    flags = _xla_flags_after("--xla_gpu_enable_pipelined_all_reduce=false",
                             "flags = zpp.use_gpu_overlap_flags()\n"
                             "assert zpp.use_gpu_overlap_flags() == flags  # idempotent\n"
                             "import jax; jax.devices()\n")
    assert flags == ["--xla_gpu_enable_pipelined_all_reduce=false",
                     "--xla_gpu_enable_pipelined_all_gather=true",
                     "--xla_gpu_enable_pipelined_reduce_scatter=true",
                     "--xla_gpu_enable_while_loop_double_buffering=true",
                     "--xla_gpu_experimental_collective_start_as_early_as_possible=true",
                     "--xla_gpu_experimental_parallel_collective_overlap_limit=3"]


def test_a_setting_in_the_other_spelling_is_the_users():
    # jax 0.11's spelling of the all-gather switch in XLA_FLAGS: not set a second time.
    flags = _xla_flags_after("--xla_gpu_pipeline_all_gather=off",
                             "zpp.use_gpu_overlap_flags()\n")
    assert flags[0] == "--xla_gpu_pipeline_all_gather=off"
    assert not any("pipelined_all_gather" in f for f in flags)
    assert "--xla_gpu_enable_pipelined_reduce_scatter=true" in flags


def test_the_gpu_cluster_benchmark_compiles_with_these_flags():
    from benchmarks.gpu_cluster.run import flag_set

    assert flag_set("pipelined") == zpp.gpu_overlap_flags()


def test_xla_cpu_fusion_emitter_switch_where_jaxlib_has_it():
    # jaxlib 0.10 has the switch (the suite turns the emitters off for speed and on for its
    # bit-for-bit tests); 0.11 dropped it, and naming it there aborts the process.
    from zeropp_jax.core import compat

    lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(3))
    for on in (False, True):
        options = compat.cpu_fusion_emitter_options(on)
        lowered.compile(options)  # a name this jaxlib does not know raises
        assert options in ({"xla_cpu_use_fusion_emitters": on}, {})
    assert bool(compat.cpu_fusion_emitter_options(True)) == (compat.JAXLIB_VERSION < (0, 11))
    assert compat.xla_flags_text({"a": True, "b": False, "c": 2}) == "--a=true --b=false --c=2"
