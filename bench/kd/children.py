"""The KD benchmark's MXNet processes: calibrate and export the teachers, time them alone, and the inline_async loop.

    python -m bench.kd.children prepare --root DIR --sizes JSON
    python -m bench.kd.children async --teacher PREFIX --dataset SPEC [--epochs N] [--batch-size B] [--ctx C]

bench.kd starts both with one compute thread (bench.common.child_env); each prints one JSON line.
"""
import argparse
import json
import math
import os
import shutil
import statistics
import sys
import time

import numpy as np

from bench.cli import RUN, check_child, like, parse_args, trainer_option
from bench.kd.scenarios import BATCH, CLASSES, SEED, SHAPE, STUDENT, TARGETS
from kdcache.args import Allowed, Choice, Dir, Float, Int, Option, fail
from kdcache.pipeline.options import resolve_teacher

FIRST_SHAPE = {"light": (16, 0), "heavy": (40, 1)}  # the calibration's first guesses (width, extra convs)


def teacher_net(width, extra, prefix):
    """A VGG-style CNN: (Conv-BN-ReLU x2, MaxPool) at widths w, 2w, 4w, then `extra` more
    Conv-BN-ReLU at 4w (8x8), global average pool, Dense. Its compute is about w^2 (4 + extra)
    units; w stays a multiple of 8, since oneDNN's blocked layouts make other widths several
    times slower per FLOP."""
    from mxnet import gluon
    net = gluon.nn.HybridSequential(prefix=prefix)  # explicit: the same files every run
    with net.name_scope():
        for k in (1, 2, 4):
            for _ in range(2 + (extra if k == 4 else 0)):
                net.add(gluon.nn.Conv2D(width * k, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                        gluon.nn.Activation("relu"))
            net.add(gluon.nn.MaxPool2D(2))
        net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(CLASSES))
    return net


def teacher_cost(width, extra):
    """Relative forward cost of teacher_net(width, extra): FLOP units (the model calibration refines)."""
    return width * width * (4 + extra)


TEACHER_SHAPES = sorted(((w, e) for w in range(8, 129, 8) for e in range(0, 5)), key=lambda s: teacher_cost(*s))


def trainer_defaults():
    """The trainer's own defaults (optimiser, KD loss), so the loops here train as it does."""
    from kdcache.trainer.options import build_parser
    return build_parser().parse_args([])


def optimizer(net, d):
    """The trainer's optimiser with its defaults (its lr schedule aside: these loops measure speed)."""
    from mxnet import gluon
    return gluon.Trainer(net.collect_params(), d.optimizer, {"learning_rate": d.lr, "wd": d.wd, **(
        {"momentum": d.momentum} if d.optimizer in ("sgd", "nag") else {})})


def child_prepare(root, reps, tries, epoch_s, min_steps, max_steps):
    """Everything before the scenarios, in one process on one thread (an MXNet start-up costs
    seconds): calibrate and export the teachers, size the data set, and build the trainer's
    teacher-accuracy caches of the test split. Prints one JSON line."""
    out_dir = os.path.join(root, "teachers")
    os.makedirs(out_dir, exist_ok=True)
    cal = calibrate(out_dir, reps, tries)
    step_s = cal["student_step_ms"] / 1e3
    steps = int(min(max_steps, max(min_steps, round(epoch_s / step_s))))
    n = steps * BATCH
    dataset = f"synthetic:n={n},classes={CLASSES},shape={'x'.join(map(str, SHAPE))}"
    out = {**cal, "steps_per_epoch": steps, "n": n, "dataset": dataset, "test_cache": {}}
    for pair, c in cal["pairs"].items():
        out["test_cache"][pair] = test_split_cache(c["prefix"], dataset, os.path.join(root, pair, "caches-test"))
    print(json.dumps(out))


