"""A finished cache memory-mapped: the same rows as the RAM and disk paths, every codec and dtype,
several views; the switch from a followed cache to the map; the fallbacks, logged."""
import logging
import mmap
import os

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdcache.store import BadInputError, CacheReader, path_for
from kdcache.store.format import schema
from kdcache.store.folder.registry import final_path, parts_path
from tests.helpers import expected_logits, make_spec, produce

CODECS = [("full", "float16"), ("full", "float32"), ("topk:3", "float16"), ("topk:3", "float32"),
          ("topk:12", "float16"), ("int8", "float16")]
SOURCES = [(True, None, "map"), (False, None, "ram"), (False, 0, "disk")]
N, C, V = 257, 12, 3


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """One finished cache per codec, N samples x V views, written in a shuffled order."""
    d = str(tmp_path_factory.mktemp("mapped"))
    out = {}
    for codec, dtype in CODECS:
        spec = make_spec(num_samples=N, num_classes=C, views=V, codec=codec, dtype=dtype)
        p = path_for(d, spec.fingerprint)
        assert produce(p, spec, seed=3, batch=40)
        out[codec, dtype] = (p, spec)
    return out


def readers(p, spec):
    rs = [CacheReader(p, spec=spec, mmap=m, memory_budget=b) for m, b, _ in SOURCES]
    assert [r.source for r in rs] == [s for _, _, s in SOURCES]
    return rs


@pytest.mark.parametrize("codec,dtype", CODECS)
def test_mapped_rows_equal_ram_and_disk_rows_and_the_codec(caches, codec, dtype):
    p, spec = caches[codec, dtype]
    c = spec.make_codec()
    keys = np.arange(spec.num_keys)
    want = c.decode(c.encode(expected_logits(keys, C)))
    rs = readers(p, spec)
    try:
        for view in range(V):
            idx = np.arange(N)
            got = [r.get(idx, view) for r in rs]
            for g in got:
                assert g.dtype == np.float32 and g.shape == (N, C)
                assert np.array_equal(g, want[idx * V + view])
        idx, views = np.array([0, 256, 5, 5, 100]), np.array([2, 0, 1, 1, 2])
        for r in rs:
            assert np.array_equal(r.get(idx, views), want[idx * V + views])
    finally:
        for r in rs:
            r.close()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(which=st.sampled_from(CODECS), idx=st.lists(st.integers(0, N - 1), max_size=70),
       view=st.one_of(st.integers(0, V - 1), st.just(None)), seed=st.integers(0, 2 ** 16))
def test_any_batch_reads_the_same_from_the_map_as_from_ram_and_disk(caches, which, idx, view, seed):
    p, spec = caches[which]
    idx = np.array(idx, dtype=np.int64)
    views = view if view is not None else np.random.default_rng(seed).integers(0, V, idx.size)
    rs = readers(p, spec)
    try:
        a, b, c = (r.get(idx, views) for r in rs)
        assert a.shape == (idx.size, C) and np.array_equal(a, b) and np.array_equal(a, c)
    finally:
        for r in rs:
            r.close()


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_one_view_hot_path_and_bad_indices(cache_dir, dtype):
    spec = make_spec(num_samples=100, num_classes=7, views=1, codec="full", dtype=dtype)
    p = path_for(cache_dir, spec.fingerprint)
    assert produce(p, spec)
    want = spec.make_codec().decode(spec.make_codec().encode(expected_logits(np.arange(100), 7)))
    for m, b, source in SOURCES:
        with CacheReader(p, spec=spec, mmap=m, memory_budget=b) as r:
            assert r.source == source
            idx = np.array([[3, 99], [0, 3]])
            assert np.array_equal(r.get(idx), want[idx.reshape(-1)])
            for bad in ([100], [-1], [5, 1000]):
                with pytest.raises(BadInputError, match="out of range"):
                    r.get(np.array(bad))


