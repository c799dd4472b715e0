# paramshard developer tasks. A fresh machine needs only make and python3 (>= 3.10): everything
# else is installed into $(VENV) by `make venv`, once, and again when pyproject.toml changes.
#
#   make test        the whole suite, slow-marked tests included (what CI runs)
#   make test-fast   everything except tests marked slow
#   make demo        GPT on 2 FSDP ranks (paramshard launch: 2 servers + 2 trainers), 300 steps
#   make lint        ruff check + ruff format --check
#   make bench       collective benchmarks against torch.distributed gloo

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.paramshard-installed
# Pinned: an unpinned `pip install torch` pulls a multi-GB CUDA build (pyproject pins it too).
TORCH := torch==2.13.0

export PIP_DISABLE_PIP_VERSION_CHECK := 1
export PIP_NO_INPUT := 1

.DEFAULT_GOAL := help
.DELETE_ON_ERROR:
.PHONY: help venv test test-fast demo lint bench clean distclean

help:
	@echo "targets: venv test test-fast demo lint bench clean distclean"
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

test: venv
	$(PY) -m pytest -q

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

demo: venv
	$(VENV)/bin/paramshard launch --nproc 2 examples/train_gpt.py --strategy fsdp --steps 300

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
