"""Does KD help on digits? The benchmark's run, its report and its tables (python -m bench.distill)."""
import os

from bench.common import limit_threads

limit_threads(os.environ)  # before anything loads MXNet or BLAS: one compute thread here, as in every child

import json  # noqa: E402

from bench.common import heading, machine, make_log, md_table, python_m, rendered, spread, utc_now  # noqa: E402
from bench.cli import RUN, given_teacher, like, out_option, quick_option, tmp_option, trainer_option  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402
from kdcache.trainer import make_teacher  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "distill.json")

# The setting where KD clearly helps on digits, found by measurement (5 seeds each): a strong,
# regularised CNN teacher (make_teacher's defaults, 99.4-99.7% test accuracy) and a 128-unit MLP
# student, trained long enough at a learning rate high enough that the student from scratch
# overfits the 1438 hard labels (8.6 errors) while the soft targets keep the distilled one general
# (4.4). Shorter or gentler budgets (10 epochs; lr 1e-3 or 3e-3) show no gain or a loss, and
# students much smaller than the teacher's knowledge (mlp with 8-32 units, small_cnn) lose with KD.
FULL = dict(seeds=5, student="mlp128", epochs=30, lr=1e-2, batch_size=64, temperature=20.0, alpha=0.5,
            teacher_epochs=40)
QUICK = dict(FULL, seeds=2, epochs=4, teacher_epochs=4)
MODES = [("scratch", "none"), ("inline", "inline"), ("cache", "cache")]
ROWS = [("teacher", "teacher"), ("scratch", "student from scratch"), ("inline", "student distilled (inline)"),
        ("cache", "student distilled (cache)")]


log = make_log("distill")

STUDENT, TEACHER = "student (the same budget for every row)", "teacher"
TEACHER_EPOCHS = next(o for o in make_teacher.TEACHER if o.dest == "epochs")
OPTIONS = [
    Option("--seeds", "student seeds 0..N-1 (default 5; --quick 2)", type=Int(1), metavar="N", group=RUN),
    quick_option("2 seeds, 4 student and 4 teacher epochs (about half a minute)"),
    out_option(DEFAULT_OUT, "JSON report"),
    like(trainer_option("teacher"), "reuse this teacher checkpoint instead of training one", metavar="PREFIX",
         group=TEACHER),
    like(TEACHER_EPOCHS, f"epochs of the teacher trained here (default {FULL['teacher_epochs']}; --quick "
         f"{QUICK['teacher_epochs']})", flag="--teacher-epochs", group=TEACHER),
    # the trainer's types: a value the trainer would refuse is refused here, before the teacher is trained
    *(like(trainer_option(dest), help, group=STUDENT) for dest, help in (
        ("student", f"student network (default {FULL['student']})"),
        ("epochs", f"student epochs (default {FULL['epochs']}; --quick {QUICK['epochs']})"),
        ("lr", f"student Adam learning rate (default {FULL['lr']})"),
        ("batch_size", f"default {FULL['batch_size']}"),
        ("temperature", f"KD temperature (default {FULL['temperature']:g})"),
        ("alpha", f"weight of the soft term (default {FULL['alpha']})"))),
    like(trainer_option("dtype"), "cache dtype (default float32: cache and inline then see the same logits)",
         default="float32", group=STUDENT),
    tmp_option("work directory for the teacher, caches and runs (default: a new temporary directory, removed at "
               "the end; a directory given here is kept)"),
]


def train_teacher(kids, prefix, epochs, seed=0):
    res = kids.run(python_m("kdcache.trainer.make_teacher", "--out", prefix, "--epochs", epochs, "--seed", seed,
                            "--threads", 1, "--quiet"), "training the teacher", timeout=900, json_line=False)
    with open(f"{prefix}-info.json") as fh:
        return {**json.load(fh), "wall_s": round(res["_wall_s"], 1), "prefix": prefix, "trained_here": True}


