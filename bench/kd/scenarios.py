"""The KD benchmark's set-up and scenarios: what each one runs, all of them for one pair, their rows and the plot."""
import json
import os
import shutil
import statistics

import numpy as np

from bench.common import child_env, make_log, python_m

CLASSES = 10
SHAPE = (3, 32, 32)
BATCH = 128
STUDENT = "small_cnn"
THREADS = 1
SEED = 0
TARGETS = {"light": 1 / 3, "heavy": 2.0}  # the pairs: teacher forward / student step, one thread each

SCENARIOS = ["student_only", "inline", "inline_async", "inline_async_2w", "online", "warm", "ring"]
REQUIRED = ["student_only", "inline", "inline_async", "online", "warm", "ring"]  # the others: not in --quick
# Run order per pair in a round: online first (warm reads the cache it fills), then the others, reversed in
# every second round (A B, then B A) so that a drift of the machine's speed within a round does not favour
# one side of a pair; student_only beside warm and ring, the pairs of the tightest floors.
ORDER = ["online", "warm", "student_only", "ring", "inline", "inline_async", "inline_async_2w"]
# inline_async_2w (informative) runs one epoch, in the first round only.
ONE_EPOCH = {"inline_async_2w"}
FIRST_ROUND_ONLY = {"inline_async_2w"}


def round_order(scenarios, round_):
    """The scenarios of round `round_` in the order they run (ORDER's, every second round reversed after online)."""
    run = [sc for sc in ORDER if sc in scenarios and (round_ == 0 or sc not in FIRST_ROUND_ONLY)]
    head, rest = run[:1], run[1:]
    return head + (rest[::-1] if round_ % 2 else rest)


# Peak memory per role: the process started (the trainer) and a `cache_builder` below it.
RSS = {"role": "trainer", "roles": {"producer": "cache_builder"}}

log = make_log("bench.kd")


# -- the stages alone --------------------------------------------------------------------------------------
def teacher_alone(pair, prefix, dataset, root, kids, round_=0):
    """The producer's offline loop as `python -m kdcache.cache_builder` runs it, in a process of its own on one
    thread, filling the train split into a fresh cache once: the loop's rows/s (start-up excluded) and its
    seconds per epoch."""
    cache_dir = os.path.join(root, pair, f"caches-alone-{round_}")
    res = kids.run(python_m("kdcache.cache_builder", "--teacher", prefix, "--dataset", dataset, "--cache-dir", cache_dir,
                            "--threads", THREADS, "--batch-size", BATCH, "--seed", SEED, "--quiet", "--json"),
                   f"{pair} teacher alone, round {round_ + 1}", env=child_env(THREADS), log_dir=root, cwd=root)
    if not res.get("complete") or res.get("rows_written") != res.get("teacher_forwards"):
        raise RuntimeError(f"bench: the offline producer left {cache_dir} incomplete ({res})")
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {"rows": res["rows_written"], "rows_per_s": res["rows_per_s"], "teacher_s": res["teacher_s"],
            "epoch_s": res["rows_written"] / res["rows_per_s"]}


