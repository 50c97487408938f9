"""The sizing benchmark runs (--quick): bytes per view from the store's codecs, measured teacher rates."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT)


@pytest.mark.slow
def test_bench_sizing_quick_writes_report(tmp_path):
    out = tmp_path / "s.json"
    r = subprocess.run([sys.executable, "-m", "bench.sizing", "--quick", "--student-rate", "1000", "--cores", "10",
                        "--out", str(out)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    # what a cache of ImageNet-1k would take, from the codecs the store writes
    assert rep["bytes_per_row"] == {"full/float32": 4000, "full/float16": 2000, "topk:10/float16": 44,
                                    "topk:5/float16": 24}
    assert set(rep["teachers"]) == {"resnet50_v1", "resnet18_v1", "mobilenet1.0"}
    for t in rep["teachers"].values():
        rate = t["images_per_s_per_core"]
        assert 0 < rate < 10000 and t["batches_timed"] >= 1
        assert t["cores_to_feed_student"] == pytest.approx(1000 / rate)
        assert t["cold_epoch_minutes_with_cores"] == pytest.approx(1_281_167 / (10 * rate) / 60)
    # a smaller network runs faster per core: the measurement is not a constant
    assert rep["teachers"]["mobilenet1.0"]["images_per_s_per_core"] > rep["teachers"]["resnet50_v1"][
        "images_per_s_per_core"]
    assert r.stdout.count("\n## ") == 2 and "| teacher" in r.stdout


def test_bench_sizing_bad_options():
    r = subprocess.run([sys.executable, "-m", "bench.sizing", "--cores", "0"], cwd=ROOT, env=ENV,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--cores" in r.stderr and "Traceback" not in r.stderr
