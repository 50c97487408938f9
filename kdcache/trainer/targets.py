"""The teacher's side of a training run, in one object: `Targets`.

It starts the producer early, settles it once the plan names the cache, serves each step's
targets (from a cache, a shared-memory ring, an ensemble of caches or an inline teacher), counts
the teacher's forwards, builds the test split's cache for the teacher's own accuracy, and closes
all of it. train.run() only asks it for things, in the order of the run.

No MXNet at import: python -m kdcache.trainer starts the producer first thing, before it loads its
own data set or imports MXNet, so the producer's start-up (its MXNet import, data load, teacher
load) overlaps the trainer's instead of coming after it, inside the first epoch. Started before
the trainer knows which cache its options name, the producer is held (`--hold`): it loads
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

from kdcache import signals
from kdcache.pipeline.child_setup import before_exec
from kdcache.pipeline.options import shared_argv
from kdcache.trainer.errors import TrainError

log = logging.getLogger("kdcache.trainer")
# The folder that holds the kdcache package: a checkout that is not installed finds it through this.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def split_threads(args, cores, plan):
    """Trainer threads: all cores when no producer runs beside it (no teacher, inline, a complete
    cache, an ensemble, --no-producer), else the cores the producer leaves. Without a plan (not made
    yet, or a data set MXNet decodes) the cache is taken to be incomplete."""
    if args.threads:
        return args.threads
    if args.teacher_mode != "cache" or args.no_producer or getattr(args, "ensemble", None) or \
            (plan is not None and args.store == "cache" and plan.complete):
        return cores
    return max(1, cores - (args.producer_threads or 1))


# --- the producer's process ------------------------------------------------------------------
def producer_command(args, plan, *, split="train", online=True, threads=1, ring=None, result=None, hold=False):
    """The producer's public entry point, with the shared options (pipeline.options.SHARED) of this
    run: the child names the same cache and follows the same schedule. The test split's cache is
    one float32 view in key order. `hold`: a producer started before the plan (plan None), which
    waits for the cache's name on its stdin (Targets.release)."""
    teacher = plan.topt.arg if plan is not None else teacher_arg(args)
    if split == "train":
        shared = shared_argv(args, teacher=teacher, cache=plan.base if ring is None and not hold else None)
    else:
        shared = shared_argv(args, teacher=teacher, cache=None, views=1, codec="full", dtype="float32",
                             augment=plan.augment.eval_view() if plan is not None else "none")
    cmd = [sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--split", split, "--threads", str(threads),
           *shared]
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
    from kdcache.pipeline.teacher_files import TeacherOptions
    return TeacherOptions.from_args(args).arg


def producer_result(path):
    """The JSON result a producer wrote with --result, or None when it wrote none (it failed or was stopped)."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def start_producer(cmd, log_path, stdin=None, held=False):
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


def producer_running(base):
    """Whether a live producer holds a shard lock of this cache."""
    from kdcache.store.folder import registry
    from kdcache.store.files.segment import lock_holders
    parts = registry.parts_path(base)
    return registry.exists(base) and os.path.isdir(parts) and bool(lock_holders(parts))


# --- where the targets are read --------------------------------------------------------------
def ring_name(run_name):
    return f"kdcache-ring-{os.getpid()}-{run_name}"[:60]


def create_ring(args, plan):
    from kdcache.store.ring import RingReader
    return RingReader(ring_name(args.run_name), create=True, capacity=args.ring_capacity,
                      num_classes=plan.spec.num_classes, codec=plan.spec.codec, dtype=plan.spec.dtype,
                      timeout=args.wait_timeout, fingerprint=plan.spec.fingerprint)


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


def open_reader(args, plan, producer, rank, producer_log):
    """The cache's reader; a producer just started needs a few seconds to create the cache."""
    from kdcache.store import CacheNotFoundError, CacheReader
    deadline = time.monotonic() + 120
    while True:
        try:
            return CacheReader(plan.base, spec=plan.spec, timeout=args.wait_timeout,
                               grace_s=30.0 if producer or rank > 0 else 0.0,
                               starting=(lambda: producer.poll() is None) if producer else None)
        except CacheNotFoundError:
            if producer is None and rank == 0:
                raise
            # Asked only once it has exited: producer_failure() gives a live producer seconds to exit.
            failure = producer_failure(producer, producer_log) if producer and producer.poll() is not None else None
            if failure:
                raise TrainError(f"the cache is not there and no producer is running: the producer failed: "
                                 f"{failure} (see {producer_log})") from None
            if time.monotonic() > deadline:
                raise TrainError(f"the producer made no cache within 120 s (see {producer_log})") from None
            signals.sleep(0.05)


