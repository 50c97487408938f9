"""bench.read_scale's sections: write a large cache, open it, gather from it warm and cold, and the memory of its readers."""
import ctypes
import mmap
import os
import shutil
import statistics
import time

import h5py
import numpy as np

from bench.common import Children, make_log, python_m
from bench.paired import paired
from bench.read_scale.children import BATCH, mapping_pss, smaps_rollup
from bench.store.gather import epoch_batches, timed_rounds
from kdcache.store import CacheReader, CacheSpec, CacheWriter, path_for
from kdcache.store.osutil import available_memory

FLOORS = {"map_vs_numpy_gather": (">=", 0.5), "pss_map_vs_file": ("<=", 1.25)}
POOL = 4093  # distinct random rows, tiled over the keys: generating logits must not dominate a write
MARGIN = 1536 << 20  # memory left free when RAM readers are sized to what is available
GB = 1e9

log = make_log("bench.read_scale")


# -- logits by key: cheap, exact in float16, distinct per key ---------------------------------------
def make_pool(rng, c):
    """POOL rows of c logits spread like a trained classifier's (std 3), already float16 values."""
    return (rng.standard_normal((POOL, c), dtype=np.float32) * np.float32(3)).astype(np.float16).astype(np.float32)


def rows_for(pool, keys):
    """The logits of flat keys: a pool row, with the key written into columns 0-2 (k/64 - 8 for each 10 bits of
    the key, exact in float16), so every key's row differs and any of them can be checked after a read."""
    k = np.asarray(keys, dtype=np.int64)
    out = pool[k % POOL]
    for j in range(min(3, out.shape[1])):
        out[:, j] = ((k >> (10 * j)) & 1023) / 64.0 - 8.0
    return out


def make_spec(rows, classes, views, tag):
    return CacheSpec(num_samples=rows, num_classes=classes, views=views, codec="full", dtype="float16",
                     inputs={"bench": f"bench.read_scale {tag}", "num_samples": rows, "num_classes": classes})


# -- the machine's page cache, disk and memory --------------------------------------------------------
def resident_fraction(path):
    """Fraction of the file's pages in the page cache (mincore over a read-only map, which touches none)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    vec = np.zeros(-(-size // page), dtype=np.uint8)
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    view = np.frombuffer(mm, dtype=np.uint8)
    try:
        ok = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size),
                          ctypes.c_void_p(vec.ctypes.data)) == 0
    finally:
        del view
        mm.close()
    return float((vec & 1).mean()) if ok else None


def evict(path):
    """Drop the file's pages from the page cache without root: fsync, then POSIX_FADV_DONTNEED. Pages that a
    live process maps stay; so the caller holds no map of it. Returns the resident fraction afterwards."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_fraction(path)


def read_through(path, chunk=64 << 20):
    """Read the whole file once (fills the page cache). Returns bytes per second."""
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as fh:
        buf = bytearray(chunk)
        while fh.readinto(buf):
            pass
    return os.path.getsize(path) / (time.perf_counter() - t0)


