"""The KD benchmark runs end to end (--quick): every pair and scenario, the floors, the plot."""
import os

import pytest

from tests.helpers import positive, run_bench
from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

PAIRS = ("light", "heavy")
SCENARIOS = ("student_only", "inline", "inline_async", "online", "warm", "ring")


@pytest.mark.slow
def test_bench_kd_quick_writes_report_and_plot(tmp_path):
    (tmp_path / "results").mkdir()  # run_bench's --out: a file in a folder that exists
    proc, report = run_bench("kd", tmp_path, "--rounds", 2, timeout=580)
    rows = {(r["pair"], r["scenario"]): r for r in report["results"]}
    for pair in PAIRS:
        for sc in SCENARIOS:
            r = rows.get((pair, sc))
            assert r is not None, f"{pair}/{sc} missing from the report"
            assert positive(r["samples_per_s"]) and positive(r["epoch1_s"]), r
            assert positive(r["ratio_to_student_only"]), r
            assert positive(r["peak_rss_mib"].get("trainer")), r
        # A warm cache: the trainer reads every target and the teacher runs zero times.
        assert rows[(pair, "warm")]["teacher_forwards"] == 0
        assert rows[(pair, "warm")]["producer_started"] is False
        # Cold cache and ring: a producer ran the teacher and its memory was measured.
        for sc in ("online", "ring"):
            assert rows[(pair, sc)]["producer_started"] is True
            assert rows[(pair, sc)]["teacher_forwards"] > 0
            assert positive(rows[(pair, sc)]["peak_rss_mib"].get("producer")), rows[(pair, sc)]
        assert rows[(pair, "student_only")]["teacher_forwards"] == 0
        assert rows[(pair, "inline")]["teacher_forwards"] > 0
        assert rows[(pair, "inline_async")]["teacher_forwards"] > 0
        # the trainer never had to start a third process for the teacher's test accuracy
        assert not any(r["test_producer_started"] for r in report["results"])

    # Every floor has a verdict (speed floors are for the report, not for tests: machines are noisy). --quick
    # --rounds 2: every scenario in round 1, warm and the student alone in round 2 too, so warm's floor rests on two
    # paired ratios (median, spread: their range, each round's) and the others on one run: no spread, no verdict.
    assert len(report["floors"]) == 8 and (report["rounds"], report["full_rounds"]) == (2, 1)
    for key, f in report["floors"].items():
        assert f["verdict"] in ("PASS", "MISS", "UNMEASURABLE"), f
        if key.startswith("warm_vs_student_only"):
            assert len(f["runs"]) == 2 and abs(f["measured"] - sum(f["runs"]) / 2) < 1e-3
            assert f["interval"] == sorted(f["runs"])
            assert abs(f["spread"] - max(f["measured"] - min(f["runs"]), max(f["runs"]) - f["measured"])) < 2e-4
        else:
            assert len(f["runs"]) == 1 and f["spread"] is None and f["verdict"] == "UNMEASURABLE", f
    for pair in PAIRS:
        w = report["floors"][f"warm_vs_student_only:{pair}"]
        warm, so = rows[(pair, "warm")], rows[(pair, "student_only")]
        assert [round(a / b, 4) for a, b in zip(warm["runs_samples_per_s"], so["runs_samples_per_s"])] == w["runs"]
        assert len(rows[(pair, "online")]["runs_samples_per_s"]) == 1  # not in the guard's round
    for pair in PAIRS:
        c = report["calibration"]["pairs"][pair]
        assert positive(c["ratio"]) and positive(c["forward_ms"]) and positive(c["student_step_ms"])
        st = report["stages"][pair]
        assert positive(st["teacher_alone_epoch_s"]) and len(st["teacher_alone_passes_epoch_s"]) == 1
        # the epoch-1 floors: round r's epoch 1 over round r's slowest stage alone
        so = rows[(pair, "student_only")]
        assert len(so["epoch1_runs"]) == 2 and abs(so["epoch1_s"] - sum(so["epoch1_runs"]) / 2) < 1e-6
        # round 2 ran warm and the student alone only, warm reading the cache round 1's online run filled
        assert rows[(pair, "warm")]["teacher_forwards"] == 0 and not rows[(pair, "warm")]["producer_started"]
        slowest = [max(t, s) for t, s in zip(st["teacher_alone_passes_epoch_s"], so["epoch1_runs"])]
        for sc in ("online", "ring"):
            f = report["floors"][f"{sc}_epoch1_vs_slowest_stage:{pair}"]
            runs = rows[(pair, sc)]["epoch1_runs"]
            assert all(abs(a - e / s) < 2e-3 for a, e, s in zip(f["runs"], runs, slowest)), (f, runs, slowest)
            assert rows[(pair, sc)]["epoch1_start_after_launch_s"] > 0 and f["startup_wait_s"] >= 0
    assert report["quick"] is True and report["date"] and report["machine"]["mxnet"]
    assert report["gpu"]["skipped"] in (True, False)

    png = tmp_path / "results" / "kd_online.png"
    assert png.exists() and png.stat().st_size > 10_000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # One table per pair plus calibration and floors on stdout; the run's files kept in one folder of --tmp.
    assert "## light teacher" in proc.stdout and "## heavy teacher" in proc.stdout and "## Floors" in proc.stdout
    assert [d.startswith("kdcache-kd-") for d in os.listdir(tmp_path / "scratch")] == [True]


SIZES = '{"reps":3,"tries":1,"epoch_s":0.75,"min_steps":3,"max_steps":40}'  # bench.kd --quick's


@pytest.mark.parametrize("module, flag, argv", [
    *(("kd", flag, argv) for flag, argv in REPORT_MISTAKES),
    ("kd", "--png", "--quick --png {tmp}/dir --tmp {tmp}/scratch"),
    ("kd", "--png", "--quick --png {tmp}/missing/p.png --tmp {tmp}/scratch"),
    # the MXNet child: each option checked as the trainer's are, and the options each child needs
    ("kd.children", "--root", "prepare --sizes " + SIZES), ("kd.children", "--root", "prepare --root {tmp}/file"),
    ("kd.children", "--sizes", "prepare --root {tmp}/dir --sizes " + SIZES.replace('"reps":3', '"reps":0')),
    ("kd.children", "--sizes", "prepare --root {tmp}/dir --sizes " + SIZES.replace("0.75", "NaN")),
    ("kd.children", "--teacher", "async --teacher {tmp}/none --dataset digits"),
    ("kd.children", "--epochs", "async --teacher {tmp}/none --dataset digits --epochs 0"),
    ("kd.children", "--ctx", "async --teacher {tmp}/none --dataset digits --ctx tpu"),
    ("kd.children", "--root", "async --root {tmp}/dir --teacher {tmp}/none --dataset digits")])
def test_bench_kd_bad_options(tmp_path, module, flag, argv):
    assert_refused(tmp_path, module, flag, argv)
