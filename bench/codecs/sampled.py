"""sampled:K against topk:K at equal bytes: the tables of bench/results/codecs_sampled.json, bench.codecs runs gathered.

    python -m bench.codecs.sampled [REPORT]     print the tables (default bench/results/codecs_sampled.json)

The report holds bench.codecs reports, one per temperature (a run distils at one -T): "runs" the quick ones
(mnist5k and the synthetic 1,000-class case, T = 1, 4, 20), "full_NAME" the full ones on data set NAME
("full_synthetic": T = 1, 4 and 20; "full_mnist5k": T = 4 and 20); "what" and "what_full_NAME" say how each
set was run. A quick run's rows are shown only where no full run of the same data set and T supersedes them
(the full runs' caches are the same, their students train longer on more seeds). Each sampled:K sits beside
the topk:K' whose bytes per row are nearest its own (sampled:9 27 B beside topk:5 28 B, sampled:16 48 B
beside topk:10 48 B), after full/float32, the teacher's exact logits.
"""
import json
import os
import sys

from bench.codecs.report import EXACT, acc_cell, paired
from bench.common import ROOT, md_table, rendered

DEFAULT_REPORT = os.path.join(ROOT, "bench", "results", "codecs_sampled.json")


def by_temperature(runs):
    """[(T as a string, its bench.codecs report)], the lowest T first."""
    return sorted(runs.items(), key=lambda kv: float(kv[0]))


def pairs(codecs):
    """[(topk label, sampled label)]: each sampled:K (in the report's order) with the topk:K' nearest it in bytes."""
    topk = [c for c in codecs if c.startswith("topk:")]
    out = []
    for label, row in codecs.items():
        if label.startswith("sampled:") and topk:
            out.append((min(topk, key=lambda c: abs(codecs[c]["bytes_per_row"] - row["bytes_per_row"])), label))
    return out


def shown(codecs):
    """The labels of a table's rows: full/float32, then each pair, top-k first."""
    return [EXACT] + [label for pair in pairs(codecs) for label in pair]


def kl(value):
    return "0" if value == 0 else f"{value:.3g}"


def ece(s):
    return "-" if s.get("ece_mean") is None else f"{s['ece_mean']:.3f}"


def seeds(reports):
    n = sorted({len(d["seeds"]) for _, r in reports for d in r["datasets"].values()})
    return " or ".join(map(str, n)) + (" seed" if n == [1] else " seeds")


def quick_table(runs):
    rows = []
    for t, r in by_temperature(runs):
        for name, d in r["datasets"].items():
            for label in shown(d["codecs"]):
                row = d["codecs"][label]
                rows.append([name, t, f"`{label}`", row["bytes_per_row"], kl(row["kl"][t]),
                             f"{row['top1_agreement']:.3f}", acc_cell(row["student"]), ece(row["student"])])
    return md_table(["data set", "T", "codec", "bytes/row", "T²·KL to the teacher at T", "top-1 agreement",
                     f"student accuracy ({seeds(by_temperature(runs))})", "student ECE"], rows, pad=False)


def full_table(runs):
    rows, notes = [], []
    for t, r in by_temperature(runs):
        diffs = []
        for name, d in r["datasets"].items():
            for label in shown(d["codecs"]):
                row = d["codecs"][label]
                rows.append([name, t, f"`{label}`", row["bytes_per_row"], kl(row["kl"][t]),
                             f"{row['top1_agreement']:.3f}", acc_cell(row["student"]), ece(row["student"])])
            rows.append([name, t, "no teacher (scratch)", "-", "-", "-", acc_cell(d["scratch"]), ece(d["scratch"])])
            for topk, sampled in pairs(d["codecs"]):
                a, b = d["codecs"][sampled]["student"], d["codecs"][topk]["student"]
                mean, std = paired(a, b)
                ahead = sum(x > y for x, y in zip(a["accs"], b["accs"]))
                diffs.append(f"`{sampled}` minus `{topk}` {mean:+.2f} ± {std:.2f} points (ahead on {ahead} of "
                             f"{len(a['accs'])} seeds)")
        notes.append(f"T = {t}: " + ", ".join(diffs))
    table = md_table(["data set", "T", "codec", "bytes/row", "T²·KL to the teacher at T", "top-1 agreement",
                      f"student accuracy ({seeds(by_temperature(runs))})", "student ECE"], rows, pad=False)
    return table + "\n\n" + "Paired by seed, " + "; ".join(notes) + "."


