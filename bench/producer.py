"""Producer benchmarks: the cache builder's rows/s beside the bare teacher forward, and two shards vs one.

    PYTHONPATH=. python -m bench.producer [--quick] [--out bench/results/producer.json] [--tmp DIR]

This process never imports MXNet. Every MXNet process is a child started with
OMP_NUM_THREADS=1 (the only knob that limits MXNet's compute threads, and it must be set
before `import mxnet`), so no side gets more cores than the other. The teacher is a small
Gluon CNN built and exported here (explicit prefix, fixed seed); the data set is `synthetic`.

1. Producer overhead: `python -m cache_builder --threads 1` filling a fresh cache offline vs a
   bare loop of the same teacher over the same batches in key order (make_views + forward, no
   store), both in a fresh child process. Both sides time only their work loop (the CLI's
   reported rows_per_s; the bare loop times itself the same way, after the same warm-up), so
   process start-up, the MXNet import and the data set load are left out. Interleaved, best
   of the repeats.                                                       floor: ratio >= 0.9
2. Two shards on two cores, on a data set in an .npz file: `--shards 2` (one command that forks
   two shard processes after loading; the verdict) and two producers (`--shard 0/2`,
   `--shard 1/2`, one thread each) started at once on a fresh cache vs one producer: wall time
   from start to the end of both
   processes (start-up and compaction included on both sides), and the aggregate of the rows/s
   each process reports. The 2-shard cache must be complete and hold the single producer's
   logits (within one float16 step; bitwise identity is reported too).  floor: ratio >= 1.6
3. Size of the finished cache and the teacher's forward time per batch (informative).

Each run also records how many cores other processes kept busy meanwhile (/proc/stat minus this
benchmark's own CPU time), so a report taken on a shared machine says how shared it was.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import (Children, busy_warning, cpu_between, cpu_snapshot, floors_line, heading,  # noqa: E402
                          machine, machine_line, make_log, md_table, python_m, rate, scratch_dir, section,
                          spread, utc_now, verdict, write_report)

DEFAULT_OUT = os.path.join("bench", "results", "producer.json")
THREADS = 1
CLASSES = 10
SHAPE = "3x32x32"
TEACHER_WIDTHS = (32, 32, 64, 64)  # ~30 ms per forward of 128 images on one thread here

# Sizes: full run (~4 min on 2 cores) and --quick (~1 min). Section 2 reads shard_n rows from
# an .npz file: enough work that the ~2.5 s start-up of a process (MXNet import, data load and
# digest, teacher load) is a small part of the wall time, as it is for any real data set.
FULL = dict(n=8000, shard_n=160000, batch=128, overhead_repeats=3, shard_repeats=3)
QUICK = dict(n=3000, shard_n=3000, batch=128, overhead_repeats=3, shard_repeats=1)

FLOORS = {"producer_vs_bare_forward": 0.9, "two_shards_vs_one": 1.6, "two_shards_vs_one_aggregate": 1.6}


log = make_log("bench.producer")


# -- children (each its own process, OMP_NUM_THREADS fixed by the parent) ----------------------
def child_export(prefix):
    """Build the benchmark's teacher and export it: PREFIX-symbol.json, PREFIX-0000.params."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    np.random.seed(0)
    net = gluon.nn.HybridSequential(prefix="benchteacher_")  # explicit: same files every run
    with net.name_scope():
        for w in TEACHER_WIDTHS:
            net.add(gluon.nn.Conv2D(w, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                    gluon.nn.Activation("relu"), gluon.nn.MaxPool2D(2))
        net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1,) + tuple(int(s) for s in SHAPE.split("x")))).wait_to_read()
    net.export(prefix, 0)
    params = sum(int(np.prod(p.shape)) for p in net.collect_params().values())
    print(json.dumps({"prefix": prefix, "parameters": params}))


