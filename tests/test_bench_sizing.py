"""The sizing benchmark runs (--quick): bytes per view from the store's codecs, measured teacher rates."""
import json
import os
import subprocess
import sys
import time

import pytest

from tests.helpers import positive

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)
DOOR_S = 5.0  # a refused command's whole run; a --quick sizing measures for ~9 s before it writes
# (flag, argv) every benchmark with a report and a scratch folder refuses: --tmp names one that must stay unmade
REPORT_MISTAKES = [("--out", "--out {tmp}/dir --tmp {tmp}/scratch"),
                   ("--out", "--quick --out {tmp}/missing/x.json --tmp {tmp}/scratch"),
                   ("--tmp", "--quick --tmp {tmp}/file")]


def assert_refused(tmp_path, module, flag, argv):
    """python -m bench.<module> argv (words; {tmp}: tmp_path, which holds a folder `dir` and a file `file`) is
    refused at the door: exit 2, one stderr line naming `flag`, no traceback, within DOOR_S, and nothing
    written (no report, no DIR.tmp, no scratch folder)."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_text("x")
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", f"bench.{module}", *argv.replace("{tmp}", str(tmp_path)).split()],
                       cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    took = time.perf_counter() - t0
    lines = r.stderr.splitlines()
    assert r.returncode == 2, r.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"error: argument {flag}"), r.stderr[-3000:]
    assert "Traceback" not in r.stderr and r.stdout == ""
    assert took < DOOR_S, f"refused after {took:.1f} s: something ran before the options were checked"
    assert sorted(os.listdir(tmp_path)) == ["dir", "file"] and not os.listdir(tmp_path / "dir")


@pytest.mark.slow
def test_bench_sizing_quick_writes_report(tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "bench.sizing", "--quick", "--student-rate", "1000", "--cores", "10",
                        "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    # what a cache of ImageNet-1k would take, from the codecs the store writes
    assert rep["bytes_per_row"] == {"full/float32": 4000, "full/float16": 2000, "topk:10/float16": 48,
                                    "topk:5/float16": 28}
    assert set(rep["teachers"]) == {"resnet50_v1", "resnet18_v1", "mobilenet1.0"}
    for t in rep["teachers"].values():
        rate = t["images_per_s_per_core"]
        assert 0 < rate < 10000 and t["batches_timed"] >= 1
        assert t["cores_to_feed_student"] == pytest.approx(1000 / rate)
        assert t["cold_epoch_minutes_with_cores"] == pytest.approx(1_281_167 / (10 * rate) / 60)
    # each rate beside this core's peak: 2 x the multiply-adds of the network, no figure above one core's
    published_macs = {"resnet50_v1": 3.86e9, "resnet18_v1": 1.82e9, "mobilenet1.0": 569e6}
    peak = rep["peak"]["gflops"]
    assert rep["valid"] is True and positive(peak) and rep["cpu"]["family"]
    for name, t in rep["teachers"].items():
        assert t["macs_per_image"] == pytest.approx(published_macs[name], rel=0.02)
        assert t["gflops_per_core"] == pytest.approx(2 * t["macs_per_image"] / 1e9 * t["images_per_s_per_core"])
        assert t["gflops_per_core"] <= 1.1 * peak and t["cores_used"] <= 1.1 and t["invalid"] == ""
    assert rep["threads"]["before"]["OMP_NUM_THREADS"] == "1"
    assert set(rep["threads"]["after"]["omp_max_threads"].values()) == {1}
    # a smaller network runs faster per core: the measurement is not a constant
    assert rep["teachers"]["mobilenet1.0"]["images_per_s_per_core"] > rep["teachers"]["resnet50_v1"][
        "images_per_s_per_core"]
    assert r.stdout.count("\n## ") == 3 and "| teacher" in r.stdout and "Measured peak:" in r.stdout


@pytest.mark.parametrize("flag, argv", [
    ("--student-rate", "--student-rate nan"), ("--student-rate", "--student-rate inf"),
    ("--student-rate", "--student-rate 0"), ("--student-rate", "--student-rate x"), ("--cores", "--cores 0"),
    ("--cores", "--cores 1.5"), ("--out", "--out {tmp}/dir"), ("--out", "--out {tmp}/file/s.json"),
    ("--out", "--quick --out {tmp}/missing/x.json")])
def test_bench_sizing_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "sizing", flag, argv)
