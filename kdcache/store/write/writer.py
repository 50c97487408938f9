"""CacheWriter: one producer appending teacher logits to a cache; crash-safe, resumable, shardable.

Each producer run appends to a fresh SWMR segment and never reopens a crashed file for
writing (a stock `h5clear -s` truncated such files here). On open it reads what every earlier
segment committed and owes only the rest of its shard's keys. When the last key of the cache
is done, the segments are compacted (compact.py) into one key-ordered file `P.h5`, written
under a temporary name, fsynced and renamed: its existence is the whole-cache "complete" marker.
"""
import fcntl
import gc
import json
import os
import stat
import threading
import time

import numpy as np

from ..format import items as item_records, schema
from .compact import finalize
from ..errors import (BadInputError, FingerprintMismatchError, StoreError, UnsupportedFormatError,
                     WriterBusyError)
from ..format.fingerprint import is_fingerprint
from ..osutil import NotOurs, fs_error, open_regular, own, stderr_silenced, write_json_atomic
from .settle import settle
from ..files.paths import base_path, final_path, foreign_files, parts_path
from ..files.segment import (HOST, create_segment, final_spec, quiet_h5py_dealloc_errors, read_manifest,
                      scan_done)


def check_final_matches(path, spec):
    """Raise unless `path` is a sound finished cache with spec's fingerprint."""
    own, meta = final_spec(path, None)
    if own.fingerprint != spec.fingerprint:
        raise FingerprintMismatchError(
            f"{path} was built for fingerprint {own.fingerprint}, these inputs give {spec.fingerprint} "
            f"(another teacher, data set, view count or codec): pass another --cache-dir or "
            f"cache path, or remove that file to rebuild")
    if meta.get(schema.A_COMPLETE) != 1:
        raise UnsupportedFormatError(f"{path}: finished cache without its complete flag: it is "
                                     f"damaged; remove it and rebuild")


def prepare_parts(path, spec):
    """The parts folder of the cache at `path` made (or found) this user's, with the manifest of `spec`
    written (a folder of another cache's, or of files kdcache did not write, refused). Returns its path."""
    base, parts = base_path(path), parts_path(path)
    parent = os.path.dirname(base) or "."
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise StoreError(f"cache directory {parent} is a file, not a directory: pass --cache-dir "
                         f"to a directory (or set KDCACHE_DIR)")
    try:
        os.makedirs(parts, exist_ok=True)
    except FileExistsError:
        raise StoreError(f"{parts} exists and is not a directory: remove it, or pass another "
                         f"--cache-dir") from None
    except OSError as e:
        raise fs_error(e, parts, "make the cache directory writable or pass another --cache-dir") from None
    try:
        st = os.lstat(parts)
    except FileNotFoundError:  # removed again by a gc: the writer's lock sees it and starts over
        return parts
    if stat.S_ISLNK(st.st_mode) or not own(st):  # written into, a link would lead anywhere
        what = "a symbolic link" if stat.S_ISLNK(st.st_mode) else f"a folder of uid {st.st_uid}"
        raise StoreError(f"{parts} is {what}, not a folder of this user's kdcache: pass another "
                         f"--cache-dir, or move it away")
    manifest = read_manifest(parts)
    other = foreign_files(parts) if manifest is None else None
    if other:
        raise StoreError(f"{parts} holds files kdcache did not write ({', '.join(other[:3])}) and no "
                         f"manifest: it is not a cache in progress; move it away, or pass another --cache-dir")
    if manifest is None:
        try:
            write_json_atomic(os.path.join(parts, schema.MANIFEST), spec.meta(), indent=1, sort_keys=True)
        except OSError as e:
            raise fs_error(e, parts, "make the cache directory writable or pass another --cache-dir") from None
    elif manifest.get(schema.A_FINGERPRINT) != spec.fingerprint:
        raise FingerprintMismatchError(
            f"{parts} holds a cache in progress for fingerprint {manifest.get(schema.A_FINGERPRINT)}, "
            f"these inputs give {spec.fingerprint}: pass another cache path, or remove it to rebuild")
    return parts


