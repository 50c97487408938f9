"""The demand benchmark runs end to end (--quick): every scenario on a fresh cache, the references, the goals."""
import os

import pytest

from bench.paired import VERDICTS, shown
from tests.helpers import assert_paired, positive, run_bench
from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

SCENARIOS = ("key_order", "demand_wait", "demand_announced", "schedule")


@pytest.mark.slow
def test_bench_demand_quick_writes_report(tmp_path):
    (tmp_path / "results").mkdir()
    proc, report = run_bench("demand", tmp_path, timeout=580)
    rows = {r["scenario"]: r for r in report["results"]}
    assert set(rows) == set(SCENARIOS)  # the num_workers=1 and per-batch variants are the full run's
    n = report["settings"]["n"]
    for sc, r in rows.items():
        assert positive(r["epoch1_s"]) and positive(r["ratio_to_slowest_stage"]), r
        assert 0 <= r["stall_s"] <= r["data_wait_s"] + 1e-6 <= r["epoch1_s"] + 1e-6, r
        assert 0 <= r["items_waited"] <= n and 0 <= r["read_when_producer_done"] <= 1, r
        assert r["producer_rows"] == n, r  # a fresh cache each time: every row written once
        assert r["num_workers"] == 0 and r["runs"] == 2 and len(r["each_run"]) == 2, r  # QUICK's reps
    # Demand reaches the producer only when it is asked to serve it, and an announced epoch is served from it.
    assert rows["key_order"]["demand_rows"] == 0
    assert rows["schedule"]["demand_rows"] == 0
    assert 0 < rows["demand_wait"]["demand_rows"] <= n
    assert 0 < rows["demand_announced"]["demand_rows"] <= n
    assert rows["schedule"]["producer"] == "cache_builder --online"

    why = report["why_waits_only"]
    assert why["demand_batches"] >= 1 and why["demand_rows_per_batch"] >= 1 and why["items"] == n
    st = report["stages"]
    assert positive(st["producer_alone_s"]) and positive(st["student_alone"]["num_workers=0"]["median_s"])
    assert st["slowest"]["num_workers=0"]["stage"] in ("producer", "student")
    # Each goal is decided on the round-by-round ratios of its two scenarios: their median beside each round's.
    assert len(report["goals"]) == 3 and {g["verdict"] for g in report["goals"].values()} <= set(VERDICTS)
    assert_paired(report["goals"], {g: 2 for g in report["goals"]})
    each = {sc: r["each_run"] for sc, r in rows.items()}
    assert report["goals"]["announced_vs_schedule_epoch1"]["runs"] == pytest.approx(
        [c["epoch1_s"] / d["epoch1_s"] for c, d in zip(each["demand_announced"], each["schedule"])], rel=1e-3)
    assert all(shown(g) in proc.stdout for g in report["goals"].values())
    assert report["goal_met"] in (True, False)
    assert positive(report["calibration"]["ratio"])
    assert report["quick"] is True and report["date"] and report["machine"]["mxnet"]
    assert report["load"]["other_processes_cores_max"] is not None

    assert "machine:" in proc.stdout and "## First epoch, cold cache" in proc.stdout and "## Goals" in proc.stdout
    assert [d.startswith("kdcache-demand-") for d in os.listdir(tmp_path / "scratch")] == [True]  # kept: --tmp


SIZES = '{"reps":3,"tries":1,"epoch_s":1.5,"min_steps":6,"max_steps":40,"target":1.25}'


@pytest.mark.parametrize("module, flag, argv", [
    *(("demand", flag, argv) for flag, argv in REPORT_MISTAKES),
    ("demand.children", "--root", "prepare --sizes " + SIZES),
    ("demand.children", "--sizes", "prepare --root {tmp}/dir --sizes " + SIZES.replace("1.25", "0")),
    ("demand.children", "--demand", "produce --teacher {tmp}/t --dataset digits --cache {tmp}/dir/c --demand maybe"),
    ("demand.children", "--ready", "train --dataset digits --cache {tmp}/dir/c --order shuffle --read item "
                                   "--workers 0"),
    ("demand.children", "--workers", "train --dataset digits --cache {tmp}/dir/c --order shuffle --read item "
                                     "--workers 2 --ready {tmp}/dir/r"),
    ("demand.children", "--order", "train --dataset digits --cache {tmp}/dir/c --order random --read item "
                                   "--workers 0 --ready {tmp}/dir/r"),
    ("demand.children", "--root", "train --root {tmp}/dir --dataset digits --cache {tmp}/dir/c --order shuffle "
                                  "--read item --workers 0 --ready {tmp}/dir/r")])
def test_bench_demand_bad_options(tmp_path, module, flag, argv):
    assert_refused(tmp_path, module, flag, argv)
