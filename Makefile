# The two commands of the README: `make demo` and `make test`. Each creates the virtual
# environment on first use and installs everything pinned (see constraints.txt).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mixprec-installed

.PHONY: demo test test-fast lint bench docs install clean gpu-check dist

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

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# The suite's time is part of its contract: both runs print their 25 slowest tests, and
# README.md records the whole run's time and test count on the machine it was last taken on.
test: $(STAMP) $(JAX_STAMP) $(WHEELHOUSE)
	$(BIN)/python -m pytest --durations=25
	# the JAX plugin's tests (flax, optax, its conformance run) in their own environment
	cd plugins/mixprec-jax && ../../$(JAX_BIN)/python -m pytest --durations=10

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow"

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

bench: $(STAMP)
	$(BIN)/python -m benchmarks

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
