# kdcache: every target builds on `setup`, which makes .venv with pinned dependencies once.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Options passed through to the tools (empty = the tool's default).
DATASET    ?= digits
DATA_ROOT  ?=
TEACHER    ?= teachers/digits
CACHE_DIR  ?=
VIEWS      ?= 1
CODEC      ?= full
SEED       ?= 0
EPOCHS     ?= 30
BATCH_SIZE ?= 64
THREADS    ?=
SHARDS     ?= 1
STUDENT    ?= mlp128
T          ?= 20
ALPHA      ?= 0.5
RUN        ?=
TEACHER_MODE ?= cache
WORKERS    ?= 2
PYTEST_ARGS ?=
QUICK ?=
DEFAULT_TEACHER := teachers/digits

# The options both sides share: the producer and the trainer derive the same schedule from them.
SHARED_OPTS = --dataset $(DATASET) $(if $(DATA_ROOT),--data-root $(DATA_ROOT)) \
	$(if $(CACHE_DIR),--cache-dir $(CACHE_DIR)) --views $(VIEWS) --codec $(CODEC) --seed $(SEED) \
	--batch-size $(BATCH_SIZE)
PRODUCER_OPTS = --teacher $(TEACHER) $(SHARED_OPTS) $(if $(THREADS),--threads $(THREADS))
# The default teacher is built when a target needs it and it is missing.
TEACHER_DEP = $(if $(filter $(DEFAULT_TEACHER),$(TEACHER)),$(DEFAULT_TEACHER)-symbol.json)

export PYTHONPATH := $(CURDIR)
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help setup test test-fast torture bench bench-kd bench-store bench-producer bench-sizing caches teacher cache cache-online train train-dist clean

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

torture: setup  ## the long fault runs: 20 kills of the producer, a 60 s soak, every fault test
	KDCACHE_TORTURE=1 $(PY) -m pytest -q $(PYTEST_ARGS) tests/test_faults.py tests/test_store_mp.py

bench: setup  ## every benchmark side by side: KD scenarios, store, producer, ImageNet sizing (QUICK=1: short runs)
	$(PY) -m bench.kd $(if $(QUICK),--quick)
	$(PY) -m bench.store $(if $(QUICK),--quick)
	$(PY) -m bench.producer $(if $(QUICK),--quick)
	$(PY) -m bench.sizing $(if $(QUICK),--quick)

bench-kd: setup  ## KD scenarios: student alone, inline, online, warm cache, ring (QUICK=1 for a short run)
	$(PY) -m bench.kd $(if $(QUICK),--quick)

bench-producer: setup  ## producer overhead vs the bare teacher, and 2 shards vs 1 (QUICK=1 for a short run)
	$(PY) -m bench.producer $(if $(QUICK),--quick)

bench-sizing: setup  ## ImageNet-1k sizing: bytes per view per codec, model-zoo teachers' images/s per core
	$(PY) -m bench.sizing $(if $(QUICK),--quick)

bench-store: setup  ## store micro-benchmarks: gather, write order, codec sizes (QUICK=1 for a short run)
	$(PY) -m bench.store $(if $(QUICK),--quick)

teacher: setup $(DEFAULT_TEACHER)-symbol.json  ## train and export the default digits teacher (teachers/digits-*) if missing

$(DEFAULT_TEACHER)-symbol.json: | $(STAMP)
	$(PY) -m trainer.make_teacher --dataset digits --out $(DEFAULT_TEACHER)

cache: setup $(TEACHER_DEP)  ## fill a cache offline: every (sample, view) of DATASET with TEACHER
	$(PY) -m cache_builder $(PRODUCER_OPTS)

cache-online: setup $(TEACHER_DEP)  ## producer following the training schedule (EPOCHS, SEED, BATCH_SIZE; SHARDS=n shard processes)
	$(PY) -m cache_builder --online --epochs $(EPOCHS) $(PRODUCER_OPTS) $(if $(filter-out 1,$(SHARDS)),--shards $(SHARDS))

train: setup $(TEACHER_DEP)  ## train STUDENT with KD from the cache (starts a producer when needed)
	$(PY) -m trainer --student $(STUDENT) --teacher $(TEACHER) --teacher-mode $(TEACHER_MODE) $(SHARED_OPTS) \
	  --temperature $(T) --alpha $(ALPHA) --epochs $(EPOCHS) $(if $(RUN),--run $(RUN)) $(if $(THREADS),--threads $(THREADS))

train-dist: setup $(TEACHER_DEP)  ## distributed training: a scheduler, a server and WORKERS workers (dist_sync) on this machine
	$(PY) -m trainer.launch --workers $(WORKERS) -- --student $(STUDENT) --teacher $(TEACHER) \
	  --teacher-mode $(TEACHER_MODE) $(SHARED_OPTS) --temperature $(T) --alpha $(ALPHA) --epochs $(EPOCHS) \
	  $(if $(RUN),--run $(RUN))

caches: setup  ## list the caches in the cache directory (CACHE_DIR=...)
	$(PY) -m store ls $(if $(CACHE_DIR),--cache-dir $(CACHE_DIR))

clean:  ## remove the virtual environment and Python caches (caches/ and runs/ are kept)
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
