"""The demand benchmark's command: its scenarios and options, the run (calibration, stages, scenarios, goals) and what it prints."""
import json
import os
import statistics
import time

from bench.cli import out_option, quick_option, tmp_option
from bench.common import (busy_warning, child_env, cpu_between, cpu_snapshot, heading, machine_line, make_log,
                          md_table, python_m, for_the_manual, spread)
from bench.paired import paired, shown, verdicts_line

DEFAULT_OUT = os.path.join("bench", "results", "demand.json")
THREADS, SEED, BATCH = 1, 0, 64
# reps: rounds of the scenarios the goals compare, (a)-(d), each round every scenario once (round robin), the goals
# decided on the round-by-round ratios (bench.paired); info_reps: rounds of the informative variants (num_workers=1,
# per batch) and of the student alone. A full round of (a)-(d) takes about 80 s, of the variants about 70 s.
FULL = dict(cal=dict(reps=7, tries=4, epoch_s=8.0, min_steps=30, max_steps=400, target=1.25), reps=5, info_reps=3,
            every=True)
QUICK = dict(cal=dict(reps=3, tries=2, epoch_s=0.75, min_steps=6, max_steps=40, target=1.25), reps=2, info_reps=1,
             every=False)
STALL_S = 0.001  # a stall counts as at least 1 ms in the goals' ratios: a run that never waited gives a ratio, not 0



def scenario(label, producer, demand, order, *, workers=0, read="item", full_only=False):
    """producer: offline (produce_offline, demand on/off) or online (cache_builder --online); order: the
    DataLoader's; read: targets per item (SoftTargetDataset) or per batch (a prototype batchify_fn)."""
    return dict(label=label, producer=producer, demand=demand, order=order, workers=workers, read=read,
                full_only=full_only)


SCENARIOS = {
    "key_order": scenario("(a) key order, demand ignored; DataLoader(shuffle=True)", "offline", "off", "shuffle"),
    "demand_wait": scenario("(b) demand, waits only; DataLoader(shuffle=True)", "offline", "on", "shuffle"),
    "demand_announced": scenario("(c) demand, order announced; DataLoader(sampler=ds.sampler())", "offline", "on",
                                 "announce"),
    "schedule": scenario("(d) kdcache's schedule: cache_builder --online; DataLoader in the schedule's order",
                         "online", None, "schedule"),
    "demand_wait_w1": scenario("(b) with num_workers=1", "offline", "on", "shuffle", workers=1, full_only=True),
    "demand_announced_w1": scenario("(c) with num_workers=1", "offline", "on", "announce", workers=1,
                                    full_only=True),
    "demand_wait_batch": scenario("(b') waits per batch (prototype: targets read in a batchify_fn); shuffle=True",
                                  "offline", "on", "shuffle", read="batch", full_only=True),
    "demand_wait_batch_w1": scenario("(b') with num_workers=1 (the worker reads the next batch ahead)", "offline",
                                     "on", "shuffle", read="batch", workers=1, full_only=True),
}
FLOORS = {"stall_vs_key_order": 0.25,       # stall of (b) or (c) <= 0.25 x stall of (a)
          "announced_vs_schedule": 1.10}    # epoch 1 of (c) <= 1.10 x epoch 1 of (d)

OPTIONS = [
    quick_option("a data set of about 0.75 s per epoch, two rounds of scenarios (a)-(d) only"),
    out_option(DEFAULT_OUT),
    tmp_option("directory for the teacher, caches and logs, kept there for inspection (default: a temporary "
               "folder, removed)"),
]

log = make_log("bench.demand")


