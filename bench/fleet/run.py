"""The many-hosts benchmark: Ray actors filling a cache as immutable parts against the local producer at equal
cores, what a task costs against its size, and ImageNet-21k on paper from those measured costs.

1. Engine overhead: in each round, interleaved (the order reversed every second round), `kdcache cache
   --shards K --threads 1` and `--engine ray --actors K --actor-cpus 1` (a local Ray cluster the command starts)
   for K = 1 and 2 on a fresh cache; each run's work-loop rows/s (start-up apart: the producer's loop, the
   driver's dispatch after every actor loaded) and its wall time. Floor: Ray >= 0.95x local, on the paired ratios.
2. Task size: `--scratch` parts of B rows (one thread), each task's median compute, write and publish seconds,
   the finish (check and compaction) time; a reader's open time over the published parts of half a cache.
3. Parts of ImageNet-1k rows (1,000 float16 logits): write, publish, a reader's open, check and compaction per byte.
4. The finish at ImageNet-1k size (1,281,167 x 1,000 float16): compaction into P.h5 against an index over the parts
   that a reader maps without copying (bench.fleet.finish): finish time, bytes written, open, an epoch cold and warm.
5. ImageNet-21k (14.2 M images x 10 views) on 8, 64 and 512 hosts of 64 cores, on paper: from sections 3 and 4's
   per-byte costs and bench.sizing's ResNet-50 rate (bench/results/sizing.json).
"""
import glob
import os
import shutil
import time

from bench.cli import out_option, quick_option, tmp_option
from bench.common import (child_env, heading, machine_line, make_log, md_table, python_m, rate, for_the_manual,
                          section)
from bench.fleet.finish import finishes
from bench.paired import floors_table, paired, shown, verdicts_line
from bench.producer.children import CLASSES, SHAPE

DEFAULT_OUT = os.path.join("bench", "results", "fleet.json")
DESCRIPTION = ("kdcache many-hosts benchmark: Ray actors filling a cache as immutable parts vs the local producer at "
               "equal cores, the cost of a task against its size, ImageNet-21k on paper. Prints markdown tables and "
               "writes a JSON report.")
# Full: ~10 min on 2 cores (2.6 GB of parts and as much again compacted); quick: ~2 min.
FULL = dict(n=60000, block=4096, rounds=3, sizes=(512, 2048, 8192), scale_parts=64, finish_rows=1_281_167)
QUICK = dict(n=8192, block=2048, rounds=1, sizes=(1024, 4096), scale_parts=8, finish_rows=20_000)
SCALE_CLASSES, SCALE_BLOCK = 1000, 4096  # section 3's parts: ImageNet-1k rows (full/float16), 4,096 a part
FLOOR = 0.95
OPTIONS = [quick_option("a smaller data set, one round (no spread)"), out_option(DEFAULT_OUT),
           tmp_option("directory for the teacher and the caches, kept there for inspection (default: a temporary "
                      "folder, removed)")]
log = make_log("bench.fleet")

# ImageNet-21k: the paper's figures
IN21K_IMAGES, IN21K_CLASSES, IN21K_VIEWS = 14_197_122, 21_841, 10
CORES_PER_HOST = 64
HOSTS = (8, 64, 512)


def params(parser, args):
    return QUICK if args.quick else FULL


def producer(kids, prefix, data, cache_dir, *extra, what):
    argv = python_m("kdcache.cache_builder", "--teacher", prefix, "--dataset", data, "--cache-dir", cache_dir,
                    "--quiet", "--json", *extra)
    return kids.run(argv, what, env=child_env(threads=1), timeout=1800)


def fresh(root, tag):
    d = os.path.join(root, "caches", tag)
    shutil.rmtree(d, ignore_errors=True)
    return d


