"""The producer benchmark's sections: the cache builder vs the bare teacher loop, and two shards vs one producer."""
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from bench.common import cpu_between, cpu_snapshot, make_log, md_table, python_m, rate, spread
from bench.paired import paired, shown
from bench.producer.children import CLASSES, SHAPE

THREADS = 1  # compute threads of every producer and bare loop
FLOORS = {"producer_vs_bare_forward": 0.9, "two_shards_vs_one": 1.6, "two_shards_vs_one_aggregate": 1.6}

log = make_log("bench.producer")


# -- the command lines the sections run, and the caches they fill --------------------------------
def producer_argv(prefix, dataset_arg, cache_dir, batch, shard="0/1", shards=None):
    """dataset_arg: a --dataset value, or an .npz path (a data set on disk, as users' are)."""
    data = ["--dataset", "npz", "--data-root", dataset_arg] if dataset_arg.endswith(".npz") else \
        ["--dataset", dataset_arg]
    return python_m("kdcache.cache_builder", "--teacher", prefix, *data, "--cache-dir", cache_dir, "--batch-size", batch,
                    "--threads", THREADS, *(["--shards", shards] if shards else ["--shard", shard]), "--json",
                    "--quiet")


def bare_argv(prefix, dataset_arg, batch):
    return python_m("bench.producer.children", "bare", "--teacher", prefix, "--dataset", dataset_arg,
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
                res = kids.run(producer_argv(prefix, dataset_arg, d, batch), "python -m kdcache.cache_builder")
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
    # The verdict: run r of the producer over run r of the bare loop (back to back), decided on the paired ratios.
    floor = paired([p_["rows_per_s"] / b["rows_per_s"] for p_, b in zip(runs["producer"], runs["bare"])],
                   FLOORS["producer_vs_bare_forward"])
    ratio_best = best["producer"] / best["bare"]
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
           "producer_vs_bare_forward": floor["measured"], "paired": {"producer_vs_bare_forward": floor},
           "producer_vs_bare_forward_median": ratio_med, "producer_vs_bare_forward_best": ratio_best,
           "teacher_share_of_producer_loop": in_run, "teacher_share_of_producer_loop_best": in_run_best,
           "producer_loop_s_best": loop_s, "producer_teacher_s_best": prod["teacher_s"],
           "bare_forward_ms_per_batch_median": bare["forward_ms_per_batch_median"],
           "bare_forward_ms_per_batch_min": bare["forward_ms_per_batch_min"],
           "bare_make_views_ms_per_batch_median": bare["make_views_ms_per_batch_median"],
           "bare_cores_used": bare["cores_used"], "bare_threads": bare["threads"],
           "cache_bytes": cache_bytes, "cpu_per_run": {k: [x["cpu"] for x in v] for k, v in runs.items()},
           **busy, "statistic": "median of the run-by-run ratios of the interleaved repeats (bench.paired); the ratio "
                                "of the medians and of the best runs also given"}
    return res


def overhead_section(res):
    """Section 1's table and note, from its result alone."""
    n, batch, med, f = res["n"], res["batch"], res["rows_per_s_median"], res["paired"]["producer_vs_bare_forward"]
    table = md_table(
        ["N x C (fp16)", "batch", "threads", "bare forward rows/s", "producer rows/s",
         "producer_vs_bare_forward", "(best runs)", "in-run teacher share", "floor", "verdict"],
        [[f"{n:,} x {CLASSES}", batch, res["threads"], rate(med["bare"]), rate(med["producer"]), shown(f),
          f"{res['producer_vs_bare_forward_best']:.3f}", f"{res['teacher_share_of_producer_loop_best']:.3f}",
          f["limit"], f["verdict"]]])
    note = (f"rows/s of the timed work loop only (set-up, MXNet import and data load excluded on both sides), "
            f"medians of {res['repeats']} interleaved runs (the side going first alternates); each side a fresh "
            f"process with OMP_NUM_THREADS={res['threads']}; the producer fills a fresh cache each run. "
            f"producer_vs_bare_forward: the median of the run-by-run ratios (run r of the producer over run r of "
            f"the bare loop, back to back) ±its spread, each run's ratio in brackets; the verdict is decided on "
            f"them (bench.paired: a floor nearer 1 than the spread is UNMEASURABLE). "
            f"In-run teacher share: make_views + forward time / loop time inside the producer itself (best "
            f"run: {res['producer_teacher_s_best']:.2f} of {res['producer_loop_s_best']:.2f} s); the rest of its "
            f"loop is the store. " + busy_text(res))
    return table, note


