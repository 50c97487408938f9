"""The store benchmark's command: its sizes and options, the run (six sections) and what it prints."""
import os

from bench.common import limit_threads

# Before numpy loads: one BLAS/OpenMP thread, so the figures do not depend on the core count.
limit_threads(os.environ, force=False)

import numpy as np  # noqa: E402

from bench.store import gather, write  # noqa: E402
from bench.common import (heading, machine_line, make_log, md_table, rate, for_the_manual, section,  # noqa: E402
                          verdict)
from bench.paired import floors_table, shown, verdicts_line  # noqa: E402
from bench.cli import RUN, out_option, quick_option, tmp_option  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "store.json")

# Sizes: full run (~70 s on 2 cores) and --quick (~15 s). *_repeats: the interleaved rounds each paired floor is
# decided on (bench.paired): 9 where a round is cheap (from nine pairs the median's interval leaves out the
# highest and lowest ratio), 5 for the per-sample files (3.4 s a round); 3 in a quick run.
FULL = dict(gather_n=200_000, gather_batches=2000, gather_repeats=9,
            files_n=20_000, files_batches=50, files_repeats=5,
            write_n={10: 100_000, 1000: 20_000}, write_repeats=9,
            bytes_n=20_000, ooc_batches=200, ooc_repeats=3)
QUICK = dict(gather_n=50_000, gather_batches=1000, gather_repeats=3,
             files_n=5_000, files_batches=20, files_repeats=3,
             write_n={10: 20_000, 1000: 4_000}, write_repeats=3,
             bytes_n=4_000, ooc_batches=50, ooc_repeats=2)

FLOORS = {**gather.FLOORS, **write.FLOORS}

OPTIONS = [
    quick_option("smaller sizes, under a minute (figures are noisier)"),
    out_option(DEFAULT_OUT),
    tmp_option("directory for the caches and files, the run's folder kept there for inspection (default: a "
               "temporary folder, removed)"),
    Option("--seed", "seed of the synthetic logits and batches", type=Int(0), default=0, metavar="S", group=RUN),
]

log = make_log("bench.store")


def render(report):
    """[(title, markdown table)]: the comparisons against their floors, then the store's other figures, from the
    JSON report alone."""
    sec, r, v, fl = report["sections"], report["rows_per_s"], report["verdicts"], report["floors"]
    g, f = sec["gather_vs_numpy"], sec["gather_vs_per_sample_files"]
    pf = report.get("paired", {})  # a report from before the floors were paired has none: its single ratios

    def floor(name):
        return f"{fl[name]['op']} {fl[name]['value']:g}"

    def ratio(name, digits):
        return shown(pf[name]) if name in pf else f"{report[name]:.{digits}f}"

    def rows_per_s(section, side, best):  # medians of the rounds where the report has them, else the best
        return rate(section.get("rows_per_s_median", section["rows_per_s_best"])[side] if pf else best)
    rows = [[f"gather, random batches of {g['batch']}, {g['n']:,} x {g['c']}, in RAM",
             f"{rows_per_s(g, 'kdcache', r['gather_kdcache'])} rows/s",
             f"numpy on the same array in RAM: {rows_per_s(g, 'numpy_held', g['rows_per_s_best']['numpy_held'])}",
             f"{ratio('gather_vs_numpy', 2)} ({g['gather_vs_numpy_float16_array']:.2f} vs the float16 array, "
             f"{g['gather_vs_numpy_f32']:.2f} vs float16 + conversion)", floor("gather_vs_numpy"), v["gather_vs_numpy"]],
            [f"gather vs one .npy file per sample (torchdistill's layout), {f['n']:,} x {f['c']}",
             f"{rows_per_s(f, 'kdcache', r['files_kdcache'])} rows/s",
             f"{rows_per_s(f, 'per_file', r['files_per_sample'])} rows/s",
             ratio("gather_vs_per_sample_files", 0), floor("gather_vs_per_sample_files"),
             v["gather_vs_per_sample_files"]]]
    for c, what in (("10", "writes in shuffled training order vs index order, C=10"), ("1000", "the same, C=1000")):
        name, w = f"shuffled_vs_ordered_write_c{c}", sec["write_order"][f"c{c}"]
        med = w.get("rows_per_s_median_with_close", {})
        rows.append([what, f"{rate(med['shuffled'] if pf else r[f'write_c{c}_shuffled'])} rows/s",
                     rate(med["ordered"] if pf else r[f"write_c{c}_ordered"]), ratio(name, 2), floor(name), v[name]])
    o, vis = sec["out_of_core"], report["visibility_ms"]
    bpr, disk = report["bytes_per_row"], report["bytes_per_row_on_disk"]
    others = [[f"gather out of core (memory_budget=0), batches of {g['batch']}",
               f"{rate(o['rows_per_s_best'])} rows/s ({o['ms_per_batch_best']:.1f} ms a batch), "
               f"{o['in_ram_vs_out_of_core']:.0f}x slower than in RAM"],
              ["a row a producer process commits is visible to a reader within",
               f"{vis['median']:.1f} ms (median; p95 {vis['p95']:.1f} ms)"]]
    others += [[f"bytes per row, {k.replace('@', ' at ')}: codec / on disk in a {sec['bytes_per_row']['n']:,}-row file",
                f"{bpr[k]} / {disk[k]:.1f}"] for k in bpr]
    how = (f"Rows/s: medians of the interleaved rounds; ratio: the median of the round-by-round ratios ±its spread, "
           f"each round's ratio in brackets (bench.paired); a floor nearer 1 than the spread is UNMEASURABLE." if pf
           else "")
    return [(how, md_table(["comparison", "kdcache", "baseline", "ratio", "floor", "verdict"], rows, pad=False)),
            ("", md_table(["measure", "value"], others, pad=False))]


