"""KD end to end: the student alone, inline KD, inline on MXNet's async engine, and kdcache (online, warm, ring).

    PYTHONPATH=. python -m bench.kd [--quick] [--out bench/results/kd.json] [--tmp DIR]

This process never imports MXNet; every MXNet process is a child with OMP_NUM_THREADS=1 (the
only knob that limits MXNet's compute threads, fixed before `import mxnet`). On this CPU-only
machine two devices are emulated by two cores: where the teacher and the student run apart
(kdcache's producer and trainer) each gets one core (`--threads 1 --producer-threads 1`);
where they run together (inline) they share the student's one core, as on one GPU.

Data: `synthetic` 3x32x32, 10 classes, sized from the measured student step so that one student
epoch takes about 10 s (--quick: 1.5 s); 2 epochs (--quick: 1). Student: `small_cnn`. Two teachers, exported here (explicit prefix,
fixed seed): a VGG-style CNN whose width (a multiple of 8) and depth are calibrated so that its
forward of a batch takes about 1/3 (light) or 2x (heavy) the student's training step on the same
batch, both on one thread; the measured ratios are printed.

Scenarios, for each pair, each with a fresh cache directory where one is used:
  student_only   python -m trainer --teacher-mode none: the limit any KD method can reach
  inline         --teacher-mode inline: teacher forward then student step, batch by batch
  inline_async   a loop here (same data, schedule, student, KDLoss) that issues the teacher's
                 forward of the next batch before the student's step and never waits for it:
                 MXNet's asynchronous engine may overlap them. One engine worker (the default):
                 the student's one core, like `inline`.
  inline_async_2w  the same with MXNET_CPU_WORKER_NTHREADS=2: the engine may run the teacher
                 and the student at once on two cores (the core budget of online/ring); informative,
                 one epoch, not in --quick
  online         --teacher-mode cache on a cold cache: the trainer starts the producer
  warm           a second experiment on the cache `online` completed: no teacher at all
  ring           --store ring: streamed through shared memory, nothing persisted
Floors use two more measurements of each pair: "teacher alone" (the producer's offline loop,
cache_builder.produce.produce_offline as `python -m cache_builder` runs it, filling the train
split into a fresh cache on one thread, in a process of its own: rows/s of the loop -> seconds
per epoch) and "student alone" (student_only's epoch 1).

Each trainer and producer is watched by a /proc poller (every 0.2 s: VmHWM of the trainer and
of its children), and the CPU time the other processes of the machine used meanwhile is recorded
(/proc/stat), so a report taken on a shared machine says how shared it was.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench.common import (ROOT, Children, busy_warning, child_env, floors_line, heading, machine,  # noqa: E402
                          machine_line, make_log, md_table, python_m, scratch_dir, spread, utc_now, verdict,
                          write_report)

DEFAULT_OUT = os.path.join("bench", "results", "kd.json")
PNG_NAME = "kd_online.png"
CLASSES = 10
SHAPE = (3, 32, 32)
BATCH = 128
STUDENT = "small_cnn"
THREADS = 1
SEED = 0
TARGETS = {"light": 1 / 3, "heavy": 2.0}  # teacher forward / student step, one thread each
FIRST_SHAPE = {"light": (16, 0), "heavy": (40, 1)}  # the calibration's first guesses (width, extra convs)

# Sizes: full run (~9 min on 2 idle cores) and --quick (~1.5-2 min: 14 MXNet processes' start-up).
FULL = dict(epoch_s=10.0, min_steps=30, max_steps=400, epochs=2, reps=7, tries=4)
QUICK = dict(epoch_s=1.5, min_steps=6, max_steps=40, epochs=1, reps=3, tries=1)
# inline_async_2w (informative) runs one epoch: inline methods run every epoch alike, and time is short.
ONE_EPOCH = {"inline_async_2w"}

SCENARIOS = ["student_only", "inline", "inline_async", "inline_async_2w", "online", "warm", "ring"]
REQUIRED = ["student_only", "inline", "inline_async", "online", "warm", "ring"]
# Run order per pair: student_only and warm side by side in time (their floor is the tightest).
ORDER = ["online", "warm", "student_only", "ring", "inline", "inline_async", "inline_async_2w"]

FLOORS = {"warm_vs_student_only": 0.97,           # warm samples/s >= 0.97 x student_only samples/s
          "epoch1_vs_slowest_stage": 1.10,        # online/ring epoch 1 <= 1.10 x max(teacher alone, student alone)
          "vs_inline_heavy": 1.5}                 # online/ring samples/s >= 1.5 x inline's, heavy pair
# Peak memory per role: the process started (the trainer) and a `cache_builder` below it.
RSS = {"role": "trainer", "roles": {"producer": "cache_builder"}}

log = make_log("bench.kd")


# -- children: calibration and the inline_async loop (MXNet imported only here) ---------------------
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
    from trainer.options import build_parser
    return build_parser().parse_args([])


def child_prepare(root, reps, tries, epoch_s, min_steps, max_steps):
    """Everything before the scenarios, in one process on one thread (an MXNet start-up costs
    seconds): calibrate and export the teachers, size the data set, time each teacher alone,
    and build the trainer's teacher-accuracy caches of the test split. Prints one JSON line."""
    out_dir = os.path.join(root, "teachers")
    os.makedirs(out_dir, exist_ok=True)
    cal = calibrate(out_dir, reps, tries)
    step_s = cal["student_step_ms"] / 1e3
    steps = int(min(max_steps, max(min_steps, round(epoch_s / step_s))))
    n = steps * BATCH
    dataset = f"synthetic:n={n},classes={CLASSES},shape={'x'.join(map(str, SHAPE))}"
    out = {**cal, "steps_per_epoch": steps, "n": n, "dataset": dataset, "alone": {}, "test_cache": {}}
    for pair, c in cal["pairs"].items():
        out["alone"][pair] = teacher_alone(c["prefix"], dataset, os.path.join(root, pair, "caches-offline"))
        out["test_cache"][pair] = test_split_cache(c["prefix"], dataset, os.path.join(root, pair, "caches-test"))
    print(json.dumps(out))