def alone_summary(passes):
    """The teacher alone over its passes (one per round): the median pass's figures and every pass's rows/s."""
    med = sorted(passes, key=lambda r: r["rows_per_s"])[len(passes) // 2]
    return {**med, "loop_s": med["epoch_s"], "passes_rows_per_s": [r["rows_per_s"] for r in passes],
            "passes_epoch_s": [r["epoch_s"] for r in passes]}


# -- one pair ----------------------------------------------------------------------------------------------
def trainer_argv(dataset, run_dir_root, run, epochs, *, mode, teacher=None, cache_dir=None, store=None, ctx=None):
    argv = python_m("kdcache.trainer", "--dataset", dataset, "--student", STUDENT, "--epochs", epochs, "--batch-size", BATCH,
                    "--seed", SEED, "--threads", THREADS, "--teacher-mode", mode,
                    "--quiet", "--json", "--runs-dir", run_dir_root, "--run", run)
    if mode != "none":  # without a teacher, teacher options are refused as mistakes
        argv += ["--producer-threads", str(THREADS)] + (["--teacher", teacher] if teacher else [])
    if cache_dir:
        argv += ["--cache-dir", cache_dir]
    if store:
        argv += ["--store", store]
    if ctx:
        argv += ["--ctx", ctx]
    return argv


def read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def startup_note(res, run_dir, steps):
    """Where start-up ends, from the trainer's timeline: epoch 1's start after launch (the trainer's
    own start-up, plus any wait for its producer before the loop), and for a run with a producer the
    first step's wait (inside epoch 1) and the producer's first finished step."""
    tl = (read_json(os.path.join(run_dir, "timeline.json")) or {}).get("steps") or []
    ptl = (read_json(os.path.join(run_dir, "producer-timeline.json")) or {}).get("steps") or []
    if len(tl) < steps or not res.get("epoch1_s"):
        return {}
    epoch_start = tl[steps - 1][0] - res["epoch1_s"]
    out = {"epoch1_start_after_launch_s": round(epoch_start - res["_launched"], 3),
           "first_step_wait_s": round(tl[0][2], 3)}
    if ptl:
        out["producer_first_step_into_epoch1_s"] = round(ptl[0][0] - epoch_start, 3)
    return out


def run_pair(pair, prep, epochs, root, kids, ctx=None, scenarios=ORDER, round_=0, warm_dir=None):
    """Every scenario of one teacher/student pair, each cache-mode run in a fresh cache directory
    that holds only the trainer's test-split cache. Returns {scenario: result}. `round_` > 0: a
    repeat, in directories of its own."""
    tag = pair + ("-" + ctx.replace(":", "") if ctx else "") + (f"-r{round_}" if round_ else "")
    base = os.path.join(root, tag)
    logs, runs = os.path.join(base, "logs"), os.path.join(base, "runs")
    for d in (logs, runs):
        os.makedirs(d, exist_ok=True)
    teacher = prep["pairs"][pair]["prefix"]
    dataset, steps = prep["dataset"], prep["steps_per_epoch"]
    env = child_env(THREADS)
    dirs = {k: os.path.join(base, "caches-" + k) for k in ("online", "ring")}
    for d in dirs.values():
        os.makedirs(d)
        shutil.copy2(prep["test_cache"][pair], d)

    out = {}
    for sc in scenarios:
        run = f"{tag}-{sc}"
        ep = 1 if sc in ONE_EPOCH else epochs
        if sc.startswith("inline_async"):
            workers = 2 if sc == "inline_async_2w" else None
            argv = python_m("bench.kd.children", "async", "--teacher", teacher, "--dataset", dataset, "--epochs", ep,
                            "--batch-size", BATCH, "--student", STUDENT, "--ctx", ctx or "cpu")
            e = child_env(THREADS, **({"MXNET_CPU_WORKER_NTHREADS": workers} if workers else {}))
            res = kids.run(argv, f"{tag} {sc}", env=e, log_dir=logs, cwd=base, rss=RSS)
        else:
            kw = {"student_only": dict(mode="none"),
                  "inline": dict(mode="inline", teacher=teacher),
                  "online": dict(mode="cache", teacher=teacher, cache_dir=dirs["online"]),
                  "warm": dict(mode="cache", teacher=teacher, cache_dir=warm_dir or dirs["online"]),
                  "ring": dict(mode="cache", teacher=teacher, cache_dir=dirs["ring"], store="ring")}[sc]
            res = kids.run(trainer_argv(dataset, runs, run, ep, ctx=ctx, **kw), f"{tag} {sc}", env=env,
                           log_dir=logs, cwd=base, rss=RSS)
            run_dir = os.path.join(runs, run)
            res["run_dir"], res["cache_dir"] = run_dir, kw.get("cache_dir")
            res["history"] = (read_json(os.path.join(run_dir, "metrics.json")) or {}).get("history")
            res["test_producer_started"] = os.path.exists(os.path.join(run_dir, "producer-test.log"))
            if res["test_producer_started"]:
                log(f"    warning: {run} started a producer for the test split (a third process)")
            res["startup"] = startup_note(res, run_dir, steps)
        res["epochs"] = ep
        out[sc] = res
        log(f"  {pair} {sc}: {res['samples_per_s']:.0f} samples/s, epoch 1 {res['epoch1_s']:.2f} s, stall "
            f"{res['stall_s'] if res['stall_s'] is not None else '-'} s, teacher forwards {res['teacher_forwards']}, "
            f"peak RSS {res['_peak_rss_mib']} MiB, {res['_cpu']['tree_cores'] or 0:.2f} cores used, other "
            f"processes {res['_cpu']['other_cores'] or 0:.2f} cores ({res['_wall_s']:.1f} s wall)")
    return out


# The guard's pair: a round after the full ones (--quick) runs only these, warm reading the cache the first
# round's online run filled: the paired warm / student-alone figure a change to the step or the reader is given.
GUARD = ["warm", "student_only"]


def run_rounds(prep, epochs, root, kids, scenarios, rounds, ctx=None, full_rounds=None):
    """`rounds` rounds, each: for every pair, the teacher alone once, then every scenario (round_order);
    rounds after the first `full_rounds` (default: all) run the GUARD scenarios only. Returns (by, alone):
    by[pair] a list of {scenario: result} per round, alone[pair] a list of passes (one per full round)."""
    full_rounds = rounds if full_rounds is None else full_rounds
    by = {pair: [] for pair in prep["pairs"]}
    alone = {pair: [] for pair in prep["pairs"]}
    for r in range(rounds):
        full = r < full_rounds
        for pair, c in prep["pairs"].items():
            log(f"round {r + 1} of {rounds}{'' if full else ' (warm and student alone only)'}, pair {pair}")
            if ctx is None and full:
                alone[pair].append(teacher_alone(pair, c["prefix"], prep["dataset"], root, kids, r))
            order = round_order(scenarios, r) if full else [sc for sc in round_order(scenarios, r) if sc in GUARD]
            warm_dir = None if full else by[pair][0]["online"]["cache_dir"]
            by[pair].append(run_pair(pair, prep, epochs, root, kids, ctx=ctx, scenarios=order, round_=r,
                                     warm_dir=warm_dir))
    return by, alone


def merged(rounds):
    """{scenario: result} over the rounds: the first round's result (memory, forwards, start-up) with the
    medians of samples/s and epoch-1 s across rounds, and each round's figures beside them."""
    out = {}
    for sc in rounds[0]:
        runs = [r[sc] for r in rounds if sc in r]
        res = dict(runs[0])
        res["runs_samples_per_s"] = [x["samples_per_s"] for x in runs]
        res["epoch1_runs"] = [x["epoch1_s"] for x in runs]
        res["startup_runs"] = [x.get("startup") for x in runs]
        res["samples_per_s"] = statistics.median(res["runs_samples_per_s"])
        res["epoch1_s"] = statistics.median(res["epoch1_runs"])
        # a teacher forward or a producer in any round shows (warm must have none in every round)
        res["teacher_forwards"] = max(x.get("teacher_forwards") or 0 for x in runs)
        if "producer_started" in res:
            res["producer_started"] = any(x.get("producer_started") for x in runs)
        peaks = [x.get("_peak_rss_mib") or {} for x in runs]
        res["_peak_rss_mib"] = {k: max(p.get(k, 0.0) for p in peaks) for k in set().union(*peaks)}
        out[sc] = res
    return out


def result_rows(pair, runs, section):
    so = runs["student_only"]["samples_per_s"]
    rows = []
    for sc in SCENARIOS:
        r = runs.get(sc)
        if r is None:
            continue
        rows.append({"pair": pair, "scenario": sc, "section": section, "samples_per_s": r["samples_per_s"],
                     "ratio_to_student_only": round(r["samples_per_s"] / so, 4) if so else None,
                     "epoch1_s": r["epoch1_s"], "epoch2_s": _epoch_s(r, 1), "epochs": r["epochs"],
                     "stall_s": r["stall_s"], "peak_rss_mib": r["_peak_rss_mib"],
                     "teacher_forwards": r["teacher_forwards"], "producer_started": r.get("producer_started"),
                     "wall_s": round(r["_wall_s"], 3), "cpu_cores_used": rounded(r["_cpu"]["tree_cores"]),
                     "other_processes_cores": rounded(r["_cpu"]["other_cores"]),
                     "loadavg_1m": [r["_cpu"]["loadavg_1m_start"], r["_cpu"]["loadavg_1m_end"]],
                     "history": r.get("history"), "startup": r.get("startup"),
                     "epoch1_start_after_launch_s": (r.get("startup") or {}).get("epoch1_start_after_launch_s"),
                     "epoch1_runs": r.get("epoch1_runs"), "startup_runs": r.get("startup_runs"),
                     "runs_samples_per_s": r.get("runs_samples_per_s"),
                     "engine_workers": r.get("engine_workers"),
                     "test_producer_started": r.get("test_producer_started", False)})
    return rows


def _epoch_s(r, i):
    h = r.get("history") or []
    return h[i]["seconds"] if len(h) > i else None


def rounded(v, d=3):
    """v rounded to d digits; None (not measured) stays None."""
    return None if v is None else round(v, d)


# -- the plot ----------------------------------------------------------------------------------------------
def plot_online(res, out_png, title, steps):
    """The producer's and the trainer's schedule positions over time, the trainer's stalls shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run_dir = res["run_dir"]
    tl = (read_json(os.path.join(run_dir, "timeline.json")) or {}).get("steps") or []
    ptl = (read_json(os.path.join(run_dir, "producer-timeline.json")) or {}).get("steps") or []
    if not tl:
        raise RuntimeError(f"bench: {run_dir}/timeline.json is missing or empty: nothing to plot")
    t0 = res["_launched"]
    tt = np.array([s[0] for s in tl]) - t0
    tp = np.array([s[1] for s in tl]) + 1
    wait = np.array([s[2] for s in tl])
    hist = res.get("history") or []
    # epoch e started its last step's time minus its duration (evaluation and checkpoints lie between)
    starts = [tt[(e + 1) * steps - 1] - h["seconds"] for e, h in enumerate(hist) if (e + 1) * steps <= len(tt)]
    fig, (ax, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5), dpi=110, gridspec_kw={"height_ratios": [3, 1]})
    # a step's wait came right before its compute: [end of the previous step, or its epoch's start, + wait]
    prev = np.concatenate([[tt[0] - wait[0]], tt[:-1]])
    for e, a in enumerate(starts):
        prev[e * steps] = a
    merged = []
    for a, w in zip(prev, wait):
        if w <= 1e-3:
            continue
        if merged and a <= merged[-1][1] + 1e-3:
            merged[-1][1] = max(merged[-1][1], a + w)
        else:
            merged.append([a, a + w])
    for i, (a, b) in enumerate(merged):
        ax.axvspan(a, b, color="tab:red", alpha=0.15, lw=0,
                   label=f"trainer waits for targets (> 1 ms; {wait.sum():.1f} s in all)" if i == 0 else None)
    if ptl:
        pt = np.array([s[0] for s in ptl]) - t0
        pp = np.array([s[1] for s in ptl]) + 1
        ax.step(np.concatenate([[pt[0]], pt]), np.concatenate([[0], pp]), where="post", color="tab:blue", lw=4,
                alpha=0.45, label=f"producer (teacher, 1 core): steps done ({int(sum(s[2] for s in ptl))} rows "
                                  f"computed)")
    epochs_txt = ", ".join(f"epoch {e + 1} {h['seconds']:.1f} s" for e, h in enumerate(hist))
    ax.step(np.concatenate([[tt[0]], tt]), np.concatenate([[0], tp]), where="post", color="tab:green", lw=1.4,
            label=f"trainer (student, 1 core): steps done ({epochs_txt})")
    for e, a in enumerate(starts):
        for axis in (ax, ax2):
            axis.axvline(a, color="0.4", ls="--", lw=1, label="epoch starts" if e == 0 and axis is ax else None)
        ax.annotate(f"epoch {e + 1}", (a, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="0.3")
    ax2.bar(prev, wait, width=np.maximum(wait, 0.05), align="edge", color="tab:red", alpha=0.7)
    ax2.set_ylabel("wait before\neach step (s)")
    ax2.set_xlabel("seconds since the trainer was launched")
    ax2.grid(alpha=0.3)
    ax.set_ylabel("schedule steps done (batches of %d)" % BATCH)
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    tmp = out_png + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out_png)