DESCRIPTION = ("kdcache store benchmarks: gather vs numpy and vs one file per sample, shuffled vs ordered writes, "
               "bytes per row, out-of-core gather. Prints markdown tables and writes a JSON report.")


def params(parser, args):
    """The sizes of a full or a quick run."""
    return QUICK if args.quick else FULL


def run(kids, args, p, root):
    """The six sections in the scratch folder: the report."""
    rng = np.random.default_rng(args.seed)
    log(f"{'quick' if args.quick else 'full'} run, temp dir {root}")
    log("1/6 gather vs numpy")
    r1, ctx = gather.bench_gather_vs_numpy(root, p, rng)
    log("2/6 gather vs one file per sample")
    r2 = gather.bench_vs_per_sample_files(root, p, rng)
    log("3/6 shuffled vs ordered writes")
    r3 = write.bench_write_order(root, p, rng)
    log("4/6 bytes per row")
    r4 = write.bench_bytes_per_row(root, p, rng)
    log("5/6 out-of-core gather")
    r5 = gather.bench_out_of_core(p, ctx)
    ctx[2].close()
    log("6/6 visibility of new rows to a live reader")
    r6 = write.bench_visibility(root, p, kids)

    pf = {**r1["paired"], **r2["paired"], **r3["c10"]["paired"], **r3["c1000"]["paired"]}
    ratios = {k: f["measured"] for k, f in pf.items()}  # the paired medians
    verdicts = {k: f["verdict"] for k, f in pf.items()}
    for name, b in r4["bytes_per_row"].items():
        codec = name.split("@")[0]
        if codec.startswith("topk:"):
            verdicts[f"bytes_per_row {name}"] = verdict(b, write.topk_floor(codec), False)
    floors = {k: {"op": ">=", "value": v} for k, v in FLOORS.items()}
    floors.update({f"bytes_per_row {k}": {"op": "<=", "value": v} for k, v in r4["topk_floor"].items()})
    return {
        **ratios,
        "gather_vs_numpy_f32": r1["gather_vs_numpy_f32"],
        "gather_vs_numpy_float16_array": r1["gather_vs_numpy_float16_array"],
        "bytes_per_row": r4["bytes_per_row"],
        "bytes_per_row_on_disk": r4["bytes_per_row_on_disk"],
        "visibility_ms": {"median": r6["median_ms"], "p95": r6["p95_ms"], "max": r6["max_ms"]},
        "rows_per_s": {
            "gather_kdcache": r1["rows_per_s_best"]["kdcache"],
            "gather_numpy_f32": r1["rows_per_s_best"]["numpy_f32"],
            "gather_numpy_raw": r1["rows_per_s_best"]["numpy_raw"],
            "files_kdcache": r2["rows_per_s_best"]["kdcache"],
            "files_per_sample": r2["rows_per_s_best"]["per_file"],
            **{f"write_c{c}_{k}": v for c in p["write_n"]
               for k, v in r3[f"c{c}"]["rows_per_s_best_with_close"].items()},
            **{f"write_c{c}_{k}_without_close": v for c in p["write_n"]
               for k, v in r3[f"c{c}"]["rows_per_s_best_without_close"].items()},
            "gather_out_of_core": r5["rows_per_s_best"],
        },
        "floors": floors,
        "paired": pf,
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()),
        "sections": {"gather_vs_numpy": r1, "gather_vs_per_sample_files": r2, "write_order": r3,
                     "bytes_per_row": r4, "out_of_core": r5, "visibility": r6},
        "seed": args.seed,
    }


SECTIONS = [("1. Gather from a cache in RAM vs numpy fancy indexing", "gather_vs_numpy", gather.gather_vs_numpy_section),
            ("2. Gather vs one .npy file per sample (torchdistill's old layout)", "gather_vs_per_sample_files",
             gather.vs_per_sample_files_section),
            ("3. Writes in shuffled training order vs index order", "write_order", write.write_order_section),
            ("4. Bytes per row by codec", "bytes_per_row", write.bytes_per_row_section),
            ("5. Out-of-core gather (memory_budget=0)", "out_of_core", gather.out_of_core_section),
            ("6. A committed row becomes visible to a reader", "visibility", write.visibility_section)]


def show(report):
    """The six sections and the floors, from the report alone."""
    print(heading("kdcache store benchmark", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    for title, key, table_and_note in SECTIONS:
        print(section(title, *table_and_note(report["sections"][key])))
    print("## Floors on paired rounds\n\n" + floors_table(report["paired"]) + "\n")
    print(verdicts_line(report["verdicts"]))
    print("\n" + for_the_manual(render(report)))