def teacher_alone(prefix, dataset_arg, cache_dir):
    """The producer's offline loop (cache_builder.produce.produce_offline, what `python -m
    cache_builder` runs) filling the train split into a fresh cache on this process's one thread:
    its rows/s, start-up excluded."""
    from cache_builder.produce import produce_offline
    from pipeline.augment import Augment
    from pipeline.cachespec import build_spec
    from pipeline.checkpoint import teacher_identity
    from pipeline.datasets import load_dataset
    from pipeline.teacher import Teacher
    from store import CacheWriter, path_for
    train = load_dataset(dataset_arg, split="train")
    spec = build_spec(teacher_identity(prefix), train, views=1, augment=Augment(), seed=SEED, codec="full",
                      dtype="float16")
    teacher = Teacher(prefix, batch_size=BATCH)
    teacher.forward(train.get_batch([0, 1])[0])  # the CLI's class check, before its loop
    teacher.forwards = 0
    with CacheWriter(path_for(cache_dir, spec.fingerprint), spec) as w:
        stats = produce_offline(teacher, train, w, seed=SEED, augment=Augment(), batch_size=BATCH, progress=False)
    if not w.complete or stats.rows_written != len(train):
        raise RuntimeError(f"bench: the offline producer left {cache_dir} incomplete ({stats})")
    return {"rows": stats.rows_written, "rows_per_s": stats.rows_per_s, "loop_s": stats.seconds,
            "teacher_s": stats.teacher_seconds, "epoch_s": len(train) / stats.rows_per_s}


def test_split_cache(prefix, dataset_arg, cache_dir):
    """The cache of the test split the trainer reads its teacher's accuracy from, under the name the
    trainer looks up (trainer/train.py: build_spec(teacher, test, codec="full", dtype="float32")).
    Copied into each fresh cache directory before a run; otherwise the trainer would start a second
    producer for it, a third MXNet process on two cores, while it trains."""
    from pipeline.cachespec import build_spec
    from pipeline.checkpoint import teacher_identity
    from pipeline.datasets import load_dataset
    from pipeline.teacher import Teacher
    from store import CacheWriter, path_for
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
    from pipeline.teacher import Teacher
    from trainer.loss import KDLoss
    from trainer.models import get_model
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
    opt = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": d.lr, "wd": d.wd})
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
    from pipeline import load_dataset, make_views, schedule
    from pipeline.augment import Augment
    from pipeline.schedule import steps_per_epoch
    from trainer.loss import KDLoss
    from trainer.models import get_model
    mx.random.seed(SEED)
    np.random.seed(SEED)
    ctx = mx.gpu(0) if a.ctx.startswith("gpu") else mx.cpu()
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
    from pipeline.teacher import Teacher
    x0 = train.get_batch(np.arange(min(n, a.batch_size)))[0]
    ref = Teacher(a.teacher, batch_size=a.batch_size).forward(x0)
    if not np.allclose(teacher(mx.nd.array(x0)).asnumpy(), ref, rtol=1e-4, atol=1e-4):
        raise RuntimeError("bench: the async loop's teacher disagrees with pipeline.teacher on the first batch")
    net = get_model(a.student, train.num_classes, prefix="student_")
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize(static_alloc=True)
    d = trainer_defaults()
    opt = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": d.lr, "wd": d.wd})
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


