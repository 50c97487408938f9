"""The trainer's command line (no MXNet import here: threads are fixed before MXNet loads).

The options it shares with the producer come from pipeline.options.SHARED, declared once.
"""
import argparse
import os
import re
from typing import NamedTuple

from kdcache.args import Allowed, Commas, Dir, Float, Floats, Int, Name, Option, Parser, Temperature, add_options, fail
from kdcache.pipeline.options import SHARED, check_applies, check_views, resolve_teacher
from kdcache.trainer.defaults import DEFAULT_ALPHA, DEFAULT_TEMPERATURE, SMOOTHING

DESCRIPTION = """\
Train a student network with knowledge distillation from cached teacher logits.

Teacher modes: cache (default) reads the teacher's raw logits from the soft-target cache
named by the teacher, data, views and codec; when the cache is incomplete and no producer is
running, a producer (kdcache cache --online) is started on the cores the trainer leaves free,
and targets not there yet are waited for (counted as stall). inline runs the teacher inside
the training loop (GluonCV's way; same loss code). none trains on the hard labels alone. A
warm cache makes the teacher cost nothing: a second experiment with another student,
temperature or alpha reuses it."""


class Devices(NamedTuple):
    """The devices --ctx names: kind auto, cpu or gpu, and the device ids (None: the kind's default)."""
    kind: str
    ids: tuple = None

    def __str__(self):
        return self.kind + ("" if self.ids is None else ":" + ",".join(map(str, self.ids)))


class Ctx(Allowed):
    """auto | cpu | cpu:0,1 | gpu | gpu:0[,1,...]."""

    def __call__(self, s):
        v = str(s).strip().lower()
        m = re.fullmatch(r"(cpu|gpu)(?::(\d+(?:,\d+)*))?", v)
        if v == "auto":
            return Devices("auto")
        if not m:
            fail(f"{s!r}: use auto, cpu, cpu:0,1 or gpu:0[,1,...]")
        ids = None if m.group(2) is None else tuple(int(i) for i in m.group(2).split(","))
        if ids is not None and len(set(ids)) != len(ids):
            fail(f"{s!r}: device ids must be distinct")
        return Devices(m.group(1), ids)


