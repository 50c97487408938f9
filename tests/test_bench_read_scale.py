"""The reading-at-scale benchmark runs end to end (--quick, small sizes) and writes the report the README quotes."""
import os

import pytest

from bench.paired import shown
from tests.helpers import assert_paired, positive, run_bench
from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

ROWS, CLASSES, VIEWS, READERS = 20_000, 100, 2, 3


@pytest.mark.slow
def test_bench_read_scale_quick_writes_report(tmp_path):
    (tmp_path / "results").mkdir()
    proc, r = run_bench("read_scale", tmp_path, "--rows", ROWS, "--classes", CLASSES, "--views", VIEWS,
                        "--readers", READERS, timeout=300)
    assert r["quick"] is True and r["rows"] == ROWS and r["classes"] == CLASSES
    assert r["machine"]["numpy"] and r["date"]
    # Timing floors are the report's business, not a test's: only that each was judged, the gathers' on the
    # round-by-round ratios of its interleaved rounds (their median beside each round's ratio), the Pss once.
    assert set(r["floors"]) == set(r["verdicts"]) == {"map_vs_numpy_gather", "pss_map_vs_file"}
    assert set(r["paired"]) == {"map_vs_numpy_gather"}
    assert_paired(r["paired"], {"map_vs_numpy_gather": 3})  # bench.read_scale.run.QUICK's gather_repeats
    f = r["paired"]["map_vs_numpy_gather"]
    assert r["map_vs_numpy_gather"] == f["measured"] and r["verdicts"]["map_vs_numpy_gather"] == f["verdict"]
    assert shown(f) in proc.stdout and r["verdicts"]["pss_map_vs_file"] in ("PASS", "MISS")

    # Every side read the rows that were written: the map, today's RAM reader, numpy on the file's array.
    assert r["rows_match"] is True and r["gather"]["rows_match"] is True
    assert all(positive(v) for v in r["gather"]["rows_per_s_best"].values())
    assert set(r["gather"]["rows_per_s_best"]) == {"map_get", "map_raw", "numpy_f32", "numpy_raw", "ram_get"}
    assert r["write"]["keys"] == ROWS and positive(r["write"]["rows_per_s"])
    assert r["file_bytes"] >= ROWS * CLASSES * 2
    assert r["open"]["ram_source"] == "ram" and positive(r["open"]["ram_vs_map"])

    # The mapped readers share one copy of the file: their maps of it add up to about one file, not one each.
    m, ram = r["readers"]["map"], r["readers"]["ram"]
    size = r["file_bytes"]
    assert m["processes"] == READERS and m["sources"] == ["map"] and m["held_dtypes"] == ["<f2"]
    assert m["pss_sum"] > m["pss_cache_map_sum"] > 0
    assert 0.8 * size <= m["pss_cache_map_sum"] <= 1.05 * size
    # Today's path holds a float32 copy in each process, and maps nothing.
    assert ram["processes"] == READERS and ram["sources"] == ["ram"] and ram["held_dtypes"] == ["<f4"]
    assert ram["pss_cache_map_sum"] == 0 and ram["pss_anon_sum"] - m["pss_anon_sum"] >= READERS * ROWS * CLASSES * 3
    assert not m["mxnet_loaded"] and not ram["mxnet_loaded"]
    assert m["rows_per_process"] == ROWS and all(positive(v) for v in m["epoch_rows_per_s"])

    for order in ("random", "sequential", "random_no_readahead", "random_read_first"):
        c = r["cold"][order]
        assert positive(c["rows_per_s"]) and 0 <= c["resident_after_evict"] <= 1 and c["total_s"] >= c["epoch_s"]

    mv = r["multiview"]
    assert mv["views"] == VIEWS and mv["rows"] == ROWS and mv["rows_match"] is True
    assert positive(mv["map_rows_per_s"]) and positive(mv["other_rows_per_s"])
    assert mv["readers"]["processes"] == READERS and mv["readers"]["pss_sum"] > 0
    assert 0.8 * mv["write"]["file_bytes"] <= mv["readers"]["pss_cache_map_sum"] <= 1.05 * mv["write"]["file_bytes"]

    assert proc.stdout.count("\n## ") == 7 and "## Floors on paired rounds" in proc.stdout
    assert [d.startswith("kdcache-read-scale-") for d in os.listdir(tmp_path / "scratch")] == [True]  # kept: --tmp


@pytest.mark.parametrize("flag, argv", [("--rows", "--rows 10"), ("--classes", "--classes 2"), ("--views", "--views 1"),
                                        ("--readers", "--readers 0"), ("--seed", "--seed x"), *REPORT_MISTAKES])
def test_bench_read_scale_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "read_scale", flag, argv)