# -- one pair ----------------------------------------------------------------------------------------------
def trainer_argv(dataset, run_dir_root, run, epochs, *, mode, teacher=None, cache_dir=None, store=None, ctx=None):
    argv = python_m("trainer", "--dataset", dataset, "--student", STUDENT, "--epochs", epochs, "--batch-size", BATCH,
                    "--seed", SEED, "--threads", THREADS, "--producer-threads", THREADS, "--teacher-mode", mode,
                    "--quiet", "--json", "--runs-dir", run_dir_root, "--run", run)
    if teacher:
        argv += ["--teacher", teacher]
    if cache_dir:
        argv += ["--cache-dir", cache_dir]
    if store:
        argv += ["--store", store]
    if ctx:
        argv += ["--ctx", ctx]
    return argv


def read_json(path):
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return None


def startup_note(res, run_dir, steps):
    """Where the producer's start-up falls: epoch 1's start (from the trainer's timeline), the
    producer's first finished step, and the trainer's wait for its first batch."""
    tl = (read_json(os.path.join(run_dir, "timeline.json")) or {}).get("steps") or []
    ptl = (read_json(os.path.join(run_dir, "producer-timeline.json")) or {}).get("steps") or []
    if len(tl) < steps or not res.get("epoch1_s"):
        return {}
    epoch_start = tl[steps - 1][0] - res["epoch1_s"]
    out = {"epoch1_start_after_launch_s": round(epoch_start - res["_launched"], 3),
           "first_step_wait_s": round(tl[0][2], 3)}
    if ptl:
        out["producer_first_step_into_epoch1_s"] = round(ptl[0][0] - epoch_start, 3)
    return out


def run_pair(pair, prep, epochs, root, kids, ctx=None, scenarios=ORDER):
    """Every scenario of one teacher/student pair, each cache-mode run in a fresh cache directory
    that holds only the trainer's test-split cache. Returns {scenario: result}."""
    tag = pair + ("-" + ctx.replace(":", "") if ctx else "")
    base = os.path.join(root, tag)
    logs, runs = os.path.join(base, "logs"), os.path.join(base, "runs")
    for d in (logs, runs):
        os.makedirs(d, exist_ok=True)
    teacher = prep["pairs"][pair]["prefix"]
    dataset, steps = prep["dataset"], prep["steps_per_epoch"]
    env = child_env(THREADS)
    dirs = {k: os.path.join(base, "caches-" + k) for k in ("online", "ring")}
    for d in dirs.values():
        os.makedirs(d)
        shutil.copy2(prep["test_cache"][pair], d)

    out = {}
    for sc in scenarios:
        run = f"{tag}-{sc}"
        ep = 1 if sc in ONE_EPOCH else epochs
        if sc.startswith("inline_async"):
            workers = 2 if sc == "inline_async_2w" else None
            argv = python_m("bench.kd", "--child", "async", "--teacher", teacher, "--dataset", dataset, "--epochs", ep,
                            "--batch-size", BATCH, "--student", STUDENT, "--ctx", ctx or "cpu")
            e = child_env(THREADS, **({"MXNET_CPU_WORKER_NTHREADS": workers} if workers else {}))
            res = kids.run(argv, f"{tag} {sc}", env=e, log_dir=logs, cwd=base, rss=RSS)
        else:
            kw = {"student_only": dict(mode="none"),
                  "inline": dict(mode="inline", teacher=teacher),
                  "online": dict(mode="cache", teacher=teacher, cache_dir=dirs["online"]),
                  "warm": dict(mode="cache", teacher=teacher, cache_dir=dirs["online"]),
                  "ring": dict(mode="cache", teacher=teacher, cache_dir=dirs["ring"], store="ring")}[sc]
            res = kids.run(trainer_argv(dataset, runs, run, ep, ctx=ctx, **kw), f"{tag} {sc}", env=env,
                           log_dir=logs, cwd=base, rss=RSS)
            run_dir = os.path.join(runs, run)
            res["run_dir"] = run_dir
            res["history"] = (read_json(os.path.join(run_dir, "metrics.json")) or {}).get("history")
            res["test_producer_started"] = os.path.exists(os.path.join(run_dir, "producer-test.log"))
            if res["test_producer_started"]:
                log(f"    warning: {run} started a producer for the test split (a third process)")
            if sc in ("online", "ring"):
                res["startup"] = startup_note(res, run_dir, steps)
        res["epochs"] = ep
        out[sc] = res
        log(f"  {pair} {sc}: {res['samples_per_s']:.0f} samples/s, epoch 1 {res['epoch1_s']:.2f} s, stall "
            f"{res['stall_s'] if res['stall_s'] is not None else '-'} s, teacher forwards {res['teacher_forwards']}, "
            f"peak RSS {res['_peak_rss_mib']} MiB, {res['_cpu']['tree_cores'] or 0:.2f} cores used, other "
            f"processes {res['_cpu']['other_cores'] or 0:.2f} cores ({res['_wall_s']:.1f} s wall)")
    return out