# -- 2. two shards vs one producer ------------------------------------------------------------------
def write_npz(root, n):
    """The section 2 data set as a user's file: synthetic images (uint8 NHWC) and labels."""
    from kdcache.pipeline.datasets import load_synthetic  # numpy only: no MXNet in this process
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
    # Run r of each way met the same load (they ran back to back): the floors are decided on the run-by-run
    # ratios (bench.paired). The verdict: the one-command way to run n shards on one host (--shards 2),
    # start-up included; the summed work-loop rows/s of two separate commands beside it.
    fl = {"two_shards_vs_one": paired([o["wall_s"] / f["wall_s"] for o, f in zip(one_runs, forked_runs)],
                                      FLOORS["two_shards_vs_one"]),
          "two_shards_vs_one_aggregate": paired([sum(t["rows_per_s"]) / o["rows_per_s"]
                                                 for o, t in zip(one_runs, two_runs)],
                                                FLOORS["two_shards_vs_one_aggregate"])}
    ratio, ratio_agg = fl["two_shards_vs_one"]["measured"], fl["two_shards_vs_one_aggregate"]["measured"]
    ratio_sep = statistics.median(o["wall_s"] / t["wall_s"] for o, t in zip(one_runs, two_runs))
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
           "two_shards_vs_one_aggregate": ratio_agg, "paired": fl,
           "wall_s_median": {"one": statistics.median(x["wall_s"] for x in one_runs),
                             "two": statistics.median(x["wall_s"] for x in two_runs),
                             "forked": statistics.median(x["wall_s"] for x in forked_runs)},
           "rows_per_s_aggregate_median": {"one": statistics.median(x["rows_per_s"] for x in one_runs),
                                           "two": statistics.median(sum(x["rows_per_s"]) for x in two_runs)},
           "two_shard_cache_equal": equal, "two_shard_cache_identical": identical, "checks": checks,
           "two_shard_own_cores_best": own2, **busy,
           "statistic": "median of the run-by-run ratios of the interleaved repeats (bench.paired); the shortest "
                        "wall and highest rows/s also given"}
    best1 = min(one_runs, key=lambda x: x["wall_s"])
    res["one_producer_outside_loop_s"] = best1["wall_s"] - n / best1["rows_per_s"]
    return res


def shards_section(res):
    """Section 2's table and note, from its result alone."""
    n, checks, equal, identical = res["n"], res["checks"], res["two_shard_cache_equal"], res["two_shard_cache_identical"]
    wm, am, fl = res["wall_s_median"], res["rows_per_s_aggregate_median"], res["paired"]
    w1, w2, w3 = wm["one"], wm["two"], wm["forked"]
    a1, a2 = am["one"], am["two"]
    ratio_sep = res["two_shards_vs_one_separate_processes"]
    f, fa = fl["two_shards_vs_one"], fl["two_shards_vs_one_aggregate"]
    threads, own2, outside = res["threads_per_process"], res["two_shard_own_cores_best"], res["one_producer_outside_loop_s"]
    best1 = min(res["one_producer_runs"], key=lambda x: x["wall_s"])
    worst = max(checks, key=lambda c: c.get("max_diff_in_float16_steps") or 0)
    table = md_table(
        ["N x C (fp16)", "measure", "one producer", "two shards", "two / one", "floor", "verdict"],
        [[f"{n:,} x {CLASSES}", "wall s, `--shards 2` (one command, forks after loading)", f"{w1:.2f}",
          f"{w3:.2f}", "", "", ""],
         ["", "rows/s from wall, `--shards 2`", rate(n / w1), rate(n / w3), shown(f), f["limit"], f["verdict"]],
         ["", "wall s, two commands `--shard 0/2`, `--shard 1/2`", f"{w1:.2f}", f"{w2:.2f}", "", "", ""],
         ["", "rows/s from wall, two commands", rate(n / w1), rate(n / w2), f"{ratio_sep:.2f}", "", "(info)"],
         ["", "rows/s reported (loops; two summed)", rate(a1), rate(a2), shown(fa), fa["limit"], fa["verdict"]],
         ["", "2-shard cache complete, logits equal", "", "yes" if equal else "NO", "", "",
          "PASS" if equal else "MISS"]])
    note = (f"{n:,} rows read from an .npz file (synthetic images, uint8). "
            f"`--threads {threads}` per process on {os.cpu_count()} CPUs, a fresh cache each run; seconds and "
            f"rows/s are medians of {res['repeats']} interleaved rounds (the way going first alternates), each "
            f"ratio the median of the round-by-round ratios ±its spread, each round's in brackets, the verdicts "
            f"decided on them (bench.paired). Wall time includes each process's start-up (MXNet "
            f"import, data set load and digest, teacher load: {outside:.1f} s of the single producer's "
            f"{best1['wall_s']:.1f} s were outside its work loop) and the compaction the last shard does; the "
            f"reported rows/s "
            f"are each process's work loop only, summed for the two shards. The two shard processes used "
            f"{own2:.2f} cores on average over their wall time (best run). Logits (h5py, dataset 'logits', float16 "
            f"as stored): {'bitwise identical' if identical else 'not bitwise identical'}; "
            f"{worst.get('rows_differing')} row(s) differ, by at most "
            f"{worst.get('max_diff_in_float16_steps') or 0:.0f} float16 step ({worst.get('max_abs_diff') or 0:.2g}); "
            f"equal means within one step, since the teacher's float32 output depends in its last bits on the "
            f"row's position in the batch. "
            + busy_text(res))
    return table, note
