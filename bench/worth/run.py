"""What the cache buys at equal compute: the runs, the report and its tables (python -m bench.worth)."""
import os

from bench.common import limit_threads

limit_threads(os.environ)  # before anything loads MXNet or BLAS: one compute thread here, as in every child

import json  # noqa: E402
import math  # noqa: E402

from bench.cli import RUN, given_teacher, like, out_option, quick_option, tmp_option, trainer_option  # noqa: E402
from bench.common import heading, machine_line, make_log, md_table, python_m, rendered  # noqa: E402
from bench.common import run_line, run_tasks, spread, verdict  # noqa: E402
from bench.flops import cpu_id, peak_line  # noqa: E402
from bench.quality.run import DATA_ROOT, INSTALL, TEACHER, data_root, teacher_task, write_slice  # noqa: E402
from kdcache.args import Dir, Int, Option  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "worth.json")

# The students and their recipe: bench.quality's (SGD, momentum 0.9, a cosine schedule after one warm-up epoch,
# every training image, T = 4); what changes here is how many epochs each gets: as many as its budget buys.
STUDENTS = {"mlp800x2": {"lr": 0.1, "batch_size": 128}, "small_cnn_flat": {"lr": 0.1, "batch_size": 128}}
KD = {"temperature": 4.0, "alpha": 0.5}
# Budgets in seconds of one core, each student process on its own core (1 thread), start-up and the final test
# pass included; a cache student's budget also pays its cache's fill (the teacher's forwards), once per
# student ("charged") or shared by every student that reads the same cache ("amortised").
BUDGETS = (120, 360)
QUICK_BUDGETS = (10, 16)
# The patient and consistent teacher (Beyer et al. 2022): one cache of V keyed views with mixup, filled once,
# against the same budget spent on the same augmentation inline (the teacher sees each mixed image once) and
# from scratch. Its own budget: one that buys the patient student >= 50 epochs after its fill (15 minutes of
# one core here: the fill of 8 views ~2 min, an epoch of mixed views ~14 s). One student takes these rows (the
# small CNN: crops and flips are views a convolution can use); --quick's one student otherwise.
PATIENT = {"views": 8, "augment": "crop:2,flip,mixup:0.2", "student": "small_cnn_flat", "budget_s": 900}
QUICK_PATIENT = {"views": 2, "augment": "crop:2,flip,mixup:0.2", "student": "mlp800x2", "budget_s": 20}
PATIENT_EPOCHS = 50  # the long schedule a patient teacher needs: a floor on the patient student's epochs, reported
# A sweep: N students that differ in network, T and alpha, from one cache against the same N inline.
SWEEP = [("mlp800x2", 4.0, 0.5), ("mlp800x2", 8.0, 0.7), ("small_cnn_flat", 4.0, 0.5), ("small_cnn_flat", 2.0, 0.9)]
SWEEP_EPOCHS, QUICK_SWEEP_EPOCHS = 2, 1
FULL = dict(seeds=3, **KD)
QUICK = dict(seeds=1, **KD)
QUICK_STUDENTS = ("mlp800x2",)  # --quick: one student, one seed (the sweep keeps both networks)
QUICK_TEACHER_EPOCHS = 2
FLOORS = {"cache_minus_inline": 0.005, "cache_minus_scratch": 0.01}
GAP_FLOOR = 0.6
CALIBRATION = (1, 3)  # epochs of the two calibration runs of each way
MODES = ("scratch", "inline", "cache", "cache_amortised")

log = make_log("worth")