def open_ensemble(args, train, augment):
    """The --ensemble reader, its members checked against this run's data set, views, seed and augmentation."""
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.store.derive.ensemble import EnsembleReader
    reader = EnsembleReader(args.ensemble, rule=args.ensemble_rule, timeout=args.wait_timeout)
    want = build_spec(None, train, views=args.views, augment=augment, seed=args.seed)
    for what, mine, theirs in (("sample count", want.num_samples, reader.spec.num_samples),
                               ("class count", want.num_classes, reader.spec.num_classes),
                               ("views", want.views, reader.spec.views),
                               *((f"{k.replace('_', ' ')}", want.inputs[k], reader.spec.inputs.get(k))
                                 for k in ("dataset", "augment", "augment_seed"))):
        if mine != theirs:
            reader.close()
            raise TrainError(f"--ensemble: its caches ({reader.members[0].cache}, ...) hold another {what} than this "
                             f"run's ({str(theirs)[:80]} vs {str(mine)[:80]}): pass the --dataset, --views, --augment "
                             f"and --seed they were built with")
    log.info("ensemble of %d caches (%s, rule %s): the teacher costs nothing in this run", len(reader.members),
             ", ".join(r.fingerprint for r in reader.readers), reader.rule)
    from kdcache.trainer.options import sampled_warning
    for r, m in zip(reader.readers, reader.members):
        note = sampled_warning(r.codec.spec, args.temperature, member=(r.base, m.temperature))
        if note:
            log.warning(note)
    return reader


def teacher_accuracy(base, spec, test):
    """The teacher's test accuracy from its cache of the test split; None (logged) if unavailable:
    it is a report, not the job."""
    import numpy as np
    from kdcache.store import CacheReader
    try:
        with CacheReader(base, spec=spec) as r:
            return float((r.get(np.arange(len(test)), wait=False).argmax(1) == test.labels).mean())
    except Exception as e:
        log.warning("teacher test accuracy unavailable: %s", e)
        return None


