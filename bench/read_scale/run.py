"""The read_scale benchmark's command: its sizes and options, the run (six sections) and what it prints."""
import os

from bench.common import limit_threads

limit_threads(os.environ, force=False)  # before numpy loads: one BLAS/OpenMP thread

import shutil  # noqa: E402

import numpy as np  # noqa: E402

from bench.read_scale import sections as S  # noqa: E402
from bench.common import (BenchError, busy_warning, cpu_between, cpu_snapshot, heading, machine_line,  # noqa: E402
                          md_table, rate, for_the_manual, section, verdict)
from bench.paired import floors_table, shown, verdicts_line  # noqa: E402
from bench.cli import RUN, out_option, quick_option, tmp_option  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402
from kdcache.store import path_for  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "read_scale.json")
IMAGENET = 1_281_167
FULL = dict(rows=IMAGENET, classes=1000, views=None, max_views=10, write_batch=256, mv_write_batch=16384,
            open_repeats=3, gather_batches=2000, gather_repeats=5, disk_batches=100, cold_rows=None)
QUICK = dict(rows=100_000, classes=1000, views=3, max_views=3, write_batch=256, mv_write_batch=16384,
             open_repeats=3, gather_batches=500, gather_repeats=3, disk_batches=50, cold_rows=25_000)

OPTIONS = [
    quick_option("100,000 rows and 3 views instead of ImageNet-1k's 1,281,167 and up to 10: well under a minute"),
    out_option(DEFAULT_OUT),
    tmp_option("directory for the caches (default: the system temp dir; a full run writes as many views, up to 10, "
               "as leave 20 GB free there), the run's folder kept there (each cache removed once measured; default: "
               "a temporary folder, removed)"),
    Option("--rows", "samples in the cache (default 1,281,167; --quick 100,000)", type=Int(1000), metavar="N",
           group=RUN),
    Option("--classes", "logits per row (default 1000)", type=Int(3), metavar="C", group=RUN),
    Option("--views", "views of the multi-view cache (default: the most, up to 10, that the free disk holds; "
           "--quick 3)", type=Int(2, 100), metavar="V", group=RUN),
    Option("--readers", "reader processes whose memory is measured together", type=Int(1, 32), default=4,
           metavar="R", group=RUN),
    Option("--seed", "seed of the logits, the write order and the batches", type=Int(0), default=0, metavar="S",
           group=RUN),
]

log = S.log


def fmt_gb(b):
    return f"{b / S.GB:.2f} GB" if b >= 0.1 * S.GB else f"{b / 1e6:.1f} MB"


def fmt_s(s):
    """Seconds: 3 significant digits (an open of the map takes milliseconds)."""
    return f"{s:.3g}"


def fmt_rate(x):
    return rate(x) if x is not None else "-"