OPTIONS = [
    Option("--seeds", "student seeds 0..N-1 (default 3; --quick 1)", type=Int(1, 100), metavar="N", group=RUN),
    Option("--jobs", "children run at once, one compute thread each (default 2)", type=Int(1, 64), default=2,
           metavar="N", group=RUN),
    Option("--budget-scale", "every budget times this (default 1: "
           f"{', '.join(f'{b // 60} min' for b in BUDGETS)} of one core)", type=Int(1, 100), default=1, metavar="K",
           group=RUN),
    Option("--data-root", f"the folder of Fashion-MNIST's IDX files (default {DATA_ROOT}, where `{INSTALL}` puts "
           f"them)", type=Dir(), metavar="DIR", group=RUN),
    like(trainer_option("teacher"), "reuse this teacher checkpoint instead of training one", metavar="PREFIX",
         group="teacher"),
    quick_option("the first 2,000 training and 1,000 test images, a 2-epoch teacher, budgets of "
                 f"{' and '.join(map(str, QUICK_BUDGETS))} s, one student ({', '.join(QUICK_STUDENTS)}), one seed, "
                 f"{QUICK_PATIENT['views']} patient views (~3 min)"),
    out_option(DEFAULT_OUT, "JSON report"),
    tmp_option("work directory for the teacher, the caches and the runs (default: a new temporary directory, "
               "removed at the end; a directory given here is kept)"),
    Option("--resume", "work in DIR (made if missing) and keep it there with a journal of the runs that "
           "finished: the same command with the same DIR again runs only what is missing (a stopped full run "
           "resumes)", type=Dir(), metavar="DIR", group=RUN),
]


def params(ap, args):
    """The run's parameters; a missing data set or a contradictory option ends it with one line, before
    anything is trained."""
    root = data_root(ap, args)
    given_teacher(ap, args)
    p = dict(QUICK if args.quick else FULL)
    p["teacher"] = dict(TEACHER, epochs=QUICK_TEACHER_EPOCHS if args.quick else TEACHER["epochs"])
    p["budgets"] = [b * args.budget_scale for b in (QUICK_BUDGETS if args.quick else BUDGETS)]
    p["patient"] = dict(QUICK_PATIENT if args.quick else PATIENT)
    p["patient"]["budget_s"] *= args.budget_scale
    p["sweep_epochs"] = QUICK_SWEEP_EPOCHS if args.quick else SWEEP_EPOCHS
    if args.seeds is not None:
        p["seeds"] = args.seeds
    students = {k: v for k, v in STUDENTS.items() if not args.quick or k in QUICK_STUDENTS}
    p.update(data_root=os.path.abspath(root), jobs=args.jobs, students=students)
    return p


# -- the children ------------------------------------------------------------------------------------------
def data_args(p):
    return ["--dataset", p["dataset"], "--data-root", p["data_path"]]


def fill_task(p, prefix, work, key, *, views=1, augment=None, seed=0):
    extra = ["--views", views, "--seed", seed] + (["--augment", augment] if augment else [])
    argv = python_m("kdcache.cache_builder", "--teacher", prefix, *data_args(p), *extra,
                    "--cache-dir", os.path.join(work, "caches"), "--threads", 1, "--quiet", "--json")
    return {"key": key, "argv": argv, "what": f"filling {key}", "after": ["teacher"], "timeout": 3600}


def student_task(p, prefix, work, key, student, mode, seed, epochs, *, after=(), views=1, augment=None,
                 temperature=None, alpha=None):
    b = STUDENTS[student]  # the recipe (the sweep reaches networks --quick leaves out)
    name = "-".join(str(k) for k in key)
    teacher = [] if mode == "none" else ["--teacher", prefix]
    aug = ["--views", views] + (["--augment", augment] if augment else [])
    argv = python_m("kdcache.trainer", *data_args(p), *teacher, "--teacher-mode", mode, "--student", student,
                    "--epochs", epochs, "--lr", repr(b["lr"]), "--batch-size", b["batch_size"],
                    "--optimizer", "sgd", "--momentum", 0.9, "--lr-mode", "cosine",
                    "--warmup-epochs", min(1, epochs - 1), "--val-fraction", 0, *aug,
                    "--temperature", repr(temperature or p["temperature"]), "--alpha", repr(alpha or p["alpha"]),
                    "--seed", seed, "--threads", 1, "--quiet", "--json",
                    *(["--no-producer"] if mode == "cache" else []),
                    "--runs-dir", os.path.join(work, "runs"), "--cache-dir", os.path.join(work, "caches"),
                    "--run", name)
    return {"key": key, "argv": argv, "what": f"{name} ({epochs} epoch(s))", "after": list(after),
            "timeout": 7200, "scratch": os.path.join(work, "runs", name)}


