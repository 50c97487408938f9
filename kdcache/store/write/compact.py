"""Compaction: the producers' segments, once they cover every key, become one key-ordered file `P.h5`.

NOTE [a full disk]
Compaction never lets the file system run out of space under a write it cannot recover from: a
sparse memory map (the spill file, used when the cache is larger than half the free memory) dies
with SIGBUS at the first page the disk has no block for, and HDF5, failing a write, leaves h5py's
file in a state whose close raises RuntimeError and may crash the interpreter. So every byte is
allocated (posix_fallocate) before anything is written into it: the spill files, a reservation of
the cache file's size taken before the segments are read, then the cache file itself, created by
h5py with only its metadata (datasets allocated early, never filled) and its rows written with
pwrite at the datasets' offsets. A full disk is then ENOSPC at an allocation: NoSpaceError, one
line; the temporary files are removed, the segments are untouched (every row is kept) and the next
producer, reader or `kdcache ls` compacts again.
"""
import errno
import fcntl
import logging
import os

import h5py
import numpy as np
from h5py import h5d, h5p

from ..format import checksums, items as item_records, schema, seal
from ..errors import NoSpaceError, StoreError
from ..osutil import NotOurs, available_memory, fs_error, fsync_dir, is_ours, open_regular
from ..files.parts import check_parts, list_parts
from ..files.paths import COMPACT_TMP, base_path, compact_tmp, discard, final_path, parts_path
from ..files.segment import (committed_rows, count_done, list_segments, open_swmr, quiet_h5py_dealloc_errors,
                      read_segment_items, read_segment_rows)

_FULL = (errno.ENOSPC, errno.EDQUOT)
_CREATE = os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC

log = logging.getLogger("kdcache.store")


def step(name):
    """A named step of compaction: "locked", "writing" (after each block of the final file),
    "written" (synced, not yet renamed), "renamed" (final in place, parts still there), "removing" (parts renamed aside, not deleted). Does
    nothing; the crash tests replace it to kill the process at exactly that step."""


def remove_stale_tmp(final):
    """Temporary files of compactions that died before their rename. Called under the compaction
    lock, where no other compaction of this cache can be writing one."""
    d, name = os.path.split(final)
    try:
        names = os.listdir(d or ".")
    except OSError:
        return
    for n in names:
        m = COMPACT_TMP.match(n)
        if m and m.group(1) + schema.FINAL_SUFFIX == name and is_ours(os.path.join(d, n)):
            try:
                os.unlink(os.path.join(d, n))
            except OSError:
                pass


class _Full(Exception):
    """An allocation or write found the file system full (carries the OSError)."""


def _is_full(e):
    """True for ENOSPC / EDQUOT, also when h5py reports it only in its message."""
    if getattr(e, "errno", None) in _FULL:
        return True
    text = str(e)
    return any(f"errno = {n}," in text for n in _FULL) or "No space left on device" in text


def allocate(fd, size):
    """Give the file blocks for its first `size` bytes (ENOSPC now, not SIGBUS or a failed write later).
    File systems without fallocate get zeros written."""
    if size <= 0:
        return
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    zeros = bytes(1 << 20)
    for a in range(0, size, len(zeros)):
        os.pwrite(fd, zeros[:min(len(zeros), size - a)], a)


def _spill_table(path, shape, dtype):
    """A writable memmap over a file whose every block is allocated first (NOTE [a full disk])."""
    fd = os.open(path, _CREATE, 0o644)
    with open(fd, "r+b") as fh:
        allocate(fd, int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize)
        return np.memmap(fh, dtype=dtype, mode="r+", shape=shape)  # the map holds its own descriptor


def space_needed(spec, codec, memory_budget=None):
    """(cache file bytes, spill file bytes): the most compacting a cache of `spec` writes beside its
    segments: the rows, the done flags, the item records, the seal's user block, metadata and alignment;
    and, when the rows take more than the memory budget (default: half the free memory), a spill file
    of the rows."""
    need = spec.num_keys * codec.bytes_per_row
    budget = memory_budget if memory_budget is not None else available_memory() // 2
    records = spec.num_samples * schema.ITEM_DTYPE.itemsize
    return need + spec.num_keys + records + seal.SEAL_BYTES + (256 << 10), (need if need > budget else 0)


def free_space(directory):
    """How much of the file system at `directory` is free, in words."""
    try:
        st = os.statvfs(directory)
        return f"{st.f_bavail * st.f_frsize:,} bytes are free"
    except OSError:
        return "its free space is unknown"


