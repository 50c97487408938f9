"""The publishing benchmark runs end to end (--quick, small files) against a real nginx and writes its report."""
import pytest

from bench.publish.nginx import binary
from bench.publish.run import render
from tests.helpers import assert_paired, positive, run_bench


@pytest.mark.skipif(binary() is None, reason="nginx is not installed (apt-get install nginx-light; .ci/run installs it)")
def test_bench_publish_quick_writes_its_report(tmp_path):
    (tmp_path / "results").mkdir()
    proc, report = run_bench("publish", tmp_path, "--rows", "2000", "--imagenet-rows", "5000", timeout=300)
    rate = report["rate"]
    assert rate["rounds"] == 3 and all(len(v) == 3 for v in rate["seconds"].values())
    assert all(positive(v) for v in rate["mb_per_s"].values()) and set(rate["mb_per_s"]) == {"curl", "curl_fsync", "fetch", "command"}
    assert_paired(report["paired"], {"fetch_vs_curl": 3})
    assert report["verdicts"]["fetch_vs_curl"] == report["paired"]["fetch_vs_curl"]["verdict"]
    res = report["resume"]  # killed once half was staged: the rest came in one range request
    assert res["killed_at"] >= 0.5 and [q["status"] for q in res["resumed_requests"]] == [206]
    assert res["resumed_requests"][0]["bytes"] == res["file_bytes"] - res["killed_at_bytes"] == res["fetched_by_resume"]
    assert 0 <= res["fetched_again"] <= res["chunk"] and report["verdicts"]["resume_fetched_again"] == "PASS"
    big = report["large"]
    assert big["rows"] == 5000 and big["bitwise_equal"] is True and positive(big["pull_s"]) and positive(big["publish_s"])
    assert big["file_bytes"] > 5000 * 2000  # 1000 float16 logits a row
    assert report["quick"] is True and report["machine"]["cpu_model"] is not None and report["versions"]["nginx"]
    titles = [t for t, _ in render(report)]
    assert len(titles) == 4 and "Floors" in titles[-1]
    assert "Pull rate against curl" in proc.stdout
