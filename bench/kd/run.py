"""The KD benchmark's command: its sizes and options, the run (calibration, scenarios, floors) and what it prints."""
import json
import os
import statistics

from bench.common import (ROOT, busy_warning, child_env, heading, machine_line, md_table, python_m,
                          for_the_manual, spread, verdict)
from bench.cli import OUTPUT, RUN, out_option, quick_option, tmp_option
from bench.kd.scenarios import (BATCH, ORDER, REQUIRED, RSS, SEED, STUDENT, TARGETS, THREADS, alone_summary, log,
                                merged, plot_online, result_rows, rounded, run_rounds)
from bench.paired import paired, shown, verdicts_line
from kdcache.args import Int, Option, OutFile

DEFAULT_OUT = os.path.join("bench", "results", "kd.json")
PNG_NAME = "kd_online.png"

# Sizes: full run and --quick. rounds: how many times every scenario and the teacher alone run, interleaved
# (bench.paired NOTE): the floors are decided on the rounds' paired ratios.
# --quick's rounds after the first run the guard's pair alone (warm, student alone: scenarios.GUARD), so that its
# paired figure comes in under three minutes; its other floors rest on one run and are UNMEASURABLE.
FULL = dict(epoch_s=5.0, min_steps=30, max_steps=400, epochs=2, reps=7, tries=4, rounds=4, full_rounds=4)
QUICK = dict(epoch_s=0.75, min_steps=3, max_steps=40, epochs=1, reps=3, tries=1, rounds=5, full_rounds=1)

OPTIONS = [
    quick_option("a data set of about a second per epoch (figures noisier)"),
    out_option(DEFAULT_OUT),
    Option("--png", f"plot path (default: {PNG_NAME} beside --out)", type=OutFile(), metavar="FILE", group=OUTPUT),
    tmp_option("directory for teachers, caches and runs, kept there for inspection (runs, logs; default: a "
               "temporary folder, removed)"),
    Option("--rounds", f"times every scenario runs, interleaved; floors are decided on the paired ratios' median "
           f"(default {FULL['rounds']}; --quick {QUICK['rounds']}, every scenario in the first, warm and the student "
           f"alone in the others)", type=Int(1, 50), metavar="N", group=RUN),
]

FLOORS = {"warm_vs_student_only": 0.97,           # warm samples/s >= 0.97 x student_only samples/s
          "epoch1_vs_slowest_stage": 1.05,        # online/ring epoch 1 <= 1.05 x max(teacher alone, student alone)
          "vs_inline_heavy": 1.5,                 # online samples/s >= 1.5 x inline's, heavy pair
          # The ring pays the slower stage every epoch, so against inline (both stages every epoch) it can reach
          # (student + teacher) / slower stage at most: 1.5 exactly for a teacher at 2x the student's step. Its floor
          # is a share of that ceiling (from the same round's stages alone), not a figure at the ceiling itself.
          "ring_vs_ceiling_heavy": 0.95}          # (ring samples/s / inline's) / the ceiling >= 0.95, heavy pair


def pair_table(rows):
    def mib(d, k):
        return f"{d[k]:.0f}" if d and d.get(k) else "-"
    return md_table(
        ["scenario", "epochs", "samples/s", "ratio to student_only", "epoch 1 starts (s after launch)", "epoch-1 s",
         "epoch-2 s", "stall s", "cores used", "peak RSS trainer MiB", "peak RSS producer MiB", "teacher forwards",
         "other procs (cores)"],
        [[r["scenario"], r["epochs"], f"{r['samples_per_s']:.0f}", f"{r['ratio_to_student_only']:.3f}",
          "-" if r.get("epoch1_start_after_launch_s") is None else f"{r['epoch1_start_after_launch_s']:.2f}",
          f"{r['epoch1_s']:.2f}", "-" if r["epoch2_s"] is None else f"{r['epoch2_s']:.2f}",
          "-" if r["stall_s"] is None else f"{r['stall_s']:.2f}", f"{r['cpu_cores_used'] or 0:.2f}",
          mib(r["peak_rss_mib"], "trainer"), mib(r["peak_rss_mib"], "producer"), r["teacher_forwards"],
          f"{r['other_processes_cores'] or 0:.2f}"] for r in rows])


