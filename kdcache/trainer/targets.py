"""Where the teacher's targets come from when the trainer starts the producer itself.

No MXNet here: python -m kdcache.trainer starts the producer first thing, before it loads its own data
set or imports MXNet, so the producer's start-up (its MXNet import, data load, teacher load)
overlaps the trainer's instead of coming after it, inside the first epoch. Started before the
trainer knows which cache its options name, the producer is held (`--hold`): it loads
everything, then waits for the trainer's plan to name the cache (or to end it, unused).
"""
import dataclasses
import functools
import json
import logging
import os
import signal
import subprocess
import sys
import time

from kdcache.pipeline.children import before_exec
from kdcache.pipeline.options import shared_argv

log = logging.getLogger("kdcache.trainer")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class TrainError(Exception):
    """A run cannot go on; the message names the cause and the fix."""


def split_threads(args, cores, plan):
    """Trainer threads: all cores when no producer runs beside it (no teacher, inline, a complete
    cache, --no-producer), else the cores the producer leaves. Without a plan (not made yet, or a
    data set MXNet decodes) the cache is taken to be incomplete."""
    if args.threads:
        return args.threads
    if args.teacher_mode != "cache" or args.no_producer or (plan is not None and args.store == "cache"
                                                            and plan.complete):
        return cores
    return max(1, cores - (args.producer_threads or 1))


