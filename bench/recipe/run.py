"""The recipe sweep's runs, its report and its tables (python -m bench.recipe)."""
import json
import os
import shutil
import statistics

from bench.cli import RUN, like, out_option, quick_option, tmp_option, trainer_option
from bench.common import ROOT, make_log, md_table, rendered, run_tasks
from bench.recipe.builtin import (BUILTIN, FASHION_INSTALL, FASHION_ROOT, check_fashion, fill_task, teacher_plan,
                                  trainer_argv)
from kdcache.args import Dir, Int, Option

log = make_log("recipe")
DEFAULT_OUT = os.path.join(ROOT, "bench", "results", "recipe_sweep.json")

# (optimizer, lr mode, lr): SGD with momentum and a cosine schedule at three rates (the literature's recipe; 0.3 the
# default a sweep on hard labels chose), Nesterov at the middle one, Adam at a fixed rate (the trainer's only recipe
# before) at two. Momentum 0.9, wd 1e-4 and no warm-up: the trainer's defaults.
GRID = (("sgd", "cosine", 0.03), ("sgd", "cosine", 0.1), ("sgd", "cosine", 0.3), ("nag", "cosine", 0.1),
        ("adam", "constant", 3e-3), ("adam", "constant", 1e-2))
LANDED = ("sgd", "cosine", 0.3)  # the default the hard-label sweep chose (recipe_sweep_hard_labels.json)
BEFORE = ("adam", "constant", 1e-2)  # the trainer's recipe before there was a choice
SEEDS = {"digits": (0, 1), "mnist5k": (0, 1), "fashion-mnist": (0,)}
# Fashion-MNIST (60,000 images: its runs cost as much as the rest together) runs the FINALISTS recipes best on
# the small data sets' validation slices, and LANDED, so that its table answers "is the choice as good there too,
# and better than what it replaces".
FINALISTS = 1
QUICK = dict(datasets=("digits",), grid=(("sgd", "cosine", 0.1), ("adam", "constant", 1e-2)), seeds={"digits": (0,)},
             epochs=2)

OPTIONS = [quick_option("digits, two recipes, one seed, two epochs, a two-epoch teacher: seconds"),
           like(trainer_option("epochs"), "epochs of every run (default: the trainer's, what make train runs; "
                "--quick 2)", group=RUN),
           Option("--jobs", "children at once, one compute thread each (default 1)", type=Int(1, 64), default=1,
                  metavar="N", group=RUN),
           Option("--fashion-root", f"Fashion-MNIST's IDX files (default {FASHION_ROOT}, where `{FASHION_INSTALL}` "
                  f"puts them; not there: the sweep runs without it and says so)", type=Dir(), metavar="DIR",
                  group=RUN),
           like(trainer_option("teacher"), "the Fashion-MNIST teacher to distil from (default: one trained here)",
                flag="--fashion-teacher", metavar="PREFIX", group=RUN),
           tmp_option("scratch folder for the teachers, caches and runs (default: a temporary one)"),
           out_option("bench/results/recipe_sweep.json")]


def key(recipe):
    opt, mode, lr = recipe
    return f"{opt} {mode} {lr:g}"


def defaults():
    """The trainer's declared defaults that the sweep does not vary: what every run gets by passing nothing."""
    return {dest: trainer_option(dest).default for dest in ("student", "temperature", "alpha", "epochs",
                                                            "batch_size", "momentum", "wd", "warmup_epochs",
                                                            "val_fraction")}


def trainer_recipe():
    """(optimizer, lr mode, lr): the trainer's default recipe, as declared."""
    return (trainer_option("optimizer").default, trainer_option("lr_mode").default, trainer_option("lr").default)


def params(ap, args):
    root = args.fashion_root or FASHION_ROOT
    fashion = check_fashion(ap, args, root)
    if args.quick:
        plan = dict(QUICK)
    else:
        plan = dict(datasets=tuple(d for d in BUILTIN if d != "fashion-mnist" or fashion), grid=GRID, seeds=SEEDS,
                    epochs=None)
    plan["epochs"] = args.epochs or plan["epochs"]
    plan.update(fashion_root=fashion and os.path.abspath(fashion), fashion_skipped=None if fashion or args.quick
                else f"no Fashion-MNIST files in {root} (`{FASHION_INSTALL}`)", jobs=args.jobs)
    return plan


