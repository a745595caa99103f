# The two commands of the README: `make demo` and `make test`. Each creates the virtual
# environment on first use and installs everything pinned (see constraints.txt).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mixprec-installed

.PHONY: demo test test-slow lint bench bench-lowbit docs install clean gpu-check dist kernels sanitize

# The JAX plugin's own environment: JAX needs NumPy 2, MXNet 1.9.1 needs NumPy 1.23.5.
JAX_VENV  := .venv-jax
JAX_BIN   := $(JAX_VENV)/bin
JAX_STAMP := $(JAX_VENV)/.mixprec-installed
JAX_PIN   := plugins/mixprec-jax/constraints.txt

$(STAMP): pyproject.toml constraints.txt plugins/mixprec-numpy/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch==2.13.0 must be named exactly: a loose range pulls the CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]' -e ./plugins/mixprec-numpy
	touch $(STAMP)

# The C kernels, built in place by the editable install (setup.py); rebuilt here after an
# edit of the C without reinstalling anything else, and checked to load (the loader refuses
# a library built from another version of the source). MIXPREC_NATIVE_BUILD=1 compiles them
# at first use into a private cache instead (mixprec_torch.cpu.devbuild).
KERNELS_C  := backends/torch/cpu/_cpu_kernels.c
KERNELS_SO := backends/torch/cpu/_mixprec_kernels.so
$(KERNELS_SO): $(KERNELS_C) setup.py | $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps --no-build-isolation -e .
	MIXPREC_NATIVE= MIXPREC_NATIVE_BUILD= $(BIN)/python -c "import sys; \
		from mixprec_torch.cpu import clib; i = clib.info(); \
		print('CPU kernels:', i.describe()); sys.exit(i.origin != 'installed')"
	touch $@

kernels: $(KERNELS_SO)

# The kernels built with AddressSanitizer and UBSan (the developer build, into
# build/sanitize) and the kernel tests run against that build: the slow test does both, so
# CI's full run covers it (tests/torch/test_native_delivery.py).
sanitize: $(KERNELS_SO)
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/torch/test_native_delivery.py \
		-k sanitizer -m slow

$(JAX_STAMP): pyproject.toml $(JAX_PIN) plugins/mixprec-jax/pyproject.toml
	test -x $(JAX_BIN)/python || $(PYTHON) -m venv $(JAX_VENV)
	$(JAX_BIN)/python -m pip install -q -c $(JAX_PIN) -e . -e './plugins/mixprec-jax[test,bench]' \
		-e ./plugins/mixprec-numpy
	touch $(JAX_STAMP)

# The wheels a fresh `pip install 'mixprec[jax]' flax` needs besides mixprec's own (pinned as
# .venv-jax is), downloaded once (pip's cache makes it quick): the JAX plugin's install test
# installs from them and dist/ alone, offline (plugins/mixprec-jax/tests/test_install.py).
WHEELHOUSE := build/wheelhouse/.complete
$(WHEELHOUSE): $(JAX_PIN) | $(JAX_STAMP)
	$(JAX_BIN)/python -m pip download -q -d build/wheelhouse -c $(JAX_PIN) \
		pluggy jax optax flax 'setuptools>=68' wheel
	touch $(WHEELHOUSE)

install: $(STAMP) $(JAX_STAMP) $(WHEELHOUSE)

# The wheels of mixprec and its plugins, as a release publishes them:
# `pip install --find-links dist 'mixprec[jax]'` installs from them (docs/jax.md).
dist:
	# setuptools builds in each project's build/ and never removes a stale module from it
	rm -rf dist build/lib build/bdist.* plugins/mixprec-numpy/build plugins/mixprec-jax/build
	$(PYTHON) -m pip wheel -q --no-deps -w dist . ./plugins/mixprec-numpy ./plugins/mixprec-jax

demo: $(STAMP) $(KERNELS_SO)
	$(BIN)/python examples/demo.py

# The suite's time is part of its contract: `make test` stays under 8 minutes on a 2-core
# machine. It runs every test but the heavy cases (marker `slow`: training to an accuracy,
# several ranks, compiled builds of the kernels, fresh virtual environments), which
# `make test-slow` runs; CI (.ci/run) runs both. Each run prints its slowest tests, and
# README.md records the time and test count of both on the machine they were last taken on.
# Two workers (pytest-xdist, `--dist loadfile`: a file's tests on one worker, the files with
# the most tests handed out first); one thread each for torch's, MXNet's and NumPy's kernels,
# so two workers on two cores do not wait on each other's threads.
TEST_WORKERS ?= 2
XDIST := -n $(TEST_WORKERS) --dist loadfile
test: $(STAMP) $(KERNELS_SO) $(JAX_STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(XDIST) -m "not slow" --durations=25
	# the JAX plugin's tests (flax, optax, its conformance run) in their own environment
	cd plugins/mixprec-jax && OMP_NUM_THREADS=1 ../../$(JAX_BIN)/python -m pytest $(XDIST) \
		-m "not slow" --durations=10

test-slow: $(STAMP) $(KERNELS_SO) $(JAX_STAMP) $(WHEELHOUSE)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest $(XDIST) -m slow --durations=25
	cd plugins/mixprec-jax && OMP_NUM_THREADS=1 ../../$(JAX_BIN)/python -m pytest $(XDIST) \
		-m slow --durations=10

lint: $(STAMP)
	$(BIN)/ruff check mixprec backends plugins tests benchmarks examples docsbuild
	$(BIN)/ruff format --check mixprec backends plugins tests benchmarks examples docsbuild
	# mypy_path is build/typecheck: link the backends there first (a fresh clone has none)
	mkdir -p build/typecheck
	ln -sfn ../../backends/torch build/typecheck/mixprec_torch
	ln -sfn ../../backends/mxnet build/typecheck/mixprec_mxnet
	$(BIN)/mypy
	$(BIN)/mypy -p mixprec_torch -p mixprec_mxnet
	# the core's floors ([tool.importlinter] in pyproject.toml): no import circle comes back
	# the JAX plugin is not installed in .venv (NumPy 2): its source is only read, never imported
	PYTHONPATH=plugins/mixprec-jax/src $(BIN)/lint-imports

bench: $(STAMP) $(KERNELS_SO)
	$(BIN)/python -m benchmarks

# The low-bit AdamWs of bitsandbytes and torchao (the bench-lowbit extra, pinned in
# constraints.txt) into .venv, for case lowbit_state. torch and numpy are named exactly in the
# same command so that nothing upgrades them: a loose torch pulls the multi-GB CUDA build,
# and MXNet needs numpy 1.23.5. Then:
# .venv/bin/python -m benchmarks --only lowbit_state --threads 1 --json bench-results/lowbit_state.json
bench-lowbit: $(STAMP)
	$(BIN)/python -m pip install -q -c constraints.txt bitsandbytes torchao \
		torch==2.13.0 numpy==1.23.5

# On a machine with a CUDA GPU, never in `make test`/CI: every CUDA test, the CUDA benchmark
# case and a short training, reported in build/gpu-check/summary.md (under 8 minutes on one
# H100). It uses .venv or a Python whose torch sees the GPU (installing this tree for it);
# without a GPU it says so and exits 2 at once. See docs/benchmarks.md.
gpu-check:
	$(PYTHON) benchmarks/gpu_check.py

# The documentation site (mkdocs-material, API reference from the docstrings) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build $(DOCSFLAGS)

clean:
	rm -rf $(VENV) $(JAX_VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
