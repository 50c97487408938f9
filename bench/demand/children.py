"""The demand benchmark's MXNet processes: calibrate the teacher, the offline producer, a user's Gluon loop.

    python -m bench.demand.children prepare --root DIR --sizes JSON
    python -m bench.demand.children produce --teacher PREFIX --dataset SPEC --cache PATH --demand on|off
    python -m bench.demand.children train --dataset SPEC --cache PATH --order shuffle|announce|schedule
                                         --read item|batch --workers 0|1 --ready FILE

bench.demand starts each with one compute thread (bench.common.child_env); each prints one JSON line.
`produce` is cache_builder.produce.produce_offline on the cache `python -m kdcache.cache_builder` would build from
these options (its own parser and spec), with every teacher batch logged: its size, its time, and whether
readers' demand chose it. `train` is the loop a user writes: gluon.data.DataLoader(SoftTargetDataset(...),
batch_size=64, ...) and a small_cnn step; it writes --ready once loaded, then waits for the cache to appear
and times its first epoch from there. `--read batch` is a prototype, not kdcache's API: the items carry no
target, and a batchify_fn reads the batch's targets at once.
"""
import ctypes
import json
import math
import multiprocessing
import os
import shutil
import statistics
import sys
import time

import numpy as np

from bench.cli import RUN, check_child, like, parse_args, trainer_option
from bench.kd.children import TEACHER_SHAPES, Sizes as KdSizes, optimizer, teacher_cost, teacher_net, trainer_defaults
from kdcache.args import Choice, Dir, Float, Int, Option, OutFile

BATCH = 64
CLASSES = 10
SHAPE = (3, 32, 32)
STUDENT = "small_cnn"
SEED = 0
FIRST_SHAPE = (32, 1)  # the calibration's first guess (width, extra convs)


# -- prepare: the teacher and the data set's size ----------------------------------------------------
def child_prepare(root, reps, tries, epoch_s, min_steps, max_steps, target):
    """Time the student's step and candidate teachers' forwards (batch 64, one thread), export the teacher
    whose forward/step ratio lands nearest `target`, and size the data set to about epoch_s of student steps."""
    import mxnet as mx
    from mxnet import autograd
    from kdcache.pipeline.teacher import Teacher
    out_dir = os.path.join(root, "teachers")
    os.makedirs(out_dir, exist_ok=True)
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    x = rng.random((BATCH,) + SHAPE, dtype=np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.float32)
    t = rng.standard_normal((BATCH, CLASSES), dtype=np.float32)
    net, opt, loss_fn = student(CLASSES)

    def step():
        t0 = time.perf_counter()
        xs, ys, ts = mx.nd.array(x), mx.nd.array(y), mx.nd.array(t)
        with autograd.record():
            loss = loss_fn(net(xs), ts, ys)
        loss.backward()
        opt.step(BATCH)
        float(loss.mean().asscalar())
        return time.perf_counter() - t0

    for _ in range(3):
        step()
    shape, seen = FIRST_SHAPE, {}
    for _ in range(tries):
        mx.random.seed(SEED)
        tn = teacher_net(*shape, "demand_")
        tn.initialize(mx.init.Xavier())
        tn.hybridize()
        tn(mx.nd.array(x[:1])).wait_to_read()
        prefix = os.path.join(out_dir, f"w{shape[0]}-x{shape[1]}")
        tn.export(prefix, 0)
        teacher = Teacher(prefix, batch_size=BATCH)  # the runner the producer uses
        teacher.forward(x)
        s, f = [], []
        for _ in range(reps):  # interleaved, so machine noise hits both
            s.append(step())
            t0 = time.perf_counter()
            teacher.forward(x)
            f.append(time.perf_counter() - t0)
        step_s, fwd_s = statistics.median(s), statistics.median(f)
        seen[shape] = {"width": shape[0], "extra_convs": shape[1], "prefix": prefix, "forward_ms": 1e3 * fwd_s,
                       "step_ms": 1e3 * step_s, "ratio": fwd_s / step_s,
                       "parameters": sum(int(np.prod(p.shape)) for p in tn.collect_params().values())}
        if abs(math.log(fwd_s / step_s / target)) < math.log(1.1):
            break
        scale = fwd_s / step_s / teacher_cost(*shape)
        nxt = min(TEACHER_SHAPES, key=lambda c: abs(math.log(scale * teacher_cost(*c) / target)))
        if nxt in seen:
            break
        shape = nxt
    best = min(seen.values(), key=lambda c: abs(math.log(c["ratio"] / target)))
    final = os.path.join(out_dir, "teacher")
    for suffix in ("-symbol.json", "-0000.params"):
        shutil.copyfile(best["prefix"] + suffix, final + suffix)
    steps = int(min(max_steps, max(min_steps, round(epoch_s / (best["step_ms"] / 1e3)))))
    n = steps * BATCH
    print(json.dumps({**best, "prefix": final, "target": target, "tries": list(seen.values()), "n": n,
                      "steps_per_epoch": steps, "batch": BATCH, "student": STUDENT,
                      "dataset": f"synthetic:n={n},classes={CLASSES},shape={'x'.join(map(str, SHAPE))}"}))


