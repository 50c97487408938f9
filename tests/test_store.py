"""The HDF5 store in one process: writer, reader, the file they share, and bad input and damaged files."""
import json
import os
import stat
import time

import h5py
import numpy as np
import pytest

from kdcache.store import (BadInputError, CacheNotFoundError, CacheReader, CacheWriter, FingerprintMismatchError,
                   MissingTargetsError, ProducerGoneError, StoreError, UnsupportedFormatError, WriterBusyError,
                   path_for)
from kdcache.store.format import schema
from kdcache.store.folder.registry import final_path, parts_path, verify
from kdcache.store.osutil import write_json_atomic
from tests.helpers import expected_logits, make_spec, produce, seal_again


def build(cache_dir, spec, seed=0, batch=32):
    p = path_for(cache_dir, spec.fingerprint)
    assert produce(p, spec, seed=seed, batch=batch)
    return p


# --- writer and reader -------------------------------------------------------------------
@pytest.mark.parametrize("codec,dtype", [("full", "float32"), ("full", "float16"), ("topk:3", "float16")])
def test_round_trip_in_shuffled_order_with_views(cache_dir, codec, dtype):
    spec = make_spec(num_samples=300, num_classes=12, views=3, codec=codec, dtype=dtype)
    p = build(cache_dir, spec)
    keys = np.arange(spec.num_keys)
    want = spec.make_codec().decode(spec.make_codec().encode(expected_logits(keys, 12)))
    for mapped, budget, source in ((True, None, "map"), (False, None, "ram"), (False, 0, "disk")):
        with CacheReader(p, spec=spec, memory_budget=budget, mmap=mapped) as r:
            assert r.complete and r.source == source
            idx = np.array([5, 299, 0, 5, 17])
            views = np.array([2, 0, 1, 2, 1])
            assert np.array_equal(r.get(idx, views), want[idx * 3 + views])
            assert np.array_equal(r.get(np.arange(300), 1), want[np.arange(300) * 3 + 1])


def test_finished_file_is_self_describing_with_plain_h5py(cache_dir):
    spec = make_spec(num_samples=40, num_classes=7, views=2, codec="topk:2", dtype="float16")
    p = build(cache_dir, spec)
    assert not os.path.exists(parts_path(p)), "segments are removed once compacted"
    with h5py.File(final_path(p), "r") as f:
        assert f.attrs[schema.A_FORMAT] == schema.FORMAT_VERSION
        assert isinstance(f.attrs[schema.A_FORMAT].item(), int)
        # text is fixed-length bytes: stored in the object header HDF5 checksums, not in its global heap
        assert f.attrs[schema.A_FINGERPRINT] == spec.fingerprint.encode()
        assert f.attrs[schema.A_COMPLETE] == 1
        assert json.loads(f.attrs[schema.A_INPUTS]) == spec.inputs
        assert f[schema.TOPK_VALUES].shape == (40, 2, 2) and f[schema.TOPK_VALUES].dtype == np.float16
        assert f[schema.TOPK_INDICES].dtype == np.uint16
        assert f[schema.TOPK_LSE].shape == (40, 2)
        assert f[schema.DONE][...].all()
        for v in f.attrs.values():  # JSON and plain numbers only: nothing to unpickle
            assert isinstance(v, (str, bytes, np.integer, int, float, np.floating))
        raw = expected_logits(np.array([13 * 2 + 1]), 7)[0]
        assert int(f[schema.TOPK_INDICES][13, 1, 0]) == int(np.argmax(raw))


def test_reader_sees_rows_while_the_writer_is_open(cache_dir):
    spec = make_spec(num_samples=100)
    p = path_for(cache_dir, spec.fingerprint)
    with CacheWriter(p, spec) as w:
        w.write([3, 4], expected_logits([3, 4], 10))
        with CacheReader(p, spec=spec) as r:
            assert np.array_equal(r.get([4, 3]), expected_logits([4, 3], 10))
            assert r.missing([3, 9, 10]).tolist() == [9, 10]
            with pytest.raises(MissingTargetsError) as ei:
                r.get([3, 50], wait=False)
            assert ei.value.missing.tolist() == [50]
            w.write([50], expected_logits([50], 10))
            assert np.array_equal(r.get([3, 50], wait=False), expected_logits([3, 50], 10))
            # a live producer that never writes the key: a timeout, not a hang
            with pytest.raises(MissingTargetsError, match="behind"):
                r.get([60], timeout=0.5)
            assert r.stall_s >= 0.5
            assert not r.complete and 0 < r.progress < 1