def child_bare(prefix, dataset_arg, batch):
    """The teacher alone over every sample in key order, the loop produce_offline runs minus the store.

    Set-up mirrors `python -m cache_builder`: load the data set, load the teacher, one probe
    forward of two samples; then only the loop is timed, as produce_offline times its loop.
    """
    from pipeline.teacher import Teacher
    from pipeline.augment import Augment, make_views
    from pipeline.datasets import load_dataset
    dataset = load_dataset(dataset_arg)
    teacher = Teacher(prefix, batch_size=batch)
    x, _ = dataset.get_batch([0, min(1, len(dataset) - 1)])
    teacher.forward(x)
    keys = np.arange(len(dataset), dtype=np.int64)  # views=1: flat key = sample index
    augment = Augment()
    views_s, forward_s = [], []
    t0 = time.perf_counter()
    for a in range(0, keys.size, batch):
        idx = keys[a:a + batch]
        t1 = time.perf_counter()
        x, _ = make_views(dataset, idx, idx % 1, seed=0, augment=augment)
        t2 = time.perf_counter()
        teacher.forward(x)
        forward_s.append(time.perf_counter() - t2)
        views_s.append(t2 - t1)
    seconds = time.perf_counter() - t0
    full = [t for t, a in zip(forward_s, range(0, keys.size, batch)) if keys.size - a >= batch] or forward_s
    print(json.dumps({"rows": int(keys.size), "seconds": seconds, "rows_per_s": keys.size / seconds,
                      "forward_ms_per_batch_median": 1e3 * statistics.median(full),
                      "forward_ms_per_batch_min": 1e3 * min(full),
                      "make_views_ms_per_batch_median": 1e3 * statistics.median(views_s),
                      "full_batches": len(full)}))


# -- the parent: runs children, compares ---------------------------------------------------------
def producer_argv(prefix, dataset_arg, cache_dir, batch, shard="0/1", shards=None):
    """dataset_arg: a --dataset value, or an .npz path (a data set on disk, as users' are)."""
    data = ["--dataset", "npz", "--data-root", dataset_arg] if dataset_arg.endswith(".npz") else \
        ["--dataset", dataset_arg]
    return python_m("cache_builder", "--teacher", prefix, *data, "--cache-dir", cache_dir, "--batch-size", batch,
                    "--threads", THREADS, *(["--shards", shards] if shards else ["--shard", shard]), "--json",
                    "--quiet")


def bare_argv(prefix, dataset_arg, batch):
    return python_m("bench.producer", "--child", "bare", "--teacher", prefix, "--dataset", dataset_arg,
                    "--batch-size", batch)


def read_cache(path):
    """(logits [N, V, C] as stored, complete flag, every row marked done) of a finished cache."""
    import h5py
    with h5py.File(path, "r") as f:
        return f["logits"][...], int(f.attrs.get("complete", 0)) == 1, bool(np.all(f["done"][...] == 1))


def compare_logits(a, b):
    """Bitwise and within-one-float16-step equality of two stored logit arrays.

    The teacher's kernels (oneDNN) give a row last-bit different float32 logits depending on
    its position in the batch, and shards batch other keys together, so a row can round to the
    neighbouring float16 value. One float16 step (np.spacing at the row's magnitude) is the
    tolerance; anything larger is a wrong row.
    """
    if a.shape != b.shape:
        return {"identical": False, "equal": False, "rows_differing": None, "max_abs_diff": None,
                "max_diff_in_float16_steps": None}
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    diff = np.abs(a32 - b32)
    step = np.spacing(np.maximum(np.abs(a), np.abs(b)).astype(np.float16)).astype(np.float32)
    steps = float((diff / step).max()) if diff.size else 0.0
    rows = diff.reshape(diff.shape[0] * diff.shape[1], -1).max(axis=1) > 0 if diff.size else np.zeros(0, bool)
    return {"identical": bool(np.array_equal(a, b)), "equal": bool(steps <= 1.0),
            "rows_differing": int(rows.sum()), "max_abs_diff": float(diff.max()) if diff.size else 0.0,
            "max_diff_in_float16_steps": steps}