KEEP = ("test_acc", "teacher_test_acc", "teacher_forwards", "wall_s", "epoch1_s", "epochs", "fingerprint", "_wall_s")


def kept(res):
    return {k: res.get(k) for k in KEEP}


def epochs_for(budget, cost, charge=0.0):
    """The epochs a budget buys: what is left after the start-up, the test pass and `charge` (a cache's fill),
    over one epoch's time, at least one."""
    return max(1, int(math.floor((budget - cost["overhead_s"] - charge) / cost["epoch_s"])))


# -- the run ---------------------------------------------------------------------------------------------
def run(kids, args, p, work):
    if args.resume:
        work = os.path.abspath(args.resume)
        os.makedirs(work, exist_ok=True)
    seeds = list(range(p["seeds"]))
    if args.quick:
        p["data_path"] = os.path.join(work, "fashion-mnist-slice.npz")
        sizes = write_slice(p["data_root"], p["data_path"])
        p["dataset"], n_train, n_test = "npz", sizes["train"], sizes["test"]
    else:
        p["data_path"], p["dataset"], n_train, n_test = p["data_root"], "fashion-mnist", 60000, 10000
    pat = p["patient"]
    journal = os.path.join(work, "finished.jsonl") if args.resume else None

    # 0. this core's peak, measured alone before anything else runs: every figure is read against it
    peak = run_tasks(kids, 1, [{"key": "peak", "argv": python_m("bench.decode.children", "peak", 3 if args.quick else 5),
                                "what": "the peak (one core, alone)", "timeout": 600}], log, journal)["peak"]

    # 1. the teacher, the plain cache and one patient cache per seed (its views are keyed by the seed)
    tasks = []
    if args.teacher:
        prefix = os.path.abspath(args.teacher)
        info = f"{prefix}-info.json"
        teacher = {**(json.load(open(info)) if os.path.exists(info) else {}), "trained_here": False}
    else:
        prefix = os.path.join(work, "teacher", "fashion-mnist")
        tasks.append(teacher_task(p, prefix))
        teacher = {**p["teacher"], "trained_here": True}
    tasks.append(fill_task(p, prefix, work, "fill"))
    tasks += [fill_task(p, prefix, work, ("fill_patient", s), views=pat["views"], augment=pat["augment"], seed=s)
              for s in seeds]
    # 2. each way run for one and for three epochs on seed 0 (beside the fills): the difference is what two epochs
    #    cost here (the training and each epoch's test pass), the rest of the one-epoch run its start-up and end
    calib = []
    ways = (("scratch", "none", [], {}), ("inline", "inline", ["teacher"], {}), ("cache", "cache", ["fill"], {}),
            ("scratch_aug", "none", [], {"augment": pat["augment"]}),
            ("inline_aug", "inline", ["teacher"], {"augment": pat["augment"]}),
            ("patient", "cache", [("fill_patient", 0)], {"views": pat["views"], "augment": pat["augment"]}))
    for s in p["students"]:
        calib += [student_task(p, prefix, work, ("calib", s, m, e), s, tm, 0, e, after=aft, **kw)
                  for m, tm, aft, kw in ways for e in CALIBRATION
                  if m in MODES or s == pat["student"]]
    for t in tasks + calib:
        t["after"] = [k for k in t.get("after", ()) if k != "teacher" or not args.teacher]
    log(f"{len(tasks) + len(calib)} children first: the teacher, the fills and the calibration of each way")
    res = run_tasks(kids, p["jobs"], tasks + calib, log, journal)
    if not args.teacher:
        with open(f"{prefix}-info.json") as fh:
            teacher.update(json.load(fh), wall_s=round(res["teacher"]["_wall_s"], 1))
    costs = {}
    for s in p["students"]:
        for m, *_ in ways:
            if ("calib", s, m, CALIBRATION[0]) not in res:
                continue  # a patient way of another student
            (e1, w1), (e2, w2) = ((e, res[("calib", s, m, e)]["_wall_s"]) for e in CALIBRATION)
            # never less than the one epoch the trainer timed itself: two runs' difference can be noise
            epoch = max((w2 - w1) / (e2 - e1), res[("calib", s, m, e1)]["epoch1_s"] or 0.0, 0.01)
            costs[(s, m)] = {"epoch_s": round(epoch, 2), "overhead_s": round(max(0.0, w1 - e1 * epoch), 2)}
    fills = {"plain": {"wall_s": round(res["fill"]["_wall_s"], 1), "teacher_forwards": res["fill"]["teacher_forwards"]},
             "patient": [{"seed": s, "wall_s": round(res[("fill_patient", s)]["_wall_s"], 1),
                          "teacher_forwards": res[("fill_patient", s)]["teacher_forwards"]} for s in seeds]}
    plain_readers = len(p["students"]) * len(seeds) * len(p["budgets"])  # every plain-cache student shares its fill
    p["plain_readers"] = plain_readers

    # 3. each budget, each student, each seed: scratch, inline, cache (its fill charged), cache (fill amortised);
    #    then the patient rows at their own budget
    runs, plan = [], {}
    for budget in p["budgets"]:
        for s in p["students"]:
            c = lambda m: costs[(s, m)]  # noqa: E731
            ep = {"scratch": epochs_for(budget, c("scratch")), "inline": epochs_for(budget, c("inline")),
                  "cache": epochs_for(budget, c("cache"), fills["plain"]["wall_s"]),
                  "cache_amortised": epochs_for(budget, c("cache"), fills["plain"]["wall_s"] / plain_readers)}
            plan[(budget, s)] = ep
    pb, ps = pat["budget_s"], pat["student"]
    c = lambda m: costs[(ps, m)]  # noqa: E731
    pf = sum(f["wall_s"] for f in fills["patient"]) / len(seeds)
    plan[(pb, ps)] = {"scratch_aug": epochs_for(pb, c("scratch_aug")), "inline_aug": epochs_for(pb, c("inline_aug")),
                      "patient": epochs_for(pb, c("patient"), pf)}
    for (budget, s), ep in plan.items():
        for seed in seeds:
            for m, e in ep.items():
                tm = {"scratch": "none", "scratch_aug": "none", "inline": "inline", "inline_aug": "inline"}.get(m, "cache")
                kw = {"augment": pat["augment"]} if m in ("scratch_aug", "inline_aug") else {}
                if m == "patient":
                    kw = {"views": pat["views"], "augment": pat["augment"]}
                if m == "cache_amortised" and e == ep["cache"]:
                    continue  # the same run as "cache"
                runs.append(student_task(p, prefix, work, (budget, s, m, seed), s, tm, seed, e, **kw))
    # 4. the sweep: N students that differ in network, T and alpha, inline and from the plain cache
    for i, (s, t, a) in enumerate(SWEEP):
        for tm in ("inline", "cache"):
            runs.append(student_task(p, prefix, work, ("sweep", i, tm), s, tm, 0, p["sweep_epochs"],
                                     temperature=t, alpha=a))
    runs.sort(key=lambda t: -t["argv"].count("inline"))  # the longest (inline) first, so the two cores end together
    log(f"{len(runs)} student runs, {p['jobs']} at a time")
    res.update(run_tasks(kids, p["jobs"], runs, log, journal))
    report = report_of(p, seeds, teacher, fills, costs, plan, res, n_train, n_test, bool(args.quick))
    report.update(peak={k: v for k, v in peak.items() if not k.startswith("_")}, cpu_id=cpu_id(),
                  children_core_s=round(sum(r["_wall_s"] for r in res.values()), 1))  # however many resumes
    return report


