"""The store benchmark runs end to end (--quick) and writes the report the README and issues quote."""
import math
import os

import pytest

from bench.paired import shown
from tests.helpers import assert_paired, run_bench
from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

RATIOS = ("gather_vs_numpy", "gather_vs_per_sample_files", "shuffled_vs_ordered_write_c10",
          "shuffled_vs_ordered_write_c1000")
QUICK_ROUNDS = {"gather_vs_numpy": 3, "gather_vs_per_sample_files": 3, "shuffled_vs_ordered_write_c10": 3,
                "shuffled_vs_ordered_write_c1000": 3}  # bench.store.run.QUICK's *_repeats


@pytest.mark.slow
def test_bench_store_quick_writes_report(tmp_path):
    (tmp_path / "results").mkdir()  # run_bench's --out: a file in a folder that exists
    proc, report = run_bench("store", tmp_path, timeout=300)
    for key in RATIOS:
        v = report[key]
        assert isinstance(v, float) and math.isfinite(v) and v > 0, (key, v)
    # Speed floors are for the benchmark report, not for tests: machines are noisy. Each is decided on the
    # round-by-round ratios of its interleaved rounds: their median, beside each round's ratio.
    assert set(report["floors"]) >= set(RATIOS)
    assert set(report["verdicts"]) >= set(RATIOS)
    assert_paired(report["paired"], QUICK_ROUNDS)
    for key in RATIOS:  # the report's figure and verdict are the paired median's
        assert report[key] == report["paired"][key]["measured"]
        assert report["verdicts"][key] == report["paired"][key]["verdict"]
    assert report["quick"] is True
    assert report["machine"]["numpy"] and report["date"]

    bpr = report["bytes_per_row"]
    assert bpr["full/float16@C=100"] == 200
    assert bpr["topk:5@C=100"] <= 4 * 5 + 8
    assert report["bytes_per_row_on_disk"]["full/float16@C=100"] >= 200
    vis = report["visibility_ms"]  # rows a live producer commits reach a reader
    assert 0 < vis["median"] <= vis["p95"] <= vis["max"]

    # One markdown table per section on stdout; the run's files kept in one folder of --tmp.
    assert proc.stdout.count("\n## ") == 7 and "PASS" in proc.stdout and "## Floors on paired rounds" in proc.stdout
    for key in RATIOS:  # the printed and rendered tables give the median and each round's ratio
        assert shown(report["paired"][key]) in proc.stdout
    assert [d.startswith("kdcache-store-") for d in os.listdir(tmp_path / "scratch")] == [True]  # kept: --tmp


@pytest.mark.parametrize("flag, argv", [("--seed", "--seed -1"), ("--seed", "--seed x"), *REPORT_MISTAKES])
def test_bench_store_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "store", flag, argv)
