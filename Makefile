# The two newcomer commands: `make demo` and `make test`.  Both create .venv and install what
# they need.  torch is pinned to 2.13.0 here because this build machine has that CPU wheel on
# disk (any other spec downloads multi-GB CUDA builds); pyproject.toml accepts torch>=2.4.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: demo test test-fast lint bench bench-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed
	$(VENV)/bin/ruff check ckptrun adapters tests benchmarks examples
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(VENV)/.installed
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check ckptrun adapters tests benchmarks examples

bench: $(VENV)/.installed
	$(PY) -m benchmarks

bench-quick: $(VENV)/.installed
	$(PY) -m benchmarks --quick

clean:
	rm -rf $(VENV) build *.egg-info ckptrun-runs
