"""Store benchmark sections that write (shuffled vs ordered, bytes per row, visibility of new rows), and their caches."""
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from bench.common import md_table, rate, verdict
from bench.paired import paired, shown
from kdcache.store import CacheNotFoundError, CacheReader, CacheSpec, CacheWriter, path_for

BATCH = 256  # rows per write and per gather: a trainer's batch
FLOORS = {"shuffled_vs_ordered_write_c10": 0.5, "shuffled_vs_ordered_write_c1000": 0.5}
CODECS = [("full", "float16"), ("full", "float32"), ("topk:5", "float16"), ("topk:10", "float16")]
BYTES_CLASSES = (100, 1000)


# -- caches of synthetic logits, the set-up of every section ----------------------------------------
def teacher_logits(rng, n, c):
    """Synthetic raw logits [n, c] float32, spread like a trained classifier's (std 3)."""
    return rng.standard_normal((n, c), dtype=np.float32) * np.float32(3.0)


def make_spec(n, c, codec="full", dtype="float16", tag="bench"):
    return CacheSpec(num_samples=n, num_classes=c, codec=codec, dtype=dtype,
                     inputs={"bench": f"bench.store {tag}", "num_samples": n, "num_classes": c})


def build_cache(cache_dir, logits, codec="full", dtype="float16", tag="bench", step=8192):
    """A finished cache of these logits (written in index order, in large batches: set-up, not timed)."""
    n, c = logits.shape
    spec = make_spec(n, c, codec, dtype, tag)
    path = path_for(cache_dir, spec.fingerprint)
    with CacheWriter(path, spec) as w:
        for a in range(0, n, step):
            w.write(np.arange(a, min(n, a + step)), logits[a:a + step])
    if not w.complete:
        raise RuntimeError(f"bench: cache {path} did not complete after writing every key")
    return spec, path


# -- 3. shuffled vs ordered writes -------------------------------------------------------------
def write_once(root, spec, keys, logits):
    """Write every row through CacheWriter in batches of BATCH in the order given.
    Returns (seconds to open and write, seconds including close/compaction, file bytes)."""
    d = tempfile.mkdtemp(prefix="write-", dir=root)
    try:
        path = path_for(d, spec.fingerprint)
        t0 = time.perf_counter()
        w = CacheWriter(path, spec)
        for a in range(0, keys.size, BATCH):
            w.write(keys[a:a + BATCH], logits[a:a + BATCH])
        t1 = time.perf_counter()
        complete = w.close()
        t2 = time.perf_counter()
        if not complete:
            raise RuntimeError(f"bench: cache in {d} did not complete after writing every key")
        return t1 - t0, t2 - t0, path
    except BaseException:
        shutil.rmtree(d, ignore_errors=True)
        raise


def bench_write_order(root, p, rng):
    res = {}
    for c, n in sorted(p["write_n"].items()):
        logits = teacher_logits(rng, n, c)
        perm = rng.permutation(n)
        orders = {"ordered": (np.arange(n), logits), "shuffled": (perm, logits[perm])}
        spec = make_spec(n, c, tag=f"write c={c}")
        times = {k: [] for k in orders}
        for r in range(p["write_repeats"]):
            names = list(orders)[r % 2:] + list(orders)[:r % 2]
            for k in names:
                keys, lg = orders[k]
                gc.collect()
                w_s, total_s, path = write_once(root, spec, keys, lg)
                if r == 0:  # the finished cache holds every row at its key, whatever the write order
                    with CacheReader(path, spec=spec) as rd:
                        probe = np.sort(rng.choice(n, size=min(n, 1000), replace=False))
                        if not np.array_equal(rd.get(probe), logits[probe].astype(np.float16).astype(np.float32)):
                            raise RuntimeError(f"bench: {k} write at C={c} left wrong rows in the cache")
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)
                times[k].append((w_s, total_s))
        best_total = {k: n / min(t[1] for t in v) for k, v in times.items()}
        best_write = {k: n / min(t[0] for t in v) for k, v in times.items()}
        med_total = {k: n / statistics.median(t[1] for t in v) for k, v in times.items()}

        def per_round(i):  # shuffled rows/s over ordered rows/s, round by round (i: 0 without close, 1 with)
            return [o[i] / s[i] for o, s in zip(times["ordered"], times["shuffled"])]
        key = f"shuffled_vs_ordered_write_c{c}"
        floor = paired(per_round(1), FLOORS[key])
        res[f"c{c}"] = {"n": n, "c": c, "dtype": "float16", "batch": BATCH, "repeats": p["write_repeats"],
                        "rows_per_s_best_with_close": best_total, "rows_per_s_best_without_close": best_write,
                        "rows_per_s_median_with_close": med_total,
                        "seconds": {k: [list(t) for t in v] for k, v in times.items()},
                        key: floor["measured"], key + "_without_close": statistics.median(per_round(0)),
                        "paired": {key: floor}}
        del logits, orders
    return res


def write_order_section(res):
    """Section 3's table and note, from its result alone."""
    rows = []
    for r in res.values():
        n, c, key = r["n"], r["c"], f"shuffled_vs_ordered_write_c{r['c']}"
        med, best_write, f = r["rows_per_s_median_with_close"], r["rows_per_s_best_without_close"], r["paired"][key]
        rows.append([f"{n:,} x {c}", rate(med["ordered"]), rate(med["shuffled"]), shown(f),
                     rate(best_write["ordered"]), rate(best_write["shuffled"]), f"{r[key + '_without_close']:.2f}",
                     f["limit"], f["verdict"]])
    table = md_table(
        ["N x C (fp16)", "ordered rows/s", "shuffled rows/s", "shuffled/ordered",
         "ordered w/o close (best)", "shuffled w/o close (best)", "ratio w/o close", "floor", "verdict"], rows)
    note = (f"All rows through CacheWriter.write in batches of {BATCH} (each batch flushed: SWMR, durable), "
            f"from opening the writer to close() (which compacts into the key-ordered .h5); 'w/o close' stops "
            f"after the last write. {next(iter(res.values()))['repeats']} interleaved rounds (the side going first "
            f"alternates), a fresh cache directory each; rows/s with close are medians, the ratios medians of the "
            f"round-by-round ratios. The verdict uses the figure with close, decided on the paired ratios "
            f"(bench.paired).")
    return table, note