# -- the manual's tables (docs/benchmarks.md) --------------------------------------------------------------
SCENARIO_NAMES = {"student_only": "student alone", "inline": "inline (GluonCV's way)",
                  "inline_async": "inline, async engine", "online": "kdcache online, cold cache",
                  "warm": "kdcache, warm cache", "ring": "kdcache ring"}


def render(report):
    """[(title, markdown table)]: the CPU section's scenarios and its floors, from the JSON report alone."""
    def num(v, fmt):
        return "-" if v is None else format(v, fmt)
    rows = [[r["pair"], SCENARIO_NAMES[r["scenario"]], f"{r['samples_per_s']:.0f}", f"{r['ratio_to_student_only']:.2f}",
             num(r.get("epoch1_start_after_launch_s"), ".2f"), f"{r['epoch1_s']:.1f}", num(r["stall_s"], ".1f")]
            for r in report["results"] if r["section"] == "cpu" and r["scenario"] in SCENARIO_NAMES]
    scenarios = md_table(["pair", "scenario", "samples/s", "vs student alone", "epoch 1 starts (s after launch)",
                          "epoch-1 s", "stall s"], rows, pad=False)
    fl, stages = report["floors"], report["stages"]

    def of(name, pairs):
        found = [fl[f"{name}:{p}"] for p in pairs if f"{name}:{p}" in fl]
        verdicts = {f["verdict"] for f in found}
        return found, "MISS" if "MISS" in verdicts else "UNMEASURABLE" if "UNMEASURABLE" in verdicts else "PASS"

    def pm(f):
        return f"{f['measured']:.2f}" + ("" if f.get("spread") is None else f" ±{f['spread']:.2f}")

    def slowest(pair):
        st = stages[pair]
        t, s = st["teacher_alone_epoch_s"], st["student_alone_epoch1_s"]
        return f"teacher {t:.2f} s" if t >= s else f"student {s:.2f} s"
    lines = []
    found, v = of("warm_vs_student_only", TARGETS)
    lines.append([f"warm >= {FLOORS['warm_vs_student_only']} x student alone",
                  ", ".join(f"{pm(f)} ({f['pair']})" for f in found), v])
    found, v = of("online_vs_inline_heavy", ["heavy"])
    lines.append([f"online >= {FLOORS['vs_inline_heavy']} x inline, heavy teacher (samples/s)",
                  "".join(pm(f) for f in found), v])
    found, v = of("ring_vs_inline_heavy", ["heavy"])
    lines.append([f"ring >= {FLOORS['ring_vs_ceiling_heavy']} x its ceiling against inline, heavy teacher (samples/s)",
                  "".join(f"{pm(f)} ({f['vs_inline']:.2f}x inline; ceiling {f['ideal_from_stages']:.3f})"
                          if "vs_inline" in f else pm(f) for f in found), v])
    for sc in ("online", "ring"):
        found, v = of(f"{sc}_epoch1_vs_slowest_stage", TARGETS)
        lines.append([f"{sc} epoch 1 <= {FLOORS['epoch1_vs_slowest_stage']} x slowest stage alone",
                      ", ".join(f"{pm(f)} ({f['pair']}" + (f": {slowest(f['pair'])})" if sc == "online" else ")")
                                for f in found), v])
    n = report.get("rounds", 1)
    return [("", scenarios), (f"Floors (median of {n} paired round(s) ± the spread: the half-width of the median's "
                              f"~95% interval, bench.paired):", md_table(["floor", "measured", "verdict"], lines,
                                                                         pad=False))]


