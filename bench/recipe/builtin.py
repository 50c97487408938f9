"""The built-in data sets `make train` runs on, the teacher each one distils from, and the children that train
them (shared by bench.recipe, the recipe sweep, and bench.train_default, the default recipe's accuracy).

digits and mnist5k ship with kdcache and have default teachers (teachers/NAME, `make teacher DATASET=NAME`):
a benchmark uses the project's when it is there, else trains it in its scratch folder with the same command.
Fashion-MNIST is measured where its files are installed (`apt-get install dataset-fashion-mnist`); it has no
default teacher, so one is trained here (bench.quality's CNN, fewer epochs) unless one is given.
"""
import os

from bench.common import ROOT, python_m
from bench.quality.run import DATA_ROOT as FASHION_ROOT
from bench.quality.run import INSTALL as FASHION_INSTALL
from bench.quality.run import TEACHER as QUALITY_TEACHER
from bench.quality.run import idx_folder

BUILTIN = ("digits", "mnist5k", "fashion-mnist")
# The Fashion-MNIST teacher trained here: bench.quality's network and augmentation, 8 epochs instead of 15 (one
# thread: ~12 s an epoch on an idle core); what it reaches is in each report.
FASHION_TEACHER = dict(QUALITY_TEACHER, epochs=8)
QUICK_TEACHER_EPOCHS = 2

__all__ = ["BUILTIN", "FASHION_INSTALL", "FASHION_ROOT", "FASHION_TEACHER", "check_fashion", "data_args",
           "fashion_installed", "fill_task", "teacher_plan", "trainer_argv"]


def fashion_installed(root):
    """The folder of Fashion-MNIST's four IDX files under root, or None where they are not all there."""
    return idx_folder(root) if root and os.path.isdir(root) else None


def check_fashion(ap, args, root):
    """The folder of Fashion-MNIST's files to measure on (None: not installed, or --quick: not measured). A
    --fashion-root given must hold them; --fashion-teacher needs them, and its checkpoint files must be there and
    readable (else one line, exit status 2)."""
    fashion = fashion_installed(root)
    if fashion is None and args.fashion_root:
        ap.error(f"argument --fashion-root: no Fashion-MNIST IDX files (train-images-idx3-ubyte[.gz] and the other "
                 f"three) in {root}: name the folder that holds them, or leave the option out")
    if fashion is None and args.fashion_teacher:
        ap.error(f"argument --fashion-teacher: no Fashion-MNIST files in {root} to distil on: install them with "
                 f"`{FASHION_INSTALL}` or pass --fashion-root DIR")
    if args.fashion_teacher is None or args.quick:
        return None if args.quick else fashion
    from kdcache.pipeline.teacher_files import TeacherError, checkpoint_files, parse_teacher_arg
    try:
        checkpoint_files(*parse_teacher_arg(args.fashion_teacher))
    except TeacherError as e:
        ap.error(f"argument --fashion-teacher: {e}")
    return fashion


def data_args(name, fashion_root):
    return ["--dataset", name] + (["--data-root", fashion_root] if name == "fashion-mnist" else [])


def teacher_plan(name, work, *, quick, fashion_root, given=None):
    """(prefix, task or None, description): the teacher `name` distils from, and the child that trains it when
    it is not there. digits, mnist5k: the project's default teacher (make teacher) when built, else the same
    command into work/teachers (--quick: always a QUICK_TEACHER_EPOCHS-epoch one there). fashion-mnist: `given`,
    else FASHION_TEACHER trained into work/teachers."""
    if given:
        return os.path.abspath(given), None, f"given ({given})"
    project = os.path.join(ROOT, "teachers", name)
    if name != "fashion-mnist" and not quick and os.path.exists(project + "-symbol.json"):
        return project, None, f"teachers/{name} (`make teacher DATASET={name}`)"
    prefix = os.path.join(work, "teachers", name)
    extra, what = [], f"kdcache teacher --dataset {name} (the data set's default), trained here"
    if name == "fashion-mnist":
        t = FASHION_TEACHER
        extra = ["--arch", t["arch"], "--epochs", t["epochs"], "--augment", t["augment"], "--seed", t["seed"]]
        what = f"{t['arch']}, {t['epochs']} epochs, augment {t['augment']}, trained here"
    if quick:
        extra, what = [*extra, "--epochs", QUICK_TEACHER_EPOCHS], f"{QUICK_TEACHER_EPOCHS}-epoch teacher, trained here"
    argv = python_m("kdcache.trainer.make_teacher", *data_args(name, fashion_root), *extra, "--out", prefix,
                    "--threads", 1, "--quiet")
    task = {"key": ("teacher", name), "argv": argv, "what": f"the {name} teacher", "json_line": False,
            "timeout": 7200}
    return prefix, task, what


def trainer_argv(name, fashion_root, teacher, work, run, seed, *recipe, epochs=None, no_producer=False):
    """`kdcache train` as `make train DATASET=name SEED=seed` runs it (the trainer's defaults for everything not
    named: student, T, alpha, epochs, batch), plus `recipe` (options), one thread, and where it writes."""
    return python_m("kdcache.trainer", *data_args(name, fashion_root), "--teacher", teacher, "--seed", seed,
                    *recipe, *(["--epochs", epochs] if epochs else []), *(["--no-producer"] if no_producer else []),
                    "--threads", 1, "--quiet", "--json", "--run", run, "--runs-dir", os.path.join(work, "runs"),
                    "--cache-dir", os.path.join(work, "caches"))


def fill_task(name, fashion_root, teacher, work, seed, *, epochs=None, after=()):
    """The offline producer filling the cache the trainer of (name, seed) reads (the same shared options)."""
    argv = python_m("kdcache.cache_builder", *data_args(name, fashion_root), "--teacher", teacher, "--seed", seed,
                    *(["--epochs", epochs] if epochs else []), "--cache-dir", os.path.join(work, "caches"),
                    "--threads", 1, "--quiet", "--json")
    return {"key": ("fill", name, seed), "argv": argv, "what": f"the {name} cache (seed {seed})",
            "after": list(after), "timeout": 7200}
