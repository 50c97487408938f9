"""The training loop, read top to bottom: options -> data -> targets -> student -> epochs -> report."""
import dataclasses
import json
import logging
import os
import signal
import subprocess
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from tqdm import tqdm

from kdcache.pipeline.augment import eval_views, make_views
from kdcache.pipeline.cachespec import build_spec
from kdcache.pipeline.datasets import load_dataset
from kdcache import signals
from kdcache.pipeline.interrupts import Interrupts
from kdcache.pipeline.schedule import EpochDigests, epoch_batches, schedule, steps_per_epoch, view_of_epoch
from kdcache.pipeline.teacher import check_fits, load_teacher
from kdcache.store import CacheNotFoundError, CacheReader, ProducerGoneError, path_for, registry
from kdcache.store.registry import final_path
from kdcache.trainer.checkpoint import load_checkpoint, save_checkpoint
from kdcache.trainer.loss import KDLoss, check_finite
from kdcache.trainer.models import check_student, get_model, model_identity
from kdcache.trainer.options import recorded
from kdcache.trainer.prefetch import Prefetcher
from kdcache.trainer.recipe import EpochLog, Subset, schedule_of, val_indices
from kdcache.trainer.targets import (TrainError, create_ring, producer_command, producer_failure, producer_result,
                             producer_running, ring_targets, start_producer, stop_producer)

log = logging.getLogger("kdcache.trainer")


# --- small helpers ---------------------------------------------------------------------------
def resolve_ctx(arg):
    """MXNet's contexts for --ctx: the Devices it parsed, or its string through the same parser."""
    from kdcache.trainer.options import Ctx
    d = Ctx().coerce(arg, "--ctx", TrainError)
    if d.kind == "auto":
        return [mx.gpu(0)] if mx.context.num_gpus() > 0 else [mx.cpu()]
    if d.kind == "cpu":  # several CPU contexts: the multi-device path (split batches, device kvstore)
        return [mx.cpu(i) for i in d.ids] if d.ids else [mx.cpu()]
    n = mx.context.num_gpus()
    ctx = [mx.gpu(i) for i in d.ids or (0,)]
    if any(c.device_id >= n for c in ctx):
        raise TrainError(f"--ctx {d}: MXNet sees {n} GPU(s); install a CUDA build of MXNet "
                         f"(pip install mxnet-cu112==1.9.1 numpy==1.23.5) or use --ctx cpu")
    return ctx


# --- targets ---------------------------------------------------------------------------------
def global_batch_size(n, batch_size, step):
    """Samples in schedule batch `step` (the last batch of an epoch may be smaller)."""
    return min(batch_size, n - step * batch_size)


def evaluate(net, dataset, ctx, batch_size=256):
    correct = 0
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        correct += int((net(mx.nd.array(x, ctx=ctx[0])).asnumpy().argmax(axis=1) == y).sum())
    return correct / len(dataset)


def scores(net, dataset, ctx, batch_size=256):
    """(top-1, top-5 or None when there are 5 classes or fewer, the predicted classes) on `dataset`."""
    top1 = top5 = 0
    wide = False
    preds = []
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        out = net(mx.nd.array(x, ctx=ctx[0])).asnumpy()
        preds.append(out.argmax(axis=1))
        top1 += int((preds[-1] == y).sum())
        wide = out.shape[1] > 5
        if wide:
            top5 += int((np.argsort(-out, axis=1)[:, :5] == y[:, None]).any(axis=1).sum())
    n = max(1, len(dataset))
    return top1 / n, (top5 / n if wide else None), (np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64))


def expected_calibration_error(net, dataset, ctx, bins=15, batch_size=256):
    """ECE of the student's softmax on `dataset`: the mean over 15 equal-width confidence bins of |accuracy -
    confidence|, weighted by the share of items in each (Guo et al. 2017). None for an empty data set."""
    conf, hit = [], []
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        p = mx.nd.softmax(net(mx.nd.array(x, ctx=ctx[0])), axis=1).asnumpy()
        conf.append(p.max(axis=1))
        hit.append(p.argmax(axis=1) == y)
    if not conf:
        return None
    conf, hit = np.concatenate(conf).astype(np.float64), np.concatenate(hit)
    which = np.minimum((conf * bins).astype(np.int64), bins - 1)
    gap = 0.0
    for b in range(bins):
        sel = which == b
        if sel.any():
            gap += sel.mean() * abs(hit[sel].mean() - conf[sel].mean())
    return float(gap)