def fresh_dir(root, tag):
    return tempfile.mkdtemp(prefix=f"{tag}-", dir=root)


# -- how busy the machine was -------------------------------------------------------------------
def busy_summary(runs):
    s = spread(r["cpu"]["other_cores"] for r in runs)
    return {"other_cores_mean": s["mean"], "other_cores_max": s["max"]}


def busy_text(summary):
    if summary["other_cores_mean"] is None:
        return "CPU use of other processes unknown (no /proc/stat)."
    return (f"Other processes on this machine kept {summary['other_cores_mean']:.2f} cores busy on average "
            f"during these runs (worst run {summary['other_cores_max']:.2f}) of {os.cpu_count()}.")


# -- 1. producer vs bare forward ----------------------------------------------------------------
def bench_overhead(root, kids, prefix, dataset_arg, p):
    n, batch = p["n"], p["batch"]
    runs = {"producer": [], "bare": []}
    cache_bytes = None
    for r in range(p["overhead_repeats"]):
        order = ["bare", "producer"] if r % 2 == 0 else ["producer", "bare"]
        for side in order:
            if side == "bare":
                res = kids.run(bare_argv(prefix, dataset_arg, batch), "bare teacher forward")
            else:
                d = fresh_dir(root, "overhead")
                res = kids.run(producer_argv(prefix, dataset_arg, d, batch), "python -m cache_builder")
                if not res.get("complete") or res.get("rows_written") != n:
                    raise RuntimeError(f"bench: the producer did not fill the cache: {res}")
                cache_bytes = os.path.getsize(res["cache_path"])
                shutil.rmtree(d)
            res["cpu"] = res["_cpu"]
            runs[side].append(res)
            log(f"  {side}: {res['rows_per_s']:.0f} rows/s (other processes: "
                f"{res['cpu']['other_cores'] or 0:.2f} cores)")
    rps = {k: spread(x["rows_per_s"] for x in v) for k, v in runs.items()}
    best, med = {k: s["max"] for k, s in rps.items()}, {k: s["median"] for k, s in rps.items()}
    ratio = best["producer"] / best["bare"]
    ratio_med = med["producer"] / med["bare"]
    # Within one producer run: teacher_s is make_views + forward inside its loop; the rest of the
    # loop is the store (encode, segment creation, SWMR writes and flushes) and bookkeeping.
    # Both parts ran in the same process at the same time, so machine noise hardly moves this.
    prod = max(runs["producer"], key=lambda x: x["rows_per_s"])
    loop_s = prod["rows_written"] / prod["rows_per_s"]
    in_run = [x["teacher_s"] / (x["rows_written"] / x["rows_per_s"]) for x in runs["producer"]]
    in_run_best = max(in_run)
    bare = max(runs["bare"], key=lambda x: x["rows_per_s"])
    busy = busy_summary(runs["bare"] + runs["producer"])
    res = {"n": n, "batch": batch, "threads": THREADS, "repeats": p["overhead_repeats"],
           "rows_per_s_best": best, "rows_per_s_median": med,
           "rows_per_s_all": {k: [x["rows_per_s"] for x in v] for k, v in runs.items()},
           "producer_vs_bare_forward": ratio, "producer_vs_bare_forward_median": ratio_med,
           "teacher_share_of_producer_loop": in_run, "teacher_share_of_producer_loop_best": in_run_best,
           "producer_loop_s_best": loop_s, "producer_teacher_s_best": prod["teacher_s"],
           "bare_forward_ms_per_batch_median": bare["forward_ms_per_batch_median"],
           "bare_forward_ms_per_batch_min": bare["forward_ms_per_batch_min"],
           "bare_make_views_ms_per_batch_median": bare["make_views_ms_per_batch_median"],
           "cache_bytes": cache_bytes, "cpu_per_run": {k: [x["cpu"] for x in v] for k, v in runs.items()},
           **busy, "statistic": "best of the interleaved repeats (median also given)"}
    table = md_table(
        ["N x C (fp16)", "batch", "threads", "bare forward rows/s", "producer rows/s",
         "producer_vs_bare_forward", "(medians)", "in-run teacher share", "floor", "verdict"],
        [[f"{n:,} x {CLASSES}", batch, THREADS, rate(best["bare"]), rate(best["producer"]), f"{ratio:.3f}",
          f"{ratio_med:.3f}", f"{in_run_best:.3f}", f">= {FLOORS['producer_vs_bare_forward']}",
          verdict(ratio, FLOORS["producer_vs_bare_forward"])]])
    note = (f"rows/s of the timed work loop only (set-up, MXNet import and data load excluded on both sides); "
            f"each side a fresh process with OMP_NUM_THREADS={THREADS}, best of {p['overhead_repeats']} "
            f"interleaved runs (the side going first alternates); the producer fills a fresh cache each run. "
            f"In-run teacher share: make_views + forward time / loop time inside the producer itself (best "
            f"run: {prod['teacher_s']:.2f} of {loop_s:.2f} s); the rest of its loop is the store. "
            + busy_text(busy))
    return res, table, note


