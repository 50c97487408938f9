"""The training loop, read top to bottom: options -> data -> targets -> student -> epochs -> report."""
import dataclasses
import logging
import os
import signal
import time

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon
from tqdm import tqdm

from kdcache.pipeline.augment import eval_views, make_views, mixes
from kdcache.pipeline.datasets import load_from_options
from kdcache import signals
from kdcache.pipeline.interrupts import Interrupts
from kdcache.pipeline.schedule import EpochDigests, epoch_batches, schedule, steps_per_epoch, view_of_epoch
from kdcache.store import ProducerGoneError
from kdcache.store.osutil import write_json_atomic
from kdcache.trainer.checkpoint import load_checkpoint, save_checkpoint
from kdcache.trainer.loss import KDLoss, LateLoss, check_finite, host_finite
from kdcache.trainer.models import StudentInput, check_student, get_model, model_identity
from kdcache.trainer.options import recorded
from kdcache.trainer.prefetch import Prefetcher
from kdcache.trainer.recipe import EpochLog, Subset, schedule_of, val_indices
from kdcache.trainer import resume as resumed
from kdcache.trainer.errors import TrainError

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


# --- measures --------------------------------------------------------------------------------
def scores(net, dataset, ctx, batch_size=256, feed=lambda x: x):
    """(top-1, top-5 or None when there are 5 classes or fewer, the predicted classes) on `dataset`;
    `feed` makes the student's input of images (models.StudentInput)."""
    top1 = top5 = 0
    wide = False
    preds = []
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        out = net(mx.nd.array(feed(x), ctx=ctx[0])).asnumpy()
        preds.append(out.argmax(axis=1))
        top1 += int((preds[-1] == y).sum())
        wide = out.shape[1] > 5
        if wide:
            top5 += int((np.argsort(-out, axis=1)[:, :5] == y[:, None]).any(axis=1).sum())
    n = max(1, len(dataset))
    return top1 / n, (top5 / n if wide else None), (np.concatenate(preds) if preds else np.zeros(0, dtype=np.int64))


def expected_calibration_error(net, dataset, ctx, bins=15, batch_size=256, feed=lambda x: x):
    """ECE of the student's softmax on `dataset`: the mean over 15 equal-width confidence bins of |accuracy -
    confidence|, weighted by the share of items in each (Guo et al. 2017). None for an empty data set."""
    conf, hit = [], []
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        p = mx.nd.softmax(net(mx.nd.array(feed(x), ctx=ctx[0])), axis=1).asnumpy()
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


def agreement(net, train, idx, view, ctx, *, seed, augment, teacher_logits, batch_size=256, feed=lambda x: x):
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
        same += int((net(mx.nd.array(feed(x), ctx=ctx[0])).asnumpy().argmax(1) == np.asarray(t).argmax(1)).sum())
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


KVSTORES = []


# --- set-up ----------------------------------------------------------------------------------
def join_kvstore(args):
    """(kvstore, rank, workers): distributed, every worker reads the shared schedule and trains on its
    part of each batch (indices[rank::workers]); dist_sync sums the gradients, so the update is the
    global batch's."""
    if not args.kvstore:
        return None, 0, 1
    try:
        if "dist" in args.kvstore:  # it blocks in the kvstore, where Python never runs: SIGTERM ends it
            signals.release(signal.SIGTERM)
        kv = mx.kv.create(args.kvstore)
    except Exception as e:
        raise TrainError(f"--kvstore {args.kvstore}: {str(e).strip().splitlines()[-1][:200]}; for dist_* start "
                         f"the workers with `kdcache launch` (or set the DMLC_* variables)") from None
    # Held to the end of the process: freeing a dist kvstore waits at a barrier for every worker, which
    # a worker leaving on an error must not do (python -m kdcache.trainer then exits without destructors).
    KVSTORES.append(kv)
    return kv, kv.rank, kv.num_workers


def run_folder(args, rank, workers):
    run_dir = os.path.join(args.runs_dir, args.run_name)
    if workers > 1:
        run_dir = os.path.join(run_dir, f"worker-{rank}")
        if os.path.exists(os.path.join(run_dir, "state.json")) and not args.resume:
            raise TrainError(f"run {run_dir} exists: pass --resume to continue it or another --run name")
    os.makedirs(run_dir, exist_ok=True)
    return run_dir


def build_student(args, train, augment, ctx, feed=lambda x: x):
    """The student, run once on one sample: a wrong output width is one line before anything starts
    (and its shapes are known before a resume loads parameters)."""
    net = get_model(args.student, train.num_classes, prefix="student_")
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize(static_alloc=True)
    x = make_views(train, [0], [0], seed=args.seed, augment=augment)[0]
    check_student(net, args.student, mx.nd.array(feed(x), ctx=ctx[0]), train.num_classes)
    return net


