"""Demand-driven producing: the first epoch of a user's shuffled DataLoader against a producer still filling the cache.

    python -m bench.demand [--quick] [--out bench/results/demand.json] [--tmp DIR]

A full run takes about 10 min on 2 idle cores, --quick about 1 min.

A user's own Gluon loop reads a cache while a producer fills it: `gluon.data.DataLoader(SoftTargetDataset(...),
batch_size=64, ...)` and a small_cnn step. kdcache does not know a shuffled DataLoader's order; it learns it only
from the readers (store.read.demand). Each scenario starts with a fresh cache, the trainer and the producer in separate
processes with one core each (OMP_NUM_THREADS=1), the same teacher and data:
  key_order         (a) the offline producer ignoring demand (produce_offline(demand=False)), DataLoader(shuffle=True)
  demand_wait       (b) the offline producer serving demand, DataLoader(shuffle=True): the reader publishes the keys
                    it waits for, one item at a time
  demand_announced  (c) the same producer, DataLoader(sampler=ds.sampler()): each epoch's order announced up front
  schedule          (d) kdcache's own schedule: `python -m kdcache.cache_builder --online`, the DataLoader reading the
                    schedule's order (pipeline.schedule.epoch_permutation, what epoch_batches cuts into batches)
  *_w1              (b) and (c) with num_workers=1 (not in --quick)
  demand_wait_batch (b') a prototype of a trainer change, not kdcache's API: items without targets and a
                    batchify_fn that reads a batch's targets at once, so a waiting reader names the batch's missing
                    keys together; with num_workers=0 and 1 (not in --quick)
The scenarios run in rounds, round robin (each round every scenario once), so that round r of each met the same
load; each goal is decided on the round-by-round ratios of the two scenarios it compares (bench.paired): their
median, reported with its spread and each round's ratio; a limit nearer 1 than the spread is UNMEASURABLE, neither
PASS nor MISS. Rounds: 5 of (a)-(d), which the goals compare (about 80 s a round), 3 of the other variants and of
the student alone (informative); --quick 2 of (a)-(d) on an epoch half as long, the student alone once. A stall
counts as at least 1 ms in the ratios, so that a run that never waited gives one.
References: the producer alone (produce_offline into a fresh cache, no reader: seconds of its loop) and the student
alone (the same loop on that finished cache). The trainer is started first; once loaded it waits for the cache,
which the producer creates after loading its teacher, and its clock starts there: neither side gets a head start.

Data: `synthetic` 3x32x32, 10 classes, sized so that the student's steps take about 8 s per epoch (--quick:
0.75 s). Teacher: bench.kd's VGG-style CNN, its width and depth calibrated here so that its forward of a batch of
64 takes about 1.25x the student's step on the same batch, both on one thread (the loop also loads each item
apart, so the two stages come out comparable; both are measured alone and printed).

This process never imports MXNet; bench.demand.run is the command, bench.demand.children the MXNet
processes.
"""