# -- 2. two shards vs one producer ------------------------------------------------------------------
def write_npz(root, n):
    """The section 2 data set as a user's file: synthetic images (uint8 NHWC) and labels."""
    from pipeline.datasets import load_synthetic  # numpy only: no MXNet in this process
    d = load_synthetic("train", n=n, classes=CLASSES, shape=tuple(int(s) for s in SHAPE.split("x")))
    path = os.path.join(root, f"shards-{n}.npz")
    np.savez(path, x_train=d.data.transpose(0, 2, 3, 1), y_train=d.labels)
    return path


def bench_shards(root, kids, prefix, dataset_arg, p):
    n, batch = p["shard_n"], p["batch"]
    one_runs, two_runs, forked_runs, checks = [], [], [], []
    for r in range(p["shard_repeats"]):
        d1, d2, d3 = fresh_dir(root, "one"), fresh_dir(root, "two"), fresh_dir(root, "forked")
        try:
            def one():
                res = kids.run(producer_argv(prefix, dataset_arg, d1, batch), "one producer")
                one_runs.append({"wall_s": res["_wall_s"], "rows_per_s": res["rows_per_s"], "cpu": res["_cpu"]})
                return res

            def two():
                s0 = cpu_snapshot()
                t0 = time.perf_counter()
                procs = [kids.start(producer_argv(prefix, dataset_arg, d2, batch, f"{i}/2"), f"producer shard {i}/2")
                         for i in range(2)]
                res = [kids.finish(pr) for pr in procs]
                wall = time.perf_counter() - t0
                two_runs.append({"wall_s": wall, "rows_per_s": [x["rows_per_s"] for x in res],
                                 "seconds": [x["seconds"] for x in res], "cpu": cpu_between(s0, cpu_snapshot())})
                return res

            def forked():  # one command, --shards 2: one start-up, two forked shard processes
                res = kids.run(producer_argv(prefix, dataset_arg, d3, batch, shards=2), "producer --shards 2")
                forked_runs.append({"wall_s": res["_wall_s"], "rows_per_s": res["rows_per_s"],
                                    "complete": res["complete"], "cpu": res["_cpu"]})
                return res

            if r % 2 == 0:
                r1, r2, r3 = one(), two(), forked()
            else:
                r3, r2, r1 = forked(), two(), one()
            if not r3["complete"] or r3["rows_written"] != n:
                raise RuntimeError(f"bench: --shards 2 left an incomplete cache: {r3}")
            log(f"  one: {one_runs[-1]['wall_s']:.2f} s wall, {one_runs[-1]['rows_per_s']:.0f} rows/s; two: "
                f"{two_runs[-1]['wall_s']:.2f} s wall, {sum(two_runs[-1]['rows_per_s']):.0f} rows/s summed "
                f"(other processes: {one_runs[-1]['cpu']['other_cores'] or 0:.2f} / "
                f"{two_runs[-1]['cpu']['other_cores'] or 0:.2f} cores)")
            if not r1["complete"]:
                raise RuntimeError(f"bench: the single producer left an incomplete cache: {r1}")
            written = sum(x["rows_written"] for x in r2)
            path2 = next((x["cache_path"] for x in r2 if x["complete"]), None)
            logits1, _, _ = read_cache(r1["cache_path"])
            chk = {"rows_written": written, "shards_reporting_complete": sum(bool(x["complete"]) for x in r2),
                   "same_fingerprint": r1["fingerprint"] == r2[0]["fingerprint"] == r2[1]["fingerprint"]}
            if path2 is None or not os.path.exists(path2):
                chk.update(complete=False, identical=False, equal=False)
            else:
                logits2, flag, done = read_cache(path2)
                chk.update(complete=bool(flag and done and written == n), **compare_logits(logits1, logits2),
                           cache_bytes=os.path.getsize(path2))
            chk["ok"] = bool(chk["complete"] and chk["equal"] and chk["same_fingerprint"])
            checks.append(chk)
        finally:
            shutil.rmtree(d1, ignore_errors=True)
            shutil.rmtree(d2, ignore_errors=True)
    w1, w2 = min(x["wall_s"] for x in one_runs), min(x["wall_s"] for x in two_runs)
    w3 = min(x["wall_s"] for x in forked_runs)
    a1, a2 = max(x["rows_per_s"] for x in one_runs), max(sum(x["rows_per_s"]) for x in two_runs)
    # The verdict: the one-command way to run n shards on one host (--shards 2), start-up included.
    ratio, ratio_sep, ratio_agg = w1 / w3, w1 / w2, a2 / a1
    equal = all(c["ok"] for c in checks)
    identical = all(c.get("identical") for c in checks)
    busy = busy_summary(one_runs + two_runs)
    own2 = max((x["cpu"]["own_cores"] or 0) for x in two_runs)
    res = {"n": n, "batch": batch, "threads_per_process": THREADS, "repeats": p["shard_repeats"],
           "one_producer_runs": one_runs, "two_shard_runs": two_runs,
           "wall_s_best": {"one": w1, "two": w2},
           "rows_per_s_wall_best": {"one": n / w1, "two": n / w2},
           "rows_per_s_aggregate_best": {"one": a1, "two": a2},
           "forked_runs": forked_runs, "wall_s_forked_best": w3,
           "two_shards_vs_one": ratio, "two_shards_vs_one_separate_processes": ratio_sep,
           "two_shards_vs_one_aggregate": ratio_agg,
           "two_shard_cache_equal": equal, "two_shard_cache_identical": identical, "checks": checks,
           "two_shard_own_cores_best": own2, **busy,
           "statistic": "best of the interleaved repeats (shortest wall, highest rows/s)"}
    worst = max(checks, key=lambda c: c.get("max_diff_in_float16_steps") or 0)
    table = md_table(
        ["N x C (fp16)", "measure", "one producer", "two shards", "two / one", "floor", "verdict"],
        [[f"{n:,} x {CLASSES}", "wall s, `--shards 2` (one command, forks after loading)", f"{w1:.2f}",
          f"{w3:.2f}", "", "", ""],
         ["", "rows/s from wall, `--shards 2`", rate(n / w1), rate(n / w3), f"{ratio:.2f}",
          f">= {FLOORS['two_shards_vs_one']}", verdict(ratio, FLOORS["two_shards_vs_one"])],
         ["", "wall s, two commands `--shard 0/2`, `--shard 1/2`", f"{w1:.2f}", f"{w2:.2f}", "", "", ""],
         ["", "rows/s from wall, two commands", rate(n / w1), rate(n / w2), f"{ratio_sep:.2f}", "", "(info)"],
         ["", "rows/s reported (loops; two summed)", rate(a1), rate(a2), f"{ratio_agg:.2f}",
          f">= {FLOORS['two_shards_vs_one_aggregate']}", verdict(ratio_agg, FLOORS["two_shards_vs_one_aggregate"])],
         ["", "2-shard cache complete, logits equal", "", "yes" if equal else "NO", "", "",
          "PASS" if equal else "MISS"]])
    best1 = min(one_runs, key=lambda x: x["wall_s"])
    outside = best1["wall_s"] - n / best1["rows_per_s"]
    res["one_producer_outside_loop_s"] = outside
    note = (f"{n:,} rows read from an .npz file (synthetic images, uint8). "
            f"`--threads {THREADS}` per process on {os.cpu_count()} CPUs, a fresh cache each run, best of "
            f"{p['shard_repeats']} interleaved run(s). Wall time includes each process's start-up (MXNet "
            f"import, data set load and digest, teacher load: {outside:.1f} s of the single producer's "
            f"{best1['wall_s']:.1f} s were outside its work loop) and the compaction the last shard does; the "
            f"reported rows/s "
            f"are each process's work loop only, summed for the two shards. The two shard processes used "
            f"{own2:.2f} cores on average over their wall time (best run). Logits (h5py, dataset 'logits', float16 "
            f"as stored): {'bitwise identical' if identical else 'not bitwise identical'}; "
            f"{worst.get('rows_differing')} row(s) differ, by at most "
            f"{worst.get('max_diff_in_float16_steps') or 0:.0f} float16 step ({worst.get('max_abs_diff') or 0:.2g}); equal means within one step, since the "
            f"teacher's float32 output depends in its last bits on the row's position in the batch. "
            + busy_text(busy))
    return res, table, note