def build_optimizer(args, net, kv, workers, steps):
    """The gluon.Trainer with the recipe's learning-rate schedule, positioned per update by the
    optimiser's update count (dist_async's server counts every worker's push)."""
    lr_schedule = schedule_of(args, steps * (workers if args.kvstore == "dist_async" else 1))
    opt_params = {"learning_rate": args.lr, "wd": args.wd, "lr_scheduler": lr_schedule,
                  **({"momentum": args.momentum} if args.optimizer in ("sgd", "nag") else {})}
    trainer = gluon.Trainer(net.collect_params(), args.optimizer, opt_params,
                            **({"kvstore": kv} if kv is not None else {}),
                            # dist_sync: workers all-reduce gradients and update alike, so the last, smaller
                            # batch of an epoch is normalised right and the optimiser state can be saved
                            **({"update_on_kvstore": False} if args.kvstore == "dist_sync" else {}))
    return trainer, lr_schedule


def join_workers(args, kv, trainer, net):
    if kv is not None and "dist" in kv.type:
        if args.kvstore == "dist_async":
            # The optimiser goes to the server when the kvstore starts, below: with the normalisation
            # every step() passes (one fixed batch), or MXNet refuses the first step as a batch change.
            trainer._optimizer.rescale_grad = trainer._scale / args.batch_size
        broadcast_initial_parameters(trainer, net)


def recipe(args, lr_schedule, val_items):
    return {"optimizer": args.optimizer, "lr": args.lr, "momentum": args.momentum if args.optimizer != "adam"
            else None, "wd": args.wd, "lr_mode": args.lr_mode,
            "lr_steps": list(lr_schedule.steps) if args.lr_mode == "step" else None,
            "lr_factor": args.lr_factor if args.lr_mode == "step" else None,
            "warmup_epochs": args.warmup_epochs, "val_fraction": args.val_fraction, "val_items": val_items,
            "save_every": args.save_every}


