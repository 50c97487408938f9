"""Producer benchmarks: the cache builder's rows/s beside the bare teacher forward, and two shards vs one.

    PYTHONPATH=. python -m bench.producer [--quick] [--out bench/results/producer.json] [--tmp DIR]

This process never imports MXNet. Every MXNet process is a child started with
OMP_NUM_THREADS=1 (the only knob that limits MXNet's compute threads, and it must be set
before `import mxnet`), so no side gets more cores than the other. The teacher is a small
Gluon CNN built and exported here (explicit prefix, fixed seed); the data set is `synthetic`.

1. Producer overhead: `python -m kdcache.cache_builder --threads 1` filling a fresh cache offline vs a
   bare loop of the same teacher over the same batches in key order (make_views + forward, no
   store), both in a fresh child process. Both sides time only their work loop (the CLI's
   reported rows_per_s; the bare loop times itself the same way, after the same warm-up), so
   process start-up, the MXNet import and the data set load are left out. Interleaved, best
   of the repeats.                                                       floor: ratio >= 0.9
2. Two shards on two cores, on a data set in an .npz file: `--shards 2` (one command that forks
   two shard processes after loading; the verdict) and two producers (`--shard 0/2`,
   `--shard 1/2`, one thread each) started at once on a fresh cache vs one producer: wall time
   from start to the end of both
   processes (start-up and compaction included on both sides), and the aggregate of the rows/s
   each process reports. The 2-shard cache must be complete and hold the single producer's
   logits (within one float16 step; bitwise identity is reported too).  floor: ratio >= 1.6
3. Size of the finished cache and the teacher's forward time per batch (informative).
4. The teacher against this core's peak: GFLOP/s per core of the bare forward and of the producer's loop
   (2 x the multiply-adds bench.flops counts on the exported symbol) beside the float32 peak a child
   measures (before section 1 and after section 2; the higher counts). A figure above 1.1x the peak, or
   from a process that used more than 1.1 cores, is INVALID and the command fails (exit 1).

Each run also records how many cores other processes kept busy meanwhile (/proc/stat minus this
benchmark's own CPU time), so a report taken on a shared machine says how shared it was.

This module is the command (sizes, section 3, the report); sections 1 and 2 are in
bench.producer_sections, the MXNet processes (teacher export, bare loop) in bench.producer_children.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file: import the repo's packages, not this directory's
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import shutil  # noqa: E402
import time  # noqa: E402

from bench.common import (Children, busy_warning, floors_line, heading, machine, machine_line,  # noqa: E402
    md_table, python_m, rate, for_the_manual, scratch_dir, section, spread, utc_now, verdict, write_report)
from bench.cli import out_option, parse_args, quick_option, tmp_option  # noqa: E402
from bench.flops import cpu_id, gflops_table, invalid_lines, peak_line, teacher_figures  # noqa: E402
from bench.producer_children import CLASSES, SHAPE, TEACHER_WIDTHS  # noqa: E402
from bench.producer_sections import FLOORS, THREADS, bench_overhead, bench_shards, log, write_npz  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "producer.json")

# Sizes: full run (~4 min on 2 cores) and --quick (~1 min). Section 2 reads shard_n rows from
# an .npz file: enough work that the ~2.5 s start-up of a process (MXNet import, data load and
# digest, teacher load) is a small part of the wall time, as it is for any real data set.
FULL = dict(n=8000, shard_n=160000, batch=128, overhead_repeats=3, shard_repeats=3)
QUICK = dict(n=3000, shard_n=3000, batch=128, overhead_repeats=3, shard_repeats=1)

OPTIONS = [
    quick_option("smaller data set, fewer repeats (figures are noisier)"),
    out_option(DEFAULT_OUT),
    tmp_option("directory for the temporary teacher and caches (default: the system temp dir); everything written "
               "there is removed"),
]


# -- 4. against the peak ------------------------------------------------------------------------------
def against_peak(r1, teacher, peaks, batch):
    """The bare forward (its median full batch) and the producer's loop (best run) as GFLOP/s per core,
    beside the higher of the measured peaks."""
    peak = max(peaks, key=lambda x: x["gflops"])
    macs = teacher["macs_per_image"]["macs"]
    shape = [int(s) for s in SHAPE.split("x")]
    rps, cpu = r1["rows_per_s_all"]["producer"], r1["cpu_per_run"]["producer"]
    best = max(range(len(rps)), key=rps.__getitem__)
    rows = [teacher_figures("bench teacher, bare forward (median batch)", shape, macs,
                            batch / (r1["bare_forward_ms_per_batch_median"] / 1e3), r1["bare_cores_used"], peak),
            teacher_figures("bench teacher in the producer (whole loop)", shape, macs, rps[best],
                            cpu[best]["own_cores"], peak)]
    cpu_ident = cpu_id()
    note = (peak_line(peak, cpu_ident) + f" (before section 1: {peaks[0]['gflops']:.1f}, after section 2: "
            f"{peaks[-1]['gflops']:.1f}.) Multiply-adds: {macs:,} per image, counted by bench.flops on the exported "
            f"symbol (Convolution, FullyConnected; BatchNorm, activations and pooling not counted). Cores used: "
            f"CPU s / wall s of the bare loop; of the whole producer process (start-up included). A figure above "
            f"1.1x the peak, or from more than 1.1 cores, is INVALID.")
    invalid = invalid_lines(rows)
    return ({"gflops": rows, "peak": peak, "peaks_gflops": [x["gflops"] for x in peaks], "cpu": cpu_ident,
             "invalid": invalid, "valid": not invalid}, gflops_table(rows), note)


# -- main -----------------------------------------------------------------------------------------
def render(report):
    """[(title, markdown table)]: the producer against the bare teacher and two shards against one (with their
    floors), then the teacher against the core's measured peak, from the JSON report alone."""
    o, t = report["sections"]["producer_vs_bare_forward"], report["sections"]["two_shards_vs_one"]
    fl, v = report["floors"], report["verdicts"]

    def floor(name):
        return f"{fl[name]['op']} {fl[name]['value']:g}"
    best, med = o["rows_per_s_best"], o["rows_per_s_median"]
    check = t["checks"][0] if t.get("checks") else {}
    same = ("identical" if report["two_shard_cache_identical"] else
            f"equal within one float16 step ({check.get('rows_differing', '?')} rows of {t['n']:,} differ by one step)"
            if report["two_shard_cache_equal"] else "NOT equal")
    rows = [[f"producer rows/s vs the bare teacher forward ({o['threads']} thread, batch {o['batch']}, {o['n']:,} rows)",
             f"{rate(best['producer'])} vs {rate(best['bare'])}: {o['producer_vs_bare_forward']:.2f} "
             f"(medians {o['producer_vs_bare_forward_median']:.2f})", floor("producer_vs_bare_forward"),
             v["producer_vs_bare_forward"]],
            [f"two shards vs one producer on two cores, `--shards 2`, wall time with start-up, {t['n']:,} rows from "
             f"an .npz file", f"{t['wall_s_best']['one']:.1f} s vs {t['wall_s_forked_best']:.1f} s: "
             f"{t['two_shards_vs_one']:.2f}", floor("two_shards_vs_one"), v["two_shards_vs_one"]],
            ["the same, summed work-loop rows/s", f"{rate(t['rows_per_s_aggregate_best']['one'])} vs "
             f"{rate(t['rows_per_s_aggregate_best']['two'])}: {t['two_shards_vs_one_aggregate']:.2f}",
             floor("two_shards_vs_one_aggregate"), v["two_shards_vs_one_aggregate"]],
            ["the same, two separate commands `--shard 0/2` and `--shard 1/2` (each loads the data)",
             f"{t['two_shards_vs_one_separate_processes']:.2f}", "(info)", ""],
            ["2-shard cache vs one producer's", same, "equal", "PASS" if report["two_shard_cache_equal"] else "MISS"]]
    pk = report["peak"]
    title = (f"The teacher against this core's measured peak, {pk['gflops']:.1f} GFLOP/s per core (float32 "
             f"{pk['n']}x{pk['n']} matrix product, one thread, best of {pk['repeats']}, {pk['source']}; `mx.nd.dot` "
             f"{pk['mx.nd.dot']['gflops']:.1f}; " + ", ".join(f"{g:.1f}" for g in report.get("peaks_gflops", []))
             + " before and after the other sections):")
    return [("", md_table(["comparison", "measured", "floor", "verdict"], rows, pad=False)),
            (title, gflops_table(report["gflops"]))]


