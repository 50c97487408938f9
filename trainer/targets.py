"""Where the teacher's targets come from when the trainer starts the producer itself.

No MXNet here: python -m trainer starts the producer (and creates the ring) before it imports
MXNet, so the producer's start-up (its own MXNet import, data load, teacher load) overlaps the
trainer's instead of coming after it, inside the first epoch.
"""
import dataclasses
import functools
import logging
import os
import signal
import subprocess
import sys
import time

from pipeline.children import die_with_parent

log = logging.getLogger("kdcache.trainer")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TrainError(Exception):
    """A run cannot go on; the message names the cause and the fix."""


def teacher_arg(args):
    """--teacher, or the default digits teacher `make teacher` builds."""
    if args.teacher:
        return args.teacher
    if args.dataset == "digits":
        prefix = os.path.join(ROOT, "teachers", "digits")
        if not os.path.exists(prefix + "-symbol.json"):
            raise TrainError(f"the default digits teacher {prefix}-symbol.json is missing: run `make teacher` "
                             f"(or pass --teacher PREFIX)")
        return prefix
    raise TrainError(f"--teacher-mode {args.teacher_mode} needs --teacher PREFIX[:EPOCH] for data set {args.dataset}")


def producer_command(args, topt, spec_path, *, split="train", online=True, threads=1, ring=None):
    """The public entry point of the producer, with the options that make the same cache."""
    cmd = [sys.executable, "-m", "cache_builder", "--quiet", "--json",
           "--teacher", f"{topt.prefix}:{topt.epoch}" if topt.epoch is not None else topt.prefix,
           "--dataset", args.dataset, "--split", split, "--views", str(args.views if split == "train" else 1),
           "--augment", args.augment if split == "train" else "none", "--seed", str(args.seed),
           "--codec", args.codec if split == "train" else "full",
           "--dtype", args.dtype if split == "train" else "float32", "--batch-size", str(args.batch_size),
           "--threads", str(threads)]
    for opt, val in (("--data-root", args.data_root), ("--image-size", args.image_size),
                     ("--num-classes", args.num_classes), ("--teacher-input", args.teacher_input),
                     ("--teacher-mean", args.teacher_mean), ("--teacher-std", args.teacher_std),
                     ("--teacher-size", args.teacher_size)):
        if val is not None:
            cmd += [opt, str(val)]
    if online:
        cmd += ["--timeline", os.path.join(args.runs_dir, args.run_name, "producer-timeline.json")]
    if ring is not None:
        cmd += ["--ring", ring, "--epochs", str(args.epochs)]
    else:
        cmd += ["--cache", spec_path]
        if online:
            cmd += ["--online", "--epochs", str(args.epochs)]
    return cmd


def start_producer(cmd, log_path):
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    fh = open(log_path, "ab")
    log.info("starting producer: %s (log: %s)", " ".join(cmd[1:]), log_path)
    proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
                            preexec_fn=functools.partial(die_with_parent, os.getpid()))
    fh.close()
    return proc


def stop_producer(proc, timeout=10.0):
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)  # a clean stop: committed rows are kept
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def producer_failure(proc, log_path):
    """The producer's own error line, when it exited with one."""
    if proc is None or proc.poll() in (None, 0):
        return None
    if proc.returncode < 0:
        try:
            name = signal.Signals(-proc.returncode).name
        except ValueError:
            name = f"signal {-proc.returncode}"
        return f"it was killed ({name})"
    try:
        lines = [ln for ln in open(log_path, errors="replace").read().splitlines() if ln.strip()]
    except OSError:
        lines = []
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs or lines or [f"exit status {proc.returncode}"])[-1]


def run_name_error(run_name):
    """Why a --run name is refused (it names a directory), or None."""
    if os.sep in run_name or run_name in (".", "..") or \
            not run_name.replace("-", "").replace("_", "").replace(".", "").isalnum():
        return f"--run {run_name!r}: use letters, digits, '-', '_' and '.' only"
    return None


_loaded = {}


def load_train(args):
    """The training split, loaded the same way (and once) wherever the trainer needs it."""
    from pipeline.datasets import load_dataset
    key = (args.dataset, args.data_root, args.image_size, args.num_classes)
    if key not in _loaded:
        _loaded[key] = load_dataset(args.dataset, data_root=args.data_root, split="train",
                                    image_size=args.image_size, num_classes=args.num_classes)
    return _loaded[key]


@dataclasses.dataclass
class EarlyStart:
    """What python -m trainer set up before importing MXNet, for run() to take over."""
    run_name: str
    train: object  # the training split, loaded once
    producer: subprocess.Popen = None
    ring: object = None  # store.ring.RingReader the producer writes into

    def close(self):
        """Idempotent: run() stops and closes the same objects when it gets that far."""
        stop_producer(self.producer)
        if self.ring is not None:
            self.ring.close()


def start_early(args, cores, threads):
    """Start the producer a cache or ring run needs, before the trainer imports MXNet.

    Returns None when there is nothing to start early or anything is off: run() then does the
    same work itself and reports any error with its usual message. Distributed runs start their
    producer in run(), on worker 0, once the kvstore has said which worker this is."""
    if args.teacher_mode != "cache" or args.no_producer or (args.kvstore or "").startswith("dist"):
        return None
    if args.dataset.split(":")[0] in ("recordio", "imagefolder"):
        return None  # decoding them loads MXNet
    run_name = args.run or time.strftime("%Y%m%d-%H%M%S")
    run_dir = os.path.join(args.runs_dir, run_name)
    if run_name_error(run_name) or (os.path.exists(os.path.join(run_dir, "state.json")) and not args.resume):
        return None
    try:
        from pipeline.cachespec import TeacherOptions, spec_from_args
        from store import path_for, registry
        from store.segment import lock_holders
        train = load_train(args)
        topt = TeacherOptions.from_args(args, teacher_arg(args))
        spec, _ = spec_from_args(args, train, topt)
    except Exception:
        return None
    args.run = args.run_name = run_name  # run() uses the same name (a time stamp could tick over)
    early = EarlyStart(run_name, train)
    os.makedirs(run_dir, exist_ok=True)
    ptheads = args.producer_threads or max(1, cores - threads)
    if args.store == "ring":
        from store.ring import RingReader
        early.ring = RingReader(f"kdcache-ring-{os.getpid()}-{run_name}"[:60], create=True,
                                capacity=args.ring_capacity, num_classes=spec.num_classes, codec=spec.codec,
                                dtype=spec.dtype, timeout=args.wait_timeout, fingerprint=spec.fingerprint)
        early.producer = start_producer(producer_command(args, topt, None, threads=ptheads, ring=early.ring.name),
                                        os.path.join(run_dir, "producer.log"))
        return early
    base = registry.base_path(args.cache) if args.cache != "auto" else path_for(args.cache_dir, spec.fingerprint)
    if os.path.exists(registry.final_path(base)):
        return early  # complete: nothing to start
    parts = registry.parts_path(base)
    if registry.exists(base) and os.path.isdir(parts) and lock_holders(parts):
        return early  # a producer is filling it already: run() reads behind it
    early.producer = start_producer(producer_command(args, topt, base, threads=ptheads),
                                    os.path.join(run_dir, "producer.log"))
    return early
