"""The producer benchmark's command: its sizes and options, the run (the four sections) and what it prints."""
import os
import sys

from bench.common import (busy_warning, heading, machine_line, md_table, python_m, rate, for_the_manual, section,
                          spread)
from bench.paired import floors_table, shown, verdicts_line
from bench.cli import out_option, quick_option, tmp_option
from bench.flops import cpu_id, gflops_table, invalid_lines, peak_line, teacher_figures
from bench.producer.children import CLASSES, SHAPE, TEACHER_WIDTHS
from bench.producer.sections import (FLOORS, THREADS, bench_overhead, bench_shards, log, overhead_section,  # noqa: F401
                                     shards_section, write_npz)  # THREADS: __main__ reads it from here

DEFAULT_OUT = os.path.join("bench", "results", "producer.json")

# Sizes: full run (~6 min on 2 cores) and --quick (~1 min). Section 2 reads shard_n rows from
# an .npz file: enough work that the ~2.5 s start-up of a process (MXNet import, data load and
# digest, teacher load) is a small part of the wall time, as it is for any real data set.
# *_repeats: the interleaved rounds each floor's paired ratios come from (bench.paired): 5 of section 1
# (~10 s a round), 3 of section 2 (~80 s a round: its floors lie far from 1); 3 and 2 in a quick run.
FULL = dict(n=8000, shard_n=160000, batch=128, overhead_repeats=5, shard_repeats=3)
QUICK = dict(n=3000, shard_n=3000, batch=128, overhead_repeats=3, shard_repeats=2)

OPTIONS = [
    quick_option("smaller data set, fewer repeats (figures are noisier)"),
    out_option(DEFAULT_OUT),
    tmp_option("directory for the teacher and caches, kept there for inspection (default: a temporary folder, "
               "removed)"),
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
    invalid = invalid_lines(rows)
    return {"gflops": rows, "peak": peak, "peaks_gflops": [x["gflops"] for x in peaks], "cpu": cpu_id(),
            "invalid": invalid, "valid": not invalid}


def peak_note(report):
    """Section 4's note, from the report alone."""
    peaks, macs = report["peaks_gflops"], report["teacher"]["macs_per_image"]["macs"]
    return (peak_line(report["peak"], report["cpu"]) + f" (before section 1: {peaks[0]:.1f}, after section 2: "
            f"{peaks[-1]:.1f}.) Multiply-adds: {macs:,} per image, counted by bench.flops on the exported "
            f"symbol (Convolution, FullyConnected; BatchNorm, activations and pooling not counted). Cores used: "
            f"CPU s / wall s of the bare loop; of the whole producer process (start-up included). A figure above "
            f"1.1x the peak, or from more than 1.1 cores, is INVALID.")


# -- the manual's tables -----------------------------------------------------------------------------------------
def render(report):
    """[(title, markdown table)]: the producer against the bare teacher and two shards against one (with their
    floors), then the teacher against the core's measured peak, from the JSON report alone."""
    o, t = report["sections"]["producer_vs_bare_forward"], report["sections"]["two_shards_vs_one"]
    fl, v = report["floors"], report["verdicts"]
    pf = report.get("paired")  # a report from before the floors were paired has none: its best runs' ratios

    def floor(name):
        return f"{fl[name]['op']} {fl[name]['value']:g}"
    check = t["checks"][0] if t.get("checks") else {}
    same = ("identical" if report["two_shard_cache_identical"] else
            f"equal within one float16 step ({check.get('rows_differing', '?')} rows of {t['n']:,} differ by one step)"
            if report["two_shard_cache_equal"] else "NOT equal")
    if pf:
        med, wm, am = o["rows_per_s_median"], t["wall_s_median"], t["rows_per_s_aggregate_median"]
        measured = [f"{rate(med['producer'])} vs {rate(med['bare'])} (medians): "
                    f"{shown(pf['producer_vs_bare_forward'])}",
                    f"{wm['one']:.1f} s vs {wm['forked']:.1f} s (medians): {shown(pf['two_shards_vs_one'])}",
                    f"{rate(am['one'])} vs {rate(am['two'])} (medians): {shown(pf['two_shards_vs_one_aggregate'])}"]
    else:
        best = o["rows_per_s_best"]
        measured = [f"{rate(best['producer'])} vs {rate(best['bare'])}: {o['producer_vs_bare_forward']:.2f} "
                    f"(medians {o['producer_vs_bare_forward_median']:.2f})",
                    f"{t['wall_s_best']['one']:.1f} s vs {t['wall_s_forked_best']:.1f} s: {t['two_shards_vs_one']:.2f}",
                    f"{rate(t['rows_per_s_aggregate_best']['one'])} vs {rate(t['rows_per_s_aggregate_best']['two'])}: "
                    f"{t['two_shards_vs_one_aggregate']:.2f}"]
    rows = [[f"producer rows/s vs the bare teacher forward ({o['threads']} thread, batch {o['batch']}, {o['n']:,} rows)",
             measured[0], floor("producer_vs_bare_forward"), v["producer_vs_bare_forward"]],
            [f"two shards vs one producer on two cores, `--shards 2`, wall time with start-up, {t['n']:,} rows from "
             f"an .npz file", measured[1], floor("two_shards_vs_one"), v["two_shards_vs_one"]],
            ["the same, summed work-loop rows/s", measured[2],
             floor("two_shards_vs_one_aggregate"), v["two_shards_vs_one_aggregate"]],
            ["the same, two separate commands `--shard 0/2` and `--shard 1/2` (each loads the data)",
             f"{t['two_shards_vs_one_separate_processes']:.2f}", "(info)", ""],
            ["2-shard cache vs one producer's", same, "equal", "PASS" if report["two_shard_cache_equal"] else "MISS"]]
    pk = report["peak"]
    title = (f"The teacher against this core's measured peak, {pk['gflops']:.1f} GFLOP/s per core (float32 "
             f"{pk['n']}x{pk['n']} matrix product, one thread, best of {pk['repeats']}, {pk['source']}; `mx.nd.dot` "
             f"{pk['mx.nd.dot']['gflops']:.1f}; " + ", ".join(f"{g:.1f}" for g in report.get("peaks_gflops", []))
             + " before and after the other sections):")
    how = (f"Each ratio: the median of the run-by-run ratios of {o['repeats']} (section 1) and {t['repeats']} "
           f"(section 2) interleaved runs ±its spread, each run's ratio in brackets; the verdicts are decided on them "
           f"(bench.paired: a floor nearer 1 than the spread is UNMEASURABLE)." if pf else "")
    return [(how, md_table(["comparison", "measured", "floor", "verdict"], rows, pad=False)),
            (title, gflops_table(report["gflops"]))]


DESCRIPTION = ("kdcache producer benchmarks: the cache builder vs the bare teacher forward (1 thread), two shards on "
               "two cores vs one producer. Prints markdown tables and writes a JSON report.")


def params(parser, args):
    """The sizes of a full or a quick run."""
    return QUICK if args.quick else FULL


def run(kids, args, p, root):
    """The teacher exported, this core's peak, sections 1 and 2, the peak again: the report."""
    dataset_arg = f"synthetic:n={p['n']},classes={CLASSES},shape={SHAPE}"
    log(f"{'quick' if args.quick else 'full'} run, {dataset_arg}, temp dir {root}")
    prefix = os.path.join(root, "teacher", "benchteacher")
    os.makedirs(os.path.dirname(prefix))
    teacher = kids.run(python_m("bench.producer.children", "export", "--teacher", prefix), "teacher export")
    peaks = [kids.run(python_m("bench.producer.children", "peak"), "peak")]
    log("1/2 producer vs bare teacher forward")
    r1 = bench_overhead(root, kids, prefix, dataset_arg, p)
    log(f"2/2 two shards vs one producer ({p['shard_n']:,} rows from an .npz file)")
    shard_data = write_npz(root, p["shard_n"])
    r2 = bench_shards(root, kids, prefix, shard_data, p)
    peaks.append(kids.run(python_m("bench.producer.children", "peak"), "peak"))

    n, c = p["n"], CLASSES
    cache_bytes = r1["cache_bytes"]
    r4 = against_peak(r1, teacher, peaks, p["batch"])
    pf = {**r1["paired"], **r2["paired"]}
    ratios = {k: f["measured"] for k, f in pf.items()}  # the paired medians
    verdicts = {k: f["verdict"] for k, f in pf.items()}
    return {
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
        "paired": pf,
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()) and r2["two_shard_cache_equal"],
        "sections": {"producer_vs_bare_forward": r1, "two_shards_vs_one": r2},
        "teacher": {"widths": list(TEACHER_WIDTHS), "classes": c, "shape": SHAPE, **teacher},
        **r4,
        "dataset": dataset_arg,
        "shard_dataset": f"npz of synthetic:n={p['shard_n']},classes={CLASSES},shape={SHAPE} (uint8 NHWC)",
    }


