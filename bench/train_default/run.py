"""The default recipe's test accuracy on every built-in data set, against floors (python -m bench.train_default)."""
import json
import os
import shutil
import statistics

from bench.cli import RUN, like, out_option, quick_option, tmp_option, trainer_option
from bench.common import ROOT, floors_line, heading, make_log, md_table, python_m, rendered, run_tasks, verdict
from bench.recipe.builtin import BUILTIN, FASHION_INSTALL, FASHION_ROOT, check_fashion, teacher_plan, trainer_argv
from kdcache.args import Dir, Int, Option

log = make_log("train_default")
DEFAULT_OUT = os.path.join(ROOT, "bench", "results", "train_default.json")

# Test top-1 of `make train` (the default recipe, seed 0) before the recipe change (Adam at 0.01, a fixed rate):
# digits 351 of 359 test images (0.9777, 0.978 rounded), mnist5k 0.959, Fashion-MNIST 0.852 (measured later, with
# bench.recipe's 8-epoch teacher); mnist5k's and Fashion-MNIST's rounded down. A floor is on every seed's run.
FLOORS = {"digits": 0.9777, "mnist5k": 0.95, "fashion-mnist": 0.85}
SEEDS = {"digits": (0, 1, 2), "mnist5k": (0, 1, 2), "fashion-mnist": (0,)}
QUICK = dict(datasets=("digits", "mnist5k"), seeds={"digits": (0,), "mnist5k": (0,)})

OPTIONS = [quick_option("digits and mnist5k, seed 0 (what make train runs), with their default teachers; the floors "
                        "still apply (the test runs it)"),
           Option("--seeds", "seeds 0..N-1 of every data set (default: 3 for digits and mnist5k, 1 for Fashion-MNIST)",
                  type=Int(1, 100), metavar="N", group=RUN),
           Option("--jobs", "children at once, one compute thread each (default 1)", type=Int(1, 64), default=1,
                  metavar="N", group=RUN),
           Option("--fashion-root", f"Fashion-MNIST's IDX files (default {FASHION_ROOT}, where `{FASHION_INSTALL}` "
                  f"puts them; not there: measured without it, and said)", type=Dir(), metavar="DIR", group=RUN),
           like(trainer_option("teacher"), "the Fashion-MNIST teacher to distil from (default: one trained here)",
                flag="--fashion-teacher", metavar="PREFIX", group=RUN),
           tmp_option("scratch folder for the teachers, caches and runs (default: a temporary one)"),
           out_option("bench/results/train_default.json")]


def params(ap, args):
    root = args.fashion_root or FASHION_ROOT
    fashion = check_fashion(ap, args, root)
    plan = dict(QUICK) if args.quick else dict(
        datasets=tuple(d for d in BUILTIN if d != "fashion-mnist" or fashion), seeds=SEEDS)
    if args.seeds:
        plan["seeds"] = {d: tuple(range(args.seeds)) for d in plan["datasets"]}
    plan.update(fashion_root=fashion and os.path.abspath(fashion), jobs=args.jobs,
                fashion_skipped=None if fashion or args.quick else f"no Fashion-MNIST files in {root} "
                                                                   f"(`{FASHION_INSTALL}`)")
    return plan


def train_task(plan, name, teacher, work, seed, after):
    """`make train DATASET=name SEED=seed` (the trainer starts the producer that fills the cache, as there)."""
    run = f"{name}-s{seed}"
    run_dir = os.path.join(work, "runs", run)

    def then(m):
        with open(os.path.join(run_dir, "metrics.json")) as fh:
            history = json.load(fh)["history"]
        return {"dataset": name, "seed": seed, "test_top1": m["test_acc"], "val_top1": history[-1]["val_acc"],
                "recipe": m["recipe"], "student": m["student"], "epochs": m["epochs"], "temperature": m["temperature"],
                "alpha": m["alpha"], "teacher_test_acc": m["teacher_test_acc"], "wall_s": round(m["_wall_s"], 1),
                "cores": m["_cpu"]}

    return {"key": (name, seed), "argv": trainer_argv(name, plan["fashion_root"], teacher, work, run, seed),
            "what": f"make train DATASET={name} SEED={seed}", "after": after, "timeout": 7200, "then": then,
            "scratch": run_dir}