class CacheWriter:
    """Append (keys, logits) batches to the cache at `path` (a base path, `.h5` or `.parts`).

    Keys are (sample index, view). `shard=(i, n)` makes this writer own the keys whose flat
    key is i mod n, so n producers can fill one cache at once; a second writer on the same
    shard is refused. Use as a context manager; `close()` returns True once the cache is complete.
    """

    def __init__(self, path, spec, *, shard=(0, 1), heartbeat_s=1.0, lock_wait_s=2.0,
                 memory_budget=None):
        self.spec = spec
        self.codec = spec.make_codec()
        self.base = base_path(path)
        self.final = final_path(self.base)
        self.parts = parts_path(self.base)
        self.shard, self.nshards = int(shard[0]), int(shard[1])
        if not (self.nshards >= 1 and 0 <= self.shard < self.nshards):
            raise StoreError(f"shard {shard[0]}/{shard[1]} is invalid: use i/n with 0 <= i < n, e.g. 0/2")
        self.memory_budget = memory_budget
        self.rows_written = 0
        self.rows_skipped = 0
        self._file = None
        self._lock_fh = None
        self._hb_stop = threading.Event()
        self._hb_thread = None
        self.complete = False
        self.segment_path = None
        self._broken = None

        name = os.path.basename(self.base)
        if is_fingerprint(name) and len(name) == len(spec.fingerprint) and name != spec.fingerprint:
            raise FingerprintMismatchError(
                f"cache path {self.base} is named for fingerprint {name}, these inputs give {spec.fingerprint}: "
                f"leave the path to the cache directory (<dir>/<fingerprint>) or pass the matching inputs")
        settle(self.base)  # finish what a crash left: a compaction, or segments beside the file
        for _ in range(10):
            if os.path.lexists(self.final):  # a link or FIFO there is refused in one line
                check_final_matches(self.final, spec)
                self.complete = True
                self._todo = np.zeros(spec.num_keys, dtype=bool)
                return
            self._prepare_dir()
            if self._lock(lock_wait_s):
                break
        else:
            raise WriterBusyError(f"{self.parts} was removed again and again while this producer started: "
                                  f"is a `kdcache gc` running in a loop? Run the producer again")
        try:
            self._start_heartbeat(heartbeat_s)
            done = scan_done(self.parts, spec)
            mine = (np.arange(spec.num_keys, dtype=np.int64) % self.nshards) == self.shard
            self._todo = mine & ~done
        except BaseException:
            self._unlock()
            raise

    # -- set-up ------------------------------------------------------------------------------
    def _prepare_dir(self):
        prepare_parts(self.base, self.spec)

    def _lock(self, wait_s):
        """Take this shard's lock. False when the folder was removed (renamed aside by `gc`, or by a
        finished compaction) while waiting: the lock then belongs to a folder no longer in use."""
        path = os.path.join(self.parts, schema.lock_name(self.shard, self.nshards))
        try:
            fd, _ = open_regular(path, mine=True, flags=os.O_RDWR | os.O_CREAT)
        except FileNotFoundError:
            return False
        except NotOurs as e:  # a FIFO, link or another user's file: never written through
            raise StoreError(f"{path}: {e.why}, not a lock file of this user's kdcache: move it away, "
                             f"then run the producer again") from None
        except OSError as e:
            raise fs_error(e, path, "make the cache directory writable or pass another --cache-dir") from None
        fh = os.fdopen(fd, "r+")
        try:
            os.chmod(fh.fileno(), 0o644)
        except OSError:
            pass
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    fh.seek(0)
                    try:
                        holder = json.loads(fh.read(4096) or "{}")
                    except (ValueError, RecursionError):
                        holder = {}
                    if not isinstance(holder, dict):
                        holder = {}
                    fh.close()
                    raise WriterBusyError(
                        f"another producer (pid {holder.get('pid', '?')} on {holder.get('host', '?')}) is "
                        f"writing shard {self.shard}/{self.nshards} of cache {self.base}: wait for it to "
                        f"finish, stop it, or give this one another shard (--shard i/n)") from None
                time.sleep(0.05)
        try:
            same = os.path.samestat(os.fstat(fh.fileno()), os.stat(path))
        except FileNotFoundError:
            same = False
        if not same:
            fh.close()
            return False
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(json.dumps({"pid": os.getpid(), "host": HOST, "shard": f"{self.shard}/{self.nshards}",
                                 "started": time.time()}))
            fh.flush()
        except OSError as e:  # a full disk: the lock is taken, its holder's line could not be written
            try:
                fh.close()
            except OSError:
                pass
            raise fs_error(e, path, "free disk space (or pass another --cache-dir), then run the producer "
                                    "again: it resumes") from None
        self._lock_fh = fh
        self.lock_path = path
        return True

    def _start_heartbeat(self, every):
        # The lock file's mtime is the heartbeat readers on other hosts go by.
        def beat():
            while not self._hb_stop.wait(every):
                try:
                    os.utime(self.lock_path)
                except OSError:
                    pass
        self._hb_thread = threading.Thread(target=beat, name="kdcache-heartbeat", daemon=True)
        self._hb_thread.start()

    def _unlock(self):
        self._hb_stop.set()
        if self._lock_fh is not None:
            try:
                fcntl.flock(self._lock_fh.fileno(), fcntl.LOCK_UN)
            finally:
                self._lock_fh.close()
                self._lock_fh = None

    # -- what is owed ---------------------------------------------------------------------------
    def missing(self):
        """Flat keys this writer still owes, ascending (index * views + view)."""
        return np.flatnonzero(self._todo)

    def is_done(self, keys):
        """Boolean mask: which of these flat keys need no more writing by this writer."""
        return ~self._todo[np.asarray(keys, dtype=np.int64)]

    @property
    def remaining(self):
        return int(self._todo.sum())

    def flat_keys(self, indices, views=0):
        return schema.flat_keys(indices, views, self.spec.num_samples, self.spec.views)

    # -- writing ------------------------------------------------------------------------------
    def write(self, indices, logits, views=0, items=None):
        """Append the teacher's raw logits [B, C] for samples `indices` (view `views`); `items`, the
        records (schema.ITEM_DTYPE [B]) of the data set items the rows' inputs were made from
        (store.format.items), is kept beside them.

        Rows are durable before they are marked done: data and keys are flushed, then the
        committed-row count is written and flushed. Keys already done are skipped.
        Returns the number of rows written.
        """
        keys = self.flat_keys(indices, views)
        logits = np.asarray(logits)
        try:
            items = item_records.as_records(items, keys.size)
        except ValueError as e:
            raise BadInputError(f"{e}: pass one record per row") from None
        c = self.spec.num_classes
        if logits.ndim != 2 or logits.shape[0] != keys.size or logits.shape[1] != c:
            raise BadInputError(f"logits of shape {tuple(logits.shape)} do not fit {keys.size} keys x {c} "
                                f"classes: the teacher's output must be [batch, {c}]; check the teacher "
                                f"and --dataset (class count)")
        if not np.issubdtype(logits.dtype, np.floating):
            raise BadInputError(f"logits have dtype {logits.dtype}: pass the teacher's floating point output")
        finite = np.isfinite(logits).all(axis=1)
        if not finite.all():
            bad = keys[~finite]
            v = self.spec.views
            raise BadInputError(f"{bad.size} teacher output row(s) hold NaN or Inf "
                                f"({schema.name_keys(bad // v, bad % v)}): no sound teacher writes these: check "
                                f"its weights, its input preprocessing and its input images; nothing of this "
                                f"batch was written (rows written before stay)")
        if self.complete:
            self.rows_skipped += keys.size
            return 0
        foreign = (keys % self.nshards) != self.shard
        if foreign.any():
            k = int(keys[foreign][0])
            raise BadInputError(f"flat key {k} belongs to shard {k % self.nshards}/{self.nshards}, this "
                                f"writer owns shard {self.shard}/{self.nshards}: write only missing() keys")
        keys, first = np.unique(keys, return_index=True)
        keep = self._todo[keys]
        self.rows_skipped += int(keys.size - keep.sum()) + (logits.shape[0] - first.size)
        if not keep.any():
            return 0
        rows_idx = first[keep]
        keys = keys[keep]
        enc = self.codec.encode(logits[rows_idx], keys=keys)
        if self._broken:
            raise StoreError(f"{self.segment_path}: an earlier write failed ({self._broken}); open a new "
                             f"writer (run the producer again) to go on: it resumes")
        if self._file is None:
            self._open_segment(items is not None)
        f, ds = self._file, self._dsets
        a, b = self._rows, self._rows + keys.size
        try:
            for name, arr in enc.items():
                ds[name][a:b] = arr
            if schema.ITEMS in ds:
                ds[schema.ITEMS][a:b] = items[rows_idx] if items is not None else item_records.unknown(keys.size)
            ds[schema.SEG_KEYS][a:b] = keys
            f.flush()
            ds[schema.SEG_STATE][schema.STATE_ROWS] = b
            f.flush()
        except (OSError, RuntimeError) as e:  # disk full, size limit, I/O error: committed rows stay sound
            quiet_h5py_dealloc_errors()
            # No h5py object of the failed file may outlive abort() in this frame, which the exception's
            # traceback keeps: freed after HDF5 failed its close, such an object crashes the interpreter.
            del f, ds
            self._broken = str(e).splitlines()[0][:200]
            raise fs_error(e, self.segment_path, "free disk space (or lift the file size limit), then run "
                                                 "the producer again: it resumes, and every row committed "
                                                 "so far is kept") from None
        self._rows = b
        self._todo[keys] = False
        self.rows_written += keys.size
        return int(keys.size)

    def _open_segment(self, items):
        try:
            self._file, self.segment_path = create_segment(self.parts, self.spec, self.codec,
                                                           int(self._todo.sum()), self.shard, self.nshards,
                                                           items=items)
        except (OSError, RuntimeError) as e:  # RuntimeError: HDF5 failed a write while creating it (a full disk)
            quiet_h5py_dealloc_errors()
            raise fs_error(e, self.parts, "free disk space or make the cache directory writable, "
                                          "then run the producer again: it resumes") from None
        self._rows = 0
        # Dataset handles live as long as the segment: a handle closed after each write would
        # flush (and, on a full disk, fail) out of sight, in h5py's deallocator.
        self._dsets = {name: self._file[name] for name in self._file}

    # -- closing ------------------------------------------------------------------------------
    def close(self):
        """Close the segment; compact the cache when every key is done. Returns `complete`."""
        if self._broken:
            self.abort()
            raise StoreError(f"{self.segment_path}: a write failed ({self._broken}): free disk space and run "
                             f"the producer again; the rows committed before it are kept")
        try:
            if self._file is not None:
                try:
                    self._dsets[schema.SEG_STATE][schema.STATE_CLOSED] = 1
                    self._file.flush()
                    self._dsets = None
                    self._file.close()
                except (OSError, RuntimeError) as e:
                    self._broken = str(e).splitlines()[0][:200]
                    raise fs_error(e, self.segment_path, "free disk space, then run the producer again: "
                                                         "it resumes") from None
                finally:
                    self._file = None
            if not self.complete and self._lock_fh is not None:
                self.complete = finalize(self.base, self.spec, memory_budget=self.memory_budget)
        finally:
            self.abort()
        return self.complete

    def abort(self):
        """Close without compacting (what a crash leaves, minus the crash)."""
        if self._file is not None:
            with stderr_silenced(self._broken is not None):
                self._dsets = None
                try:
                    self._file.close()
                except Exception:  # a flush on a full disk: the committed rows are on disk already
                    pass
                self._file = None
                gc.collect()
        self._unlock()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.abort()
        return False
