"""Read-time teacher ensembles: the runs, the report and its tables (python -m bench.ensemble)."""
import os

from bench.common import limit_threads

limit_threads(os.environ)  # before anything loads MXNet or BLAS: one compute thread here, as in every child

import time  # noqa: E402

from bench.cli import RUN, like, out_option, quick_option, tmp_option, trainer_option  # noqa: E402
from bench.common import (for_the_manual, heading, machine_line, make_log, md_table, python_m,  # noqa: E402
                          spread)
from kdcache.args import Int, Option, Path  # noqa: E402

FASHION_ROOT = "/usr/share/datasets/fashion-mnist"  # where the Debian package dataset-fashion-mnist puts its files
# The MLP teacher's epoch costs a fraction of the CNN's: at 5 epochs it stopped at 87.8%, so it trains 15.
FASHION_TEACHER_EPOCHS, FASHION_STUDENT_EPOCHS = {"cnn-s0": 5, "cnn-s1": 5, "mlp-s2": 15}, 8
# --dataset: (default report, teacher epochs (one number, or one per teacher), student epochs); --quick runs 2 of
# each on either
DATASETS = {"mnist5k": (os.path.join("bench", "results", "ensemble.json"), 20, 20),
            "fashion-mnist": (os.path.join("bench", "results", "ensemble_fashion.json"), FASHION_TEACHER_EPOCHS,
                              FASHION_STUDENT_EPOCHS)}
DEFAULT_OUT = DATASETS["mnist5k"][0]
# name: (--arch, --seed): two seeds of the data set's CNN and a smaller CNN
TEACHERS = {"cnn-s0": ("mnist_teacher", 0), "cnn-s1": ("mnist_teacher", 1), "small-s2": ("digits_teacher", 2)}
# On Fashion-MNIST the third is Hinton et al.'s MLP (784-800-800-10): digits_teacher, made for 8x8 images, keeps
# 28x28 maps through two convolutions (~36M multiply-adds an image, 8x mnist_teacher's) and would take most of
# the run's time on 60,000 images.
TEACHERS_OF = {"mnist5k": TEACHERS, "fashion-mnist": {"cnn-s0": ("mnist_teacher", 0), "cnn-s1": ("mnist_teacher", 1),
                                                      "mlp-s2": ("mlp800x2", 2)}}
QUICK_TEACHER_EPOCHS = 1
STUDENT = {"student": "mlp128", "lr": 1e-2, "batch_size": 64, "temperature": 20.0, "alpha": 0.5, "epochs": 20}
QUICK_STUDENT_EPOCHS = 1
ENSEMBLE = "ensemble"

log = make_log("ensemble")

OPTIONS = [
    Option("--dataset", "mnist5k (4,000 MNIST images, built in) or fashion-mnist (60,000, from --data-root; "
           "default mnist5k)", choices=tuple(DATASETS), default="mnist5k", group=RUN),
    Option("--data-root", f"Fashion-MNIST's IDX files (default {FASHION_ROOT}, from the Debian package "
           "dataset-fashion-mnist)", type=Path(), metavar="DIR", group=RUN),
    Option("--seeds", "student seeds 0..N-1 (default 5; --quick 1)", type=Int(1, 100), metavar="N", group=RUN),
    Option("--jobs", "children run at once, one thread each (default: the usable cores)", type=Int(1, 64),
           metavar="N", group=RUN),
    like(trainer_option("ensemble_rule"), "how the ensemble combines its members (default probs)", group=RUN,
         flag="--rule", default="probs"),
    like(trainer_option("temperature"), f"the students' KD temperature (default {STUDENT['temperature']:g})",
         group=RUN),
    like(trainer_option("alpha"), f"weight of the soft term (default {STUDENT['alpha']:g})", group=RUN),
    quick_option("1-epoch teachers, 1 seed, 1-epoch students (~1 min)"),
    out_option(DEFAULT_OUT, "JSON report; on fashion-mnist " + DATASETS["fashion-mnist"][0]),
    tmp_option("work directory for teachers, caches and runs (default: a new temporary directory, removed at the "
               "end; a directory given here is kept)"),
]


def run_all(kids, jobs, tasks, json_line=True):
    """bench.codecs.run_all: tasks [(argv, what, timeout, folder to remove after)], `jobs` at a time; a teacher's
    training prints no JSON line (json_line=False)."""
    from bench.codecs.run import run_all as run
    return run(kids, jobs, tasks, json_line=json_line)


def data_args(p):
    """The --dataset (and --data-root) of every child."""
    return ["--dataset", p["dataset"], *(["--data-root", p["data_root"]] if p["data_root"] else [])]


def train_teacher(name, arch, seed, work, epochs, p):
    prefix = os.path.join(work, "teachers", name)
    return (python_m("kdcache.trainer.make_teacher", *data_args(p), "--arch", arch, "--seed", seed, "--out",
                     prefix, "--threads", 1, "--quiet", "--epochs", epochs), f"teacher {name}", 3600, None)