# -- main -----------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.producer",
        description="kdcache producer benchmarks: the cache builder vs the bare teacher forward (1 thread), "
                    "two shards on two cores vs one producer. Prints markdown tables and writes a JSON report.")
    ap.add_argument("--quick", action="store_true", help="smaller data set, fewer repeats (figures are noisier)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON report path (default {DEFAULT_OUT})")
    ap.add_argument("--tmp", default=None, help="directory for the temporary teacher and caches (default: the "
                                                "system temp dir); everything written there is removed")
    ap.add_argument("--child", choices=["export", "bare"], help=argparse.SUPPRESS)
    ap.add_argument("--teacher", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=128, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "export":
        child_export(args.teacher)
        return 0
    if args.child == "bare":
        child_bare(args.teacher, args.dataset, args.batch_size)
        return 0

    p = QUICK if args.quick else FULL
    dataset_arg = f"synthetic:n={p['n']},classes={CLASSES},shape={SHAPE}"
    m = machine(mxnet=True, omp_num_threads=THREADS)  # what every MXNet child runs with
    t_start = time.perf_counter()
    root = scratch_dir(args.tmp, "kdcache-bench-producer-")
    kids = Children()
    sections = []
    try:
        log(f"{'quick' if args.quick else 'full'} run, {dataset_arg}, temp dir {root}")
        prefix = os.path.join(root, "teacher", "benchteacher")
        os.makedirs(os.path.dirname(prefix))
        teacher = kids.run(python_m("bench.producer", "--child", "export", "--teacher", prefix), "teacher export")
        log("1/2 producer vs bare teacher forward")
        r1, t1, n1 = bench_overhead(root, kids, prefix, dataset_arg, p)
        sections.append(("1. Producer vs bare teacher forward (1 thread each)", t1, n1))
        log(f"2/2 two shards vs one producer ({p['shard_n']:,} rows from an .npz file)")
        shard_data = write_npz(root, p["shard_n"])
        r2, t2, n2 = bench_shards(root, kids, prefix, shard_data, p)
        sections.append(("2. Two shards on two cores vs one producer", t2, n2))
    finally:
        kids.stop_all()
        shutil.rmtree(root, ignore_errors=True)
    runtime = time.perf_counter() - t_start

    n, c = p["n"], CLASSES
    cache_bytes = r1["cache_bytes"]
    t3 = md_table(["cache (N x C, fp16)", "bytes", "bytes/row", "teacher forward ms/batch (median)",
                   "make_views ms/batch", "batch", "teacher parameters"],
                  [[f"{n:,} x {c}", f"{cache_bytes:,}", f"{cache_bytes / n:.1f}",
                    f"{r1['bare_forward_ms_per_batch_median']:.1f}", f"{r1['bare_make_views_ms_per_batch_median']:.2f}",
                    p["batch"], f"{teacher['parameters']:,}"]])
    n3 = (f"Finished .h5 of a section 1 run (logits as float16 plus the 1-byte done flag per row and HDF5 "
          f"metadata). Forward and make_views times: median over the full batches of the best bare run, "
          f"1 thread. Teacher: Conv-BN-ReLU-MaxPool x {len(TEACHER_WIDTHS)} (widths "
          f"{', '.join(map(str, TEACHER_WIDTHS))}), global average pool, Dense({c}).")
    sections.append(("3. Cache size and teacher forward time", t3, n3))

    ratios = {"producer_vs_bare_forward": r1["producer_vs_bare_forward"],
              "two_shards_vs_one": r2["two_shards_vs_one"],
              "two_shards_vs_one_aggregate": r2["two_shards_vs_one_aggregate"]}
    verdicts = {k: verdict(v, FLOORS[k]) for k, v in ratios.items()}
    report = {
        **ratios,
        "two_shards_vs_one_separate_processes": r2["two_shards_vs_one_separate_processes"],  # (info)
        "two_shard_cache_equal": r2["two_shard_cache_equal"],
        "two_shard_cache_identical": r2["two_shard_cache_identical"],
        "rows_per_s": {"bare_forward": r1["rows_per_s_best"]["bare"],
                       "producer": r1["rows_per_s_best"]["producer"],
                       "one_producer_wall": r2["rows_per_s_wall_best"]["one"],
                       "two_shards_wall": r2["rows_per_s_wall_best"]["two"],
                       "one_producer_reported": r2["rows_per_s_aggregate_best"]["one"],
                       "two_shards_reported_sum": r2["rows_per_s_aggregate_best"]["two"]},
        "cache_bytes": cache_bytes,
        "cache_bytes_per_row": cache_bytes / n,
        "teacher_forward_ms_per_batch": r1["bare_forward_ms_per_batch_median"],
        "other_processes_cores_mean": {"producer_vs_bare_forward": r1["other_cores_mean"],
                                       "two_shards_vs_one": r2["other_cores_mean"]},
        "floors": {k: {"op": ">=", "value": v} for k, v in FLOORS.items()},
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()) and r2["two_shard_cache_equal"],
        "sections": {"producer_vs_bare_forward": r1, "two_shards_vs_one": r2},
        "teacher": {"widths": list(TEACHER_WIDTHS), "classes": c, "shape": SHAPE, **teacher},
        "dataset": dataset_arg,
        "shard_dataset": f"npz of synthetic:n={p['shard_n']},classes={CLASSES},shape={SHAPE} (uint8 NHWC)",
        "machine": m,
        "date": utc_now(),
        "quick": bool(args.quick),
        "runtime_s": runtime,
    }

    print(heading("kdcache producer benchmark", args.quick, runtime))
    print(machine_line(m) + "\n")
    for title, table, note in sections:
        print(section(title, table, note))
    warning = busy_warning(spread([r1["other_cores_mean"], r2["other_cores_mean"]])["max"],
                           "a section (section 2 the most: it needs both cores)")
    if warning:
        print(warning)
    missed = [k for k, v in verdicts.items() if v != "PASS"]
    if not r2["two_shard_cache_equal"]:
        missed.append("two_shard_cache_equal")
    print(floors_line(missed))

    write_report(args.out, report)
    print(f"Report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
