"""The Fashion-MNIST distillation benchmark (--quick on a slice of the real files): its report, its table, its refusals."""
import json
import os
import subprocess
import sys

import pytest

from tests.test_bench_sizing import ENV, REPORT_MISTAKES, assert_refused

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FASHION = "/usr/share/datasets/fashion-mnist"
HAVE_FASHION = os.path.exists(os.path.join(FASHION, "train-images-idx3-ubyte.gz")) or \
    os.path.exists(os.path.join(FASHION, "train-images-idx3-ubyte"))


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_FASHION, reason=f"Fashion-MNIST is not installed in {FASHION} "
                    f"(apt-get install dataset-fashion-mnist, as root)")
def test_quality_quick_report(tmp_path):
    out = tmp_path / "quality.json"
    proc = subprocess.run([sys.executable, "-m", "bench.quality", "--quick", "--out", str(out)],
                          cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    from bench.quality.run import render
    from bench.common import rendered

    seeds, n = report["settings"]["seeds"], report["n_train"]
    assert report["quick"] is True and len(seeds) == 2
    assert n == 2000 and report["n_test"] == 1000  # the real files' first images, not the whole set
    # The cache is filled once, for every seed of both students; no student runs the teacher from it.
    assert report["cache_fill"]["teacher_forwards"] == n and report["cache_fill"]["rows_written"] == n
    t_acc = report["teacher"]["test_acc"]
    assert set(report["students"]) == {"mlp800x2", "small_cnn_flat"}
    for name, s in report["students"].items():
        f, epochs = s["teacher_forwards"], s["budget"]["epochs"]
        assert f["scratch"] == 0 and f["cache"] == 0 and f["cache_fill"] == n, (name, f)
        assert all(r["cache"]["teacher_forwards"] == 0 for r in s["per_seed"]), name
        assert f["inline"] == epochs * n * len(seeds) == f["inline_expected"], (name, f)
        assert len(s["fingerprints"]) == 1  # one cache for every seed
        rows = s["rows"]
        for mode in ("scratch", "inline", "cache"):
            assert len(rows[mode]["accs"]) == len(seeds)
            assert 0 <= rows[mode]["min"] <= rows[mode]["mean"] <= rows[mode]["max"] <= 1
        gap = t_acc - rows["scratch"]["mean"]
        want = (rows["cache"]["mean"] - rows["scratch"]["mean"]) / gap if gap > 0 else None
        assert s["gap_closed"] == pytest.approx(want) if want is not None else s["gap_closed"] is None
    assert {v["verdict"] for v in report["verdicts"].values()} <= {"PASS", "MISS"}

    # The table the manual shows is the one the run printed, from the JSON alone.
    text = rendered(render(report))
    assert text in proc.stdout
    assert f"| teacher | mnist_teacher | 2 | " in text and f"{n:,} (the cache fill, once)" in text
    for name in report["students"]:
        assert f"| distilled from the cache | {name} | 1 | " in text
        assert f"| distilled inline | {name} | 1 | " in text
    assert "PASS:" in proc.stdout or "MISS:" in proc.stdout


def test_quality_missing_data_is_one_line_before_anything_runs(tmp_path):
    """Without the data set's files: one line naming the package to install, exit 2, nothing trained or written."""
    assert_refused(tmp_path, "quality", "--data-root", "--data-root {tmp}/dir --tmp {tmp}/scratch")
    r = subprocess.run([sys.executable, "-m", "bench.quality", "--data-root", str(tmp_path / "dir")],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert "apt-get install dataset-fashion-mnist" in r.stderr and r.returncode == 2


@pytest.mark.parametrize("flag, argv", [
    ("--seeds", "--seeds 0"), ("--jobs", "--jobs 0"), ("--lr", "--lr 0"), ("--temperature", "-T 0"),
    ("--alpha", "--alpha 1.5"), ("--epochs", "--quick --epochs 0"), ("--batch-size", "--batch-size x"),
    ("--teacher-epochs", "--teacher-epochs 0"), ("--dtype", "--dtype float64"),
    ("--teacher", "--teacher {tmp}/none --tmp {tmp}/scratch"), *REPORT_MISTAKES])
def test_quality_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "quality", flag, argv)
