"""Photos from files at 224 px: the run, its report and its table (python -m bench.decode)."""
import os
import subprocess

from bench.cli import out_option, quick_option, tmp_option
from bench.common import child_env, make_log, md_table, python_m, rendered
from bench.decode.photos import QUALITY, QUICK_PHOTOS, SEED, PHOTOS, make_photos
from bench.flops import cpu_id

DEFAULT_OUT = os.path.join("bench", "results", "decode.json")
TEACHERS = ("mobilenet1.0", "resnet18_v1")
BATCH, IMAGE_SIZE, VIEW = 32, "256x256", "center:224"
REPEATS = 5  # runs of each configuration, interleaved; the best is kept
OPTIONS = [quick_option(f"{QUICK_PHOTOS} photos, mobilenet1.0 only, short timings"),
           tmp_option("work directory (default: a new temporary directory, removed at the end; a directory given "
                      "here is kept)"), out_option(DEFAULT_OUT)]
log = make_log("bench.decode")


def teacher_beside_decoding(kids, root, prefix, batches, threads):
    """The teacher alone while one process decodes beside it (as a decode worker does): on idle cores
    the same as alone; where the cores are shared (with other work, or one physical core's two
    threads), the most a producer with one worker can reach here."""
    burner = subprocess.Popen(python_m("bench.decode.children", "burn", root), env=child_env(1),
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        burner.stdout.readline()  # it decodes from here on
        return kids.run(python_m("bench.decode.children", "teacher", prefix, batches), "the teacher beside decoding",
                        env=child_env(threads), timeout=3600)
    finally:
        burner.kill()
        burner.wait()


def producer_rate(kids, root, prefix, threads, workers, cache_dir):
    out = kids.run(python_m("kdcache.cache_builder", "--dataset", "imagefolder", "--data-root", root,
                            "--image-size", IMAGE_SIZE, "--augment", VIEW, "--teacher", prefix, "--threads", threads,
                            "--decode-workers", workers, "--batch-size", BATCH, "--cache-dir", cache_dir,
                            "--codec", "full", "--quiet", "--json"), f"the producer, {workers} decode worker(s)",
                   env=child_env(threads), timeout=3600)
    return {"images_per_s": out["rows_per_s"], "rows": out["rows_written"]}


def render(report):
    """[(title, markdown)] of a decode.json report: the table docs/images.md shows (python -m bench.docs
    writes it there) and the note beside it, the machine, the peak and the load."""
    rows = []
    for name, t in report["teachers"].items():
        beside = t.get("teacher_beside_decoding")
        rows.append([f"`{name}`", f"{t['teacher_alone']:.1f}", "-" if beside is None else f"{beside:.1f}",
                     f"{t['producer_serial']:.1f}", f"{t['producer_workers']:.1f} ({report['decode_workers']} worker)",
                     f"{t['ratio_workers']:.2f}x", f"{t['ratio_serial']:.2f}x",
                     "-" if beside is None else f"{t['ratio_workers_to_beside']:.2f}x"])
    d = report["decode"]
    cpu = report["cpu"]
    paired = []  # each run's workers / alone: runs are interleaved, so run r of each met the same load
    for name, t in report["teachers"].items():
        r = sorted(w / a for a, w in zip(t["runs"]["alone"], t["runs"]["workers"]))
        if len(r) > 1:
            paired.append(f"`{name}` {r[0]:.2f}-{r[-1]:.2f}x (median {r[len(r) // 2]:.2f}x)")
    note = (f"{report['photos']} photos, {IMAGE_SIZE} then `{VIEW}`, batch {BATCH}, teacher on "
            f"{report['teacher_threads']} thread(s); each figure the best of {report.get('repeats', 1)} runs, "
            f"interleaved. Decode: {d['kdcache_ms']:.2f} ms per image on one worker "
            f"(kdcache's path: MXNet's decoder, --image-size, the view), PIL's decode + resize + crop "
            f"{d['pil_ms']:.2f} ms. {cpu['model_name']} ({cpu['cpus']} cores), measured peak "
            f"{report['peak']['gflops']:.1f} GFLOP/s per core; load average (1, 5, 15 min) before the run "
            f"{report['load_before']}, after it {report.get('load_after', '-')}"
            f"{' (quick run)' if report['quick'] else ''}."
            f"{' Workers / teacher alone run by run: ' + ', '.join(paired) + '.' if paired else ''}"
            f" \"Beside decoding\": the teacher alone while one "
            f"process makes views beside it, as one decode worker does; on idle cores it equals the teacher "
            f"alone, on shared cores it is the most a producer with one worker can reach.")
    return [(None, md_table(["teacher (224 px, random weights)", "teacher alone, images/s",
                             "teacher beside decoding", "producer, decoding in series", "producer, decode workers",
                             "workers / teacher alone", "series / teacher alone", "workers / beside decoding"],
                            rows)), (None, note)]


def table(report):
    """What the benchmark prints: render(report) as the manual shows it."""
    return rendered(render(report))


def params(ap, args):
    cores = len(os.sched_getaffinity(0))
    threads = max(1, cores - 1)  # the producer's default: all cores but one
    return {"cores": cores, "threads": threads, "workers": max(1, cores - threads),
            "n": QUICK_PHOTOS if args.quick else PHOTOS, "teachers": TEACHERS[:1] if args.quick else TEACHERS,
            "repeats": 1 if args.quick else REPEATS}


def run(kids, args, p, work):
    from bench.common import machine
    n, threads, workers = p["n"], p["threads"], p["workers"]
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    root = os.path.join(work, "photos")
    srcs = make_photos(root, n)
    log(f"{n} photos from {len(srcs)} sources in {root}")
    decode = kids.run(python_m("bench.decode.children", "decode", root, min(n, 256)), "decoding", env=child_env(1))
    log(f"decode {decode['kdcache_ms']:.2f} ms per image (PIL {decode['pil_ms']:.2f} ms)")
    peak = kids.run(python_m("bench.decode.children", "peak", 3 if args.quick else 5), "the peak",
                    env=child_env(1))  # one core's
    results = {}
    for name in p["teachers"]:
        prefix = os.path.join(work, name.replace(".", "_"))
        kids.run(python_m("bench.decode.children", "export", name, prefix), f"exporting {name}", env=child_env(1))
        # Each configuration REPEATS times, interleaved, the best kept: other processes' load comes and
        # goes within a run on a shared machine, and the best of each is the nearest to idle cores.
        runs = {"alone": [], "beside": [], "serial": [], "workers": []}
        for r in range(p["repeats"]):
            runs["alone"].append(kids.run(python_m("bench.decode.children", "teacher", prefix, n // BATCH),
                                          "the teacher alone", env=child_env(threads), timeout=3600)["images_per_s"])
            runs["beside"].append(teacher_beside_decoding(kids, root, prefix, n // BATCH, threads)["images_per_s"])
            runs["serial"].append(producer_rate(kids, root, prefix, threads, 0, os.path.join(work, f"c0-{name}-{r}"))
                                  ["images_per_s"])
            runs["workers"].append(producer_rate(kids, root, prefix, threads, workers,
                                                 os.path.join(work, f"c1-{name}-{r}"))["images_per_s"])
        best = {k: max(v) for k, v in runs.items()}
        results[name] = {"teacher_alone": best["alone"], "teacher_beside_decoding": best["beside"],
                         "ratio_workers_to_beside": best["workers"] / best["beside"],
                         "producer_serial": best["serial"], "producer_workers": best["workers"],
                         "ratio_workers": best["workers"] / best["alone"],
                         "ratio_serial": best["serial"] / best["alone"], "runs": runs}
        log(f"{name}: alone {best['alone']:.1f}/s, series {best['serial']:.1f}/s, "
            f"{workers} worker(s) {best['workers']:.1f}/s")
    for k in ("_wall_s", "_launched", "_cpu"):  # the child's own bookkeeping
        peak.pop(k, None)
        decode.pop(k, None)
    return {"photos": n, "sources": srcs, "seed": SEED, "quality": QUALITY, "decode": decode,
            "teachers": results, "repeats": p["repeats"], "teacher_threads": threads, "decode_workers": workers,
            "cores": p["cores"], "cpu": cpu_id(), "peak": peak, "load_before": load_before,
            "load_after": " ".join(f"{x:.2f}" for x in os.getloadavg()), "quick": bool(args.quick),
            "machine": machine(mxnet=True, omp_num_threads=threads)}


def show(report):
    print(table(report))
