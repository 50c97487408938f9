"""The codec benchmark runs end to end (--quick): every codec row, the students, the floors and the Hinton rows."""
import pytest

from tests.helpers import run_bench
from tests.test_bench_sizing import REPORT_MISTAKES, assert_refused

ROWS = {10: ["full/float32", "full/float16", "topk:1", "topk:5", "sampled:9", "int8"],  # topk:10 only where K < C
        1000: ["full/float32", "full/float16", "topk:1", "topk:5", "sampled:9", "topk:10", "sampled:16", "int8"]}


@pytest.mark.slow
def test_bench_codecs_quick_writes_every_row_and_verdict(tmp_path):
    (tmp_path / "results").mkdir()
    proc, rep = run_bench("codecs", tmp_path, "--seeds", "1", timeout=900)
    assert rep["quick"] is True and rep["settings"]["temperature"] == 20.0
    assert rep["settings"]["seeds"] == {"digits": [0], "mnist5k": [0], "synthetic": [0]}
    assert rep["settings"]["views"]["mnist5k"] == {"views": 8, "augment": "crop:2"}
    assert rep["machine"]["cpu_model"] is not None and rep["machine"]["omp_num_threads"] == "1"
    assert set(rep["datasets"]) == {"digits", "mnist5k", "synthetic"}
    for name, d in rep["datasets"].items():
        assert list(d["codecs"]) == ROWS[d["classes"]], name
        assert 0.5 < d["teacher"]["test_acc"] <= 1.0
        for label, row in d["codecs"].items():
            codec = label.split("/")[0]
            c = d["classes"]
            want = {"full/float32": 4 * c, "full/float16": 2 * c, "int8": c + 8}.get(label)
            k = int(codec.split(":")[1]) if ":" in codec else None
            want = want or (3 * k if codec.startswith("sampled:") else 4 * k + 8)  # sampled: uint16 class, uint8 count
            assert row["bytes_per_row"] == want, (name, label)
            assert set(row["kl"]) == {"1", "4", "20"} and all(v >= 0 for v in row["kl"].values())
            # a few draws from a spread posterior (synthetic's teacher is right 64% of the time) may miss its top
            assert (0.3 if codec.startswith("sampled:") else 0.9) <= row["top1_agreement"] <= 1.0
            assert row["student"]["ece_mean"] is not None and 0 <= row["student"]["ece_mean"] <= 1
            assert len(row["student"]["accs"]) == 1 and 0 < row["student"]["mean"] <= 1
            # one fill per codec (per seed with several views: the augmentation is keyed by the seed)
            assert row["teacher_forwards"] == d["n_train"] * d["views"] * (len(d["seeds"]) if d["views"] > 1 else 1)
            if codec.startswith("topk:"):
                assert set(row["ideal"]) == set(row["ratio"]) == {"1", "4", "20"}
        assert d["codecs"]["full/float32"]["kl"] == {"1": 0.0, "4": 0.0, "20": 0.0}  # the exact logits themselves
        assert d["scratch"]["teacher_forwards"] == 0
    # int8 is closer to the teacher than any top-K, and full float16 closer still
    for d in rep["datasets"].values():
        for t in ("1", "4", "20"):
            kl = {label: row["kl"][t] for label, row in d["codecs"].items()}
            assert kl["full/float16"] <= kl["int8"] < min(v for k, v in kl.items() if k.startswith("topk:"))
    floors = rep["floors"]
    assert all(set(f) == {"floor", "measured", "value", "verdict"} and f["verdict"] in ("PASS", "MISS")
               for f in floors)
    assert sum("within 1.5x of the ideal" in f["floor"] for f in floors) == 2 + 2 + 3
    assert any("mnist5k `topk:5` student" in f["floor"] for f in floors)
    h = rep["hinton"]
    assert set(h["rows"]) == {"teacher", "scratch", "inline", "cache"}
    assert h["rows"]["cache"]["teacher_forwards"] == 4000 * 8  # 8 views, filled once
    assert h["rows"]["inline"]["teacher_forwards"] == 4000 * rep["datasets"]["mnist5k"]["epochs"]
    assert set(h["gap_closed"]) == {"inline", "cache"}
    for title in ("## digits", "## mnist5k", "## synthetic", "## Floors", "Hinton et al. (2015)", "| `int8` |",
                  "| no teacher (scratch) |", "| student distilled, inline |"):
        assert title in proc.stdout, title


@pytest.mark.parametrize("flag, argv", [
    ("--datasets", "--datasets nosuch"), ("--datasets", "--datasets ,"), ("--seeds", "--seeds 0"),
    ("--jobs", "--jobs 0"), ("--temperature", "-T 0"), ("--alpha", "--alpha 2"),
    ("--teachers", "--teachers {tmp}/none --tmp {tmp}/scratch"),
    ("--teachers", "--teachers {tmp}/file --tmp {tmp}/scratch"), *REPORT_MISTAKES])
def test_bench_codecs_bad_options(tmp_path, flag, argv):
    assert_refused(tmp_path, "codecs", flag, argv)