# -- one scenario: the trainer first, the producer once the trainer is loaded --------------------------------
def run_one(name, prep, root, kids, rep, *, demand=None, order="shuffle", workers=0, read="item",
            producer="offline", cache=None):
    """One trainer (and its producer unless `producer` is None: the cache is then complete already).
    Returns {"trainer": ..., "producer": ..., "cpu": ...}."""
    d = os.path.join(root, f"{name}-{rep}")
    os.makedirs(d)
    cache = cache or os.path.join(d, "cache")
    ready = os.path.join(d, "ready")
    env = child_env(THREADS)
    snap = cpu_snapshot()
    tr = kids.start(python_m("bench.demand.children", "train", "--dataset", prep["dataset"], "--cache", cache,
                             "--order", order, "--read", read, "--workers", workers, "--ready", ready),
                    f"{name}-{rep} trainer", env=env, log_dir=d, cwd=d)
    pr = None
    if producer is not None:
        deadline = time.monotonic() + 300
        while not os.path.exists(ready) and tr.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        if producer == "online":
            argv = python_m("kdcache.cache_builder", "--teacher", prep["prefix"], "--dataset", prep["dataset"], "--cache",
                            cache, "--online", "--seed", SEED, "--epochs", 1, "--batch-size", BATCH, "--threads",
                            THREADS, "--json", "--quiet", "--timeline", os.path.join(d, "timeline.json"))
        else:
            argv = python_m("bench.demand.children", "produce", "--teacher", prep["prefix"], "--dataset",
                            prep["dataset"], "--cache", cache, "--demand", demand)
        pr = kids.start(argv, f"{name}-{rep} producer", env=env, log_dir=d, cwd=d)
    t = kids.finish(tr)
    p = kids.finish(pr) if pr is not None else None
    if producer == "online":  # its last step's time, from its timeline
        with open(os.path.join(d, "timeline.json")) as fh:
            p["loop_end_unix"] = json.load(fh)["steps"][-1][0]
    elif p is not None:
        p["loop_end_unix"] = p["loop_start_unix"] + p["loop_s"]
    if p is not None:  # how far the trainer had read when the producer wrote its last row
        done = p["loop_end_unix"] - t["epoch_start_unix"]
        t["producer_done_s"] = done
        t["read_when_producer_done"] = min(t["samples"], BATCH * sum(1 for a in t["batch_arrived_s"] if a <= done))
    return {"trainer": t, "producer": p, "cpu": cpu_between(snap, cpu_snapshot())}


def median(runs, key):
    return statistics.median(r[key] for r in runs)


def scenario_row(name, runs, slowest):
    """The report's row of one scenario: medians over its runs, and each run."""
    sc = SCENARIOS[name]
    workers = sc["workers"]
    tr = [r["trainer"] for r in runs]
    pr = [r["producer"] for r in runs]
    e1 = median(tr, "epoch1_s")
    row = {"scenario": name, "label": sc["label"], "producer": "cache_builder --online" if sc["producer"] == "online"
           else f"produce_offline(demand={sc['demand'] == 'on'})", "order": sc["order"], "read": sc["read"],
           "num_workers": workers, "runs": len(runs),
           "epoch1_s": round(e1, 3), "stall_s": round(median(tr, "stall_s"), 3),
           "data_wait_s": round(median(tr, "data_wait_s"), 3), "items_waited": int(median(tr, "items_waited")),
           "first_batch_s": round(median(tr, "first_batch_s"), 3),
           "producer_done_s": round(median(tr, "producer_done_s"), 3),
           "read_when_producer_done": round(median(tr, "read_when_producer_done") / tr[0]["samples"], 4),
           "ratio_to_slowest_stage": round(e1 / slowest[workers]["seconds"], 4),
           "slowest_stage": slowest[workers]["stage"],
           "demand_rows": int(median(pr, "demand_rows")) if all("demand_rows" in p for p in pr) else None,
           "producer_rows": int(median(pr, "rows_written")),
           "producer_teacher_s": round(median(pr, "teacher_s"), 3),
           "other_processes_cores": round(max(r["cpu"]["other_cores"] or 0 for r in runs), 3),
           "each_run": [{"epoch1_s": round(t["epoch1_s"], 3), "stall_s": round(t["stall_s"], 3),
                         "data_wait_s": round(t["data_wait_s"], 3), "items_waited": t["items_waited"],
                         "producer_done_s": round(t["producer_done_s"], 3),
                         "read_when_producer_done": t["read_when_producer_done"],
                         "demand_rows": p.get("demand_rows"), "producer_loop_s": rounded(p.get("loop_s")),
                         "producer_start_after_epoch_start_s": rounded(p["loop_start_unix"] - t["epoch_start_unix"])
                         if "loop_start_unix" in p else None,
                         "producer_batches": p.get("batches"), "reader_source_at_start": t["reader_source_at_start"],
                         "other_processes_cores": rounded(r["cpu"]["other_cores"]),
                         "wall_s": round(t["_wall_s"], 2)} for r, t, p in zip(runs, tr, pr)]}
    return row