def producer_command(args, plan, *, split="train", online=True, threads=1, ring=None, result=None, hold=False):
    """The producer's public entry point, with the shared options (pipeline.options.SHARED) of this
    run: the child names the same cache and follows the same schedule. The test split's cache is
    one float32 view in key order. `hold`: a producer started before the plan (plan None), which
    waits for the cache's name on its stdin (EarlyStart.release)."""
    teacher = plan.topt.arg if plan is not None else teacher_arg(args)
    if split == "train":
        shared = shared_argv(args, teacher=teacher, cache=plan.base if ring is None and not hold else None)
    else:
        shared = shared_argv(args, teacher=teacher, cache=None, views=1, codec="full", dtype="float32",
                             augment=plan.augment.eval_view() if plan is not None else "none")
    cmd = [sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--split", split, "--threads", str(threads), *shared]
    if result:
        cmd += ["--result", result]
    if online:
        cmd += ["--timeline", os.path.join(args.runs_dir, args.run_name, "producer-timeline.json")]
    if ring is not None:
        cmd += ["--ring", ring]
    elif online:
        cmd += ["--online"] + (["--hold"] if hold else [])
    return cmd


def teacher_arg(args):
    """The --teacher value that names this run's checkpoint (as Plan.topt.arg gives it)."""
    from kdcache.pipeline.checkpoint import TeacherOptions
    return TeacherOptions.from_args(args).arg


def producer_result(path):
    """The JSON result a producer wrote with --result, or None when it wrote none (it failed or was stopped)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def start_producer(cmd, log_path, stdin=None, held=False):
    # Installed, the packages are found anyway; from a checkout that is not installed, through this.
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    fh = open(log_path, "ab")
    # A held producer may never run (the cache is found complete): it is said to start when released.
    log.log(logging.DEBUG if held else logging.INFO, "%s: %s (log: %s)",
            "loading a producer ahead" if held else "starting producer", " ".join(cmd[1:]), log_path)
    proc = subprocess.Popen(cmd, stdin=stdin, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=os.getcwd(),
                            preexec_fn=functools.partial(before_exec, os.getpid()))
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
    from kdcache.pipeline.datasets import load_dataset
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
        from kdcache.store import registry
        return self.base is not None and os.path.exists(registry.final_path(self.base))


def make_plan(args):
    from kdcache.pipeline.cachespec import resolve_augment, spec_from_args
    from kdcache.pipeline.checkpoint import TeacherOptions
    from kdcache.store import path_for, registry
    train = load_train(args)
    if args.teacher_mode == "none" or getattr(args, "ensemble", None):  # an ensemble opens its caches in run()
        return Plan(train, resolve_augment(args.augment, train.name, args.views))
    topt = TeacherOptions.from_args(args)
    spec, augment = spec_from_args(args, train, topt)
    base = registry.base_path(args.cache) if args.cache else path_for(args.cache_dir, spec.fingerprint)
    return Plan(train, augment, topt, spec, base)


@dataclasses.dataclass
class EarlyStart:
    """The producer python -m kdcache.trainer starts before anything else, for run() to take over."""
    producer: subprocess.Popen = None
    ring: object = None  # store.ring.RingReader the producer writes into
    held: bool = False  # started with --hold: it waits on its stdin for the cache's name
    log_path: str = None

    def settle(self, args, plan):
        """With the plan made: create the ring the producer attaches to, or name the cache to a held
        producer; end it unused when the cache is complete or another producer is filling it."""
        if self.producer is None:
            return self
        if args.store == "ring":
            self.ring = create_ring(args, plan)
        elif plan.complete or producer_running(plan.base):
            self.cancel()
        else:
            self.release(plan)
        return self

    def release(self, plan):
        """Send the held producer on: one JSON line with the cache's path and fingerprint (it checks
        the fingerprint against its own). A producer that already failed is named later, by its log."""
        log.info("starting producer: it fills cache %s (log: %s)", plan.spec.fingerprint, self.log_path)
        try:
            self.producer.stdin.write((json.dumps({"cache": plan.base, "fingerprint": plan.spec.fingerprint})
                                       + "\n").encode())
            self.producer.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        self.held = False

    def cancel(self):
        """End a held producer: it has written nothing, so it can be killed at once."""
        if self.producer.poll() is None:
            self.producer.kill()
        self.producer.wait()
        try:
            self.producer.stdin.close()
        except OSError:
            pass
        self.producer, self.held = None, False

    def close(self):
        """Idempotent: run() stops and closes the same objects when it gets that far."""
        if self.held:
            self.cancel()
        stop_producer(self.producer)
        if self.ring is not None:
            self.ring.close()


def ring_name(run_name):
    return f"kdcache-ring-{os.getpid()}-{run_name}"[:60]


def create_ring(args, plan):
    from kdcache.store.ring import RingReader
    return RingReader(ring_name(args.run_name), create=True, capacity=args.ring_capacity,
                      num_classes=plan.spec.num_classes, codec=plan.spec.codec, dtype=plan.spec.dtype,
                      timeout=args.wait_timeout, fingerprint=plan.spec.fingerprint)


def producer_running(base):
    """Whether a live producer holds a shard lock of this cache."""
    from kdcache.store import registry
    from kdcache.store.segment import lock_holders
    parts = registry.parts_path(base)
    return registry.exists(base) and os.path.isdir(parts) and bool(lock_holders(parts))


def spawn_early(args, run_dir, threads, cores):
    """Start the producer a cache or ring run needs, before the trainer loads its data set or imports
    MXNet, so that the two start-ups overlap; EarlyStart.settle() then tells it what the plan found.
    Into a cache it starts held (nothing is opened before the plan names the cache); into a ring it
    attaches, once it has loaded the data set, to the ring the trainer creates by this name.
    Distributed runs start theirs in run(), on worker 0, once the kvstore has said which worker this
    is; on one core there is no start-up to overlap, and run() starts the producer once the plan
    says one is needed."""
    early = EarlyStart()
    if args.teacher_mode != "cache" or args.no_producer or (args.kvstore or "").startswith("dist") or cores < 2:
        return early
    pthreads = args.producer_threads or max(1, cores - threads)
    os.makedirs(run_dir, exist_ok=True)
    result, log_path = os.path.join(run_dir, "producer.json"), os.path.join(run_dir, "producer.log")
    if args.store == "ring":
        early.producer = start_producer(producer_command(args, None, threads=pthreads, ring=ring_name(args.run_name),
                                                         result=result), log_path)
    else:
        early.producer = start_producer(producer_command(args, None, threads=pthreads, result=result, hold=True),
                                        log_path, stdin=subprocess.PIPE, held=True)
        early.held, early.log_path = True, log_path
    return early


def start_early(args, plan, run_dir, threads, cores):
    """spawn_early() and settle() at once, for a caller that has its plan already."""
    if args.store == "cache" and (plan.complete or producer_running(plan.base)):
        return EarlyStart()
    return spawn_early(args, run_dir, threads, cores).settle(args, plan)


def ring_targets(ring, producer, producer_log, timeout):
    """The targets of a schedule step from the ring. A producer started early attaches once it has
    loaded its data set: the first call waits for that, and names at once a producer that exited
    without attaching (the ring alone would wait out its timeout for one)."""
    from kdcache.store import MissingTargetsError
    waiting = [producer is not None]

    def get(st):
        if waiting[0]:
            waiting[0] = False
            deadline = time.monotonic() + timeout
            while not ring.producer_alive() and producer.poll() is None:
                if time.monotonic() > deadline:
                    raise TrainError(f"the producer did not attach to ring {ring.name} within {timeout:g} s "
                                     f"(see {producer_log})")
                time.sleep(0.01)
            if producer.poll() is not None and not ring.producer_alive():
                try:  # it may have written everything and left: that is read here
                    return ring.get(st.indices, st.epoch, timeout=1.0)
                except MissingTargetsError:
                    failure = producer_failure(producer, producer_log) or "it wrote nothing"
                    raise TrainError(f"the producer exited before it attached to ring {ring.name}: {failure} "
                                     f"(see {producer_log})") from None
        return ring.get(st.indices, st.epoch)
    return get