def keep_free(free):
    """Disk space a run leaves free: 20 GB, or half of what is free when that is less (small test runs)."""
    return min(20 * GB, free // 2)


def write_peak(nbytes):
    """Disk bytes a cache of nbytes needs while it is compacted: its segment and the final file, plus the
    compaction's scratch copy when the cache is more than the memory compaction may use (store.write.compact)."""
    return nbytes * (2 if nbytes <= available_memory() // 2 else 3)


def fits_in_memory(nbytes):
    return nbytes + MARGIN <= available_memory()


def logits_array(path):
    """The final file's logits dataset read as one float16 array in RAM (np.fromfile at its offset)."""
    with h5py.File(path, "r") as f:
        d = f["logits"]
        off, shape = d.id.get_offset(), d.shape
    return np.fromfile(path, dtype=np.float16, count=int(np.prod(shape)), offset=off).reshape(shape[0] * shape[1], -1)


# -- 1. write --------------------------------------------------------------------------------------
def write_cache(root, spec, pool, order, batch, tag):
    """Every key through CacheWriter in `order`, `batch` rows a write. Returns (cache path, figures)."""
    d = os.path.join(root, tag)
    path = path_for(d, spec.fingerprint)
    nv = spec.views
    t0 = time.perf_counter()
    w = CacheWriter(path, spec)
    for a in range(0, order.size, batch):
        k = order[a:a + batch]
        if nv == 1:
            w.write(k, rows_for(pool, k))
        else:
            w.write(k // nv, rows_for(pool, k), views=k % nv)
    t1 = time.perf_counter()
    complete = w.close()
    t2 = time.perf_counter()
    if not complete:
        raise RuntimeError(f"bench: cache {path} did not complete after writing every key")
    final = path + ".h5"
    nk = spec.num_keys
    return path, {"keys": nk, "batch": batch, "write_s": t1 - t0, "compaction_s": t2 - t1,
                  "rows_per_s": nk / (t1 - t0), "rows_per_s_with_close": nk / (t2 - t0),
                  "file_bytes": os.path.getsize(final), "bytes_per_row": os.path.getsize(final) / nk}


# -- 2. open ----------------------------------------------------------------------------------------
def ram_budget(spec):
    """A memory_budget that holds a full float16 cache widened to float32, as today's RAM path does."""
    return spec.num_keys * spec.num_classes * 4


def timed_open(path, **kw):
    t0 = time.perf_counter()
    r = CacheReader(path, **kw)
    return r, time.perf_counter() - t0


def bench_open(path, spec, repeats):
    """Open the same file mapped (best of `repeats`) and through today's RAM path (once: it reads it all).
    Returns (figures, the RAM reader or None: section 3 gathers from it too)."""
    res = {"map_s": [], "ram_s": None, "ram_skipped": None}
    for _ in range(repeats):
        r, t = timed_open(path, spec=spec)
        if r.source != "map":
            raise RuntimeError(f"bench: the finished cache {path} was read from {r.source}, not mapped")
        r.close()
        res["map_s"].append(t)
    need = ram_budget(spec)
    ram = None
    if fits_in_memory(need):
        ram, res["ram_s"] = timed_open(path, spec=spec, mmap=False, memory_budget=need)
        res["ram_source"] = ram.source
        res["ram_held_dtype"] = ram._hot.dtype.str if ram._hot is not None else None
    else:
        res["ram_skipped"] = f"needs {need / GB:.1f} GB, {available_memory() / GB:.1f} GB available"
    res["map_s_best"] = min(res["map_s"])
    res["ram_vs_map"] = res["ram_s"] / res["map_s_best"] if res["ram_s"] else None
    return res, ram


# -- 3. warm gathers --------------------------------------------------------------------------------
def bench_gather(path, spec, pool, ram, p, rng):
    """reader.get on the map vs numpy fancy indexing of the same float16 array in RAM (and today's reader)."""
    res = {"warm_read_bytes_per_s": read_through(path + ".h5")}
    mapped = CacheReader(path, spec=spec)
    arr = logits_array(path + ".h5")
    hot = mapped._hot  # the mapped float16 array get() gathers from
    batches = epoch_batches(rng, spec.num_samples, p["gather_batches"])
    checks = []
    for b in batches[:4]:
        want = rows_for(pool, b)
        got = mapped.get(b)
        checks.append(np.array_equal(got, want) and np.array_equal(arr[b].astype(np.float32), want))
        if ram is not None:
            checks.append(np.array_equal(ram.get(b), got))
    res["rows_match"] = bool(all(checks))
    if not res["rows_match"]:
        raise RuntimeError("bench: the mapped reader, today's reader and the file's array disagree on the same rows")
    sides = {"map_get": lambda: [mapped.get(b) for b in batches],
             "map_raw": lambda: [hot[b] for b in batches],
             "numpy_f32": lambda: [arr[b].astype(np.float32) for b in batches],
             "numpy_raw": lambda: [arr[b] for b in batches]}
    if ram is not None:
        sides["ram_get"] = lambda: [ram.get(b) for b in batches]
    timed_rounds(sides, 1)  # warm-up: page tables, caches
    times = timed_rounds(sides, p["gather_repeats"])
    rps = {k: batches.size / min(t) for k, t in times.items()}

    def per_round(side, base):  # side's rows/s over base's, round by round: round r of each met the same load
        return [tb / ts for ts, tb in zip(times[side], times[base])]
    op, value = FLOORS["map_vs_numpy_gather"]
    floor = paired(per_round("map_get", "numpy_f32"), value, higher_is_better=op == ">=")
    res.update(batches=int(batches.shape[0]), batch=BATCH, repeats=p["gather_repeats"], rows_per_s_best=rps,
               rows_per_s_median={k: batches.size / statistics.median(t) for k, t in times.items()}, seconds=times,
               map_vs_numpy_gather=floor["measured"], paired={"map_vs_numpy_gather": floor},
               map_raw_vs_numpy_raw=statistics.median(per_round("map_raw", "numpy_raw")),
               map_vs_ram_reader=statistics.median(per_round("map_get", "ram_get")) if "ram_get" in rps else None)
    mapped.close()
    return res


# -- 4. memory of several reader processes ------------------------------------------------------------
def bench_readers(root, path, mode, count, seed, memory_budget=None, views=None, timeout=1800):
    """`count` reader processes (bench.read_scale.children) each gather every key of the cache once (views=V:
    reader i every sample once in view i mod V); while all are alive, their Pss (/proc/PID/smaps_rollup) and
    the Pss of their maps of the file are read."""
    final = path + ".h5"
    sync = os.path.join(root, f"sync-{mode}-{time.monotonic_ns()}")
    os.makedirs(sync)
    kids, started = Children(), []
    try:
        for i in range(count):
            argv = python_m("bench.read_scale.children", "--path", path, "--mode", mode, "--sync", sync,
                            "--seed", seed + i, *(("--memory-budget", memory_budget) if memory_budget else ()),
                            *(("--view", i % views) if views else ()))
            started.append(kids.start(argv, f"reader {mode} {i}", timeout=timeout))
        while True:
            pending = [c for c in started if not os.path.exists(os.path.join(sync, f"{c.proc.pid}.ready"))]
            if not pending:
                break
            for c in pending:  # a reader that died is reaped now, with its error
                if os.waitid(os.P_PID, c.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    kids.finish(c)
            time.sleep(0.05)
        mem = [{"rollup": smaps_rollup(c.proc.pid), "file_map": mapping_pss(c.proc.pid, final)} for c in started]
        with open(os.path.join(sync, "release"), "w"):
            pass
        out = [kids.finish(c) for c in started]
    except BaseException:
        kids.stop_all()
        raise
    finally:
        shutil.rmtree(sync, ignore_errors=True)
    size = os.path.getsize(final)

    def total(get):
        return sum(get(m) or 0 for m in mem)
    pss = total(lambda m: m["rollup"].get("Pss"))
    res = {"mode": mode, "processes": count, "file_bytes": size, "each_reads": "one view" if views else "every key", "sources": sorted({o["source"] for o in out}),
           "held_dtypes": sorted({str(o["held_dtype"]) for o in out}),
           "pss_sum": pss, "pss_vs_file": pss / size,
           "pss_anon_sum": total(lambda m: m["rollup"].get("Pss_Anon")),
           "pss_file_sum": total(lambda m: m["rollup"].get("Pss_File")),
           "pss_cache_map_sum": total(lambda m: m["file_map"]["pss"]),
           "rss_sum": total(lambda m: m["rollup"].get("Rss")),
           "pss_before_open_sum": sum(o["pss_before_open"] or 0 for o in out),
           "open_s": [o["open_s"] for o in out], "epoch_rows_per_s": [o["rows_per_s"] for o in out],
           "rows_per_process": out[0]["rows"], "mxnet_loaded": any(o["mxnet_loaded"] for o in out),
           "per_process": [{"pss": m["rollup"].get("Pss"), "cache_map_pss": m["file_map"]["pss"]} for m in mem]}
    res["pss_net_vs_file"] = (pss - res["pss_before_open_sum"]) / size
    return res


def ram_readers_that_fit(spec, want):
    """How many readers holding the cache widened to float32 fit in the memory available now (0 to want)."""
    each = ram_budget(spec) + (200 << 20)  # the array, plus the interpreter, numpy and h5py
    return max(0, min(want, (available_memory() - MARGIN) // each))


# -- 5. the first epoch from disk ------------------------------------------------------------------------
def epoch(reader, order):
    t0 = time.perf_counter()
    for a in range(0, order.size, BATCH):
        reader.get(order[a:a + BATCH])
    return time.perf_counter() - t0


def reader_mmap(reader):
    """The mmap object under a mapped reader's arrays (None if not found): to try another madvise on it."""
    a = reader._hot
    while a is not None and not isinstance(a, mmap.mmap):
        a = a.obj if isinstance(a, memoryview) else getattr(a, "base", None)
    return a


def bench_cold(path, spec, rng, rows=None):
    """One epoch (its first `rows` rows, when given) through the mapped reader right after the file's pages were
    dropped: random order, key order (both with the kernel's default read-ahead, as the reader maps it); random
    order with no read-ahead (MADV_RANDOM set on the reader's map), and after one sequential read of the file;
    today's RAM path's open from a cold file and a plain read of the file, for comparison."""
    final, n = path + ".h5", spec.num_samples
    m = min(n, rows or n)
    res = {"resident_before_evict": resident_fraction(final), "rows": m, "of_rows": n}
    perm = rng.permutation(n)[:m]

    def no_readahead(r):
        mm = reader_mmap(r)
        if mm is None:
            raise RuntimeError("bench: no mmap found under the mapped reader's arrays")
        mm.madvise(mmap.MADV_RANDOM)
    for name, order, before, after in (("random", perm, None, None), ("sequential", np.arange(m), None, None),
                                       ("random_no_readahead", perm, None, no_readahead),
                                       ("random_read_first", perm, read_through, None)):
        left = evict(final)
        t0 = time.perf_counter()
        if before:
            before(final)
        r, open_s = timed_open(path, spec=spec)
        if after:
            after(r)
        s = epoch(r, order)
        r.close()
        res[name] = {"resident_after_evict": left, "open_s": open_s, "epoch_s": s, "rows_per_s": m / s,
                     "total_s": time.perf_counter() - t0, "resident_after_epoch": resident_fraction(final)}
    res["evicted"] = all(res[k]["resident_after_evict"] is not None and res[k]["resident_after_evict"] < 0.05
                         for k in ("random", "sequential", "random_no_readahead", "random_read_first"))
    left = evict(final)
    res["plain_read"] = {"resident_after_evict": left, "bytes_per_s": read_through(final)}
    res["ram_open"] = None
    if fits_in_memory(ram_budget(spec)):
        left = evict(final)
        r, t = timed_open(path, spec=spec, mmap=False, memory_budget=ram_budget(spec))
        r.close()
        res["ram_open"] = {"resident_after_evict": left, "open_s": t}
    return res


# -- 6. several views -------------------------------------------------------------------------------------
def choose_views(rows, classes, free, asked, max_views):
    """Views (and rows) for the multi-view cache: `asked`, or the most (<= max_views) whose write fits the
    disk with keep_free(free) left; fewer rows when even 2 views do not. Returns (rows, views, why)."""
    room = free - keep_free(free)
    row = classes * 2  # full float16
    if asked:
        need = write_peak(rows * asked * row)
        if need > room:
            raise RuntimeError(f"bench: --views {asked} needs {need / GB:.1f} GB of disk while it is written, "
                               f"{room / GB:.1f} GB may be used: pass fewer views, or --tmp on a larger disk")
        return rows, asked, f"{asked} views as asked"
    for v in range(max_views, 1, -1):
        if write_peak(rows * v * row) <= room:
            return rows, v, (f"{v} views: the most of {max_views} whose write ({write_peak(rows * v * row) / GB:.1f}"
                             f" GB at peak) leaves {keep_free(free) / GB:.0f} GB of {free / GB:.0f} GB free")
    fewer = int(room // (3 * 2 * row))
    if fewer < 1000:
        return None, None, f"skipped: {room / GB:.1f} GB of disk may be used, too little for 2 views"
    return fewer, 2, f"2 views of {fewer:,} rows: the disk holds no more"


def bench_multiview(root, rows, views, classes, pool, p, rng, readers, seed):
    spec = make_spec(rows, classes, views, f"{views} views")
    nk = spec.num_keys
    log(f"6/6 writing {rows:,} x {views} views x {classes} ({nk * classes * 2 / GB:.1f} GB)")
    path, wr = write_cache(root, spec, pool, np.arange(nk), p["mv_write_batch"], "multiview")
    final = path + ".h5"
    res = {"rows": rows, "views": views, "classes": classes, "write": wr}
    # Warm when the page cache can hold the file: random gathers from a file that it cannot hold run at the
    # disk's speed (section 5), and a pass over every key would take hours.
    res["warmed"] = wr["file_bytes"] < 0.85 * available_memory()
    if res["warmed"]:
        read_through(final)
    res["resident_before_gather"] = resident_fraction(final)
    warm = res["resident_before_gather"] >= 0.9
    maps = []
    for _ in range(p["open_repeats"]):
        r, t = timed_open(path, spec=spec)
        maps.append(t)
        if r.source != "map":
            raise RuntimeError(f"bench: the finished {views}-view cache was read from {r.source}, not mapped")
        r.close()
    res["map_open_s"] = maps
    keys = epoch_batches(rng, nk, p["gather_batches"] if warm else p["disk_batches"])
    mapped = CacheReader(path, spec=spec)
    other = CacheReader(path, spec=spec, mmap=False)  # today's path for a cache this size: RAM if it fits, else disk
    few = keys[:p["disk_batches"]]
    ok = all(np.array_equal(mapped.get(k // views, views=k % views), rows_for(pool, k)) and
             np.array_equal(other.get(k // views, views=k % views), rows_for(pool, k)) for k in few[:3])
    if not ok:
        raise RuntimeError(f"bench: the {views}-view cache returned rows other than those written")
    map_side = {"map": lambda: [mapped.get(k // views, views=k % views) for k in keys]}
    if warm:
        timed_rounds(map_side, 1)  # warm-up: page tables
    times = timed_rounds(map_side, p["gather_repeats"] if warm else 1)
    other_t = timed_rounds({"other": lambda: [other.get(k // views, views=k % views) for k in few]}, 2)
    res.update(rows_match=ok, batches=int(keys.shape[0]), other_batches=int(few.shape[0]), other_source=other.source,
               map_rows_per_s=keys.size / min(times["map"]), other_rows_per_s=few.size / min(other_t["other"]))
    res["map_vs_other"] = res["map_rows_per_s"] / res["other_rows_per_s"]
    mapped.close()
    other.close()
    log(f"6/6 {readers} mapped readers of the {views}-view cache")
    res["readers"] = bench_readers(root, path, "map", readers, seed, views=None if warm else views)
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)
    return res

