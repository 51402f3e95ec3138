"""Test configuration: 8 simulated CPU devices, strict numerics (equinox-style), and a
compile cache shared by the run's pytest workers.

The device count and the XLA flags must be set before JAX initializes its backend, so that
happens at import.
"""

import gc
import inspect
import os
import shutil
import tempfile

import pytest

# Compiling is most of the suite's time, and most of an XLA CPU compile is code generation
# the tests do not need: they check numerics against references compiled under the same
# flags (tolerances are derived from the rounding measured under them), the HLO XLA emits
# and its buffer assignment, none of which the code generator decides.
# - --xla_backend_optimization_level=0: LLVM does not optimise the kernels (a compile-bound
#   test file ~25% faster on a 2-core AMD EPYC).
# - --xla_cpu_use_fusion_emitters=false: fusions go through XLA's elemental IR emitter
#   instead of the MLIR fusion emitters, which build and tear down an MLIR pipeline per
#   kernel (a 2x4 zeropp step of the small test GPT: 3.1 s -> 1.5 s to compile on the Xeon).
#   (Only where jaxlib has that switch: 0.11 has the fusion emitters alone, and an unknown
#   flag in XLA_FLAGS aborts the process.)
# - --xla_cpu_parallel_codegen_split_count=1: one LLVM module per program instead of several
#   compiled on XLA's thread pool; the two pytest workers already keep both cores busy, so
#   the split only adds work (that step: 0.89 s -> 0.79 s to compile on the Xeon).
# Subprocesses the tests start get the same flags (helpers.subprocess_env reads them from
# ZEROPP_TEST_XLA_FLAGS).
from zeropp_jax.core import compat  # noqa: E402  (imports jax; starts no backend)

COMPILE_FLAGS = compat.xla_flags_text({
    "xla_backend_optimization_level": 0, **compat.cpu_fusion_emitter_options(False),
    "xla_cpu_parallel_codegen_split_count": 1})
os.environ["ZEROPP_TEST_XLA_FLAGS"] = COMPILE_FLAGS
os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"), COMPILE_FLAGS]))

import jax  # noqa: E402  (after XLA_FLAGS: the backend reads them when it starts)

import zeropp_jax  # noqa: E402

zeropp_jax.simulate_cpu_devices(8)

# Silent broadcasting bugs fail loudly.
jax.config.update("jax_numpy_rank_promotion", "raise")

# Python's cyclic garbage collector at its defaults (700, 10, 10) runs a full collection
# every ~70k allocations, and tracing a step allocates millions of short-lived objects:
# each full pass walks every object the process holds (compiled programs, cached jaxprs,
# modules), which grows through the run. These thresholds run a full pass every ~20M
# allocations (~300x less often); the young generations still free the tracers' cycles.
# Measured on tests/units, test_offload.py and test_qgz.py (2 workers, 2-core Xeon): 12 s
# of collector time and 130 s wall became 1.2 s and 115 s, at the same peak memory; the
# whole suite from fresh clones, two back-to-back pairs: 6:16 -> 5:55 and 7:54 -> 7:24 of
# pytest (same peak worker memory, 3.42 GB). Nothing a test checks depends on when the
# collector runs (the library holds no finalizers or weak references).
gc.set_threshold(50_000, 20, 20)

# One compile per program per run: many tests build the same programs (the single-device
# references, a step of the same model on the same mesh, eager ops of the same shapes), in
# either pytest worker. JAX's persistent compilation cache, in a directory made for this run
# and shared by its workers (xdist starts them after pytest_configure, so they inherit the
# variable), serves the second and later compiles of a program from disk. A run starts with
# an empty cache, so the suite's time is a fresh clone's; set ZEROPP_TEST_COMPILE_CACHE to a
# directory of your own to keep the cache between runs (it is keyed by the program, the
# flags and the jax version, so a stale entry is never served).
_CACHE_ENV = "ZEROPP_TEST_COMPILE_CACHE"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and not os.environ.get(_CACHE_ENV):
        # The controller (or a run without workers) makes the run's directory.
        config._zeropp_cache = tempfile.mkdtemp(prefix="zeropp-test-compile-cache-")
        os.environ[_CACHE_ENV] = config._zeropp_cache
    jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
    # Every program: the eager ops the tests repeat take tens of ms each to compile.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_unconfigure(config):
    made = getattr(config, "_zeropp_cache", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)
        os.environ.pop(_CACHE_ENV, None)


