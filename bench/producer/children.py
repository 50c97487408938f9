"""The producer benchmark's MXNet processes: export its teacher, the bare teacher loop it is compared with,
and this core's float32 peak.

    python -m bench.producer.children export --teacher PREFIX
    python -m bench.producer.children bare --teacher PREFIX --dataset SPEC --batch-size B
    python -m bench.producer.children peak

bench.producer starts each with one compute thread (bench.common.child_env); each checks that its OpenMP
runtimes run one thread (bench.flops.one_thread) and prints one JSON line.
"""
import json
import statistics
import sys
import time

import numpy as np

from bench.cli import RUN, check, check_child, like, parse_args, trainer_option
from bench.flops import Meter, count_macs, measure_peak, one_thread
from kdcache.args import Choice, Option, OutFile
from kdcache.pipeline.options import resolve_teacher

CLASSES = 10
SHAPE = "3x32x32"
TEACHER_WIDTHS = (32, 32, 64, 64)  # ~30 ms per forward of 128 images on one thread here


def child_export(prefix):
    """Build the benchmark's teacher and export it: PREFIX-symbol.json, PREFIX-0000.params."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(0)
    np.random.seed(0)
    net = gluon.nn.HybridSequential(prefix="benchteacher_")  # explicit: same files every run
    with net.name_scope():
        for w in TEACHER_WIDTHS:
            net.add(gluon.nn.Conv2D(w, 3, padding=1, use_bias=False), gluon.nn.BatchNorm(),
                    gluon.nn.Activation("relu"), gluon.nn.MaxPool2D(2))
        net.add(gluon.nn.GlobalAvgPool2D(), gluon.nn.Dense(CLASSES))
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1,) + tuple(int(s) for s in SHAPE.split("x")))).wait_to_read()
    net.export(prefix, 0)
    params = sum(int(np.prod(p.shape)) for p in net.collect_params().values())
    # counted on the exported graph: what the producer loads and runs
    macs = count_macs(mx.sym.load(prefix + "-symbol.json"), {"data": (1, *(int(s) for s in SHAPE.split("x")))})
    print(json.dumps({"prefix": prefix, "parameters": params, "macs_per_image": macs}))


def child_bare(prefix, dataset_arg, batch):
    """The teacher alone over every sample in key order, the loop produce_offline runs minus the store.

    Set-up mirrors `python -m kdcache.cache_builder`: load the data set, load the teacher, one probe
    forward of two samples; then only the loop is timed, as produce_offline times its loop.
    """
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.datasets import load_dataset
    dataset = load_dataset(dataset_arg)
    teacher = Teacher(prefix, batch_size=batch)
    x, _ = dataset.get_batch([0, min(1, len(dataset) - 1)])
    teacher.forward(x)
    keys = np.arange(len(dataset), dtype=np.int64)  # views=1: flat key = sample index
    augment = Augment()
    threads = one_thread()
    views_s, forward_s = [], []
    meter = Meter().start()
    for a in range(0, keys.size, batch):
        idx = keys[a:a + batch]
        t1 = time.perf_counter()
        x, _ = make_views(dataset, idx, idx % 1, seed=0, augment=augment)
        t2 = time.perf_counter()
        teacher.forward(x)
        forward_s.append(time.perf_counter() - t2)
        views_s.append(t2 - t1)
    seconds = meter.stop().wall
    full = [t for t, a in zip(forward_s, range(0, keys.size, batch)) if keys.size - a >= batch] or forward_s
    print(json.dumps({"rows": int(keys.size), "seconds": seconds, "rows_per_s": keys.size / seconds,
                      "forward_ms_per_batch_median": 1e3 * statistics.median(full),
                      "forward_ms_per_batch_min": 1e3 * min(full),
                      "make_views_ms_per_batch_median": 1e3 * statistics.median(views_s),
                      "full_batches": len(full), "cores_used": meter.cores, "threads": threads}))


def child_peak():
    """This core's float32 peak (bench.flops.measure_peak), in a process with the teacher's threads."""
    import mxnet  # noqa: F401  (its OpenMP runtime is checked too)
    print(json.dumps({"threads": one_thread(), **measure_peak()}))


NEEDS = {"export": ("teacher",), "bare": ("teacher", "dataset", "batch_size"), "peak": ()}  # what each child reads
OPTIONS = [
    Option("--teacher", "the teacher's checkpoint prefix (export: where to write it)", metavar="PREFIX", group=RUN),
    like(trainer_option("dataset"), "bare: the data set (a --dataset value of the cache builder)", group=RUN),
    like(trainer_option("batch_size"), "bare: rows per forward", group=RUN),
]


def main(argv=None):
    p, args = parse_args("python -m bench.producer.children", __doc__.split("\n\n")[0], OPTIONS, argv,
                         positionals=[("child", Choice(*NEEDS), "export | bare | peak")])
    check_child(p, args, NEEDS)
    if args.child == "export":
        check(p, "--teacher", OutFile(), args.teacher)  # PREFIX-symbol.json, ... are written in its folder
        child_export(args.teacher)
    elif args.child == "peak":
        child_peak()
    else:
        resolve_teacher(args, p)  # its checkpoint files are there and readable
        child_bare(args.teacher, args.dataset, args.batch_size)
    return 0

if __name__ == "__main__":
    sys.exit(main())