def engines(kids, root, prefix, data, p):
    """Section 1: {K: {"local": [runs], "ray": [runs]}} over p["rounds"] interleaved rounds."""
    runs = {k: {"local": [], "ray": []} for k in (1, 2)}
    for r in range(p["rounds"]):
        order = [(k, e) for k in (1, 2) for e in ("local", "ray")]
        if r % 2:
            order.reverse()
        for k, e in order:
            extra = (["--threads", 1] + (["--shards", k] if k > 1 else [])) if e == "local" else \
                ["--engine", "ray", "--actors", k, "--actor-cpus", 1, "--block-rows", p["block"]]
            res = producer(kids, prefix, data, fresh(root, f"{e}{k}"), *extra, what=f"{e} x{k}, round {r + 1}")
            rps = res["work_rows_per_s"] if e == "ray" else res["rows_per_s"]
            runs[k][e].append({"rows_per_s": rps, "wall_s": round(res["_wall_s"], 2), "rows": res["rows_written"],
                               **{f: res.get(f) for f in ("start_s", "work_s", "finish_s", "tasks", "task_costs",
                                                          "nodes", "actors")}})
            log(f"  round {r + 1}: {e} x{k}: {rate(rps)} rows/s (work loop), {res['_wall_s']:.1f} s wall")
    return runs


def task_sizes(kids, root, prefix, data, p, bytes_per_row):
    """Section 2: the local parts engine at each block size; then half a cache of parts, read by a reader."""
    out = []
    for b in p["sizes"]:
        res = producer(kids, prefix, data, fresh(root, f"parts{b}"), "--threads", 1, "--block-rows", b, "--scratch",
                       os.path.join(root, "scratch"), what=f"parts of {b} rows")
        out.append({"block_rows": b, "tasks": res["tasks"], "rows_per_s": res["work_rows_per_s"],
                    "finish_s": res["finish_s"], "part_bytes": b * bytes_per_row, **res["task_costs"]})
        log(f"  parts of {b:,} rows: {res['tasks']} tasks, {rate(res['work_rows_per_s'])} rows/s, task "
            f"{res['task_costs']['seconds']:.3f} s (write {res['task_costs']['write_s']:.4f} s, publish "
            f"{res['task_costs']['publish_s']:.4f} s), finish {res['finish_s']:.2f} s")
    b = min(p["sizes"])  # the most parts: half the cache, left unfinished for the reader
    d = fresh(root, "half")
    producer(kids, prefix, data, d, "--threads", 1, "--block-rows", b, "--scratch", os.path.join(root, "scratch"),
             "--shard", "0/2", what="half a cache of parts")
    parts = glob.glob(os.path.join(d, "*.parts", "part-*.h5"))
    from kdcache.store import CacheReader
    t0 = time.perf_counter()
    with CacheReader(glob.glob(os.path.join(d, "*.parts"))[0], timeout=0) as r:
        open_s = time.perf_counter() - t0
        done = float(r.progress)
    return out, {"parts": len(parts), "open_s": round(open_s, 4), "per_part_ms": round(1e3 * open_s / len(parts), 3),
                 "fraction_done": round(done, 3), "block_rows": b}


