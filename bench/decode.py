"""Photos from files at 224 px: decode ms per image, and the producer's images/s with decode workers against the teacher alone.

    PYTHONPATH=. python -m bench.decode [--quick] [--out bench/results/decode.json]

The photos: PHOTOS JPEGs of 300-500 px made from real photographs available offline: the colour
JPEGs of the Debian package opencv-doc (/usr/share/doc/opencv-doc/examples/data/*.jpg) and the
two scikit-learn ships (china.jpg, flower.jpg). Photo i is a crop of source i mod S (its area
30-100% of the source's, aspect 3/4-4/3, drawn from numpy's Generator seeded [SEED, i]), rescaled
(Lanczos) so that its longer side is 300-500 px (drawn too), and encoded as JPEG at quality
QUALITY; class = source mod 10, root/train/c<class>/<i>.jpg. Deterministic byte for byte.

Teachers: Gluon model-zoo architectures (mobilenet1.0, resnet18_v1) with random weights (speed does
not depend on weights; nothing is downloaded), exported to checkpoint files, 224x224 inputs. The
producer (python -m kdcache.cache_builder, offline) reads the folder with --image-size 256x256 and
--augment center:224 (short side 256, centre crop 224), batch 32, the teacher on THREADS thread(s);
it is timed with 0 decode workers (decoding in series) and with the workers the cores left give
(at least 1). The teacher alone runs the same checkpoint on pre-decoded tensors, same threads and
batch, once by itself and once beside a process that makes views as a decode worker does (on shared
cores that is the most a producer with one worker can reach). Each configuration runs REPEATS
times, interleaved, and the best is kept. Each figure stands beside the CPU model, the cores, this
core's measured float32 peak and the load average before and after the run.
"""
import glob
import io
import json
import os
import subprocess
import sys
import tempfile

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "decode.json")
OPENCV_DATA = "/usr/share/doc/opencv-doc/examples/data"
PHOTOS, QUICK_PHOTOS = 1024, 64
SEED, QUALITY = 0, 90
SIDE = (300, 500)
TEACHERS = ("mobilenet1.0", "resnet18_v1")
BATCH, IMAGE_SIZE, VIEW = 32, "256x256", "center:224"
REPEATS = 3  # runs of each configuration, interleaved; the best is kept


# --- the photos --------------------------------------------------------------------------------
def sources():
    """[(name, RGB PIL image)]: opencv-doc's colour JPEGs (when the package is installed), then
    scikit-learn's china.jpg and flower.jpg; always in this order."""
    from PIL import Image
    out = []
    for p in sorted(glob.glob(os.path.join(OPENCV_DATA, "*.jpg"))):
        with Image.open(p) as im:
            if im.mode == "RGB" and min(im.size) >= 192:  # photographs in colour, not the grey calibration shots
                out.append((os.path.basename(p), im.convert("RGB")))
    from sklearn.datasets import load_sample_images
    s = load_sample_images()
    for name, a in zip(s.filenames, s.images):
        out.append((os.path.basename(name), Image.fromarray(a)))
    return out


def make_photos(root, n=PHOTOS, *, seed=SEED, quality=QUALITY, classes=10):
    """Write n JPEGs under root/train/c<k>/ (see the module's text); returns the source names."""
    from PIL import Image
    src = sources()
    classes = min(classes, len(src))
    for k in range(classes):
        os.makedirs(os.path.join(root, "train", f"c{k}"), exist_ok=True)
    for i in range(n):
        s = i % len(src)
        im = src[s][1]
        rng = np.random.default_rng([seed, i])
        w, h = im.size
        area = rng.uniform(0.3, 1.0) * w * h
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw = int(min(w, round(np.sqrt(area * aspect))))
        ch = int(min(h, round(np.sqrt(area / aspect))))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        longer = int(rng.integers(SIDE[0], SIDE[1] + 1))
        scale = longer / max(cw, ch)
        crop = im.crop((x0, y0, x0 + cw, y0 + ch)).resize(
            (max(1, round(cw * scale)), max(1, round(ch * scale))), Image.LANCZOS)
        buf = io.BytesIO()
        crop.save(buf, "JPEG", quality=quality)
        with open(os.path.join(root, "train", f"c{s % classes}", f"{i:05d}.jpg"), "wb") as fh:
            fh.write(buf.getvalue())
    return [name for name, _ in src]


