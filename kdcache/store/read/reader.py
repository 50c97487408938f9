"""CacheReader: targets by key from a cache, finished or still being written by producers.

Where its rows come from (`source`):
* "map"  -- a finished cache, memory-mapped read-only (store.read.mapped): open in milliseconds at any
  size, rows paged in as batches touch them, one copy in the page cache for every process on the
  machine; float16 stays float16 and is widened per batch. Chosen whenever the file allows it.
* "ram"  -- the cache held in RAM: a cache still being written that fits the memory budget (filled
  incrementally from the producers' segments as rows are committed), or a finished one that
  cannot be mapped. A batch is one numpy gather.
* "disk" -- otherwise rows are read per batch with sorted, de-duplicated selections (h5py needs
  increasing indices).
When the producers finish, a reader that followed them switches to the map (freeing its RAM).

NOTE [threads]
One reader may serve many threads (a DataLoader with thread_pool=True, a user's own threads). h5py
objects are not safe to open, refresh and read from several threads at once, and refresh() swaps a
reader's source under the others (segments closed, the map opened). So everything that touches
h5py or changes the reader's state runs under one lock (`_lock`); a gather from numpy tables (RAM
or the map) does not take it: those arrays are only ever replaced whole, never changed in place
under a reader, except rows not marked done yet, which no reader gathers.
"""
import logging
import os
import threading
import time

import numpy as np

from ..format import checksums, items as item_records, schema
from ..errors import (CacheNotFoundError, DamagedRowsError, FingerprintMismatchError, NoSpaceError,
                     MissingTargetsError, ProducerGoneError)
from .demand import publish, withdraw
from ..write.settle import settle
from .mapped import MapUnavailable, map_fields
from ..osutil import available_memory, warn_if_network
from ..folder.registry import base_path, final_path, parts_path, touch_used
from ..files.segment import (committed_rows, final_spec, list_segments, lock_holders, open_final, open_swmr, parts_spec,
                      read_segment_items, read_segment_rows)
from ..format.validate import check_committed, check_keys, check_scale, check_segment

log = logging.getLogger("kdcache.store")


class _Segment:
    """One producer's segment, checked when opened; its committed count is checked on every change."""
    __slots__ = ("path", "file", "seen", "closed", "capacity", "row_bytes")

    def __init__(self, path, spec):
        self.path = path
        self.file = open_swmr(path)
        try:
            self.capacity = check_segment(self.file, path, spec)
        except BaseException:
            self.file.close()
            raise
        self.row_bytes = spec.make_codec().bytes_per_row
        self.seen = 0
        self.closed = False

    def committed(self):
        rows, closed = committed_rows(self.file)
        if rows != self.seen:
            check_committed(self.file, rows, self.capacity, self.row_bytes)
        return rows, closed


