"""Sizing for ImageNet-1k: bytes per view per codec, teacher images/s per core, producer cores per student.

Teacher throughput per CPU core is measured here and extrapolated to the producer cores that
keep a student fed.

    PYTHONPATH=. python -m bench.sizing [--quick] [--student-rate 3000] [--cores 64]
                                        [--out bench/results/sizing.json]

Teachers: Gluon model-zoo networks with 1000 classes and random weights (speed does not depend
on the weights, and nothing is downloaded), forward only, one thread (OMP_NUM_THREADS=1, set
before MXNet is imported), batch 16 of 224x224 images, hybridized as the producer runs them.
Bytes per row come from the store's own codecs (store.codec), not from a formula typed here.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import limit_threads  # noqa: E402

limit_threads(os.environ)  # one core, before MXNet loads: the unit the extrapolation multiplies

import time  # noqa: E402

from bench.common import (heading, machine, machine_line, make_log, md_table, section, utc_now,  # noqa: E402
    write_report)
from bench.cli import out_option, parse_args, quick_option  # noqa: E402
from kdcache.args import Float, Int, Option  # noqa: E402
from store.codec import make_codec  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "sizing.json")
IMAGENET_TRAIN = 1_281_167
IMAGENET_CLASSES = 1000
TEACHERS = ("resnet50_v1", "resnet18_v1", "mobilenet1.0")
CODECS = (("full", "float32"), ("full", "float16"), ("topk:10", "float16"), ("topk:5", "float16"))


OPTIONS = [
    quick_option("one timed batch per teacher (noisier)"),
    Option("--student-rate", "images/s the student trains at, to keep fed (default 3000: a mid-size GPU student)",
           type=Float(0, None, gt=True), default=3000.0, metavar="R", group="extrapolation"),
    Option("--cores", "producer cores for the cold-epoch time", type=Int(1), default=64, metavar="N",
           group="extrapolation"),
    out_option(DEFAULT_OUT),
]

log = make_log("bench.sizing")


def size(nbytes):
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def teacher_rate(name, batch, seconds, min_batches):
    """Images per second of one forward-only teacher on one thread (after one warm-up batch)."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision
    net = vision.get_model(name, classes=IMAGENET_CLASSES)
    net.initialize(mx.init.Xavier())
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.random.uniform(shape=(batch, 3, 224, 224))
    net(x).wait_to_read()  # warm-up: shape inference, memory planning
    done, t0 = 0, time.perf_counter()
    while done < min_batches or time.perf_counter() - t0 < seconds:
        net(x).asnumpy()
        done += 1
    return done * batch / (time.perf_counter() - t0), done


def main(argv=None):
    _, args = parse_args("python -m bench.sizing", __doc__.split("\n\n")[0], OPTIONS, argv, default_out=DEFAULT_OUT)
    t_start = time.perf_counter()
    batch = 16
    seconds, min_batches = (0.0, 1) if args.quick else (8.0, 3)

    rows = []
    sizes = {}
    for codec, dtype in CODECS:
        b = make_codec(codec, IMAGENET_CLASSES, dtype).bytes_per_row
        sizes[f"{codec}/{dtype}"] = b
        rows.append([f"`{codec}`, {dtype}", f"{b:,}", size(b * IMAGENET_TRAIN), size(10 * b * IMAGENET_TRAIN)])
    t1 = md_table(["codec", "bytes per row", "one view (1,281,167 rows)", "10 views"], rows)
    n1 = ("Plus 1 byte per row for the `done` flag and a few KiB of HDF5 metadata in the finished file. "
          "`topk:K` keeps the K largest logits and the log-sum-exp of the rest (see the cache format).")

    rates = {}
    for name in TEACHERS:
        log(f"{name}: forward, batch {batch}, 224x224, 1 thread")
        r, n = teacher_rate(name, batch, seconds, min_batches)
        rates[name] = {"images_per_s_per_core": r, "batches_timed": n}
        log(f"  {r:.1f} images/s ({n} batches)")
    rows = []
    for name in TEACHERS:
        r = rates[name]["images_per_s_per_core"]
        need = args.student_rate / r
        epoch_min = IMAGENET_TRAIN / (args.cores * r) / 60
        rates[name].update(cores_to_feed_student=need, cold_epoch_minutes_with_cores=epoch_min)
        rows.append([name, f"{r:.1f}", f"{need:,.0f}", f"{epoch_min:,.0f}"])
    t2 = md_table(["teacher", "images/s per core (measured)",
                   f"producer cores to feed {args.student_rate:,.0f} images/s",
                   f"cold epoch (one view) on {args.cores} cores, minutes"], rows)
    n2 = (f"Forward only, batch {batch}, 224x224, one thread, random weights, hybridized; each teacher timed "
          f"{'for one batch' if args.quick else f'for at least {seconds:.0f} s and {min_batches} batches'} after a "
          f"warm-up batch. Cores needed = student images/s / teacher images/s per core: the producer's "
          f"overhead over the bare forward is a few percent and shards scale with cores (both measured by "
          f"bench.producer). Every later experiment on the same teacher, data and views reads "
          f"the cache and runs the teacher zero times.")

    m = machine(mxnet=True, omp_num_threads=1)
    runtime = time.perf_counter() - t_start
    print(heading("kdcache sizing for ImageNet-1k", args.quick, runtime))
    print(machine_line(m) + "\n")
    print(section("Bytes per view", t1, n1))
    print(section("Teacher throughput per CPU core, and producer cores to keep a student fed", t2, n2))
    write_report(args.out, {
        "bytes_per_row": sizes, "imagenet_train_images": IMAGENET_TRAIN, "classes": IMAGENET_CLASSES,
        "teachers": rates, "batch": batch, "student_rate": args.student_rate, "cores": args.cores,
        "machine": m, "quick": bool(args.quick), "runtime_s": runtime,
        "date": utc_now()})
    print(f"Report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
