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
    assert flags and all(v is True or type(v) is int for v in flags.values())
    lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(3))
    lowered.compile(flags)
    with pytest.raises(Exception, match="No such compile option"):
        lowered.compile({"xla_gpu_enable_pipelined_all_gathers": True})
    flags["changed"] = True
    assert "changed" not in zpp.gpu_overlap_flags()  # a new dict each call


def test_refused_once_the_backends_started():
    jax.devices()  # the test process has started them
    with pytest.raises(RuntimeError, match="comes too late.*compiler_options"):
        zpp.use_gpu_overlap_flags()


def test_sets_xla_flags_first_thing_and_keeps_the_users():
    code = (
        "import os, json\n"
        "os.environ['XLA_FLAGS'] = '--xla_gpu_enable_pipelined_all_reduce=false'\n"
        "import zeropp_jax as zpp\n"
        "flags = zpp.use_gpu_overlap_flags()\n"
        "assert zpp.use_gpu_overlap_flags() == flags  # idempotent\n"
        "import jax; jax.devices()\n"
        "print(json.dumps(os.environ['XLA_FLAGS'].split()))\n")
    env = subprocess_env()
    env.pop("XLA_FLAGS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    flags = json.loads(out.strip().splitlines()[-1])
    assert flags == ["--xla_gpu_enable_pipelined_all_reduce=false",
                     "--xla_gpu_enable_pipelined_all_gather=true",
                     "--xla_gpu_enable_pipelined_reduce_scatter=true",
                     "--xla_gpu_enable_while_loop_double_buffering=true",
                     "--xla_gpu_experimental_collective_start_as_early_as_possible=true",
                     "--xla_gpu_experimental_parallel_collective_overlap_limit=2"]


def test_the_gpu_cluster_benchmark_compiles_with_these_flags():
    from benchmarks.gpu_cluster.run import FLAGS

    assert FLAGS["pipelined"] == zpp.gpu_overlap_flags()