def test_reader_fails_fast_when_no_producer_is_alive(cache_dir):
    spec = make_spec(num_samples=100)
    p = path_for(cache_dir, spec.fingerprint)
    w = CacheWriter(p, spec)
    w.write([1], expected_logits([1], 10))
    w.abort()  # like a crash: the lock is gone, rows stay
    import time
    with CacheReader(p, spec=spec) as r:
        t = time.monotonic()
        with pytest.raises(ProducerGoneError, match="no producer"):
            r.get([1, 2], timeout=60)
        assert time.monotonic() - t < 3
        assert np.array_equal(r.get([1]), expected_logits([1], 10))


def test_resume_skips_done_keys_and_completes(cache_dir):
    spec = make_spec(num_samples=200)
    p = path_for(cache_dir, spec.fingerprint)
    w = CacheWriter(p, spec)
    w.write(np.arange(0, 120), expected_logits(np.arange(120), 10))
    w.abort()
    with CacheWriter(p, spec) as w2:
        assert w2.missing().tolist() == list(range(120, 200))
        assert w2.write(np.arange(100, 200), expected_logits(np.arange(100, 200), 10)) == 80
        assert w2.rows_skipped == 20
    assert w2.complete
    with CacheReader(p) as r:
        assert np.array_equal(r.get(np.arange(200)), expected_logits(np.arange(200), 10))
    # a complete cache is reused: nothing is owed
    with CacheWriter(p, spec) as w3:
        assert w3.complete and w3.remaining == 0


def test_two_shards_equal_a_single_producer(cache_dir, tmp_path):
    spec = make_spec(num_samples=333, views=2)
    one = build(str(tmp_path), spec)
    p = path_for(cache_dir, spec.fingerprint)
    assert not produce(p, spec, shard=(1, 2), seed=5)  # half the keys: not complete yet
    with CacheReader(p) as r:
        assert 0.49 < r.progress < 0.51
    assert produce(p, spec, shard=(0, 2), seed=6)
    with h5py.File(final_path(one)) as a, h5py.File(final_path(p)) as b:
        assert np.array_equal(a[schema.LOGITS][...], b[schema.LOGITS][...])


# --- bad input ---------------------------------------------------------------------------
@pytest.fixture
def half_built(cache_dir):
    spec = make_spec(num_samples=100)
    p = path_for(cache_dir, spec.fingerprint)
    w = CacheWriter(p, spec)
    w.write(np.arange(50), expected_logits(np.arange(50), 10))
    return spec, p, w


def _intact(p, n=50):
    with CacheReader(p) as r:
        assert r.missing(np.arange(n)).size == 0
        assert np.array_equal(r.get(np.arange(n)), expected_logits(np.arange(n), 10))
        return r.progress


@pytest.mark.parametrize("bad,match", [
    (lambda k: np.where(np.arange(10) == 3, np.nan, expected_logits(k, 10)), "NaN or Inf"),
    (lambda k: np.full((k.size, 10), np.inf, np.float32), "NaN or Inf"),
    (lambda k: expected_logits(k, 11), "classes"),
    (lambda k: expected_logits(k, 10)[:, None, :], r"\[batch, 10\]"),
    (lambda k: expected_logits(k, 10)[:-1], "do not fit"),
    (lambda k: (expected_logits(k, 10) * 10).astype(np.int64), "dtype"),
])
def test_bad_logits_are_refused_and_nothing_is_written(half_built, bad, match):
    spec, p, w = half_built
    k = np.arange(60, 70)
    with pytest.raises(BadInputError, match=match):
        w.write(k, bad(k))
    assert w.missing().size == 50
    w.abort()
    assert _intact(p) == 0.5