def charged(way, fills, n_seeds, readers):
    """{teacher_forwards, wall_s} of a cache's fill charged to one student of `way`: the whole plain fill
    ("cache"), its share among every student reading it ("cache_amortised"), the seed's own patient fill
    (one per seed: the views are keyed by it; their mean), nothing for the other ways."""
    if way == "cache":
        return fills["plain"]
    if way == "cache_amortised":
        return {k: fills["plain"][k] / readers for k in ("teacher_forwards", "wall_s")}
    if way == "patient":
        return {k: sum(f[k] for f in fills["patient"]) / n_seeds for k in ("teacher_forwards", "wall_s")}
    return {"teacher_forwards": 0, "wall_s": 0.0}


def report_of(p, seeds, teacher, fills, costs, plan, res, n_train, n_test, quick):
    readers = p["plain_readers"]  # every plain-cache student, counted once in run()
    t_acc = res[("calib", next(iter(p["students"])), "inline", CALIBRATION[0])]["teacher_test_acc"]

    def rows_of(budget, s):
        rows = {}
        for m, e in plan[(budget, s)].items():
            src = "cache" if m == "cache_amortised" and e == plan[(budget, s)]["cache"] else m
            per = [kept(res[(budget, s, src, seed)]) for seed in seeds]
            acc = spread([r["test_acc"] for r in per])
            fill = charged(m, fills, len(seeds), readers)  # the fill's share of this way, per seed
            rows[m] = {"epochs": e, "acc": {k: acc[k] for k in ("mean", "std", "min", "max")},
                       "accs": [r["test_acc"] for r in per],
                       "teacher_forwards": sum(r["teacher_forwards"] or 0 for r in per)
                       + round(fill["teacher_forwards"] * len(seeds)),
                       "fill_s": round(fill["wall_s"], 1),
                       "wall_s": round(sum(r["_wall_s"] for r in per) / len(per), 1)}
        return rows

    budgets = []
    for budget in p["budgets"]:
        students = {}
        for s in p["students"]:
            rows = rows_of(budget, s)
            sc, inl, ca = (rows[m]["acc"]["mean"] for m in ("scratch", "inline", "cache"))
            students[s] = {"rows": rows, "cache_minus_inline": ca - inl, "cache_minus_scratch": ca - sc}
        budgets.append({"budget_s": budget, "students": students})
    pb, ps = p["patient"]["budget_s"], p["patient"]["student"]
    rows = rows_of(pb, ps)
    base, mean = rows["scratch_aug"]["acc"]["mean"], rows["patient"]["acc"]["mean"]
    patient = {"budget_s": pb, "student": ps, "rows": rows,
               "gap_closed": (mean - base) / (t_acc - base) if t_acc > base else None,
               "patient_minus_inline_aug": mean - rows["inline_aug"]["acc"]["mean"],
               "patient_minus_scratch_aug": mean - base}
    sweep = {tm: {"teacher_forwards": sum(res[("sweep", i, tm)]["teacher_forwards"] for i in range(len(SWEEP)))
                  + (fills["plain"]["teacher_forwards"] if tm == "cache" else 0),
                  "wall_s": round(sum(res[("sweep", i, tm)]["_wall_s"] for i in range(len(SWEEP)))
                                  + (fills["plain"]["wall_s"] if tm == "cache" else 0), 1),
                  "accs": [res[("sweep", i, tm)]["test_acc"] for i in range(len(SWEEP))]}
             for tm in ("inline", "cache")}
    checks = [(b["budget_s"], s, v) for b in budgets for s, v in b["students"].items()]
    verdicts = {k: {"floor": f, "values": {f"{b}s {s}": v[k] for b, s, v in checks},
                    "verdict": "PASS" if all(v[k] >= f for _, _, v in checks) else "MISS"}
                for k, f in FLOORS.items()}
    g = patient["gap_closed"]
    verdicts["patient_gap_closed"] = {"floor": GAP_FLOOR, "value": g,
                                      "verdict": verdict(-1.0 if g is None else g, GAP_FLOOR)}
    e = rows["patient"]["epochs"]
    verdicts["patient_epochs"] = {"floor": PATIENT_EPOCHS, "value": e, "verdict": verdict(e, PATIENT_EPOCHS)}
    return {
        "settings": {"dataset": "fashion-mnist", "data": p["dataset"], "teacher": p["teacher"],
                     "students": p["students"], "seeds": seeds, "temperature": p["temperature"], "alpha": p["alpha"],
                     "budgets_s": p["budgets"], "patient": p["patient"], "sweep": SWEEP,
                     "sweep_epochs": p["sweep_epochs"], "threads": 1, "jobs": p["jobs"], "codec": "full",
                     "dtype": "float16"},
        "n_train": n_train, "n_test": n_test, "teacher": {**teacher, "test_acc": t_acc},
        "fills": fills, "costs": {f"{s} {m}": c for (s, m), c in costs.items()},
        "budgets": budgets, "patient": patient, "sweep": sweep, "verdicts": verdicts, "quick": quick,
    }