# -- floors ------------------------------------------------------------------------------------------------
def floors(by, alone):
    """Every floor of the CPU section, decided on the rounds' paired ratios (bench.paired): run r of a
    scenario against run r of its reference, which ran beside it."""
    out = []
    for pair in TARGETS:
        rounds, passes = by[pair], alone[pair]
        f = paired([r["warm"]["samples_per_s"] / r["student_only"]["samples_per_s"] for r in rounds],
                   FLOORS["warm_vs_student_only"])
        out.append({"floor": "warm_vs_student_only", "pair": pair, **f,
                    "compares": "samples/s of warm / samples/s of student_only, round by round"})
        full = rounds[:len(passes)]  # the rounds that ran every scenario and the teacher alone
        slowest = [max(a["epoch_s"], r["student_only"]["epoch1_s"]) for a, r in zip(passes, full)]
        stages = ["teacher" if a["epoch_s"] >= r["student_only"]["epoch1_s"] else "student"
                  for a, r in zip(passes, full)]
        for sc in ("online", "ring"):
            runs = [r[sc]["epoch1_s"] for r in full]
            waits = [(r[sc].get("startup") or {}).get("first_step_wait_s") for r in full]
            f = paired([e / s_ for e, s_ in zip(runs, slowest)], FLOORS["epoch1_vs_slowest_stage"],
                       higher_is_better=False)
            out.append({"floor": f"{sc}_epoch1_vs_slowest_stage", "pair": pair, **f,
                        "compares": f"epoch-1 s of {sc} (start-up inside) / the slowest stage alone in the same "
                                    f"round ({', '.join(f'{st} {s_:.2f} s' for st, s_ in zip(stages, slowest))})",
                        "startup_wait_s": None if None in waits else round(statistics.median(waits), 3),
                        # informative: the same without the first step's wait for the producer's start-up
                        "measured_without_startup_wait": None if None in waits else
                        round(statistics.median((e - w) / s_ for e, w, s_ in zip(runs, waits, slowest)), 4)})
    passes = alone["heavy"]
    rounds = by["heavy"][:len(passes)]
    s_ = statistics.median(r["student_only"]["epoch1_s"] for r in rounds)
    t_ = statistics.median(a["epoch_s"] for a in passes)
    def ideal(sc, s, t, e):
        # The best any pipeline can do from the stages' own times: inline pays student + teacher every
        # epoch; the ring pays the slower stage every epoch; the cache pays it once, then the student.
        return e * (s + t) / (e * max(s, t) if sc == "ring" else max(s, t) + (e - 1) * s)
    for sc in ("online", "ring"):
        e = rounds[0][sc]["epochs"]
        vs_inline = [r[sc]["samples_per_s"] / r["inline"]["samples_per_s"] for r in rounds]
        ceilings = [ideal(sc, r["student_only"]["epoch1_s"], a["epoch_s"], e) for r, a in zip(rounds, passes)]
        if sc == "online":
            f = paired(vs_inline, FLOORS["vs_inline_heavy"])
        else:
            f = paired([v / c for v, c in zip(vs_inline, ceilings)], FLOORS["ring_vs_ceiling_heavy"])
        e1 = statistics.median(r["inline"]["epoch1_s"] / r[sc]["epoch1_s"] for r in rounds)
        out.append({"floor": f"{sc}_vs_inline_heavy", "pair": "heavy", **f,
                    "compares": (f"samples/s of {sc} / samples/s of inline" if sc == "online" else
                                 "(samples/s of ring / samples/s of inline) / its ceiling from the same round's stages")
                                + f", round by round, over {e} epoch(s) of training time (epoch-1 time of inline / "
                                  f"of {sc}: {e1:.3f}, median; ideal from the stages alone, no start-up: "
                                  f"{ideal(sc, s_, t_, e):.3f})",
                    "vs_inline": paired(vs_inline, FLOORS["vs_inline_heavy"])["measured"],
                    "vs_inline_runs": [round(v, 4) for v in vs_inline],
                    "epoch1_ratio": round(e1, 4), "ideal_from_stages": round(ideal(sc, s_, t_, e), 4),
                    "ceilings": [round(c, 4) for c in ceilings]})
    return out


def floors_table(fl):
    def aside(f):
        if f.get("measured_without_startup_wait") is None:
            return ""
        return f"{f['measured_without_startup_wait']:.3f} (first wait {f['startup_wait_s']:.2f} s, median)"
    return md_table(["floor", "pair", "median ± spread (runs)", "limit", "verdict", "without start-up wait",
                     "compares"],
                    [[f["floor"], f["pair"], shown(f), f["limit"], f["verdict"], aside(f), f["compares"]] for f in fl])


