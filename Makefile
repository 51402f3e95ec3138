# Two commands: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-seeds gpu-check gpu-calibrate gpu-cluster venv clean docs lint-imports

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,bench]'
	touch $(STAMP)

# The main job: a byte-level GPT with ZeRO++ (qwZ + hpZ + qgZ) on 2 nodes x 4 local
# simulated CPU devices.
demo: $(STAMP)
	$(PY) examples/train_gpt.py --nodes 2 --local 4 --mode zeropp --steps 300 \
		--json demo_run.json

# Two pytest workers: most of a test's time is XLA compiling, which runs on one core.
# worksteal: an idle worker takes queued tests from the busy one, so the long tests do not
# leave one core idle at the end.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

# The layers import only downward (contracts in pyproject.toml; import-linter is in the
# test extra).
lint-imports: $(STAMP)
	$(VENV)/bin/lint-imports

test-all: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m ''

# Every test that draws its inputs from fresh seeds, ROUNDS times on seeds of its own
# (tests/conftest.py, --seed-rounds), then which test passed on how many seeds
# (tests/seed_report.py; the seeds, and any failure's, in seed-report/). The tests of
# `make test`; MARKS= adds the slow ones. Flags: make test-seeds ROUNDS=30 SEED_TESTS=tests/train
ROUNDS ?= 30
MARKS ?= not slow
SEED_TESTS ?= tests
SEED_DIR := seed-report
test-seeds: $(STAMP)
	rm -rf $(SEED_DIR) && mkdir -p $(SEED_DIR)
	-ZPP_SEED_LOG=$(CURDIR)/$(SEED_DIR)/seeds.tsv $(PY) -m pytest -q -n 2 --dist worksteal \
		-m '$(MARKS)' --seed-rounds $(ROUNDS) --junitxml=$(SEED_DIR)/junit.xml $(SEED_TESTS)
	$(PY) tests/seed_report.py $(SEED_DIR)/seeds.tsv $(SEED_DIR)/junit.xml \
		$(SEED_DIR)/seeds.json

# On a machine with an NVIDIA GPU: Pallas kernels bit-exact and their bandwidth, and a
# one-GPU train step (benchmarks/gpu_check.py; ~6 minutes on an H100). Uses .venv if it
# exists, else the python3 on PATH (a GPU machine with jax[cuda] installed and no venv).
# Flags: make gpu-check ARGS=--quick
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) benchmarks/gpu_check.py $(ARGS)

# The gpu-cluster replay's prices checked on a GPU: the 1.3B's train step (plain jax.jit,
# ZeRO-3, ZeRO++, INT4 + Hadamard weights) run for real, each kernel's profiled time against
# its roofline price (benchmarks/gpu_cluster/calibrate.py; about 1 minute on an H200).
# Flags: make gpu-calibrate ARGS="--out benchmarks/results --name gpu_calibrate_h200"
gpu-calibrate:
	$(GPU_PY) -m benchmarks.gpu_cluster.calibrate $(ARGS)

# ZeRO-3 and ZeRO++ compiled for an H100 cluster (2x8 to 16x8 GPUs) on this host, no GPU
# needed: memory against the planner's model, and the compiled schedule's overlap
# (benchmarks/gpu_cluster/run.py; about 45 minutes on 2 CPU cores). JAX's CUDA plugin goes
# into a venv of its own (.venv-cuda, ~6 GB), so the test venv stays CPU-only.
# Results go to benchmarks/out/; ARGS="--out benchmarks/results" updates the tracked ones.
# Flags: make gpu-cluster ARGS="--experiments grid --models 1.3B --meshes 2x8"
CUDA_VENV := .venv-cuda
CUDA_STAMP := $(CUDA_VENV)/.installed

$(CUDA_STAMP): pyproject.toml
	test -x $(CUDA_VENV)/bin/python || $(PYTHON) -m venv $(CUDA_VENV)
	$(CUDA_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(CUDA_VENV)/bin/python -m pip install --quiet -e '.[gpu,bench]'
	touch $(CUDA_STAMP)

gpu-cluster: $(CUDA_STAMP)
	JAX_PLATFORMS=cpu $(CUDA_VENV)/bin/python -m benchmarks.gpu_cluster.run $(ARGS)

# The documentation site (docs/, mkdocs.yml) into build/site. --strict: a broken link or
# anchor, a result table docs/hooks.py cannot render from benchmarks/results/*.json, or an API
# name the reference cannot find fails the build. The docs extra goes into the same .venv,
# with its own stamp. NO_MKDOCS_2_WARNING silences mkdocs-material's banner.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): pyproject.toml $(STAMP)
	$(PY) -m pip install --quiet -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir build/site

clean:
	rm -rf $(VENV) $(CUDA_VENV) demo_run.json demo_run.png