# Programs that do the same arithmetic and only move data differently (hpZ against ZeRO-3,
# a bucketed gather against separate ones) are compared bit for bit. XLA's elemental
# emitter (COMPILE_FLAGS) emits a fusion's loops by the fusion's shape, so two such
# programs that XLA fuses differently can round a reduction differently (measured: 1e-8
# absolute on a bias gradient of the 2x4 hpZ step); its MLIR fusion emitters, XLA's
# default, give both the same bits. Tests marked ``bitwise_programs`` compile with them.
@pytest.fixture(autouse=True)
def _default_fusion_emitters(request):
    if request.node.get_closest_marker("bitwise_programs") is None:
        yield
        return
    with compat.xla_options(compat.cpu_fusion_emitter_options(True)) as built:
        yield
    # Programs served from JAX's in-memory caches keep the emitter they were compiled with:
    # a test whose programs were all compiled elsewhere would compare the elemental
    # emitter's and pass or fail by chance.
    assert built, ("bitwise_programs: no program of this test was compiled here, so none "
                   "got XLA's default fusion emitters (see tests/conftest.py)")


def pytest_collection_modifyitems(session, config, items):
    """The whole-program tests (tests/integration: subprocesses, several seconds each) run
    first. xdist's worksteal hands each worker a contiguous share and lets an idle worker
    take the tail of the other's: with the long tests first, the run ends on short ones
    instead of one worker finishing a 10 s test while the other waits. With
    ``--seed-rounds``, only the tests that draw fresh seeds run."""
    if config.getoption("seed_rounds") > 1:
        def repeated(item) -> bool:
            callspec = getattr(item, "callspec", None)
            return callspec is not None and "_seed_round" in callspec.params

        config.hook.pytest_deselected(items=[i for i in items if not repeated(i)])
        items[:] = [i for i in items if repeated(i)]
    items.sort(key=lambda item: "/integration/" not in "/" + item.nodeid)


# ``--seed-rounds N`` (``make test-seeds``): every test of a module that draws its inputs
# with ``helpers.fresh_seed`` runs N times in this process, each round on seeds of its own;
# the rounds after the first reuse the first's compiled programs, so 30 rounds cost far
# less than 30 runs. With ``ZPP_SEED_LOG`` set, ``fresh_seed`` writes each test's seeds
# there (tests/seed_report.py pairs them with the outcomes).
def pytest_addoption(parser):
    parser.addoption("--seed-rounds", type=int, default=1,
                     help="run each test that draws fresh seeds this many times")


@pytest.fixture(scope="module", autouse=True)
def _seed_round(request):
    """The round (``--seed-rounds``), 0 without. Module-scoped: a module-scoped fixture that
    draws a fresh seed takes it as an argument, so it draws again each round."""
    return getattr(request, "param", 0)


@pytest.fixture(autouse=True)
def _drawn_seeds():
    import helpers

    helpers.DRAWN.clear()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test that drew fresh seeds names them, and how to replay one."""
    report = (yield).get_result()
    if report.failed:
        import helpers

        if helpers.DRAWN:
            report.sections.append(("seeds", f"inputs from seeds {helpers.DRAWN}: rerun "
                                    f"with ZPP_TEST_SEED={helpers.DRAWN[0]}"))


def _drawing_names(module) -> frozenset:
    """The module's functions (fixtures included) that draw a fresh seed, directly or
    through another of them."""
    sources = {}
    for name, obj in vars(module).items():
        fn = getattr(obj, "__wrapped__", getattr(obj, "__pytest_wrapped__", obj))
        fn = getattr(fn, "obj", fn)
        if inspect.isfunction(fn) and fn.__module__ == module.__name__:
            sources[name] = inspect.getsource(fn)
    drawing = {n for n, src in sources.items() if "fresh_seed(" in src}
    while True:
        more = {n for n, src in sources.items()
                if n not in drawing and any(f"{d}(" in src or f" {d}" in src for d in drawing)}
        if not more:
            return frozenset(drawing)
        drawing |= more


def pytest_generate_tests(metafunc):
    rounds = metafunc.config.getoption("seed_rounds")
    if rounds <= 1 or "fresh_seed(" not in inspect.getsource(metafunc.module):
        return
    drawing = _drawing_names(metafunc.module)
    if metafunc.function.__name__ in drawing or drawing & set(metafunc.fixturenames):
        metafunc.parametrize("_seed_round", range(rounds), ids=lambda i: f"round{i}",
                             scope="module")