def render(report):
    """[(title, markdown table)]: the mapped reader against its baselines and floors, from the JSON report alone
    (a line whose measurement the run skipped is left out)."""
    op, g, rd, cold = report["open"], report["gather"], report["readers"], report.get("cold") or {}
    # rows/s: the medians of the rounds (the best, in a report from before the floors were paired)
    best = g["rows_per_s_median"] if "paired" in g else g["rows_per_s_best"]
    fl, v = report["floors"], report["verdicts"]

    def floor(name):
        return f"{fl[name]['op']} {fl[name]['value']:g}"
    ram = (f"`mmap=False`: {op['ram_s']:.1f} s (reads it all, float16 widened to float32)" if op.get("ram_s")
           else f"`mmap=False`: skipped ({op.get('ram_skipped')})")
    rows = [["open the finished file (page cache warm)", f"{1e3 * op['map_s_best']:.1f} ms", ram,
             f"{op['ram_vs_map']:.0f}x" if op.get("ram_vs_map") else "", "", ""],
            ["random gathers of 256, warm, float32 out", f"{rate(best['map_get'])} rows/s",
             f"numpy `a16[b].astype(float32)` on the same array in RAM: {rate(best['numpy_f32'])}",
             shown(g["paired"]["map_vs_numpy_gather"]) if "paired" in g else f"{g['map_vs_numpy_gather']:.2f}",
             floor("map_vs_numpy_gather"), v["map_vs_numpy_gather"]],
            ["the same, float16 out", f"{rate(best['map_raw'])} rows/s", f"numpy `a16[b]`: {rate(best['numpy_raw'])}",
             f"{g['map_raw_vs_numpy_raw']:.2f}", "", ""]]
    if best.get("ram_get"):
        rows.append(["the same vs today's reader (float32 held in RAM)", f"{rate(best['map_get'])} rows/s",
                     rate(best["ram_get"]), f"{g['map_vs_ram_reader']:.2f}", "", ""])
    m, r = rd["map"], rd.get("ram")
    rows.append([f"Pss of {m['processes']} reader processes, each gathering every row once, all alive",
                 f"{fmt_gb(m['pss_sum'])}, {m['pss_vs_file']:.2f}x the file",
                 f"`mmap=False`: {fmt_gb(r['pss_sum'])}, {r['pss_vs_file']:.2f}x" if r else "",
                 "", f"{floor('pss_map_vs_file')}x", v["pss_map_vs_file"]])
    rnd, slow, seq = cold.get("random"), cold.get("random_no_readahead"), cold.get("sequential")
    if rnd and slow:
        rows.append(["first epoch after the file's pages were dropped, random order",
                     f"{rate(rnd['rows_per_s'])} rows/s ({rnd['epoch_s']:.1f} s)",
                     f"the same map with no read-ahead (MADV_RANDOM): {rate(slow['rows_per_s'])} "
                     f"({slow['epoch_s']:.0f} s)", f"{rnd['rows_per_s'] / slow['rows_per_s']:.1f}", "", ""])
    first, plain = cold.get("random_read_first"), cold.get("plain_read")
    if seq and first and plain:
        rows.append(["the same, key order", f"{rate(seq['rows_per_s'])} rows/s ({seq['epoch_s']:.1f} s)",
                     f"one plain read of the file ({plain['bytes_per_s'] / 1e9:.1f} GB/s), then a random epoch: "
                     f"{first['total_s']:.1f} s in all", "", "", ""])
    how = (f"Random gathers: rows/s the medians of {g['repeats']} interleaved rounds, each ratio the median of the "
           f"round-by-round ratios, the floor's ±its spread, each round's ratio in brackets, its verdict decided on "
           f"them (bench.paired). The Pss floor is a size, measured once (it does not vary from run to run as a "
           f"timing does)."
           if "paired" in g else "")
    return [(how, md_table(["comparison", "mapped (default)", "baseline", "ratio", "floor", "verdict"], rows,
                           pad=False))]


def measure(args, p, root, rng, busy):
    """The six sections' measurements: the report's measured part. Other processes' CPU use per section into `busy`."""
    n, c = p["rows"], p["classes"]
    spec = S.make_spec(n, c, 1, "one view")
    pool = S.make_pool(rng, c)

    def step(k, what):  # other processes' CPU use is recorded per section, for the report's warning
        if step.snap is not None:
            busy.append(cpu_between(step.snap, cpu_snapshot())["other_cores"])
        step.snap = cpu_snapshot()
        log(f"{k}/6 {what}")
    step.snap = None

    free = shutil.disk_usage(root).free
    need = S.write_peak(n * c * 2)
    if need > free - S.keep_free(free):
        raise BenchError(f"bench: writing {n:,} x {c} needs {need / S.GB:.1f} GB of disk, {free / S.GB:.1f} GB "
                         f"is free on {root}: pass --tmp on a larger disk, or --rows")
    if args.views:  # refused now, not after five sections
        S.choose_views(n, c, free, args.views, p["max_views"])
    step(1, f"writing {n:,} x {c} (full float16) in shuffled order")
    path, wr = S.write_cache(root, spec, pool, rng.permutation(n), p["write_batch"], "one-view")

    step(2, "open: mapped vs RAM")
    op, ram = S.bench_open(path, spec, p["open_repeats"])

    step(3, "warm gathers: map vs numpy in RAM")
    g = S.bench_gather(path, spec, pool, ram, p, rng)
    if ram is not None:
        ram.close()
        del ram

    step(4, f"{args.readers} reader processes: mapped, then mmap=False")
    mem = {"map": S.bench_readers(root, path, "map", args.readers, args.seed)}
    k = S.ram_readers_that_fit(spec, args.readers)
    mem["ram"] = S.bench_readers(root, path, "ram", k, args.seed, S.ram_budget(spec)) if k else None

    step(5, "cold epochs from disk")
    cold = S.bench_cold(path, spec, rng, p["cold_rows"])
    shutil.rmtree(os.path.dirname(path), ignore_errors=True)

    free = shutil.disk_usage(root).free
    mv_rows, views, why = S.choose_views(n, c, free, args.views or p["views"], p["max_views"])
    mv = None
    step(6, f"multi-view cache: {why}")
    if views:
        mv = S.bench_multiview(root, mv_rows, views, c, pool, p, rng, args.readers, args.seed)
    busy.append(cpu_between(step.snap, cpu_snapshot())["other_cores"])
    return {"rows": n, "classes": c, "file_bytes": wr["file_bytes"], "write": wr, "open": op, "gather": g,
            "readers": mem, "cold": cold, "multiview": mv, "multiview_choice": why}