def main(argv=None):
    _, args = parse_args(
        "python -m bench.producer",
        "kdcache producer benchmarks: the cache builder vs the bare teacher forward (1 thread), two shards on two "
        "cores vs one producer. Prints markdown tables and writes a JSON report.", OPTIONS, argv,
        default_out=DEFAULT_OUT)

    p = QUICK if args.quick else FULL
    dataset_arg = f"synthetic:n={p['n']},classes={CLASSES},shape={SHAPE}"
    m = machine(mxnet=True, omp_num_threads=THREADS)  # what every MXNet child runs with
    t_start = time.perf_counter()
    root = scratch_dir(args.tmp, "kdcache-bench-producer-")
    kids = Children()
    sections = []
    try:
        log(f"{'quick' if args.quick else 'full'} run, {dataset_arg}, temp dir {root}")
        prefix = os.path.join(root, "teacher", "benchteacher")
        os.makedirs(os.path.dirname(prefix))
        teacher = kids.run(python_m("bench.producer_children", "export", "--teacher", prefix), "teacher export")
        peaks = [kids.run(python_m("bench.producer_children", "peak"), "peak")]
        log("1/2 producer vs bare teacher forward")
        r1, t1, n1 = bench_overhead(root, kids, prefix, dataset_arg, p)
        sections.append(("1. Producer vs bare teacher forward (1 thread each)", t1, n1))
        log(f"2/2 two shards vs one producer ({p['shard_n']:,} rows from an .npz file)")
        shard_data = write_npz(root, p["shard_n"])
        r2, t2, n2 = bench_shards(root, kids, prefix, shard_data, p)
        sections.append(("2. Two shards on two cores vs one producer", t2, n2))
        peaks.append(kids.run(python_m("bench.producer_children", "peak"), "peak"))
    finally:
        kids.stop_all()
        shutil.rmtree(root, ignore_errors=True)
    runtime = time.perf_counter() - t_start

    n, c = p["n"], CLASSES
    cache_bytes = r1["cache_bytes"]
    t3 = md_table(["cache (N x C, fp16)", "bytes", "bytes/row", "teacher forward ms/batch (median)",
                   "make_views ms/batch", "batch", "teacher parameters"],
                  [[f"{n:,} x {c}", f"{cache_bytes:,}", f"{cache_bytes / n:.1f}",
                    f"{r1['bare_forward_ms_per_batch_median']:.1f}", f"{r1['bare_make_views_ms_per_batch_median']:.2f}",
                    p["batch"], f"{teacher['parameters']:,}"]])
    n3 = (f"Finished .h5 of a section 1 run (logits as float16 plus the 1-byte done flag per row and HDF5 "
          f"metadata). Forward and make_views times: median over the full batches of the best bare run, "
          f"1 thread. Teacher: Conv-BN-ReLU-MaxPool x {len(TEACHER_WIDTHS)} (widths "
          f"{', '.join(map(str, TEACHER_WIDTHS))}), global average pool, Dense({c}).")
    sections.append(("3. Cache size and teacher forward time", t3, n3))
    r4, t4, n4 = against_peak(r1, teacher, peaks, p["batch"])
    sections.append(("4. The teacher against this core's peak", t4, n4))

    ratios = {"producer_vs_bare_forward": r1["producer_vs_bare_forward"],
              "two_shards_vs_one": r2["two_shards_vs_one"],
              "two_shards_vs_one_aggregate": r2["two_shards_vs_one_aggregate"]}
    verdicts = {k: verdict(v, FLOORS[k]) for k, v in ratios.items()}
    report = {
        **ratios,
        "two_shards_vs_one_separate_processes": r2["two_shards_vs_one_separate_processes"],  # (info)
        "two_shard_cache_equal": r2["two_shard_cache_equal"],
        "two_shard_cache_identical": r2["two_shard_cache_identical"],
        "rows_per_s": {"bare_forward": r1["rows_per_s_best"]["bare"],
                       "producer": r1["rows_per_s_best"]["producer"],
                       "one_producer_wall": r2["rows_per_s_wall_best"]["one"],
                       "two_shards_wall": r2["rows_per_s_wall_best"]["two"],
                       "one_producer_reported": r2["rows_per_s_aggregate_best"]["one"],
                       "two_shards_reported_sum": r2["rows_per_s_aggregate_best"]["two"]},
        "cache_bytes": cache_bytes,
        "cache_bytes_per_row": cache_bytes / n,
        "teacher_forward_ms_per_batch": r1["bare_forward_ms_per_batch_median"],
        "other_processes_cores_mean": {"producer_vs_bare_forward": r1["other_cores_mean"],
                                       "two_shards_vs_one": r2["other_cores_mean"]},
        "floors": {k: {"op": ">=", "value": v} for k, v in FLOORS.items()},
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()) and r2["two_shard_cache_equal"],
        "sections": {"producer_vs_bare_forward": r1, "two_shards_vs_one": r2},
        "teacher": {"widths": list(TEACHER_WIDTHS), "classes": c, "shape": SHAPE, **teacher},
        **r4,
        "dataset": dataset_arg,
        "shard_dataset": f"npz of synthetic:n={p['shard_n']},classes={CLASSES},shape={SHAPE} (uint8 NHWC)",
        "machine": m,
        "date": utc_now(),
        "quick": bool(args.quick),
        "runtime_s": runtime,
    }

    print(heading("kdcache producer benchmark", args.quick, runtime))
    print(machine_line(m) + "\n")
    for title, table, note in sections:
        print(section(title, table, note))
    warning = busy_warning(spread([r1["other_cores_mean"], r2["other_cores_mean"]])["max"],
                           "a section (section 2 the most: it needs both cores)")
    if warning:
        print(warning)
    missed = [k for k, v in verdicts.items() if v != "PASS"]
    if not r2["two_shard_cache_equal"]:
        missed.append("two_shard_cache_equal")
    print(floors_line(missed))
    print("\n" + for_the_manual(render(report)))

    write_report(args.out, report)
    print(f"Report: {args.out}")
    if not report["valid"]:  # the report keeps the evidence; the command fails
        print("error: per-core figures one core cannot have produced:\n" + "\n".join(r4["invalid"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
