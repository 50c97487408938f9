"""Store micro-benchmarks: gathers, write order and bytes per row, each beside its baseline.

    PYTHONPATH=. python -m bench.store [--quick] [--out bench/results/store.json] [--tmp DIR]

Every comparison runs both sides in the same process, interleaved (the side that goes first
rotates each repeat), and keeps the best of the repeats, so machine noise hits both sides.
Sections, with the floors the store was built to meet:

1. gather from a cache held in RAM vs numpy fancy indexing on the same array  (ratio >= 0.5)
2. gather vs one .npy file per sample, torchdistill's old layout              (ratio >= 20)
3. writes in shuffled training order vs in index order, C=10 and C=1000       (ratio >= 0.5)
4. bytes per row of each codec, from the codec and measured on disk         (topk:K <= 4K+8)
5. gather from disk (memory_budget=0), informative only
6. how soon a row a producer process commits is visible to a reader, informative only

This module is the command (sizes, report); the sections are in bench.store_gather (1, 2, 5)
and bench.store_write (3, 4, 6), each floor beside the section it judges.
"""
import os
import sys

if __package__ in (None, ""):  # run as a file (python bench/store.py): import the repo's store/, not this module
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.common import limit_threads  # noqa: E402

# Before numpy loads: one BLAS/OpenMP thread, so the figures do not depend on the core count.
limit_threads(os.environ, force=False)

import shutil  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench import store_gather as gather, store_write as write  # noqa: E402
from bench.common import (floors_line, heading, machine, machine_line, make_log, md_table, rate, for_the_manual,  # noqa: E402
    scratch_dir, section, utc_now, verdict, write_report)
from bench.cli import RUN, out_option, parse_args, quick_option, tmp_option  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "store.json")

# Sizes: full run (~1 min on 2 cores) and --quick (~15 s).
FULL = dict(gather_n=200_000, gather_batches=2000, gather_repeats=5,
            files_n=20_000, files_batches=50, files_repeats=3,
            write_n={10: 100_000, 1000: 20_000}, write_repeats=5,
            bytes_n=20_000, ooc_batches=200, ooc_repeats=3)
QUICK = dict(gather_n=50_000, gather_batches=1000, gather_repeats=3,
             files_n=5_000, files_batches=20, files_repeats=2,
             write_n={10: 20_000, 1000: 4_000}, write_repeats=3,
             bytes_n=4_000, ooc_batches=50, ooc_repeats=2)

FLOORS = {**gather.FLOORS, **write.FLOORS}

OPTIONS = [
    quick_option("smaller sizes, under a minute (figures are noisier)"),
    out_option(DEFAULT_OUT),
    tmp_option("directory for the temporary caches and files (default: the system temp dir); everything written "
               "there is removed at the end"),
    Option("--seed", "seed of the synthetic logits and batches", type=Int(0), default=0, metavar="S", group=RUN),
]

log = make_log("bench.store")


def render(report):
    """[(title, markdown table)]: the comparisons against their floors, then the store's other figures, from the
    JSON report alone."""
    sec, r, v, fl = report["sections"], report["rows_per_s"], report["verdicts"], report["floors"]
    g, f = sec["gather_vs_numpy"], sec["gather_vs_per_sample_files"]
    w = sec["write_order"]

    def floor(name):
        return f"{fl[name]['op']} {fl[name]['value']:g}"
    rows = [[f"gather, random batches of {g['batch']}, {g['n']:,} x {g['c']}, in RAM", f"{rate(r['gather_kdcache'])} rows/s",
             f"numpy on the same array in RAM: {rate(g['rows_per_s_best']['numpy_held'])}",
             f"{g['gather_vs_numpy']:.2f} ({g['gather_vs_numpy_float16_array']:.2f} vs the float16 array, "
             f"{g['gather_vs_numpy_f32']:.2f} vs float16 + conversion)", floor("gather_vs_numpy"), v["gather_vs_numpy"]],
            [f"gather vs one .npy file per sample (torchdistill's layout), {f['n']:,} x {f['c']}",
             f"{rate(r['files_kdcache'])} rows/s", f"{rate(r['files_per_sample'])} rows/s",
             f"{f['gather_vs_per_sample_files']:.0f}", floor("gather_vs_per_sample_files"),
             v["gather_vs_per_sample_files"]]]
    for c, what in (("10", "writes in shuffled training order vs index order, C=10"), ("1000", "the same, C=1000")):
        name = f"shuffled_vs_ordered_write_c{c}"
        rows.append([what, f"{rate(r[f'write_c{c}_shuffled'])} rows/s", rate(r[f"write_c{c}_ordered"]),
                     f"{report[name]:.2f}", floor(name), v[name]])
    o, vis = sec["out_of_core"], report["visibility_ms"]
    bpr, disk = report["bytes_per_row"], report["bytes_per_row_on_disk"]
    others = [[f"gather out of core (memory_budget=0), batches of {g['batch']}",
               f"{rate(o['rows_per_s_best'])} rows/s ({o['ms_per_batch_best']:.1f} ms a batch), "
               f"{o['in_ram_vs_out_of_core']:.0f}x slower than in RAM"],
              ["a row a producer process commits is visible to a reader within",
               f"{vis['median']:.1f} ms (median; p95 {vis['p95']:.1f} ms)"]]
    others += [[f"bytes per row, {k.replace('@', ' at ')}: codec / on disk in a {sec['bytes_per_row']['n']:,}-row file",
                f"{bpr[k]} / {disk[k]:.1f}"] for k in bpr]
    return [("", md_table(["comparison", "kdcache", "baseline", "ratio", "floor", "verdict"], rows, pad=False)),
            ("", md_table(["measure", "value"], others, pad=False))]