def student(classes):
    """small_cnn with the trainer's optimiser and KD loss, as a user's loop would set them up."""
    import mxnet as mx
    from kdcache.trainer.loss import KDLoss
    from kdcache.trainer.models import get_model
    net = get_model(STUDENT, classes, prefix="student_")
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True)
    d = trainer_defaults()
    return (net, optimizer(net, d),
            KDLoss(d.temperature, d.alpha))


# -- produce: the offline producer, every batch logged --------------------------------------------------
def child_produce(a):
    """produce_offline (demand on or off) into the cache `python -m kdcache.cache_builder --cache PATH` would fill."""
    import kdcache.cache_builder.produce as produce
    from kdcache.cache_builder.options import parse_args as producer_args
    from kdcache.pipeline.cachespec import spec_from_args
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.teacher import check_fits, load_teacher
    from kdcache.store import CacheWriter
    args = producer_args(["--teacher", a.teacher, "--dataset", a.dataset, "--cache", a.cache, "--threads", "1",
                          "--batch-size", str(BATCH), "--seed", str(SEED), "--quiet"])
    topt = TeacherOptions.from_args(args)
    dataset = load_dataset(args.dataset, split="train")
    spec, augment = spec_from_args(args, dataset, topt)
    teacher = load_teacher(topt, BATCH)
    check_fits(teacher, dataset)  # as the command does: a forward before the loop (oneDNN's set-up)
    batches, chosen = [], [0]

    class Logged(produce.Demand):
        def take(self, is_done, n):
            keys = super().take(is_done, n)
            chosen[0] = keys.size
            return keys

    class Timed:
        def forward(self, x):
            t0 = time.perf_counter()
            out = teacher.forward(x)
            batches.append((round(t0 - start, 4), len(x), round(time.perf_counter() - t0, 5), chosen[0] > 0))
            chosen[0] = 0
            return out

    produce.Demand = Logged
    with CacheWriter(args.cache, spec) as writer:
        start, wall = time.perf_counter(), time.time()
        stats = produce.produce_offline(Timed(), dataset, writer, seed=SEED, augment=augment, batch_size=BATCH,
                                        progress=False, demand=a.demand == "on")
    if not writer.complete or stats.rows_written != len(dataset):
        raise RuntimeError(f"bench: the producer left {args.cache} incomplete ({stats})")
    print(json.dumps({"rows_written": stats.rows_written, "demand_rows": stats.demand_rows,
                      "loop_s": stats.seconds, "teacher_s": stats.teacher_seconds, "rows_per_s": stats.rows_per_s,
                      "loop_start_unix": wall, "fingerprint": spec.fingerprint, "batches": batch_summary(batches),
                      "batch_log": batches}))


def batch_summary(batches):
    """Teacher batches chosen by demand and in key order: count, rows, sizes, teacher seconds."""
    out = {}
    for kind, flag in (("demand", True), ("key_order", False)):
        b = [r for r in batches if r[3] == flag]
        rows = sum(r[1] for r in b)
        out[kind] = {"batches": len(b), "rows": rows, "teacher_s": round(sum(r[2] for r in b), 4),
                     "rows_per_batch": round(rows / len(b), 2) if b else None,
                     "batches_of_1_row": sum(1 for r in b if r[1] == 1),
                     "ms_per_row": round(1e3 * sum(r[2] for r in b) / rows, 4) if rows else None}
    return out