def test_float16_overflow_is_refused(cache_dir):
    spec = make_spec(dtype="float16")
    with CacheWriter(path_for(cache_dir, spec.fingerprint), spec) as w:
        with pytest.raises(BadInputError, match="float32"):
            w.write([0], np.full((1, 10), 1e6, np.float32))


@pytest.mark.parametrize("idx,views,match", [([100], 0, "out of range"), ([-1], 0, "out of range"),
                                             ([1], 1, "view")])
def test_keys_out_of_range(half_built, idx, views, match):
    spec, p, w = half_built
    with pytest.raises(BadInputError, match=match):
        w.write(idx, expected_logits([0], 10), views=views)
    w.abort()
    _intact(p)


def test_second_writer_on_the_same_shard_is_refused(half_built):
    spec, p, w = half_built
    with pytest.raises(WriterBusyError, match=f"pid {os.getpid()}"):
        CacheWriter(p, spec, lock_wait_s=0.2)
    other = CacheWriter(p, spec, shard=(1, 2), lock_wait_s=0.2)  # another shard is fine
    other.abort()
    w.abort()
    _intact(p)


def test_foreign_shard_keys_are_refused(cache_dir):
    spec = make_spec()
    with CacheWriter(path_for(cache_dir, spec.fingerprint), spec, shard=(0, 2)) as w:
        with pytest.raises(BadInputError, match="shard 1/2"):
            w.write([1], expected_logits([1], 10))
        w.abort()
    with pytest.raises(StoreError, match="shard"):
        CacheWriter(path_for(cache_dir, spec.fingerprint), spec, shard=(2, 2))


def test_file_built_for_another_fingerprint_is_refused(cache_dir):
    a = make_spec(tag="teacher-a")
    b = make_spec(tag="teacher-b")
    pa = build(cache_dir, a)
    wrong = path_for(cache_dir, b.fingerprint)
    os.rename(final_path(pa), final_path(wrong))  # a cache file under the wrong name
    with pytest.raises(FingerprintMismatchError, match=a.fingerprint):
        CacheWriter(wrong, b)
    with pytest.raises(FingerprintMismatchError, match=b.fingerprint):
        CacheReader(wrong, spec=b)
    assert os.path.exists(final_path(wrong)), "the refused file is left alone"
    # in progress too
    w = CacheWriter(path_for(cache_dir, a.fingerprint), a)
    w.write([0], expected_logits([0], 10))
    w.abort()
    os.rename(parts_path(pa), parts_path(wrong))
    with pytest.raises(FingerprintMismatchError):
        CacheWriter(wrong, b)


def test_newer_format_version_is_refused(cache_dir):
    spec = make_spec()
    p = build(cache_dir, spec)
    with h5py.File(final_path(p), "r+") as f:
        f.attrs[schema.A_FORMAT] = schema.FORMAT_VERSION + 1
    seal_again(final_path(p))  # as a newer kdcache would have written it
    with pytest.raises(UnsupportedFormatError, match="upgrade kdcache"):
        CacheReader(p)
    with pytest.raises(UnsupportedFormatError, match="upgrade kdcache"):
        CacheWriter(p, spec)


@pytest.mark.parametrize("content", [b"\0" * 4096, b"PK\x03\x04 not hdf5 at all", b""])
def test_garbage_named_like_a_cache_is_refused_and_kept(cache_dir, content):
    spec = make_spec()
    p = path_for(cache_dir, spec.fingerprint)
    with open(final_path(p), "wb") as fh:
        fh.write(content)
    with pytest.raises(UnsupportedFormatError, match="not a kdcache cache file"):
        CacheReader(p)
    with pytest.raises(UnsupportedFormatError):
        CacheWriter(p, spec)
    assert open(final_path(p), "rb").read() == content
    with pytest.raises(UnsupportedFormatError, match="not a kdcache cache file"):
        verify(p)


