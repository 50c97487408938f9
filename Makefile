# kdcache: every target builds on `setup`, which makes .venv with pinned dependencies once.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

# Options passed to the tools when set. Empty means the tool's own default: every option the
# producer and the trainer share is declared once, with its default, in pipeline/options.py
# (`kdcache options` prints them), so nothing here restates a default.
# NOTE [values reach the tools as they are]: a value is never text of a command line. Each variable
# holds exactly what was typed (`$(value)`: make expands nothing in it) and is exported; a recipe
# names it as "$$VAR", which the shell neither splits nor runs, so the tool receives it as one
# argument whatever it holds (spaces, quotes, ';', '$', backquotes, new lines). `make -n` shows
# these references, not the values.
DATASET    ?=
DATA_ROOT  ?=
TEACHER    ?=
CACHE_DIR  ?=
VIEWS      ?=
AUGMENT    ?=
CODEC      ?=
SEED       ?=
EPOCHS     ?=
BATCH_SIZE ?=
THREADS    ?=
SHARDS     ?=
STUDENT    ?=
T          ?=
ALPHA      ?=
RUN        ?=
TEACHER_MODE ?=
WORKERS    ?=
PYTEST_ARGS ?=
QUICK ?=
CACHE ?=
KDCACHE := $(VENV)/bin/kdcache
# A variable set on the command line that is none of these is an error naming them: `make train
# TEMPERATURE=4` would otherwise train at the default temperature without a word.
VARIABLES := PYTHON DATASET DATA_ROOT TEACHER CACHE_DIR VIEWS AUGMENT CODEC SEED EPOCHS BATCH_SIZE THREADS \
	SHARDS STUDENT T ALPHA RUN TEACHER_MODE WORKERS PYTEST_ARGS QUICK CACHE
UNKNOWN_VARIABLES := $(filter-out $(VARIABLES),$(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v))))
ifneq ($(strip $(UNKNOWN_VARIABLES)),)
$(error $(UNKNOWN_VARIABLES): no such variable; use one of $(VARIABLES) (`make options` lists the options they set))
endif
$(foreach v,$(VARIABLES),$(eval override $(v) := $$(value $(v))))
export $(VARIABLES)
# The data sets with a default teacher, teachers/NAME (pipeline.options.DEFAULT_TEACHERS): the trainer and
# the producer fall back on it when no TEACHER is given, and `make teacher` builds it.
TEACHER_DATASETS := digits mnist5k
DEFAULT_DATASET = $(if $(DATASET),$(if $(filter 1,$(words $(DATASET))),$(DATASET),-),digits)
DEFAULT_TEACHER = teachers/$(DEFAULT_DATASET)

# bench.codecs distils from the default teachers of digits and mnist5k: built here when missing.
CODEC_TEACHERS = $(TEACHER_DATASETS:%=teachers/%-symbol.json)

# opt(VARIABLE, FLAG): FLAG=VALUE as one argument when the variable is set, nothing when it is empty
# (NOTE [values reach the tools as they are]).
opt = $${$(1):+$(2)="$$$(1)"}
# The options both sides share (pipeline.options.SHARED): the producer and the trainer derive the
# same cache and the same schedule from them.
SHARED_OPTS = $(call opt,TEACHER,--teacher) $(call opt,DATASET,--dataset) $(call opt,DATA_ROOT,--data-root) \
	$(call opt,CACHE_DIR,--cache-dir) $(call opt,VIEWS,--views) $(call opt,AUGMENT,--augment) $(call opt,CODEC,--codec) $(call opt,SEED,--seed) \
	$(call opt,EPOCHS,--epochs) $(call opt,BATCH_SIZE,--batch-size)
PRODUCER_OPTS = $(SHARED_OPTS) $(call opt,THREADS,--threads) $(call opt,SHARDS,--shards)
TRAINER_OPTS = $(SHARED_OPTS) $(call opt,STUDENT,--student) $(call opt,TEACHER_MODE,--teacher-mode) \
	$(call opt,T,--temperature) $(call opt,ALPHA,--alpha) $(call opt,RUN,--run)
# The data set's default teacher is built when a target needs it (no TEACHER given) and it is missing.
DEFAULT_TEACHER_FILE = $(if $(filter $(TEACHER_DATASETS),$(DEFAULT_DATASET)),$(DEFAULT_TEACHER)-symbol.json)
TEACHER_DEP = $(if $(TEACHER),,$(DEFAULT_TEACHER_FILE))

export PYTHONDONTWRITEBYTECODE := 1

.PHONY: help options docs setup lock test test-fast torture bench bench-kd bench-fleet bench-publish bench-demand bench-store bench-read bench-checksums bench-producer bench-sizing bench-codecs bench-ensemble bench-quality bench-worth bench-decode bench-recipe bench-recipe-sweep caches verify teacher cache cache-online train train-dist clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | column -t -s "$$(printf '\t')"

setup: $(STAMP)  ## create .venv and install kdcache into it (editable) with its pinned dependencies (quick when done)

