"""The equal-compute benchmark (--quick on a slice of the real Fashion-MNIST): budgets bought as epochs, the cache's
fill charged, the patient cache's views, the sweep's teacher forwards, and its refusals."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_bench_quality import HAVE_FASHION, FASHION
from tests.test_bench_sizing import ENV, assert_refused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_FASHION, reason=f"Fashion-MNIST is not installed in {FASHION} "
                    f"(apt-get install dataset-fashion-mnist, as root)")
def test_worth_quick_report(tmp_path):
    out, work = tmp_path / "worth.json", tmp_path / "work"
    argv = [sys.executable, "-m", "bench.worth", "--quick", "--resume", str(work)]
    proc = subprocess.run(argv + ["--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                          timeout=1500)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    # the same command again runs nothing: every run is in the journal, and the report is the same
    again = subprocess.run(argv + ["--out", str(tmp_path / "again.json")], cwd=ROOT, env=ENV,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "done in" not in again.stdout + again.stderr, again.stderr[-2000:]
    redo = json.loads((tmp_path / "again.json").read_text())
    assert (redo["budgets"], redo["sweep"], redo["fills"]) == (report["budgets"], report["sweep"], report["fills"])
    n, seeds = report["n_train"], report["settings"]["seeds"]
    assert report["quick"] and n == 2000 and len(seeds) == 1
    views = report["settings"]["patient"]["views"]
    assert report["fills"]["plain"]["teacher_forwards"] == n
    assert [f["teacher_forwards"] for f in report["fills"]["patient"]] == [n * views] * len(seeds)
    budgets = [b["budget_s"] for b in report["budgets"]]
    assert budgets == sorted(budgets) and len(budgets) >= 2
    for b in report["budgets"]:
        for name, s in b["students"].items():
            rows = s["rows"]
            # only the inline rows run the teacher; a budget's epochs never shrink as the budget grows
            # the student runs of the cache never run the teacher: their forwards are the fill's, charged
            assert rows["scratch"]["teacher_forwards"] == 0, name
            assert rows["cache"]["teacher_forwards"] == n * len(seeds), name
            assert rows["inline"]["teacher_forwards"] == rows["inline"]["epochs"] * n * len(seeds), name
            assert rows["cache_amortised"]["fill_s"] < rows["cache"]["fill_s"] == report["fills"]["plain"]["wall_s"]
            # the fill charged to one student costs it epochs it keeps when the fill is shared
            assert rows["cache_amortised"]["epochs"] >= rows["cache"]["epochs"] >= 1, rows
            assert all(0.0 <= a <= 1.0 for r in rows.values() for a in r["accs"])
        assert all(set(s["rows"]) == {"scratch", "inline", "cache", "cache_amortised"} for s in b["students"].values())
    # the patient rows: their own budget, one student, the same mixed views each way
    pt, ps = report["patient"], report["settings"]["patient"]
    assert pt["budget_s"] == ps["budget_s"] and pt["student"] == ps["student"]
    rows = pt["rows"]
    assert set(rows) == {"scratch_aug", "inline_aug", "patient"}
    assert rows["scratch_aug"]["teacher_forwards"] == 0
    assert rows["inline_aug"]["teacher_forwards"] == rows["inline_aug"]["epochs"] * n * len(seeds)
    assert rows["patient"]["teacher_forwards"] == n * views * len(seeds)  # each seed's fill, nothing in training
    assert report["verdicts"]["patient_epochs"]["value"] == rows["patient"]["epochs"] >= 1
    small, large = report["budgets"][0]["students"], report["budgets"][-1]["students"]
    for name in small:
        for way in ("scratch", "inline", "cache"):
            assert large[name]["rows"][way]["epochs"] >= small[name]["rows"][way]["epochs"], (name, way)
    sweep = report["sweep"]
    k = len(report["settings"]["sweep"])
    assert sweep["cache"]["teacher_forwards"] == n  # one fill for every student of the sweep
    assert sweep["inline"]["teacher_forwards"] == k * report["settings"]["sweep_epochs"] * n
    from bench.common import rendered
    from bench.worth.run import render
    text = rendered(render(report))
    assert "from the cache (fill charged)" in text and "patient cache" in text


@pytest.mark.parametrize("flag,argv", [("--seeds", "--seeds 0"), ("--budget-scale", "--budget-scale x"),
                                       ("--jobs", "--jobs 0"),
                                       ("--data-root", "--data-root {tmp}/dir --tmp {tmp}/scratch")])
def test_worth_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "worth", flag, argv)


def test_journal_resumes_after_a_failure(tmp_path):
    """A run stopped by a failing task keeps what finished: run again, only the failed task and those after it run."""
    from bench.common import BenchError, Children, run_tasks
    flag, journal, ran = tmp_path / "fixed", tmp_path / "finished.jsonl", []

    def task(key, code, after=()):
        return {"key": key, "what": str(key), "timeout": 60, "after": list(after),
                "argv": [sys.executable, "-c", f"import json, os, sys\n{code}\nprint(json.dumps({{'k': {key[1]}}}))"]}
    left = tmp_path / "c-scratch"  # what a run killed during c left: c must start without it
    left.mkdir()
    tasks = [task(("a", 1), ""), task(("b", 2), f"if not os.path.exists({str(flag)!r}): sys.exit(3)", [("a", 1)]),
             {**task(("c", 3), f"assert not os.path.exists({str(left)!r})", [("b", 2)]), "scratch": str(left)}]
    kids = Children()
    with pytest.raises(BenchError):
        run_tasks(kids, 1, tasks, ran.append, str(journal))
    assert [json.loads(line)["key"] for line in journal.read_text().splitlines()] == [repr(("a", 1))]
    flag.write_text("")
    res = run_tasks(kids, 1, tasks, ran.append, str(journal))
    assert {k: v["k"] for k, v in res.items()} == {("a", 1): 1, ("b", 2): 2, ("c", 3): 3}
    assert any("1 task(s) already finished" in line for line in ran)
    assert sum("('a', 1): done" in line for line in ran) == 1  # a ran once, in the first run


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_FASHION, reason=f"Fashion-MNIST is not installed in {FASHION}")
def test_a_terminated_run_stops_its_children_and_resumes(tmp_path):
    """SIGTERM (a kill, a time limit) stops the benchmark and every child it started; the same command then
    runs only what the journal lacks."""
    import signal
    import time
    work = tmp_path / "work"
    argv = [sys.executable, "-m", "bench.worth", "--quick", "--resume", str(work), "--out", str(tmp_path / "w.json")]
    proc = subprocess.Popen(argv, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    journal = work / "finished.jsonl"
    deadline = time.time() + 600
    while not (journal.exists() and journal.read_text().count("\n") >= 2) and time.time() < deadline:
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-3000:]
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(work)], capture_output=True, text=True).stdout.split()
    assert not left, f"children of the stopped run still alive: {left}"
    kept = journal.read_text().count("\n")
    again = subprocess.run(argv, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1500)
    assert again.returncode == 0, again.stderr[-3000:]
    import re  # each stage of the run says how many of its tasks the journal held: together, every line of it
    said = re.findall(r"(\d+) task\(s\) already finished", again.stdout + again.stderr)
    assert sum(map(int, said)) == kept, (said, kept)
