"""bench.codecs' tables: the codec table per data set, the floors with their verdicts, the Hinton-style table."""
from bench.common import busy_warning, heading, machine_line, md_table, for_the_manual

RATIO_FLOOR = 1.5        # top-K's T^2 * KL within this factor of the ideal top-K with an even tail
TOPK5_POINTS = 0.3       # topk:5's student no more than this many points below full/float32's, on mnist5k
GAP_GOAL = 0.5           # fraction of the scratch-to-teacher gap the cache-distilled student closes, on mnist5k
HINTON_MNIST = (146 - 74) / (146 - 67)  # Hinton et al. 2015 on MNIST: 146 -> 74 errors, teacher 67
EXACT, FLOOR_TOPK, FLOOR_DATASET = "full/float32", "topk:5", "mnist5k"


def pct(x):
    return f"{100 * x:.2f}%"


def acc_cell(s):
    spread = f" ± {100 * s['std']:.2f}" if len(s["accs"]) > 1 else " (one seed)"
    return f"{pct(s['mean'])}{spread}"


def kl_cell(row, t):
    kl = row["kl"][t]
    if "ideal" not in row:
        return f"{kl:.3g}"
    ratio = row["ratio"][t]
    return f"{kl:.3g} (ideal {row['ideal'][t]:.3g}, {ratio:.2f}x)" if ratio is not None else f"{kl:.3g} (ideal 0)"


def codec_table(d):
    full = d["codecs"][EXACT]["student"]["mean"]
    body = []
    for label, row in d["codecs"].items():
        s = row["student"]
        body.append([f"`{label}`", row["bytes_per_row"], *(kl_cell(row, t) for t in ("1", "4", "20")),
                     f"{row['top1_agreement']:.4f}", acc_cell(s),
                     "-" if label == EXACT else f"{100 * (s['mean'] - full):+.2f}"])
    s = d["scratch"]
    body.append(["no teacher (scratch)", "-", "-", "-", "-", "-", acc_cell(s), f"{100 * (s['mean'] - full):+.2f}"])
    return md_table(["codec", "bytes/row", "T²·KL, T=1", "T²·KL, T=4", "T²·KL, T=20", "top-1 agreement",
                     "student test accuracy", "vs full/float32 (points)"], body, pad=False)


