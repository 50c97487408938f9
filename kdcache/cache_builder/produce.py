"""Producing: run the teacher over (sample, view) keys and stream the logits into the store.

Offline fills every key of the cache in key order, serving first the keys readers wait for or
announce (store.read.demand: a user's shuffled DataLoader, whose order kdcache does not know). Online follows the training schedule, so
keys are written in the order the trainer will read them, as far ahead as the store allows.
"""
import collections
import dataclasses
import logging
import os
import time

import numpy as np
from tqdm import tqdm

from kdcache.pipeline.augment import make_views
from kdcache.pipeline.teacher_files import TeacherError
from kdcache.pipeline.decode_workers import PREFETCH, Decoder, finite_rows
from kdcache.pipeline.teacher import NonFiniteOutputError
from kdcache.cache_builder.errors import ProducerError
from kdcache.pipeline.interrupts import Interrupts
from kdcache.pipeline.schedule import schedule, steps_per_epoch
from kdcache.store.folder import registry
from kdcache.store.read.demand import Demand
from kdcache.store.format.schema import name_keys

log = logging.getLogger("kdcache.producer")


class NonFiniteInputError(ProducerError):
    """A batch's input images hold NaN or Inf: the data set or the augmentation made them."""


@dataclasses.dataclass
class Stats:
    rows_written: int = 0
    teacher_forwards: int = 0
    seconds: float = 0.0
    teacher_seconds: float = 0.0
    demand_rows: int = 0

    @property
    def rows_per_s(self):
        return self.rows_written / self.seconds if self.seconds else 0.0


def teacher_rows(teacher, dataset, indices, views, *, seed, augment, images=None, finite=None):
    """Logits [B, C] of keys (indices, views): the same inputs the student will see (`images`: those
    inputs, made already by a pipeline.decode_workers.Decoder, and `finite`, its judgement of them per row).

    Every producer (offline, shards, online, ring) gets its rows here, so here a batch with a
    non-finite input image or teacher output is refused, naming its keys, before any of it is
    written. Images are checked too: NaN images can come out of some teachers as finite rows, all
    the same (a pooling or batch-norm layer), which the cache would then hold for every key.
    """
    x = images if images is not None else make_views(dataset, indices, views, seed=seed, augment=augment)[0]
    indices = np.asarray(indices)
    views = np.broadcast_to(np.asarray(views, dtype=np.int64), np.shape(indices))
    bad = ~(finite_rows(x) if images is None or finite is None else np.asarray(finite, dtype=bool))
    if bad.any():
        first = int(np.flatnonzero(bad)[0])
        raw, _ = dataset.get_batch(indices[first:first + 1])
        source = (f"the data set {dataset.name} holds them" if not np.isfinite(raw).all()
                  else f"the augmentation {augment.spec} makes them from finite images")
        raise NonFiniteInputError(
            f"{int(bad.sum())} of {bad.size} input images of a batch hold NaN or Inf "
            f"({name_keys(indices[bad], views[bad])}): {source}; fix it: no teacher gives sound targets for "
            f"them; nothing of this batch was cached (rows cached before are kept)")
    try:
        out = teacher.forward(x)
    except NonFiniteOutputError as e:
        out = None
        bad = np.zeros(len(x), dtype=bool)
        bad[e.rows] = True
    if out is not None:  # any object with forward(x) may be the teacher here, not only pipeline.teacher's
        bad = ~np.isfinite(np.reshape(out, (len(x), -1))).all(axis=1)
    if bad.any():
        raise TeacherError(
            f"the teacher returned NaN or Inf for {int(bad.sum())} of {bad.size} samples of a batch "
            f"({name_keys(indices[bad], views[bad])}; their input images are finite): its weights or its "
            f"preprocessing (--teacher-mean/--teacher-std) are broken; nothing of this batch was cached "
            f"(rows cached before are kept)")
    return out