def result_rows(pair, runs, section):
    so = runs["student_only"]["samples_per_s"]
    rows = []
    for sc in SCENARIOS:
        r = runs.get(sc)
        if r is None:
            continue
        rows.append({"pair": pair, "scenario": sc, "section": section, "samples_per_s": r["samples_per_s"],
                     "ratio_to_student_only": round(r["samples_per_s"] / so, 4) if so else None,
                     "epoch1_s": r["epoch1_s"], "epoch2_s": _epoch_s(r, 1), "epochs": r["epochs"],
                     "stall_s": r["stall_s"], "peak_rss_mib": r["_peak_rss_mib"],
                     "teacher_forwards": r["teacher_forwards"], "producer_started": r.get("producer_started"),
                     "wall_s": round(r["_wall_s"], 3), "cpu_cores_used": _round(r["_cpu"]["tree_cores"]),
                     "other_processes_cores": _round(r["_cpu"]["other_cores"]),
                     "loadavg_1m": [r["_cpu"]["loadavg_1m_start"], r["_cpu"]["loadavg_1m_end"]],
                     "history": r.get("history"), "startup": r.get("startup"),
                     "engine_workers": r.get("engine_workers"),
                     "test_producer_started": r.get("test_producer_started", False)})
    return rows


def _epoch_s(r, i):
    h = r.get("history") or []
    return h[i]["seconds"] if len(h) > i else None


def _round(v, d=3):
    return None if v is None else round(v, d)


def pair_table(rows):
    def mib(d, k):
        return f"{d[k]:.0f}" if d and d.get(k) else "-"
    return md_table(
        ["scenario", "epochs", "samples/s", "ratio to student_only", "epoch-1 s", "epoch-2 s", "stall s", "cores used",
         "peak RSS trainer MiB", "peak RSS producer MiB", "teacher forwards", "other procs (cores)"],
        [[r["scenario"], r["epochs"], f"{r['samples_per_s']:.0f}", f"{r['ratio_to_student_only']:.3f}",
          f"{r['epoch1_s']:.2f}", "-" if r["epoch2_s"] is None else f"{r['epoch2_s']:.2f}",
          "-" if r["stall_s"] is None else f"{r['stall_s']:.2f}", f"{r['cpu_cores_used'] or 0:.2f}",
          mib(r["peak_rss_mib"], "trainer"), mib(r["peak_rss_mib"], "producer"), r["teacher_forwards"],
          f"{r['other_processes_cores'] or 0:.2f}"] for r in rows])


