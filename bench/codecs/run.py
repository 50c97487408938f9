"""Which soft-target codec keeps the teacher's knowledge: the runs and the report (python -m bench.codecs)."""
import os

from bench.common import limit_threads

limit_threads(os.environ)  # before anything loads MXNet or BLAS: one compute thread here, as in every child

import shutil  # noqa: E402
import time  # noqa: E402

from bench.cli import RUN, like, out_option, quick_option, tmp_option, trainer_option  # noqa: E402
from bench.common import make_log, python_m, spread  # noqa: E402
from kdcache.args import Allowed, Int, Option, Path, fail  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "codecs.json")
SYNTHETIC = {"n": 10000, "classes": 1000, "shape": (1, 4, 4), "seed": 0}
# --quick's synthetic case: the same classes and posterior on fewer samples (it checks that every row is written)
QUICK_SYNTHETIC = dict(SYNTHETIC, n=2000)


def synthetic_arg(synthetic):
    return "synthetic:n={n},classes={classes},shape={s[0]}x{s[1]}x{s[2]},seed={seed}".format(
        **synthetic, s=synthetic["shape"])


SYNTHETIC_ARG, QUICK_SYNTHETIC_ARG = synthetic_arg(SYNTHETIC), synthetic_arg(QUICK_SYNTHETIC)
# name: (--dataset, default teacher name or None for the synthetic posterior, epochs, --quick epochs)
DATASETS = {"digits": ("digits", "digits", 30, 2), "mnist5k": ("mnist5k", "mnist5k", 20, 2),
            "synthetic": (SYNTHETIC_ARG, None, 10, 1)}
# Views and augmentation of every student of a data set (and of its caches): mnist5k distils on 8 views shifted by
# up to 2 pixels (Hinton et al. 2015 jittered MNIST by up to 2 pixels), the student from scratch on the same views.
# Measured on 3 seeds: one view closed 0.30 of the scratch-to-teacher gap, 8 views 0.47 (T = 4, alpha 0.3-0.9,
# crop:3, 16 views or 40 epochs all within 0.2 points of it).
VIEWS = {"mnist5k": (8, "crop:2")}
# Seeds by default: mnist5k's floors compare students 0.3 points apart, about the seed-to-seed spread, so it runs more.
SEEDS = {"mnist5k": 10}
# label, --codec, --dtype; topk:K only where K < C; sampled:K beside the topk:K' of (about) equal bytes per row,
# where that one is: sampled:9 27 B vs topk:5 28 B, sampled:16 48 B vs topk:10 48 B (3K vs 4K' + 8)
CODECS = [("full/float32", "full", "float32"), ("full/float16", "full", "float16"), ("topk:1", "topk:1", "float16"),
          ("topk:5", "topk:5", "float16"), ("sampled:9", "sampled:9", "float16"), ("topk:10", "topk:10", "float16"),
          ("sampled:16", "sampled:16", "float16"), ("int8", "int8", "float16")]
SAMPLED_BESIDE = {"sampled:9": "topk:5", "sampled:16": "topk:10"}
EXACT = "full/float32"
STUDENT = {"student": "mlp128", "lr": 1e-2, "batch_size": 64, "temperature": 20.0, "alpha": 0.5}
HINTON = "mnist5k"  # the data set of the Hinton-style table (inline KD runs there only)
QUICK_TEACHER_EPOCHS = 2

log = make_log("codecs")


class DatasetList(Allowed):
    """digits, mnist5k and synthetic (the 1000-class case), separated by commas."""

    def __call__(self, s):
        names = [v.strip().lower() for v in str(s).split(",") if v.strip()]
        bad = [n for n in names if n not in DATASETS]
        if not names or bad:
            fail(f"{s!r}: name one or more of {', '.join(DATASETS)}, separated by commas")
        return tuple(n for n in DATASETS if n in names)  # the table's order, each once

    format = staticmethod(",".join)


