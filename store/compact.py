"""Compaction: the producers' segments, once they cover every key, become one key-ordered file `P.h5`."""
import fcntl
import os
import shutil

import h5py
import numpy as np

from . import schema
from .osutil import available_memory, fs_error, fsync_dir
from .registry import base_path, final_path, parts_path
from .segment import committed_rows, list_segments, open_swmr, read_segment_rows, scan_done


def finalize(path, spec, *, memory_budget=None):
    """If the segments at `path` cover every key, write the key-ordered cache file `P.h5` (temp
    name, fsync, rename) and remove the segments. Returns True when the cache is complete."""
    base = base_path(path)
    final, parts = final_path(base), parts_path(base)
    if os.path.exists(final):
        return True
    codec = spec.make_codec()
    with open(os.path.join(parts, schema.COMPACT_LOCK), "a+") as lk:
        fcntl.flock(lk.fileno(), fcntl.LOCK_EX)
        if os.path.exists(final):
            return True
        if not scan_done(parts, spec).all():
            return False
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
        step = max(1, (64 << 20) // max(1, codec.bytes_per_row))
        for seg in list_segments(parts):
            with open_swmr(seg) as f:
                rows, _ = committed_rows(f)
                for a in range(0, rows, step):
                    keys, fields = read_segment_rows(f, codec, a, min(rows, a + step))
                    new = ~filled[keys]  # duplicates (overlapping shard layouts) hold equal rows
                    keys = keys[new]
                    for name in tables:
                        tables[name][keys] = fields[name][new]
                    filled[keys] = True
        tmp = f"{final}.tmp-{os.getpid()}"
        try:
            with h5py.File(tmp, "w") as out:
                for k, val in spec.meta().items():
                    out.attrs[k] = val
                out.attrs[schema.A_KIND] = schema.KIND_CACHE
                out.attrs[schema.A_COMPLETE] = 1
                for name, shape, dtype in codec.fields:
                    d = out.create_dataset(name, shape=(n, v) + tuple(shape), dtype=dtype)
                    src = tables[name].reshape((n, v) + tuple(shape))
                    rstep = max(1, step // v)
                    for a in range(0, n, rstep):
                        d[a:a + rstep] = src[a:a + rstep]
                out.create_dataset(schema.DONE, data=np.ones((n, v), dtype=np.uint8))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, final)
            fsync_dir(os.path.dirname(final) or ".")
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
    shutil.rmtree(parts, ignore_errors=True)
    return True