# The project is installed into .venv (editable): the `kdcache` command and the packages work from
# any directory, with no PYTHONPATH. pyproject.toml declares the ranges kdcache works with; the versions
# installed here are the tested ones, from constraints.txt.
EXTRAS := datasets,images,test,bench,ray,share
$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || "$$PYTHON" -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -c constraints.txt -e '.[$(EXTRAS)]'
	$(PY) -c "import mxnet, numpy, h5py; assert numpy.__version__ == '1.23.5', numpy.__version__"
	touch $(STAMP)

# PYTEST_ARGS reaches pytest through PYTEST_ADDOPTS, which pytest splits as a shell would (quotes
# group words) without running anything.
PYTEST = PYTEST_ADDOPTS="$${PYTEST_ADDOPTS:-} $$PYTEST_ARGS" $(PY) -m pytest -q

lock: setup  ## write constraints.txt anew from what .venv holds (after changing a range in pyproject.toml)
	{ sed -n '/^# /p; /^pyarrow/p' constraints.txt; $(PY) -m pip freeze --exclude-editable; } > constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt

test: setup  ## run every test (slow ones included), as CI does
	$(PYTEST) tests

test-fast: setup  ## run the tests not marked slow
	$(PYTEST) -m "not slow" tests

torture: setup  ## the long fault runs (each test up to an hour, not make test's 10 min): 20 kills of the producer, a 60 s soak, 400 threaded reads, 100+ signals at start-up, hostile .parts entries, 8,000 flipped bits in rows, every bit of every codec's metadata and 10,000 through every tool, 12 trainer kills, 20 kills of a pull, 90 + 70 command lines of train and cache at the door, every fault test
	KDCACHE_TORTURE=1 $(PYTEST) --timeout 3600 tests/test_faults.py tests/test_store_mp.py \
		tests/test_compact_crash.py tests/test_store_trust.py tests/test_ring_trust.py tests/test_identity.py \
		tests/test_reader_threads.py tests/test_signals.py tests/test_cache_dir_entries.py tests/test_nonfinite.py \
		tests/test_compact_nospace.py tests/test_checksums.py tests/test_recipe.py tests/test_seal.py tests/test_trust_others.py \
		tests/test_pull_server.py tests/test_door.py

bench: setup $(CODEC_TEACHERS)  ## every benchmark side by side: KD scenarios, demand-driven producing, store, reading at scale, producer, many hosts (Ray), ImageNet sizing, codecs, the default recipe's accuracy (QUICK=1: short runs)
	$(PY) -m bench.kd $(if $(QUICK),--quick)
	$(PY) -m bench.demand $(if $(QUICK),--quick)
	$(PY) -m bench.store $(if $(QUICK),--quick)
	$(PY) -m bench.read_scale $(if $(QUICK),--quick)
	$(PY) -m bench.producer $(if $(QUICK),--quick)
	$(PY) -m bench.fleet $(if $(QUICK),--quick)
	$(PY) -m bench.sizing $(if $(QUICK),--quick)
	$(PY) -m bench.codecs $(if $(QUICK),--quick)
	$(PY) -m bench.train_default $(if $(QUICK),--quick)

bench-recipe: setup $(CODEC_TEACHERS)  ## the default recipe's `make train` test accuracy on digits, mnist5k and Fashion-MNIST (where installed), 3 seeds, against floors (QUICK=1: digits and mnist5k, seed 0)
	$(PY) -m bench.train_default $(if $(QUICK),--quick)

bench-recipe-sweep: setup $(CODEC_TEACHERS)  ## the sweep the default recipe comes from: optimiser x rate, KD as make train runs it, on every built-in data set, chosen on the validation slice (QUICK=1: seconds)
	$(PY) -m bench.recipe $(if $(QUICK),--quick)

bench-kd: setup  ## KD scenarios: student alone, inline, online, warm cache, ring (QUICK=1 for a short run)
	$(PY) -m bench.kd $(if $(QUICK),--quick)

bench-fleet: setup  ## many hosts: Ray actors filling a cache as immutable parts vs the local producer at equal cores, a task's cost against its size, the finish at ImageNet-1k size (compaction against a part index), ImageNet-21k on paper (QUICK=1 for a short run)
	$(PY) -m bench.fleet $(if $(QUICK),--quick)

bench-demand: setup  ## a user's shuffled DataLoader against a producer still filling the cache: key order, demand-driven (waits, announced order), kdcache's schedule (QUICK=1 for a short run)
	$(PY) -m bench.demand $(if $(QUICK),--quick)

bench-producer: setup  ## producer overhead vs the bare teacher, and 2 shards vs 1 (QUICK=1 for a short run)
	$(PY) -m bench.producer $(if $(QUICK),--quick)

bench-sizing: setup  ## ImageNet-1k sizing: bytes per view per codec, model-zoo teachers' images/s per core
	$(PY) -m bench.sizing $(if $(QUICK),--quick)