def zoo_names():
    """The Gluon model-zoo's network names, read from MXNet's source without importing MXNet (the
    trainer fixes its threads first); None when that file cannot be read."""
    import ast
    import importlib.util
    try:
        spec = importlib.util.find_spec("mxnet")
        path = os.path.join(spec.submodule_search_locations[0], "gluon", "model_zoo", "vision", "__init__.py")
        with open(path) as fh:
            tree = ast.parse(fh.read())
    except (ImportError, AttributeError, TypeError, OSError, SyntaxError):
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) and \
                any(getattr(t, "id", None) == "models" for t in node.targets):
            return {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
    return None


class Student(Allowed):
    """A built-in student (mlp128, mlp, mlp800x2, small_cnn, small_cnn_flat) or a Gluon model-zoo name."""

    BUILTIN = ("mlp128", "mlp", "mlp800x2", "small_cnn", "small_cnn_flat", "digits_teacher")

    def __call__(self, s):
        from kdcache.pipeline.user_code import is_piece
        if is_piece(s):
            return s.strip()  # MODULE:FUNCTION(classes) -> HybridBlock, loaded (and checked) with the student
        zoo = zoo_names()
        if s not in self.BUILTIN and zoo is not None and s not in zoo:
            fail(f"{s!r} is not a known network: use {', '.join(self.BUILTIN[:5])}, a Gluon model-zoo name "
                 f"such as resnet18_v1, mobilenet0.25, or MODULE:FUNCTION (your own)")
        return s


class Steps(Commas):
    """Epochs at which --lr-mode step multiplies the rate by --lr-factor: increasing integers >= 1
    separated by commas, e.g. 30,60,90."""

    def __init__(self):
        super().__init__(int, use="epochs separated by commas", example="30,60,90",
                         rule="the epochs must be at least 1 and increasing, e.g. 30,60,90", lo=1, increasing=True,
                         container=tuple)


class Ensemble(Allowed):
    """CACHE[:WEIGHT[:T]],CACHE[:WEIGHT[:T]]... (two or more caches of the same data, views and seed; WEIGHT
    and the member's temperature T default to 1)."""

    def __call__(self, s):
        from kdcache.store.derive.ensemble import parse_members  # numpy, no MXNet
        from kdcache.store.errors import StoreError
        try:
            return parse_members(s)
        except StoreError as e:
            fail(str(e))

    @staticmethod
    def format(v):
        return ",".join(str(m) for m in v)


KVSTORES = ("local", "device", "dist_sync", "dist_async", "dist_device_sync")

TRAINER = [
    Option("--student", "mlp128 | mlp | mlp800x2 | small_cnn | small_cnn_flat | a Gluon model-zoo name (resnet18_v1, "
           "mobilenet0.25, ...) | MODULE:FUNCTION (your own: FUNCTION(classes) returns a HybridBlock)",
           type=Student(), default="mlp128", metavar="ARCH", group="student", make="STUDENT"),
    Option("--optimizer", "sgd (with --momentum) | nag (Nesterov) | adam (see docs/recipe.md for the sweep the "
           "defaults come from)", choices=("sgd", "nag", "adam"), default="nag", group="recipe"),
    Option("--lr", "base learning rate (the peak after warm-up)", type=Float(0, 10, gt=True), default=0.1,
           metavar="LR", group="recipe"),
    Option("--momentum", "momentum of sgd and nag (adam ignores it)", type=Float(0, 1), default=0.9, metavar="M",
           group="recipe"),
    Option("--wd", "weight decay", type=Float(0, 1), default=1e-4, metavar="WD", group="recipe"),
    Option("--lr-mode", "constant | step (times --lr-factor at each of --lr-steps) | cosine (to 0 at the last "
           "epoch), after the warm-up; updated every step", choices=("constant", "step", "cosine"),
           default="cosine", group="recipe"),
    Option("--lr-steps", "epochs where --lr-mode step decays, e.g. 30,60,90 (default: half and three quarters of "
           "--epochs)", type=Steps(), metavar="E1,E2,...", group="recipe"),
    Option("--lr-factor", "what each --lr-steps epoch multiplies the rate by", type=Float(0, 1, gt=True),
           default=0.1, metavar="F", group="recipe"),
    Option("--warmup-epochs", "epochs of linear warm-up from ~0 to --lr", type=Int(0, 100000), default=0,
           metavar="E", group="recipe"),
    Option("--val-fraction", "share of the training split held out (by --seed) to pick the best checkpoint; never "
           "trained on; 0: none", type=Float(0, 0.5), default=0.1, metavar="F", group="recipe"),
    Option("--save-every", "keep the parameters of every Nth epoch too (the last and the best are always kept)",
           type=Int(1, 100000), metavar="N", group="recipe"),
    Option("--student-mean", "per-channel mean subtracted from the student's [0,1] input images (one value, or one "
           "per channel; default: none); the teacher's preprocessing is --teacher-mean's", type=Floats(),
           metavar="M[,M,M]", group="student"),
    Option("--student-std", "per-channel std the student's input images are divided by (> 0; default: none)",
           type=Floats(positive=True), metavar="S[,S,S]", group="student"),
    Option("--ctx", "auto (GPU when MXNet sees one) | cpu | gpu:0[,1,...] (several GPUs: each batch is split "
           "across them, gradients summed by the device kvstore) | cpu:0,1 (the same on CPU contexts)",
           type=Ctx(), default="auto", metavar="CTX", group="student"),
    Option("--threads", "trainer compute threads (default: the cores the producer leaves)", type=Int(1, 1024),
           metavar="N", group="student", make="THREADS"),
    Option("--kvstore", "MXNet kvstore: device (several devices; the default then), dist_sync or dist_async "
           "(workers started by kdcache launch); default: none for one device", choices=KVSTORES,
           group="student"),
    Option("--teacher-mode", "cache: targets from the store; inline: the teacher in the loop; none: hard labels",
           choices=("cache", "inline", "none"), default="cache", group="distillation", make="TEACHER_MODE"),
    Option("--temperature", "KD temperature (as GluonCV)", type=Temperature(), default=DEFAULT_TEMPERATURE,
           metavar="T", group="distillation", make="T", short="-T"),
    Option("--alpha", f"weight of the soft term; 1 - alpha weighs the hard labels ({DEFAULT_ALPHA:g} = GluonCV's)",
           type=Float(0, 1), default=DEFAULT_ALPHA, metavar="A", group="distillation", make="ALPHA"),
    Option("--label-smoothing", "eps of the hard-label term: the target (1 - eps) one-hot + eps / classes "
           "(GluonCV's --label-smoothing, 0.1 with mixup); with mixed views (--augment ...,mixup:A) each of the two "
           "labels is smoothed", type=SMOOTHING, default=0.0, metavar="EPS", group="distillation"),
    Option("--ensemble", "distil from several teachers' caches combined per key at read time (no teacher runs; "
           "replaces --teacher and --cache)", type=Ensemble(), metavar="CACHE[:W[:T]],...", group="distillation"),
    Option("--ensemble-rule", "logits: the weighted mean of the members' logits / T; probs: of their "
           "probabilities at T, as log-probabilities", choices=("logits", "probs"), default="logits",
           group="distillation"),
    Option("--store", "cache: persistent HDF5; ring: stream through shared memory, nothing persisted",
           choices=("cache", "ring"), default="cache", group="distillation"),
    Option("--ring-capacity", "ring size in rows", type=Int(1, 1 << 28), default=4096, metavar="ROWS",
           group="distillation"),
    Option("--no-producer", "never start a producer; wait for one started elsewhere", action="store_true",
           group="distillation"),
    Option("--producer-threads", "threads of the producer the trainer starts (default 1)", type=Int(1, 1024),
           metavar="N", group="distillation"),
    Option("--wait-timeout", "seconds to wait for a missing target", type=Float(0, None, gt=True), default=600.0,
           metavar="S", group="distillation"),
    Option("--run", "run name: outputs go to <runs-dir>/<run>/ (default: a time stamp)", type=Name(),
           metavar="NAME", group="run", make="RUN"),
    Option("--runs-dir", "where runs are written", type=Dir(), default="runs", metavar="DIR", group="run"),
    Option("--resume", "continue <runs-dir>/<run>/ from its last checkpoint (needs --run), with the run's options: "
           "one that differs is refused (docs/recipe.md lists those that may)", action="store_true", group="run"),
    Option("--quiet", "no progress bars", action="store_true", group="run"),
    Option("--json", "end with the metrics as one JSON line", action="store_true", group="run"),
]


# --- what a resumed run may change -------------------------------------------------------------
# `--resume` continues a run as the run it was: every option of SHARED + TRAINER is compared with
# the run's record (kdcache.trainer.resume) and a difference is refused, except the options below.
# A new option is compared until it is listed here, so it cannot be forgotten.
MAY_DIFFER = {
    "threads": "compute threads: how fast the same steps run",
    "producer_threads": "the producer's threads: how fast the same rows are written",
    "ctx": "the devices the same steps run on",
    "ring_capacity": "a buffer's size: the same rows pass through it",
    "wait_timeout": "how long a missing target is waited for",
    "no_producer": "who fills the cache, not what it holds",
    "save_every": "which epochs' parameters are kept, not what they are",
    "run": "names the run", "runs_dir": "where the run is", "resume": "this is the resume",
    "quiet": "output only", "json": "output only",
}
# Options that name files: compared by their content (the run records the data set's digest, the
# teacher's and the cache's fingerprint, the augmentation's spec), so a moved folder still resumes.
# A run recorded without that content compares their values instead.
BY_CONTENT = {"data_root": "dataset", "teacher": "teacher", "cache": "cache", "cache_dir": "cache",
              "augment": "augment"}


def epochs_in_schedule(lr_mode, lr_steps):
    """Whether --epochs shapes the learning rate of every update: cosine decays to 0 at the last
    epoch, step without --lr-steps steps at half and three quarters of it. Then a resume must keep
    --epochs; with constant or step at given epochs it may train on to another --epochs."""
    return lr_mode == "cosine" or (lr_mode == "step" and lr_steps is None)

def build_parser(prog="python -m kdcache.trainer"):
    p = Parser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, SHARED + TRAINER, cache={"help": "explicit cache path instead of <cache-dir>/<fingerprint> "
                                                    "(auto: the same as leaving it out)"})
    return p