OPTIONS = [
    Option("--datasets", "data sets (default: all three)", type=DatasetList(), metavar="LIST", group=RUN),
    Option("--seeds", "student seeds 0..N-1 for every data set (default 5, mnist5k 10; --quick 1)", type=Int(1, 100),
           metavar="N", group=RUN),
    Option("--jobs", "children run at once, one thread each (default: the usable cores)", type=Int(1, 64),
           metavar="N", group=RUN),
    Option("--teachers", "where the digits and mnist5k teachers are (default teachers, as `make teacher` builds "
           "them); a missing one is trained into the work directory", type=Path(exists=True), metavar="DIR",
           group=RUN),
    like(trainer_option("temperature"), f"the students' KD temperature (default {STUDENT['temperature']:g}, the "
         f"README's digits setting)", group=RUN),
    like(trainer_option("alpha"), f"weight of the soft term (default {STUDENT['alpha']:g})", group=RUN),
    quick_option(f"1 seed, 1-2 epochs, {QUICK_SYNTHETIC['n']:,} synthetic samples, a {QUICK_TEACHER_EPOCHS}-epoch "
                 "teacher where one is missing (~1-2 min)"),
    out_option(DEFAULT_OUT, "JSON report"),
    tmp_option("work directory for teachers, caches and runs (default: a new temporary directory, removed at the "
               "end; a directory given here is kept)"),
]


def codecs_for(classes):
    def kept(label):
        label = SAMPLED_BESIDE.get(label, label)
        return not label.startswith("topk:") or int(label.split(":")[1]) < classes
    return [c for c in CODECS if kept(c[0])]


def run_all(kids, jobs, tasks, json_line=True):
    """Run tasks [(argv, what, timeout, folder to remove after or None)], `jobs` at a time; their results in
    order (json_line: each child prints a JSON line last). The first failure stops the others and is raised."""
    from concurrent.futures import ThreadPoolExecutor
    errors = []

    def one(task):
        argv, what, timeout, scratch = task
        if errors:
            return None
        try:
            return kids.run(argv, what, timeout=timeout, json_line=json_line)
        except BaseException as e:
            errors.append(e)
            for c in list(kids.live.values()):
                c.kill()
            raise
        finally:
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)  # a student's checkpoints: only its metrics are kept

    with ThreadPoolExecutor(max_workers=jobs) as ex:
        futures = [ex.submit(one, t) for t in tasks]
        for f in futures:
            f.exception()  # wait for each
    if errors:
        raise errors[0]
    return [f.result() for f in futures]


def dataset_arg(name, quick):
    """The --dataset of data set `name` in a full or a --quick run."""
    return QUICK_SYNTHETIC_ARG if quick and name == "synthetic" else DATASETS[name][0]


def teachers(kids, args, names, work, jobs):
    """{data set: (prefix, how it was obtained)}: the default teacher, one trained here (`jobs` at a time), or
    the posterior."""
    out, training = {}, []
    for name in names:
        arg, default = dataset_arg(name, args.quick), DATASETS[name][1]
        if default is None:
            from bench.codecs.metrics import posterior_teacher
            prefix = os.path.join(work, "teachers", name)
            os.makedirs(os.path.dirname(prefix), exist_ok=True)
            posterior_teacher(prefix, SYNTHETIC["classes"], SYNTHETIC["shape"], SYNTHETIC["seed"])
            out[name] = (prefix, "the generator's posterior (linear, not trained)")
            continue
        shown = os.path.join(args.teachers or "teachers", default)
        prefix = os.path.abspath(shown)
        if os.path.exists(prefix + "-symbol.json"):
            out[name] = (prefix, f"{shown} (`make teacher DATASET={name}`)")
            continue
        prefix = os.path.join(work, "teachers", name)
        epochs = ["--epochs", QUICK_TEACHER_EPOCHS] if args.quick else []
        log(f"no {name} teacher at {shown}: training one here ({'quick' if args.quick else 'its recipe'})")
        training.append((python_m("kdcache.trainer.make_teacher", "--dataset", arg, "--out", prefix, "--threads", 1,
                                  "--quiet", *epochs), f"training the {name} teacher", 1800, None))
        out[name] = (prefix, f"trained here ({'quick, ' if args.quick else ''}make_teacher's recipe"
                             f"{f', {QUICK_TEACHER_EPOCHS} epochs' if args.quick else ''})")
    run_all(kids, jobs, training, json_line=False)
    return out


def views_of(name):
    """(views, augmentation) of a data set's students and caches."""
    return VIEWS.get(name, (1, "none"))


def views_args(name):
    views, augment = views_of(name)
    return ["--views", views, "--augment", augment]


def fill(name, arg, prefix, codec, dtype, caches, split="train", seed=0):
    views = views_args(name) if split == "train" else []
    return (python_m("kdcache.cache_builder", "--teacher", prefix, "--dataset", arg, "--codec", codec, "--dtype", dtype,
                     "--split", split, "--cache-dir", caches, "--threads", 1, "--quiet", "--json", "--seed", seed,
                     *views), f"{name} {split} cache {codec} {dtype} seed {seed}", 900, None)