# -- 4. bytes per row ---------------------------------------------------------------------------
def codec_name(codec, dtype):
    return f"{codec}/{dtype}" if codec == "full" else codec


def topk_floor(codec):
    k = int(codec.split(":", 1)[1])
    return 4 * k + 8


def bench_bytes_per_row(root, p, rng):
    n = p["bytes_n"]
    codec_bytes, disk_bytes = {}, {}
    for c in BYTES_CLASSES:
        logits = teacher_logits(rng, n, c)
        for codec, dtype in CODECS:
            spec, path = build_cache(root, logits, codec=codec, dtype=dtype, tag=f"bytes c={c}")
            size = os.path.getsize(path + ".h5")
            os.unlink(path + ".h5")
            name = f"{codec_name(codec, dtype)}@C={c}"
            codec_bytes[name] = spec.make_codec().bytes_per_row
            disk_bytes[name] = size / n
        del logits
    return {"n": n, "bytes_per_row": codec_bytes, "bytes_per_row_on_disk": disk_bytes,
            "topk_floor": {f"{codec}@C={c}": topk_floor(codec) for c in BYTES_CLASSES
                           for codec, _ in CODECS if codec.startswith("topk:")}}


def bytes_per_row_section(res):
    """Section 4's table and note, from its result alone."""
    codec_bytes, disk_bytes, rows = res["bytes_per_row"], res["bytes_per_row_on_disk"], []
    for c in BYTES_CLASSES:
        for codec, dtype in CODECS:
            name = f"{codec_name(codec, dtype)}@C={c}"
            if codec.startswith("topk:"):
                fl = topk_floor(codec)
                floor, v = f"<= {fl}", (f"{verdict(codec_bytes[name], fl, False)} / "
                                        f"{verdict(disk_bytes[name], fl, False)}")
            else:
                floor, v = "-", "-"
            rows.append([c, codec_name(codec, dtype), codec_bytes[name], f"{disk_bytes[name]:.2f}",
                         f"{codec_bytes[name] / (4 * c):.3f}", floor, v])
    table = md_table(["C", "codec", "bytes/row (codec)", "bytes/row on disk", "codec vs fp32 full",
                      "floor (4K+8)", "verdict codec / disk"], rows)
    note = (f"On disk = size of a finished cache file of {res['n']:,} rows / rows; it adds the 1-byte 'done' flag "
            f"per row and the HDF5 metadata to the codec's bytes.")
    return table, note


# -- 6. a committed row's visibility to a reader ---------------------------------------------------
VISIBILITY_WRITER = """
import sys, time, numpy as np
from kdcache.store import CacheSpec, CacheWriter
spec = CacheSpec(num_samples=int(sys.argv[2]), num_classes=8, dtype="float32", inputs={"bench": "visibility"})
t0 = float(sys.argv[3])
with CacheWriter(sys.argv[1], spec) as w:
    for i in range(spec.num_samples):
        row = np.zeros((1, 8), np.float32)
        row[0, 0] = time.time() - t0  # when this row was handed to the writer
        w.write([i], row)
        time.sleep(0.01)
"""


def bench_visibility(root, p, kids):
    """How soon a row a producer process commits is visible to a reader in this process (its writer one of `kids`)."""
    n = p.get("visibility_rows", 200)
    spec = CacheSpec(num_samples=n, num_classes=8, dtype="float32", inputs={"bench": "visibility"})
    path = path_for(os.path.join(root, "visibility"), spec.fingerprint)
    t0 = time.time()
    writer = kids.start([sys.executable, "-c", VISIBILITY_WRITER, path, str(n), repr(t0)], "visibility writer",
                        timeout=300)
    lat = []
    deadline = time.monotonic() + 120
    try:
        while True:
            try:
                reader = CacheReader(path, spec=spec)
                break
            except CacheNotFoundError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.001)
        seen = np.zeros(n, dtype=bool)
        while not seen.all() and time.monotonic() < deadline:
            reader.refresh()
            new = np.flatnonzero(reader._done & ~seen)
            if new.size:
                now = time.time() - t0
                lat.extend((now - reader.get(new, wait=False)[:, 0]).tolist())
                seen[new] = True
            else:
                time.sleep(0.0002)
        reader.close()
    except BaseException:
        kids.stop_all()
        raise
    kids.finish(writer, json_line=False)
    lat_ms = np.array(lat) * 1000
    res = {"rows": int(lat_ms.size), "median_ms": float(np.median(lat_ms)), "p95_ms": float(np.percentile(lat_ms, 95)),
           "max_ms": float(lat_ms.max())}
    return res


def visibility_section(res):
    """Section 6's table and note, from its result alone."""
    table = md_table(["rows", "median ms", "p95 ms", "max ms"],
                     [[res["rows"], f"{res['median_ms']:.2f}", f"{res['p95_ms']:.2f}", f"{res['max_ms']:.2f}"]])
    note = ("A producer process commits one row every 10 ms (write, flush, then the committed-row count, "
            "flush); this process polls refresh() and measures from the row's hand-over to the writer until "
            "the reader sees it. Includes the writer's two flushes.")
    return table, note