def test_truncated_cache_file_is_refused(cache_dir):
    spec = make_spec(num_samples=2000)
    p = build(cache_dir, spec)
    size = os.path.getsize(final_path(p))
    with open(final_path(p), "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(UnsupportedFormatError, match="truncated"):
        CacheReader(p).get(np.arange(2000))
    problems = verify(p)[1]  # kdcache's file, changed: NOT sound
    assert len(problems) == 1 and "truncated" in problems[0]


def test_hdf5_file_without_kdcache_metadata(cache_dir):
    spec = make_spec()
    p = path_for(cache_dir, spec.fingerprint)
    with h5py.File(final_path(p), "w") as f:
        f["x"] = np.zeros(3)
    with pytest.raises(UnsupportedFormatError, match="not a kdcache cache"):
        CacheReader(p)


def test_missing_cache_names_the_fix(cache_dir):
    with pytest.raises(CacheNotFoundError, match="build it with `kdcache cache`"):
        CacheReader(os.path.join(cache_dir, "0123456789abcdef0123"))


def test_cache_dir_that_is_a_file(tmp_path):
    f = tmp_path / "notadir"
    f.write_text("x")
    spec = make_spec()
    with pytest.raises(StoreError, match="is a file"):
        CacheWriter(path_for(str(f), spec.fingerprint), spec)
    assert f.read_text() == "x"


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_cache_dir(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(stat.S_IRUSR | stat.S_IXUSR)
    spec = make_spec()
    try:
        with pytest.raises(StoreError, match="writable"):
            CacheWriter(path_for(str(d), spec.fingerprint), spec)
    finally:
        d.chmod(0o755)


def test_read_only_cache_dir_as_root_via_readonly_parts(tmp_path):
    """Root bypasses permissions; a parts path that cannot be created still gives a clear error."""
    spec = make_spec()
    d = tmp_path / "c"
    d.mkdir()
    (d / (spec.fingerprint + ".parts")).write_text("in the way")
    with pytest.raises(StoreError, match="not a directory"):
        CacheWriter(path_for(str(d), spec.fingerprint), spec)


def test_reader_views_and_indices_out_of_range(cache_dir):
    spec = make_spec(num_samples=10, views=2)
    p = build(cache_dir, spec)
    with CacheReader(p) as r:
        with pytest.raises(BadInputError, match="out of range"):
            r.get([10])
        with pytest.raises(BadInputError, match="view"):
            r.get([1], views=2)
        with pytest.raises(BadInputError, match="view"):
            r.get([1, 2], views=[0, 5])


def test_segments_hold_only_chunked_datasets(cache_dir):
    """HDF5 >= 1.14.4 SWMR readers reject contiguous datasets of a file being written."""
    spec = make_spec(codec="topk:2")
    p = path_for(cache_dir, spec.fingerprint)
    w = CacheWriter(p, spec)
    w.write([0], expected_logits([0], 10))
    with h5py.File(w.segment_path, "r", swmr=True) as f:
        assert f.attrs[schema.A_KIND] == schema.KIND_SEGMENT.encode()
        assert sorted(f) == sorted([schema.SEG_KEYS, schema.SEG_STATE, schema.TOPK_VALUES,
                                    schema.TOPK_INDICES, schema.TOPK_LSE, schema.TOPK_LOGTAIL])
        for name in f:
            assert f[name].chunks is not None, name
    w.abort()


def test_the_grace_for_a_starting_producer_ends_when_the_caller_sees_it_exit(cache_dir):
    """A cache whose producer died while starting (manifest written, nothing locked or written):
    grace_s keeps a reader waiting for it, `starting` returning False ends that at once."""
    spec = make_spec(num_samples=50)
    p = path_for(cache_dir, spec.fingerprint)
    os.makedirs(parts_path(p))
    write_json_atomic(os.path.join(parts_path(p), schema.MANIFEST), spec.meta())
    alive = [True]
    r = CacheReader(p, spec=spec, grace_s=60.0, starting=lambda: alive[0])
    assert r.producer_alive()  # still starting, as far as anyone knows
    alive[0] = False
    t = time.monotonic()
    with pytest.raises(ProducerGoneError, match="no producer is running"):
        r.get([0, 1], timeout=30)
    assert time.monotonic() - t < 2
    r.close()
