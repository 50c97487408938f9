"""The training loop, read top to bottom: options -> data -> targets -> student -> epochs -> report."""
import dataclasses
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from tqdm import tqdm

from pipeline.augment import make_views
from pipeline.cachespec import TeacherOptions, build_spec, resolve_augment, spec_from_args
from pipeline.datasets import load_dataset
from pipeline.schedule import schedule, steps_per_epoch
from store import CacheReader, ProducerGoneError, path_for, registry
from store.registry import final_path
from trainer.loss import KDLoss
from trainer.models import get_model
from trainer.targets import (TrainError, load_train, producer_command, producer_failure,
                             run_name_error, start_producer, stop_producer, teacher_arg)

log = logging.getLogger("kdcache.trainer")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- small helpers ---------------------------------------------------------------------------
def resolve_ctx(arg):
    if arg == "auto":
        return [mx.gpu(0)] if mx.context.num_gpus() > 0 else [mx.cpu()]
    if arg == "cpu":
        return [mx.cpu()]
    if arg.startswith("cpu:"):  # several CPU contexts: the multi-device path (split batches, device kvstore)
        try:
            ids = [int(i) for i in arg.split(":", 1)[1].split(",")]
        except ValueError:
            raise TrainError(f"--ctx {arg!r}: use cpu:0,1 (device ids separated by commas)") from None
        if len(set(ids)) != len(ids) or min(ids) < 0:
            raise TrainError(f"--ctx {arg!r}: device ids must be distinct and not negative")
        return [mx.cpu(i) for i in ids]
    if arg.startswith("gpu"):
        ids = arg.split(":", 1)[1] if ":" in arg else "0"
        n = mx.context.num_gpus()
        ctx = [mx.gpu(int(i)) for i in ids.split(",")]
        if any(c.device_id >= n for c in ctx):
            raise TrainError(f"--ctx {arg}: MXNet sees {n} GPU(s); install a CUDA build of MXNet "
                             f"(pip install mxnet-cu112==1.9.1 numpy==1.23.5) or use --ctx cpu")
        return ctx
    raise TrainError(f"--ctx {arg!r}: use auto, cpu, cpu:0,1 or gpu:0[,1,...]")


class Interrupts:
    """Ctrl-C (SIGINT) during the epochs, raised where it is safe.

    Python raises KeyboardInterrupt wherever the main thread happens to be: inside an MXNet
    destructor it is swallowed ("Exception ignored in ... NDArrayBase.__del__") and training goes
    on; between a lock's acquire and its release (a queue's, in the batch wait) it can leave the
    lock held, and a trainer was once seen hanging after a Ctrl-C. While installed, the first
    SIGINT is recorded and raised by check(), at the next step or while the loop waits for a
    batch; a second one is raised at once."""

    def __init__(self):
        self.requested = False
        self._old = None

    def install(self):
        # only over Python's own handler: not when the trainer was started with SIGINT ignored
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self):
        if self.requested:
            raise KeyboardInterrupt

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None