def produce_offline(teacher, dataset, writer, *, seed, augment, batch_size, progress=True, demand=True,
                    decode_workers=0):
    """Fill every key this writer owes, in key order; with `demand`, the keys readers wait for or
    announce go first (polled between batches). `decode_workers` processes make the images of the
    next blocks while the teacher runs this one (pipeline.decode_workers; 0: in this process)."""
    spec = writer.spec
    # Batches are fixed blocks of this shard's keys, whatever is already done: a batch is
    # committed whole, so a resumed run feeds the teacher exactly the batches an uninterrupted
    # run would, and the cache comes out bitwise the same (MKL-DNN's results can differ in the
    # last bit with the batch's composition).
    owned = np.arange(writer.shard, spec.num_keys, writer.nshards, dtype=np.int64)
    todo_n = writer.remaining
    stats = Stats()
    t0 = time.perf_counter()
    bar = tqdm(total=owned.size, initial=owned.size - todo_n, unit="row", desc="teacher",
               disable=not progress, dynamic_ncols=True, smoothing=0.1)
    wanted = Demand(writer.parts, spec.num_keys, writer.shard, writer.nshards) if demand else None
    interrupts = Interrupts().install()
    decoder = Decoder(dataset, seed=seed, augment=augment, workers=decode_workers)
    ahead = collections.deque()  # (keys, ticket): the next blocks in key order, asked for ahead
    a = 0
    try:
        while a < owned.size or ahead:
            interrupts.check()  # Ctrl-C stops here, between committed batches
            keys = np.zeros(0, dtype=np.int64)
            if wanted is not None and wanted.poll():
                keys = wanted.take(writer.is_done, batch_size)
            if keys.size:  # readers wait for these: made now (the blocks asked for ahead wait)
                images, finite, items = decoder.take(decoder.submit(keys // spec.views, keys % spec.views), items=True)
            else:
                while len(ahead) <= PREFETCH and a < owned.size:  # the next blocks in key order
                    block = owned[a:a + batch_size]
                    a += batch_size
                    block = block[~writer.is_done(block)]
                    if block.size:
                        ahead.append((block, decoder.submit(block // spec.views, block % spec.views)))
                if not ahead:
                    continue
                keys, ticket = ahead.popleft()
                images, finite, items = decoder.take(ticket, items=True)
                fresh = ~writer.is_done(keys)  # readers' demand may have had some written since
                if not fresh.all():  # (a copy of the batch: only then)
                    keys, images, finite, items = keys[fresh], images[fresh], finite[fresh], items[fresh]
                if keys.size == 0:
                    continue
            idx, views = keys // spec.views, keys % spec.views
            t1 = time.perf_counter()
            logits = teacher_rows(teacher, dataset, idx, views, seed=seed, augment=augment, images=images,
                                  finite=finite)
            stats.teacher_seconds += time.perf_counter() - t1
            stats.teacher_forwards += keys.size
            stats.rows_written += writer.write(idx, logits, views=views, items=items)
            bar.update(keys.size)
    finally:
        decoder.close()
        interrupts.restore()
        bar.close()
        stats.seconds = time.perf_counter() - t0
    if wanted is not None and wanted.served:
        log.info("%d of %d rows were written first because readers were waiting for them or announced them",
                 wanted.served, stats.rows_written)
    stats.demand_rows = wanted.served if wanted is not None else 0
    return stats


class CacheSink:
    """Online target: the persistent cache, keyed (sample, view); cached keys are skipped."""

    def __init__(self, writer):
        self.writer, self.spec, self.base = writer, writer.spec, writer.base

    def need(self, indices, view, epoch):
        return ~self.writer.is_done(indices * self.spec.views + view)

    def write(self, indices, logits, view, epoch, items=None):
        return self.writer.write(indices, logits, views=view, items=items)

    @property
    def finished(self):
        return self.writer.remaining == 0


class RingSink:
    """Online target: the shared-memory ring, keyed (sample, epoch); every step is streamed."""

    def __init__(self, ring, spec):
        self.ring, self.spec, self.base = ring, spec, None

    def need(self, indices, view, epoch):
        return np.ones(len(indices), dtype=bool)

    def write(self, indices, logits, view, epoch, items=None):
        self.ring.write(indices, np.full(len(indices), epoch, dtype=np.int64), logits, views=view)
        return len(indices)

    finished = False


def produce_online(teacher, dataset, sink, *, seed, augment, batch_size, epochs, start_epoch=0,
                   progress=True, report_every_s=0.5, timeline=None, digests=None, decode_workers=0):
    """Follow the training schedule: each step's keys, skipping those already cached.

    With a persistent cache the producer runs as far ahead as it can; with the ring buffer the
    writer blocks when the ring is full (back-pressure). The trainer's position, when it
    reports one, is shown as the producer's lead in steps. `timeline`, a list, receives
    (unix time, schedule position, rows computed) after each step; `digests`, a
    pipeline.schedule.EpochDigests, the keys of each step followed. `decode_workers` processes make
    the images of the next steps while the teacher runs this one (pipeline.decode_workers; 0: in this process).
    """
    spec = sink.spec
    n = spec.num_samples
    # A cache holds every view after `views` epochs (epoch e uses view e mod V): the work ends
    # there. A ring is consumed as it goes: every epoch is streamed.
    epochs_of_work = epochs - start_epoch if sink.base is None else min(epochs - start_epoch, spec.views)
    total = epochs_of_work * steps_per_epoch(n, batch_size)
    stats = Stats()
    t0 = time.perf_counter()
    next_report = 0.0
    bar = tqdm(total=total, unit="step", desc="teacher (online)", disable=not progress, dynamic_ncols=True)
    # Into a cache, Ctrl-C stops between committed steps. Into a ring it is taken as it comes: a
    # write may wait for the trainer to free slots, and a stop must not wait for that.
    interrupts = Interrupts().install() if sink.base is not None else Interrupts()
    decoder = Decoder(dataset, seed=seed, augment=augment, workers=decode_workers)
    steps = schedule(seed, epochs, n, batch_size, spec.views, start_epoch)
    ahead = collections.deque()  # (step, keys needed, ticket): the next steps, their images asked for ahead
    try:
        while True:
            interrupts.check()
            for st in steps:
                need = sink.need(st.indices, st.view, st.epoch)
                ahead.append((st, need, decoder.submit(st.indices[need], st.view) if need.any() else None))
                if len(ahead) > PREFETCH:
                    break
            if not ahead:
                break
            st, need, ticket = ahead.popleft()
            if digests is not None:
                digests.add(st)
            if need.any():
                images, finite, items = decoder.take(ticket, items=True)
                fresh = sink.need(st.indices[need], st.view, st.epoch)  # asked for ahead: written since?
                need[need] = fresh
                if not fresh.all():
                    images, finite, items = images[fresh], finite[fresh], items[fresh]
            if need.any():
                idx = st.indices[need]
                t1 = time.perf_counter()
                logits = teacher_rows(teacher, dataset, idx, st.view, seed=seed, augment=augment, images=images,
                                      finite=finite)
                stats.teacher_seconds += time.perf_counter() - t1
                stats.teacher_forwards += idx.size
                stats.rows_written += sink.write(idx, logits, st.view, st.epoch, items=items)
            if timeline is not None:
                timeline.append((round(time.time(), 4), int(st.position), int(need.sum())))
            bar.update(1)
            now = time.perf_counter()
            if now >= next_report and sink.base is not None:
                next_report = now + report_every_s
                pos = trainer_position(sink.base)
                if pos is not None:
                    bar.set_postfix(lead=f"{st.position - pos:+d} steps", refresh=False)
            if sink.finished:
                bar.update(max(0, bar.total - bar.n))  # done: the bar says so
                break  # every key is cached: later epochs would only re-read it
    finally:
        decoder.close()
        interrupts.restore()
        bar.close()
        stats.seconds = time.perf_counter() - t0
    return stats


def trainer_position(base):
    """The furthest step a trainer on this cache has reported, or None."""
    pos = registry.read_positions(base)
    return max(p["position"] for p in pos) if pos else None


def default_threads():
    """Teacher threads when none are given: all cores but one, which is left to the trainer."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1), cores
