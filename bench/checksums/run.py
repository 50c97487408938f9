"""What the checksums of a finished cache cost: the run, its report and its tables (python -m bench.checksums)."""
import os
import sys

from bench.common import limit_threads

limit_threads(os.environ, force=False)  # before numpy loads: one BLAS/OpenMP thread

import statistics  # noqa: E402
import time  # noqa: E402
import zlib  # noqa: E402

import h5py  # noqa: E402
import numpy as np  # noqa: E402

from bench.cli import RUN, out_option, quick_option, tmp_option  # noqa: E402
from bench.common import heading, machine, machine_line, md_table, rate, section  # noqa: E402
from bench.paired import floors_table, paired, verdicts_line  # noqa: E402
from bench.read_scale.sections import evict, read_through  # noqa: E402
from bench.store.gather import timed_rounds  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402
from kdcache.store import CacheReader, CacheSpec, CacheWriter, path_for  # noqa: E402
from kdcache.store.format import checksums, schema  # noqa: E402
from kdcache.store.folder.verify import verify  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "checksums.json")
IMAGENET = 1_281_167
BATCH = 256
FLOORS = {"checked_vs_numpy_gather": (">=", 0.5)}
# Warm gathers: rounds of numpy, the checked cache and the one without checksums, interleaved (the side going first
# rotates); the floor is decided on the round-by-round ratios (bench.paired). A round is five epochs, about 1.3 s
# at 100,000 rows: 9 rounds (from nine pairs the median's interval leaves out the highest and lowest ratio).
ROUNDS, QUICK_ROUNDS = 9, 3
OPTIONS = [
    quick_option("20,000 rows instead of 100,000: a few seconds"),
    out_option(DEFAULT_OUT),
    tmp_option("work directory for the two caches (default: a new temporary directory, removed at the end; a "
               "directory given here is kept)"),
    Option("--rows", "samples in each cache (default 100,000; --quick 20,000)", type=Int(1000), metavar="N",
           group=RUN),
    Option("--classes", "logits per row (default 1000)", type=Int(3), default=1000, metavar="C", group=RUN),
    Option("--seed", "seed of the logits and the batches", type=Int(0), default=0, metavar="S", group=RUN),
]


def log(msg):
    print(f"[bench.checksums] {msg}", file=sys.stderr, flush=True)


def build(root, n, c, pool, with_sums):
    """A finished cache of n x c (full float16); compaction seconds. Without checksums: as compaction wrote
    before they existed."""
    spec = CacheSpec(num_samples=n, num_classes=c, dtype="float16",
                     inputs={"bench": "bench.checksums", "checksums": with_sums})
    path = path_for(root, spec.fingerprint)
    write, compute = checksums.write, checksums.compute
    if not with_sums:
        checksums.write = lambda *a, **k: None
        checksums.compute = lambda *a, **k: None
    try:
        w = CacheWriter(path, spec)
        for a in range(0, n, 8192):
            k = np.arange(a, min(n, a + 8192))
            w.write(k, pool[k % len(pool)])
        t0 = time.perf_counter()
        if not w.close():
            raise RuntimeError(f"bench: the cache at {path} did not finish")
        took = time.perf_counter() - t0
    finally:
        checksums.write, checksums.compute = write, compute
    if not with_sums:
        as_format_1(path + ".h5")  # a sealed file must hold checksums: this is the file before both existed
    return path, spec, took


def as_format_1(fin):
    """The finished file at `fin` rewritten as kdcache wrote it before seals and checksums (format version 1):
    no user block, text attributes as HDF5 strings, every dataset contiguous at a page boundary."""
    tmp = fin + ".v1"
    with h5py.File(fin, "r") as src, h5py.File(tmp, "w", alignment_threshold=64 << 10, alignment_interval=4096) as out:
        for k, v in src.attrs.items():
            out.attrs[k] = v.decode() if isinstance(v, bytes) else v
        out.attrs[schema.A_FORMAT] = 1
        for k in src:
            out.create_dataset(k, data=src[k][()])
    os.replace(tmp, fin)


def epoch(reader, order):
    t0 = time.perf_counter()
    for a in range(0, order.size, BATCH):
        reader.get(order[a:a + BATCH])
    return order.size / (time.perf_counter() - t0)


def best(f, repeats=3):
    return min(f() for _ in range(repeats))