def rounded(v, d=3):
    return None if v is None else round(v, d)


def goals(runs, by):
    """Each goal decided on the round-by-round ratios of its two scenarios (run r of each came from round r of the
    round robin): bench.paired's median, spread, runs and verdict (PASS, MISS or UNMEASURABLE)."""
    out = []
    ref = [r["trainer"]["stall_s"] for r in runs["key_order"]]
    for sc in ("demand_wait", "demand_announced"):
        f = paired([max(r["trainer"]["stall_s"], STALL_S) / max(a, STALL_S) for r, a in zip(runs[sc], ref)],
                   FLOORS["stall_vs_key_order"], higher_is_better=False)
        out.append({"goal": f"{sc}_stall_vs_key_order", **f,
                    "compares": f"stall s of {sc} / of key_order, round by round (medians {by[sc]['stall_s']:.2f} / "
                                f"{by['key_order']['stall_s']:.2f})"})
    f = paired([c["trainer"]["epoch1_s"] / d["trainer"]["epoch1_s"]
                for c, d in zip(runs["demand_announced"], runs["schedule"])],
               FLOORS["announced_vs_schedule"], higher_is_better=False)
    out.append({"goal": "announced_vs_schedule_epoch1", **f,
                "compares": f"epoch-1 s of demand_announced / of schedule, round by round (medians "
                            f"{by['demand_announced']['epoch1_s']:.2f} / {by['schedule']['epoch1_s']:.2f})"})
    return out


def why_waits_only(row, runs):
    """What (b)'s producer did and what each waiting item cost: its batches chosen by demand and in key order,
    their sizes and times, the mean wait of an item that waited, and how far the trainer had read when the
    producer wrote its last row (medians of the runs where it applies)."""
    b = [r["producer"]["batches"] for r in runs]
    if not all(b):
        return None

    def med(f):
        vals = [f(x) for x in b]
        vals = [v for v in vals if v is not None]
        return round(statistics.median(vals), 4) if vals else None
    tr = [r["trainer"] for r in runs]
    loop = statistics.median(r["producer"]["loop_s"] for r in runs)
    batches = med(lambda x: x["demand"]["batches"] + x["key_order"]["batches"])
    return {"items": tr[0]["samples"], "items_waited": row["items_waited"],
            "mean_wait_per_waited_item_s": round(statistics.median(t["stall_s"] / max(1, t["items_waited"])
                                                                   for t in tr), 4),
            "producer_loop_s": round(loop, 3), "producer_batches": batches,
            "producer_s_per_batch": round(loop / batches, 4) if batches else None,
            "demand_batches": med(lambda x: x["demand"]["batches"]), "demand_rows": med(lambda x: x["demand"]["rows"]),
            "demand_rows_per_batch": med(lambda x: x["demand"]["rows_per_batch"]),
            "demand_batches_of_1_row": med(lambda x: x["demand"]["batches_of_1_row"]),
            "demand_ms_per_row": med(lambda x: x["demand"]["ms_per_row"]),
            "key_order_batches": med(lambda x: x["key_order"]["batches"]),
            "key_order_rows": med(lambda x: x["key_order"]["rows"]),
            "key_order_ms_per_row": med(lambda x: x["key_order"]["ms_per_row"]),
            "read_when_producer_done": row["read_when_producer_done"]}


DESCRIPTION = ("The first epoch of a user's shuffled DataLoader against a producer filling the cache: key order, "
               "demand-driven (waits only, and with the order announced) and kdcache's own schedule, one core each. "
               "Prints markdown tables and writes a JSON report.")


def params(parser, args):
    """The sizes of a full or a quick run."""
    return QUICK if args.quick else FULL


