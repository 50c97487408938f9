"""bench.fleet --quick: Ray actors against the local producer, a task's costs, parts at ImageNet-1k row size, and
ImageNet-21k on paper, every figure in the report and its tables."""
import pytest

from tests.helpers import run_bench

pytestmark = pytest.mark.slow


def test_bench_fleet_quick_writes_every_section(tmp_path):
    (tmp_path / "results").mkdir()  # run_bench's --out: a file in a folder that exists
    _, report = run_bench("fleet", tmp_path)
    s = report["sections"]
    for k in ("1", "2"):
        runs = s["engines"][k]
        assert len(runs["local"]) == len(runs["ray"]) == 1
        assert all(r["rows_per_s"] > 0 and r["rows"] == 8192 for r in runs["local"] + runs["ray"])
        assert runs["ray"][0]["nodes"] == 1 and runs["ray"][0]["actors"] == int(k)
    assert set(report["verdicts"]) == {"ray_vs_local_x1", "ray_vs_local_x2"}
    assert [t["block_rows"] for t in s["task_sizes"]] == [1024, 4096]
    assert all(t["tasks"] == -(-8192 // t["block_rows"]) and t["write_s"] > 0 for t in s["task_sizes"])
    assert s["reader"]["parts"] == 4 and s["reader"]["fraction_done"] == 0.5
    sc = s["scale"]
    assert sc["parts"] == 8 and sc["bytes"] == 8 * 4096 * 2000 and sc["compact_s"] > 0 and sc["check_s"] > 0
    fin = s["finish"]  # compaction against a part index, from the same parts, the same rows read both ways
    assert fin["rows"] == 20_000 and fin["parts"] == 5 and fin["part_bytes"] > 20_000 * 2000
    assert fin["compaction"]["written_bytes"] >= 20_000 * 2000 > fin["part_index"]["written_bytes"] > 20_000 * 8
    assert all(f["finish_s"] > 0 and f["warm_epoch_s"] > 0 for f in (fin["compaction"], fin["part_index"]))
    rows = report["imagenet21k"]["table"]
    assert [r["hosts"] for r in rows] == [8, 64, 512] * 2
    assert rows[0]["parts"] == -(-14_197_122 * 10 // 4096) and rows[3]["bytes"] == 14_197_122 * 10 * 2 * 21_841
    assert rows[0]["index_maps"] == 4 * rows[0]["parts"] and rows[3]["index_maps"] == rows[3]["parts"]
    assert rows[3]["finish_h"] > 0 and rows[3]["finish_index_h"] > 0