def main(argv=None):
    _, args = parse_args(
        "python -m bench.store",
        "kdcache store benchmarks: gather vs numpy and vs one file per sample, shuffled vs ordered writes, bytes per "
        "row, out-of-core gather. Prints markdown tables and writes a JSON report.", OPTIONS, argv,
        default_out=DEFAULT_OUT)

    p = QUICK if args.quick else FULL
    rng = np.random.default_rng(args.seed)
    m = machine()
    t_start = time.perf_counter()
    root = scratch_dir(args.tmp, "kdcache-bench-store-")
    sections = []
    try:
        log(f"{'quick' if args.quick else 'full'} run, temp dir {root}")
        log("1/6 gather vs numpy")
        r1, t1, n1, ctx = gather.bench_gather_vs_numpy(root, p, rng)
        sections.append(("1. Gather from a cache in RAM vs numpy fancy indexing", t1, n1))
        log("2/6 gather vs one file per sample")
        r2, t2, n2 = gather.bench_vs_per_sample_files(root, p, rng)
        sections.append(("2. Gather vs one .npy file per sample (torchdistill's old layout)", t2, n2))
        log("3/6 shuffled vs ordered writes")
        r3, t3, n3 = write.bench_write_order(root, p, rng)
        sections.append(("3. Writes in shuffled training order vs index order", t3, n3))
        log("4/6 bytes per row")
        r4, t4, n4 = write.bench_bytes_per_row(root, p, rng)
        sections.append(("4. Bytes per row by codec", t4, n4))
        log("5/6 out-of-core gather")
        r5, t5, n5 = gather.bench_out_of_core(p, ctx)
        sections.append(("5. Out-of-core gather (memory_budget=0)", t5, n5))
        ctx[2].close()
        log("6/6 visibility of new rows to a live reader")
        r6, t6, n6 = write.bench_visibility(root, p)
        sections.append(("6. A committed row becomes visible to a reader", t6, n6))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runtime = time.perf_counter() - t_start

    ratios = {
        "gather_vs_numpy": r1["gather_vs_numpy"],
        "gather_vs_per_sample_files": r2["gather_vs_per_sample_files"],
        "shuffled_vs_ordered_write_c10": r3["c10"]["shuffled_vs_ordered_write_c10"],
        "shuffled_vs_ordered_write_c1000": r3["c1000"]["shuffled_vs_ordered_write_c1000"],
    }
    verdicts = {k: verdict(v, FLOORS[k]) for k, v in ratios.items()}
    for name, b in r4["bytes_per_row"].items():
        codec = name.split("@")[0]
        if codec.startswith("topk:"):
            verdicts[f"bytes_per_row {name}"] = verdict(b, write.topk_floor(codec), False)
    floors = {k: {"op": ">=", "value": v} for k, v in FLOORS.items()}
    floors.update({f"bytes_per_row {k}": {"op": "<=", "value": v} for k, v in r4["topk_floor"].items()})
    report = {
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
        "verdicts": verdicts,
        "all_pass": all(v == "PASS" for v in verdicts.values()),
        "sections": {"gather_vs_numpy": r1, "gather_vs_per_sample_files": r2, "write_order": r3,
                     "bytes_per_row": r4, "out_of_core": r5, "visibility": r6},
        "machine": m,
        "date": utc_now(),
        "quick": bool(args.quick),
        "seed": args.seed,
        "runtime_s": runtime,
    }

    print(heading("kdcache store benchmark", args.quick, runtime))
    print(machine_line(m) + "\n")
    for title, table, note in sections:
        print(section(title, table, note))
    print(floors_line([k for k, v in verdicts.items() if v != "PASS"]))
    print("\n" + for_the_manual(render(report)))

    write_report(args.out, report)
    print(f"Report: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