def run(kids, args, p, root):
    """Calibrate the teacher, time the stages alone, run every scenario round robin: the report."""
    load_start = os.getloadavg()
    names = [s for s, sc in SCENARIOS.items() if p["every"] or not sc["full_only"]]
    log(f"{'quick' if args.quick else 'full'} run, temp dir {root}, load average "
        f"{' '.join(f'{v:.2f}' for v in load_start)}")
    log("calibrating the teacher against the student's step and sizing the data set (one process, 1 thread)")
    prep = kids.run(python_m("bench.demand.children", "prepare", "--root", root, "--sizes", json.dumps(p["cal"])),
                    "prepare", env=child_env(THREADS), log_dir=root, cwd=root)
    n = prep["n"]
    log(f"  teacher width {prep['width']} + {prep['extra_convs']} convs: forward {prep['forward_ms']:.1f} ms vs "
        f"student step {prep['step_ms']:.1f} ms per batch of {BATCH} (ratio {prep['ratio']:.2f}); data set "
        f"{prep['dataset']}")
    # the producer alone into a fresh cache, no reader; then the student alone on that finished cache
    d0 = os.path.join(root, "producer-alone")
    os.makedirs(d0)
    warm = os.path.join(d0, "cache")
    snap = cpu_snapshot()
    alone = kids.run(python_m("bench.demand.children", "produce", "--teacher", prep["prefix"], "--dataset",
                              prep["dataset"], "--cache", warm, "--demand", "off"), "producer alone",
                     env=child_env(THREADS), log_dir=d0, cwd=d0)
    alone_cpu = cpu_between(snap, cpu_snapshot())
    log(f"  producer alone: {alone['loop_s']:.2f} s ({alone['rows_per_s']:.0f} rows/s)")
    student = {}
    for w in (0, 1) if p["every"] else (0,):
        student[w] = [run_one(f"student-alone-w{w}", prep, root, kids, i, order="shuffle", workers=w,
                              producer=None, cache=warm) for i in range(p["info_reps"])]
        log(f"  student alone, num_workers={w}: epoch 1 "
            + ", ".join(f"{r['trainer']['epoch1_s']:.2f}" for r in student[w]) + " s")
    slowest = {}
    for w, runs in student.items():
        s = median([r["trainer"] for r in runs], "epoch1_s")
        slowest[w] = ({"stage": "producer", "seconds": alone["loop_s"]} if alone["loop_s"] >= s else
                      {"stage": "student", "seconds": s})
    runs = {s: [] for s in names}
    for rep in range(p["reps"]):  # round robin: round r of every scenario met the same load (the goals pair them)
        for s in names:
            sc = SCENARIOS[s]
            if sc["full_only"] and rep >= p["info_reps"]:  # informative: no goal compares it
                continue
            r = run_one(s, prep, root, kids, rep, demand=sc["demand"], order=sc["order"], workers=sc["workers"],
                        read=sc["read"], producer=sc["producer"])
            runs[s].append(r)
            t = r["trainer"]
            log(f"  {s} #{rep + 1}: epoch 1 {t['epoch1_s']:.2f} s, stall {t['stall_s']:.2f} s, "
                f"{t['items_waited']} items waited, demand rows {r['producer'].get('demand_rows')}, other "
                f"processes {r['cpu']['other_cores'] or 0:.2f} cores")
    load_end = os.getloadavg()

    by = {s: scenario_row(s, runs[s], slowest) for s in names}
    gl = goals(runs, by)
    why = why_waits_only(by["demand_wait"], runs["demand_wait"])
    student_rows = {f"num_workers={w}": {"epoch1_s": [round(r["trainer"]["epoch1_s"], 3) for r in rs],
                                         "median_s": round(median([r["trainer"] for r in rs], "epoch1_s"), 3)}
                    for w, rs in student.items()}
    others = spread([r["cpu"]["other_cores"] for rs in list(runs.values()) + list(student.values()) for r in rs]
                    + [alone_cpu["other_cores"]])
    return {
        "results": [by[s] for s in names],
        "goals": {g["goal"]: g for g in gl},
        "goal_met": (gl[0]["verdict"] == "PASS" or gl[1]["verdict"] == "PASS") and gl[2]["verdict"] == "PASS",
        "why_waits_only": why,
        "stages": {"producer_alone_s": round(alone["loop_s"], 3),
                   "producer_alone_rows_per_s": round(alone["rows_per_s"], 1),
                   "producer_alone_teacher_s": round(alone["teacher_s"], 3), "student_alone": student_rows,
                   "slowest": {f"num_workers={w}": {"stage": v["stage"], "seconds": round(v["seconds"], 3)}
                               for w, v in slowest.items()}},
        "calibration": {k: (round(v, 4) if isinstance(v, float) else v) for k, v in prep.items()
                        if k not in ("prefix", "tries")},
        "settings": {"dataset": prep["dataset"], "n": n, "batch": BATCH, "student": prep["student"],
                     "threads_per_process": THREADS, "seed": SEED, "reps": p["reps"], "info_reps": p["info_reps"],
                     "scenarios": names},
        "load": {"loadavg_start": [round(v, 2) for v in load_start], "loadavg_end": [round(v, 2) for v in load_end],
                 "other_processes_cores_mean": rounded(others["mean"]),
                 "other_processes_cores_max": rounded(others["max"])},
    }