# -- what it prints -----------------------------------------------------------------------------------------
LABELS = {"scratch": "from scratch", "inline": "distilled inline", "cache": "from the cache (fill charged)",
          "cache_amortised": "from the cache (fill amortised)", "scratch_aug": "from scratch, mixup views",
          "inline_aug": "inline, mixup views", "patient": "patient cache (V views, mixup)"}


def pct(x):
    return f"{100 * x:.2f}%"


def budget_table(b):
    body = []
    for s, v in b["students"].items():
        for m, r in v["rows"].items():
            a = r["acc"]
            std = f"± {100 * a['std']:.2f}" if len(r["accs"]) > 1 else "(one seed)"
            fill = f" + {r['fill_s']:.0f} s fill" if r.get("fill_s") else ""
            body.append([s, LABELS[m], r["epochs"], f"{pct(a['mean'])} {std}", f"{r['teacher_forwards']:,}",
                         f"{r['wall_s']:.0f} s{fill}"])
    return md_table(["student", "way", "epochs", "test accuracy (mean ± std)",
                     "teacher forwards (all seeds, fills charged)", "wall per run"], body, pad=False)


def sweep_table(report):
    sw, n = report["sweep"], len(report["settings"]["sweep"])
    who = ", ".join(f"{s} T={t:g} α={a:g}" for s, t, a in report["settings"]["sweep"])
    return md_table([f"sweep of {n} students ({who}), {report['settings']['sweep_epochs']} epoch(s) each",
                     "teacher forwards", "wall (one core, all students)", "their test accuracies"],
                    [[tm, f"{sw[tm]['teacher_forwards']:,}", f"{sw[tm]['wall_s']:.0f} s",
                      ", ".join(pct(a) for a in sw[tm]["accs"])] for tm in ("inline", "cache")], pad=False)


