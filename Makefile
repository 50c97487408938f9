# kdcache: every target builds on `setup`, which makes .venv with pinned dependencies once.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Options passed through to the tools (empty = the tool's default).
CACHE_DIR ?=
PYTEST_ARGS ?=
QUICK ?=

export PYTHONPATH := $(CURDIR)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help setup test test-fast bench-store caches clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s "$$(printf '\t')"

setup: $(STAMP)  ## create .venv and install the pinned dependencies (quick when done)

$(STAMP): requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -r requirements.txt numpy==1.23.5
	$(PY) -c "import mxnet, numpy, h5py; assert numpy.__version__ == '1.23.5', numpy.__version__"
	touch $(STAMP)

test: setup  ## run every test (slow ones included), as CI does
	$(PY) -m pytest -q $(PYTEST_ARGS) tests

test-fast: setup  ## run the tests not marked slow
	$(PY) -m pytest -q -m "not slow" $(PYTEST_ARGS) tests

bench-store: setup  ## store micro-benchmarks: gather, write order, codec sizes (QUICK=1 for a short run)
	$(PY) -m bench.store $(if $(QUICK),--quick)

caches: setup  ## list the caches in the cache directory (CACHE_DIR=...)
	$(PY) -m store ls $(if $(CACHE_DIR),--cache-dir $(CACHE_DIR))

clean:  ## remove the virtual environment and Python caches (caches/ and runs/ are kept)
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
