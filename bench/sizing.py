"""Sizing for ImageNet-1k: bytes per view per codec, teacher images/s per core, producer cores per student.

Teacher throughput per CPU core is measured here and extrapolated to the producer cores that
keep a student fed. Each teacher's rate is also given as GFLOP/s per core (2 x the multiply-adds
bench.flops counts from its symbol graph) beside this core's float32 peak, measured in the same
run; a figure one core cannot have produced is marked INVALID and the command fails (exit 1).

    PYTHONPATH=. python -m bench.sizing [--quick] [--student-rate 3000] [--cores 64]
                                        [--out bench/results/sizing.json]

Teachers: Gluon model-zoo networks with 1000 classes and random weights (speed does not depend
on the weights, and nothing is downloaded), forward only, one thread (OMP_NUM_THREADS=1, set
before MXNet is imported, and checked: every OpenMP runtime at one thread, and the timed loop's
CPU seconds over its wall seconds at most 1.1), batch 16 of 224x224 images, hybridized as the
producer runs them. Bytes per row come from the store's own codecs (store.codec), not from a formula typed here.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import limit_threads  # noqa: E402

limit_threads(os.environ)  # one core, before MXNet loads: the unit the extrapolation multiplies

import time  # noqa: E402

from bench.common import (BenchError, busy_warning, cpu_between, cpu_snapshot, heading, machine,  # noqa: E402
    for_the_manual, machine_line, make_log, md_table, section, utc_now, write_report)
from bench.cli import out_option, parse_args, quick_option  # noqa: E402
from bench.flops import (Meter, cpu_id, cpu_text, gflops_table, gluon_symbol, invalid_lines,  # noqa: E402
    macs_per_image, measure_peak, one_thread, peak_line, teacher_figures)
from kdcache.args import Float, Int, Option  # noqa: E402
from kdcache.store.codec import make_codec  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "sizing.json")
IMAGENET_TRAIN = 1_281_167
IMAGENET_CLASSES = 1000
INPUT = (3, 224, 224)
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


def render(report):
    """[(title, markdown table)]: bytes per view of each codec, then each teacher's throughput per core against the
    peak and the producer cores a student needs, from the JSON report alone."""
    n = report["imagenet_train_images"]
    rows = []
    for key, b in report["bytes_per_row"].items():
        codec, dtype = key.rsplit("/", 1)
        rows.append([f"`{codec}`, {dtype}", f"{b:,}", size(b * n), size(10 * b * n)])
    views = md_table(["codec", "bytes per row", f"one view ({n:,} rows)", "10 views"], rows, pad=False)
    rows = []
    for name, t in report["teachers"].items():
        rows.append([name, f"{t['gflop_per_image']:.2f}", *(["INVALID"] * 3 if t["invalid"] else
                     [f"{t['images_per_s_per_core']:.1f}", f"{t['gflops_per_core']:.1f}", f"{t['fraction_of_peak']:.2f}"]),
                     *(["INVALID"] * 2 if t["invalid"] else [f"{t['cores_to_feed_student']:,.0f}",
                                                              f"{t['cold_epoch_minutes_with_cores']:,.0f} min"]),
                     f"{t['cores_used']:.2f}"])
    pk = report["peak"]
    title = (f"Forward only, batch {report['batch']}, 224x224, one thread; measured peak {pk['gflops']:.1f} GFLOP/s per "
             f"core (float32 {pk['n']}x{pk['n']} matrix product, best of {pk['repeats']}, {pk['source']}; "
             + ", ".join(f"{g:.1f}" for g in report.get("peaks_before_after", [])) + " before and after the teachers):")
    teachers = md_table(["teacher", "GFLOP per image (2 x MACs)", "images/s per core", "GFLOP/s per core",
                         "fraction of the measured peak", f"producer cores for {report['student_rate']:,.0f} images/s",
                         f"cold epoch (one view) on {report['cores']} cores", "cores used"], rows, pad=False)
    return [("", views), (title, teachers)]


def teacher_rate(name, batch, seconds, min_batches):
    """One forward-only teacher on this thread (after one warm-up batch): its multiply-adds per image, its
    images/s over the timed loop and the cores that loop used (CPU s / wall s)."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision
    net = vision.get_model(name, classes=IMAGENET_CLASSES)
    net.initialize(mx.init.Xavier())
    macs = macs_per_image(gluon_symbol(net), INPUT)
    net.hybridize(static_alloc=True, static_shape=True)
    x = mx.nd.random.uniform(shape=(batch, *INPUT))
    net(x).wait_to_read()  # warm-up: shape inference, memory planning
    done, per_batch, meter = 0, [], Meter().start()
    while done < min_batches or time.perf_counter() - meter.wall0 < seconds:
        t0 = time.perf_counter()
        net(x).asnumpy()
        per_batch.append(time.perf_counter() - t0)
        done += 1
    meter.stop()
    return {"macs": macs, "images_per_s": done * batch / meter.wall, "batches_timed": done,
            "cores_used": meter.cores, "batch_s_min": min(per_batch)}