bench-decode: setup  ## photos from JPEG files at 224 px: decode ms per image, the producer's images/s with decode workers vs the teacher alone (QUICK=1 for a short run)
	$(PY) -m bench.decode $(if $(QUICK),--quick)

bench-codecs: setup $(CODEC_TEACHERS)  ## soft-target codecs (full, topk:K, int8): distance to the teacher and students distilled from each (QUICK=1 for a short run)
	$(PY) -m bench.codecs $(if $(QUICK),--quick)

bench-ensemble: setup  ## read-time teacher ensembles on mnist5k (DATASET=fashion-mnist: the full Fashion-MNIST, DATA_ROOT its files): three teachers alone and together, students from each, 0 teacher forwards to build the ensemble (QUICK=1 for a short run)
	$(PY) -m bench.ensemble $(if $(QUICK),--quick) $(call opt,DATASET,--dataset) $(call opt,DATA_ROOT,--data-root)

bench-quality: setup  ## distillation on the full Fashion-MNIST (apt-get install dataset-fashion-mnist): two students from scratch, inline and from the cache, 5 seeds, the gap each closes (QUICK=1 for a short run)
	$(PY) -m bench.quality $(if $(QUICK),--quick)

bench-worth: setup  ## what the cache buys at equal compute on the full Fashion-MNIST (apt-get install dataset-fashion-mnist): each student given the same budget of one core, from scratch, inline and from the cache; the patient teacher (8 mixup views); a sweep's teacher forwards (~3 h; QUICK=1 for a short run; RESUME=DIR keeps the work there, and the same command again resumes a stopped run)
	$(PY) -m bench.worth $(if $(QUICK),--quick) $(if $(RESUME),--resume $(RESUME))

bench-store: setup  ## store micro-benchmarks: gather, write order, codec sizes (QUICK=1 for a short run)
	$(PY) -m bench.store $(if $(QUICK),--quick)

bench-checksums: setup  ## what the checksums of a finished cache cost: compaction, open, warm and cold gathers, verify, with and without (QUICK=1 for a short run)
	$(PY) -m bench.checksums $(if $(QUICK),--quick)

bench-publish: setup  ## publishing and pulling a cache from a real nginx (apt-get install nginx-light): the pull's rate against curl, a resume after kill -9 at 50%, publish and pull at ImageNet-1k's size, 2.56 GB (QUICK=1 for a short run)
	$(PY) -m bench.publish $(if $(QUICK),--quick)

bench-read: setup  ## reading a finished cache at ImageNet-1k size: mapped vs RAM reader, open, gathers warm and cold, memory of 4 readers (writes as many views, up to 10, as leave 20 GB free in the temp dir; QUICK=1 for a short run)
	$(PY) -m bench.read_scale $(if $(QUICK),--quick)

teacher: setup $(DEFAULT_TEACHER_FILE)  ## train and export the default teacher of DATASET (digits, mnist5k: teachers/DATASET-*) if missing
	$(if $(DEFAULT_TEACHER_FILE),,$(error make teacher builds the default teachers (DATASET digits or mnist5k), \
		not one for DATASET=$(DATASET): run kdcache teacher --dataset NAME --out PREFIX))

$(TEACHER_DATASETS:%=teachers/%-symbol.json): teachers/%-symbol.json: | $(STAMP)
	$(KDCACHE) teacher --dataset $* --out teachers/$* $(call opt,THREADS,--threads)

cache: setup $(TEACHER_DEP)  ## fill a cache offline: every (sample, view) of DATASET with TEACHER
	$(KDCACHE) cache $(PRODUCER_OPTS)

cache-online: setup $(TEACHER_DEP)  ## producer following the training schedule (EPOCHS, SEED, BATCH_SIZE; SHARDS=n shard processes)
	$(KDCACHE) cache --online $(PRODUCER_OPTS)

train: setup $(TEACHER_DEP)  ## train STUDENT with KD from the cache (starts a producer when needed)
	$(KDCACHE) train $(TRAINER_OPTS) $(call opt,THREADS,--threads)

train-dist: setup $(TEACHER_DEP)  ## distributed training: a scheduler, a server and WORKERS workers (dist_sync) on this machine
	$(KDCACHE) launch $(call opt,WORKERS,--workers) -- $(TRAINER_OPTS)

caches: setup  ## list the caches in the cache directory (CACHE_DIR=...)
	$(KDCACHE) ls $(call opt,CACHE_DIR,--cache-dir)

verify: setup  ## check the cache CACHE=PATH (store checks); with TEACHER=PREFIX, its logits against the teacher too
	$(if $(CACHE),,$(error make verify needs CACHE=PATH: `make caches` lists them))
	$(KDCACHE) verify $(call opt,TEACHER,--teacher) -- "$$CACHE"

options: setup  ## the options the producer and the trainer share, with their defaults and Make variables
	$(KDCACHE) options

docs: setup  ## rewrite the manual's generated tables (docs/*.md) from bench/results/*.json and the option declarations
	$(PY) -m bench.docs

clean:  ## remove the virtual environment and Python caches (caches/ and runs/ are kept)
	rm -rf $(VENV) .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