def fill_seeds(name, plan):
    """The seeds whose train caches are filled: with several views the augmentation is keyed by the seed, so the
    fingerprint (and the cache) differ per seed; with one view seed 0's cache serves every seed."""
    return plan[name]["seeds"] if plan[name]["views"][0] > 1 else [0]


def student(name, arg, prefix, mode, seed, epochs, work, kd, codec=None, dtype=None):
    run = f"{name}-{mode}-{(codec or '').replace(':', '')}{dtype or ''}-seed{seed}"
    argv = python_m("kdcache.trainer", "--dataset", arg, "--teacher-mode", mode, "--student", STUDENT["student"],
                    "--epochs", epochs, "--lr", repr(STUDENT["lr"]), "--batch-size", STUDENT["batch_size"],
                    # the recipe these tables were measured with (Adam, fixed rate, every item trained on)
                    "--optimizer", "adam", "--lr-mode", "constant", "--val-fraction", 0,
                    "--temperature", repr(kd["temperature"]), "--alpha", repr(kd["alpha"]),
                    "--seed", seed, "--threads", 1, "--quiet", "--json", "--runs-dir", os.path.join(work, "runs"),
                    "--cache-dir", os.path.join(work, "caches"), "--run", run, *views_args(name))
    if mode != "none":
        argv += ["--teacher", prefix]
    if mode == "cache":
        argv += ["--codec", codec, "--dtype", dtype, "--no-producer"]
    what = " ".join(str(w) for w in (name, "student", mode, codec, dtype, "seed", seed) if w is not None)
    return argv, what, 1800, os.path.join(work, "runs", run)


def read_all(path):
    import numpy as np

    from kdcache.store import CacheReader
    with CacheReader(path) as r:
        n, v = r.spec.num_samples, r.spec.views
        return r.get(np.repeat(np.arange(n), v), np.tile(np.arange(v), n)), r.codec.bytes_per_row, n


def distances(name, fills):
    """Per codec: bytes per row, T^2 * KL to the exact logits (and the ideal top-K), top-1 agreement."""
    from bench.codecs.metrics import codec_distances
    z, _, n = read_all(fills[EXACT]["cache_path"])
    out = {}
    for label, res in fills.items():
        r, bpr, _ = read_all(res["cache_path"])
        k = int(label.split(":")[1]) if label.startswith("topk:") else None
        out[label] = {"bytes_per_row": bpr, "bytes_on_disk_per_row": round(os.path.getsize(res["cache_path"]) / n, 1),
                      **codec_distances(z, r, k)}
        log(f"{name} {label}: T^2*KL " + ", ".join(f"T={t} {v:.3g}" for t, v in out[label]["kl"].items()))
    return out, n, z.shape[1]


def summary(results):
    accs = [m["test_acc"] for m in results]
    s = spread(accs)
    ece = spread([m.get("test_ece") for m in results])  # the students' calibration (15 bins)
    return {"accs": accs, "mean": s["mean"], "std": s["std"], "min": s["min"], "max": s["max"],
            "eces": [m.get("test_ece") for m in results], "ece_mean": ece["mean"],
            "teacher_forwards": sum(m["teacher_forwards"] for m in results),
            "wall_s": [round(m["_wall_s"], 1) for m in results]}