def run(kids, args, plan, work):
    peak = kids.run(python_m("bench.producer.children", "peak"), "the peak", timeout=600)
    tasks, runs, teachers = [], [], {}
    for name in plan["datasets"]:
        prefix, task, what = teacher_plan(name, work, quick=False, fashion_root=plan["fashion_root"],
                                          given=args.fashion_teacher if name == "fashion-mnist" else None)
        teachers[name] = {"prefix": prefix, "source": what}
        after = [task["key"]] if task else []
        tasks += [task] if task else []  # the teachers first: the longest tasks, while the others' runs go on
        for i, seed in enumerate(plan["seeds"][name]):
            # the first seed's run of a data set ahead of the others: no two producers start on one cache
            runs.append(train_task(plan, name, prefix, work, seed, after + ([(name, plan["seeds"][name][0])]
                                                                            if i else [])))
    log(f"{len(tasks)} teachers to train, {len(runs)} runs, {plan['jobs']} at a time")
    res = run_tasks(kids, plan["jobs"], tasks + runs, log)
    for t in teachers.values():
        info = f"{t['prefix']}-info.json"
        if os.path.exists(info):
            with open(info) as fh:
                t["info"] = json.load(fh)
    shutil.rmtree(os.path.join(work, "caches"), ignore_errors=True)
    results = [res[t["key"]] for t in runs]
    rows = []
    for name in plan["datasets"]:
        rs = [r for r in results if r["dataset"] == name]
        acc = [r["test_top1"] for r in rs]
        rows.append({"dataset": name, "seeds": [r["seed"] for r in rs], "test_top1": acc,
                     "mean": round(statistics.mean(acc), 4), "spread": round(max(acc) - min(acc), 4),
                     "floor": FLOORS[name], "verdict": verdict(min(acc), FLOORS[name]),
                     "wall_s": [r["wall_s"] for r in rs]})
    peak = {k: v for k, v in peak.items() if not k.startswith("_")}
    from bench.flops import cpu_id
    return {"benchmark": "train_default", "quick": args.quick, "datasets": list(plan["datasets"]),
            "fashion_skipped": plan["fashion_skipped"], "recipe": results[0]["recipe"],
            "defaults": {k: results[0][k] for k in ("student", "epochs", "temperature", "alpha")},
            "teachers": teachers, "threads": 1, "jobs": plan["jobs"], "cpu_id": cpu_id(), "peak": peak,
            "table": rows, "runs": results}


# -- the tables ----------------------------------------------------------------------------------------------
def recipe_text(r):
    sched = r["lr_mode"] + (f", {r['warmup_epochs']} warm-up epochs" if r.get("warmup_epochs") else "")
    mom = f", momentum {r['momentum']:g}" if r["optimizer"] in ("sgd", "nag") else ""
    return f"{r['optimizer']} lr {r['lr']:g} {sched}{mom}, wd {r['wd']:g}"


def render(report):
    """[(title, markdown table)] from the JSON report alone (python -m bench.docs)."""
    d, c, p = report["defaults"], report["cpu_id"], report["peak"]
    rows = [(r["dataset"], ", ".join(f"{a:.4f}" for a in r["test_top1"]), ",".join(map(str, r["seeds"])),
             f"{r['mean']:.4f}", f"{r['spread']:.4f}", f">= {r['floor']}", r["verdict"],
             f"{statistics.mean(r['wall_s']):.0f}") for r in report["table"]]
    title = (f"`make train` defaults: {recipe_text(report['recipe'])}; student {d['student']}, {d['epochs']} epochs, "
             f"KD from the cache at T = {d['temperature']:g}, alpha {d['alpha']:g}. {c['model_name'] or 'CPU'} "
             f"({c['cpus']} CPUs), {report['threads']} thread per run, {report['jobs']} run(s) at a time; measured "
             f"peak {p['gflops']:.1f} GFLOP/s per core.")
    return [(title, md_table(["data set", "test top-1 (each seed)", "seeds", "mean", "spread", "floor (every seed)",
                              "verdict", "s per run"], rows))]


def show(report):
    from bench.flops import peak_line
    print(heading("The default recipe's test accuracy", report["quick"], report["runtime_s"]))
    print(rendered(render(report)) + "\n")
    print(peak_line(report["peak"], report["cpu_id"]))
    for name, t in report["teachers"].items():
        acc = (t.get("info") or {}).get("test_acc")
        print(f"{name} teacher: {t['source']}" + (f", test top-1 {acc:.4f}" if acc is not None else ""))
    if report.get("fashion_skipped"):
        print(f"Fashion-MNIST not measured: {report['fashion_skipped']}.")
    missed = [f"{r['dataset']} >= {r['floor']}" for r in report["table"] if r["verdict"] != "PASS"]
    print(floors_line(missed))
    return 1 if missed else 0