def sections(report):
    """The six sections' (title, table, note), from the report alone."""
    n, c, size, wr = report["rows"], report["classes"], report["file_bytes"], report["write"]
    op, g, mem, cold, mv = report["open"], report["gather"], report["readers"], report["cold"], report["multiview"]
    readers, spec = report["readers_asked"], S.make_spec(n, c, 1, "one view")
    cpu = f"1 thread, {report['machine']['cpu_model'] or 'this CPU'}"
    out = [("1. Writing the cache through CacheWriter", md_table(
        ["N x C (full float16)", "write order, rows a write", "write rows/s", "compaction s", "rows/s with close",
         "file"],
        [[f"{n:,} x {c}", f"shuffled, {wr['batch']}", rate(wr["rows_per_s"]), fmt_s(wr["compaction_s"]),
          rate(wr["rows_per_s_with_close"]), fmt_gb(size)]]),
        f"Every row through CacheWriter.write (each batch flushed: SWMR, durable), then close(), which compacts the "
        f"segment into the key-ordered {os.path.basename(path_for('', spec.fingerprint))}.h5. Logits: {S.POOL} random "
        f"rows tiled over the keys, each key written into 3 columns. {cpu}.")]

    out.append(("2. Opening the finished file", md_table(
        ["reader", "source", "open s", "RAM path / map"],
        [["CacheReader(path) (mapped)", "map", f"{fmt_s(op['map_s_best'])} (best of {len(op['map_s'])})", ""],
         ["CacheReader(path, mmap=False)", op.get("ram_source", "-"),
          fmt_s(op["ram_s"]) if op["ram_s"] else f"skipped: {op['ram_skipped']}",
          f"{op['ram_vs_map']:.0f}x" if op["ram_vs_map"] else "-"]]),
        f"Same file, page cache warm. The RAM path reads it whole, widening float16 to float32 "
        f"(held {op.get('ram_held_dtype')}); the map reads nothing at open. {cpu}."))

    rps, f = g["rows_per_s_median"], g["paired"]["map_vs_numpy_gather"]
    out.append(("3. Random gathers, page cache warm", md_table(
        ["N x C (fp16)", "map get (f32)", "numpy a16[b].astype(f32)", "map / numpy f32", "map raw a16[b]",
         "numpy a16[b]", "raw map / numpy", "today's reader (RAM f32)", "map / today", "floor", "verdict"],
        [[f"{n:,} x {c}", rate(rps["map_get"]), rate(rps["numpy_f32"]), shown(f),
          rate(rps["map_raw"]), rate(rps["numpy_raw"]), f"{g['map_raw_vs_numpy_raw']:.2f}",
          fmt_rate(rps.get("ram_get")), f"{g['map_vs_ram_reader']:.2f}" if g["map_vs_ram_reader"] else "-",
          f["limit"], f["verdict"]]]),
        f"rows/s; {g['batches']} random batches of {g['batch']} (shuffled epochs), medians of {g['repeats']} "
        f"interleaved rounds after a warm-up round (the side going first rotates); each ratio the median of the "
        f"round-by-round ratios, the floor's ±its spread with each round's ratio, its verdict decided on them "
        f"(bench.paired: a floor nearer 1 than the spread is UNMEASURABLE). numpy: the file's float16 logits read "
        f"into one array in RAM (np.fromfile at "
        f"the dataset's offset); 'raw' sides return float16 (no conversion). Rows checked equal on all sides. {cpu}."))

    fl4 = S.FLOORS["pss_map_vs_file"][1]
    rows4 = []
    for mode, m in mem.items():
        if m is None:
            rows4.append(["mmap=False", 0, "-", "skipped: not even one fits the available memory"] + [""] * 8)
            continue
        rows4.append([{"map": "mapped (default)", "ram": "mmap=False"}[mode], m["processes"], "/".join(m["sources"]),
                      fmt_gb(m["pss_sum"]), f"{m['pss_vs_file']:.2f}", fmt_gb(m["pss_cache_map_sum"]),
                      fmt_gb(m["pss_anon_sum"]), fmt_gb(m["pss_before_open_sum"]), f"{m['pss_net_vs_file']:.2f}",
                      rate(float(np.mean(m["epoch_rows_per_s"]))),
                      f"<= {fl4}" if mode == "map" else "", verdict(m["pss_vs_file"], fl4, False) if mode == "map"
                      else ""])
    ram_note = "" if mem["ram"] is None or mem["ram"]["processes"] == readers else (
        f" mmap=False ran {mem['ram']['processes']} processes, not {readers}: each holds "
        f"{fmt_gb(S.ram_budget(spec))} and no more fit the memory available (keeping 1.5 GiB free).")
    out.append((f"4. Memory of {readers} reader processes on one file ({fmt_gb(size)})", md_table(
        ["reader", "processes", "source", "Pss sum", "x file", "of it: cache map", "of it: anon",
         "Pss before open (sum)", "net x file", "epoch rows/s each", "floor", "verdict"], rows4),
        f"Each process opens CacheReader, gathers every row once in a random order (batches of {S.BATCH}), then "
        f"waits; Pss (/proc/PID/smaps_rollup) is read while all are alive. 'cache map' is the Pss of their maps of "
        f"the file (shared pages count once in the sum); 'before open' is the interpreter with numpy, h5py and store "
        f"imported (no MXNet), and 'net' the Pss sum less it: what the readers add.{ram_note} {cpu}, the processes "
        f"sharing {report['machine']['cpus']} cores."))

    names = {"random": "map, random order", "sequential": "map, key order",
             "random_no_readahead": "map, random order, no read-ahead (MADV_RANDOM on the map)",
             "random_read_first": "map, random order, after one plain read of the file"}
    rows5 = [[label, f"{cold[k]['resident_after_evict']:.1%}", fmt_s(cold[k]["open_s"]), fmt_s(cold[k]["epoch_s"]),
              rate(cold[k]["rows_per_s"]), fmt_s(cold[k]["total_s"]), f"{cold[k]['resident_after_epoch']:.0%}"]
             for k, label in names.items()]
    pr = cold["plain_read"]
    rows5.append(["plain read of the file (64 MiB reads)", f"{pr['resident_after_evict']:.1%}", "", "",
                  f"{pr['bytes_per_s'] / 1e6:.0f} MB/s", fmt_s(size / pr["bytes_per_s"]), "100%"])
    if cold["ram_open"]:
        rows5.append(["mmap=False (reads it all at open)", f"{cold['ram_open']['resident_after_evict']:.1%}",
                      fmt_s(cold["ram_open"]["open_s"]), "", "", fmt_s(cold["ram_open"]["open_s"]), ""])
    out.append(("5. The first epoch from disk (page cache dropped)", md_table(
        ["reader", "file resident before", "open s", "epoch s", "rows/s", "total s", "resident after"], rows5),
        f"Before each line the file's pages are dropped (fsync, POSIX_FADV_DONTNEED; no process maps it) and the "
        f"share still resident is measured with mincore. One epoch = {cold['rows']:,} rows"
        f"{'' if cold['rows'] == n else f' (of {n:,}: a part of one, in a quick run)'} in batches of {S.BATCH}; 'total' "
        f"includes the plain read where one comes first. The reader leaves the kernel's default read-ahead on its "
        f"map; the third line turns it off (MADV_RANDOM) on the same map. A VM's "
        f"host may cache the disk below the guest: 'cold' means not in this machine's page cache. {cpu}."))

    if mv:
        mr, why, views, mv_rows = mv["readers"], report["multiview_choice"], mv["views"], mv["rows"]
        out.append((f"6. A cache of {views} views ({fmt_gb(mv['write']['file_bytes'])})", md_table(
            ["N x V x C", "file", "write rows/s", "compaction s", "map open s", "map get rows/s",
             "mmap=False source", "mmap=False rows/s", "map / mmap=False", f"Pss of {mr['processes']} mapped readers",
             "x file"],
            [[f"{mv_rows:,} x {views} x {c}", fmt_gb(mv["write"]["file_bytes"]), rate(mv["write"]["rows_per_s"]),
              fmt_s(mv["write"]["compaction_s"]), fmt_s(min(mv["map_open_s"])), rate(mv["map_rows_per_s"]),
              mv["other_source"], rate(mv["other_rows_per_s"]), f"{mv['map_vs_other']:.1f}",
              fmt_gb(mr["pss_sum"]), f"{mr['pss_vs_file']:.2f}"]]),
            f"{why}. Written in key order, {mv['write']['batch']} rows a write (set-up). Gathers: {mv['batches']} "
            f"random batches of {S.BATCH} (sample, view) keys from the map ({mv['resident_before_gather']:.0%} of the "
            f"file in the page cache before"
            f"{'' if mv['resident_before_gather'] >= 0.9 else ': one round, partly from disk'}), "
            f"{mv['other_batches']} from CacheReader(mmap=False), which reads from RAM only when the cache fits its "
            f"memory budget (half the available memory). Each reader process gathers "
            f"{'every key once' if mr['each_reads'] == 'every key' else 'every sample once in one view (i mod V)'}. "
            f"{cpu}."))
    return out