def run_task(plan, name, teacher, work, recipe, seed, after):
    opt, mode, lr = recipe
    run = f"{name}-{opt}-{mode}-{lr:g}-s{seed}"
    run_dir = os.path.join(work, "runs", run)

    def then(m):
        with open(os.path.join(run_dir, "metrics.json")) as fh:
            history = json.load(fh)["history"]
        log(f"{name} {key(recipe)} seed {seed}: val top-1 {history[-1]['val_acc']:.4f}, test {m['test_acc']:.4f}")
        return {"dataset": name, "optimizer": opt, "lr_mode": mode, "lr": lr, "seed": seed,
                "val_top1": history[-1]["val_acc"], "test_top1": m["test_acc"], "best_val_top1": m["best_val_top1"],
                "best_epoch": m["best_epoch"], "epochs": m["epochs"], "student": m["student"],
                "temperature": m["temperature"], "alpha": m["alpha"], "val_items": m["recipe"]["val_items"],
                "teacher_test_acc": m["teacher_test_acc"], "wall_s": round(m["_wall_s"], 1)}

    argv = trainer_argv(name, plan["fashion_root"], teacher, work, run, seed, "--optimizer", opt, "--lr-mode", mode,
                        "--lr", repr(lr), epochs=plan["epochs"], no_producer=True)
    return {"key": (name, recipe, seed), "argv": argv, "what": f"{name} {key(recipe)} seed {seed}", "after": after,
            "timeout": 7200, "then": then, "scratch": run_dir}


def rows_of(runs):
    """One row per (data set, recipe): seeds, mean and spread (max - min) of the last epoch's validation and test
    top-1."""
    groups = {}
    for r in runs:
        groups.setdefault((r["dataset"], (r["optimizer"], r["lr_mode"], r["lr"])), []).append(r)
    rows = []
    for (name, (opt, mode, lr)), rs in groups.items():
        val, test = [r["val_top1"] for r in rs], [r["test_top1"] for r in rs]
        rows.append({"dataset": name, "optimizer": opt, "lr_mode": mode, "lr": lr, "seeds": [r["seed"] for r in rs],
                     "val_top1": round(statistics.mean(val), 4), "val_spread": round(max(val) - min(val), 4),
                     "test_top1": round(statistics.mean(test), 4), "test_spread": round(max(test) - min(test), 4)})
    return rows


def ranking(rows, datasets):
    """Recipes run on every one of `datasets`, best first by the mean over them of the validation top-1."""
    by = {}
    for r in rows:
        by.setdefault((r["optimizer"], r["lr_mode"], r["lr"]), {})[r["dataset"]] = r["val_top1"]
    out = [{"optimizer": o, "lr_mode": m, "lr": lr, "val_top1": {d: v[d] for d in datasets},
            "mean_val_top1": round(statistics.mean(v[d] for d in datasets), 4)}
           for (o, m, lr), v in by.items() if all(d in v for d in datasets)]
    return sorted(out, key=lambda r: -r["mean_val_top1"])


def run(kids, args, plan, work):
    teachers, tasks, runs_first = {}, [], []
    for name in sorted(plan["datasets"], key=lambda d: d != "fashion-mnist"):  # the longest teacher first
        prefix, task, what = teacher_plan(name, work, quick=args.quick, fashion_root=plan["fashion_root"],
                                          given=args.fashion_teacher if name == "fashion-mnist" else None)
        teachers[name] = {"prefix": prefix, "source": what}
        if task:
            tasks.append(task)
        for seed in plan["seeds"][name]:
            tasks.append(fill_task(name, plan["fashion_root"], prefix, work, seed, epochs=plan["epochs"],
                                   after=[task["key"]] if task else []))
    small = [d for d in plan["datasets"] if d != "fashion-mnist"]
    for name in small:
        for recipe in plan["grid"]:
            for seed in plan["seeds"][name]:
                runs_first.append(run_task(plan, name, teachers[name]["prefix"], work, recipe, seed,
                                           [("fill", name, seed)]))
    log(f"{len(tasks)} teachers and caches to make, {len(runs_first)} runs on {', '.join(small)}, "
        f"{plan['jobs']} at a time")
    res = run_tasks(kids, plan["jobs"], tasks + runs_first, log)
    runs = [res[t["key"]] for t in runs_first]
    finalists = []
    if "fashion-mnist" in plan["datasets"]:
        order = [(r["optimizer"], r["lr_mode"], r["lr"]) for r in ranking(rows_of(runs), small)]
        finalists = list(dict.fromkeys(order[:FINALISTS] + [LANDED]))
        log(f"Fashion-MNIST runs {', '.join(map(key, finalists))}")
        more = [run_task(plan, "fashion-mnist", teachers["fashion-mnist"]["prefix"], work, recipe, seed, [])
                for recipe in finalists for seed in plan["seeds"]["fashion-mnist"]]
        done = run_tasks(kids, plan["jobs"], more, log)
        runs += [done[t["key"]] for t in more]
    for name, t in teachers.items():
        info = f"{t['prefix']}-info.json"
        if os.path.exists(info):
            with open(info) as fh:
                t["info"] = json.load(fh)
    rows = rows_of(runs)
    ranked = ranking(rows, plan["datasets"])
    choice = ranked[0]
    shutil.rmtree(os.path.join(work, "caches"), ignore_errors=True)
    return {"benchmark": "recipe_sweep", "loss": "kd", "teacher_mode": "cache", "quick": args.quick,
            "datasets": list(plan["datasets"]), "fashion_skipped": plan["fashion_skipped"], "grid": plan["grid"],
            "seeds": {d: plan["seeds"][d] for d in plan["datasets"]}, "finalists": finalists,
            "landed_default": dict(zip(("optimizer", "lr_mode", "lr"), LANDED)),
            "before_default": dict(zip(("optimizer", "lr_mode", "lr"), BEFORE)),
            "trainer_defaults": {**defaults(), **({"epochs": plan["epochs"]} if plan["epochs"] else {})},
            "selection": "the last epoch's top-1 on the validation slice (never the test split), mean over the seeds, "
                         "then over the data sets every recipe ran on",
            "teachers": teachers, "threads": 1, "jobs": plan["jobs"],
            "table": rows, "ranking": ranked,
            "choice": {k: choice[k] for k in ("optimizer", "lr_mode", "lr")}, "runs": runs}


