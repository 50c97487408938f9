"""bench.codecs.sampled's tables: each data set's full runs shown with their paired differences, and a quick
run's rows only where no full run of the same data set and temperature supersedes them."""
import copy
import json

from bench.codecs.sampled import DEFAULT_REPORT, render, runs_line


def report_with(full):
    """The quick runs of the committed report at T = 1 and 4, and `full` {key: {T: data sets}} made from them
    (a quick run's data set relabelled as a full run's: only the shape matters here)."""
    with open(DEFAULT_REPORT, encoding="utf-8") as fh:
        runs = json.load(fh)["runs"]
    report = {"what": "", "runs": {t: runs[t] for t in ("1", "4")}}
    for key, by_t in full.items():
        report[key] = {t: {**copy.deepcopy(runs[t]), "quick": False,
                           "datasets": {n: copy.deepcopy(runs[t]["datasets"][n]) for n in names}}
                       for t, names in by_t.items()}
    return report


def rows(table, name, t):
    return [line for line in table.splitlines() if line.startswith(f"| {name} | {t} |")]


def test_a_full_run_supersedes_the_quick_rows_of_its_data_set_and_temperature():
    report = report_with({"full_mnist5k": {"4": ["mnist5k"]}, "full_synthetic": {"1": ["synthetic"],
                                                                                   "4": ["synthetic"]}})
    tables = render(report)
    assert [title.split(" (")[0] for title, _ in tables] == ["Quick runs", "Full runs", "Full runs"]
    quick, mnist, synthetic = (table for _, table in tables)
    assert rows(quick, "mnist5k", 1) and not rows(quick, "mnist5k", 4) and not rows(quick, "synthetic", 1)
    assert "on mnist5k" in tables[1][0] and "T = 4:" in tables[1][0]
    assert len(rows(mnist, "mnist5k", 4)) == 4  # full/float32, topk:5, sampled:9, scratch
    assert "`sampled:9` minus `topk:5`" in mnist and "T²·KL to the teacher at T" in mnist
    assert "`sampled:16` minus `topk:10`" in synthetic
    assert runs_line(report).startswith("Runs of ") and " 4 runs," in runs_line(report)


def test_quick_runs_every_row_of_which_is_superseded_are_not_shown():
    report = report_with({"full_mnist5k": {"1": ["mnist5k"], "4": ["mnist5k"]},
                          "full_synthetic": {"1": ["synthetic"], "4": ["synthetic"]}})
    titles = [title for title, _ in render(report)]
    assert len(titles) == 2 and all(t.startswith("Full runs") for t in titles)
    assert " 4 runs," in runs_line(report)