# -- train: a user's Gluon loop ----------------------------------------------------------------------
def measured_dataset():
    """SoftTargetDataset that adds each item's wait for its target to counters in shared memory, so a
    DataLoader worker's waits reach the main process (set up before the DataLoader forks its workers)."""
    from kdcache.trainer.softdata import SoftTargetDataset

    class Measured(SoftTargetDataset):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.stall = multiprocessing.RawValue(ctypes.c_double, 0.0)
            self.waited = multiprocessing.RawValue(ctypes.c_int64, 0)

        def __getitem__(self, idx):
            r = self.reader()
            s0 = r.stall_s
            item = super().__getitem__(idx)
            if r.stall_s > s0:
                self.stall.value += r.stall_s - s0
                self.waited.value += 1
            return item
    return Measured


def child_train(a):
    import mxnet as mx
    from mxnet import autograd, gluon
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.schedule import epoch_permutation
    from kdcache.store import CacheNotFoundError
    np.random.seed(SEED)  # DataLoader(shuffle=True) draws its order from numpy's global generator
    mx.random.seed(SEED)
    data = load_dataset(a.dataset, split="train")
    n = len(data)
    net, opt, loss_fn = student(data.num_classes)
    ctx = mx.cpu()
    x0 = mx.nd.array(np.stack([data[i][0] for i in range(BATCH)]))
    for _ in range(2):  # memory plans and oneDNN primitives, before the clock starts
        with autograd.record():
            loss = loss_fn(net(x0), mx.nd.zeros((BATCH, data.num_classes)), mx.nd.zeros(BATCH))
        loss.backward()
        float(loss.mean().asscalar())
    with open(a.ready, "w") as fh:
        fh.write("ready\n")
    Measured = measured_dataset()
    deadline = time.monotonic() + a.wait_s
    while True:  # the producer creates the cache once it has loaded its teacher
        try:
            ds = Measured(data, a.cache, seed=SEED, views=1, augment=None, timeout=600.0)
            break
        except CacheNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)
    kw = dict(batch_size=BATCH, num_workers=a.workers, last_batch="keep")
    items = ds
    if a.read == "batch":  # a prototype: targets read per batch in batchify_fn, one wait for its missing keys
        _BATCH_DS[:] = [ds]
        items, kw["batchify_fn"] = _Unlabelled(ds), batch_targets
    if a.order == "shuffle":
        loader = gluon.data.DataLoader(items, shuffle=True, **kw)
    elif a.order == "announce":
        loader = gluon.data.DataLoader(items, sampler=ds.sampler(), **kw)
    else:  # kdcache's schedule: epoch 0's batches of pipeline.schedule, flattened
        loader = gluon.data.DataLoader(items, sampler=_Fixed(epoch_permutation(SEED, 0, n)), **kw)
    ds.set_epoch(0)
    source0 = ds.reader().source
    wait_s, waits, arrived, seen = 0.0, [], [], 0
    start_unix, t0 = time.time(), time.perf_counter()
    it = iter(loader)
    while True:
        t1 = time.perf_counter()
        try:
            x, y, t = next(it)
        except StopIteration:
            break
        if isinstance(x, np.ndarray):  # from batch_targets
            x, y, t = mx.nd.array(x), mx.nd.array(y), mx.nd.array(t)
        x, y, t = (v.as_in_context(ctx) for v in (x, y, t))  # a worker's batches live in shared memory
        w = time.perf_counter() - t1
        wait_s += w
        waits.append(round(w, 4))
        arrived.append(round(t1 + w - t0, 4))
        with autograd.record():
            loss = loss_fn(net(x), t, y.astype("float32"))
        loss.backward()
        opt.step(x.shape[0])
        float(loss.mean().asscalar())
        seen += x.shape[0]
    epoch_s = time.perf_counter() - t0
    if seen != n:
        raise RuntimeError(f"bench: the epoch read {seen} samples of {n}")
    print(json.dumps({"epoch1_s": epoch_s, "stall_s": ds.stall.value, "items_waited": ds.waited.value,
                      "data_wait_s": wait_s, "first_batch_s": waits[0], "batch_waits": waits,
                      "batch_arrived_s": arrived, "samples": seen, "epoch_start_unix": start_unix,
                      "workers": a.workers, "order": a.order, "read": a.read, "reader_source_at_start": source0}))