def agreement(net, train, idx, view, ctx, *, seed, augment, teacher_logits, batch_size=256):
    """Share of items `idx` (view `view`, the view the teacher saw) where the student's top-1 is
    the teacher's argmax; None when the teacher's targets are not at hand (hard labels, a ring)."""
    if teacher_logits is None or len(idx) == 0:
        return None
    same = 0
    for a in range(0, len(idx), batch_size):
        part = idx[a:a + batch_size]
        t = teacher_logits(part, view)
        if t is None:
            return None
        x, _ = make_views(train, part, view, seed=seed, augment=augment)
        same += int((net(mx.nd.array(x, ctx=ctx[0])).asnumpy().argmax(1) == np.asarray(t).argmax(1)).sum())
    return same / len(idx)


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
def open_reader(args, plan, producer, rank, producer_log):
    """The cache's reader; a producer just started needs a few seconds to create the cache."""
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
    from kdcache.store.ensemble import EnsembleReader
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
                             f"run's ({str(theirs)[:80]} vs {str(mine)[:80]}): pass the --dataset, --views, --augment and --seed they "
                             f"were built with")
    log.info("ensemble of %d caches (%s, rule %s): the teacher costs nothing in this run", len(reader.members),
             ", ".join(r.fingerprint for r in reader.readers), reader.rule)
    return reader


KVSTORES = []