def parse_args(argv=None, prog="python -m kdcache.trainer", launched=False):
    """The options, checked: a mistake exits here with one line and status 2, before anything runs.
    `launched`: checked by kdcache launch for its workers, before it sets their DMLC_* variables."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.cache == "auto":
        args.cache = None
    if args.ensemble is not None:
        for flag, bad in (("--teacher-mode", args.teacher_mode != "cache"), ("--store", args.store != "cache"),
                          ("--teacher", args.teacher is not None), ("--cache", args.cache is not None)):
            if bad:
                p.error(f"argument --ensemble: it reads the members' caches and runs no teacher; drop {flag}")
        args.no_producer = True  # the members are finished caches (or filled by producers started elsewhere)
    elif args.teacher_mode != "none":
        resolve_teacher(args, p)
    check_views(args, p)
    check_applies(args, p)
    if args.teacher_mode == "none":
        for dest in ("teacher", "teacher_input", "teacher_mean", "teacher_std", "teacher_size", "cache",
                     "producer_threads"):
            if getattr(args, dest) is not None:
                flag = "--" + dest.replace("_", "-")
                p.error(f"argument {flag}: --teacher-mode none trains on the hard labels alone, without a "
                        f"teacher; drop {flag} or use --teacher-mode cache or inline")
    if args.warmup_epochs and args.warmup_epochs >= args.epochs:
        p.error(f"argument --warmup-epochs: {args.warmup_epochs} leaves no epoch after the warm-up of --epochs "
                f"{args.epochs}: use fewer than {args.epochs}")
    if args.lr_steps is not None and args.lr_mode != "step":
        p.error(f"argument --lr-steps: it applies to --lr-mode step, not {args.lr_mode}: add --lr-mode step or "
                f"drop --lr-steps")
    if args.lr_steps is not None and args.lr_steps[-1] >= args.epochs:
        p.error(f"argument --lr-steps: epoch {args.lr_steps[-1]} is never reached in --epochs {args.epochs}: "
                f"use epochs below {args.epochs}")
    if args.resume and not args.run:
        p.error("argument --resume: name the run to continue with --run NAME")
    if args.store == "ring" and args.no_producer:
        p.error("argument --no-producer: the trainer creates its ring and starts the producer that fills it; "
                "drop --no-producer (or use --store cache to read behind a producer started elsewhere)")
    if args.store == "ring" and args.teacher_mode != "cache":
        p.error(f"argument --store: ring streams targets from a producer; it needs --teacher-mode cache, "
                f"not {args.teacher_mode}")
    if (args.kvstore or "").startswith("dist") and not launched and not all(os.environ.get(v) for v in (
            "DMLC_ROLE", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT", "DMLC_NUM_WORKER", "DMLC_NUM_SERVER")):
        p.error(f"argument --kvstore: {args.kvstore} needs a scheduler, servers and the DMLC_* variables: start "
                f"the workers with kdcache launch (or set DMLC_ROLE, DMLC_PS_ROOT_URI, DMLC_PS_ROOT_PORT, "
                f"DMLC_NUM_WORKER and DMLC_NUM_SERVER as the README shows)")
    if (args.kvstore or "").startswith("dist") and args.store == "ring":
        p.error("argument --store: a ring has one reader; distributed workers read a cache (--store cache)")
    return args


def sampled_warning(codec, temperature, *, member=None):
    """The one line a run prints when it distils from a `sampled:K` codec at a temperature other than 1, or
    None. Its rows are an unbiased estimate of the teacher's distribution at T = 1 (docs/codecs.md); at
    another T the student learns the estimate tempered, which is neither unbiased nor the teacher at T.
    `member`: (cache, its own T) of an ensemble member, whose own T tempers it first."""
    codec, t = str(codec or ""), float(temperature)
    mt = float(member[1]) if member else 1.0
    if not codec.startswith("sampled:") or (t == 1.0 and mt == 1.0):
        return None
    what = f"ensemble member {member[0]} (codec {codec})" if member else f"codec {codec}"
    at = f"--temperature {t:g}" if mt == 1.0 else f"its own T {mt:g} and --temperature {t:g}"
    fix = " and ".join(([] if t == 1.0 else ["pass -T 1"]) + ([] if mt == 1.0 else ["give the member T 1 (CACHE:W:1)"]))
    return (f"warning: {what} holds an unbiased estimate of the teacher's distribution at T = 1; at {at} the "
            f"student learns that estimate tempered (count^(1/T), renormalised), which is neither unbiased nor the "
            f"teacher at that temperature: {fix} for the estimate the codec is made for (docs/codecs.md)")


def recorded(args):
    """The options as a checkpoint records them (JSON): a value parsed into an object (--augment's
    Augment, --ctx's Devices) as its command-line word."""
    from kdcache.pipeline.augment import Augment
    by_dest = {o.dest: o for o in SHARED + TRAINER}
    return {k: by_dest[k].format(v) if isinstance(v, (Augment, Devices)) or k == "ensemble" and v else
            list(v) if isinstance(v, tuple) else v for k, v in vars(args).items()}
