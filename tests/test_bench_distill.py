"""The distillation table runs end to end (--quick): four rows, and the cache trains the same student as inline KD."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_distill_table_quick_writes_report(tmp_path):
    out = tmp_path / "results" / "distill.json"
    out.parent.mkdir()  # --out: a file in a folder that exists
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "bench.distill", "--quick", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    report = json.loads(out.read_text())
    rows = report["rows"]
    assert set(rows) == {"teacher", "scratch", "inline", "cache"}
    for name, row in rows.items():
        for key in ("mean", "min", "max"):
            assert 0.0 <= row[key] <= 1.0, (name, key, row[key])
        assert row["min"] <= row["mean"] <= row["max"]
    seeds = report["settings"]["seeds"]
    assert len(seeds) == 2 and report["quick"] is True
    for name in ("scratch", "inline", "cache"):
        assert len(rows[name]["accs"]) == len(seeds)

    # Same logits (float32 cache), same schedule, same initialisation: the same student per seed.
    for s in report["per_seed"]:
        assert s["cache"]["test_acc"] == s["inline"]["test_acc"], s["seed"]
        assert s["cache_equals_inline"] is True
    assert report["cache_vs_inline"]["equal_test_acc"] == len(seeds)

    # The teacher ran once for the cache (every seed shares it) and every epoch of every inline run.
    n = report["n_train"]
    assert report["teacher_forwards"]["cache"] == n and report["cache_fills"] == 1
    assert report["teacher_forwards"]["inline"] == report["settings"]["epochs"] * n * len(seeds)
    assert report["teacher_forwards"]["scratch"] == 0

    # The markdown table names the four rows.
    for label in ("| teacher |", "| student from scratch |", "| student distilled (inline) |",
                  "| student distilled (cache) |"):
        assert label in proc.stdout


@pytest.mark.parametrize("flag, argv", [
    ("--seeds", "--seeds 0"), ("--lr", "--lr nan"), ("--lr", "--lr 0"), ("--temperature", "-T 0"),
    ("--alpha", "--alpha 1.5"), ("--student", "--student nosuch"), ("--epochs", "--quick --epochs 0"),
    ("--batch-size", "--batch-size 0"), ("--teacher-epochs", "--teacher-epochs 0"), ("--dtype", "--dtype float64"),
    ("--teacher", "--teacher {tmp}/none --tmp {tmp}/scratch"),
    ("--teacher-epochs", "--teacher teachers/digits --teacher-epochs 3 --tmp {tmp}/scratch"), *REPORT_MISTAKES])
def test_distill_table_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "distill", flag, argv)