# -- the run -----------------------------------------------------------------------------------------------
DESCRIPTION = ("kdcache end to end: student alone, inline KD, inline on the async engine, and the cache (online, warm, "
               "ring) with a light and a heavy teacher, one core each. Prints markdown tables, writes a JSON report "
               "and a plot of the heavy pair's online run.")


def params(parser, args):
    """The sizes of a full or a quick run (--rounds over either's)."""
    p = dict(QUICK if args.quick else FULL)
    if args.rounds is not None:
        p["rounds"] = args.rounds
        p["full_rounds"] = min(p["full_rounds"], args.rounds) if args.quick else args.rounds
    return p


def run(kids, args, p, root):
    """Calibrate the pairs, time the stages alone, run every scenario of each pair: the report."""
    png = args.png or os.path.join(os.path.dirname(os.path.abspath(args.out)), PNG_NAME)
    load_start = os.getloadavg()
    log(f"{'quick' if args.quick else 'full'} run, temp dir {root}, load average {load_start[0]:.2f} "
        f"{load_start[1]:.2f} {load_start[2]:.2f}")
    log("calibrating the teachers against the student's step, sizing the data set (one process, 1 thread)")
    sizes = {k: p[k] for k in ("reps", "tries", "epoch_s", "min_steps", "max_steps")}
    prep = kids.run(python_m("bench.kd.children", "prepare", "--root", root, "--sizes", json.dumps(sizes)),
                    "prepare", env=child_env(THREADS), log_dir=root, cwd=root, rss=RSS)
    n, steps, dataset, epochs = prep["n"], prep["steps_per_epoch"], prep["dataset"], p["epochs"]
    for pair, c in prep["pairs"].items():
        log(f"  {pair}: width {c['width']} + {c['extra_convs']} convs, forward {c['forward_ms']:.1f} ms vs "
            f"student step {c['step_ms']:.1f} ms per batch of {BATCH}: ratio {c['ratio']:.3f} (target "
            f"{c['target']:.3f})")
    log(f"data set {dataset}: {steps} steps of {BATCH} per epoch (~{steps * prep['student_step_ms'] / 1e3:.1f} s "
        f"of student), {epochs} epoch(s), {p['rounds']} round(s), every scenario in {p['full_rounds']} of them")
    scenarios = [sc for sc in ORDER if sc in REQUIRED or not args.quick]

    rounds, passes = run_rounds(prep, epochs, root, kids, scenarios, p["rounds"], full_rounds=p["full_rounds"])
    by = {pair: merged(rounds[pair]) for pair in TARGETS}
    alone = {pair: alone_summary(passes[pair]) for pair in TARGETS}
    fl = floors(rounds, passes)
    for f in fl:
        log(f"  {f['floor']} ({f['pair']}): {shown(f)} {f['limit']}: {f['verdict']}")
    gpu = {"skipped": True, "reason": "MXNet sees no GPU (mxnet.context.num_gpus() == 0): CPU-only machine",
           "results": []}
    if prep.get("num_gpus", 0) > 0:
        gpu = {"skipped": False, "reason": None, "ctx": "gpu:0", "results": [], "error": None}
        try:
            log("GPU section (student on gpu:0, teacher on the CPU), one round")
            gpu_rounds, _ = run_rounds(prep, epochs, root, kids, scenarios, 1, ctx="gpu:0")
            for pair in TARGETS:
                gpu["results"] += result_rows(pair, merged(gpu_rounds[pair]), "gpu")
        except RuntimeError as e:  # keep the CPU section's report; the exit status says it failed
            gpu["error"] = str(e)
            log(f"GPU section failed: {e}")
    else:
        log("GPU section skipped: MXNet sees no GPU")
    heavy_online = by["heavy"]["online"]
    plot_online(heavy_online, png,
                f"kdcache online, heavy teacher (forward {prep['pairs']['heavy']['ratio']:.2f}x the student's "
                f"step), cold cache: {n} samples, batch {BATCH}, 1 core each", steps)
    load_end = os.getloadavg()

    results = [row for pair in TARGETS for row in result_rows(pair, by[pair], "cpu")]
    calibration = {"student": STUDENT, "batch": BATCH, "threads": THREADS,
                   "student_step_ms": round(prep["student_step_ms"], 2),
                   "pairs": {k: {"width": v["width"], "extra_convs": v["extra_convs"], "forward_ms": round(v["forward_ms"], 2),
                                 "student_step_ms": round(v["step_ms"], 2), "ratio": round(v["ratio"], 4),
                                 "target": round(v["target"], 4), "teacher_parameters": v["parameters"],
                                 "tries": [{k2: (round(x, 4) if isinstance(x, float) else x) for k2, x in t.items()
                                            if k2 != "prefix"} for t in v["tries"]]}
                             for k, v in prep["pairs"].items()}}
    stages = {pair: {"teacher_alone_rows_per_s": round(alone[pair]["rows_per_s"], 1),
                     "teacher_alone_epoch_s": round(alone[pair]["epoch_s"], 3),
                     "teacher_alone_loop_s": round(alone[pair]["loop_s"], 3),
                     "teacher_alone_forward_s": round(alone[pair]["teacher_s"], 3),
                     "teacher_alone_passes_rows_per_s": alone[pair]["passes_rows_per_s"],
                     "teacher_alone_passes_epoch_s": [round(v, 3) for v in alone[pair]["passes_epoch_s"]],
                     "student_alone_epoch1_s": statistics.median(by[pair]["student_only"]["epoch1_runs"]),
                     "student_alone_epoch1_runs": by[pair]["student_only"]["epoch1_runs"]} for pair in TARGETS}
    others = spread(r["other_processes_cores"] for r in results)
    return {
        "results": results,
        "floors": {f"{f['floor']}:{f['pair']}": f for f in fl},
        "all_pass": all(f["verdict"] == "PASS" for f in fl),
        "rounds": p["rounds"], "full_rounds": p["full_rounds"],
        "calibration": calibration,
        "stages": stages,
        "startup": {pair: {sc: by[pair][sc].get("startup") for sc in ("online", "ring")} for pair in TARGETS},
        "settings": {"dataset": dataset, "n": n, "steps_per_epoch": steps, "epochs": epochs, "batch": BATCH,
                     "student": STUDENT, "threads_per_process": THREADS, "seed": SEED,
                     "inline_async": {"omp_num_threads": THREADS, "mxnet_cpu_worker_nthreads": 1},
                     "inline_async_2w": {"omp_num_threads": THREADS, "mxnet_cpu_worker_nthreads": 2}},
        "gpu": gpu,
        "load": {"loadavg_start": [round(v, 2) for v in load_start], "loadavg_end": [round(v, 2) for v in load_end],
                 "other_processes_cores_mean": rounded(others["mean"]),
                 "other_processes_cores_max": rounded(others["max"])},
        "plot": os.path.relpath(png, ROOT) if os.path.abspath(png).startswith(ROOT + os.sep) else png,
    }


