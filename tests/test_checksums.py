"""Checksums that travel with a cache: every flipped bit of a finished cache's data is caught by verify and
by the mapped reader; a copied cache is found by its fingerprint and verified elsewhere; caches written
before checksums existed are still read, and said to have none."""
import json
import os
import shutil
import subprocess
import sys
import zlib

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader, path_for
from kdcache.store.format import schema
from kdcache.store.format import checksums
from kdcache.store.errors import DamagedFileError, DamagedRowsError
from kdcache.store.folder.verify import verify
from tests.helpers import CHILD_ENV, as_format_1, expected_logits, flip, make_spec, produce, seal_again

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"
FLIPS = 2000 if TORTURE else 40  # per codec
CODECS = [("full", "float16"), ("topk:3", "float16"), ("int8", "float16"), ("full", "float32")]


def kdcache(*argv, cwd=ROOT):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=cwd, timeout=300)


def small_cache(folder, codec="full", dtype="float16", samples=300, views=2, chunk_bytes=512):
    """A finished cache of `samples` x `views` rows, its checksums over chunks of about `chunk_bytes`."""
    spec = make_spec(num_samples=samples, num_classes=12, views=views, codec=codec, dtype=dtype)
    p = path_for(str(folder), spec.fingerprint)
    old = checksums.CHUNK_BYTES
    checksums.CHUNK_BYTES = chunk_bytes  # many chunks in a small file
    try:
        assert produce(p, spec)
    finally:
        checksums.CHUNK_BYTES = old
    return p, spec


def regions(fin):
    """{dataset: (offset, bytes)} of every dataset's data in the finished file."""
    with h5py.File(fin, "r") as f:
        return {k: (f[k].id.get_offset(), f[k].size * f[k].dtype.itemsize) for k in f.keys()}


def read_all(p, spec):
    """Every row through the mapped reader, in random batches."""
    keys = np.random.default_rng(0).permutation(spec.num_keys)
    with CacheReader(p) as r:
        assert r.source == "map"
        for a in range(0, keys.size, 64):
            k = keys[a:a + 64]
            r.get(k // spec.views, k % spec.views)


@pytest.mark.parametrize("codec, dtype", CODECS)
def test_every_flipped_bit_in_the_data_is_caught_by_verify_and_the_reader(tmp_path, codec, dtype):
    p, spec = small_cache(tmp_path, codec, dtype)
    fin = p + ".h5"
    assert verify(p)[1] == [] and verify(p)[0]["checksums"].startswith("crc32")
    read_all(p, spec)  # sound: every chunk checks
    where = regions(fin)
    fields = [name for name, _, _ in spec.make_codec().fields]
    with h5py.File(fin, "r") as f:
        assert f[schema.CHECKSUMS].shape[0] > 10  # many chunks: the first bad one is named, not the file
    rng = np.random.default_rng(zlib.crc32(f"{codec}/{dtype}".encode()))
    names = fields + [schema.CHECKSUMS, schema.DONE]
    sizes = np.array([where[n][1] for n in names], dtype=float)
    for _ in range(FLIPS):
        name = names[rng.choice(len(names), p=sizes / sizes.sum())]
        off, size = where[name]
        at, bit = off + int(rng.integers(size)), int(rng.integers(8))
        flip(fin, at, bit)
        try:
            problems = verify(p)[1]
            assert problems, f"a flipped bit {bit} at byte {at} ({name}) passed verify"
            if name == schema.CHECKSUMS:  # the table is metadata: the seal covers it (test_seal.py)
                assert "does not match its seal" in problems[0]
                with pytest.raises(DamagedFileError, match="seal"):
                    read_all(p, spec)
            elif name != schema.DONE:  # the done flags are verify's: a mapped reader reads every row of a finished file
                assert "do not match their crc32 checksum" in problems[0]
                with pytest.raises(DamagedRowsError, match=r"samples \[\d+, \d+\) \(flat keys .*kdcache verify"):
                    read_all(p, spec)
        finally:
            flip(fin, at, bit)
    assert verify(p)[1] == []


def test_verify_names_the_first_bad_key_range_in_one_line_and_exits_1(tmp_path):
    p, spec = small_cache(tmp_path, samples=400, views=1, chunk_bytes=1024)
    with h5py.File(p + ".h5", "r") as f:
        samples = int(f[schema.CHECKSUMS].attrs[schema.CK_SAMPLES])
        off = f[schema.LOGITS].id.get_offset()
    row = spec.make_codec().bytes_per_row
    flip(p + ".h5", off + (3 * samples + 1) * row + 5, 2)  # in chunk 3
    flip(p + ".h5", off + (7 * samples) * row, 0)  # and chunk 7
    r = kdcache("verify", p)
    assert r.returncode == 1, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].endswith("NOT sound") and len(lines) == 2, r.stdout
    assert f"samples [{3 * samples}, {4 * samples})" in lines[1] and "first of 2 bad chunks" in lines[1]
    r = kdcache("verify", p, "--json")
    assert json.loads(r.stdout)["sound"] is False
    # a reader that never touches a bad chunk reads on; the first batch that does is refused
    with CacheReader(p) as rd:
        good = rd.get(np.arange(samples))
        assert np.array_equal(good, expected_logits(np.arange(samples), 12).astype(np.float16).astype(np.float32))
        with pytest.raises(DamagedRowsError, match=rf"samples \[{3 * samples}, {4 * samples}\)"):
            rd.get(np.arange(3 * samples + 2, 3 * samples + 10))