def train_student(kids, work, teacher, mode, seed, p, dtype):
    name = f"{mode}-seed{seed}"
    teacher_opts = ["--teacher", teacher, "--producer-threads", 1] if mode != "none" else []  # none: no teacher
    argv = python_m("kdcache.trainer", *teacher_opts, "--teacher-mode", mode, "--student", p["student"],
                    "--epochs", p["epochs"], "--lr", repr(p["lr"]), "--batch-size", p["batch_size"],
                    # the recipe these tables were measured with (Adam, fixed rate, every item trained on)
                    "--optimizer", "adam", "--lr-mode", "constant", "--val-fraction", 0,
                    "--temperature", repr(p["temperature"]), "--alpha", repr(p["alpha"]), "--seed", seed,
                    "--dtype", dtype, "--threads", 1, "--quiet", "--json",
                    "--runs-dir", os.path.join(work, "runs"), "--cache-dir", os.path.join(work, "caches"),
                    "--run", name)
    m = kids.run(argv, f"the {mode} student, seed {seed}", timeout=1200)
    keep = ("test_acc", "teacher_test_acc", "teacher_forwards", "fingerprint", "producer_started", "stall_s",
            "samples_per_s", "wall_s")
    return {**{k: m.get(k) for k in keep}, "run_dir": os.path.join(work, "runs", name),
            "child_wall_s": round(m["_wall_s"], 1), "final_epoch": p["epochs"] - 1}


def max_weight_diff(run_a, run_b, epoch):
    """Largest |difference| of any final student weight between two runs (0.0: the same student)."""
    import mxnet as mx
    a = mx.nd.load(os.path.join(run_a, f"student-{epoch:04d}.params"))
    b = mx.nd.load(os.path.join(run_b, f"student-{epoch:04d}.params"))
    if a.keys() != b.keys():
        return float("inf")
    return max(float((a[k] - b[k]).abs().max().asscalar()) for k in a)


def summarise(accs, n_test):
    s = spread(accs)
    return {"mean": s["mean"], "std": s["std"], "min": s["min"], "max": s["max"],
            "errors_mean": (1 - s["mean"]) * n_test, "errors": [round((1 - a) * n_test) for a in accs], "accs": accs}


def table(rows, n_test, forwards):
    body = []
    for key, label in ROWS:
        r = rows[key]
        std = f"± {100 * r['std']:.2f}" if len(r["accs"]) > 1 else \
            "(one network)" if key == "teacher" else "(one seed)"
        body.append([label, f"{100 * r['mean']:.2f}% {std}", f"{r['errors_mean']:.1f}",
                     f"{100 * r['min']:.2f}–{100 * r['max']:.2f}%", forwards.get(key, "–")])
    return md_table(["", "test accuracy (mean ± std)", f"test errors of {n_test} (mean)", "min–max accuracy",
                     "teacher forwards (all seeds)"], body, pad=False)


def seed_table(per_seed, n_test):
    body = []
    for s in per_seed:
        e = {m: round((1 - s[m]["test_acc"]) * n_test) for m, _ in MODES}
        body.append([s["seed"], e["scratch"], e["inline"], e["cache"], "yes" if s["cache_equals_inline"] else "NO",
                     f"{s['max_abs_weight_diff']:.3g}"])
    return md_table(["seed", "scratch errors", "inline errors", "cache errors", "cache == inline (test acc)",
                     "max abs weight diff"], body, pad=False)


def render(report):
    """[(title, markdown table)]: the four rows and the per-seed errors, from the JSON report alone."""
    return [("", table(report["rows"], report["n_test"], report["teacher_forwards"])),
            ("Per seed:", seed_table(report["per_seed"], report["n_test"]))]


def params(ap, args):
    """The run's settings: --quick's or the full run's, with each option given in their place."""
    given_teacher(ap, args)
    p = dict(QUICK if args.quick else FULL)
    for k in ("seeds", "student", "epochs", "lr", "batch_size", "temperature", "alpha", "teacher_epochs"):
        if getattr(args, k) is not None:
            p[k] = getattr(args, k)
    return p


