"""Compaction: the producers' segments, once they cover every key, become one key-ordered file `P.h5`."""
import fcntl
import os

import h5py
import numpy as np

from . import schema
from .errors import StoreError
from .osutil import NotOurs, available_memory, fs_error, fsync_dir, is_ours, open_regular
from .paths import COMPACT_TMP, base_path, compact_tmp, discard, final_path, parts_path
from .segment import committed_rows, count_done, list_segments, open_swmr, read_segment_rows


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


def _in_the_way(e):
    return StoreError(f"{e.path}: {e.why}, where compaction writes: move it away, then run "
                      f"the producer (or kdcache ls) again")


def finalize(path, spec, *, memory_budget=None):
    """If the segments at `path` cover every key, write the key-ordered cache file `P.h5` (temp
    name, fsync, rename) and remove the segments. Returns True when the cache is complete."""
    base = base_path(path)
    final, parts = final_path(base), parts_path(base)
    if os.path.exists(final):
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
        if os.path.exists(final):
            return True
        remove_stale_tmp(final)
        if count_done(parts, spec) < spec.num_keys:
            return False
        tmp = compact_tmp(final)
        for p in [tmp] + [os.path.join(parts, f".compact-{name}.tmp") for name, _, _ in codec.fields]:
            if os.path.lexists(p) and not is_ours(p):  # written through, a link would lead anywhere
                raise _in_the_way(NotOurs(p, "not a file kdcache wrote"))
        step("locked")
        n, v, nk = spec.num_samples, spec.views, spec.num_keys
        need = nk * codec.bytes_per_row
        budget = memory_budget if memory_budget is not None else available_memory() // 2
        tables, spill = {}, []
        for name, shape, dtype in codec.fields:
            if need <= budget:
                tables[name] = np.empty((nk,) + tuple(shape), dtype=dtype)
            else:  # larger than memory: scatter into a page-cached memmap instead
                p = os.path.join(parts, f".compact-{name}.tmp")
                tables[name] = np.memmap(p, dtype=dtype, mode="w+", shape=(nk,) + tuple(shape))
                spill.append(p)
        filled = np.zeros(nk, dtype=bool)
        block = max(1, (64 << 20) // max(1, codec.bytes_per_row))
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
        try:
            # Contiguous, unfiltered datasets (h5py's default), each of 64 KiB or more starting on a
            # page boundary: readers map them straight from the file (store.mapped).
            with h5py.File(tmp, "w", alignment_threshold=64 << 10, alignment_interval=4096) as out:
                for k, val in spec.meta().items():
                    out.attrs[k] = val
                out.attrs[schema.A_KIND] = schema.KIND_CACHE
                out.attrs[schema.A_COMPLETE] = 1
                for name, shape, dtype in codec.fields:
                    d = out.create_dataset(name, shape=(n, v) + tuple(shape), dtype=dtype)
                    src = tables[name].reshape((n, v) + tuple(shape))
                    rstep = max(1, block // v)
                    for a in range(0, n, rstep):
                        d[a:a + rstep] = src[a:a + rstep]
                        step("writing")
                out.create_dataset(schema.DONE, data=np.ones((n, v), dtype=np.uint8))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            step("written")
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final) or ".")
            step("renamed")
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise fs_error(e, final, "free disk space, then run the producer again: every row is kept "
                                     "in the segments and compaction is retried") from None
        finally:
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