def run(args, plan, early, threads, cores):
    t_start = time.perf_counter()
    ctx = resolve_ctx(args.ctx)
    # Distributed: every worker reads the shared schedule and trains on its part of each batch
    # (indices[rank::workers]); dist_sync sums the gradients, so the update is the global batch's.
    kv, rank, workers = None, 0, 1
    if args.kvstore:
        try:
            if "dist" in args.kvstore:  # it blocks in the kvstore, where Python never runs: SIGTERM ends it
                signals.release(signal.SIGTERM)
            kv = mx.kv.create(args.kvstore)
        except Exception as e:
            raise TrainError(f"--kvstore {args.kvstore}: {str(e).strip().splitlines()[-1][:200]}; for dist_* start "
                             f"the workers with `kdcache launch` (or set the DMLC_* variables)") from None
        rank, workers = kv.rank, kv.num_workers
        # Held to the end of the process: freeing a dist kvstore waits at a barrier for every worker, which
        # a worker leaving on an error must not do (python -m kdcache.trainer then exits without destructors).
        KVSTORES.append(kv)
    run_name = args.run_name
    run_dir = os.path.join(args.runs_dir, run_name)
    if workers > 1:
        run_dir = os.path.join(run_dir, f"worker-{rank}")
        if os.path.exists(os.path.join(run_dir, "state.json")) and not args.resume:
            raise TrainError(f"run {run_dir} exists: pass --resume to continue it or another --run name")
    os.makedirs(run_dir, exist_ok=True)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)

    # data
    train, augment = plan.train, plan.augment
    test = load_dataset(args.dataset, data_root=args.data_root, split="test", image_size=args.image_size,
                        num_classes=args.num_classes)
    test = eval_views(test, augment)  # rrc:SIZE trains at SIZE: the test images are centre-cropped to it
    n, classes = len(train), train.num_classes
    # The validation slice: items of the training split the loop skips, for picking the best epoch
    # (never the test split). The schedule and the cache still cover every item: the producer needs
    # no option of the trainer's, and a cache stays valid whatever --val-fraction is.
    val_idx = val_indices(n, args.val_fraction, args.seed)
    is_val = np.zeros(n, dtype=bool)
    is_val[val_idx] = True
    val = Subset(eval_views(train, augment), val_idx)
    log.info("data set %s: %d train / %d test samples, %d classes, %d view(s), augment %s; ctx %s, %d thread(s) "
             "of %d core(s)", train.name, n, len(test), classes, args.views, augment.spec, ctx, threads, cores)

    # student: run once on one sample, so a wrong output width is one line before anything starts (and its
    # shapes are known before a resume loads parameters)
    net = get_model(args.student, classes, prefix="student_")
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize(static_alloc=True)
    check_student(net, args.student, mx.nd.array(make_views(train, [0], [0], seed=args.seed, augment=augment)[0],
                                                 ctx=ctx[0]), classes)

    # targets
    producer = reader = ring = teacher = None
    spec = plan.spec
    cache_path = None
    teacher_acc = None
    targets = None
    mode = args.teacher_mode
    result_file = os.path.join(run_dir, "producer.json")
    producer_log = os.path.join(run_dir, "producer.log")
    if early is not None:
        producer, ring = early.producer, early.ring
    if mode == "inline":
        teacher = load_teacher(plan.topt, args.batch_size)
        check_fits(teacher, train, augment, args.seed)
        correct = 0
        for a in range(0, len(test), args.batch_size):  # in training-size batches: bounded memory
            x, y = test.get_batch(np.arange(a, min(len(test), a + args.batch_size)))
            correct += int((teacher.forward(x).argmax(1) == y).sum())
        teacher_acc = correct / len(test)
        teacher.forwards = 0
    elif mode == "cache" and args.ensemble:
        reader = open_ensemble(args, train, augment)
        targets = lambda st: reader.get(st.indices, st.view)  # noqa: E731
        test_cache_missing = False
    elif mode == "cache":
        pthreads = args.producer_threads or max(1, cores - threads)
        if args.store == "ring":
            if ring is None:
                ring = create_ring(args, plan)
                producer = start_producer(producer_command(args, plan, threads=pthreads, ring=ring.name,
                                                           result=result_file), producer_log)
            targets = ring_targets(ring, producer, producer_log, args.wait_timeout)
        else:
            base = plan.base
            cache_path = final_path(base)
            if producer is None and not plan.complete and not args.no_producer and rank == 0:
                if producer_running(base):
                    log.info("a producer is already filling cache %s: reading behind it", spec.fingerprint)
                else:
                    producer = start_producer(producer_command(args, plan, threads=pthreads, result=result_file),
                                              producer_log)
            elif plan.complete:
                log.info("cache %s is complete: the teacher costs nothing in this run", spec.fingerprint)
            reader = open_reader(args, plan, producer, rank, producer_log)
            targets = lambda st: reader.get(st.indices, st.view)
        # the teacher's own test accuracy, from a (small, reusable) cache of the test split
        tspec = build_spec(spec.inputs["teacher"], test, augment=augment.eval_view(), codec="full", dtype="float32")
        tbase = path_for(args.cache_dir, tspec.fingerprint)
        # Built after training when missing: during it, a third MXNet process would take the
        # trainer's or the producer's core.
        test_cache_missing = not os.path.exists(final_path(tbase))
        if rank == 0 and not test_cache_missing:
            teacher_acc = teacher_accuracy(tbase, tspec, test)

    # the optimiser (the student is built and checked above, before any producer starts)
    spe = steps_per_epoch(n, args.batch_size)
    # per update, positioned by the optimiser's update count; dist_async's server counts every worker's push
    lr_schedule = schedule_of(args, spe * (workers if args.kvstore == "dist_async" else 1))
    opt_params = {"learning_rate": args.lr, "wd": args.wd, "lr_scheduler": lr_schedule,
                  **({"momentum": args.momentum} if args.optimizer in ("sgd", "nag") else {})}
    trainer = gluon.Trainer(net.collect_params(), args.optimizer, opt_params,
                            **({"kvstore": kv} if kv is not None else {}),
                            # dist_sync: workers all-reduce gradients and update alike, so the last, smaller
                            # batch of an epoch is normalised right and the optimiser state can be saved
                            **({"update_on_kvstore": False} if args.kvstore == "dist_sync" else {}))
    start_epoch, history, best = 0, [], None
    if args.resume:
        state = load_checkpoint(run_dir, net, trainer)
        start_epoch, history, best = state["epoch"] + 1, state.get("history", []), state.get("best")
        log.info("resuming %s after epoch %d", run_dir, state["epoch"])
    epoch_log = EpochLog(run_dir, resume_after=start_epoch - 1 if args.resume else None)
    teacher_logits = None  # (indices, view) -> the teacher's logits, for the agreement column
    if mode == "inline":
        def teacher_logits(idx, v):
            forwards = teacher.forwards  # the count reports training's forwards only
            out = teacher.forward(make_views(train, idx, v, seed=args.seed, augment=augment)[0])
            teacher.forwards = forwards
            return out
    elif reader is not None:
        def teacher_logits(idx, v):
            try:
                return reader.get(idx, v, wait=False)
            except Exception:  # not written yet (a producer behind): the column stays empty
                return None
    if kv is not None and "dist" in kv.type:
        if args.kvstore == "dist_async":
            # The optimiser goes to the server when the kvstore starts, below: with the normalisation
            # every step() passes (one fixed batch), or MXNet refuses the first step as a batch change.
            trainer._optimizer.rescale_grad = trainer._scale / args.batch_size
        broadcast_initial_parameters(trainer, net)
    loss_fn = KDLoss(args.temperature, args.alpha if mode != "none" else 0.0)

    # epochs
    stall_total = 0.0
    seen = 0
    train_s = 0.0
    metrics = {}
    pf = None
    timeline = []  # (unix time, schedule position, seconds this step waited): runs/<run>/timeline.json
    digests = EpochDigests(n, args.batch_size)  # the keys read, epoch by epoch (metrics: schedule_sha256)
    interrupts = Interrupts(term=workers == 1).install()  # a worker waits in the kvstore: SIGTERM ends it
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
            # the global batches' sizes without their validation items (dist_sync normalises by them)
            global_sizes = [int((~is_val[b]).sum()) for b in epoch_batches(args.seed, epoch, n, args.batch_size)]
            epoch_lr = None
            try:
                for st, x, y, t in pf:
                    interrupts.check()
                    digests.add(st)
                    keep = ~is_val[st.indices]  # validation items are read with the batch, never trained on
                    if not keep.all():
                        x, y, t = x[keep], y[keep], (t[keep] if t is not None else None)
                    if x.shape[0] == 0 and workers == 1:
                        continue
                    if mode == "inline":
                        t = teacher.forward(x)
                    xs = gluon.utils.split_and_load(x, ctx, even_split=False)
                    ys = gluon.utils.split_and_load(y.astype(np.float32), ctx, even_split=False)
                    ts = gluon.utils.split_and_load(t, ctx, even_split=False) if t is not None else \
                        [mx.nd.zeros((len(a), classes), ctx=a.context) for a in ys]
                    with autograd.record():
                        losses = [loss_fn(net(a), b, c) for a, c, b in zip(xs, ys, ts)]
                    autograd.backward(losses)
                    # read before the step: a NaN target would put NaN into every weight (trainer.loss NOTE)
                    tot_loss += check_finite(losses, keys=(st.indices, st.view), targets=t if t is not None else (),
                                             inputs=x, where=f"epoch {epoch + 1} batch {st.step + 1} of {spe}",
                                             cache=cache_path)
                    # the global batch: dist_sync sums the workers' gradients
                    if workers == 1:
                        trainer.step(x.shape[0])
                    elif args.kvstore == "dist_sync":
                        trainer.step(global_sizes[st.step])
                    else:  # dist_async updates on the server with one fixed normalisation
                        trainer.step(args.batch_size)
                    if epoch_lr is None:  # the rate the optimiser used for the epoch's first update
                        epoch_lr = trainer.learning_rate if args.kvstore != "dist_async" else \
                            lr_schedule.at_epoch(epoch)
                    seen += x.shape[0]
                    epoch_seen += x.shape[0]
                    timeline.append((round(time.time(), 4), int(st.position), round(pf.stall_s - stall_before, 5)))
                    stall_before = pf.stall_s
                    bar.update(1)
                    now = time.perf_counter()
                    if now - last_report > 0.5:
                        last_report = now
                        if reader is not None and reader.base:
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
            acc, top5, _ = scores(net, test, ctx)
            val_acc = scores(net, val, ctx)[0] if len(val) else None
            agree = agreement(net, train, val_idx, view_of_epoch(epoch, args.views), ctx, seed=args.seed,
                              augment=augment, teacher_logits=teacher_logits, batch_size=args.batch_size)
            loss = tot_loss / max(1, epoch_seen)
            history.append({"epoch": epoch, "seconds": round(dt, 3), "loss": loss, "test_acc": acc,
                            "stall_s": round(pf.stall_s, 3), "samples_per_s": round(epoch_seen / dt, 1),
                            "test_top5": top5, "val_acc": val_acc, "agreement": agree, "lr": epoch_lr,
                            "samples": epoch_seen})
            if val_acc is not None and (best is None or val_acc > best["val_top1"]):
                best = {"epoch": epoch, "val_top1": val_acc}
            # before the checkpoint: a crash between the two re-runs the epoch, and its row is dropped
            epoch_log.append({"epoch": epoch + 1, "loss": loss, "top1": acc, "top5": top5, "val_top1": val_acc,
                              "agreement": agree, "lr": epoch_lr, "samples_per_s": round(epoch_seen / dt, 1),
                              "stall_s": round(pf.stall_s, 3)})
            log.info("epoch %d/%d: loss %.4f, test accuracy %.4f, %.0f samples/s, stall %.2f s%s", epoch + 1,
                     args.epochs, loss, acc, epoch_seen / dt, pf.stall_s,
                     f" (worker {rank} of {workers})" if workers > 1 else "")
            options = recorded(args)  # JSON: typed values as their command-line words
            keep = {epoch} | ({best["epoch"]} if best else set()) | \
                ({e for e in range(epoch + 1) if (e + 1) % args.save_every == 0} if args.save_every else set())
            save_checkpoint(run_dir, net, trainer, epoch, {"history": history, "args": options, "best": best,
                                                           "rank": rank, "workers": workers, "kvstore": args.kvstore},
                            keep=keep)
            interrupts.check()
    finally:
        interrupts.restore()
        stop_producer(producer)
        if ring is not None:
            ring.close()

    if mode == "cache" and rank == 0 and test_cache_missing:
        test_producer = start_producer(producer_command(args, plan, split="test", online=False, threads=cores),
                                       os.path.join(run_dir, "producer-test.log"))
        try:
            with signals.interruptible():
                test_producer.wait(timeout=300)
        except subprocess.TimeoutExpired:
            stop_producer(test_producer)
        teacher_acc = teacher_accuracy(tbase, tspec, test)
    final_acc = history[-1]["test_acc"] if history else None
    test_ece = expected_calibration_error(net, test, ctx) if history else None  # the last epoch's student
    forwards = teacher.forwards if teacher is not None else 0
    if producer is not None:
        forwards = (producer_result(result_file) or {}).get("teacher_forwards", forwards)
    if reader is not None:
        reader.close()
    metrics = {
        "run": run_name, "dataset": args.dataset, "student": args.student,
        "student_identity": model_identity(args.student), "teacher_mode": mode,
        "store": args.store if mode == "cache" else None, "temperature": args.temperature,
        "alpha": args.alpha if mode != "none" else 0.0, "epochs": args.epochs, "seed": args.seed,
        "batch_size": args.batch_size,
        "test_acc": final_acc, "test_ece": test_ece, "teacher_test_acc": teacher_acc,
        "samples_per_s": round(seen / train_s, 1) if train_s else None,
        "teacher_forwards": int(forwards), "stall_s": round(stall_total, 3),
        "target_wait_s": round(reader.stall_s if reader else (ring.stall_s if ring else 0.0), 3),
        "cache_path": cache_path, "fingerprint": spec.fingerprint if spec else None,
        "ensemble": dict(reader.identity(), fingerprint=reader.fingerprint) if args.ensemble else None,
        "producer_started": producer is not None, "threads": threads, "ctx": str(ctx),
        "kvstore": args.kvstore, "rank": rank, "workers": workers,
        "epoch1_s": history[0]["seconds"] if history and start_epoch == 0 else None,
        "wall_s": round(time.perf_counter() - t_start, 3), "history": history,
        "checkpoint": os.path.join(run_dir, "student-symbol.json"),
        "recipe": {"optimizer": args.optimizer, "lr": args.lr, "momentum": args.momentum if args.optimizer != "adam"
                   else None, "wd": args.wd, "lr_mode": args.lr_mode,
                   "lr_steps": list(lr_schedule.steps) if args.lr_mode == "step" else None,
                   "lr_factor": args.lr_factor if args.lr_mode == "step" else None,
                   "warmup_epochs": args.warmup_epochs, "val_fraction": args.val_fraction, "val_items": len(val_idx),
                   "save_every": args.save_every},
        "best_epoch": best["epoch"] + 1 if best else None, "best_val_top1": best["val_top1"] if best else None,
        "best_checkpoint": os.path.join(run_dir, f"student-{best['epoch']:04d}.params") if best else None,
        "last_checkpoint": os.path.join(run_dir, f"student-{history[-1]['epoch']:04d}.params") if history else None,
        "schedule_sha256": digests.complete(),
    }
    with open(os.path.join(run_dir, "timeline.json"), "w") as fh:
        json.dump({"columns": ["time", "position", "wait_s"], "steps": timeline}, fh)
    with open(os.path.join(run_dir, "metrics.json.tmp"), "w") as fh:
        json.dump(metrics, fh, indent=1)
    os.replace(os.path.join(run_dir, "metrics.json.tmp"), os.path.join(run_dir, "metrics.json"))
    return metrics, run_dir