def test_the_map_is_read_only_and_shares_the_files_pages(cache_dir):
    spec = make_spec(num_samples=5000, num_classes=100, codec="full", dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    assert produce(p, spec, batch=500)
    with CacheReader(p, spec=spec) as r:
        t = r._tables[schema.LOGITS]
        assert r.source == "map" and not t.flags.writeable
        with pytest.raises(ValueError):
            t[0, 0] = 1
        assert t.dtype == np.float16, "float16 stays float16 in memory"
        with open(final_path(p), "rb") as fh:  # the array is the file's bytes, at the dataset's offset
            with h5py.File(final_path(p), "r") as f:
                off = f[schema.LOGITS].id.get_offset()
            assert off % 4096 == 0, "large datasets start on a page boundary"
            fh.seek(off)
            assert fh.read(t.nbytes) == t.tobytes()


def test_a_reader_that_followed_the_producers_switches_to_the_map(cache_dir):
    spec = make_spec(num_samples=200, num_classes=9, views=2, codec="full", dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    from kdcache.store import CacheWriter
    want = spec.make_codec().decode(spec.make_codec().encode(expected_logits(np.arange(400), 9)))
    w = CacheWriter(p, spec)
    keys = np.arange(200)
    w.write(keys // 2, expected_logits(keys, 9), views=keys % 2)
    r = CacheReader(p, spec=spec)
    assert r.source == "ram" and not r.complete
    assert np.array_equal(r.get(np.arange(100), 0, wait=False), want[np.arange(100) * 2])
    keys = np.arange(200, 400)
    w.write(keys // 2, expected_logits(keys, 9), views=keys % 2)
    w.close()
    assert os.path.exists(final_path(p))
    r.refresh()
    assert r.complete and r.source == "map"
    assert np.array_equal(r.get(np.arange(200), 1), want[np.arange(200) * 2 + 1])
    r.close()


@pytest.mark.parametrize("budget", [None, 1])  # in RAM, and from disk per batch
def test_a_segment_removed_after_the_reader_opened_it_is_still_read(cache_dir, budget):
    """Compaction removes segments a following reader may have open (a second worker opened the cache
    just as its producer finished): the open file stays readable, and its new rows are taken in."""
    spec = make_spec(num_samples=300, num_classes=9, codec="full", dtype="float32")
    p = path_for(cache_dir, spec.fingerprint)
    from kdcache.store import CacheWriter
    from kdcache.store.files.segment import list_segments
    w = CacheWriter(p, spec)
    w.write(np.arange(100), expected_logits(np.arange(100), 9))
    r = CacheReader(p, spec=spec, memory_budget=budget)
    assert not r.complete and r.progress == 100 / 300
    w.write(np.arange(100, 200), expected_logits(np.arange(100, 200), 9))
    (seg,) = list_segments(parts_path(p))
    os.rename(seg, seg + ".gone")  # its path disappears; the reader's and the writer's files stay open
    r.refresh()
    assert r.progress == 200 / 300
    assert np.array_equal(r.get(np.arange(200), wait=False), expected_logits(np.arange(200), 9))
    r.close()
    os.rename(seg + ".gone", seg)
    w.close()


def rewrite_chunked(path):
    """The same cache file with chunked datasets (as another writer might lay it out)."""
    tmp = path + ".chunked"
    with h5py.File(path, "r") as src, h5py.File(tmp, "w") as out:
        for k, v in src.attrs.items():
            out.attrs[k] = v
        out.attrs[schema.A_FORMAT] = 1  # as an older kdcache wrote it: no seal
        for k in src:
            out.create_dataset(k, data=src[k][...], chunks=True)
    os.replace(tmp, path)


def test_files_that_cannot_be_mapped_are_read_the_old_way_and_say_why(cache_dir, caplog, monkeypatch):
    spec = make_spec(num_samples=300, num_classes=10, views=2, codec="topk:3", dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    assert produce(p, spec)
    with CacheReader(p, spec=spec, mmap=False) as r:
        want = r.get(np.arange(300), 1)
    rewrite_chunked(final_path(p))
    caplog.set_level(logging.WARNING, logger="kdcache.store")
    for budget, source in ((None, "ram"), (0, "disk")):
        caplog.clear()
        with CacheReader(p, spec=spec, memory_budget=budget) as r:
            assert r.source == source
            assert np.array_equal(r.get(np.arange(300), 1), want)
        assert "not memory-mapped" in caplog.text and "chunked" in caplog.text

    def refuse(*a, **k):
        raise OSError(19, "No such device")
    p2 = path_for(cache_dir, make_spec(num_samples=50, tag="other").fingerprint)
    assert produce(p2, make_spec(num_samples=50, tag="other"))
    monkeypatch.setattr(mmap, "mmap", refuse)
    caplog.clear()
    with CacheReader(p2) as r:
        assert r.source == "ram" and r.get([49]).shape == (1, 10)
    assert "refused to map" in caplog.text


# Reads from a mapped cache in its own process (a SIGBUS would kill it): batch 0, then "opened"; after
# a line on stdin, the last samples' rows; a StoreError is printed and is exit status 3.
TRUNCATED_READER = """
import sys
import numpy as np
from kdcache.store import CacheReader, StoreError
from tests.helpers import make_spec
n, c, views, codec = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
r = CacheReader(sys.argv[1], spec=make_spec(num_samples=n, num_classes=c, views=views, codec=codec, dtype="float32"))
assert r.source == "map"
r.get(np.arange(10), 0)
print("opened", flush=True)
sys.stdin.readline()
try:
    r.get(np.arange(n - 10, n), views - 1)
except StoreError as e:
    print(type(e).__name__, e, flush=True)
    sys.exit(3)
print("read", flush=True)
"""


@pytest.mark.parametrize("codec,views", [("full", 1), ("full", 2), ("topk:3", 1)])
def test_a_file_truncated_under_the_map_is_an_error_not_a_sigbus(cache_dir, codec, views):
    import subprocess
    import sys

    from tests.helpers import CHILD_ENV, ROOT
    n, c = 4000, 50
    spec = make_spec(num_samples=n, num_classes=c, views=views, codec=codec, dtype="float32")
    p = path_for(cache_dir, spec.fingerprint)
    assert produce(p, spec, batch=1000)
    fin = final_path(p)
    size = os.path.getsize(fin)
    child = subprocess.Popen([sys.executable, "-c", TRUNCATED_READER, p, str(n), str(c), str(views), codec], cwd=ROOT,
                             env=CHILD_ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    assert child.stdout.readline().strip() == "opened", child.communicate()
    os.truncate(fin, size // 4)  # in place: the reader's mapping now reaches past the file's end
    out, err = child.communicate("go\n", timeout=60)
    assert child.returncode == 3, f"exit {child.returncode} (-7 is SIGBUS): {out} {err[-2000:]}"
    assert out.strip() == (f"CacheChangedError the cache file {fin} shrank from {size:,} to {size // 4:,} bytes while being read: it "
                           f"was replaced or truncated; reopen it, or check it with `kdcache verify {fin}`")