def main(argv=None):
    _, args = parse_args("python -m bench.sizing", __doc__.split("\n\n")[0], OPTIONS, argv, default_out=DEFAULT_OUT)
    t_start = time.perf_counter()
    batch = 16
    seconds, min_batches = (0.0, 1) if args.quick else (8.0, 3)
    peak_repeats = 3 if args.quick else 5

    rows = []
    sizes = {}
    for codec, dtype in CODECS:
        b = make_codec(codec, IMAGENET_CLASSES, dtype).bytes_per_row
        sizes[f"{codec}/{dtype}"] = b
        rows.append([f"`{codec}`, {dtype}", f"{b:,}", size(b * IMAGENET_TRAIN), size(10 * b * IMAGENET_TRAIN)])
    t1 = md_table(["codec", "bytes per row", "one view (1,281,167 rows)", "10 views"], rows)
    n1 = ("Plus 1 byte per row for the `done` flag and a few KiB of HDF5 metadata in the finished file. "
          "`topk:K` keeps the K largest logits and the log-sum-exp of the rest (see the cache format).")

    import mxnet  # noqa: F401  (the threads are checked in the runtimes it loads)
    threads = one_thread()
    cpu = cpu_id()
    log(f"peak: float32 matrix products on one thread, {cpu_text(cpu)}")
    peaks = [measure_peak(repeats=peak_repeats)]
    s0 = cpu_snapshot()
    measured = {}
    for name in TEACHERS:
        log(f"{name}: forward, batch {batch}, 224x224, 1 thread")
        measured[name] = teacher_rate(name, batch, seconds, min_batches)
        log(f"  {measured[name]['images_per_s']:.1f} images/s ({measured[name]['batches_timed']} batches, "
            f"{measured[name]['cores_used']:.2f} cores)")
    busy = cpu_between(s0, cpu_snapshot())
    peaks.append(measure_peak(repeats=peak_repeats))  # after too: a clock that moved shows here
    peak = max(peaks, key=lambda p: p["gflops"])
    threads_after = one_thread()
    log(f"peak {peak['gflops']:.1f} GFLOP/s ({peaks[0]['gflops']:.1f} before, {peaks[1]['gflops']:.1f} after)")

    figures = [teacher_figures(name, INPUT, m["macs"]["macs"], m["images_per_s"], m["cores_used"], peak)
               for name, m in measured.items()]
    rates = {}
    rows = []
    for f, (name, m) in zip(figures, measured.items()):
        r = m["images_per_s"]
        need, epoch_min = args.student_rate / r, IMAGENET_TRAIN / (args.cores * r) / 60
        rates[name] = {"images_per_s_per_core": r, "batches_timed": m["batches_timed"], "cores_to_feed_student": need,
                       "cold_epoch_minutes_with_cores": epoch_min, "mac_count": m["macs"], **f}
        rows.append([name, *(["INVALID"] * 3 if f["invalid"] else
                             [f"{r:.1f}", f"{need:,.0f}", f"{epoch_min:,.0f}"])])
    t2 = md_table(["teacher", "images/s per core (measured)",
                   f"producer cores to feed {args.student_rate:,.0f} images/s",
                   f"cold epoch (one view) on {args.cores} cores, minutes"], rows)
    n2 = (f"Forward only, batch {batch}, 224x224, one thread, random weights, hybridized; each teacher timed "
          f"{'for one batch' if args.quick else f'for at least {seconds:.0f} s and {min_batches} batches'} after a "
          f"warm-up batch. Cores needed = student images/s / teacher images/s per core: the producer's "
          f"overhead over the bare forward is a few percent and shards scale with cores (both measured by "
          f"bench.producer). Every later experiment on the same teacher, data and views reads "
          f"the cache and runs the teacher zero times.")
    t3 = gflops_table(figures)
    n3 = (peak_line(peak, cpu) + " Multiply-adds counted by bench.flops from each network's symbol graph "
          "(Convolution with groups, FullyConnected; BatchNorm, activations, pooling and sums not counted). "
          f"A figure above 1.1x the peak, or from a loop that used more than 1.1 cores, is INVALID. "
          f"OpenMP runtimes at one thread: {', '.join(f'{k} {v}' for k, v in threads['omp_max_threads'].items())}.")

    m = machine(mxnet=True, omp_num_threads=1)
    runtime = time.perf_counter() - t_start
    print(heading("kdcache sizing for ImageNet-1k", args.quick, runtime))
    print(machine_line(m) + "\n")
    print(section("Bytes per view", t1, n1))
    print(section("Teacher throughput per CPU core, and producer cores to keep a student fed", t2, n2))
    print(section("Teachers against this core's peak", t3, n3))
    warning = busy_warning(busy["other_cores"], "the teacher runs")
    if warning:
        print(warning)
    invalid = invalid_lines(figures)
    report = {
        "bytes_per_row": sizes, "imagenet_train_images": IMAGENET_TRAIN, "classes": IMAGENET_CLASSES,
        "teachers": rates, "batch": batch, "student_rate": args.student_rate, "cores": args.cores,
        "peak": peak, "peaks_before_after": [p["gflops"] for p in peaks], "cpu": cpu,
        "threads": {"before": threads, "after": threads_after}, "cpu_during_teachers": busy,
        "valid": not invalid, "machine": m, "quick": bool(args.quick), "runtime_s": runtime, "date": utc_now()}
    print(for_the_manual(render(report)))
    write_report(args.out, report)
    print(f"Report: {args.out}")
    if invalid:  # the report keeps the evidence; the command fails
        print("error: per-core figures one core cannot have produced:\n" + "\n".join(invalid), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