# --- the one object --------------------------------------------------------------------------
@dataclasses.dataclass
class Targets:
    """The teacher's side of one run. Targets.start() before the plan; settle() with it; open()
    once the data and the student are ready; get(st) per step; stop() after the last epoch;
    test_accuracy() and report() for the summary; close() always (idempotent)."""
    producer: subprocess.Popen = None
    ring: object = None  # store.ring.RingReader the producer writes into
    held: bool = False  # started with --hold: it waits on its stdin for the cache's name
    log_path: str = None
    reader: object = dataclasses.field(default=None, compare=False)  # CacheReader or EnsembleReader
    teacher: object = dataclasses.field(default=None, compare=False)  # inline: the teacher runner
    get: object = dataclasses.field(default=None, compare=False)  # step -> targets, None without a cache
    cache_path: str = dataclasses.field(default=None, compare=False)
    result_file: str = dataclasses.field(default=None, compare=False)
    teacher_acc: float = dataclasses.field(default=None, compare=False)
    _test: tuple = dataclasses.field(default=None, compare=False)  # (spec, base) of the test split's cache, to build

    # -- before the plan --
    @classmethod
    def start(cls, args, run_dir, threads, cores):
        """Start the producer a cache or ring run needs, before the trainer loads its data set or
        imports MXNet, so that the two start-ups overlap; settle() then tells it what the plan found.
        Into a cache it starts held (nothing is opened before the plan names the cache); into a ring
        it attaches, once it has loaded the data set, to the ring the trainer creates by this name.
        Distributed runs start theirs in open(), on worker 0, once the kvstore has said which worker
        this is; on one core there is no start-up to overlap, and open() starts the producer once
        the plan says one is needed."""
        t = cls()
        if args.teacher_mode != "cache" or args.no_producer or getattr(args, "ensemble", None) or \
                (args.kvstore or "").startswith("dist") or cores < 2:
            return t
        pthreads = args.producer_threads or max(1, cores - threads)
        os.makedirs(run_dir, exist_ok=True)
        result, log_path = os.path.join(run_dir, "producer.json"), os.path.join(run_dir, "producer.log")
        if args.store == "ring":
            t.producer = start_producer(producer_command(args, None, threads=pthreads, ring=ring_name(args.run_name),
                                                         result=result), log_path)
        else:
            t.producer = start_producer(producer_command(args, None, threads=pthreads, result=result, hold=True),
                                        log_path, stdin=subprocess.PIPE, held=True)
            t.held = True
        t.log_path = log_path
        return t

    @classmethod
    def start_settled(cls, args, plan, run_dir, threads, cores):
        """start() and settle() at once, for a caller that has its plan already."""
        if args.store == "cache" and (plan.complete or producer_running(plan.base)):
            return cls()
        return cls.start(args, run_dir, threads, cores).settle(args, plan)

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

    # -- the run --
    def open(self, args, plan, *, run_dir, rank, threads, cores, test):
        """Where this run's targets come from, ready to serve: the inline teacher loaded (and its test
        accuracy measured), the ensemble's caches opened, the ring created and its producer started,
        or the cache opened behind a producer started when none fills it. `test` (the test split at
        the evaluation view) gives the teacher's accuracy from a small cache of its own, when that
        cache exists; test_accuracy() builds it after training otherwise."""
        import numpy as np
        mode = args.teacher_mode
        self.result_file = os.path.join(run_dir, "producer.json")
        self.log_path = os.path.join(run_dir, "producer.log")
        train, augment, spec = plan.train, plan.augment, plan.spec
        if mode == "inline":
            from kdcache.pipeline.teacher import check_fits, load_teacher
            self.teacher = load_teacher(plan.topt, args.batch_size)
            check_fits(self.teacher, train, augment, args.seed)
            correct = 0
            for a in range(0, len(test), args.batch_size):  # in training-size batches: bounded memory
                x, y = test.get_batch(np.arange(a, min(len(test), a + args.batch_size)))
                correct += int((self.teacher.forward(x).argmax(1) == y).sum())
            self.teacher_acc = correct / len(test)
            self.teacher.forwards = 0
            return self
        if mode != "cache":
            return self
        if args.ensemble:
            self.reader = open_ensemble(args, train, augment)
            self.get = lambda st: self.reader.get(st.indices, st.view)
            return self
        pthreads = args.producer_threads or max(1, cores - threads)
        if args.store == "ring":
            if self.ring is None:
                self.ring = create_ring(args, plan)
                self.producer = start_producer(producer_command(args, plan, threads=pthreads, ring=self.ring.name,
                                                                result=self.result_file), self.log_path)
            self.get = ring_targets(self.ring, self.producer, self.log_path, args.wait_timeout)
        else:
            from kdcache.store.folder.registry import final_path
            self.cache_path = final_path(plan.base)
            if self.producer is None and not plan.complete and not args.no_producer and rank == 0:
                if producer_running(plan.base):
                    log.info("a producer is already filling cache %s: reading behind it", spec.fingerprint)
                else:
                    self.producer = start_producer(producer_command(args, plan, threads=pthreads,
                                                                    result=self.result_file), self.log_path)
            elif plan.complete:
                log.info("cache %s is complete: the teacher costs nothing in this run", spec.fingerprint)
            self.reader = open_reader(args, plan, self.producer, rank, self.log_path)
            self.get = lambda st: self.reader.get(st.indices, st.view)
        # the teacher's own test accuracy, from a (small, reusable) cache of the test split
        from kdcache.pipeline.cachespec import build_spec
        from kdcache.store import path_for
        from kdcache.store.folder.registry import final_path
        tspec = build_spec(spec.inputs["teacher"], test, augment=augment.eval_view(), codec="full", dtype="float32")
        tbase = path_for(args.cache_dir, tspec.fingerprint)
        if rank == 0 and os.path.exists(final_path(tbase)):
            self.teacher_acc = teacher_accuracy(tbase, tspec, test)
        elif rank == 0:
            # Built after training: during it, a third MXNet process would take the trainer's or the
            # producer's core.
            self._test = (tspec, tbase)
        return self

    def forward(self, x):
        """The inline teacher's logits for a batch of images (counted as training forwards)."""
        return self.teacher.forward(x)

    def teacher_logits(self, train, idx, view, *, seed, augment):
        """The teacher's logits of items `idx` at `view`, for the agreement column; None where they
        are not at hand (hard labels, a ring, rows a producer has not written yet)."""
        if self.teacher is not None:
            from kdcache.pipeline.augment import make_views
            forwards = self.teacher.forwards  # the count reports training's forwards only
            out = self.teacher.forward(make_views(train, idx, view, seed=seed, augment=augment)[0])
            self.teacher.forwards = forwards
            return out
        if self.reader is None:
            return None
        try:
            return self.reader.get(idx, view, wait=False)
        except Exception:  # not written yet (a producer behind): the column stays empty
            return None

    def report_position(self, st, *, epoch, run):
        """Tell the cache's producers how far training has read (they keep ahead of it)."""
        if self.reader is not None and getattr(self.reader, "base", None):
            from kdcache.store.folder import registry
            registry.write_position(self.reader.base, st.position, epoch=epoch, step=st.step, run=run)

    def gone(self, error):
        """The store found the producer gone: one TrainError naming the producer's own failure."""
        failure = producer_failure(self.producer, self.log_path)
        return TrainError(f"{error}" + (f"; the producer failed: {failure}" if failure else ""))

    def stop(self):
        """After the last epoch (or a stop): the producer stopped cleanly, the ring closed."""
        stop_producer(self.producer)
        if self.ring is not None:
            self.ring.close()

    def test_accuracy(self, args, plan, *, run_dir, cores, test):
        """The teacher's test accuracy, building the test split's cache first when it is missing."""
        if self._test is not None:
            tspec, tbase = self._test
            test_producer = start_producer(producer_command(args, plan, split="test", online=False, threads=cores),
                                           os.path.join(run_dir, "producer-test.log"))
            try:
                with signals.interruptible():
                    test_producer.wait(timeout=300)
            except subprocess.TimeoutExpired:
                stop_producer(test_producer)
            self.teacher_acc = teacher_accuracy(tbase, tspec, test)
            self._test = None
        return self.teacher_acc

    def report(self, args, plan):
        """The metrics of the teacher's side: forwards (the producer's own count when one ran), waits,
        the cache or the ensemble read."""
        forwards = self.teacher.forwards if self.teacher is not None else 0
        if self.producer is not None:
            forwards = (producer_result(self.result_file) or {}).get("teacher_forwards", forwards)
        waited = self.reader if self.reader is not None else self.ring
        return {"teacher_forwards": int(forwards), "teacher_test_acc": self.teacher_acc,
                "target_wait_s": round(waited.stall_s if waited is not None else 0.0, 3),
                "cache_path": self.cache_path, "fingerprint": plan.spec.fingerprint if plan.spec else None,
                "ensemble": dict(self.reader.identity(), fingerprint=self.reader.fingerprint)
                if getattr(args, "ensemble", None) and self.reader is not None else None,
                "producer_started": self.producer is not None}

    def close(self):
        """Idempotent: every process it started is stopped, every reader closed."""
        if self.held:
            self.cancel()
        self.stop()
        if self.reader is not None:
            self.reader.close()
            self.reader = None