def measure(kids, args, p, work):
    names = p["datasets"]
    caches = os.path.join(work, "caches")
    t0 = time.perf_counter()
    got = teachers(kids, args, names, work, p["jobs"])
    step_s = {"teachers": round(time.perf_counter() - t0, 1)}

    from kdcache.pipeline.datasets import load_dataset
    plan = {}
    for name in names:
        arg = dataset_arg(name, args.quick)
        train, test = load_dataset(arg, split="train"), load_dataset(arg, split="test")
        plan[name] = {"arg": arg, "classes": train.num_classes, "n_train": len(train), "n_test": len(test),
                      "codecs": codecs_for(train.num_classes), "epochs": DATASETS[name][3 if args.quick else 2],
                      "seeds": list(range(p["seeds"] or (1 if args.quick else SEEDS.get(name, 5)))),
                      "views": views_of(name)}

    t0 = time.perf_counter()
    tasks, keys = [], []
    for name in names:
        prefix, arg = got[name][0], plan[name]["arg"]
        for label, codec, dtype in plan[name]["codecs"]:
            for seed in fill_seeds(name, plan):
                tasks.append(fill(name, arg, prefix, codec, dtype, caches, seed=seed))
                keys.append((name, label))
        tasks.append(fill(name, arg, prefix, "full", "float32", caches, split="test"))  # the trainer's teacher accuracy
        keys.append((name, "test"))
    log(f"filling {len(tasks)} caches, {p['jobs']} at a time")
    fills = {name: {} for name in names}
    for (name, label), res in zip(keys, run_all(kids, p["jobs"], tasks)):
        if label in fills[name]:  # another seed's cache: its forwards count, seed 0's cache is compared
            fills[name][label]["teacher_forwards"] += res["teacher_forwards"]
        else:
            fills[name][label] = res
    step_s["fills"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    metrics = {}
    for name in names:
        train_fills = {k: v for k, v in fills[name].items() if k != "test"}
        metrics[name], _, _ = distances(name, train_fills)
    step_s["distances"] = round(time.perf_counter() - t0, 1)

    t0 = time.perf_counter()
    tasks, keys = [], []
    for name in reversed(names):  # the slowest data set first: the last jobs are then short
        prefix, arg, epochs = got[name][0], plan[name]["arg"], plan[name]["epochs"]
        for seed in plan[name]["seeds"]:
            tasks.append(student(name, arg, prefix, "none", seed, epochs, work, p))
            keys.append((name, "scratch"))
            if name == HINTON:
                tasks.append(student(name, arg, prefix, "inline", seed, epochs, work, p))
                keys.append((name, "inline"))
            for label, codec, dtype in plan[name]["codecs"]:
                tasks.append(student(name, arg, prefix, "cache", seed, epochs, work, p, codec, dtype))
                keys.append((name, label))
    log(f"training {len(tasks)} students, {p['jobs']} at a time")
    done = {name: {} for name in names}
    for (name, label), res in zip(keys, run_all(kids, p["jobs"], tasks)):
        done[name].setdefault(label, []).append(res)
    step_s["students"] = round(time.perf_counter() - t0, 1)

    report = {"settings": {**STUDENT, "temperature": p["temperature"], "alpha": p["alpha"],
                           "seeds": {name: plan[name]["seeds"] for name in names},
                           "threads": 1, "jobs": p["jobs"], "wd": 1e-4,
                           "synthetic": dataset_arg("synthetic", args.quick),
                           "views": {name: {"views": plan[name]["views"][0], "augment": plan[name]["views"][1]}
                                     for name in names}},
              "datasets": {}, "step_s": step_s}
    for name in names:
        students = {label: summary(rs) for label, rs in done[name].items()}
        teacher_acc = next(r["teacher_test_acc"] for r in done[name][EXACT])
        rows = {}
        for label, codec, dtype in plan[name]["codecs"]:
            rows[label] = {"codec": codec, "dtype": dtype, **metrics[name][label], "student": students[label],
                           "fingerprint": fills[name][label]["fingerprint"],
                           "teacher_forwards": fills[name][label]["teacher_forwards"]}
        report["datasets"][name] = {
            "dataset": plan[name]["arg"], "classes": plan[name]["classes"], "n_train": plan[name]["n_train"],
            "n_test": plan[name]["n_test"], "epochs": plan[name]["epochs"], "seeds": plan[name]["seeds"],
            "views": plan[name]["views"][0], "augment": plan[name]["views"][1],
            "teacher": {"prefix": got[name][0], "source": got[name][1], "test_acc": teacher_acc},
            "codecs": rows, "scratch": students["scratch"], **({"inline": students["inline"]} if "inline" in students
                                                                 else {})}
    return report


def params(ap, args):
    if args.teachers is not None and not os.path.isdir(args.teachers):
        ap.error(f"argument --teachers: {args.teachers} is not a folder")
    return {"datasets": args.datasets or tuple(DATASETS), "seeds": args.seeds,
            "jobs": args.jobs or len(os.sched_getaffinity(0)),
            "temperature": STUDENT["temperature"] if args.temperature is None else args.temperature,
            "alpha": STUDENT["alpha"] if args.alpha is None else args.alpha}


def run(kids, args, p, work):
    from bench.codecs.report import floors, hinton
    report = measure(kids, args, p, work)
    report["quick"] = bool(args.quick)
    report["floors"] = floors(report)
    report["hinton"] = hinton(report)
    return report


def show(report):
    from bench.codecs.report import print_report
    print_report(report)