def epochs(runs):
    """'3 epochs on mnist5k, 2 on synthetic': the student epochs of each data set, as run."""
    per = {}
    for _, r in by_temperature(runs):
        for name, d in r["datasets"].items():
            per.setdefault(name, d["epochs"])
    return ", ".join(f"{e} epochs on {name}" if i == 0 else f"{e} on {name}" for i, (name, e) in enumerate(per.items()))


def temperatures(runs):
    ts = [t for t, _ in by_temperature(runs)]
    return ", ".join(ts[:-1]) + " and " + ts[-1] if len(ts) > 1 else ts[0]


def full_parts(report):
    """[(key, {T: report})]: the full runs, one set per data set ("full_mnist5k", "full_synthetic"), by name."""
    return sorted((k, v) for k, v in report.items() if k.startswith("full_") and isinstance(v, dict) and v)


def unsuperseded(report):
    """The quick runs, each keeping only the data sets no full run at the same T covers (a run left with
    none is left out)."""
    covered = {(name, float(t)) for _, runs in full_parts(report) for t, r in runs.items() for name in r["datasets"]}
    out = {}
    for t, r in report["runs"].items():
        kept = {name: d for name, d in r["datasets"].items() if (name, float(t)) not in covered}
        if kept:
            out[t] = {**r, "datasets": kept}
    return out


def render(report):
    """[(title, markdown table)]: the quick runs' codecs at each T no full run supersedes, then each data set's
    full runs, their students with the sampled-minus-top-k differences paired by seed."""
    quick = unsuperseded(report)
    kind = lambda runs: "quick" if all(r.get("quick") for _, r in by_temperature(runs)) else "full"  # noqa: E731
    out = []
    if quick:
        out.append((f"{kind(quick).capitalize()} runs ({epochs(quick)}), T = {temperatures(quick)}:",
                    quick_table(quick)))
    for _, full in full_parts(report):
        out.append((f"{kind(full).capitalize()} runs ({epochs(full)}), T = {temperatures(full)}:", full_table(full)))
    return out


def runs_line(report):
    """The line that dates the figures: each run's day and time, the machine, the other processes' load (the
    runs shown: a quick run every data set of which a full run supersedes is not counted)."""
    parts = [unsuperseded(report)] + [runs for _, runs in full_parts(report)]
    runs = [r for part in parts for _, r in by_temperature(part)]
    days = sorted({str(r.get("date", "?"))[:10] for r in runs})
    m = runs[0].get("machine") or {} if runs else {}
    where = ", ".join(x for x in (m.get("cpu_model"), f"{m['cpus']} vCPUs" if m.get("cpus") else "") if x)
    other = [r["cpu"]["other_cores"] for r in runs if (r.get("cpu") or {}).get("other_cores") is not None]
    parts = [f"{len(runs)} runs, {sum(r.get('runtime_s') or 0 for r in runs):.0f} s in all", where,
             f"other processes kept {min(other):.2f}-{max(other):.2f} cores busy on average" if other else "",
             "one thread per process"]
    return f"Runs of {', '.join(days)}: " + "; ".join(x for x in parts if x) + "."


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else DEFAULT_REPORT
    try:
        with open(path, encoding="utf-8") as fh:
            report = json.load(fh)
    except (OSError, ValueError) as e:
        print(f"error: {path} cannot be read ({e}): give a report bench.codecs' runs were gathered into",
              file=sys.stderr)
        return 2
    print(runs_line(report) + "\n\n" + rendered(render(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
