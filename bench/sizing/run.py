"""Sizing for ImageNet-1k: the measurements, the report and its tables (python -m bench.sizing)."""
import os
import sys

from bench.common import limit_threads

limit_threads(os.environ)  # one core, before MXNet loads: the unit the extrapolation multiplies

import time  # noqa: E402

from bench.common import (busy_warning, cpu_between, cpu_snapshot, heading, machine, for_the_manual,  # noqa: E402
    machine_line, make_log, md_table, section)
from bench.cli import out_option, quick_option  # noqa: E402
from bench.flops import (Meter, cpu_id, cpu_text, gflops_table, gluon_symbol, invalid_lines,  # noqa: E402
    macs_per_image, measure_peak, one_thread, peak_line, teacher_figures)
from kdcache.args import Float, Int, Option  # noqa: E402
from kdcache.store.format.codec import make_codec  # noqa: E402

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


def params(ap, args):
    return {"batch": 16, "seconds": 0.0 if args.quick else 8.0, "min_batches": 1 if args.quick else 3,
            "peak_repeats": 3 if args.quick else 5}


def run(kids, args, p, work):
    """Measured here, in this process on one thread: the unit the extrapolation multiplies."""
    batch, seconds, min_batches, peak_repeats = p["batch"], p["seconds"], p["min_batches"], p["peak_repeats"]
    sizes = {f"{codec}/{dtype}": make_codec(codec, IMAGENET_CLASSES, dtype).bytes_per_row for codec, dtype in CODECS}
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
    peak = max(peaks, key=lambda pk: pk["gflops"])
    threads_after = one_thread()
    log(f"peak {peak['gflops']:.1f} GFLOP/s ({peaks[0]['gflops']:.1f} before, {peaks[1]['gflops']:.1f} after)")
    rates = {}
    for name, m in measured.items():
        f = teacher_figures(name, INPUT, m["macs"]["macs"], m["images_per_s"], m["cores_used"], peak)
        r = m["images_per_s"]
        rates[name] = {"images_per_s_per_core": r, "batches_timed": m["batches_timed"],
                       "cores_to_feed_student": args.student_rate / r,
                       "cold_epoch_minutes_with_cores": IMAGENET_TRAIN / (args.cores * r) / 60, "mac_count": m["macs"],
                       **f}
    return {
        "bytes_per_row": sizes, "imagenet_train_images": IMAGENET_TRAIN, "classes": IMAGENET_CLASSES,
        "teachers": rates, "batch": batch, "seconds": seconds, "min_batches": min_batches,
        "student_rate": args.student_rate, "cores": args.cores,
        "peak": peak, "peaks_before_after": [pk["gflops"] for pk in peaks], "cpu": cpu,
        "threads": {"before": threads, "after": threads_after}, "cpu_during_teachers": busy,
        "valid": not invalid_lines(list(rates.values())), "machine": machine(mxnet=True, omp_num_threads=1),
        "quick": bool(args.quick)}


def sections(report):
    """[(title, table, note)]: what the benchmark prints, from its report."""
    n = report["imagenet_train_images"]
    t1 = md_table(["codec", "bytes per row", f"one view ({n:,} rows)", "10 views"],
                  [[f"`{key.rsplit('/', 1)[0]}`, {key.rsplit('/', 1)[1]}", f"{b:,}", size(b * n), size(10 * b * n)]
                   for key, b in report["bytes_per_row"].items()])
    n1 = ("Plus 1 byte per row for the `done` flag and a few KiB of HDF5 metadata in the finished file. "
          "`topk:K` keeps the K largest logits and the log-sum-exp of the rest (see the cache format).")
    rows = []
    for name, t in report["teachers"].items():
        rows.append([name, *(["INVALID"] * 3 if t["invalid"] else
                             [f"{t['images_per_s_per_core']:.1f}", f"{t['cores_to_feed_student']:,.0f}",
                              f"{t['cold_epoch_minutes_with_cores']:,.0f}"])])
    t2 = md_table(["teacher", "images/s per core (measured)",
                   f"producer cores to feed {report['student_rate']:,.0f} images/s",
                   f"cold epoch (one view) on {report['cores']} cores, minutes"], rows)
    timed = ("for one batch" if report["quick"] else
             f"for at least {report['seconds']:.0f} s and {report['min_batches']} batches")
    n2 = (f"Forward only, batch {report['batch']}, 224x224, one thread, random weights, hybridized; each teacher timed "
          f"{timed} after a warm-up batch. Cores needed = student images/s / teacher images/s per core: the "
          f"producer's overhead over the bare forward is a few percent and shards scale with cores (both measured by "
          f"bench.producer). Every later experiment on the same teacher, data and views reads "
          f"the cache and runs the teacher zero times.")
    t3 = gflops_table(list(report["teachers"].values()))
    omp = report["threads"]["before"]["omp_max_threads"]
    n3 = (peak_line(report["peak"], report["cpu"]) + " Multiply-adds counted by bench.flops from each network's "
          "symbol graph (Convolution with groups, FullyConnected; BatchNorm, activations, pooling and sums not "
          "counted). A figure above 1.1x the peak, or from a loop that used more than 1.1 cores, is INVALID. "
          f"OpenMP runtimes at one thread: {', '.join(f'{k} {v}' for k, v in omp.items())}.")
    return [("Bytes per view", t1, n1),
            ("Teacher throughput per CPU core, and producer cores to keep a student fed", t2, n2),
            ("Teachers against this core's peak", t3, n3)]


def show(report):
    print(heading("kdcache sizing for ImageNet-1k", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    for title, table, note in sections(report):
        print(section(title, table, note))
    warning = busy_warning(report["cpu_during_teachers"]["other_cores"], "the teacher runs")
    if warning:
        print(warning)
    print(for_the_manual(render(report)))
    invalid = invalid_lines(list(report["teachers"].values()))
    if invalid:  # the report keeps the evidence; the command fails
        print("error: per-core figures one core cannot have produced:\n" + "\n".join(invalid), file=sys.stderr)
        return 1
    return 0
