# paramshard developer tasks. A fresh machine needs only make and python3 (>= 3.10): everything
# else is installed into $(VENV) by `make venv`, once, and again when pyproject.toml changes.
#
#   make test        the whole suite, slow-marked tests included, then the server-side tests
#                    again on the strict test backend (what CI runs)
#   make test-strict only that second run
#   make test-gpu    on a GPU host: the gpu/cupy-marked tests, then the server-side tests on CuPy
#   make test-fast   everything except tests marked slow
#   make demo        GPT on 2 FSDP ranks to a validation loss; inspect, SIGKILL a server, recover,
#                    snapshot, export, sample in plain torch (examples/demo.py, ~2 min)
#   make lint        ruff check + ruff format --check
#   make bench       collective benchmarks against torch.distributed gloo
#
# Tests run in JOBS pytest-xdist worker processes (default 2), a file at a time each
# (--dist loadfile: a file's module fixtures, such as the multi-host lab, are built once and
# its tests keep their order). Many tests wait on sockets, timers and child processes, so two
# workers finish sooner even on two cores: on a 2-core AMD EPYC, idle, the whole suite took
# 20:52-22:16 with JOBS=2 (three runs) against 32-35 minutes in one process, the strict set
# 3:23-3:29 against 4:17; with one torch thread per worker (tests/conftest.py), 20:00 and 3:02.
# JOBS=0 runs the tests in pytest's own process, one at a time.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.paramshard-installed
# Pinned: an unpinned `pip install torch` pulls a multi-GB CUDA build (pyproject pins it too).
TORCH := torch==2.13.0
JOBS ?= 2
PYTEST = $(PY) -m pytest -q -n $(JOBS) --dist loadfile

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1

.DEFAULT_GOAL := help
.DELETE_ON_ERROR:
.PHONY: help venv test test-strict test-gpu test-fast demo lint bench clean distclean

help:
	@echo "targets: venv test test-strict test-gpu test-fast demo lint bench clean distclean"
	@echo "  (PYTHON=$(PYTHON) VENV=$(VENV); see the top of the Makefile)"

venv: $(STAMP)

# Reuses a working $(VENV); recreates a broken or half-made one. Debian/Ubuntu ship python3
# without ensurepip: as root the python3-venv package is installed, otherwise we say what to do.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null || { \
	  echo "make venv: paramshard needs Python >= 3.10; '$(PYTHON)' is missing or older" \
	       "(run e.g. make PYTHON=python3.11 ...)" >&2; exit 1; }
	@if ! $(PY) -m pip --version >/dev/null 2>&1; then \
	  rm -rf $(VENV); \
	  echo "$(PYTHON) -m venv $(VENV)"; \
	  if ! $(PYTHON) -m venv $(VENV); then \
	    rm -rf $(VENV); \
	    if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	      pyver=$$($(PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])'); \
	      echo "make venv: installing python3-venv (python$$pyver-venv) with apt-get"; \
	      DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	      { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python$$pyver-venv || \
	        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv; } && \
	      $(PYTHON) -m venv $(VENV) || { rm -rf $(VENV); exit 1; }; \
	    else \
	      echo "make venv: '$(PYTHON) -m venv' failed; on Debian/Ubuntu install python3-venv" >&2; \
	      exit 1; \
	    fi; \
	  fi; \
	fi
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[dev]"
	@touch $@

# The server-side tests on the strict test backend (tests/strict_backend.py): arrays that refuse
# implicit conversion to NumPy as CuPy's do, so NumPy-only server code fails here, not on a GPU.
# Files that reach servers through their API; unit tests that hand NumPy arrays to server
# internals (test_optimizers, test_server_float64) are not among them. The 3D recovery test
# (53 s) runs the servers' recovery code that the other recovery tests run: once is enough.
STRICT_TESTS := $(addprefix tests/test_,$(addsuffix .py,server_services bad_input collectives \
  collectives_behaviour bad_requests bad_slots buffers buffer_steps nonfinite snapshots \
  snapshot_regressions hardening_snapshots hardening_replication hardening_store hardening_limits \
  optimizer_state recovery recovery_finish determinism dlpack shm replica_shm))
SERVER_TESTS = $(PYTEST) $(1) --deselect tests/test_recovery.py::test_3d_job_recovers_from_a_killed_server
STRICT_RUN := PARAMSHARD_TEST_BACKEND=strict $(call SERVER_TESTS,$(STRICT_TESTS))

# Both runs happen even when the first fails, so one pass shows everything to fix; the exit
# status is the first failing pytest's own (5: no tests collected fails too).
test: venv
	@status=0; \
	echo "$(PYTEST)"; $(PYTEST) || status=$$?; \
	echo "$(STRICT_RUN)"; $(STRICT_RUN) || { code=$$?; [ $$status -ne 0 ] || status=$$code; }; \
	exit $$status

test-strict: venv
	$(STRICT_RUN)

# On a GPU host: CuPy into $(VENV), the tests marked gpu or cupy, then the strict set's files with
# every server on CuPy (PARAMSHARD_TEST_BACKEND=cuda:0). test_dlpack.py's CPU cases need CPU
# servers beside CPU tensors, so it runs only in the first part (its GPU case).
test-gpu: venv
	$(PY) -m pip install -q -e ".[gpu]"
	@status=0; \
	$(PYTEST) -m "gpu or cupy" tests/test_cuda.py tests/test_dlpack.py \
	  tests/test_server_services.py || status=$$?; \
	PARAMSHARD_TEST_BACKEND=cuda:0 $(call SERVER_TESTS,$(filter-out tests/test_dlpack.py,$(STRICT_TESTS))) \
	  || { code=$$?; [ $$status -ne 0 ] || status=$$code; }; \
	exit $$status

test-fast: venv
	$(PYTEST) -m "not slow"

demo: venv
	$(PY) examples/demo.py

# Both checks run even when the first fails, so one pass shows everything to fix.
lint: venv
	@status=0; \
	echo "$(PY) -m ruff check ."; $(PY) -m ruff check . || status=1; \
	echo "$(PY) -m ruff format --check ."; $(PY) -m ruff format --check . || status=1; \
	exit $$status

bench: venv
	$(PY) -m benchmarks.collectives

clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis build
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
