# The two newcomer commands: `make demo` and `make test`.  Both create .venv and install what
# they need.  torch is pinned to 2.13.0 here because this build machine has that CPU wheel on
# disk (any other spec downloads multi-GB CUDA builds); pyproject.toml accepts torch>=2.4.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
PYTEST_ARGS ?=
# The compatibility part of `make test` runs the tests marked `compat` again on the oldest torch
# pyproject.toml admits and on the newest release on the package index (each in a venv of its
# own, kept under COMPAT_VENVS between runs: tests/compat_run.sh), then writes docs/compat.md.
# The newest is asked of the index at each run (2.15.0 if it cannot be asked).
TORCH_FLOOR ?= 2.7.0
TORCH_NEWEST ?= $(shell PIP_CONFIG_FILE=/dev/null $(PYTHON) -m pip index versions torch 2>/dev/null \
                  | sed -n 's/^torch (\([0-9.]*\))$$/\1/p' | head -1 | grep . || echo 2.15.0)

.PHONY: demo test test-compat test-fast test-services lint soak bench bench-quick clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH_PIN)
	$(PY) -m pip install -q -e '.[test]'
	@# torchtitan's training-state components for tests/test_adapters_torchtitan.py, without
	@# the rest of what torchtitan lists (datasets, tensorboard, wandb, ...: its trainer's and
	@# data pipeline's, which the test does not run); its components need tyro and spmd_types
	$(PY) -m pip install -q --no-deps 'torchtitan==0.3.0'
	$(PY) -m pip install -q tyro 'spmd_types==0.2.3'
	touch $@

demo: $(VENV)/.installed
	$(PY) examples/demo.py

test: $(VENV)/.installed test-services
	$(VENV)/bin/ruff check ckptrun adapters tests benchmarks examples
	@# an editable install leaves byte-compiling to the first import, which never writes it
	@# where PYTHONDONTWRITEBYTECODE is set: every agent, worker and reaper the tests start
	@# would compile the package from source again
	@$(PY) -m compileall -q ckptrun adapters >/dev/null
	@# two at a time (tests sharing a reference run on one worker, longest first: tests/conftest.py),
	@# then the machine-loss scenarios two at a time (the `paired` mark), then the
	@# tests that time things alone (the `serial` mark, tests/conftest.py); every part always
	@# runs; exit code 5 is "this part selected no test" (a PYTEST_ARGS subset)
	@# --durations: CI must stay under 50 minutes on 2 cores; the slowest tests show where it goes
	@# one directory for the failure-free reference runs the three parts share (tests/conftest.py)
	@# then the compatibility part (see TORCH_FLOOR above), which writes docs/compat.md
	@status=0; shared=$$(mktemp -d); export CKPTRUN_TEST_SHARED_DIR=$$shared; \
	reports=$$(mktemp -d); export CKPTRUN_COMPAT_REPORT=$$reports/torch-pinned.json; \
	$(PY) -m pytest -n 2 --dist loadgroup -m "not serial and not paired" --durations=25 $(PYTEST_ARGS) || { rc=$$?; [ $$rc = 5 ] || status=$$rc; }; \
	$(PY) -m pytest -n 2 --dist loadgroup -m paired --durations=25 $(PYTEST_ARGS) || { rc=$$?; [ $$rc = 5 ] || status=$$rc; }; \
	$(PY) -m pytest -m serial --durations=25 $(PYTEST_ARGS) || { rc=$$?; [ $$rc = 5 ] || status=$$rc; }; \
	unset CKPTRUN_TEST_SHARED_DIR CKPTRUN_COMPAT_REPORT; \
	for v in $(TORCH_FLOOR) $(TORCH_NEWEST); do \
	  echo "== compatibility part: torch $$v"; \
	  tests/compat_run.sh $$v $$reports/torch-$$v.json $(PYTEST_ARGS) || status=$$?; \
	done; \
	ls $$reports/*.json >/dev/null 2>&1 && $(PY) tests/compat_table.py docs/compat.md $$reports/*.json; \
	rm -rf "$$shared" "$$reports"; exit $$status

# the compatibility part alone (the `compat` tests of one torch release: TORCH=2.7.0)
test-compat:
	tests/compat_run.sh $(TORCH) /tmp/ckptrun-compat-$(TORCH).json $(PYTEST_ARGS)

# A real etcd for the etcd-v2 machine-loss test (Debian's etcd-server; the test starts its
# own server on loopback ports), and Debian's Slurm for tests/test_slurm.py (the test starts
# its own slurmctld and slurmds on loopback).  Best effort: without root or apt the test is skipped.  The
# package's system service is stopped again so that nothing is left listening on 2379.
test-services:
	@command -v etcd >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && { apt-get install -y -qq etcd-server >/dev/null 2>&1 \
	       || { apt-get update -qq >/dev/null 2>&1 && apt-get install -y -qq etcd-server >/dev/null 2>&1; }; } \
	  && { systemctl disable --now etcd >/dev/null 2>&1 || true; }; } \
	  || echo "note: etcd is not installed; tests/test_etcd_machine_loss.py will be skipped"
	@command -v slurmctld >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
	  && apt-get install -y -qq --no-install-recommends slurmctld slurmd slurm-client >/dev/null 2>&1 \
	  && { systemctl disable --now slurmctld slurmd munge >/dev/null 2>&1 || true; }; } \
	  || echo "note: Slurm is not installed; tests/test_slurm.py will install it or be skipped"

test-fast: $(VENV)/.installed
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check ckptrun adapters tests benchmarks examples

# 100 faults of every kind on examples/train.py at 3 ranks (CI runs one of each kind, with
# every rank restarted and in place: tests/test_check_soak.py)
SOAK_FAULTS ?= 100
soak: $(VENV)/.installed
	$(PY) -m ckptrun.cli check --standalone --nproc-per-node 3 --faults $(SOAK_FAULTS) \
	  --steps $$(( $(SOAK_FAULTS) * 2 )) examples/train.py --width 64 --steps $$(( $(SOAK_FAULTS) * 2 ))

bench: $(VENV)/.installed
	$(PY) -m benchmarks

bench-quick: $(VENV)/.installed
	$(PY) -m benchmarks --quick

clean:
	rm -rf $(VENV) build *.egg-info ckptrun-runs