# -- floors ------------------------------------------------------------------------------------------------
def floors(by, alone):
    """Every floor's measured value, limit and verdict (PASS/MISS), for the CPU section."""
    out = []
    for pair in TARGETS:
        so, warm = by[pair]["student_only"], by[pair]["warm"]
        v = warm["samples_per_s"] / so["samples_per_s"]
        out.append({"floor": "warm_vs_student_only", "pair": pair, "measured": round(v, 4),
                    "limit": f">= {FLOORS['warm_vs_student_only']}",
                    "verdict": verdict(v, FLOORS["warm_vs_student_only"]),
                    "compares": "samples/s of warm / samples/s of student_only"})
        slowest = max(alone[pair]["epoch_s"], so["epoch1_s"])
        stage = "teacher" if alone[pair]["epoch_s"] >= so["epoch1_s"] else "student"
        for sc in ("online", "ring"):
            r = by[pair][sc]
            v = r["epoch1_s"] / slowest
            wait0 = (r.get("startup") or {}).get("first_step_wait_s")
            out.append({"floor": f"{sc}_epoch1_vs_slowest_stage", "pair": pair, "measured": round(v, 4),
                        "limit": f"<= {FLOORS['epoch1_vs_slowest_stage']}",
                        "verdict": verdict(v, FLOORS["epoch1_vs_slowest_stage"], higher_is_better=False),
                        "compares": f"epoch-1 s of {sc} ({r['epoch1_s']:.2f}, start-up inside) / slowest stage "
                                    f"alone ({stage}: {slowest:.2f} s)",
                        # informative: the same without the first step's wait for the producer's start-up
                        "startup_wait_s": wait0,
                        "measured_without_startup_wait": None if wait0 is None else
                        round((r["epoch1_s"] - wait0) / slowest, 4)})
    inline = by["heavy"]["inline"]
    s_, t_ = by["heavy"]["student_only"]["epoch1_s"], alone["heavy"]["epoch_s"]
    for sc in ("online", "ring"):
        r = by["heavy"][sc]
        v = r["samples_per_s"] / inline["samples_per_s"]
        e1 = inline["epoch1_s"] / r["epoch1_s"]
        # The best any pipeline can do from the stages' own times: inline pays student + teacher every
        # epoch; the ring pays the slower stage every epoch; the cache pays it once, then the student.
        e = r["epochs"]
        ideal = e * (s_ + t_) / (e * max(s_, t_) if sc == "ring" else max(s_, t_) + (e - 1) * s_)
        out.append({"floor": f"{sc}_vs_inline_heavy", "pair": "heavy", "measured": round(v, 4),
                    "limit": f">= {FLOORS['vs_inline_heavy']}", "verdict": verdict(v, FLOORS["vs_inline_heavy"]),
                    "compares": f"samples/s of {sc} / samples/s of inline, over {e} epoch(s) of training time "
                                f"(epoch-1 time of inline / of {sc}: {e1:.3f}; ideal from the stages alone, no "
                                f"start-up: {ideal:.3f})",
                    "epoch1_ratio": round(e1, 4), "ideal_from_stages": round(ideal, 4)})
    return out


def floors_table(fl):
    def aside(f):
        if f.get("measured_without_startup_wait") is None:
            return ""
        return f"{f['measured_without_startup_wait']:.3f} (first wait {f['startup_wait_s']:.2f} s)"
    return md_table(["floor", "pair", "measured", "limit", "verdict", "without start-up wait", "compares"],
                    [[f["floor"], f["pair"], f"{f['measured']:.3f}", f["limit"], f["verdict"], aside(f), f["compares"]]
                     for f in fl])