# -- what it prints ----------------------------------------------------------------------------------------
def show(report):
    """The tables, from the report alone; 1 when the GPU section failed (its CPU section is kept)."""
    results, calibration, stages, gpu = report["results"], report["calibration"], report["stages"], report["gpu"]
    fl, st_, ld = list(report["floors"].values()), report["settings"], report["load"]
    dataset, steps, epochs = st_["dataset"], st_["steps_per_epoch"], st_["epochs"]
    repeats = report.get("rounds", 1)
    print(heading("kdcache KD benchmark", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]))
    print(f"load average (1/5/15 min): {' '.join(f'{v:.2f}' for v in ld['loadavg_start'])} at the start, "
          f"{' '.join(f'{v:.2f}' for v in ld['loadavg_end'])} at the end; other processes kept "
          f"{ld['other_processes_cores_mean'] or 0:.2f} cores busy on average during the runs "
          f"(worst {ld['other_processes_cores_max'] or 0:.2f}) of {os.cpu_count()}\n")
    print(f"Data: {dataset}, batch {BATCH}, {steps} steps per epoch, {epochs} epoch(s); student {STUDENT}; "
          f"every MXNet process OMP_NUM_THREADS={THREADS}.\n")
    print("## Calibration (one thread, batch of %d)\n" % BATCH)
    print(md_table(["pair", "teacher width + extra convs", "teacher params", "teacher forward ms", "student step ms",
                    "ratio (measured)", "target", "teacher alone rows/s", "teacher alone epoch s",
                    "student alone epoch-1 s (median)"],
                   [[pair, f"{c['width']} + {c['extra_convs']}", f"{c['teacher_parameters']:,}", f"{c['forward_ms']:.1f}",
                     f"{c['student_step_ms']:.1f}", f"{c['ratio']:.3f}", f"{c['target']:.3f}",
                     f"{stages[pair]['teacher_alone_rows_per_s']:.0f}", f"{stages[pair]['teacher_alone_epoch_s']:.2f}",
                     f"{stages[pair]['student_alone_epoch1_s']:.2f}"] for pair, c in calibration["pairs"].items()]))
    print("\nTeacher: (Conv-BN-ReLU x2, MaxPool) at widths w, 2w, 4w with the extra Conv-BN-ReLU at 4w, global "
          "average pool, Dense(10); forward via "
          "pipeline.teacher (the producer's and inline mode's runner). Teacher alone: the producer's offline loop "
          "(cache_builder.produce.produce_offline) as `python -m kdcache.cache_builder --threads 1` runs it in a process of "
          f"its own, filling the train split into a fresh cache, nothing else running: rows/s of the loop (start-up "
          f"excluded), one pass per round, median of {repeats}. Student alone: student_only's epoch 1, median of "
          f"{repeats} run(s). Every scenario ran {repeats} time(s), interleaved (round by round, the order reversed "
          f"every second round); each figure below is the median of its rounds, each floor the median of the "
          f"rounds' paired ratios.\n")
    for pair in TARGETS:
        rows = [r for r in results if r["pair"] == pair]
        print(f"## {pair} teacher (forward {calibration['pairs'][pair]['ratio']:.2f}x the student's step)\n")
        print(pair_table(rows))
        st = report["startup"][pair]
        notes = []
        for sc in ("online", "ring"):
            s = st.get(sc) or {}
            if s:
                notes.append(f"{sc}: epoch 1 began {s['epoch1_start_after_launch_s']:.1f} s after launch; its first step "
                             f"waited {s['first_step_wait_s']:.2f} s for the producer's start-up (inside epoch1_s)"
                             + (f"; the producer finished its first step {s['producer_first_step_into_epoch1_s']:.2f} s "
                                f"into epoch 1" if "producer_first_step_into_epoch1_s" in s else ""))
        print("\n" + "; ".join(notes) + ".\n")
    print("samples/s: training time only (epochs; set-up, evaluation and checkpoints excluded). epoch 1 starts: "
          "seconds from the trainer's launch to its first step's fetch (its own start-up; for online, also any wait "
          "for the producer to create the cache). epoch-1 s: the trainer's epoch1_s; for online and ring it "
          "includes whatever of the producer's start-up (MXNet import, data, teacher load) and first batch the "
          "trainer's own start-up did not cover. stall s: the trainer's wait for batches/targets "
          "(not measured in inline_async). cores used: CPU time of the process tree / its wall time. "
          "inline_async: MXNET_CPU_WORKER_NTHREADS unset (1 engine worker); inline_async_2w: 2 workers, so the "
          "engine may use both cores (the budget of online/ring, not of inline). Peak RSS: VmHWM sampled every "
          "0.2 s.\n")
    print("## Floors\n")
    print(floors_table(fl) + "\n")
    warning = busy_warning(ld["other_processes_cores_max"], "a scenario")
    if warning:
        print(warning)
    print("## GPU section\n")
    if gpu["skipped"]:
        print(f"skipped: {gpu['reason']}\n")
    elif gpu.get("error"):
        print(f"failed: {gpu['error'][-2000:]}\n")
    else:
        for pair in TARGETS:
            print(f"### {pair} teacher, student on gpu:0, teacher on the CPU\n")
            print(pair_table([r for r in gpu["results"] if r["pair"] == pair]) + "\n")
    print(verdicts_line({f"{f['floor']} ({f['pair']}, " + ("one run" if f["spread"] is None else
                                                         f"±{f['spread']:.3f}") + ")": f["verdict"] for f in fl}))
    print("\n" + for_the_manual(render(report)))
    print(f"Plot: {report['plot']}")
    return 1 if gpu.get("error") else 0