def test_split_cache(prefix, dataset_arg, cache_dir):
    """The cache of the test split the trainer reads its teacher's accuracy from, under the name the
    trainer looks up (trainer/train.py: build_spec(teacher, test, codec="full", dtype="float32")).
    Copied into each fresh cache directory before a run; otherwise the trainer would start a second
    producer for it, a third MXNet process on two cores, while it trains."""
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.pipeline.teacher_files import teacher_identity
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.teacher import Teacher
    from kdcache.store import CacheWriter, path_for
    test = load_dataset(dataset_arg, split="test")
    spec = build_spec(teacher_identity(prefix), test, codec="full", dtype="float32")
    teacher = Teacher(prefix, batch_size=BATCH)
    with CacheWriter(path_for(cache_dir, spec.fingerprint), spec) as w:
        for a in range(0, len(test), BATCH):
            idx = np.arange(a, min(len(test), a + BATCH))
            w.write(idx, teacher.forward(test.get_batch(idx)[0]))
    if not w.complete:
        raise RuntimeError(f"bench: the test-split cache in {cache_dir} is incomplete")
    return w.final


def calibrate(out_dir, reps, tries):
    """Time the student's training step and candidate teachers' forwards on one thread; export the
    light and heavy teachers whose forward/step ratios land nearest 1/3 and 2."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from kdcache.pipeline.teacher import Teacher
    from kdcache.trainer.loss import KDLoss
    from kdcache.trainer.models import get_model
    mx.random.seed(SEED)
    rng = np.random.default_rng(SEED)
    x = rng.random((BATCH,) + SHAPE, dtype=np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.float32)
    t = rng.standard_normal((BATCH, CLASSES), dtype=np.float32)

    # the student's step as trainer/train.py runs it: copy in, KD loss, backward, Adam, loss read back
    net = get_model(STUDENT, CLASSES, prefix="student_")
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True)
    d = trainer_defaults()
    opt = optimizer(net, d)
    loss_fn = KDLoss(d.temperature, d.alpha)

    def student_step():
        t0 = time.perf_counter()
        xs, ys, ts = mx.nd.array(x), mx.nd.array(y), mx.nd.array(t)
        with autograd.record():
            loss = loss_fn(net(xs), ts, ys)
        autograd.backward([loss])
        opt.step(BATCH)
        float(loss.sum().asscalar())
        return time.perf_counter() - t0

    def load_teacher(shape, pair, name):
        mx.random.seed(SEED)
        tn = teacher_net(*shape, f"kd{pair}_")
        tn.initialize(mx.init.Xavier())
        tn.hybridize()
        tn(mx.nd.array(x[:1])).wait_to_read()
        prefix = os.path.join(out_dir, name)
        tn.export(prefix, 0)
        teacher = Teacher(prefix, batch_size=BATCH)  # the runner the producer and inline mode use
        teacher.forward(x)
        return prefix, teacher, sum(int(np.prod(p.shape)) for p in tn.collect_params().values())

    def paired(teacher):
        """Median step and forward times, interleaved so machine noise hits both."""
        s, f = [], []
        for _ in range(reps):
            s.append(student_step())
            t0 = time.perf_counter()
            teacher.forward(x)
            f.append(time.perf_counter() - t0)
        return statistics.median(s), statistics.median(f)

    for _ in range(3):
        student_step()  # warm-up: memory plans, oneDNN primitives
    out = {"student": STUDENT, "batch": BATCH, "threads": int(os.environ.get("OMP_NUM_THREADS", 0) or 0),
           "num_gpus": mx.context.num_gpus(), "pairs": {}}
    steps_s = []
    for name, target in TARGETS.items():
        shape, seen, scale = FIRST_SHAPE[name], {}, None
        for _ in range(tries):
            prefix, teacher, params = load_teacher(shape, name, f"{name}-w{shape[0]}-x{shape[1]}")
            step_s, fwd_s = paired(teacher)
            steps_s.append(step_s)
            ratio = fwd_s / step_s
            seen[shape] = {"width": shape[0], "extra_convs": shape[1], "prefix": prefix, "forward_ms": 1e3 * fwd_s,
                           "step_ms": 1e3 * step_s, "ratio": ratio, "parameters": params}
            if abs(math.log(ratio / target)) < math.log(1.1):
                break
            scale = ratio / teacher_cost(*shape)  # ratio per cost unit, from the latest measurement
            nxt = min(TEACHER_SHAPES, key=lambda s: abs(math.log(scale * teacher_cost(*s) / target)))
            if nxt in seen:
                break
            shape = nxt
        best = min(seen.values(), key=lambda c: abs(math.log(c["ratio"] / target)))
        final = os.path.join(out_dir, name)
        for suffix in ("-symbol.json", "-0000.params"):
            shutil.copyfile(best["prefix"] + suffix, final + suffix)
        out["pairs"][name] = {**best, "prefix": final, "target": target, "tries": list(seen.values())}
    out["student_step_ms"] = 1e3 * statistics.median(steps_s)
    return out


def child_async(a):
    """Inline KD on MXNet's asynchronous engine: the teacher's forward of batch i+1 is issued before
    the student's step on batch i and never waited for; only the student's loss is read back each
    step, as trainer/train.py does. Same data, schedule, student, optimiser and KDLoss as the trainer."""
    import mxnet as mx
    from mxnet import autograd, gluon
    from kdcache.pipeline import load_dataset, make_views, schedule
    from kdcache.pipeline.augment import Augment
    from kdcache.pipeline.schedule import steps_per_epoch
    from kdcache.trainer.loss import KDLoss
    from kdcache.trainer.models import get_model
    from kdcache.trainer.train import resolve_ctx
    mx.random.seed(SEED)
    np.random.seed(SEED)
    ctx = resolve_ctx(a.ctx)[0]  # the door's Devices, as the trainer resolves them
    train = load_dataset(a.dataset, split="train")
    n = len(train)
    teacher = gluon.SymbolBlock.imports(a.teacher + "-symbol.json", ["data"], a.teacher + "-0000.params",
                                        ctx=mx.cpu())
    # The oneDNN graph fusion (conv+BN+ReLU) the executor of pipeline.teacher gets by default; without
    # it this teacher would run ~20% slower than inline's. Outputs of successive calls stay distinct.
    try:
        teacher.hybridize(backend="MKLDNN", static_alloc=True)
    except Exception:  # a build without oneDNN
        teacher.hybridize(static_alloc=True)
    from kdcache.pipeline.teacher import Teacher
    x0 = train.get_batch(np.arange(min(n, a.batch_size)))[0]
    ref = Teacher(a.teacher, batch_size=a.batch_size).forward(x0)
    if not np.allclose(teacher(mx.nd.array(x0)).asnumpy(), ref, rtol=1e-4, atol=1e-4):
        raise RuntimeError("bench: the async loop's teacher disagrees with pipeline.teacher on the first batch")
    net = get_model(a.student, train.num_classes, prefix="student_")
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize(static_alloc=True)
    d = trainer_defaults()
    opt = optimizer(net, d)
    loss_fn = KDLoss(d.temperature, d.alpha)
    net(mx.nd.array(train.get_batch([0])[0], ctx=ctx)).wait_to_read()
    augment = Augment()

    def issue(st):
        """The batch's inputs, and the teacher's forward queued on the engine (not waited for)."""
        x, y = make_views(train, st.indices, st.view, seed=SEED, augment=augment)
        xc = mx.nd.array(x, ctx=mx.cpu())
        t = teacher(xc)
        if ctx != mx.cpu():
            return st, xc.as_in_context(ctx), mx.nd.array(y.astype(np.float32), ctx=ctx), t.as_in_context(ctx)
        return st, xc, mx.nd.array(y.astype(np.float32)), t

    spe = steps_per_epoch(n, a.batch_size)
    steps = schedule(SEED, a.epochs, n, a.batch_size, 1)
    history, forwards, seen = [], 0, 0
    t0 = t_epoch = time.perf_counter()
    nxt = issue(next(steps))
    forwards += len(nxt[0].indices)
    while nxt is not None:
        st, x, y, t = nxt
        try:
            nxt = issue(next(steps))  # before the student's step: the engine may overlap the two
            forwards += len(nxt[0].indices)
        except StopIteration:
            nxt = None
        with autograd.record():
            loss = loss_fn(net(x), t, y)
        autograd.backward([loss])
        opt.step(x.shape[0])
        float(loss.sum().asscalar())  # the trainer reads its loss every step too
        seen += x.shape[0]
        if st.step == spe - 1:
            now = time.perf_counter()
            history.append({"epoch": st.epoch, "seconds": round(now - t_epoch, 3),
                            "samples_per_s": round(n / (now - t_epoch), 1)})
            t_epoch = now
    train_s = time.perf_counter() - t0
    print(json.dumps({"samples_per_s": round(seen / train_s, 1), "epoch1_s": history[0]["seconds"],
                      "stall_s": None, "teacher_forwards": forwards, "producer_started": False,
                      "history": history, "ctx": str(ctx),
                      "engine_workers": os.environ.get("MXNET_CPU_WORKER_NTHREADS", "1 (default)")}))


class Sizes(Allowed):
    """JSON of reps, tries, epoch_s, min_steps, max_steps: counts >= 1, epoch_s > 0, min_steps <= max_steps."""

    KEYS = {"reps": Int(1), "tries": Int(1), "epoch_s": Float(0, None, gt=True), "min_steps": Int(1),
            "max_steps": Int(1)}

    def __call__(self, s):
        try:
            v = json.loads(s)
        except ValueError:
            v = None
        if not isinstance(v, dict) or set(v) != set(self.KEYS):
            fail(f"{s!r}: use {self.allowed()}")
        out = {}
        for k, kind in self.KEYS.items():
            try:
                out[k] = kind(v[k])
            except argparse.ArgumentTypeError as e:
                fail(f"{k}: {e}")
        if out["min_steps"] > out["max_steps"]:
            fail(f"min_steps {out['min_steps']} is more than max_steps {out['max_steps']}")
        return out


NEEDS = {"prepare": ("root", "sizes"), "async": ("teacher", "dataset")}  # what each child reads
OPTIONS = [
    Option("--root", "prepare: the benchmark's temporary directory", type=Dir(), metavar="DIR", group=RUN),
    Option("--sizes", "prepare: JSON of reps, tries, epoch_s, min_steps, max_steps", type=Sizes(), metavar="JSON",
           group=RUN),
    Option("--teacher", "async: the teacher's checkpoint prefix", metavar="PREFIX", group=RUN),
    like(trainer_option("dataset"), "async: the data set (a --dataset value of the trainer)", group=RUN),
    like(trainer_option("student"), "async: the student network", group=RUN, default=STUDENT),
    like(trainer_option("epochs"), "async: epochs", group=RUN, default=1),
    like(trainer_option("batch_size"), "async: batch size", group=RUN, default=BATCH),
    like(trainer_option("ctx"), "async: cpu or gpu:0", group=RUN, default="cpu"),
]


def main(argv=None):
    p, args = parse_args("python -m bench.kd.children", __doc__.split("\n\n")[0], OPTIONS, argv,
                         positionals=[("child", Choice(*NEEDS), "prepare | async")])
    check_child(p, args, NEEDS)
    if args.teacher is not None:
        resolve_teacher(args, p)  # its checkpoint files are there and readable
    if args.child == "prepare":
        child_prepare(args.root, **args.sizes)
    else:
        child_async(args)
    return 0

if __name__ == "__main__":
    sys.exit(main())
