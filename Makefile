# The two commands of the README: `make demo` and `make test`. Each creates the virtual
# environment on first use and installs everything pinned (see constraints.txt).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.mixprec-installed

.PHONY: demo test test-fast lint bench docs install clean

$(STAMP): pyproject.toml constraints.txt plugins/mixprec-numpy/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	# torch==2.13.0 must be named exactly: a loose range pulls the CUDA build.
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]' -e ./plugins/mixprec-numpy
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest

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
	$(BIN)/lint-imports

bench: $(STAMP)
	$(BIN)/python -m benchmarks

# The documentation site (mkdocs-material, API reference from the docstrings) into site/.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build $(DOCSFLAGS)

clean:
	rm -rf $(VENV) build site *.egg-info .pytest_cache .mypy_cache .ruff_cache