def floors_table(report):
    """Each floor, what was measured where it applies, and its verdict."""
    v, rows = report["verdicts"], []
    for k, what in (("cache_minus_inline", "cache − inline"), ("cache_minus_scratch", "cache − scratch")):
        rows.append([f"{what}, every budget and student", f"≥ +{100 * v[k]['floor']:.2f} point",
                     "; ".join(f"{where}: {100 * x:+.2f}" for where, x in v[k]["values"].items()), v[k]["verdict"]])
    pt, g, e = report["patient"], v["patient_gap_closed"], v["patient_epochs"]
    rows.append([f"the patient student's epochs in {pt['budget_s']} s", f"≥ {e['floor']}", str(e["value"]),
                 e["verdict"]])
    gap = "–" if g["value"] is None else f"{100 * g['value']:.0f}%"
    rows.append(["the patient student's share of the teacher − scratch gap", f"≥ {100 * g['floor']:.0f}%",
                 f"{pt['student']}: {gap} (patient − inline {100 * pt['patient_minus_inline_aug']:+.2f} point, "
                 f"− scratch {100 * pt['patient_minus_scratch_aug']:+.2f})", g["verdict"]])
    return md_table(["floor", "asked", "measured (means over the seeds)", "verdict"], rows, pad=False)


def render(report):
    out = [(f"Budget {b['budget_s']} s of one core:", budget_table(b)) for b in report["budgets"]]
    pt, ps = report["patient"], report["settings"]["patient"]
    out.append((f"The patient and consistent teacher, budget {pt['budget_s']} s of one core: {ps['views']} views of "
                f"{ps['augment']} for each way:", budget_table({"students": {pt["student"]: pt}})))
    out.append(("A sweep from one cache against the same students inline (the cache's fill included):",
                sweep_table(report)))
    out.append(("Floors (the gap is the teacher's test accuracy minus that of the students from scratch on the "
                "same mixup views):", floors_table(report)))
    return out