def paired(a, b):
    """Per-seed differences a - b (same seeds, same order), in points: mean and std."""
    diffs = [100 * (x - y) for x, y in zip(a["accs"], b["accs"])]
    n = len(diffs)
    mean = sum(diffs) / n
    std = (sum((x - mean) ** 2 for x in diffs) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return mean, std


def floors(report):
    """[{floor, measured, verdict}]: every kept top-K within RATIO_FLOOR of its ideal; topk:5's student on
    mnist5k; the fraction of the gap closed. A floor whose data set was not run is "not run"."""
    out = []
    for name, d in report["datasets"].items():
        for label, row in d["codecs"].items():
            if "ratio" not in row:
                continue
            ratios = [r for r in row["ratio"].values() if r is not None]
            worst = max(ratios) if ratios else None
            out.append({"floor": f"{name} `{label}`: T²·KL within {RATIO_FLOOR}x of the ideal top-K, T = 1, 4, 20",
                        "measured": " / ".join(f"{r:.2f}x" if r is not None else "ideal 0"
                                               for r in row["ratio"].values()),
                        "value": worst, "verdict": "PASS" if worst is not None and worst <= RATIO_FLOOR else "MISS"})
    d = report["datasets"].get(FLOOR_DATASET)
    if d is not None and FLOOR_TOPK in d["codecs"]:
        a, b = d["codecs"][FLOOR_TOPK]["student"], d["codecs"][EXACT]["student"]
        diff = 100 * (a["mean"] - b["mean"])
        pm, ps = paired(a, b)
        out.append({"floor": f"{FLOOR_DATASET} `{FLOOR_TOPK}` student no more than {TOPK5_POINTS} points below "
                             f"`{EXACT}`'s (mean of the seeds)",
                    "measured": f"{pct(a['mean'])} vs {pct(b['mean'])}: {diff:+.2f} points (per seed {pm:+.2f} ± "
                                f"{ps:.2f})", "value": diff, "verdict": "PASS" if diff >= -TOPK5_POINTS else "MISS"})
    else:
        out.append({"floor": f"{FLOOR_DATASET} `{FLOOR_TOPK}` student within {TOPK5_POINTS} points of `{EXACT}`'s",
                    "measured": "not run", "value": None, "verdict": "not run"})
    h = hinton(report)
    out.append({"floor": f"{FLOOR_DATASET}: the student distilled from the cache closes >= {GAP_GOAL} of the "
                         f"scratch-to-teacher gap (goal)",
                "measured": "not run" if h is None else f"{h['gap_closed']['cache']:.2f} (inline "
                                                        f"{h['gap_closed']['inline']:.2f})",
                "value": None if h is None else h["gap_closed"]["cache"],
                "verdict": "not run" if h is None else "PASS" if h["gap_closed"]["cache"] >= GAP_GOAL else "MISS"})
    return out


def hinton(report):
    """The Hinton-style rows on mnist5k (None when it was not run): accuracy, errors, forwards, gap closed."""
    d = report["datasets"].get(FLOOR_DATASET)
    if d is None or "inline" not in d:
        return None
    n = d["n_test"]
    teacher = d["teacher"]["test_acc"]
    rows = {"teacher": {"accs": [teacher], "mean": teacher, "std": 0.0, "min": teacher, "max": teacher,
                        "teacher_forwards": None},
            "scratch": d["scratch"], "inline": d["inline"],
            "cache": {**d["codecs"][EXACT]["student"],
                      "teacher_forwards": d["codecs"][EXACT]["teacher_forwards"]}}  # one fill serves every seed
    gap = teacher - d["scratch"]["mean"]
    return {"n_test": n, "rows": {k: {**v, "errors_mean": (1 - v["mean"]) * n} for k, v in rows.items()},
            "gap_closed": {k: (rows[k]["mean"] - d["scratch"]["mean"]) / gap if gap > 0 else None
                           for k in ("inline", "cache")},
            "hinton_2015_mnist_gap_closed": round(HINTON_MNIST, 3)}


def hinton_table(h):
    labels = [("teacher", "teacher"), ("scratch", "student from scratch"),
              ("inline", "student distilled, inline"), ("cache", f"student distilled, from the cache ({EXACT})")]
    body = []
    for key, label in labels:
        r = h["rows"][key]
        acc = pct(r["mean"]) + (" (one network)" if key == "teacher" else f" ± {100 * r['std']:.2f}")
        forwards = "-" if r["teacher_forwards"] is None else f"{r['teacher_forwards']:,}"
        body.append([label, acc, f"{r['errors_mean']:.1f}", f"{pct(r['min'])}–{pct(r['max'])}", forwards])
    return md_table(["", "test accuracy (mean ± std)", f"test errors of {h['n_test']:,} (mean)", "min–max",
                     "teacher forwards (all seeds)"], body, pad=False)


def kl_short(row, t):
    kl = row["kl"][t]
    return "0" if kl == 0 else f"{kl:.1e}" if kl < 1e-3 else f"{kl:.3g}"


def render(report):
    """[(title, markdown table)]: every data set's codecs in one table, the floors, the Hinton-style table,
    from the JSON report alone."""
    body = []
    for name, d in report["datasets"].items():
        views = f"; {d['views']} views" if d["views"] > 1 else ""
        first = f"{name}, {d['classes']} classes (teacher {pct(d['teacher']['test_acc'])}{views}; {len(d['seeds'])} seeds)"
        for label, row in d["codecs"].items():
            ratios = [r for r in (row.get("ratio") or {}).values() if r is not None]
            ideal = f" ({max(ratios):.2f}x)" if ratios else ""
            s = row["student"]
            body.append([first, label, row["bytes_per_row"], " / ".join(kl_short(row, t) for t in ("1", "4", "20"))
                         + ideal, f"{row['top1_agreement']:.4f}", acc_cell(s)])
            first = ""
        body.append(["", "no teacher", "-", "-", "-", acc_cell(d["scratch"])])
    out = [("", md_table(["data set", "codec", "bytes/row", "T²·KL T=1 / 4 / 20 (topk: x its ideal)",
                          "top-1 agreement", "student accuracy (mean ± std over seeds)"], body, pad=False)),
           ("", md_table(["floor", "measured", "verdict"], [[f["floor"], f["measured"], f["verdict"]]
                                                            for f in report["floors"]], pad=False))]
    h = report.get("hinton")
    if h is not None:
        d = report["datasets"][FLOOR_DATASET]
        out.append((f"Hinton-style, {FLOOR_DATASET} ({report['settings']['student']}, "
                    f"{d['views']} view{'s' if d['views'] > 1 else ''}, "
                    f"{len(d['seeds'])} seeds; `make bench-codecs` prints it):", hinton_table(h)))
    return out


def print_report(report):
    s = report["settings"]
    print(heading("Soft-target codecs", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]))
    other = report["cpu"].get("other_cores")
    print(f"Run time {report['runtime_s']:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in report['step_s'].items())}), "
          f"{s['jobs']} one-thread processes at a time; other processes kept "
          f"{other if other is not None else float('nan'):.2f} cores busy on average: run times depend on that "
          f"load, accuracies do not (one thread per process, fixed seeds).")
    print(busy_warning(other, "this run"), end="")
    print(f"Student {s['student']}, Adam lr {s['lr']:g}, batch {s['batch_size']}, wd {s['wd']:g}, "
          f"KD T={s['temperature']:g}, alpha={s['alpha']:g}. "
          f"T²·KL: mean over the training rows of T²·KL(teacher ‖ rebuilt) against the teacher's float32 logits; "
          f"ideal: top-K exact, the exact tail mass spread evenly.\n")
    for name, d in report["datasets"].items():
        t = d["teacher"]
        views = "one view" if d["views"] == 1 else f"{d['views']} views ({d['augment']}; epoch e reads view e mod " \
                                                     f"{d['views']}, every student alike)"
        print(f"## {name}: {d['classes']} classes, {d['n_train']:,} training / {d['n_test']:,} test samples, "
              f"{d['epochs']} student epochs, {views}, seeds {', '.join(map(str, d['seeds']))}\n")
        print(f"Teacher: {t['source']}, test accuracy {pct(t['test_acc'])}.\n")
        print(codec_table(d) + "\n")
    print("## Floors\n")
    print(md_table(["floor", "measured", "verdict"], [[f["floor"], f["measured"], f["verdict"]]
                                                      for f in report["floors"]], pad=False) + "\n")
    h = report["hinton"]
    if h is not None:
        d = report["datasets"][FLOOR_DATASET]
        print("## Distillation on mnist5k, in the manner of Hinton et al. (2015)\n")
        print(hinton_table(h) + "\n")
        g = h["gap_closed"]
        per_seed = "" if d["views"] == 1 else f" x {len(d['seeds'])} seeds: the views are keyed by the seed"
        print(f"Distillation closes {g['cache']:.2f} of the gap between the student from scratch and the teacher "
              f"from the cache, {g['inline']:.2f} inline (goal >= {GAP_GOAL}; Hinton et al. 2015 on MNIST: "
              f"146 -> 74 errors with a 67-error teacher, {h['hinton_2015_mnist_gap_closed']:.2f}). From the cache: "
              f"{h['rows']['cache']['teacher_forwards']:,} teacher forwards in all ({d['n_train']:,} samples x "
              f"{d['views']} view(s){per_seed}"
              f"), each cache filled once and read by every epoch; inline runs the teacher on every sample of every "
              f"epoch.\n")
    print(f"Missed: {', '.join(f['floor'] for f in report['floors'] if f['verdict'] == 'MISS') or 'none'}.")
    print("\n" + for_the_manual(render(report)))