def fill(name, work, split, p):
    prefix = os.path.join(work, "teachers", name)
    extra = ["--codec", "full", "--dtype", "float32"] if split == "test" else []
    return (python_m("kdcache.cache_builder", "--teacher", prefix, *data_args(p), "--split", split,
                     "--cache-dir", os.path.join(work, "caches"), "--threads", 1, "--quiet", "--json", *extra),
            f"{name} {split} cache", 900, None)


def student(source, seed, work, p, caches=None):
    run = f"{source}-seed{seed}"
    argv = python_m("kdcache.trainer", *data_args(p), "--student", STUDENT["student"], "--epochs", p["epochs"],
                    "--lr", repr(STUDENT["lr"]), "--batch-size", STUDENT["batch_size"], "--optimizer", "adam",
                    "--lr-mode", "constant", "--val-fraction", 0, "--temperature", repr(p["temperature"]),
                    "--alpha", repr(p["alpha"]), "--seed", seed, "--threads", 1, "--quiet", "--json",
                    "--runs-dir", os.path.join(work, "runs"), "--cache-dir", os.path.join(work, "caches"),
                    "--run", run)
    if source == "scratch":
        argv += ["--teacher-mode", "none"]
    elif source == ENSEMBLE:
        argv += ["--ensemble", ",".join(caches), "--ensemble-rule", p["rule"]]
    else:
        argv += ["--teacher", os.path.join(work, "teachers", source), "--no-producer"]
    return argv, f"student {source} seed {seed}", 3600, os.path.join(work, "runs", run)


def test_accuracy(paths, rule, labels):
    """Test accuracy of each member's test cache and of their ensemble (read from the caches: no teacher runs)."""
    import numpy as np

    from kdcache.store import CacheReader, EnsembleReader
    out = {}
    for name, path in paths.items():
        with CacheReader(path) as r:
            out[name] = float((r.get(np.arange(len(labels))).argmax(1) == labels).mean())
    with EnsembleReader(list(paths.values()), rule=rule) as ens:
        out[ENSEMBLE] = float((ens.get(np.arange(len(labels))).argmax(1) == labels).mean())
    return out


def summary(results):
    accs = [m["test_acc"] for m in results]
    eces = [m.get("test_ece") for m in results]
    s, e = spread(accs), spread(eces)
    return {"accs": accs, "mean": s["mean"], "std": s["std"], "eces": eces, "ece_mean": e["mean"],
            "teacher_forwards": sum(m["teacher_forwards"] for m in results)}


def paired(a, b):
    d = [100 * (x - y) for x, y in zip(a["accs"], b["accs"])]
    s = spread(d)
    return {"mean": s["mean"], "std": s["std"], "diffs": d}


