"""The producer benchmark runs end to end (--quick) and writes the report the README and issues quote."""
import os

import pytest

from bench.paired import shown
from tests.helpers import assert_paired, positive, run_bench
from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

RATIOS = ("producer_vs_bare_forward", "two_shards_vs_one", "two_shards_vs_one_aggregate")
QUICK_ROUNDS = {"producer_vs_bare_forward": 3, "two_shards_vs_one": 2,
                "two_shards_vs_one_aggregate": 2}  # bench.producer.run.QUICK's overhead_repeats, shard_repeats
RATES = ("bare_forward", "producer", "one_producer_wall", "two_shards_wall", "one_producer_reported",
         "two_shards_reported_sum")


@pytest.mark.slow
def test_bench_producer_quick_writes_report(tmp_path):
    (tmp_path / "results").mkdir()  # run_bench's --out: a file in a folder that exists
    proc, report = run_bench("producer", tmp_path, timeout=400)
    for key in RATIOS:
        assert positive(report[key]), (key, report[key])
    for key in RATES:
        assert positive(report["rows_per_s"][key]), (key, report["rows_per_s"][key])
    # Speed floors are for the benchmark report, not for tests: machines are noisy. Each is decided on the
    # run-by-run ratios of its interleaved runs: their median, beside each run's ratio.
    assert set(report["floors"]) >= set(RATIOS) and set(report["verdicts"]) >= set(RATIOS)
    assert_paired(report["paired"], QUICK_ROUNDS)
    for key in RATIOS:  # the report's figure and verdict are the paired median's, printed with each run's ratio
        assert report[key] == report["paired"][key]["measured"]
        assert report["verdicts"][key] == report["paired"][key]["verdict"]
        assert shown(report["paired"][key]) in proc.stdout

    # Two producers on shards 0/2 and 1/2 filled one complete cache holding the single producer's logits.
    assert report["two_shard_cache_equal"] is True, report["sections"]["two_shards_vs_one"]["checks"]
    for check in report["sections"]["two_shards_vs_one"]["checks"]:
        assert check["complete"] and check["same_fingerprint"] and check["rows_written"] > 0

    assert positive(report["cache_bytes"]) and positive(report["teacher_forward_ms_per_batch"])
    assert report["quick"] is True
    assert report["machine"]["mxnet"] and report["machine"]["numpy"] and report["date"]

    # The teacher against this core's peak: its multiply-adds counted on the exported symbol (four 3x3 convs
    # at 32, 16, 8 and 4 pixels, the Dense(10)), both figures per core, checked against the measured peak.
    assert report["teacher"]["macs_per_image"]["macs"] == (32 * 32 * 32 * 27 + 16 * 16 * 32 * 288 + 8 * 8 * 64 * 288
                                                           + 4 * 4 * 64 * 576 + 64 * 10)
    assert report["valid"] is True and report["invalid"] == []
    assert positive(report["peak"]["gflops"]) and len(report["peaks_gflops"]) == 2
    assert report["cpu"]["family"] and report["peak"]["mx.nd.dot"]["cores_used"] <= 1.1
    for row in report["gflops"]:
        assert row["gflops_per_core"] == pytest.approx(row["gflop_per_image"] * row["images_per_s_per_core"])
        assert row["gflops_per_core"] <= 1.1 * report["peak"]["gflops"] and row["cores_used"] <= 1.1
        assert row["fraction_of_peak"] == pytest.approx(row["gflops_per_core"] / report["peak"]["gflops"])
    assert "Measured peak:" in proc.stdout and "GFLOP/s per core" in proc.stdout

    # One markdown table per section on stdout; the run's files kept in one folder of --tmp.
    assert proc.stdout.count("\n## ") == 5 and "| verdict" in proc.stdout and "## Floors on paired runs" in proc.stdout
    assert [d.startswith("kdcache-producer-") for d in os.listdir(tmp_path / "scratch")] == [True]  # kept: --tmp


@pytest.mark.parametrize("module, flag, argv", [
    *(("producer", flag, argv) for flag, argv in REPORT_MISTAKES),
    # the MXNet child: each option checked as bench.producer's are, and the options each child needs
    ("producer.children", "--teacher", "export"), ("producer.children", "--teacher", "export --teacher {tmp}/dir"),
    ("producer.children", "--dataset", "export --teacher {tmp}/t --dataset digits"),
    ("producer.children", "--teacher", "bare --teacher {tmp}/none --dataset digits --batch-size 8"),
    ("producer.children", "--batch-size", "bare --teacher {tmp}/none --dataset digits --batch-size 0"),
    ("producer.children", "--dataset", "bare --teacher {tmp}/none --dataset nosuch --batch-size 8")])
def test_bench_producer_bad_options(tmp_path, module, flag, argv):
    assert_refused(tmp_path, module, flag, argv)