def measure(args, n, c, root, rounds):
    rng = np.random.default_rng(args.seed)
    pool = rng.normal(0, 4, size=(4096, c)).astype(np.float32)
    out = {}
    log(f"writing two caches of {n:,} x {c} (full float16)")
    a_path, spec, comp_with = build(root, n, c, pool, True)
    b_path, _, comp_without = build(root, n, c, pool, False)
    size = os.path.getsize(a_path + ".h5")
    table = np.ascontiguousarray(pool[np.arange(n) % len(pool)].astype(np.float16))
    t0 = time.perf_counter()
    crc_sums = checksums.compute({"logits": table}, spec)
    crc_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    zlib.crc32(memoryview(table).cast("B"))
    crc_gbs = table.nbytes / (time.perf_counter() - t0) / 1e9
    with CacheReader(a_path) as r:
        chunks, samples = r._guard.sums.chunks, r._guard.sums.samples
    out["compaction"] = {"with_s": comp_with, "without_s": comp_without, "checksums_s": crc_s,
                         "crc32_gb_per_s": crc_gbs, "chunks": int(chunks), "samples_per_chunk": int(samples),
                         "table_bytes": int(crc_sums.nbytes)}

    log("open: lazy (first touch) vs every chunk at open, page cache warm")
    read_through(a_path + ".h5")

    def open_lazy():
        t0 = time.perf_counter()
        CacheReader(a_path).close()
        return time.perf_counter() - t0

    def open_all():
        t0 = time.perf_counter()
        with CacheReader(a_path) as r:
            r._check_sums(np.arange(0, n, samples))  # a key of every chunk: each is checked
            assert r._guard is None
        return time.perf_counter() - t0
    out["open"] = {"first_touch_s": best(open_lazy), "all_at_open_s": best(open_all)}

    log(f"warm gathers: {rounds} interleaved rounds")
    order = rng.permutation(n)
    ram = np.array(table)
    read_through(b_path + ".h5")
    runs = {k: [] for k in ("numpy_f32", "checked_first_epoch", "checked_next_epoch", "no_checksums_first_epoch",
                            "no_checksums_next_epoch")}

    def numpy_epoch():
        t0 = time.perf_counter()
        for a in range(0, n, BATCH):
            ram[order[a:a + BATCH]].astype(np.float32)
        runs["numpy_f32"].append(n / (time.perf_counter() - t0))

    def cache_epochs(name, path):
        def side():  # a fresh reader: its first epoch checks every chunk, the next one nothing
            with CacheReader(path) as r:
                runs[f"{name}_first_epoch"].append(epoch(r, order))
                runs[f"{name}_next_epoch"].append(epoch(r, order))
        return side
    timed_rounds({"numpy": numpy_epoch, "checked": cache_epochs("checked", a_path),
                  "no_checksums": cache_epochs("no_checksums", b_path)}, rounds)
    out["warm"] = {k: statistics.median(v) for k, v in runs.items()}  # rows/s, the medians of the rounds
    out["warm_runs"] = runs
    op, value = FLOORS["checked_vs_numpy_gather"]
    floor = paired([c / m for c, m in zip(runs["checked_next_epoch"], runs["numpy_f32"])], value,
                   higher_is_better=op == ">=")

    log("cold first epochs")
    cold = {}
    for name, path in (("checked", a_path), ("no_checksums", b_path)):
        resident = evict(path + ".h5")
        with CacheReader(path) as r:
            cold[name] = epoch(r, order)
        cold[f"{name}_resident_after_evict"] = resident
    evict(a_path + ".h5")
    t0 = time.perf_counter()
    with CacheReader(a_path) as r:
        r._check_sums(np.arange(0, n, samples))
        cold["all_at_open_s"] = time.perf_counter() - t0
        cold["checked_all_at_open_then_epoch"] = epoch(r, order)
    out["cold"] = cold

    log("verify")
    read_through(a_path + ".h5")
    t0 = time.perf_counter()
    rep, problems = verify(a_path)
    v_with = time.perf_counter() - t0
    assert not problems and rep["checksums"].startswith("crc32")
    t0 = time.perf_counter()
    rep, problems = verify(b_path)
    v_without = time.perf_counter() - t0
    assert not problems and rep["checksums"].startswith("no checksums")
    out["verify"] = {"with_s": v_with, "without_s": v_without}
    out["file_bytes"] = size
    out["checked_vs_numpy_gather"] = floor["measured"]
    out["paired"] = {"checked_vs_numpy_gather": floor}
    out["rounds"] = rounds
    return out