# The manual's names of the scenarios and goals (docs/benchmarks.md).
DOC_LABELS = {"key_order": "(a) key order, demand ignored; `shuffle=True`",
              "demand_wait": "(b) demand, waits only; `shuffle=True`",
              "demand_announced": "(c) demand, order announced; `sampler=ds.sampler()`",
              "schedule": "(d) kdcache's schedule: `cache_builder --online`",
              "demand_wait_w1": "(b)", "demand_announced_w1": "(c)",
              "demand_wait_batch": "(b') prototype: targets read per batch",
              "demand_wait_batch_w1": "(b') prototype: targets read per batch"}
DOC_GOALS = {"demand_announced_stall_vs_key_order": "stall of (c) / stall of (a)",
             "announced_vs_schedule_epoch1": "epoch 1 of (c) / epoch 1 of (d)",
             "demand_wait_stall_vs_key_order": "stall of (b) / stall of (a)"}


def render(report):
    """[(title, markdown table)]: the first epoch of each scenario and the goals, from the JSON report alone."""
    def stall(r):
        return f"{r['stall_s']:.2f}" + (f" (loop's wait {r['data_wait_s']:.2f})" if r["num_workers"] else "")
    rows = [[DOC_LABELS.get(r["scenario"], r["label"]), r["num_workers"], f"{r['epoch1_s']:.2f}", stall(r),
             f"{r['ratio_to_slowest_stage']:.2f}",
             "-" if r["scenario"] == "schedule" or r["demand_rows"] is None else r["demand_rows"], f"{100 * r['read_when_producer_done']:.0f}%"]
            for r in report["results"]]
    goals = [[DOC_GOALS.get(name, name), shown(g) if "runs" in g else f"{g['measured']:.2f}", g["limit"], g["verdict"]]
             for name, g in sorted(report["goals"].items(), key=lambda kv: list(DOC_GOALS).index(kv[0])
                                   if kv[0] in DOC_GOALS else len(DOC_GOALS))]
    return [("", md_table(["scenario", "num_workers", "epoch-1 s", "stall s", "vs slowest stage alone", "demand_rows",
                           "read when the producer finished"], rows, pad=False)),
            ("Goals:" + (" each the median of the round-by-round ratios ±its spread, each round's ratio in brackets, "
                         "its verdict decided on them (bench.paired: a limit nearer 1 than the spread is UNMEASURABLE)."
                         if any("runs" in g for g in report["goals"].values()) else ""),
             md_table(["goal", "measured", "limit", "verdict"], goals, pad=False))]


