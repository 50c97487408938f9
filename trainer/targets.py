"""Where the teacher's targets come from when the trainer starts the producer itself.

No MXNet here: python -m trainer starts the producer (and creates the ring) before it imports
MXNet, so the producer's start-up (its own MXNet import, data load, teacher load) overlaps the
trainer's instead of coming after it, inside the first epoch.
"""
import dataclasses
import functools
import json
import logging
import os
import signal
import subprocess
import sys

from pipeline.children import die_with_parent
from pipeline.options import shared_argv

log = logging.getLogger("kdcache.trainer")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TrainError(Exception):
    """A run cannot go on; the message names the cause and the fix."""


def producer_command(args, plan, *, split="train", online=True, threads=1, ring=None, result=None):
    """The producer's public entry point, with the shared options (pipeline.options.SHARED) of this
    run: the child names the same cache and follows the same schedule. The test split's cache is
    one float32 view in key order."""
    if split == "train":
        shared = shared_argv(args, teacher=plan.topt.arg, cache=plan.base if ring is None else None)
    else:
        shared = shared_argv(args, teacher=plan.topt.arg, cache=None, views=1, augment="none", codec="full",
                             dtype="float32")
    cmd = [sys.executable, "-m", "cache_builder", "--quiet", "--split", split, "--threads", str(threads), *shared]
    if result:
        cmd += ["--result", result]
    if online:
        cmd += ["--timeline", os.path.join(args.runs_dir, args.run_name, "producer-timeline.json")]
    if ring is not None:
        cmd += ["--ring", ring]
    elif online:
        cmd += ["--online"]
    return cmd


def producer_result(path):
    """The JSON result a producer wrote with --result, or None when it wrote none (it failed or was stopped)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def start_producer(cmd, log_path):
    # Installed, the packages are found anyway; from a checkout that is not installed, through this.
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
    """The producer's own error line, when it exited with one (given a few seconds to exit: the
    store may notice a producer gone before the kernel has reaped it)."""
    if proc is None:
        return None
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return None
    if proc.returncode == 0:
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


# Data sets that MXNet decodes: loading them imports MXNet, so they wait until threads are fixed.
MXNET_DATASETS = ("recordio", "imagefolder")


def load_train(args):
    """The training split."""
    from pipeline.datasets import load_dataset
    return load_dataset(args.dataset, data_root=args.data_root, split="train", image_size=args.image_size,
                        num_classes=args.num_classes)


@dataclasses.dataclass
class Plan:
    """What this run's options name, computed once per process and handed on: the training split,
    the teacher, the cache spec (its fingerprint hashes the teacher's files) and the cache's path."""
    train: object
    augment: object
    topt: object = None
    spec: object = None
    base: str = None  # the cache's base path (the cache store)

    @property
    def complete(self):
        from store import registry
        return self.base is not None and os.path.exists(registry.final_path(self.base))


def make_plan(args):
    from pipeline.cachespec import resolve_augment, spec_from_args
    from pipeline.checkpoint import TeacherOptions
    from store import path_for, registry
    train = load_train(args)
    if args.teacher_mode == "none":
        return Plan(train, resolve_augment(args.augment, train.name, args.views))
    topt = TeacherOptions.from_args(args)
    spec, augment = spec_from_args(args, train, topt)
    base = registry.base_path(args.cache) if args.cache else path_for(args.cache_dir, spec.fingerprint)
    return Plan(train, augment, topt, spec, base)


@dataclasses.dataclass
class EarlyStart:
    """What python -m trainer set up before importing MXNet, for run() to take over."""
    producer: subprocess.Popen = None
    ring: object = None  # store.ring.RingReader the producer writes into

    def close(self):
        """Idempotent: run() stops and closes the same objects when it gets that far."""
        stop_producer(self.producer)
        if self.ring is not None:
            self.ring.close()


def ring_name(run_name):
    return f"kdcache-ring-{os.getpid()}-{run_name}"[:60]


def create_ring(args, plan):
    from store.ring import RingReader
    return RingReader(ring_name(args.run_name), create=True, capacity=args.ring_capacity,
                      num_classes=plan.spec.num_classes, codec=plan.spec.codec, dtype=plan.spec.dtype,
                      timeout=args.wait_timeout, fingerprint=plan.spec.fingerprint)


def producer_running(base):
    """Whether a live producer holds a shard lock of this cache."""
    from store import registry
    from store.segment import lock_holders
    parts = registry.parts_path(base)
    return registry.exists(base) and os.path.isdir(parts) and bool(lock_holders(parts))


def start_early(args, plan, run_dir, threads, cores):
    """Start the producer a cache or ring run needs, before the trainer imports MXNet, so its
    start-up overlaps the trainer's. Distributed runs start theirs in run(), on worker 0, once the
    kvstore has said which worker this is."""
    early = EarlyStart()
    if args.teacher_mode != "cache" or args.no_producer or (args.kvstore or "").startswith("dist"):
        return early
    pthreads = args.producer_threads or max(1, cores - threads)
    os.makedirs(run_dir, exist_ok=True)
    if args.store == "ring":
        early.ring = create_ring(args, plan)
        early.producer = start_producer(producer_command(args, plan, threads=pthreads, ring=early.ring.name,
                                                         result=os.path.join(run_dir, "producer.json")),
                                        os.path.join(run_dir, "producer.log"))
    elif not plan.complete and not producer_running(plan.base):
        early.producer = start_producer(producer_command(args, plan, threads=pthreads,
                                                         result=os.path.join(run_dir, "producer.json")),
                                        os.path.join(run_dir, "producer.log"))
    return early