def run(kids, args, p, work):
    from kdcache.pipeline.datasets import load_dataset
    teachers = p["teachers"]  # this data set's
    step_s = {}
    t0 = time.perf_counter()
    epochs = p["teacher_epochs"]
    epochs_of = {n: epochs[n] if isinstance(epochs, dict) else epochs for n in teachers}
    run_all(kids, p["jobs"], [train_teacher(n, a, s, work, epochs_of[n], p) for n, (a, s) in teachers.items()],
            json_line=False)
    step_s["teachers"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    tasks = [fill(n, work, split, p) for n in teachers for split in ("train", "test")]
    res = run_all(kids, p["jobs"], tasks)
    fills = {(n, split): r for (n, split), r in zip(((n, s) for n in teachers for s in ("train", "test")), res)}
    step_s["fills"] = round(time.perf_counter() - t0, 1)
    labels = load_dataset(p["dataset"], data_root=p["data_root"], split="test").labels
    teacher_acc = test_accuracy({n: fills[(n, "test")]["cache_path"] for n in teachers}, p["rule"], labels)
    caches = [fills[(n, "train")]["cache_path"] for n in teachers]

    t0 = time.perf_counter()
    sources = ["scratch", *teachers, ENSEMBLE]
    tasks, keys = [], []
    for seed in p["seeds"]:
        for src in sources:
            tasks.append(student(src, seed, work, p, caches))
            keys.append(src)
    log(f"training {len(tasks)} students, {p['jobs']} at a time")
    done = {}
    for src, r in zip(keys, run_all(kids, p["jobs"], tasks)):
        done.setdefault(src, []).append(r)
    step_s["students"] = round(time.perf_counter() - t0, 1)
    students = {src: summary(rs) for src, rs in done.items()}
    best = max(teachers, key=lambda n: students[n]["mean"])
    ens_run = done[ENSEMBLE][0]
    return {
        "settings": {**STUDENT, "epochs": p["epochs"], "temperature": p["temperature"], "alpha": p["alpha"],
                     "rule": p["rule"], "seeds": p["seeds"], "threads": 1, "jobs": p["jobs"], "dataset": p["dataset"],
                     "teacher_epochs": epochs, "views": 1, "train_codec": "full/float16"},
        "teachers": {n: {"arch": a, "seed": s, "epochs": epochs_of[n], "test_acc": teacher_acc[n],
                         "cache_fingerprint": fills[(n, "train")]["fingerprint"],
                         "cache_teacher_forwards": fills[(n, "train")]["teacher_forwards"]}
                     for n, (a, s) in teachers.items()},
        "ensemble": {"test_acc": teacher_acc[ENSEMBLE], "identity": ens_run.get("ensemble"),
                     "teacher_forwards_to_build": students[ENSEMBLE]["teacher_forwards"]},
        "students": students, "best_single": best,
        "gain_over_best_single": paired(students[ENSEMBLE], students[best]),
        "gain_over_scratch": paired(students[ENSEMBLE], students["scratch"]),
        "step_s": step_s,
    }


def pct(x):
    return "-" if x is None else f"{100 * x:.2f}%"


def render(report):
    """[(title, markdown table)]: the teachers and their ensemble, the students from each."""
    t, e, s = report["teachers"], report["ensemble"], report["students"]
    rows = [[f"`{n}`", f"{v['arch']} seed {v['seed']}", pct(v["test_acc"]), v["cache_teacher_forwards"]]
            for n, v in t.items()]
    rows.append([f"ensemble ({report['settings']['rule']}, equal weights)", "the three caches, read together",
                 pct(e["test_acc"]), e["teacher_forwards_to_build"]])
    teachers = md_table(["teacher", "network", "test accuracy", "teacher forwards"], rows, pad=False)
    n = len(report["settings"]["seeds"])
    body = []
    for src in ["scratch", *t, ENSEMBLE]:
        v = s[src]
        spread_ = f" ± {100 * v['std']:.2f}" if n > 1 else " (one seed)"
        body.append([f"`{src}`" if src in t else src, f"{pct(v['mean'])}{spread_}",
                     "-" if v["ece_mean"] is None else f"{v['ece_mean']:.4f}"])
    g, best = report["gain_over_best_single"], report["best_single"]
    seeds = f"{n} seeds" if n > 1 else "one seed"
    students = md_table(["student distilled from", f"test accuracy ({seeds})", "ECE (15 bins)"], body, pad=False)
    # the members' average per seed, computed here from the report's accuracies: a pure function of the JSON
    average = {"accs": [sum(accs) / len(accs) for accs in zip(*(s[m]["accs"] for m in t))]}
    a = paired(s[ENSEMBLE], average)
    behind = sum(d < 0 for d in g["diffs"])
    z = report["gain_over_scratch"]
    note = (f"Paired by seed, the ensemble's students against the average of the members' students: "
            f"{a['mean']:+.2f} ± {a['std']:.2f} points; against the best single teacher's (`{best}`): "
            f"{g['mean']:+.2f} ± {g['std']:.2f} (behind on {behind} of {len(g['diffs'])} seeds); against the "
            f"students from scratch: {z['mean']:+.2f} ± {z['std']:.2f}.")
    return [(f"Teachers and their ensemble ({report['settings']['dataset']} test split)", teachers),
            ("Students (mlp128)", students + "\n\n" + note)]


def print_report(report):
    print(heading("Read-time teacher ensembles", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    print(for_the_manual(render(report)))


def params(ap, args):
    out, teacher_epochs, student_epochs = DATASETS[args.dataset]
    args.out = args.out or out
    data_root = None
    if args.dataset == "fashion-mnist":
        data_root = os.path.abspath(args.data_root or FASHION_ROOT)  # the children run in the scratch folder
        if not any(os.path.exists(os.path.join(data_root, f"train-images-idx3-ubyte{gz}")) for gz in ("", ".gz")):
            ap.error(f"argument --data-root: no Fashion-MNIST files (train-images-idx3-ubyte.gz) in {data_root}: "
                     "install them with `apt-get install dataset-fashion-mnist` (as root), or name their folder")
    elif args.data_root is not None:
        ap.error("argument --data-root: only --dataset fashion-mnist reads files; drop it (mnist5k is built in)")
    return {"dataset": args.dataset, "data_root": data_root, "teachers": TEACHERS_OF[args.dataset],
            "teacher_epochs": QUICK_TEACHER_EPOCHS if args.quick else teacher_epochs,
            "seeds": list(range(args.seeds or (1 if args.quick else 5))),
            "jobs": args.jobs or len(os.sched_getaffinity(0)), "rule": args.rule,
            "temperature": STUDENT["temperature"] if args.temperature is None else args.temperature,
            "alpha": STUDENT["alpha"] if args.alpha is None else args.alpha,
            "epochs": QUICK_STUDENT_EPOCHS if args.quick else student_epochs}


def show(report):
    print_report(report)
