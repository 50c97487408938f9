"""Store micro-benchmarks: gathers, write order and bytes per row, each beside its baseline.

    PYTHONPATH=. python -m bench.store [--quick] [--out bench/results/store.json] [--tmp DIR]

Every comparison runs both sides in the same process, interleaved (the side that goes first
rotates each repeat), and keeps the best of the repeats, so machine noise hits both sides.
Sections, with the floors the store was built to meet:

1. gather from a cache held in RAM vs numpy fancy indexing on the same array  (ratio >= 0.5)
2. gather vs one .npy file per sample, torchdistill's old layout              (ratio >= 20)
3. writes in shuffled training order vs in index order, C=10 and C=1000       (ratio >= 0.5)
4. bytes per row of each codec, from the codec and measured on disk         (topk:K <= 4K+8)
5. gather from disk (memory_budget=0), informative only
"""
import os
import sys

if __package__ in (None, ""):  # run as a file (python bench/store.py): import the repo's store/, not this module
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import limit_threads  # noqa: E402

# Before numpy loads: one BLAS/OpenMP thread, so the figures do not depend on the core count.
limit_threads(os.environ, force=False)

import argparse  # noqa: E402
import gc  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import (Children, floors_line, heading, machine, machine_line, make_log, md_table,  # noqa: E402
                          rate, scratch_dir, section, utc_now, verdict, write_report)
from store import CacheNotFoundError, CacheReader, CacheSpec, CacheWriter, path_for  # noqa: E402

BATCH = 256
DEFAULT_OUT = os.path.join("bench", "results", "store.json")

# Sizes: full run (~1 min on 2 cores) and --quick (~15 s).
FULL = dict(gather_n=200_000, gather_batches=2000, gather_repeats=5,
            files_n=20_000, files_batches=50, files_repeats=3,
            write_n={10: 100_000, 1000: 20_000}, write_repeats=5,
            bytes_n=20_000, ooc_batches=200, ooc_repeats=3)
QUICK = dict(gather_n=50_000, gather_batches=1000, gather_repeats=3,
             files_n=5_000, files_batches=20, files_repeats=2,
             write_n={10: 20_000, 1000: 4_000}, write_repeats=3,
             bytes_n=4_000, ooc_batches=50, ooc_repeats=2)

FLOORS = {
    "gather_vs_numpy": 0.5,
    "gather_vs_per_sample_files": 20.0,
    "shuffled_vs_ordered_write_c10": 0.5,
    "shuffled_vs_ordered_write_c1000": 0.5,
}
CODECS = [("full", "float16"), ("full", "float32"), ("topk:5", "float16"), ("topk:10", "float16")]
BYTES_CLASSES = (100, 1000)


log = make_log("bench.store")


# -- helpers ------------------------------------------------------------------------------------
def teacher_logits(rng, n, c):
    """Synthetic raw logits [n, c] float32, spread like a trained classifier's (std 3)."""
    return rng.standard_normal((n, c), dtype=np.float32) * np.float32(3.0)