def tables(res, n):
    x = IMAGENET / n
    comp, op, warm, cold, ver = res["compaction"], res["open"], res["warm"], res["cold"], res["verify"]
    s = []
    s.append(("1. Compaction", md_table(
        ["", f"{n:,} rows", "ImageNet-1k (extrapolated)"],
        [["compaction, with checksums", f"{comp['with_s']:.2f} s", f"{comp['with_s'] * x:.1f} s"],
         ["compaction, without", f"{comp['without_s']:.2f} s", f"{comp['without_s'] * x:.1f} s"],
         ["of which the checksums (in memory)", f"{comp['checksums_s']:.3f} s", f"{comp['checksums_s'] * x:.2f} s"],
         ["zlib.crc32 speed", f"{comp['crc32_gb_per_s']:.1f} GB/s", ""],
         ["chunks (samples each), table bytes", f"{comp['chunks']} ({comp['samples_per_chunk']}), "
                                                f"{comp['table_bytes']}", f"{comp['table_bytes'] * x:,.0f} bytes"]]),
        "The checksums are computed from the rows in memory just before the file is written."))
    s.append(("2. Open (page cache warm)", md_table(
        ["reader", f"{n:,} rows", "ImageNet-1k (extrapolated)"],
        [["mapped, chunks checked on first touch (kept)", f"{op['first_touch_s'] * 1e3:.1f} ms",
          f"{op['first_touch_s'] * 1e3:.1f} ms (does not grow)"],
         ["mapped, every chunk checked at open", f"{op['all_at_open_s']:.3f} s", f"{op['all_at_open_s'] * x:.2f} s"]]),
        "Checking at open reads every page of the file before the first batch."))
    s.append(("3. Gathers of 256 random rows, page cache warm (rows/s)", md_table(
        ["cache", "first epoch", "next epoch"],
        [["with checksums (first touch)", rate(warm["checked_first_epoch"]), rate(warm["checked_next_epoch"])],
         ["without checksums", rate(warm["no_checksums_first_epoch"]), rate(warm["no_checksums_next_epoch"])],
         ["numpy, float16 array in RAM, to float32", rate(warm["numpy_f32"]), ""]]),
        "The first epoch checks every chunk once; afterwards the reader drops the check."
        + (f" Medians of {res['rounds']} interleaved rounds, each a fresh reader of each cache and an epoch of numpy "
           f"(the side going first rotates)." if "rounds" in res else "")))
    s.append(("4. First epoch after the pages were dropped (rows/s)", md_table(
        ["cache", "first epoch", f"check at open ({n:,} rows)", "ImageNet-1k (extrapolated)"],
        [["with checksums (first touch)", rate(cold["checked"]), "", ""],
         ["without checksums", rate(cold["no_checksums"]), "", ""],
         ["with checksums, every chunk at open", rate(cold["checked_all_at_open_then_epoch"]),
          f"{cold['all_at_open_s']:.2f} s", f"{cold['all_at_open_s'] * x:.1f} s"]]),
        "Dropped with fsync + POSIX_FADV_DONTNEED. A chunk checked on first touch is read whole (about 1 MiB)."))
    s.append(("5. kdcache verify", md_table(
        ["cache", f"{n:,} rows", "ImageNet-1k (extrapolated)"],
        [["with checksums", f"{ver['with_s']:.2f} s", f"{ver['with_s'] * x:.1f} s"],
         ["without", f"{ver['without_s']:.2f} s", f"{ver['without_s'] * x:.1f} s"]]),
        "Page cache warm; verify also scans every value for NaN/Inf and identical rows."))
    if "paired" in res:  # a report from before the floor was paired did not show it
        s.append(("6. Floor, on paired rounds", floors_table(res["paired"], {
            "checked_vs_numpy_gather": "next epoch with checksums / numpy float16 array to float32 (warm gathers)"}),
            "The median of the round-by-round ratios ±its spread, each round's ratio in brackets; the verdict is "
            "decided on them (bench.paired: a floor nearer 1 than the spread is UNMEASURABLE)."))
    return s


def render(report):
    """[(title, markdown table)] of a report: what main prints, for bench.docs."""
    return [(title, table) for title, table, _ in tables(report, report["rows"])]


def params(ap, args):
    return {"rows": args.rows or (20_000 if args.quick else 100_000), "classes": args.classes,
            "rounds": QUICK_ROUNDS if args.quick else ROUNDS}


def run(kids, args, p, work):
    n = p["rows"]
    res = measure(args, n, p["classes"], work, p["rounds"])
    verdicts = {k: f["verdict"] for k, f in res["paired"].items()}
    return {**res, "rows": n, "classes": p["classes"], "imagenet_rows": IMAGENET, "extrapolation": IMAGENET / n,
            "floors": {k: {"op": op, "value": v} for k, (op, v) in FLOORS.items()}, "verdicts": verdicts,
            "machine": machine(), "quick": bool(args.quick), "seed": args.seed}


def show(report):
    print(heading("kdcache: what checksums cost", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    for title, table, note in tables(report, report["rows"]):
        print(section(title, table, note))
    print(verdicts_line(report["verdicts"]))