DESCRIPTION = ("Reading a finished kdcache cache at ImageNet-1k size: the memory-mapped reader vs today's RAM path "
               "and numpy (open, gathers warm and cold, memory of several reader processes). Prints markdown tables "
               "and writes a JSON report.")


def params(parser, args):
    """The sizes of a full or a quick run, --rows and --classes over them."""
    p = dict(QUICK if args.quick else FULL)
    p.update({k: getattr(args, k) for k in ("rows", "classes") if getattr(args, k) is not None})
    return p


def run(kids, args, p, root):
    """The six sections in the scratch folder: the report (its reader processes are started by the sections)."""
    log(f"{'quick' if args.quick else 'full'} run, {p['rows']:,} x {p['classes']}, temp dir {root}")
    busy = []
    res = measure(args, p, root, np.random.default_rng(args.seed), busy)
    # The gathers' floor is timed: decided on the paired rounds. The Pss floor is a size, measured once: the
    # pages the readers hold do not come and go with other processes' load as a timing does.
    pf = res["gather"]["paired"]
    ratios = {"map_vs_numpy_gather": pf["map_vs_numpy_gather"]["measured"],
              "pss_map_vs_file": res["readers"]["map"]["pss_vs_file"]}
    op, value = S.FLOORS["pss_map_vs_file"]
    verdicts = {"map_vs_numpy_gather": pf["map_vs_numpy_gather"]["verdict"],
                "pss_map_vs_file": verdict(ratios["pss_map_vs_file"], value, op == ">=")}
    ram = res["readers"]["ram"]
    return {
        **ratios,
        "pss_ram_vs_file": ram["pss_vs_file"] if ram else None,
        "ram_readers": ram["processes"] if ram else 0,
        "open_ram_vs_map": res["open"]["ram_vs_map"],
        "map_vs_ram_reader_gather": res["gather"]["map_vs_ram_reader"],
        "rows_match": res["gather"]["rows_match"] and (res["multiview"] or {}).get("rows_match", True),
        **res,
        "floors": {k: {"op": op, "value": v} for k, (op, v) in S.FLOORS.items()},
        "paired": pf,
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()),
        "other_cores_worst": max((b for b in busy if b is not None), default=None),
        "seed": args.seed, "readers_asked": args.readers,
    }


def show(report):
    """The six sections and the floors, from the report alone."""
    print(heading("kdcache: reading a finished cache at scale", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    warn = busy_warning(report["other_cores_worst"], "this run")
    if warn:
        print(warn)
    for title, table, note in sections(report):
        print(section(title, table, note))
    print("## Floors on paired rounds\n\n" + floors_table(report["paired"]) + "\n")
    print(verdicts_line(report["verdicts"]))
    print("\n" + for_the_manual(render(report)))