def show(report):
    n_test = report["n_test"]
    s = report["settings"]
    print(heading("Distillation on digits", report["quick"], report["runtime_s"]))
    t = report["teacher"]
    print(f"Teacher {t.get('arch', os.path.basename(t['prefix']))} ({t.get('epochs', '?')} epochs), "
          f"student {s['student']}; "
          f"student budget for every row: {s['epochs']} epochs, Adam lr {s['lr']:g}, batch {s['batch_size']}, "
          f"wd 1e-4 (trainer default); KD T={s['temperature']:g}, alpha={s['alpha']:g} (soft weight); "
          f"seeds {', '.join(map(str, s['seeds']))}; cache {s['dtype']}; 1 thread per process. "
          f"Test set: {n_test} images.\n")
    print(rendered(render(report)) + "\n")
    c = report["cache_vs_inline"]
    print(f"cache vs inline: {'identical students on every seed' if c['identical'] else 'DIFFERENT students'} "
          f"(test accuracy equal on {c['equal_test_acc']} of {len(s['seeds'])} seeds, max weight difference "
          f"{c['max_abs_weight_diff']:.3g}). Teacher forwards: cache {report['teacher_forwards']['cache']} "
          f"(one fill for every seed: {report['cache_fills']} fingerprint(s)), inline "
          f"{report['teacher_forwards']['inline']} (= {s['epochs']} epochs x {report['n_train']} samples x "
          f"{len(s['seeds'])} seeds).")


def run(kids, args, p, work):
    seeds = list(range(p["seeds"]))
    if args.teacher:
        prefix = os.path.abspath(args.teacher)
        info_path = f"{prefix}-info.json"
        info = json.load(open(info_path)) if os.path.exists(info_path) else {}
        teacher = {**info, "prefix": prefix, "trained_here": False}
        log(f"teacher: reusing {prefix}")
    else:
        prefix = os.path.join(work, "teacher", "digits")
        log(f"training the teacher ({p['teacher_epochs']} epochs, one thread)")
        teacher = train_teacher(kids, prefix, p["teacher_epochs"])
        log(f"teacher: test accuracy {teacher['test_acc']:.4f} in {teacher['wall_s']} s")

    per_seed = []
    for seed in seeds:
        res = {"seed": seed}
        for key, mode in MODES:
            res[key] = train_student(kids, work, prefix, mode, seed, p, args.dtype)
            log(f"seed {seed} {key:8s} test accuracy {res[key]['test_acc']:.4f}, teacher forwards "
                f"{res[key]['teacher_forwards']}, {res[key]['child_wall_s']} s")
        res["cache_equals_inline"] = res["cache"]["test_acc"] == res["inline"]["test_acc"]
        res["max_abs_weight_diff"] = max_weight_diff(res["cache"]["run_dir"], res["inline"]["run_dir"],
                                                     p["epochs"] - 1)
        per_seed.append(res)

    from kdcache.pipeline.datasets import load_dataset
    n_test = len(load_dataset("digits", split="test"))
    n_train = len(load_dataset("digits", split="train"))
    # The teacher's accuracy as the trainer measured it (inline: the loaded checkpoint on the test split).
    t_acc = per_seed[0]["inline"]["teacher_test_acc"]
    teacher["test_acc_after_training"] = teacher.pop("test_acc", None)
    rows = {"teacher": summarise([t_acc], n_test)}
    for key, _ in MODES:
        rows[key] = summarise([s[key]["test_acc"] for s in per_seed], n_test)
    forwards = {key: sum(s[key]["teacher_forwards"] for s in per_seed) for key, _ in MODES}
    fingerprints = sorted({s["cache"]["fingerprint"] for s in per_seed})
    equal = sum(s["cache_equals_inline"] for s in per_seed)
    for s in per_seed:  # run directories are temporary; keep the numbers only
        for key, _ in MODES:
            s[key].pop("run_dir", None)
    return {
        "settings": {**{k: v for k, v in p.items() if k != "seeds"}, "seeds": seeds, "dtype": args.dtype,
                     "wd": 1e-4, "threads": 1, "producer_threads": 1, "views": 1, "codec": "full"},
        "teacher": {**teacher, "test_acc": t_acc},
        "n_test": n_test, "n_train": n_train,
        "rows": rows,
        "per_seed": per_seed,
        "cache_vs_inline": {"identical": equal == len(per_seed)
                            and all(s["max_abs_weight_diff"] == 0.0 for s in per_seed),
                            "equal_test_acc": equal,
                            "max_abs_weight_diff": max(s["max_abs_weight_diff"] for s in per_seed)},
        "teacher_forwards": {**forwards,
                             "inline_expected": p["epochs"] * n_train * len(seeds), "cache_expected": n_train},
        "cache_fills": len(fingerprints), "fingerprints": fingerprints,
        "kd_gain_errors": rows["scratch"]["errors_mean"] - rows["cache"]["errors_mean"],
        "quick": bool(args.quick),
        "machine": machine(mxnet=True, omp_num_threads=1),
        "date": utc_now(),
    }