def at_scale(root, nparts):
    """Parts of ImageNet-sized rows (1,000 classes, float16, 4,096 rows each, random logits: no teacher), written,
    published, opened by a reader, checked and compacted, each step timed: the per-byte and per-part costs."""
    import numpy as np
    from kdcache.store import CacheReader, CacheSpec
    from kdcache.store.write.compact import finalize
    from kdcache.store.files.parts import check_parts, part_name, publish, write_part
    from kdcache.store.write.writer import prepare_parts
    n = nparts * SCALE_BLOCK
    spec = CacheSpec(num_samples=n, num_classes=SCALE_CLASSES, views=1, codec="full", dtype="float16",
                     inputs={"teacher": {"name": "bench.fleet", "digest": "0" * 16},
                             "dataset": {"name": "synthetic", "length": n}})
    base = os.path.join(root, "scale", spec.fingerprint)
    parts = prepare_parts(base, spec)
    scratch = os.path.join(root, "scale-scratch")
    os.makedirs(scratch, exist_ok=True)
    rng = np.random.default_rng(0)
    codec = spec.make_codec()
    write_s = publish_s = 0.0
    open_s = None
    for j in range(nparts):
        if j == nparts - 1:  # every part but the last published: a reader behind the producers opens them all
            os.system("sync")
            t0 = time.perf_counter()
            with CacheReader(base, spec=spec, timeout=0) as r:
                open_s = time.perf_counter() - t0
                assert not r.complete
        keys = np.arange(j * SCALE_BLOCK, (j + 1) * SCALE_BLOCK)
        enc = codec.encode(rng.normal(size=(SCALE_BLOCK, SCALE_CLASSES)).astype(np.float32), keys=keys)
        local = os.path.join(scratch, part_name(keys[0], keys[-1] + 1, keys))
        t0 = time.perf_counter()
        write_part(local, spec, keys[0], keys[-1] + 1, keys, enc)
        t1 = time.perf_counter()
        publish(local, parts, spec)
        publish_s += time.perf_counter() - t1
        write_s += t1 - t0
        os.unlink(local)
    os.system("sync")
    t0 = time.perf_counter()
    check_parts(parts, spec)
    check_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert finalize(base, spec)
    compact_s = time.perf_counter() - t0
    nbytes = n * codec.bytes_per_row
    out = {"parts": nparts, "rows": n, "bytes": nbytes, "write_s": round(write_s, 3), "publish_s": round(publish_s, 3),
           "reader_open_s": round(open_s, 3), "check_s": round(check_s, 3), "compact_s": round(compact_s, 3),
           "per_part_open_ms": round(1e3 * open_s / (nparts - 1), 2),
           "open_bytes_per_s": (nparts - 1) * SCALE_BLOCK * codec.bytes_per_row / open_s,
           "write_bytes_per_s": nbytes / write_s, "publish_bytes_per_s": nbytes / publish_s,
           "finish_bytes_per_s": nbytes / (check_s + compact_s)}
    shutil.rmtree(os.path.join(root, "scale"), ignore_errors=True)
    log(f"  {nparts} parts of {SCALE_BLOCK:,} x {SCALE_CLASSES} float16 ({_bytes(nbytes)}): write {write_s:.2f} s, "
        f"publish {publish_s:.2f} s, a reader opens them in {open_s:.3f} s, check {check_s:.2f} s, compaction "
        f"{compact_s:.2f} s")
    return out