# -- the tables ----------------------------------------------------------------------------------------------
def pct(x):
    return "-" if x is None else f"{x:.4f}"


def render_hard_labels(report):
    """The first sweep's table (hard labels, recipe_sweep_hard_labels.json)."""
    return [("", md_table(["student", "optimizer", "lr mode", "warm-up", "lr", "seeds", "test top-1", "spread",
                           "best val top-1"],
                          [(r["student"], r["optimizer"], r["lr_mode"], r["warmup_epochs"], f"{r['lr']:g}", r["seeds"],
                            f"{r['test_top1']:.4f}", f"{r['test_spread']:.4f}", pct(r["best_val_top1"]))
                           for r in report["table"]]))]


def render(report):
    """[(title, markdown table)]: the sweep's tables, from the JSON report alone (python -m bench.docs)."""
    if report.get("loss") != "kd":
        return render_hard_labels(report)
    rec = {k: (report[k]["optimizer"], report[k]["lr_mode"], report[k]["lr"]) for k in ("landed_default",
                                                                                        "before_default", "choice")}
    words = [(rec["choice"], "**chosen**"), (rec["landed_default"], "the default before"),
             (rec["before_default"], "the trainer's first default")]

    def note(r):
        return ", ".join(w for rc, w in words if rc == (r["optimizer"], r["lr_mode"], r["lr"]))

    main = md_table(["data set", "optimizer", "lr mode", "lr", "seeds", "val top-1", "spread", "test top-1", "spread",
                     ""],
                    [(r["dataset"], r["optimizer"], r["lr_mode"], f"{r['lr']:g}", ",".join(map(str, r["seeds"])),
                      pct(r["val_top1"]), pct(r["val_spread"]), pct(r["test_top1"]), pct(r["test_spread"]), note(r))
                     for r in report["table"]])
    def ranked(rows, ds):
        return md_table(["optimizer", "lr mode", "lr", *(f"{d} val" for d in ds), "mean val top-1", ""],
                        [(r["optimizer"], r["lr_mode"], f"{r['lr']:g}", *(pct(r["val_top1"][d]) for d in ds),
                          pct(r["mean_val_top1"]), note(r)) for r in rows])

    tables = [("", main)]
    small = [d for d in report["datasets"] if d != "fashion-mnist"]
    if report.get("finalists") and small != report["datasets"]:
        tables.append((f"On {' and '.join(small)}, every recipe, best first (Fashion-MNIST then ran "
                       f"{' and '.join(key(tuple(f)) for f in report['finalists'])}):",
                       ranked(ranking(report["table"], small), small)))
    tables.append(("Recipes run on every data set, best first (the choice):",
                   ranked(report["ranking"], report["datasets"])))
    return tables


def show(report):
    print(rendered(render(report)))
    if report.get("fashion_skipped"):
        print(f"\nFashion-MNIST not measured: {report['fashion_skipped']}.")
    c, now = report["choice"], trainer_recipe()
    chosen = (c["optimizer"], c["lr_mode"], c["lr"])
    print(f"\nChoice: {key(chosen)}; the trainer's default: {key(now)}"
          + ("" if chosen == now or report["quick"] else " -- NOT the sweep's choice"))
