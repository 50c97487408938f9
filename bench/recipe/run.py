"""The recipe sweep's runs, its report and its table (python -m bench.recipe)."""
import os
import statistics

from bench.cli import out_option, quick_option, tmp_option
from bench.common import ROOT, make_log, md_table, python_m, rendered
from kdcache.args import Int, Option

log = make_log("recipe")
DEFAULT_OUT = os.path.join(ROOT, "bench", "results", "recipe_sweep.json")

# (optimizer, lr-mode, warm-up epochs, rates): Adam at a fixed rate is the old default; SGD with
# momentum 0.9 and a cosine or step schedule is the literature's (GluonCV, the distillation papers).
# The rates bracket each one's best on this budget (a first pass found SGD at 0.03 and Adam at 1e-3
# far behind); the warm-up rows ask whether one epoch of it makes the high rates safe.
RECIPES = [("adam", "constant", 0, (3e-3, 1e-2, 3e-2)), ("sgd", "cosine", 0, (0.1, 0.3, 1.0)),
           ("sgd", "step", 0, (0.1, 0.3, 1.0)), ("sgd", "cosine", 1, (0.3, 1.0))]
FULL = dict(dataset="mnist5k", students=("mlp128", "mlp", "small_cnn"), seeds=(0, 1), epochs=8, recipes=RECIPES)
QUICK = dict(dataset="digits", students=("mlp",), seeds=(0,), epochs=2,
             recipes=[("adam", "constant", 0, (1e-2,)), ("sgd", "cosine", 1, (0.1,))])

OPTIONS = [quick_option("digits, mlp, two recipes, two epochs, one seed: seconds"),
           Option("--epochs", "epochs per run (default: 8; --quick 2)", type=Int(1, 1000), metavar="E", group="run"),
           tmp_option("scratch folder for the runs (default: a temporary one)"),
           out_option("bench/results/recipe_sweep.json")]


def run_one(kids, tmp, dataset, student, optimizer, mode, warmup, lr, seed, epochs):
    name = f"{student}-{optimizer}-{mode}-w{warmup}-{lr:g}-s{seed}"
    argv = python_m("kdcache.trainer", "--quiet", "--json", "--teacher-mode", "none", "--dataset", dataset,
                    "--student", student, "--optimizer", optimizer, "--lr-mode", mode, "--lr", repr(lr),
                    "--warmup-epochs", warmup,
                    "--epochs", epochs, "--seed", seed, "--threads", 1, "--run", name,
                    "--runs-dir", os.path.join(tmp, "runs"), "--cache-dir", os.path.join(tmp, "caches"))
    m = kids.run(argv, name, timeout=3600)
    return {"student": student, "optimizer": optimizer, "lr_mode": mode, "warmup_epochs": warmup, "lr": lr, "seed": seed,
            "test_top1": m["test_acc"], "best_val_top1": m.get("best_val_top1"), "best_epoch": m.get("best_epoch"),
            "wall_s": m["wall_s"]}


def table(runs):
    groups = {}
    for r in runs:
        groups.setdefault((r["student"], r["optimizer"], r["lr_mode"], r["warmup_epochs"], r["lr"]), []).append(r)
    rows = []
    for (student, opt, mode, warmup, lr), rs in groups.items():
        test = [r["test_top1"] for r in rs]
        val = [r["best_val_top1"] for r in rs if r["best_val_top1"] is not None]
        rows.append({"student": student, "optimizer": opt, "lr_mode": mode, "warmup_epochs": warmup, "lr": lr,
                     "seeds": len(rs),
                     "test_top1": round(statistics.mean(test), 4),
                     "test_spread": round(max(test) - min(test), 4),
                     "best_val_top1": round(statistics.mean(val), 4) if val else None})
    return rows


def render(report):
    """[(title, markdown table)]: the sweep's table, from the JSON report alone (python -m bench.docs)."""
    return [("", md_table(["student", "optimizer", "lr mode", "warm-up", "lr", "seeds", "test top-1", "spread",
                           "best val top-1"],
                          [(r["student"], r["optimizer"], r["lr_mode"], r["warmup_epochs"], f"{r['lr']:g}", r["seeds"],
                            f"{r['test_top1']:.4f}", f"{r['test_spread']:.4f}",
                            "-" if r["best_val_top1"] is None else f"{r['best_val_top1']:.4f}")
                           for r in report["table"]]))]


def params(ap, args):
    plan = dict(QUICK if args.quick else FULL)
    plan["epochs"] = args.epochs or plan["epochs"]
    return plan


def run(kids, args, plan, work):
    runs = []
    for student in plan["students"]:
        for optimizer, mode, warmup, rates in plan["recipes"]:
            for lr in rates:
                for seed in plan["seeds"]:
                    runs.append(run_one(kids, work, plan["dataset"], student, optimizer, mode, warmup, lr, seed,
                                        plan["epochs"]))
                    log(f"{runs[-1]}")
    return {"benchmark": "recipe_sweep", "quick": args.quick, "dataset": plan["dataset"], "epochs": plan["epochs"],
            "teacher_mode": "none", "threads": 1, "batch_size": 64, "momentum": 0.9, "wd": 1e-4, "val_fraction": 0.1,
            "table": table(runs), "runs": runs}


def show(report):
    print(rendered(render(report)))