def in21k(sections, sizing):
    """ImageNet-21k on paper from the measured per-byte costs (sections 3 and 4) and ResNet-50's measured rate."""
    from kdcache.store import CacheSpec
    rows = IN21K_IMAGES * IN21K_VIEWS
    per_core = sizing["teachers"]["resnet50_v1"]["images_per_s_per_core"]
    sc, fin = sections["scale"], sections["finish"]
    write_bps, publish_bps = sc["write_bytes_per_s"], sc["publish_bytes_per_s"]
    compact_bps = fin["part_bytes"] / fin["compaction"]["finish_s"]
    index_bps = fin["part_bytes"] / fin["part_index"]["finish_s"]
    index_per_key = fin["part_index"]["written_bytes"] / fin["rows"]
    out = []
    for codec, label in (("topk:10", "topk:10/float16"), ("full", "full/float16")):
        c = CacheSpec(num_samples=1, num_classes=IN21K_CLASSES, views=1, codec=codec, dtype="float16",
                      inputs={"teacher": {"name": "paper", "digest": "0" * 16}}).make_codec()
        bpr, nfields = c.bytes_per_row, len(c.fields)
        block = 4096
        parts = -(-rows // block)
        total = rows * bpr
        for h in HOSTS:
            cores = h * CORES_PER_HOST
            produce_s = rows / (cores * per_core)
            out.append({"codec": label, "bytes_per_row": bpr, "hosts": h, "parts": parts, "bytes": total,
                        "produce_h": round(produce_s / 3600, 2),
                        "part_io_s": round(block * bpr / write_bps + block * bpr / publish_bps, 3),
                        "finish_h": round(total / compact_bps / 3600, 2),
                        "finish_index_h": round(total / index_bps / 3600, 2),
                        "index_bytes": int(rows * index_per_key), "index_maps": parts * nfields,
                        "reader_open_s": round(total / sc["open_bytes_per_s"], 1),
                        "lost_host_rows": CORES_PER_HOST * block,
                        "lost_host_min": round(block / per_core / 60, 1)})
    return {"rows": rows, "resnet50_images_per_s_per_core": per_core, "write_bytes_per_s": write_bps,
            "open_bytes_per_s": sc["open_bytes_per_s"], "publish_bytes_per_s": publish_bps,
            "finish_bytes_per_s": compact_bps, "index_finish_bytes_per_s": index_bps, "table": out}


def run(kids, args, p, root):
    import json
    data = f"synthetic:n={p['n']},classes={CLASSES},shape={SHAPE}"
    log(f"{'quick' if args.quick else 'full'} run, {data}, temp dir {root}")
    prefix = os.path.join(root, "teacher", "benchteacher")
    os.makedirs(os.path.dirname(prefix))
    kids.run(python_m("bench.producer.children", "export", "--teacher", prefix), "teacher export")
    bytes_per_row = 2 * CLASSES  # full/float16
    log("1/4 Ray actors vs the local producer at equal cores")
    eng = engines(kids, root, prefix, data, p)
    log("2/4 the cost of a task against its size")
    sizes, reader = task_sizes(kids, root, prefix, data, p, bytes_per_row)
    pf = {f"ray_vs_local_x{k}": paired([r["rows_per_s"] / l["rows_per_s"] for r, l in
                                        zip(eng[k]["ray"], eng[k]["local"])], FLOOR) for k in (1, 2)}
    log(f"3/4 parts of ImageNet-sized rows: the costs per byte and per part")
    scale = at_scale(root, p["scale_parts"])
    log(f"4/4 the finish of {p['finish_rows']:,} rows: compaction against a part index")
    fin = finishes(root, p["finish_rows"], SCALE_CLASSES, SCALE_BLOCK)
    sections = {"engines": eng, "task_sizes": sizes, "reader": reader, "scale": scale, "finish": fin, "n": p["n"],
                "bytes_per_row": bytes_per_row}
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results",
                           "sizing.json")) as fh:
        sizing = json.load(fh)
    return {"dataset": data, "block_rows": p["block"], "rounds": p["rounds"], "sections": sections,
            "paired": pf, "verdicts": {k: f["verdict"] for k, f in pf.items()},
            "floors": {k: {"op": ">=", "value": FLOOR} for k in pf}, "imagenet21k": in21k(sections, sizing)}


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def render(report):
    """[(title, markdown table)] from the JSON report alone."""
    s, pf = report["sections"], report["paired"]
    rows = []
    for k in (1, 2):
        e = s["engines"][str(k)] if str(k) in s["engines"] else s["engines"][k]
        lr, rr = e["local"], e["ray"]
        rows.append([f"{k} core(s): `--engine ray --actors {k}` vs `--shards {k}`",
                     rate(_median([x["rows_per_s"] for x in lr])), rate(_median([x["rows_per_s"] for x in rr])),
                     f"{_median([x['wall_s'] for x in lr]):.1f} s / {_median([x['wall_s'] for x in rr]):.1f} s",
                     f"{_median([x['start_s'] for x in rr]):.1f} s",
                     shown(pf[f"ray_vs_local_x{k}"]), f">= {FLOOR}", pf[f"ray_vs_local_x{k}"]["verdict"]])
    t1 = md_table(["run", "local rows/s", "Ray rows/s", "wall, local / Ray", "Ray start-up (cluster, actors)",
                   "Ray / local (paired)", "floor", "verdict"], rows, pad=False)
    t2 = md_table(["rows per task", "tasks", "rows/s", "task s (median)", "compute s", "write s", "publish s",
                   "finish s", "part bytes"],
                  [[f"{x['block_rows']:,}", x["tasks"], rate(x["rows_per_s"]), f"{x['seconds']:.3f}",
                    f"{x['compute_s']:.3f}", f"{x['write_s']:.4f}", f"{x['publish_s']:.4f}", f"{x['finish_s']:.2f}",
                    f"{x['part_bytes']:,}"] for x in s["task_sizes"]], pad=False)
    rd, sc = s["reader"], s["scale"]
    t4 = md_table(["parts", "rows x classes (float16)", "bytes", "write in scratch", "publish (copy, fsync, link)",
                   "a reader opens them", "check (CRC-32 of every part)", "compaction into P.h5"],
                  [[sc["parts"], f"{sc['rows']:,} x {SCALE_CLASSES}", _bytes(sc["bytes"]),
                    f"{sc['write_s']:.2f} s ({_bytes(sc['write_bytes_per_s'])}/s)",
                    f"{sc['publish_s']:.2f} s ({_bytes(sc['publish_bytes_per_s'])}/s)",
                    f"{sc['reader_open_s']:.3f} s for {sc['parts'] - 1} ({sc['per_part_open_ms']:.1f} ms a part)",
                    f"{sc['check_s']:.2f} s", f"{sc['compact_s']:.2f} s"]], pad=False)
    fin = s["finish"]
    t5 = md_table(["finish", "time", "bytes written", "a reader opens it", "an epoch in shuffled order, cold",
                   "the next epoch, warm", "warm rows/s"],
                  [[name, f"{f['finish_s']:.1f} s" + (f" (check {f['check_s']:.1f} s + index {f['index_s']:.2f} s)"
                                                      if "check_s" in f else " (check and copy)"),
                    _bytes(f["written_bytes"]), f"{1e3 * f['open_s']:.0f} ms", f"{f['cold_epoch_s']:.1f} s",
                    f"{f['warm_epoch_s']:.1f} s", rate(fin["rows"] / f["warm_epoch_s"])]
                   for name, f in (("compaction into P.h5 (kept)", fin["compaction"]),
                                   ("index over the parts (measured only)", fin["part_index"]))], pad=False)
    i21 = report["imagenet21k"]
    t3 = md_table(["codec", "hosts (64 cores)", "parts (4,096 rows)", "bytes", "teacher hours", "finish (compaction) hours",
                   "finish as a part index, hours", "part index: bytes, maps a reader holds",
                   "a reader reads the parts", "a lost host recomputes"],
                  [[x["codec"], x["hosts"], f"{x['parts']:,}", _bytes(x["bytes"]), f"{x['produce_h']:.2f}",
                    f"{x['finish_h']:.2f}", f"{x['finish_index_h']:.2f}",
                    f"{_bytes(x['index_bytes'])}, {x['index_maps']:,}", _duration(x["reader_open_s"]),
                    f"{x['lost_host_rows']:,} rows, {x['lost_host_min']:.1f} min"] for x in i21["table"]], pad=False)
    return [(f"Ray actors against the local producer, {report['dataset']}, tasks of {report['block_rows']:,} rows, "
             f"{report['rounds']} interleaved round(s); rows/s of the work loop (start-up apart), medians:", t1),
            (f"The cost of a task against its size (the local parts engine, one thread); a reader opened "
             f"{rd['parts']} published parts of {rd['block_rows']:,} rows in {rd['open_s']:.3f} s "
             f"({rd['per_part_ms']:.2f} ms a part):", t2),
            (f"Parts of ImageNet-1k-sized rows ({SCALE_BLOCK:,} rows of {SCALE_CLASSES:,} float16 logits each, random "
             f"values, no teacher), each step timed on this machine's disk:", t4),
            (f"The finish of {fin['rows']:,} rows x {fin['classes']:,} float16 logits ({fin['parts']} parts, "
             f"{_bytes(fin['part_bytes'])}): compaction against an index over the parts that a reader maps without "
             f"copying; the same parts, batches of 256, page cache "
             f"{'dropped before each cold epoch' if fin['page_cache_dropped'] else 'not dropped (not allowed here)'}:",
             t5),
            (f"ImageNet-21k ({IN21K_IMAGES:,} images x {IN21K_VIEWS} views, {IN21K_CLASSES:,} classes), on paper: "
             f"ResNet-50 at {i21['resnet50_images_per_s_per_core']:.1f} images/s per core (bench.sizing); finish "
             f"at the rates measured above, one host (compaction {_bytes(i21['finish_bytes_per_s'])}/s, a part "
             f"index {_bytes(i21['index_finish_bytes_per_s'])}/s); "
             f"a reader following the build reads every published part at the rate measured above "
             f"({_bytes(i21['open_bytes_per_s'])}/s); a lost host's in-flight tasks (one per core) "
             f"recomputed:", t3)]


def _duration(seconds):
    return f"{seconds / 3600:.1f} h" if seconds >= 3600 else f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.1f} s"


def _bytes(n):
    for unit, div in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= div:
            return f"{n / div:.1f} {unit}"
    return f"{n:.0f} B"


def show(report):
    print(heading("kdcache many-hosts benchmark", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    for title, table in render(report):
        print(section(title, table, ""))
    print("## Floors on paired runs\n\n" + floors_table(report["paired"]) + "\n")
    print(verdicts_line(report["verdicts"]))
    print("\n" + for_the_manual(render(report)))
    return 0