class _Unlabelled:
    """The items of a SoftTargetDataset without their targets: (image, label, index)."""

    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        image, label = self.ds.dataset[int(i)][:2]
        return np.asarray(image, dtype=np.float32), label, int(i)


_BATCH_DS = []  # the data set batch_targets reads from; a worker inherits it when the DataLoader forks


def batch_targets(items):
    """A batchify_fn that reads a batch's targets with one CacheReader.get: a reader that waits publishes
    every missing key of the batch at once. Module-level (a worker process receives it pickled, by name);
    returns numpy arrays (a worker hands them back pickled)."""
    ds = _BATCH_DS[0]
    idx = np.array([it[2] for it in items], dtype=np.int64)
    r = ds.reader()
    s0, missing = r.stall_s, r.missing(idx, ds.view).size
    t = r.get(idx, ds.view)
    if r.stall_s > s0:
        ds.stall.value += r.stall_s - s0
        ds.waited.value += missing
    return np.stack([it[0] for it in items]), np.array([it[1] for it in items], dtype=np.float32), t


class _Fixed:
    """A sampler over a fixed order (DataLoader takes any iterable with a length)."""

    def __init__(self, order):
        self.order = [int(i) for i in order]

    def __iter__(self):
        return iter(self.order)

    def __len__(self):
        return len(self.order)


class Sizes(KdSizes):
    """JSON of reps, tries, epoch_s, min_steps, max_steps, target: counts >= 1, epoch_s and target > 0,
    min_steps <= max_steps."""

    KEYS = {**KdSizes.KEYS, "target": Float(0, None, gt=True)}


NEEDS = {"prepare": ("root", "sizes"), "produce": ("teacher", "dataset", "cache", "demand"),
         "train": ("dataset", "cache", "order", "workers", "ready", "read")}
OPTIONS = [
    Option("--root", "prepare: the benchmark's temporary directory", type=Dir(), metavar="DIR", group=RUN),
    Option("--sizes", "prepare: JSON of reps, tries, epoch_s, min_steps, max_steps, target", type=Sizes(),
           metavar="JSON", group=RUN),
    Option("--teacher", "produce: the teacher's checkpoint prefix", metavar="PREFIX", group=RUN),
    like(trainer_option("dataset"), "produce, train: the data set (a --dataset value of the trainer)", group=RUN),
    Option("--cache", "produce, train: the cache's path", type=OutFile(), metavar="PATH", group=RUN),
    Option("--demand", "produce: serve readers' demand first (on) or key order only (off)", choices=("on", "off"),
           group=RUN),
    Option("--order", "train: DataLoader(shuffle=True), DataLoader(sampler=ds.sampler()) or the schedule's order",
           choices=("shuffle", "announce", "schedule"), group=RUN),
    Option("--read", "train: targets read per item (SoftTargetDataset) or per batch (a batchify_fn)",
           choices=("item", "batch"), group=RUN),
    Option("--workers", "train: the DataLoader's worker processes", type=Int(0, 1), metavar="N", group=RUN),
    Option("--ready", "train: the file written once the loop is loaded", type=OutFile(), metavar="FILE", group=RUN),
    Option("--wait-s", "train: how long to wait for the cache to appear", type=Float(0, None, gt=True),
           default=300.0, metavar="S", group=RUN),
]


def main(argv=None):
    p, args = parse_args("python -m bench.demand.children", __doc__.split("\n\n")[0], OPTIONS, argv,
                         positionals=[("child", Choice(*NEEDS), "prepare | produce | train")])
    check_child(p, args, NEEDS)
    if args.child == "prepare":
        child_prepare(args.root, **args.sizes)
    elif args.child == "produce":
        child_produce(args)
    else:
        child_train(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