# --- the run ---------------------------------------------------------------------------------
def run(args, plan, targets, threads, cores):
    """Train the student: set-up, the epochs, the report. `targets` (producer.Targets) is the
    teacher's side, started and settled by the caller; the caller closes it."""
    t_start = time.perf_counter()
    ctx = resolve_ctx(args.ctx)
    kv, rank, workers = join_kvstore(args)
    run_name = args.run_name
    run_dir = run_folder(args, rank, workers)
    ident = resumed.identity(args, plan)  # recorded with every checkpoint: a resume compares it
    if args.resume and (args.kvstore or "").startswith("dist"):  # one worker's folder, known by its rank now
        resumed.check(run_dir, args, ident)
    mx.random.seed(args.seed)
    np.random.seed(args.seed)
    mode = args.teacher_mode

    # data
    train, augment = plan.train, plan.augment
    test = load_from_options(args, "test")
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

    # student, targets, optimiser (the student is checked before any producer starts)
    feed = StudentInput(args.student_mean, args.student_std, channels=train.shape[0])  # the student's input only
    net = build_student(args, train, augment, ctx, feed)
    targets.open(args, plan, run_dir=run_dir, rank=rank, threads=threads, cores=cores, test=test)
    spe = steps_per_epoch(n, args.batch_size)
    trainer, lr_schedule = build_optimizer(args, net, kv, workers, spe)
    start_epoch, history, best = 0, [], None
    if args.resume:
        state = load_checkpoint(run_dir, net, trainer)
        start_epoch, history, best = state["epoch"] + 1, state.get("history", []), state.get("best")
        log.info("resuming %s after epoch %d", run_dir, state["epoch"])
    epoch_log = EpochLog(run_dir, resume_after=start_epoch - 1 if args.resume else None)
    join_workers(args, kv, trainer, net)
    # mixed views (mixup, cutmix) carry labels (label, partner's label, λ): pipeline.augment NOTE (mixed views)
    loss_fn = KDLoss(args.temperature, args.alpha if mode != "none" else 0.0, label_smoothing=args.label_smoothing,
                     mixed=mixes(augment))

    # epochs
    stall_total, seen, train_s = 0.0, 0, 0.0
    timeline = []  # (unix time, schedule position, seconds this step waited): runs/<run>/timeline.json
    digests = EpochDigests(n, args.batch_size)  # the keys read, epoch by epoch (metrics: schedule_sha256)
    interrupts = Interrupts(term=workers == 1).install()  # a worker waits in the kvstore: SIGTERM ends it
    try:
        for epoch in range(start_epoch, args.epochs):
            steps = schedule(args.seed, epoch + 1, n, args.batch_size, args.views, start_epoch=epoch)
            if workers > 1:
                steps = (dataclasses.replace(st, indices=st.indices[rank::workers]) for st in steps)
            pf = Prefetcher(steps, train, seed=args.seed, augment=augment, targets=targets.get, poll=interrupts.check)
            bar = tqdm(total=spe, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step", disable=args.quiet,
                       dynamic_ncols=True, leave=not args.quiet)
            t0 = time.perf_counter()
            tot_loss, last_report, stall_before, epoch_seen = 0.0, 0.0, 0.0, 0
            late = LateLoss(targets.cache_path)  # the losses, read one step late (trainer.loss NOTE)
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
                        t = targets.forward(x)
                    xs = gluon.utils.split_and_load(feed(x), ctx, even_split=False)
                    ys = gluon.utils.split_and_load(y.astype(np.float32), ctx, even_split=False)
                    ts = gluon.utils.split_and_load(t, ctx, even_split=False) if t is not None else \
                        [mx.nd.zeros((len(a), classes), ctx=a.context) for a in ys]
                    with autograd.record():
                        losses = [loss_fn(net(a), b, c) for a, c, b in zip(xs, ys, ts)]
                    autograd.backward(losses)
                    # Off the critical path (trainer.loss NOTE): a NaN target would put NaN into every weight, so
                    # the host's targets and images are checked before the step, and only where they hold NaN or
                    # Inf does the loop wait for this step's loss (check_finite names the keys and the cause).
                    check = dict(keys=(st.indices, st.view), targets=t if t is not None else (), inputs=x,
                                 where=f"epoch {epoch + 1} batch {st.step + 1} of {spe}")
                    read_now = not host_finite(x, t)
                    if read_now:
                        tot_loss += late.flush() + check_finite(losses, cache=targets.cache_path, **check)
                    # the global batch: dist_sync sums the workers' gradients
                    if workers == 1:
                        trainer.step(x.shape[0])
                    elif args.kvstore == "dist_sync":
                        trainer.step(global_sizes[st.step])
                    else:  # dist_async updates on the server with one fixed normalisation
                        trainer.step(args.batch_size)
                    if not read_now:
                        tot_loss += late.add(losses, **check)  # the step before's loss, computed by now
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
                        targets.report_position(st, epoch=epoch, run=run_name)
                        bar.set_postfix(loss=f"{tot_loss / max(1, epoch_seen):.4f}",
                                        stall=f"{pf.stall_s:.1f}s", refresh=False)
                tot_loss += late.flush()
            except ProducerGoneError as e:
                raise targets.gone(e) from None
            finally:
                pf.close()
                bar.close()
            dt = time.perf_counter() - t0
            train_s += dt
            stall_total += pf.stall_s
            acc, top5, _ = scores(net, test, ctx, feed=feed)
            val_acc = scores(net, val, ctx, feed=feed)[0] if len(val) else None
            agree = agreement(net, train, val_idx, view_of_epoch(epoch, args.views), ctx, seed=args.seed,
                              augment=augment, batch_size=args.batch_size, feed=feed,
                              teacher_logits=lambda idx, v: targets.teacher_logits(train, idx, v, seed=args.seed,
                                                                                   augment=augment))
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
            keep = {epoch} | ({best["epoch"]} if best else set()) | \
                ({e for e in range(epoch + 1) if (e + 1) % args.save_every == 0} if args.save_every else set())
            save_checkpoint(run_dir, net, trainer, epoch, {"history": history, "args": recorded(args), "best": best,
                                                           "identity": ident, "rank": rank, "workers": workers,
                                                           "kvstore": args.kvstore},
                            keep=keep)
            interrupts.check()
    finally:
        interrupts.restore()
        targets.stop()

    # report
    teacher_acc = targets.test_accuracy(args, plan, run_dir=run_dir, cores=cores, test=test) if mode == "cache" \
        else targets.teacher_acc
    metrics = {
        "run": run_name, "dataset": args.dataset, "student": args.student,
        "student_identity": model_identity(args.student), "teacher_mode": mode,
        "store": args.store if mode == "cache" else None, "temperature": args.temperature,
        "alpha": args.alpha if mode != "none" else 0.0, "epochs": args.epochs, "seed": args.seed,
        "batch_size": args.batch_size,
        "test_acc": history[-1]["test_acc"] if history else None,
        "test_ece": expected_calibration_error(net, test, ctx, feed=feed) if history else None,  # the last epoch's student
        "samples_per_s": round(seen / train_s, 1) if train_s else None, "stall_s": round(stall_total, 3),
        **targets.report(args, plan), "teacher_test_acc": teacher_acc,
        "threads": threads, "ctx": str(ctx), "kvstore": args.kvstore, "rank": rank, "workers": workers,
        "epoch1_s": history[0]["seconds"] if history and start_epoch == 0 else None,
        "wall_s": round(time.perf_counter() - t_start, 3), "history": history,
        "checkpoint": os.path.join(run_dir, "student-symbol.json"),
        "recipe": recipe(args, lr_schedule, len(val_idx)),
        "best_epoch": best["epoch"] + 1 if best else None, "best_val_top1": best["val_top1"] if best else None,
        "best_checkpoint": os.path.join(run_dir, f"student-{best['epoch']:04d}.params") if best else None,
        "last_checkpoint": os.path.join(run_dir, f"student-{history[-1]['epoch']:04d}.params") if history else None,
        "schedule_sha256": digests.complete(),
    }
    write_json_atomic(os.path.join(run_dir, "timeline.json"), {"columns": ["time", "position", "wait_s"],
                                                               "steps": timeline}, fsync=False)  # a diagnostic
    write_json_atomic(os.path.join(run_dir, "metrics.json"), metrics, indent=1)  # the run's result: fsynced
    return metrics, run_dir
