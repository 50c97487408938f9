"""Store benchmark sections that read: gather from RAM vs numpy, vs one file per sample, and out of core."""
import gc
import os
import shutil
import statistics
import tempfile
import time

import h5py
import numpy as np

from bench.common import md_table, rate
from bench.paired import paired, shown
from bench.store.write import BATCH, build_cache, teacher_logits
from kdcache.store import CacheReader

FLOORS = {"gather_vs_numpy": 0.5, "gather_vs_per_sample_files": 20.0}


def epoch_batches(rng, n, count, size=BATCH):
    """`count` batches of `size` sample indices, drawn as a trainer does: shuffled epochs back to back."""
    need = count * size
    order = np.concatenate([rng.permutation(n) for _ in range(-(-need // n))])
    return order[:need].reshape(count, size)


def timed_rounds(sides, repeats):
    """Run each side's callable `repeats` times, interleaved, rotating which side goes first.
    Returns {side: [seconds per run]}: run r of every side met the same load (bench.paired pairs them).
    The garbage collector is off inside each timed run."""
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
    reader = CacheReader(path, spec=spec, memory_budget=None, mmap=False)  # the map: bench.read_scale
    if reader.source != "ram":
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

    def per_round(base):  # kdcache's rows/s over the baseline's, round by round
        return [tb / tk for tk, tb in zip(times["kdcache"], times[base])]
    # The verdict compares with numpy fancy indexing of the very array the reader holds in RAM
    # (float32: a float16 cache is widened once when that fits the memory budget). Two other
    # baselines are printed: the stored float16 array (stricter: half the bytes to move, but no
    # float32 output) and that array converted per batch (the same output as reader.get).
    floor = paired(per_round("numpy_held"), FLOORS["gather_vs_numpy"])
    res = {"n": n, "c": c, "dtype": "float16", "batch": BATCH, "batches": int(batches.shape[0]),
           "repeats": p["gather_repeats"], "rows_per_s_best": rps, "rows_per_s_median": med,
           "us_per_batch_best": {k: 1e6 * min(t) / batches.shape[0] for k, t in times.items()},
           "seconds": times, "gather_vs_numpy": floor["measured"], "paired": {"gather_vs_numpy": floor},
           "gather_vs_numpy_float16_array": statistics.median(per_round("numpy_raw")),
           "gather_vs_numpy_f32": statistics.median(per_round("numpy_f32")),
           "held_dtype": str(held.dtype),
           "ratio_baseline": "numpy_held: arr[batch] on the array the reader holds in RAM"}
    return res, (spec, path, reader, batches, rps["kdcache"])


def gather_vs_numpy_section(res):
    """Section 1's table and note, from its result alone."""
    n, c, rps, held = res["n"], res["c"], res["rows_per_s_median"], res["held_dtype"]
    f = res["paired"]["gather_vs_numpy"]
    table = md_table(
        ["N x C (fp16)", "kdcache get", f"numpy held[b] ({held})", "numpy arr16[b]",
         "numpy arr16[b].astype(f32)", "gather_vs_numpy", "vs arr16[b]", "vs arr16[b].astype(f32)", "floor",
         "verdict"],
        [[f"{n:,} x {c}", rate(rps["kdcache"]), rate(rps["numpy_held"]), rate(rps["numpy_raw"]),
          rate(rps["numpy_f32"]), shown(f), f"{res['gather_vs_numpy_float16_array']:.2f}",
          f"{res['gather_vs_numpy_f32']:.2f}", f["limit"], f["verdict"]]])
    note = (f"rows/s; {res['batches']} random batches of {res['batch']} (shuffled epochs), medians of "
            f"{res['repeats']} interleaved rounds (the side going first rotates); each ratio is the median of the "
            f"round-by-round ratios, the verdict decided on them (bench.paired). gather_vs_numpy = reader.get vs "
            f"numpy fancy indexing of "
            f"the same array the reader holds in RAM ({held}: a float16 cache is widened once when that fits "
            f"the memory budget, so get() returns float32 with one gather). Also shown: vs indexing the stored "
            f"float16 array (no float32 output) and vs indexing it then converting to float32 (same output).")
    return table, note


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
    med = {"kdcache": batches.size / statistics.median(times["kdcache"]),
           "per_file": few.size / statistics.median(times["per_file"])}
    floor = paired([(batches.size / tk) / (few.size / tf) for tk, tf in zip(times["kdcache"], times["per_file"])],
                   FLOORS["gather_vs_per_sample_files"])
    res = {"n": n, "c": c, "dtype": "float16", "batch": BATCH, "batches_kdcache": int(batches.shape[0]),
           "batches_per_file": int(few.shape[0]), "repeats": p["files_repeats"], "rows_per_s_best": rps,
           "rows_per_s_median": med, "seconds": times, "per_file_write_s": write_s,
           "gather_vs_per_sample_files": floor["measured"], "paired": {"gather_vs_per_sample_files": floor},
           "page_cache": "warm (both sides)"}
    return res


def vs_per_sample_files_section(res):
    """Section 2's table and note, from its result alone."""
    n, c, rps, f = res["n"], res["c"], res["rows_per_s_median"], res["paired"]["gather_vs_per_sample_files"]
    few, many = res["batches_per_file"], res["batches_kdcache"]
    table = md_table(
        ["N x C (fp16)", "kdcache get rows/s", "one .npy per sample rows/s", "gather_vs_per_sample_files",
         "floor", "verdict"],
        [[f"{n:,} x {c}", rate(rps["kdcache"]), rate(rps["per_file"]), shown(f), f["limit"], f["verdict"]]])
    note = (f"rows/s, medians of {res['repeats']} interleaved rounds, the verdict on the round-by-round ratios "
            f"(bench.paired). Per-sample side: np.save of each float16 row ({n:,} files, written in "
            f"{res['per_file_write_s']:.1f} s), "
            f"np.load + np.stack + astype(float32) per batch, {few} batches; kdcache side: "
            f"{many} batches from the same seeded list (the first {few} are the "
            f"per-file batches). Both warm in the page cache (it cannot be dropped here). torchdistill "
            f"saved float32 .pt files with torch.save, which load slower than .npy.")
    return table, note


# -- 5. out-of-core gather ----------------------------------------------------------------------
def bench_out_of_core(p, gather_ctx):
    spec, path, _, batches, in_ram_rps = gather_ctx
    few = batches[:p["ooc_batches"]]
    with CacheReader(path, spec=spec, memory_budget=0, mmap=False) as reader:
        if reader.source != "disk":
            raise RuntimeError(f"bench: memory_budget=0 read the cache from {reader.source}, not per batch from disk")
        reader.get(few[0])  # warm-up: opens datasets, fills the page cache
        times = timed_rounds({"out_of_core": lambda: [reader.get(b) for b in few]}, p["ooc_repeats"])
    t = min(times["out_of_core"])
    rps = few.size / t
    res = {"n": spec.num_samples, "c": spec.num_classes, "batches": int(few.shape[0]),
           "repeats": p["ooc_repeats"], "rows_per_s_best": rps, "ms_per_batch_best": 1e3 * t / few.shape[0],
           "in_ram_rows_per_s": in_ram_rps, "in_ram_vs_out_of_core": in_ram_rps / rps}
    return res


def out_of_core_section(res):
    """Section 5's table and note, from its result alone."""
    table = md_table(["N x C (fp16)", "out-of-core rows/s", "ms / batch", "in-RAM rows/s (section 1)",
                      "in-RAM / out-of-core"],
                     [[f"{res['n']:,} x {res['c']}", rate(res["rows_per_s_best"]), f"{res['ms_per_batch_best']:.2f}",
                       rate(res["in_ram_rows_per_s"]), f"{res['in_ram_vs_out_of_core']:.0f}x"]])
    note = (f"CacheReader(memory_budget=0, mmap=False) on the finished .h5 of section 1, {res['batches']} of its "
            f"batches, best of {res['repeats']}; file warm in the page cache. Informative, no floor.")
    return table, note
