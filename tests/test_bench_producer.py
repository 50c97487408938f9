"""The producer benchmark runs end to end (--quick) and writes the report the README and issues quote."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

RATIOS = ("producer_vs_bare_forward", "two_shards_vs_one", "two_shards_vs_one_aggregate")
RATES = ("bare_forward", "producer", "one_producer_wall", "two_shards_wall", "one_producer_reported",
         "two_shards_reported_sum")


def positive(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


@pytest.mark.slow
def test_bench_producer_quick_writes_report(tmp_path):
    out = tmp_path / "results" / "p.json"
    scratch = tmp_path / "scratch"
    env = dict(os.environ, PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-m", "bench.producer", "--quick", "--out", str(out),
                           "--tmp", str(scratch)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]

    report = json.loads(out.read_text())
    for key in RATIOS:
        assert positive(report[key]), (key, report[key])
    for key in RATES:
        assert positive(report["rows_per_s"][key]), (key, report["rows_per_s"][key])
    # Speed floors are for the benchmark report, not for tests: machines are noisy.
    assert set(report["floors"]) >= set(RATIOS) and set(report["verdicts"]) >= set(RATIOS)
    assert set(report["verdicts"].values()) <= {"PASS", "MISS"}

    # Two producers on shards 0/2 and 1/2 filled one complete cache holding the single producer's logits.
    assert report["two_shard_cache_equal"] is True, report["sections"]["two_shards_vs_one"]["checks"]
    for check in report["sections"]["two_shards_vs_one"]["checks"]:
        assert check["complete"] and check["same_fingerprint"] and check["rows_written"] > 0

    assert positive(report["cache_bytes"]) and positive(report["teacher_forward_ms_per_batch"])
    assert report["quick"] is True
    assert report["machine"]["mxnet"] and report["machine"]["numpy"] and report["date"]

    # One markdown table per section on stdout, and every temporary file removed.
    assert proc.stdout.count("\n## ") == 3 and "| verdict" in proc.stdout
    assert os.listdir(scratch) == []