# --- targets ---------------------------------------------------------------------------------
class Prefetcher:
    """Builds batches (student inputs, labels, teacher targets) ahead of the loop in a thread, so
    cache gathers and input preparation overlap the student's compute (MXNet releases the GIL)."""

    def __init__(self, steps, dataset, *, seed, augment, targets, depth=3, poll=lambda: None):
        self.q = queue.Queue(maxsize=depth)
        self._poll = poll  # called every 0.1 s while the loop waits for a batch
        self._stop = threading.Event()
        self.error = None
        self.stall_s = 0.0
        self._t = threading.Thread(target=self._run, args=(steps, dataset, seed, augment, targets), daemon=True)
        self._t.start()

    def _run(self, steps, dataset, seed, augment, targets):
        try:
            for st in steps:
                x, y = make_views(dataset, st.indices, st.view, seed=seed, augment=augment)
                t = targets(st) if targets is not None else None
                while not self._stop.is_set():
                    try:
                        self.q.put((st, x, y, t), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # handed to the loop, which raises it
            self.error = e
        finally:
            self.q.put(None)

    def __iter__(self):
        while True:
            t0 = time.perf_counter()
            while True:
                try:
                    item = self.q.get(timeout=0.1)
                    break
                except queue.Empty:
                    self._poll()
            self.stall_s += time.perf_counter() - t0
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def close(self):
        self._stop.set()
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            pass


def global_batch_size(n, batch_size, step):
    """Samples in schedule batch `step` (the last batch of an epoch may be smaller)."""
    return min(batch_size, n - step * batch_size)


def evaluate(net, dataset, ctx, batch_size=256):
    correct = 0
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        correct += int((net(mx.nd.array(x, ctx=ctx[0])).asnumpy().argmax(axis=1) == y).sum())
    return correct / len(dataset)


def save_checkpoint(run_dir, net, trainer, epoch, state):
    """Export the student and the optimiser state; state.json, written last and atomically,
    says which epoch is complete, so an interrupted save is never resumed from."""
    tmp = os.path.join(run_dir, f".tmp-{os.getpid()}")
    net.export(tmp + "-student", epoch=epoch)
    os.replace(f"{tmp}-student-{epoch:04d}.params", os.path.join(run_dir, f"student-{epoch:04d}.params"))
    os.replace(f"{tmp}-student-symbol.json", os.path.join(run_dir, "student-symbol.json"))
    if state.get("kvstore") != "dist_async":  # dist_async keeps the optimiser state on the server
        trainer.save_states(tmp + ".states")
        os.replace(tmp + ".states", os.path.join(run_dir, "trainer.states"))
    with open(tmp + ".json", "w") as fh:
        json.dump({**state, "epoch": epoch}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp + ".json", os.path.join(run_dir, "state.json"))


def load_checkpoint(run_dir, net, trainer):
    path = os.path.join(run_dir, "state.json")
    if not os.path.exists(path):
        raise TrainError(f"--resume: {run_dir} has no checkpoint (state.json): run without --resume")
    with open(path) as fh:
        state = json.load(fh)
    e = state["epoch"]
    saved = mx.nd.load(os.path.join(run_dir, f"student-{e:04d}.params"))
    params = net.collect_params()
    for k, v in saved.items():
        name = k.split(":", 1)[1] if ":" in k else k
        params[name].set_data(v)
    states = os.path.join(run_dir, "trainer.states")
    if os.path.exists(states):
        trainer.load_states(states)
    else:
        log.warning("no optimiser state in %s (distributed run): the optimiser restarts from its defaults", run_dir)
    return state


def broadcast_initial_parameters(trainer, net):
    """Give every worker worker 0's parameters, and wait until they have arrived.

    MXNet 1.9's gluon.Trainer broadcasts the initial parameters inside the first step(): an
    asynchronous pull from the server that the engine may send after the same step's gradient
    push. The server then answers it with the summed gradients, which overwrite that worker's
    weights (seen on loopback in about 1 run of 5: one layer of worker 1 far from worker 0's for
    the rest of the run). Doing the broadcast before training and waiting for it closes the race.
    """
    trainer._init_kvstore()
    trainer._init_params()
    for p in net.collect_params().values():
        for d in p.list_data():
            d.wait_to_read()


def teacher_accuracy(base, spec, test):
    """The teacher's test accuracy from its cache of the test split; None (logged) if unavailable:
    it is a report, not the job."""
    try:
        with CacheReader(base, spec=spec) as r:
            return float((r.get(np.arange(len(test)), wait=False).argmax(1) == test.labels).mean())
    except Exception as e:
        log.warning("teacher test accuracy unavailable: %s", e)
        return None


# --- the run ---------------------------------------------------------------------------------
def run(args, threads, cores):
    t_start = time.perf_counter()
    ctx = resolve_ctx(args.ctx)
    # Distributed: every worker reads the shared schedule and trains on its part of each batch
    # (indices[rank::workers]); dist_sync sums the gradients, so the update is the global batch's.
    kv, rank, workers = None, 0, 1
    if args.kvstore:
        try:
            kv = mx.kv.create(args.kvstore)
        except Exception as e:
            raise TrainError(f"--kvstore {args.kvstore}: {str(e).strip().splitlines()[-1][:200]}; for dist_* start "
                             f"the workers with `python -m trainer.launch` (or set the DMLC_* variables)") from None
        rank, workers = kv.rank, kv.num_workers
    run_name = args.run or time.strftime("%Y%m%d-%H%M%S")
    if run_name_error(run_name):
        raise TrainError(run_name_error(run_name))
    run_dir = os.path.join(args.runs_dir, run_name)
    args.run_name = run_name
    if workers > 1:
        run_dir = os.path.join(run_dir, f"worker-{rank}")
    if os.path.exists(os.path.join(run_dir, "state.json")) and not args.resume:
        raise TrainError(f"run {run_dir} exists: pass --resume to continue it or another --run name")
    os.makedirs(run_dir, exist_ok=True)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)

    # data (python -m trainer may have loaded the training split already, to start the producer)
    early = getattr(args, "early", None)
    train = early.train if early is not None else load_train(args)
    test = load_dataset(args.dataset, data_root=args.data_root, split="test", image_size=args.image_size,
                        num_classes=args.num_classes)
    augment = resolve_augment(args.augment, train.name, args.views)
    n, classes = len(train), train.num_classes
    log.info("data set %s: %d train / %d test samples, %d classes, %d view(s), augment %s; ctx %s, %d thread(s) "
             "of %d core(s)", train.name, n, len(test), classes, args.views, augment.spec, ctx, threads, cores)

    # targets
    producer = test_producer = reader = ring = teacher = None
    spec = None
    cache_path = None
    teacher_acc = None
    targets = None
    mode = args.teacher_mode
    if mode != "none":
        topt = TeacherOptions.from_args(args, teacher_arg(args))
        spec, _ = spec_from_args(args, train, topt)
        tid = spec.inputs["teacher"]
    if mode == "inline":
        teacher = topt.load(args.batch_size)
        correct = 0
        for a in range(0, len(test), args.batch_size):  # in training-size batches: bounded memory
            x, y = test.get_batch(np.arange(a, min(len(test), a + args.batch_size)))
            correct += int((teacher.forward(x).argmax(1) == y).sum())
        teacher_acc = correct / len(test)
        teacher.forwards = 0
    elif mode == "cache":
        ptheads = args.producer_threads or max(1, cores - threads)
        if args.store == "ring" and early is not None and early.ring is not None:
            ring, producer = early.ring, early.producer
            targets = lambda st: ring.get(st.indices, st.epoch)
        elif args.store == "ring":
            from store.ring import RingReader
            ring = RingReader(f"kdcache-ring-{os.getpid()}-{run_name}"[:60], create=True, capacity=args.ring_capacity,
                              num_classes=spec.num_classes, codec=spec.codec, dtype=spec.dtype,
                              timeout=args.wait_timeout, fingerprint=spec.fingerprint)
            producer = start_producer(producer_command(args, topt, None, threads=ptheads, ring=ring.name),
                                      os.path.join(run_dir, "producer.log"))
            targets = lambda st: ring.get(st.indices, st.epoch)
            cache_path = None
        else:
            base = registry.base_path(args.cache) if args.cache != "auto" else path_for(args.cache_dir, spec.fingerprint)
            cache_path = final_path(base)
            have = registry.exists(base)
            complete = os.path.exists(cache_path)
            if early is not None and early.producer is not None:
                producer = early.producer  # started before MXNet loaded here
            elif not complete and not args.no_producer and rank == 0:
                alive = have and os.path.isdir(registry.parts_path(base)) and \
                    bool(__import__("store.segment", fromlist=["x"]).lock_holders(registry.parts_path(base)))
                if alive:
                    log.info("a producer is already filling cache %s: reading behind it", spec.fingerprint)
                else:
                    producer = start_producer(producer_command(args, topt, base, threads=ptheads),
                                              os.path.join(run_dir, "producer.log"))
            elif complete:
                log.info("cache %s is complete: the teacher costs nothing in this run", spec.fingerprint)
            deadline = time.monotonic() + 120
            while True:  # the producer needs a few seconds to start and create the cache
                try:
                    reader = CacheReader(base, spec=spec, timeout=args.wait_timeout,
                                         grace_s=30.0 if producer or rank > 0 else 0.0,
                                         starting=(lambda: producer.poll() is None) if producer else None)
                    break
                except Exception as e:
                    from store import CacheNotFoundError
                    if not isinstance(e, CacheNotFoundError) or (producer is None and rank == 0):
                        raise
                    failure = producer_failure(producer, os.path.join(run_dir, "producer.log"))
                    if failure or time.monotonic() > deadline:
                        raise TrainError(f"the producer did not start: {failure or 'no cache after 120 s'} "
                                         f"(see {run_dir}/producer.log)") from None
                    time.sleep(0.2)
            targets = lambda st: reader.get(st.indices, st.view)
        # the teacher's own test accuracy, from a (small, reusable) cache of the test split
        tspec = build_spec(tid, test, codec="full", dtype="float32")
        tbase = path_for(args.cache_dir, tspec.fingerprint)
        # Built after training when missing: during it, a third MXNet process would take the
        # trainer's or the producer's core.
        test_cache_missing = not os.path.exists(final_path(tbase))
        if rank == 0 and not test_cache_missing:
            teacher_acc = teacher_accuracy(tbase, tspec, test)

    # student
    net = get_model(args.student, classes, prefix="student_")
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize(static_alloc=True)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": args.lr, "wd": args.wd},
                            **({"kvstore": kv} if kv is not None else {}),
                            # dist_sync: workers all-reduce gradients and update alike, so the last, smaller
                            # batch of an epoch is normalised right and the optimiser state can be saved
                            **({"update_on_kvstore": False} if args.kvstore == "dist_sync" else {}))
    net(mx.nd.array(train.get_batch([0])[0], ctx=ctx[0]))  # shapes known before a resume loads parameters
    start_epoch, history = 0, []
    if args.resume:
        state = load_checkpoint(run_dir, net, trainer)
        start_epoch, history = state["epoch"] + 1, state.get("history", [])
        log.info("resuming %s after epoch %d", run_dir, state["epoch"])
    if kv is not None and "dist" in kv.type:
        broadcast_initial_parameters(trainer, net)
    loss_fn = KDLoss(args.temperature, args.alpha if mode != "none" else 0.0)

    # epochs
    spe = steps_per_epoch(n, args.batch_size)
    stall_total = 0.0
    seen = 0
    train_s = 0.0
    metrics = {}
    pf = None
    timeline = []  # (unix time, schedule position, seconds this step waited): runs/<run>/timeline.json
    interrupts = Interrupts().install()
    try:
        for epoch in range(start_epoch, args.epochs):
            steps = schedule(args.seed, epoch + 1, n, args.batch_size, args.views, start_epoch=epoch)
            if workers > 1:
                steps = (dataclasses.replace(st, indices=st.indices[rank::workers]) for st in steps)
            pf = Prefetcher(steps, train, seed=args.seed, augment=augment,
                            targets=targets if mode == "cache" else None, poll=interrupts.check)
            bar = tqdm(total=spe, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step", disable=args.quiet,
                       dynamic_ncols=True, leave=not args.quiet)
            t0 = time.perf_counter()
            tot_loss, last_report, stall_before, epoch_seen = 0.0, 0.0, 0.0, 0
            try:
                for st, x, y, t in pf:
                    interrupts.check()
                    if mode == "inline":
                        t = teacher.forward(x)
                    xs = gluon.utils.split_and_load(x, ctx, even_split=False)
                    ys = gluon.utils.split_and_load(y.astype(np.float32), ctx, even_split=False)
                    ts = gluon.utils.split_and_load(t, ctx, even_split=False) if t is not None else \
                        [mx.nd.zeros((len(a), classes), ctx=a.context) for a in ys]
                    with autograd.record():
                        losses = [loss_fn(net(a), b, c) for a, c, b in zip(xs, ys, ts)]
                    autograd.backward(losses)
                    # the global batch: dist_sync sums the workers' gradients
                    if workers == 1:
                        trainer.step(x.shape[0])
                    elif args.kvstore == "dist_sync":
                        trainer.step(global_batch_size(n, args.batch_size, st.step))
                    else:  # dist_async updates on the server with one fixed normalisation
                        trainer.step(args.batch_size)
                    tot_loss += sum(float(l.sum().asscalar()) for l in losses)
                    seen += x.shape[0]
                    epoch_seen += x.shape[0]
                    timeline.append((round(time.time(), 4), int(st.position), round(pf.stall_s - stall_before, 5)))
                    stall_before = pf.stall_s
                    bar.update(1)
                    now = time.perf_counter()
                    if now - last_report > 0.5:
                        last_report = now
                        if reader is not None:
                            registry.write_position(reader.base, st.position, epoch=epoch, step=st.step, run=run_name)
                        bar.set_postfix(loss=f"{tot_loss / max(1, epoch_seen):.4f}",
                                        stall=f"{pf.stall_s:.1f}s", refresh=False)
            except ProducerGoneError as e:
                failure = producer_failure(producer, os.path.join(run_dir, "producer.log"))
                raise TrainError(f"{e}" + (f"; the producer failed: {failure}" if failure else "")) from None
            finally:
                pf.close()
                bar.close()
            dt = time.perf_counter() - t0
            train_s += dt
            stall_total += pf.stall_s
            acc = evaluate(net, test, ctx)
            loss = tot_loss / max(1, epoch_seen)
            history.append({"epoch": epoch, "seconds": round(dt, 3), "loss": loss, "test_acc": acc,
                            "stall_s": round(pf.stall_s, 3), "samples_per_s": round(epoch_seen / dt, 1)})
            log.info("epoch %d/%d: loss %.4f, test accuracy %.4f, %.0f samples/s, stall %.2f s%s", epoch + 1,
                     args.epochs, loss, acc, epoch_seen / dt, pf.stall_s,
                     f" (worker {rank} of {workers})" if workers > 1 else "")
            options = {k: v for k, v in vars(args).items() if k != "early"}
            save_checkpoint(run_dir, net, trainer, epoch, {"history": history, "args": options,
                                                           "rank": rank, "workers": workers, "kvstore": args.kvstore})
            interrupts.check()
    finally:
        interrupts.restore()
        stop_producer(producer)
        if ring is not None:
            ring.close()

    if mode == "cache" and rank == 0 and test_cache_missing:
        test_producer = start_producer(producer_command(args, topt, tbase, split="test", online=False, threads=cores),
                                       os.path.join(run_dir, "producer-test.log"))
        try:
            test_producer.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stop_producer(test_producer)
        teacher_acc = teacher_accuracy(tbase, tspec, test)
    final_acc = history[-1]["test_acc"] if history else None
    forwards = teacher.forwards if teacher is not None else 0
    if producer is not None:
        try:
            out = [ln for ln in open(os.path.join(run_dir, "producer.log")).read().splitlines() if ln.startswith("{")]
            forwards = json.loads(out[-1])["teacher_forwards"] if out else forwards
        except (OSError, ValueError, KeyError):
            pass
    if reader is not None:
        reader.close()
    metrics = {
        "run": run_name, "dataset": args.dataset, "student": args.student, "teacher_mode": mode,
        "store": args.store if mode == "cache" else None, "temperature": args.temperature,
        "alpha": args.alpha if mode != "none" else 0.0, "epochs": args.epochs, "seed": args.seed,
        "test_acc": final_acc, "teacher_test_acc": teacher_acc,
        "samples_per_s": round(seen / train_s, 1) if train_s else None,
        "teacher_forwards": int(forwards), "stall_s": round(stall_total, 3),
        "target_wait_s": round(reader.stall_s if reader else (ring.stall_s if ring else 0.0), 3),
        "cache_path": cache_path, "fingerprint": spec.fingerprint if spec else None,
        "producer_started": producer is not None, "threads": threads, "ctx": str(ctx),
        "kvstore": args.kvstore, "rank": rank, "workers": workers,
        "epoch1_s": history[0]["seconds"] if history and start_epoch == 0 else None,
        "wall_s": round(time.perf_counter() - t_start, 3), "history": history,
        "checkpoint": os.path.join(run_dir, "student-symbol.json"),
    }
    with open(os.path.join(run_dir, "timeline.json"), "w") as fh:
        json.dump({"columns": ["time", "position", "wait_s"], "steps": timeline}, fh)
    with open(os.path.join(run_dir, "metrics.json.tmp"), "w") as fh:
        json.dump(metrics, fh, indent=1)
    os.replace(os.path.join(run_dir, "metrics.json.tmp"), os.path.join(run_dir, "metrics.json"))
    return metrics, run_dir