def show(report):
    """The tables, from the report alone."""
    m, ld, st, cal = report["machine"], report["load"], report["stages"], report["calibration"]
    by = {r["scenario"]: r for r in report["results"]}
    names, gl, why = list(by), list(report["goals"].values()), report["why_waits_only"]
    print(heading("kdcache demand-driven producing", report["quick"], report["runtime_s"]))
    print(machine_line(m))
    print(f"load average (1/5/15 min): {' '.join(f'{v:.2f}' for v in ld['loadavg_start'])} at the start, "
          f"{' '.join(f'{v:.2f}' for v in ld['loadavg_end'])} at the end; other processes kept "
          f"{ld['other_processes_cores_mean'] or 0:.2f} cores busy on average during the runs (worst "
          f"{ld['other_processes_cores_max'] or 0:.2f}) of {os.cpu_count()}\n")
    print(f"Data: {cal['dataset']}, batch {BATCH}, {cal['steps_per_epoch']} steps per epoch; student "
          f"{cal['student']}; teacher width {cal['width']} + {cal['extra_convs']} convs, forward "
          f"{cal['forward_ms']:.1f} ms vs student step {cal['step_ms']:.1f} ms per batch (ratio {cal['ratio']:.2f}, "
          f"one thread each); every MXNet process OMP_NUM_THREADS={THREADS}, one core each; "
          f"{report['settings']['reps']} round(s) of (a)-(d), round robin, "
          f"{report['settings'].get('info_reps', report['settings']['reps'])} of the other scenarios and of the "
          f"student alone (medians); the goals are decided on the round-by-round ratios.\n")
    slow = st["slowest"]
    print(f"Stages alone: producer {st['producer_alone_s']:.2f} s ({st['producer_alone_rows_per_s']:.0f} rows/s, "
          f"its loop); student (the same loop on the finished cache) "
          + ", ".join(f"{k}: {v['median_s']:.2f} s" for k, v in st["student_alone"].items())
          + "; slowest: " + ", ".join(f"{k}: {v['stage']} {v['seconds']:.2f} s" for k, v in slow.items()) + ".\n")
    print("## First epoch, cold cache\n")
    print(md_table(["scenario", "num_workers", "epoch-1 s", "stall s", "items waited", "vs slowest stage alone",
                    "demand_rows", "read when producer done", "data wait s", "other procs (cores)"],
                   [[r["label"], r["num_workers"], f"{r['epoch1_s']:.2f}", f"{r['stall_s']:.2f}", r["items_waited"],
                     f"{r['ratio_to_slowest_stage']:.2f}", "-" if r["demand_rows"] is None else r["demand_rows"],
                     f"{100 * r['read_when_producer_done']:.0f}%", f"{r['data_wait_s']:.2f}",
                     f"{r['other_processes_cores']:.2f}"] for r in (by[s] for s in names)]))
    print("\nstall s: the reader's wait for targets (CacheReader.stall_s, summed over the items; from a worker "
          "process through shared memory). data wait s: the loop's wait for each batch (the stall plus loading the "
          "items). demand_rows: rows the producer wrote first because a reader waited for them or announced them "
          "(its Demand.served); online follows the schedule and takes no demand. read when producer done: the share "
          "of the epoch the trainer had read when the producer wrote its last row. (b'): a prototype, not kdcache's "
          "API (see bench.demand.children).\n")
    if why:
        print("## (b), waits only: what its producer did\n")
        print(md_table(["measure", "value"], [
            ["items that waited / items", f"{why['items_waited']} / {why['items']}"],
            ["mean wait of an item that waited", f"{1e3 * why['mean_wait_per_waited_item_s']:.0f} ms"],
            ["producer: batches, loop s, s per batch", f"{why['producer_batches']:.0f}, {why['producer_loop_s']:.2f}, "
                                                      f"{1e3 * (why['producer_s_per_batch'] or 0):.0f} ms"],
            ["batches chosen by demand: count, rows per batch, of 1 row",
             f"{why['demand_batches']:.0f}, {why['demand_rows_per_batch'] or 0:.1f}, "
             f"{why['demand_batches_of_1_row']:.0f}"],
            ["teacher ms per row: demand batches / key-order batches",
             f"{why['demand_ms_per_row'] or 0:.2f} / {why['key_order_ms_per_row'] or 0:.2f}"],
            ["teacher ms per key-order batch of 64", f"{BATCH * (why['key_order_ms_per_row'] or 0):.0f}"],
            ["trainer had read when the producer wrote its last row", f"{100 * why['read_when_producer_done']:.0f}%"],
        ]))
        print("\nA DataLoader reads its items one by one (SoftTargetDataset.__getitem__), so a waiting reader names "
              "one key at a time; the producer serves it as a batch of its own, then fills its next batch from key "
              "order before it polls again. Compare the mean wait of an item that waited with the teacher's time "
              "for a key-order batch: when they are about equal, the trainer gets one waited-for item per "
              "key-order batch, and reads the rest of its epoch only once key order has filled the cache.\n")
    print("## Goals\n")
    print(md_table(["goal", "measured", "limit", "verdict", "compares"],
                   [[g["goal"], shown(g), g["limit"], g["verdict"], g["compares"]] for g in gl]) + "\n")
    warning = busy_warning(ld["other_processes_cores_max"], "a scenario")
    if warning:
        print(warning)
    print(verdicts_line({g["goal"]: g["verdict"] for g in gl}))
    print("\n" + for_the_manual(render(report)))