def verdict_lines(report):
    v = report["verdicts"]
    lines = [f"{v[k]['verdict']}: at equal compute the cache's student beats the {what} one by >= "
             f"{100 * v[k]['floor']:.1f} point(s) at every budget (" +
             ", ".join(f"{where}: {100 * x:+.2f}" for where, x in v[k]["values"].items()) + ")"
             for k, what in (("cache_minus_inline", "inline"), ("cache_minus_scratch", "scratch"))]
    g, e = v["patient_gap_closed"], v["patient_epochs"]
    lines.append(f"{e['verdict']}: the patient student trains >= {e['floor']} epochs ({e['value']})")
    gap = "–" if g["value"] is None else f"{100 * g['value']:.0f}%"
    lines.append(f"{g['verdict']}: the patient student closes >= {100 * g['floor']:.0f}% of the teacher-scratch gap "
                 f"({gap})")
    return lines


def runs_line(report):
    """The run's line (date, run time, machine, the other processes' load) and this core's peak beside it."""
    line = run_line(report, (report.get("cpu") or {}).get("other_cores"))
    if report.get("children_core_s"):  # the run time above is the last invocation's when a run was resumed
        line += f" Every child's wall time together: {report['children_core_s'] / 3600:.1f} core-hours."
    return line + ("\n\n" + peak_line(report["peak"], report["cpu_id"]) if report.get("peak") else "")


def show(report):
    s = report["settings"]
    print(heading("What the cache buys at equal compute (Fashion-MNIST)", report.get("quick"),
                  report.get("runtime_s") or 0))
    if report.get("machine"):
        print(machine_line(report["machine"]) + "\n")
    if report.get("peak"):
        print(peak_line(report["peak"], report["cpu_id"]) + "\n")
    print(f"Data: {report['n_train']:,} training and {report['n_test']:,} test images ({s['data']}). Teacher "
          f"{s['teacher']['arch']}: {pct(report['teacher']['test_acc'])}. Budgets: "
          f"{', '.join(f'{b} s' for b in s['budgets_s'])} of one core per student, start-up and test pass "
          f"included; seeds {', '.join(map(str, s['seeds']))}; KD T={s['temperature']:g}, alpha={s['alpha']:g}; "
          f"patient ({s['patient']['student']}, {s['patient']['budget_s']} s): {s['patient']['views']} views of "
          f"{s['patient']['augment']}.\n")
    print(rendered(render(report)) + "\n")
    print("\n".join(verdict_lines(report)))