class CacheReader:
    """Read soft targets (raw teacher logits, float32 [B, C]) by (sample index, view).

    `spec` or `fingerprint`, when given, must match the cache, or FingerprintMismatchError is
    raised: a cache is never used for other inputs. `get()` waits for targets a live producer
    has not written yet (counted in `stall_s`) and fails within seconds when none is alive.
    `grace_s` counts a producer that is still starting (not locked yet) as alive; `starting`,
    a callable, ends that grace as soon as it returns False (the caller saw its producer exit).
    `mmap=False` never maps a finished cache (it is then read into RAM, or per batch from disk).
    """

    def __init__(self, path, *, spec=None, fingerprint=None, memory_budget=None, timeout=300.0,
                 heartbeat_timeout=10.0, grace_s=0.0, starting=None, mmap=True):
        self.base = base_path(path)
        self.use_mmap = bool(mmap)
        self.source = None
        self.starting = starting  # optional callable: False once the producer we wait for is known gone
        self.final = final_path(self.base)
        self.parts = parts_path(self.base)
        self.timeout = timeout
        self.heartbeat_timeout = heartbeat_timeout
        self.grace_until = time.monotonic() + grace_s
        self.stall_s = 0.0
        self._segs = {}
        self._file = None
        self._tables = None
        self._demanding = False  # this process has published demand files (removed on close)
        self.waits = 0  # times get() waited for targets not written yet
        self._lock = threading.RLock()  # NOTE [threads]
        self._map = None  # the mapped file (store.read.mapped.FileMap), checked before each batch read from it
        self._guard = None  # the map's checksums, until every chunk was checked (store.format.checksums.Guard)
        try:
            settle(self.base)  # a crash may have left every key committed and the compaction undone
        except NoSpaceError as e:  # the segments hold every row: read them; compaction is retried later
            log.warning("%s", e)
        name = os.path.basename(self.base)
        if os.path.exists(self.final):
            self.spec, meta = final_spec(self.final, name)
        elif os.path.isdir(self.parts):
            if not os.path.exists(os.path.join(self.parts, schema.MANIFEST)):
                raise CacheNotFoundError(f"{self.parts} has no manifest yet: start the producer first "
                                         f"(kdcache cache --online ..., with the trainer's options)")
            self.spec, meta = parts_spec(self.parts, name)
            check_scale(self.spec, self.parts)
        else:
            raise CacheNotFoundError(
                f"no cache at {self.base} (neither {os.path.basename(self.final)} nor "
                f"{os.path.basename(self.parts)}): build it with `kdcache cache` (the same --teacher, "
                f"--dataset and shared options), or pass the right --cache-dir")
        self.meta = meta
        self.fingerprint = self.spec.fingerprint
        want = spec.fingerprint if spec is not None else fingerprint
        if want is not None and want != self.fingerprint:
            raise FingerprintMismatchError(
                f"cache {self.base} was built for fingerprint {self.fingerprint}, you asked for {want} "
                f"(another teacher, data set, view count or codec): pass the matching cache, or let the "
                f"producer build one for these inputs")
        self.codec = self.spec.make_codec()
        nk = self.spec.num_keys
        budget = memory_budget if memory_budget is not None else available_memory() // 2
        self.in_ram = nk * self.codec.bytes_per_row <= budget
        # Full float16 logits are widened to float32 once, when that still fits: a batch is then
        # a single gather instead of a gather plus a (slow) float16 conversion per batch.
        self._ram_dtype = {}
        if self.in_ram and self.codec.name == "full" and nk * self.spec.num_classes * 4 <= budget:
            self._ram_dtype[schema.LOGITS] = np.dtype(np.float32)
        self._done = np.zeros(nk, dtype=bool)
        # The data set's item records by sample (store.format.items): taken in with the rows while following the
        # segments; a finished file's are read the first time items() is asked (None: not yet).
        self._items = None
        self.complete = False
        self._hot = None
        if os.path.exists(self.final):
            self._open_final()
        else:
            self.source = "ram" if self.in_ram else "disk"
            log.info("%s is still being written: following its segments %s (mapped once finished)", self.base,
                     "in RAM" if self.in_ram else "from disk per batch (larger than the memory budget)")
            warn_if_network(os.path.dirname(self.base) or ".")  # following a live writer: not over NFS
            self._items = item_records.unknown(self.spec.num_samples)
            if self.in_ram:
                self._tables = {n: np.zeros((nk,) + tuple(s), dtype=self._ram_dtype.get(n, d))
                                for n, s, d in self.codec.fields}
            else:
                self._loc_seg = np.full(nk, -1, dtype=np.int32)
                self._loc_row = np.zeros(nk, dtype=np.int64)
                self._seg_list = []
            self.refresh()
        touch_used(self.base)

    # -- loading ------------------------------------------------------------------------------
    def _open_final(self):
        for s in self._segs.values():
            s.file.close()
        self._segs = {}
        if self._items is not None and not item_records.known(self._items).all():
            self._items = None  # the finished file's own records are read when asked for
        own, _ = final_spec(self.final, os.path.basename(self.base))
        if own.fingerprint != self.fingerprint:
            raise FingerprintMismatchError(f"{self.final} (compacted while this reader was open) holds the cache "
                                           f"{own.fingerprint}, not {self.fingerprint}: it was replaced; remove it")
        f = open_final(self.final)
        nk = self.spec.num_keys
        if self.use_mmap:
            try:
                tables, fmap = map_fields(f, self.final, self.codec.fields, nk)
                sums = checksums.load(f, self.final, self.spec)
            except MapUnavailable as e:
                log.warning("%s: not memory-mapped, %s; reading it %s instead", self.final, e,
                            "into RAM" if self.in_ram else "from disk per batch")
            else:
                f.close()
                self._map = fmap
                # each chunk is checked the first time a batch touches it (NOTE [checksums])
                self._guard = checksums.Guard(sums, tables, self.base) if sums else None
                self._tables, self.source, self.in_ram = tables, "map", False
                self._done[:] = True
                self._set_complete()
                return
        if self.in_ram and self._done.all() and self._tables is not None:
            f.close()  # every row is already in RAM, taken in from the segments
        elif self.in_ram:
            tables = {}  # filled, then put in place whole: other threads gather from it without the lock
            for name, shape, dtype in self.codec.fields:
                d = f[name]
                t = np.empty((nk,) + tuple(shape), dtype=self._ram_dtype.get(name, dtype))
                d.read_direct(t.reshape(d.shape))  # converts while reading when widened
                tables[name] = t
            self._tables = tables
            f.close()
        else:
            self._file = f
        self.source = "ram" if self.in_ram else "disk"
        self._done[:] = True
        self._set_complete()

    def refresh(self):
        """Take in every row producers have committed since the last call. Cheap when nothing changed."""
        if self.complete:
            return
        with self._lock:  # NOTE [threads]
            if not self.complete:
                self._refresh()

    def _refresh(self):
        if os.path.exists(self.final):
            self._open_final()  # the map, when it can be had: one copy for every reader
            return
        for p in list_segments(self.parts):
            if p not in self._segs:
                try:
                    self._segs[p] = _Segment(p, self.spec)
                except Exception:
                    if os.path.exists(self.final):  # compacted under us
                        return self._refresh()
                    raise
                if not self.in_ram:
                    self._seg_list.append(self._segs[p])
        for s in self._segs.values():
            if s.closed:
                continue
            rows, closed = s.committed()
            if rows > s.seen:
                if self.in_ram:
                    keys, fields = read_segment_rows(s.file, self.codec, s.seen, rows, self.spec.num_keys)
                    for name, arr in fields.items():
                        self._tables[name][keys] = arr
                else:
                    ks = s.file[schema.SEG_KEYS]
                    ks.refresh()
                    keys = ks[s.seen:rows]
                    check_keys(keys, self.spec.num_keys, s.path)
                    fresh = ~self._done[keys]
                    self._loc_seg[keys[fresh]] = self._seg_list.index(s)
                    self._loc_row[keys[fresh]] = np.arange(s.seen, rows)[fresh]
                self._done[keys] = True
                rec = read_segment_items(s.file, s.seen, rows)
                if rec is not None:
                    ok = item_records.known(rec)
                    self._items[keys[ok] // self.spec.views] = rec[ok]
                s.seen = rows
            if closed and s.seen == rows and self.in_ram:
                s.closed = True
                s.file.close()
        if self._done.all():
            self._set_complete()

    def _set_complete(self):
        self.complete = True
        if self._tables is not None:
            if self.codec.name == "full":
                self._hot = self._tables[schema.LOGITS]  # raw logits: a batch is a gather (and a widening)

    # -- keys ---------------------------------------------------------------------------------
    def flat_keys(self, indices, views=0):
        """Flat keys (index * views + view), checked against the cache's shape."""
        return schema.flat_keys(indices, views, self.spec.num_samples, self.spec.views,
                                check_upper=self._tables is None)

    def _index_error(self, idx):
        return schema.index_error(idx, self.spec.num_samples)

    @property
    def progress(self):
        """Fraction of keys committed so far."""
        return 1.0 if self.complete else float(self._done.mean())

    def missing(self, indices, views=0):
        """Flat keys (index * views + view) among these that are not in the cache yet."""
        keys = self.flat_keys(indices, views)
        if keys.size and keys.max() >= self.spec.num_keys:
            raise self._index_error(np.asarray(indices, dtype=np.int64).reshape(-1))
        if self.complete:
            return keys[:0]
        self.refresh()
        return keys[~self._done[keys]]

    def announce(self, indices, views=0):
        """Tell producers which targets this reader will read next, in order (a shuffled epoch, say):
        they serve those before the rest. A hint: False when nothing was published (the cache is
        complete, or its folder is not writable)."""
        keys = self.flat_keys(indices, views)
        if self.complete or not os.path.isdir(self.parts):
            return False
        self._demanding = True
        return publish(self.parts, "next", keys)

    def producer_alive(self):
        """True while a producer holds a lock on this cache. `grace_s` covers a producer that is
        still starting: it counts only until one has been seen."""
        if lock_holders(self.parts, self.heartbeat_timeout):
            self.grace_until = 0.0
            return True
        if self._segs or list_segments(self.parts):
            self.grace_until = 0.0  # a producer has started writing: it is no longer starting
        if self.starting is not None and not self.starting():
            self.grace_until = 0.0  # the caller knows its producer died before it locked or wrote
        return time.monotonic() < self.grace_until

    # -- reading ------------------------------------------------------------------------------
    def items(self, indices):
        """The records (schema.ITEM_DTYPE) of the data set items of samples `indices` that the cache's
        rows were made from (store.format.items); a record whose label is schema.ITEM_UNKNOWN is not known: the
        cache was written before records existed, or no row of that sample was taken in yet (get() it first)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < 0 or idx.max() >= self.spec.num_samples):
            raise self._index_error(idx)
        with self._lock:  # NOTE [threads]: the table is taken in, or read from the file, here
            if self._items is None and self.complete:
                with open_final(self.final) as f:
                    found = item_records.load_final(f, self.final, self.spec.num_samples)
                self._items = found if found is not None else item_records.unknown(self.spec.num_samples)
            return self._items[idx] if self._items is not None else item_records.unknown(idx.size)

    def get(self, indices, views=0, *, wait=True, timeout=None):
        """float32 logits [B, C] for samples `indices` in view(s) `views`.

        Missing targets are waited for (wait=True) up to `timeout` seconds, or reported at once
        with MissingTargetsError(missing=flat keys) (wait=False).
        """
        hot, fmap = self._hot, self._map
        if fmap is not None:
            fmap.check()  # a file truncated under the map is an error here, not a SIGBUS in the gather
        if hot is not None and self.spec.views == 1 and type(views) is int and views == 0:
            # The hot path (complete cache, raw logits in RAM or mapped, one view): one gather.
            idx = np.asarray(indices, dtype=np.int64)
            if idx.size and idx.min() < 0:
                raise self._index_error(idx.reshape(-1))
            try:
                out = hot[idx.reshape(-1)].astype(np.float32, copy=False)
            except IndexError:
                raise self._index_error(idx.reshape(-1)) from None
            if self._guard is not None:
                self._check_sums(idx)
            return out
        keys = self.flat_keys(indices, views)
        try:
            if self._guard is not None:  # before decoding: a damaged row is named as such, not as a bad value
                self._check_sums(keys)
            if hot is not None:
                return hot[keys].astype(np.float32, copy=False)
            return self._get(keys, wait, timeout)
        except IndexError:
            raise self._index_error(np.asarray(indices, dtype=np.int64).reshape(-1)) from None

    def _check_sums(self, keys):
        """The checksums of the mapped chunks these (valid) keys lie in, the first time each is touched."""
        guard = self._guard
        if guard is None:
            return
        guard.check(keys)
        if guard.done:
            self._guard = None  # every chunk checked: nothing more to do per batch

    def _get(self, keys, wait, timeout):
        if not self.complete and not self._done[keys].all():
            self.refresh()
            if not self._done[keys].all():
                if not wait:
                    miss = keys[~self._done[keys]]
                    raise MissingTargetsError(f"{miss.size} of {keys.size} targets are not in the cache yet",
                                              missing=miss)
                self._wait(keys, self.timeout if timeout is None else timeout)
        try:
            return self.codec.decode(self._gather(keys))
        except DamagedRowsError as e:  # named here, where the cache's path and the keys are known
            shown = keys[e.rows[:5]].tolist() if e.rows is not None else []
            raise DamagedRowsError(f"cache {self.base}: {e} (flat keys {shown}); check it with `kdcache verify "
                                   f"{self.base}`, then remove it and build it again", rows=e.rows) from None

    def _wait(self, keys, timeout):
        t0 = time.monotonic()
        delay, next_check = 0.0005, t0 + 0.2
        self._demanding = True  # producers serve what a reader waits for first
        self.waits += 1
        with self._lock:  # one demand file per process: threads take turns replacing it
            publish(self.parts, "wait", keys[~self._done[keys]])
        try:
            while True:
                time.sleep(delay)
                delay = min(0.01, delay * 1.5)
                self.refresh()
                if self._done[keys].all():
                    return
                now = time.monotonic()
                if now >= next_check:
                    next_check = now + 0.2
                    if not self.producer_alive():
                        self.refresh()  # it may have committed its last rows just before exiting
                        if self._done[keys].all():
                            return
                        n = int((~self._done[keys]).sum())
                        raise ProducerGoneError(
                            f"{n} of {keys.size} targets are missing from cache {self.base} "
                            f"({self.progress:.1%} done) and no producer is running: start one "
                            f"(kdcache cache --online, with the trainer's options) and retry")
                if now - t0 >= timeout:
                    miss = keys[~self._done[keys]]
                    raise MissingTargetsError(
                        f"waited {timeout:.0f} s for {miss.size} targets of cache {self.base}; a producer is "
                        f"alive but behind: give it more cores (--threads) or raise the timeout", missing=miss)
        finally:
            self.stall_s += time.monotonic() - t0

    def _gather(self, keys):
        tables = self._tables
        if tables is not None:  # numpy (RAM or the map; get() checked the map): no lock, NOTE [threads]
            return {name: t[keys] for name, t in tables.items()}
        with self._lock:  # h5py
            if self._tables is not None:  # another thread switched the source while this one waited
                return self._gather(keys)
            return self._read(keys)

    def _read(self, keys):
        """Rows from the finished file or the segments, per batch (the "disk" source)."""
        out = {name: np.empty((keys.size,) + tuple(s), dtype=d) for name, s, d in self.codec.fields}
        if self._file is not None:  # not `complete`: every key may be committed before the file exists
            nv = self.spec.views
            for view in np.unique(keys % nv):
                sel = np.flatnonzero(keys % nv == view)
                u, inv = np.unique(keys[sel] // nv, return_inverse=True)
                for name in out:
                    out[name][sel] = self._file[name][u, int(view)][inv]
            return out
        segs = self._loc_seg[keys]
        for sid in np.unique(segs):
            sel = np.flatnonzero(segs == sid)
            u, inv = np.unique(self._loc_row[keys[sel]], return_inverse=True)
            f = self._seg_list[sid].file
            for name in out:
                d = f[name]
                d.refresh()
                out[name][sel] = d[u][inv]
        return out

    def close(self):
        with self._lock:
            self._close()

    def _close(self):
        for s in self._segs.values():
            try:
                s.file.close()
            except Exception:
                pass
        self._segs = {}
        if self._file is not None:
            self._file.close()
            self._file = None
        self._tables = self._hot = self._map = self._guard = None  # a mapping closes with the last array over it
        if self._demanding:
            withdraw(self.parts)
            self._demanding = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