def export_teacher(name, prefix, classes=10):
    """A model-zoo architecture with random weights, exported as prefix-symbol.json / -0000.params."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision
    mx.random.seed(0)
    net = vision.get_model(name, classes=classes, prefix="teacher_")
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1, 3, 224, 224)))
    net.export(prefix, 0)
    return prefix


# --- the measurements, each in a child process with its own threads ----------------------------
def decode_ms(root, n, repeats=1):
    """ms per image on this one process: the producer's own path (MXNet decode, --image-size, the view)
    and PIL's decode + resize + centre crop, for reference."""
    import time
    from PIL import Image
    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.images import ImageFolderDataset
    ds = ImageFolderDataset(root, "train", (256, 256))
    aug = Augment.parse(VIEW)
    n = min(n, len(ds))
    make_views(ds, np.arange(4), 0, seed=0, augment=aug)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            make_views(ds, np.arange(i, min(n, i + BATCH)), 0, seed=0, augment=aug)
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    paths = [p for p, _ in ds._folder.items[:n]]
    t0 = time.perf_counter()
    for p in paths:
        with Image.open(p) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = 256 / min(w, h)
            im = im.resize((max(256, round(w * s)), max(256, round(h * s))), Image.BILINEAR)
            w, h = im.size
            a = np.asarray(im.crop(((w - 224) // 2, (h - 224) // 2, (w - 224) // 2 + 224, (h - 224) // 2 + 224)),
                           dtype=np.float32)
    pil = (time.perf_counter() - t0) / n * 1e3
    return {"kdcache_ms": best, "pil_ms": pil, "images": n, "shape": list(a.shape)}


def teacher_alone(prefix, batches):
    """The teacher's images/s on pre-decoded tensors (OMP_NUM_THREADS set by the parent), timed as the
    producer's rows/s is: after a forward of 2 samples (its fit check), over every batch, the first (which
    binds the executor for the batch's shape) included."""
    import time
    from kdcache.pipeline.checkpoint import TeacherOptions
    from kdcache.pipeline.teacher import load_teacher
    t = load_teacher(TeacherOptions(prefix=prefix, epoch=0), BATCH)
    x = np.random.default_rng(0).uniform(0, 1, (BATCH, 3, 224, 224)).astype(np.float32)
    t.forward(x[:2])  # as check_fits
    t0 = time.perf_counter()
    for _ in range(batches):
        t.forward(x)
    return {"images_per_s": batches * BATCH / (time.perf_counter() - t0), "batches": batches}


def decode_forever(root):
    """Make views of the photos until killed: the load one decode worker puts on the machine."""
    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.images import ImageFolderDataset
    ds = ImageFolderDataset(root, "train", (256, 256))
    aug = Augment.parse(VIEW)
    print("decoding", flush=True)
    while True:
        for i in range(0, len(ds), BATCH):
            make_views(ds, np.arange(i, min(len(ds), i + BATCH)), 0, seed=0, augment=aug)


def teacher_beside_decoding(root, prefix, batches, threads):
    """The teacher alone while one process decodes beside it (as a decode worker does): on idle cores
    the same as alone; where the cores are shared (with other work, or one physical core's two
    threads), the most a producer with one worker can reach here."""
    from bench.common import child_env
    burner = subprocess.Popen([sys.executable, "-m", "bench.decode", "--child-burn", root, "0"], env=child_env(1),
                              stdout=subprocess.PIPE, text=True)
    try:
        burner.stdout.readline()  # it decodes from here on
        return child(["-m", "bench.decode", "--child-teacher", prefix, str(batches)], threads)
    finally:
        burner.kill()
        burner.wait()


def child(args, threads):
    from bench.common import child_env
    env = child_env(threads)  # every BLAS and OpenMP runtime at `threads`
    r = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        from bench.common import BenchError
        raise BenchError(f"{' '.join(args[:3])} failed ({r.returncode}): {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def producer_rate(root, prefix, threads, workers, cache_dir):
    out = child(["-m", "kdcache.cache_builder", "--dataset", "imagefolder", "--data-root", root,
                 "--image-size", IMAGE_SIZE, "--augment", VIEW, "--teacher", prefix, "--threads", str(threads),
                 "--decode-workers", str(workers), "--batch-size", str(BATCH), "--cache-dir", cache_dir,
                 "--codec", "full", "--quiet", "--json"], threads)
    return {"images_per_s": out["rows_per_s"], "rows": out["rows_written"]}


def render(report):
    """[(title, markdown)] of a decode.json report: the table docs/images.md shows (python -m bench.docs
    writes it there) and the note beside it, the machine, the peak and the load."""
    from bench.common import md_table
    rows = []
    for name, t in report["teachers"].items():
        beside = t.get("teacher_beside_decoding")
        rows.append([f"`{name}`", f"{t['teacher_alone']:.1f}", "-" if beside is None else f"{beside:.1f}",
                     f"{t['producer_serial']:.1f}", f"{t['producer_workers']:.1f} ({report['decode_workers']} worker)",
                     f"{t['ratio_workers']:.2f}x", f"{t['ratio_serial']:.2f}x",
                     "-" if beside is None else f"{t['ratio_workers_to_beside']:.2f}x"])
    d = report["decode"]
    cpu = report["cpu"]
    note = (f"{report['photos']} photos, {IMAGE_SIZE} then `{VIEW}`, batch {BATCH}, teacher on "
            f"{report['teacher_threads']} thread(s); each figure the best of {report.get('repeats', 1)} runs, "
            f"interleaved. Decode: {d['kdcache_ms']:.2f} ms per image on one worker "
            f"(kdcache's path: MXNet's decoder, --image-size, the view), PIL's decode + resize + crop "
            f"{d['pil_ms']:.2f} ms. {cpu['model_name']} ({cpu['cpus']} cores), measured peak "
            f"{report['peak']['gflops']:.1f} GFLOP/s per core; load average (1, 5, 15 min) before the run "
            f"{report['load_before']}, after it {report.get('load_after', '-')}"
            f"{' (quick run)' if report['quick'] else ''}. \"Beside decoding\": the teacher alone while one "
            f"process makes views beside it, as one decode worker does; on idle cores it equals the teacher "
            f"alone, on shared cores it is the most a producer with one worker can reach.")
    return [(None, md_table(["teacher (224 px, random weights)", "teacher alone, images/s",
                             "teacher beside decoding", "producer, decoding in series", "producer, decode workers",
                             "workers / teacher alone", "series / teacher alone", "workers / beside decoding"],
                            rows)), (None, note)]


def table(report):
    """What main prints: render(report) as the manual shows it."""
    from bench.common import rendered
    return rendered(render(report))


def main(argv=None):
    from bench.cli import out_option, parse_args, quick_option, tmp_option
    import time
    from bench.common import machine, make_log, utc_now, write_report
    from bench.flops import cpu_id
    if argv is None and len(sys.argv) > 1 and sys.argv[1] in ("--child-decode", "--child-teacher", "--child-burn"):
        what, a, b = sys.argv[1:4]
        if what == "--child-burn":
            decode_forever(a)
        print(json.dumps(decode_ms(a, int(b)) if what == "--child-decode" else teacher_alone(a, int(b))))
        return 0
    _, args = parse_args("python -m bench.decode", __doc__.split("\n\n")[0],
                         [quick_option(f"{QUICK_PHOTOS} photos, mobilenet1.0 only, short timings"),
                          tmp_option("scratch folder (default: the system's)"), out_option(DEFAULT_OUT)],
                         argv, default_out=DEFAULT_OUT)
    log = make_log("bench.decode")
    t_start = time.perf_counter()
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores - 1)  # the producer's default: all cores but one
    workers = max(1, cores - threads)
    n = QUICK_PHOTOS if args.quick else PHOTOS
    teachers = TEACHERS[:1] if args.quick else TEACHERS
    repeats = 1 if args.quick else REPEATS
    if args.tmp:
        os.makedirs(args.tmp, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kdcache-decode-", dir=args.tmp) as tmp:
        root = os.path.join(tmp, "photos")
        srcs = make_photos(root, n)
        log(f"{n} photos from {len(srcs)} sources in {root}")
        decode = child(["-m", "bench.decode", "--child-decode", root, str(min(n, 256))], 1)
        log(f"decode {decode['kdcache_ms']:.2f} ms per image (PIL {decode['pil_ms']:.2f} ms)")
        peak = child(["-c", "import json; from bench.flops import measure_peak; "
                      f"print(json.dumps(measure_peak(repeats={3 if args.quick else 5})))"], 1)  # one core's
        results = {}
        for name in teachers:
            prefix = os.path.join(tmp, name.replace(".", "_"))
            export_teacher(name, prefix)
            # Each configuration REPEATS times, interleaved, the best kept: other processes' load comes and
            # goes within a run on a shared machine, and the best of each is the nearest to idle cores.
            runs = {"alone": [], "beside": [], "serial": [], "workers": []}
            for r in range(repeats):
                runs["alone"].append(child(["-m", "bench.decode", "--child-teacher", prefix, str(n // BATCH)],
                                           threads)["images_per_s"])
                runs["beside"].append(teacher_beside_decoding(root, prefix, n // BATCH, threads)["images_per_s"])
                runs["serial"].append(producer_rate(root, prefix, threads, 0, os.path.join(tmp, f"c0-{name}-{r}"))
                                      ["images_per_s"])
                runs["workers"].append(producer_rate(root, prefix, threads, workers,
                                                     os.path.join(tmp, f"c1-{name}-{r}"))["images_per_s"])
            best = {k: max(v) for k, v in runs.items()}
            results[name] = {"teacher_alone": best["alone"], "teacher_beside_decoding": best["beside"],
                             "ratio_workers_to_beside": best["workers"] / best["beside"],
                             "producer_serial": best["serial"], "producer_workers": best["workers"],
                             "ratio_workers": best["workers"] / best["alone"],
                             "ratio_serial": best["serial"] / best["alone"], "runs": runs}
            alone, serial, par = ({"images_per_s": best[k]} for k in ("alone", "serial", "workers"))
            log(f"{name}: alone {alone['images_per_s']:.1f}/s, series {serial['images_per_s']:.1f}/s, "
                f"{workers} worker(s) {par['images_per_s']:.1f}/s")
    report = {"photos": n, "sources": srcs, "seed": SEED, "quality": QUALITY, "decode": decode,
              "teachers": results, "repeats": repeats, "teacher_threads": threads, "decode_workers": workers, "cores": cores,
              "cpu": cpu_id(), "peak": peak, "load_before": load_before,
              "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "quick": bool(args.quick),
              "machine": machine(mxnet=True, omp_num_threads=threads), "runtime_s": time.perf_counter() - t_start,
              "date": utc_now()}
    print(table(report))
    write_report(args.out, report)
    print(f"Report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