def epoch_batches(rng, n, count, size=BATCH):
    """`count` batches of `size` sample indices, drawn as a trainer does: shuffled epochs back to back."""
    need = count * size
    order = np.concatenate([rng.permutation(n) for _ in range(-(-need // n))])
    return order[:need].reshape(count, size)


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


def timed_rounds(sides, repeats):
    """Run each side's callable `repeats` times, interleaved, rotating which side goes first.
    Returns {side: [seconds per run]}. The garbage collector is off inside each timed run."""
    names = list(sides)
    times = {k: [] for k in names}
    for r in range(repeats):
        s = r % len(names)
        for k in names[s:] + names[:s]:
            gc.collect()
            gc.disable()
            try:
                t0 = time.perf_counter()
                sides[k]()
                times[k].append(time.perf_counter() - t0)
            finally:
                gc.enable()
    return times


# -- 1. gather vs numpy -----------------------------------------------------------------------
def bench_gather_vs_numpy(root, p, rng):
    n, c = p["gather_n"], 100
    logits = teacher_logits(rng, n, c)
    spec, path = build_cache(root, logits, tag="gather")
    del logits
    reader = CacheReader(path, spec=spec, memory_budget=None)
    if not reader.in_ram:
        raise RuntimeError(f"bench: the reader did not hold the {n}x{c} cache in RAM; free some memory")
    with h5py.File(path + ".h5", "r") as f:  # the same rows, as one plain numpy array in RAM
        arr = np.ascontiguousarray(f["logits"][:, 0, :])
    batches = epoch_batches(rng, n, p["gather_batches"])
    for b in batches[:3]:
        if not np.array_equal(reader.get(b), arr[b].astype(np.float32)):
            raise RuntimeError("bench: reader.get() and numpy disagree on the same rows")

    def kdcache():
        for b in batches:
            reader.get(b)

    def numpy_f32():
        for b in batches:
            arr[b].astype(np.float32)

    def numpy_raw():
        for b in batches:
            arr[b]

    held = reader._tables["logits"]  # the array the reader holds in RAM (float32 once widened)

    def numpy_held():
        for b in batches:
            held[b]

    sides = {"kdcache": kdcache, "numpy_held": numpy_held, "numpy_f32": numpy_f32, "numpy_raw": numpy_raw}
    timed_rounds(sides, 1)  # warm-up
    times = timed_rounds(sides, p["gather_repeats"])
    rows = batches.size
    rps = {k: rows / min(t) for k, t in times.items()}
    med = {k: rows / statistics.median(t) for k, t in times.items()}
    # The verdict compares with numpy fancy indexing of the very array the reader holds in RAM
    # (float32: a float16 cache is widened once when that fits the memory budget). Two other
    # baselines are printed: the stored float16 array (stricter: half the bytes to move, but no
    # float32 output) and that array converted per batch (the same output as reader.get).
    ratio = rps["kdcache"] / rps["numpy_held"]
    raw16 = rps["kdcache"] / rps["numpy_raw"]
    f32 = rps["kdcache"] / rps["numpy_f32"]
    res = {"n": n, "c": c, "dtype": "float16", "batch": BATCH, "batches": int(batches.shape[0]),
           "repeats": p["gather_repeats"], "rows_per_s_best": rps, "rows_per_s_median": med,
           "us_per_batch_best": {k: 1e6 * min(t) / batches.shape[0] for k, t in times.items()},
           "gather_vs_numpy": ratio, "gather_vs_numpy_float16_array": raw16, "gather_vs_numpy_f32": f32,
           "held_dtype": str(held.dtype),
           "ratio_baseline": "numpy_held: arr[batch] on the array the reader holds in RAM"}
    table = md_table(
        ["N x C (fp16)", "kdcache get", f"numpy held[b] ({held.dtype})", "numpy arr16[b]",
         "numpy arr16[b].astype(f32)", "gather_vs_numpy", "vs arr16[b]", "vs arr16[b].astype(f32)", "floor",
         "verdict"],
        [[f"{n:,} x {c}", rate(rps["kdcache"]), rate(rps["numpy_held"]), rate(rps["numpy_raw"]),
          rate(rps["numpy_f32"]), f"{ratio:.2f}", f"{raw16:.2f}", f"{f32:.2f}", f">= {FLOORS['gather_vs_numpy']}",
          verdict(ratio, FLOORS["gather_vs_numpy"])]])
    note = (f"rows/s; {batches.shape[0]} random batches of {BATCH} (shuffled epochs), best of "
            f"{p['gather_repeats']} interleaved runs. gather_vs_numpy = reader.get vs numpy fancy indexing of "
            f"the same array the reader holds in RAM ({held.dtype}: a float16 cache is widened once when that fits "
            f"the memory budget, so get() returns float32 with one gather). Also shown: vs indexing the stored "
            f"float16 array (no float32 output) and vs indexing it then converting to float32 (same output).")
    return res, table, note, (spec, path, reader, batches, rps["kdcache"])


# -- 2. gather vs one file per sample ------------------------------------------------------------
def bench_vs_per_sample_files(root, p, rng):
    n, c = p["files_n"], 100
    logits = teacher_logits(rng, n, c)
    spec, path = build_cache(root, logits, tag="files")
    reader = CacheReader(path, spec=spec, memory_budget=None)
    rows16 = logits.astype(np.float16)  # the very rows the cache holds, one file each
    del logits
    fdir = tempfile.mkdtemp(prefix="per-sample-", dir=root)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            np.save(os.path.join(fdir, f"{i}.npy"), rows16[i])
        write_s = time.perf_counter() - t0
        del rows16
        batches = epoch_batches(rng, n, p["gather_batches"])
        few = batches[:p["files_batches"]]

        def load(b):
            return np.stack([np.load(os.path.join(fdir, f"{i}.npy")) for i in b]).astype(np.float32)

        for b in few[:2]:
            if not np.array_equal(reader.get(b), load(b)):
                raise RuntimeError("bench: reader.get() and the per-sample files disagree")

        def kdcache():
            for b in batches:
                reader.get(b)

        def per_file():
            for b in few:
                load(b)

        timed_rounds({"kdcache": kdcache, "per_file": per_file}, 1)  # warm-up
        times = timed_rounds({"kdcache": kdcache, "per_file": per_file}, p["files_repeats"])
    finally:
        shutil.rmtree(fdir, ignore_errors=True)
        reader.close()
        os.unlink(path + ".h5")
    rps = {"kdcache": batches.size / min(times["kdcache"]), "per_file": few.size / min(times["per_file"])}
    ratio = rps["kdcache"] / rps["per_file"]
    res = {"n": n, "c": c, "dtype": "float16", "batch": BATCH, "batches_kdcache": int(batches.shape[0]),
           "batches_per_file": int(few.shape[0]), "repeats": p["files_repeats"], "rows_per_s_best": rps,
           "per_file_write_s": write_s, "gather_vs_per_sample_files": ratio, "page_cache": "warm (both sides)"}
    table = md_table(
        ["N x C (fp16)", "kdcache get rows/s", "one .npy per sample rows/s", "gather_vs_per_sample_files",
         "floor", "verdict"],
        [[f"{n:,} x {c}", rate(rps["kdcache"]), rate(rps["per_file"]), f"{ratio:.0f}",
          f">= {FLOORS['gather_vs_per_sample_files']:.0f}", verdict(ratio, FLOORS["gather_vs_per_sample_files"])]])
    note = (f"Per-sample side: np.save of each float16 row ({n:,} files, written in {write_s:.1f} s), "
            f"np.load + np.stack + astype(float32) per batch, {few.shape[0]} batches; kdcache side: "
            f"{batches.shape[0]} batches from the same seeded list (the first {few.shape[0]} are the "
            f"per-file batches). Both warm in the page cache (it cannot be dropped here). torchdistill "
            f"saved float32 .pt files with torch.save, which load slower than .npy.")
    return res, table, note


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
    res, rows = {}, []
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
        ratio = best_total["shuffled"] / best_total["ordered"]
        ratio_nc = best_write["shuffled"] / best_write["ordered"]
        key = f"shuffled_vs_ordered_write_c{c}"
        res[f"c{c}"] = {"n": n, "c": c, "dtype": "float16", "batch": BATCH, "repeats": p["write_repeats"],
                        "rows_per_s_best_with_close": best_total, "rows_per_s_best_without_close": best_write,
                        "seconds": {k: [list(t) for t in v] for k, v in times.items()},
                        key: ratio, key + "_without_close": ratio_nc}
        rows.append([f"{n:,} x {c}", rate(best_total["ordered"]), rate(best_total["shuffled"]), f"{ratio:.2f}",
                     rate(best_write["ordered"]), rate(best_write["shuffled"]), f"{ratio_nc:.2f}",
                     f">= {FLOORS[key]}", verdict(ratio, FLOORS[key])])
        del logits, orders
    table = md_table(
        ["N x C (fp16)", "ordered rows/s", "shuffled rows/s", "shuffled/ordered",
         "ordered w/o close", "shuffled w/o close", "ratio w/o close", "floor", "verdict"], rows)
    note = (f"All rows through CacheWriter.write in batches of {BATCH} (each batch flushed: SWMR, durable), "
            f"from opening the writer to close() (which compacts into the key-ordered .h5); 'w/o close' stops "
            f"after the last write. Best of {p['write_repeats']} interleaved runs, a fresh cache directory each. "
            f"The verdict uses the figure with close.")
    return res, table, note


# -- 4. bytes per row ---------------------------------------------------------------------------
def codec_name(codec, dtype):
    return f"{codec}/{dtype}" if codec == "full" else codec


def topk_floor(codec):
    k = int(codec.split(":", 1)[1])
    return 4 * k + 8


def bench_bytes_per_row(root, p, rng):
    n = p["bytes_n"]
    codec_bytes, disk_bytes, rows = {}, {}, []
    for c in BYTES_CLASSES:
        logits = teacher_logits(rng, n, c)
        for codec, dtype in CODECS:
            spec, path = build_cache(root, logits, codec=codec, dtype=dtype, tag=f"bytes c={c}")
            size = os.path.getsize(path + ".h5")
            os.unlink(path + ".h5")
            name = f"{codec_name(codec, dtype)}@C={c}"
            codec_bytes[name] = spec.make_codec().bytes_per_row
            disk_bytes[name] = size / n
            if codec.startswith("topk:"):
                fl = topk_floor(codec)
                floor, v = f"<= {fl}", (f"{verdict(codec_bytes[name], fl, False)} / "
                                        f"{verdict(disk_bytes[name], fl, False)}")
            else:
                floor, v = "-", "-"
            rows.append([c, codec_name(codec, dtype), codec_bytes[name], f"{disk_bytes[name]:.2f}",
                         f"{codec_bytes[name] / (4 * c):.3f}", floor, v])
        del logits
    table = md_table(["C", "codec", "bytes/row (codec)", "bytes/row on disk", "codec vs fp32 full",
                      "floor (4K+8)", "verdict codec / disk"], rows)
    note = (f"On disk = size of a finished cache file of {n:,} rows / rows; it adds the 1-byte 'done' flag "
            f"per row and the HDF5 metadata to the codec's bytes.")
    res = {"n": n, "bytes_per_row": codec_bytes, "bytes_per_row_on_disk": disk_bytes,
           "topk_floor": {f"{codec}@C={c}": topk_floor(codec) for c in BYTES_CLASSES
                          for codec, _ in CODECS if codec.startswith("topk:")}}
    return res, table, note


# -- 5. out-of-core gather ----------------------------------------------------------------------
def bench_out_of_core(p, gather_ctx):
    spec, path, _, batches, in_ram_rps = gather_ctx
    few = batches[:p["ooc_batches"]]
    with CacheReader(path, spec=spec, memory_budget=0) as reader:
        if reader.in_ram:
            raise RuntimeError("bench: memory_budget=0 still held the cache in RAM")
        reader.get(few[0])  # warm-up: opens datasets, fills the page cache
        times = timed_rounds({"out_of_core": lambda: [reader.get(b) for b in few]}, p["ooc_repeats"])
    t = min(times["out_of_core"])
    rps = few.size / t
    res = {"n": spec.num_samples, "c": spec.num_classes, "batches": int(few.shape[0]),
           "repeats": p["ooc_repeats"], "rows_per_s_best": rps, "ms_per_batch_best": 1e3 * t / few.shape[0],
           "in_ram_rows_per_s": in_ram_rps, "in_ram_vs_out_of_core": in_ram_rps / rps}
    table = md_table(["N x C (fp16)", "out-of-core rows/s", "ms / batch", "in-RAM rows/s (section 1)",
                      "in-RAM / out-of-core"],
                     [[f"{spec.num_samples:,} x {spec.num_classes}", rate(rps), f"{1e3 * t / few.shape[0]:.2f}",
                       rate(in_ram_rps), f"{in_ram_rps / rps:.0f}x"]])
    note = (f"CacheReader(memory_budget=0) on the finished .h5 of section 1, {few.shape[0]} of its batches, "
            f"best of {p['ooc_repeats']}; file warm in the page cache. Informative, no floor.")
    return res, table, note


# -- main ---------------------------------------------------------------------------------------
VISIBILITY_WRITER = """
import sys, time, numpy as np
from store import CacheSpec, CacheWriter
spec = CacheSpec(num_samples=int(sys.argv[2]), num_classes=8, dtype="float32", inputs={"bench": "visibility"})
t0 = float(sys.argv[3])
with CacheWriter(sys.argv[1], spec) as w:
    for i in range(spec.num_samples):
        row = np.zeros((1, 8), np.float32)
        row[0, 0] = time.time() - t0  # when this row was handed to the writer
        w.write([i], row)
        time.sleep(0.01)
"""


def bench_visibility(root, p):
    """How soon a row a producer process commits is visible to a reader in this process."""
    n = p.get("visibility_rows", 200)
    spec = CacheSpec(num_samples=n, num_classes=8, dtype="float32", inputs={"bench": "visibility"})
    path = path_for(os.path.join(root, "visibility"), spec.fingerprint)
    t0 = time.time()
    kids = Children()
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
    table = md_table(["rows", "median ms", "p95 ms", "max ms"],
                     [[res["rows"], f"{res['median_ms']:.2f}", f"{res['p95_ms']:.2f}", f"{res['max_ms']:.2f}"]])
    note = ("A producer process commits one row every 10 ms (write, flush, then the committed-row count, "
            "flush); this process polls refresh() and measures from the row's hand-over to the writer until "
            "the reader sees it. Includes the writer's two flushes.")
    return res, table, note


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.store",
        description="kdcache store benchmarks: gather vs numpy and vs one file per sample, shuffled vs "
                    "ordered writes, bytes per row, out-of-core gather. Prints markdown tables and "
                    "writes a JSON report.")
    ap.add_argument("--quick", action="store_true", help="smaller sizes, under a minute (figures are noisier)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON report path (default {DEFAULT_OUT})")
    ap.add_argument("--tmp", default=None,
                    help="directory for the temporary caches and files (default: the system temp dir); "
                         "everything written there is removed at the end")
    ap.add_argument("--seed", type=int, default=0, help="seed of the synthetic logits and batches (default 0)")
    args = ap.parse_args(argv)

    p = QUICK if args.quick else FULL
    rng = np.random.default_rng(args.seed)
    m = machine()
    t_start = time.perf_counter()
    root = scratch_dir(args.tmp, "kdcache-bench-store-")
    sections = []
    try:
        log(f"{'quick' if args.quick else 'full'} run, temp dir {root}")
        log("1/6 gather vs numpy")
        r1, t1, n1, ctx = bench_gather_vs_numpy(root, p, rng)
        sections.append(("1. Gather from a cache in RAM vs numpy fancy indexing", t1, n1))
        log("2/6 gather vs one file per sample")
        r2, t2, n2 = bench_vs_per_sample_files(root, p, rng)
        sections.append(("2. Gather vs one .npy file per sample (torchdistill's old layout)", t2, n2))
        log("3/6 shuffled vs ordered writes")
        r3, t3, n3 = bench_write_order(root, p, rng)
        sections.append(("3. Writes in shuffled training order vs index order", t3, n3))
        log("4/6 bytes per row")
        r4, t4, n4 = bench_bytes_per_row(root, p, rng)
        sections.append(("4. Bytes per row by codec", t4, n4))
        log("5/6 out-of-core gather")
        r5, t5, n5 = bench_out_of_core(p, ctx)
        sections.append(("5. Out-of-core gather (memory_budget=0)", t5, n5))
        ctx[2].close()
        log("6/6 visibility of new rows to a live reader")
        r6, t6, n6 = bench_visibility(root, p)
        sections.append(("6. A committed row becomes visible to a reader", t6, n6))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runtime = time.perf_counter() - t_start

    ratios = {
        "gather_vs_numpy": r1["gather_vs_numpy"],
        "gather_vs_per_sample_files": r2["gather_vs_per_sample_files"],
        "shuffled_vs_ordered_write_c10": r3["c10"]["shuffled_vs_ordered_write_c10"],
        "shuffled_vs_ordered_write_c1000": r3["c1000"]["shuffled_vs_ordered_write_c1000"],
    }
    verdicts = {k: verdict(v, FLOORS[k]) for k, v in ratios.items()}
    for name, b in r4["bytes_per_row"].items():
        codec = name.split("@")[0]
        if codec.startswith("topk:"):
            verdicts[f"bytes_per_row {name}"] = verdict(b, topk_floor(codec), False)
    floors = {k: {"op": ">=", "value": v} for k, v in FLOORS.items()}
    floors.update({f"bytes_per_row {k}": {"op": "<=", "value": v} for k, v in r4["topk_floor"].items()})
    report = {
        **ratios,
        "gather_vs_numpy_f32": r1["gather_vs_numpy_f32"],
        "gather_vs_numpy_float16_array": r1["gather_vs_numpy_float16_array"],
        "bytes_per_row": r4["bytes_per_row"],
        "bytes_per_row_on_disk": r4["bytes_per_row_on_disk"],
        "visibility_ms": {"median": r6["median_ms"], "p95": r6["p95_ms"], "max": r6["max_ms"]},
        "rows_per_s": {
            "gather_kdcache": r1["rows_per_s_best"]["kdcache"],
            "gather_numpy_f32": r1["rows_per_s_best"]["numpy_f32"],
            "gather_numpy_raw": r1["rows_per_s_best"]["numpy_raw"],
            "files_kdcache": r2["rows_per_s_best"]["kdcache"],
            "files_per_sample": r2["rows_per_s_best"]["per_file"],
            **{f"write_c{c}_{k}": v for c in p["write_n"]
               for k, v in r3[f"c{c}"]["rows_per_s_best_with_close"].items()},
            **{f"write_c{c}_{k}_without_close": v for c in p["write_n"]
               for k, v in r3[f"c{c}"]["rows_per_s_best_without_close"].items()},
            "gather_out_of_core": r5["rows_per_s_best"],
        },
        "floors": floors,
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()),
        "sections": {"gather_vs_numpy": r1, "gather_vs_per_sample_files": r2, "write_order": r3,
                     "bytes_per_row": r4, "out_of_core": r5, "visibility": r6},
        "machine": m,
        "date": utc_now(),
        "quick": bool(args.quick),
        "seed": args.seed,
        "runtime_s": runtime,
    }

    print(heading("kdcache store benchmark", args.quick, runtime))
    print(machine_line(m) + "\n")
    for title, table, note in sections:
        print(section(title, table, note))
    print(floors_line([k for k, v in verdicts.items() if v != "PASS"]))

    write_report(args.out, report)
    print(f"Report: {args.out}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