def show(report):
    """The four sections, from the report alone; 1 when a per-core figure is one a core cannot have produced."""
    r1, r2 = report["sections"]["producer_vs_bare_forward"], report["sections"]["two_shards_vs_one"]
    n, c, teacher, cache_bytes = r1["n"], report["teacher"]["classes"], report["teacher"], report["cache_bytes"]
    t3 = md_table(["cache (N x C, fp16)", "bytes", "bytes/row", "teacher forward ms/batch (median)",
                   "make_views ms/batch", "batch", "teacher parameters"],
                  [[f"{n:,} x {c}", f"{cache_bytes:,}", f"{cache_bytes / n:.1f}",
                    f"{r1['bare_forward_ms_per_batch_median']:.1f}", f"{r1['bare_make_views_ms_per_batch_median']:.2f}",
                    r1["batch"], f"{teacher['parameters']:,}"]])
    n3 = (f"Finished .h5 of a section 1 run (logits as float16 plus the 1-byte done flag per row and HDF5 "
          f"metadata). Forward and make_views times: median over the full batches of the best bare run, "
          f"1 thread. Teacher: Conv-BN-ReLU-MaxPool x {len(teacher['widths'])} (widths "
          f"{', '.join(map(str, teacher['widths']))}), global average pool, Dense({c}).")
    sections = [("1. Producer vs bare teacher forward (1 thread each)", *overhead_section(r1)),
                ("2. Two shards on two cores vs one producer", *shards_section(r2)),
                ("3. Cache size and teacher forward time", t3, n3),
                ("4. The teacher against this core's peak", gflops_table(report["gflops"]), peak_note(report))]
    print(heading("kdcache producer benchmark", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    for title, table, note in sections:
        print(section(title, table, note))
    warning = busy_warning(spread([r1["other_cores_mean"], r2["other_cores_mean"]])["max"],
                           "a section (section 2 the most: it needs both cores)")
    if warning:
        print(warning)
    print("## Floors on paired runs\n\n" + floors_table(report["paired"]) + "\n")
    print(verdicts_line({**report["verdicts"],
                         "two_shard_cache_equal": "PASS" if r2["two_shard_cache_equal"] else "MISS"}))
    print("\n" + for_the_manual(render(report)))
    if not report["valid"]:  # the report keeps the evidence; the command fails
        print("error: per-core figures one core cannot have produced:\n" + "\n".join(report["invalid"]),
              file=sys.stderr)
        return 1
    return 0