def test_a_cache_written_before_checksums_is_read_and_said_to_have_none(tmp_path, monkeypatch):
    monkeypatch.setattr(checksums, "write", lambda *a, **k: None)  # what compaction wrote before checksums
    p, spec = small_cache(tmp_path)
    monkeypatch.undo()
    # a sealed format promises checksums: one without them is refused, never read as an older file
    with pytest.raises(DamagedFileError, match="without its checksums"):
        CacheReader(p)
    assert "without its checksums" in verify(p)[1][0]
    as_format_1(p + ".h5")  # as kdcache wrote it before seals and checksums
    with h5py.File(p + ".h5", "r") as f:
        assert schema.CHECKSUMS not in f
    report, problems = verify(p)
    assert problems == [] and report["checksums"].startswith("no checksums")
    r = kdcache("verify", p)
    assert r.returncode == 0 and "no checksums" in r.stdout, r.stdout + r.stderr
    r = kdcache("inspect", p, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["checksums"].startswith("no checksums")
    read_all(p, spec)
    with CacheReader(p) as rd:
        k = np.arange(spec.num_samples)
        assert np.array_equal(rd.get(k, 1), expected_logits(k * 2 + 1, 12).astype(np.float16).astype(np.float32))


def test_checksums_that_do_not_fit_the_rows_are_one_line(tmp_path):
    p, _ = small_cache(tmp_path)
    with h5py.File(p + ".h5", "r+") as f:
        f[schema.CHECKSUMS].attrs[schema.CK_SAMPLES] = 7  # another chunking than the table's
    r = kdcache("verify", p)
    assert r.returncode == 1 and "seal" in r.stdout, r.stdout + r.stderr  # changed after it was written
    seal_again(p + ".h5")  # as a writer that got the table wrong would have sealed it
    r = kdcache("verify", p)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "checksums" in r.stderr, r.stderr
    with pytest.raises(Exception, match="its checksums are unreadable"):
        CacheReader(p)


def test_a_cache_copied_to_another_folder_is_reused_there_and_verified(tmp_path, teacher):
    a, b = tmp_path / "a", tmp_path / "b"
    b.mkdir()
    cache = ["cache", "--teacher", teacher, "--dtype", "float32", "--quiet", "--json"]
    r = kdcache(*cache, "--cache-dir", a)
    assert r.returncode == 0, r.stderr
    built = json.loads(r.stdout.strip().splitlines()[-1])
    shutil.copy(built["cache_path"], b)  # publish: the one .h5 file
    r = kdcache(*cache, "--cache-dir", b)
    assert r.returncode == 0, r.stderr
    again = json.loads(r.stdout.strip().splitlines()[-1])
    assert again["reused"] and again["teacher_forwards"] == 0 and again["fingerprint"] == built["fingerprint"]
    copy = os.path.join(b, os.path.basename(built["cache_path"]))
    assert kdcache("verify", copy).returncode == 0
    where = regions(copy)
    flip(copy, where[schema.LOGITS][0] + where[schema.LOGITS][1] // 2, 6)  # a bad copy
    r = kdcache("verify", copy)
    assert r.returncode == 1 and "do not match their crc32 checksum" in r.stdout, r.stdout
    with pytest.raises(DamagedRowsError, match="kdcache verify"):
        with CacheReader(copy) as rd:
            rd.get(np.arange(rd.spec.num_samples))


def test_bench_checksums_quick_writes_its_report(tmp_path):
    from bench.paired import shown
    from tests.helpers import assert_paired, positive, run_bench
    (tmp_path / "results").mkdir()
    proc, r = run_bench("checksums", tmp_path, "--rows", 2000, "--classes", 100, timeout=300)
    assert r["quick"] is True and r["rows"] == 2000 and r["extrapolation"] == 1_281_167 / 2000
    assert r["compaction"]["chunks"] >= 1 and positive(r["compaction"]["crc32_gb_per_s"])
    assert all(positive(v) for v in r["warm"].values()) and positive(r["cold"]["checked"])
    assert positive(r["open"]["first_touch_s"]) and positive(r["verify"]["with_s"])
    # The floor is decided on the round-by-round ratios of its interleaved rounds: their median, beside each one.
    assert set(r["verdicts"]) == set(r["paired"]) == {"checked_vs_numpy_gather"} and proc.stdout.count("\n## ") == 6
    assert_paired(r["paired"], {"checked_vs_numpy_gather": 3})  # bench.checksums.run.QUICK_ROUNDS
    f = r["paired"]["checked_vs_numpy_gather"]
    assert r["checked_vs_numpy_gather"] == f["measured"] and r["verdicts"]["checked_vs_numpy_gather"] == f["verdict"]
    assert all(len(v) == 3 for v in r["warm_runs"].values()) and shown(f) in proc.stdout
    from bench.checksums.run import render
    assert all(f"## {title}\n\n{table}" in proc.stdout for title, table in render(r))
    assert len(os.listdir(tmp_path / "scratch")) == 1  # its work folder, kept: --tmp was given