def reserve(path, size):
    """Hold `size` bytes of the file system under the temporary name of the cache file until h5py
    creates it: a full disk is found before the segments are read, not after."""
    fd = os.open(path, _CREATE, 0o644)
    try:
        allocate(fd, size)
    finally:
        os.close(fd)


def _write_final(tmp, spec, codec, tables, block, items=None):
    """The key-ordered cache file at `tmp`: h5py writes its metadata, then its space is allocated and
    the rows are written at the datasets' offsets (NOTE [a full disk]). Contiguous, unfiltered datasets,
    each of 64 KiB or more starting on a page boundary: readers map them straight from the file
    (store.read.mapped)."""
    n, v = spec.num_samples, spec.views
    early = h5p.create(h5p.DATASET_CREATE)
    early.set_alloc_time(h5d.ALLOC_TIME_EARLY)  # every dataset has its place in the file now, unwritten
    early.set_fill_time(h5d.FILL_TIME_NEVER)  # (on the property list: create_dataset's fill_time is h5py 3.12+)
    places = []
    sums = checksums.compute(tables, spec)  # of the bytes written below (NOTE [checksums])
    try:
        # The first SEAL_BYTES are HDF5's user block, for the seal (NOTE [the seal]); the v110 format
        # checksums HDF5's own metadata too, for readers that open the file with h5py alone.
        with h5py.File(tmp, "w", userblock_size=seal.SEAL_BYTES, libver=("v110", "v110"),
                       alignment_threshold=64 << 10, alignment_interval=4096) as out:
            for k, val in spec.meta().items():
                out.attrs[k] = schema.attr_value(val)
            out.attrs[schema.A_KIND] = schema.attr_value(schema.KIND_CACHE)
            out.attrs[schema.A_COMPLETE] = 1
            for name, shape, dtype in codec.fields:
                d = out.create_dataset(name, shape=(n, v) + tuple(shape), dtype=dtype, dcpl=early)
                places.append((name, d.id.get_offset()))
            done = out.create_dataset(schema.DONE, data=np.ones((n, v), dtype=np.uint8))
            checksums.write(out, sums, spec)
            item_records.write_final(out, items)  # the data set's item records, when every one is known
            # what the seal leaves out: data checked on their own -- the rows by the checksum table, the
            # done flags by being all 1, the item records by their CRC-32; the seal covers the table
            sealed_apart = [(d.id.get_offset(), d.id.get_storage_size())
                            for d in (done, out.get(schema.ITEMS)) if d is not None]
    except (OSError, RuntimeError) as e:  # h5py's close after a failed write raises RuntimeError
        quiet_h5py_dealloc_errors()
        if _is_full(e):
            raise _Full(e) from None
        raise
    fd = os.open(tmp, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        end = max(off + tables[name].nbytes for name, off in places)
        allocate(fd, max(end, os.fstat(fd).st_size))
        for name, off in places:
            # key order is (sample, view, ...) in C order: the dataset's bytes, as they stand
            src = np.ascontiguousarray(tables[name]).reshape(-1).view(np.uint8)
            row = src.size // max(1, spec.num_keys)
            for a in range(0, spec.num_keys, block):
                buf, at = memoryview(src[a * row:(a + block) * row]), off + a * row
                while buf:
                    k = os.pwrite(fd, buf, at)
                    buf, at = buf[k:], at + k
                step("writing")
        seal.write(fd, [(off, tables[name].nbytes) for name, off in places] + sealed_apart)
        os.fsync(fd)
    finally:
        os.close(fd)


def _no_space(directory, final_bytes, spill_bytes):
    free = free_space(directory)
    what = (f" ({final_bytes:,} for the cache file and {spill_bytes:,} for its spill file while it is written, as "
            f"the cache is larger than half the free memory)" if spill_bytes else "")
    return NoSpaceError(
        f"{directory}: no space left to compact the cache: it needs about {final_bytes + spill_bytes:,} bytes there"
        f"{what} and {free}: free space on that file system (or move the cache directory to a larger one), then "
        f"run the producer or `kdcache ls` again: every row is kept in the segments and compaction is retried")


def _in_the_way(e):
    return StoreError(f"{e.path}: {e.why}, where compaction writes: move it away, then run "
                      f"the producer (or kdcache ls) again")


def finalize(path, spec, *, memory_budget=None):
    """If the segments at `path` cover every key, write the key-ordered cache file `P.h5` (temp
    name, fsync, rename) and remove the segments. Returns True when the cache is complete."""
    base = base_path(path)
    final, parts = final_path(base), parts_path(base)
    if is_ours(final, mine=False):
        return True
    codec = spec.make_codec()
    try:
        fd, _ = open_regular(os.path.join(parts, schema.COMPACT_LOCK), flags=os.O_CREAT)
    except FileNotFoundError:  # another process finished it and removed the segments just now
        return os.path.exists(final)
    except NotOurs as e:
        raise _in_the_way(e) from None
    with open(fd, "rb") as lk:
        fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
        if os.path.lexists(final):
            if not is_ours(final, mine=False):  # a link or FIFO: renaming onto it would destroy it
                raise _in_the_way(NotOurs(final, "not a cache file kdcache wrote"))
            return True
        remove_stale_tmp(final)
        if count_done(parts, spec) < spec.num_keys:
            return False
        if list_parts(parts):  # NOTE [parts]: each checked before its rows are compacted; a damaged one set aside
            for name, why in check_parts(parts, spec)["damaged"]:
                log.warning("%s", why.splitlines()[0])
            if count_done(parts, spec) < spec.num_keys:
                return False
        tmp = compact_tmp(final)
        for p in [tmp] + [os.path.join(parts, f".compact-{name}.tmp") for name, _, _ in codec.fields]:
            if os.path.lexists(p) and not is_ours(p):  # written through, a link would lead anywhere
                raise _in_the_way(NotOurs(p, "not a file kdcache wrote"))
        step("locked")
        nk = spec.num_keys
        need = nk * codec.bytes_per_row
        final_bytes, spill_bytes = space_needed(spec, codec, memory_budget)
        tables, spill, reading = {}, [], False
        block = max(1, (64 << 20) // max(1, codec.bytes_per_row))
        try:
            try:
                for name, shape, dtype in codec.fields:
                    if not spill_bytes:
                        tables[name] = np.empty((nk,) + tuple(shape), dtype=dtype)
                    else:  # larger than memory: scatter into a page-cached memmap instead
                        p = os.path.join(parts, f".compact-{name}.tmp")
                        spill.append(p)
                        tables[name] = _spill_table(p, (nk,) + tuple(shape), dtype)
                reserve(tmp, final_bytes)
            except OSError as e:
                if _is_full(e):
                    raise _Full(e) from None
                raise
            filled = np.zeros(nk, dtype=bool)
            items = item_records.unknown(spec.num_samples)  # by sample, from whichever row records it
            reading = True
            for seg in list_segments(parts):
                with open_swmr(seg) as f:
                    rows, _ = committed_rows(f, spec)
                    for a in range(0, rows, block):
                        keys, fields = read_segment_rows(f, codec, a, min(rows, a + block), nk)
                        new = ~filled[keys]  # duplicates (overlapping shard layouts) hold equal rows
                        keys = keys[new]
                        for name in tables:
                            tables[name][keys] = fields[name][new]
                        filled[keys] = True
                        rec = read_segment_items(f, a, min(rows, a + block))
                        if rec is not None:
                            rec = rec[new]
                            ok = item_records.known(rec)
                            items[keys[ok] // spec.views] = rec[ok]
            reading = False
            _write_final(tmp, spec, codec, tables, block, items)
            step("written")
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final) or ".")
            step("renamed")
        except (OSError, _Full) as e:
            tables.clear()  # the spill maps go with their last reference: their pages are dropped, not written
            for p in [tmp] + spill:
                try:
                    os.unlink(p)
                except OSError:
                    pass
            if isinstance(e, _Full) or _is_full(e):
                raise _no_space(os.path.dirname(final) or ".", final_bytes, need if spill else 0) from None
            if reading:
                raise  # a segment that cannot be read: its reader's error, not the file system's
            raise fs_error(e, final, "free disk space, then run the producer again: every row is kept "
                                     "in the segments and compaction is retried") from None
        finally:
            tables.clear()
            for p in spill:
                try:
                    os.unlink(p)
                except OSError:
                    pass
    remove_parts(parts)
    return True


def remove_parts(parts):
    """The segments of a finished cache, once its file is in place: renamed aside, then deleted
    (a producer that locks a shard of it afterwards sees that its folder is gone)."""
    try:
        discard(parts, between=lambda: step("removing"))
    except (OSError, StoreError):
        pass  # kept for `gc`: the finished file is what readers use