# -- the plot ----------------------------------------------------------------------------------------------
def plot_online(res, out_png, title, steps):
    """The producer's and the trainer's schedule positions over time, the trainer's stalls shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    run_dir = res["run_dir"]
    tl = (read_json(os.path.join(run_dir, "timeline.json")) or {}).get("steps") or []
    ptl = (read_json(os.path.join(run_dir, "producer-timeline.json")) or {}).get("steps") or []
    if not tl:
        raise RuntimeError(f"bench: {run_dir}/timeline.json is missing or empty: nothing to plot")
    t0 = res["_launched"]
    tt = np.array([s[0] for s in tl]) - t0
    tp = np.array([s[1] for s in tl]) + 1
    wait = np.array([s[2] for s in tl])
    hist = res.get("history") or []
    # epoch e started its last step's time minus its duration (evaluation and checkpoints lie between)
    starts = [tt[(e + 1) * steps - 1] - h["seconds"] for e, h in enumerate(hist) if (e + 1) * steps <= len(tt)]
    fig, (ax, ax2) = plt.subplots(2, 1, sharex=True, figsize=(9, 6.5), dpi=110, gridspec_kw={"height_ratios": [3, 1]})
    # a step's wait came right before its compute: [end of the previous step, or its epoch's start, + wait]
    prev = np.concatenate([[tt[0] - wait[0]], tt[:-1]])
    for e, a in enumerate(starts):
        prev[e * steps] = a
    merged = []
    for a, w in zip(prev, wait):
        if w <= 1e-3:
            continue
        if merged and a <= merged[-1][1] + 1e-3:
            merged[-1][1] = max(merged[-1][1], a + w)
        else:
            merged.append([a, a + w])
    for i, (a, b) in enumerate(merged):
        ax.axvspan(a, b, color="tab:red", alpha=0.15, lw=0,
                   label=f"trainer waits for targets (> 1 ms; {wait.sum():.1f} s in all)" if i == 0 else None)
    if ptl:
        pt = np.array([s[0] for s in ptl]) - t0
        pp = np.array([s[1] for s in ptl]) + 1
        ax.step(np.concatenate([[pt[0]], pt]), np.concatenate([[0], pp]), where="post", color="tab:blue", lw=4,
                alpha=0.45, label=f"producer (teacher, 1 core): steps done ({int(sum(s[2] for s in ptl))} rows "
                                  f"computed)")
    epochs_txt = ", ".join(f"epoch {e + 1} {h['seconds']:.1f} s" for e, h in enumerate(hist))
    ax.step(np.concatenate([[tt[0]], tt]), np.concatenate([[0], tp]), where="post", color="tab:green", lw=1.4,
            label=f"trainer (student, 1 core): steps done ({epochs_txt})")
    for e, a in enumerate(starts):
        for axis in (ax, ax2):
            axis.axvline(a, color="0.4", ls="--", lw=1, label="epoch starts" if e == 0 and axis is ax else None)
        ax.annotate(f"epoch {e + 1}", (a, 1), xycoords=("data", "axes fraction"), xytext=(3, -12),
                    textcoords="offset points", fontsize=8, color="0.3")
    ax2.bar(prev, wait, width=np.maximum(wait, 0.05), align="edge", color="tab:red", alpha=0.7)
    ax2.set_ylabel("wait before\neach step (s)")
    ax2.set_xlabel("seconds since the trainer was launched")
    ax2.grid(alpha=0.3)
    ax.set_ylabel("schedule steps done (batches of %d)" % BATCH)
    ax.set_title(title, fontsize=10)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
    tmp = out_png + ".tmp.png"
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, out_png)


# -- main --------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="python -m bench.kd",
        description="kdcache end to end: student alone, inline KD, inline on the async engine, and the cache "
                    "(online, warm, ring) with a light and a heavy teacher, one core each. Prints markdown tables, "
                    "writes a JSON report and a plot of the heavy pair's online run.")
    ap.add_argument("--quick", action="store_true", help="a data set of a few seconds per epoch (figures noisier)")
    ap.add_argument("--out", default=DEFAULT_OUT, help=f"JSON report path (default {DEFAULT_OUT})")
    ap.add_argument("--png", default=None, help=f"plot path (default: {PNG_NAME} beside --out)")
    ap.add_argument("--tmp", default=None, help="directory for teachers, caches and runs (default: the system temp "
                                                "dir); everything written there is removed")
    ap.add_argument("--keep", action="store_true", help="keep the temporary directory (runs, logs) for inspection")
    ap.add_argument("--child", choices=["prepare", "async"], help=argparse.SUPPRESS)
    ap.add_argument("--teacher", help=argparse.SUPPRESS)
    ap.add_argument("--dataset", help=argparse.SUPPRESS)
    ap.add_argument("--student", default=STUDENT, help=argparse.SUPPRESS)
    ap.add_argument("--epochs", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--batch-size", type=int, default=BATCH, help=argparse.SUPPRESS)
    ap.add_argument("--ctx", default="cpu", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child == "prepare":
        child_prepare(args.root, **json.loads(args.sizes))
        return 0
    if args.child == "async":
        child_async(args)
        return 0

    p = QUICK if args.quick else FULL
    png = args.png or os.path.join(os.path.dirname(os.path.abspath(args.out)), PNG_NAME)
    m = machine(mxnet=True, omp_num_threads=THREADS)  # what every MXNet child runs with
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    root = scratch_dir(args.tmp, "kdcache-bench-kd-")
    kids = Children()
    try:
        log(f"{'quick' if args.quick else 'full'} run, temp dir {root}, load average {load_start[0]:.2f} "
            f"{load_start[1]:.2f} {load_start[2]:.2f}")
        log("calibrating the teachers against the student's step, sizing the data set, timing each teacher alone "
            "(one process, 1 thread)")
        sizes = {k: p[k] for k in ("reps", "tries", "epoch_s", "min_steps", "max_steps")}
        prep = kids.run(python_m("bench.kd", "--child", "prepare", "--root", root, "--sizes", json.dumps(sizes)),
                        "prepare", env=child_env(THREADS), log_dir=root, cwd=root, rss=RSS)
        n, steps, dataset, epochs = prep["n"], prep["steps_per_epoch"], prep["dataset"], p["epochs"]
        alone = prep["alone"]
        for pair, c in prep["pairs"].items():
            log(f"  {pair}: width {c['width']} + {c['extra_convs']} convs, forward {c['forward_ms']:.1f} ms vs "
                f"student step {c['step_ms']:.1f} ms per batch of {BATCH}: ratio {c['ratio']:.3f} (target "
                f"{c['target']:.3f}); teacher alone {alone[pair]['rows_per_s']:.0f} rows/s = "
                f"{alone[pair]['epoch_s']:.2f} s per epoch")
        log(f"data set {dataset}: {steps} steps of {BATCH} per epoch (~{steps * prep['student_step_ms'] / 1e3:.1f} s "
            f"of student), {epochs} epoch(s)")
        scenarios = [sc for sc in ORDER if sc in REQUIRED or not args.quick]

        by = {}
        for pair in TARGETS:
            log(f"pair {pair}")
            by[pair] = run_pair(pair, prep, epochs, root, kids, scenarios=scenarios)
        gpu = {"skipped": True, "reason": "MXNet sees no GPU (mxnet.context.num_gpus() == 0): CPU-only machine",
               "results": []}
        if prep.get("num_gpus", 0) > 0:
            gpu = {"skipped": False, "reason": None, "ctx": "gpu:0", "results": [], "error": None}
            try:
                for pair in TARGETS:
                    log(f"GPU section, pair {pair} (student on gpu:0, teacher on the CPU)")
                    runs = run_pair(pair, prep, epochs, root, kids, ctx="gpu:0", scenarios=scenarios)
                    gpu["results"] += result_rows(pair, runs, "gpu")
            except RuntimeError as e:  # keep the CPU section's report; the exit status says it failed
                gpu["error"] = str(e)
                log(f"GPU section failed: {e}")
        else:
            log("GPU section skipped: MXNet sees no GPU")
        heavy_online = by["heavy"]["online"]
        plot_online(heavy_online, png,
                    f"kdcache online, heavy teacher (forward {prep['pairs']['heavy']['ratio']:.2f}x the student's "
                    f"step), cold cache: {n} samples, batch {BATCH}, 1 core each", steps)
    finally:
        kids.stop_all()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    runtime = time.perf_counter() - t_start
    load_end = os.getloadavg()

    results = [row for pair in TARGETS for row in result_rows(pair, by[pair], "cpu")]
    fl = floors(by, alone)
    calibration = {"student": STUDENT, "batch": BATCH, "threads": THREADS,
                   "student_step_ms": round(prep["student_step_ms"], 2),
                   "pairs": {k: {"width": v["width"], "extra_convs": v["extra_convs"], "forward_ms": round(v["forward_ms"], 2),
                                 "student_step_ms": round(v["step_ms"], 2), "ratio": round(v["ratio"], 4),
                                 "target": round(v["target"], 4), "teacher_parameters": v["parameters"],
                                 "tries": [{k2: (round(x, 4) if isinstance(x, float) else x) for k2, x in t.items()
                                            if k2 != "prefix"} for t in v["tries"]]}
                             for k, v in prep["pairs"].items()}}
    stages = {pair: {"teacher_alone_rows_per_s": round(alone[pair]["rows_per_s"], 1),
                     "teacher_alone_epoch_s": round(alone[pair]["epoch_s"], 3),
                     "teacher_alone_loop_s": round(alone[pair]["loop_s"], 3),
                     "teacher_alone_forward_s": round(alone[pair]["teacher_s"], 3),
                     "student_alone_epoch1_s": by[pair]["student_only"]["epoch1_s"]} for pair in TARGETS}
    others = spread(r["other_processes_cores"] for r in results)
    report = {
        "results": results,
        "floors": {f"{f['floor']}:{f['pair']}": f for f in fl},
        "all_pass": all(f["verdict"] == "PASS" for f in fl),
        "calibration": calibration,
        "stages": stages,
        "startup": {pair: {sc: by[pair][sc].get("startup") for sc in ("online", "ring")} for pair in TARGETS},
        "settings": {"dataset": dataset, "n": n, "steps_per_epoch": steps, "epochs": epochs, "batch": BATCH,
                     "student": STUDENT, "threads_per_process": THREADS, "seed": SEED,
                     "inline_async": {"omp_num_threads": THREADS, "mxnet_cpu_worker_nthreads": 1},
                     "inline_async_2w": {"omp_num_threads": THREADS, "mxnet_cpu_worker_nthreads": 2}},
        "gpu": gpu,
        "load": {"loadavg_start": [round(v, 2) for v in load_start], "loadavg_end": [round(v, 2) for v in load_end],
                 "other_processes_cores_mean": _round(others["mean"]),
                 "other_processes_cores_max": _round(others["max"])},
        "machine": m,
        "date": utc_now(),
        "quick": bool(args.quick),
        "runtime_s": round(runtime, 1),
        "plot": os.path.relpath(png, ROOT) if os.path.abspath(png).startswith(ROOT + os.sep) else png,
    }

    print(heading("kdcache KD benchmark", args.quick, runtime))
    print(machine_line(m))
    print(f"load average (1/5/15 min): {' '.join(f'{v:.2f}' for v in load_start)} at the start, "
          f"{' '.join(f'{v:.2f}' for v in load_end)} at the end; other processes kept "
          f"{report['load']['other_processes_cores_mean'] or 0:.2f} cores busy on average during the runs "
          f"(worst {report['load']['other_processes_cores_max'] or 0:.2f}) of {os.cpu_count()}\n")
    print(f"Data: {dataset}, batch {BATCH}, {steps} steps per epoch, {epochs} epoch(s); student {STUDENT}; "
          f"every MXNet process OMP_NUM_THREADS={THREADS}.\n")
    print("## Calibration (one thread, batch of %d)\n" % BATCH)
    print(md_table(["pair", "teacher width + extra convs", "teacher params", "teacher forward ms", "student step ms",
                    "ratio (measured)", "target", "teacher alone rows/s", "teacher alone epoch s",
                    "student alone epoch-1 s"],
                   [[pair, f"{c['width']} + {c['extra_convs']}", f"{c['teacher_parameters']:,}", f"{c['forward_ms']:.1f}",
                     f"{c['student_step_ms']:.1f}", f"{c['ratio']:.3f}", f"{c['target']:.3f}",
                     f"{stages[pair]['teacher_alone_rows_per_s']:.0f}", f"{stages[pair]['teacher_alone_epoch_s']:.2f}",
                     f"{stages[pair]['student_alone_epoch1_s']:.2f}"] for pair, c in calibration["pairs"].items()]))
    print("\nTeacher: (Conv-BN-ReLU x2, MaxPool) at widths w, 2w, 4w with the extra Conv-BN-ReLU at 4w, global "
          "average pool, Dense(10); forward via "
          "pipeline.teacher (the producer's and inline mode's runner). Teacher alone: the producer's offline loop "
          "(cache_builder.produce.produce_offline) filling the train split into a fresh cache, 1 thread, nothing "
          "else running: rows/s of the loop (start-up excluded).\n")
    for pair in TARGETS:
        rows = [r for r in results if r["pair"] == pair]
        print(f"## {pair} teacher (forward {calibration['pairs'][pair]['ratio']:.2f}x the student's step)\n")
        print(pair_table(rows))
        st = report["startup"][pair]
        notes = []
        for sc in ("online", "ring"):
            s = st.get(sc) or {}
            if s:
                notes.append(f"{sc}: epoch 1 began {s['epoch1_start_after_launch_s']:.1f} s after launch; its first step "
                             f"waited {s['first_step_wait_s']:.2f} s for the producer's start-up (inside epoch1_s)"
                             + (f"; the producer finished its first step {s['producer_first_step_into_epoch1_s']:.2f} s "
                                f"into epoch 1" if "producer_first_step_into_epoch1_s" in s else ""))
        print("\n" + "; ".join(notes) + ".\n")
    print("samples/s: training time only (epochs; set-up, evaluation and checkpoints excluded). epoch-1 s: the "
          "trainer's epoch1_s; for online and ring it includes whatever of the producer's start-up (MXNet import, "
          "teacher load) the trainer's own set-up did not cover. stall s: the trainer's wait for batches/targets "
          "(not measured in inline_async). cores used: CPU time of the process tree / its wall time. "
          "inline_async: MXNET_CPU_WORKER_NTHREADS unset (1 engine worker); inline_async_2w: 2 workers, so the "
          "engine may use both cores (the budget of online/ring, not of inline). Peak RSS: VmHWM sampled every "
          "0.2 s.\n")
    print("## Floors\n")
    print(floors_table(fl) + "\n")
    warning = busy_warning(others["max"], "a scenario")
    if warning:
        print(warning)
    print("## GPU section\n")
    if gpu["skipped"]:
        print(f"skipped: {gpu['reason']}\n")
    elif gpu.get("error"):
        print(f"failed: {gpu['error'][-2000:]}\n")
    else:
        for pair in TARGETS:
            print(f"### {pair} teacher, student on gpu:0, teacher on the CPU\n")
            print(pair_table([r for r in gpu["results"] if r["pair"] == pair]) + "\n")
    missed = [f"{f['floor']} ({f['pair']})" for f in fl if f["verdict"] != "PASS"]
    print(floors_line(missed))
    write_report(args.out, report)
    print(f"Report: {args.out}\nPlot: {png}")
    return 1 if gpu.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
