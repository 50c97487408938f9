"""SoftTargetIter over a user's own DataIter: soft labels attached by the indices each batch
carries (an ImageRecordIter_v1 over a .rec with its .idx), a clear error for an iterator without
indices, and one warning for an iterator that augments on its own."""
import json
import logging
import subprocess
import sys

import numpy as np
import pytest

from tests.datafiles import write_rec
from tests.helpers import CHILD_ENV, ROOT, gluon_teacher

ENV = CHILD_ENV

N = 150


@pytest.fixture(scope="module")
def rec_cache(tmp_path_factory):
    """A .rec of N 8x8 colour images, a teacher for them, and the teacher's cache (float32)."""
    tmp = tmp_path_factory.mktemp("useriter")
    rng = np.random.default_rng(7)
    images = rng.integers(0, 256, (N, 8, 8, 3), dtype=np.uint8)
    rec = write_rec(tmp / "train.rec", images, rng.integers(0, 10, N))
    prefix = str(tmp / "teacher")
    gluon_teacher(prefix, classes=10, in_ch=3, seed=2)
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--teacher", prefix, "--dataset", "recordio",
                        "--data-root", rec, "--num-classes", "10", "--dtype", "float32", "--cache-dir",
                        str(tmp / "caches"), "--threads", "1", "--quiet", "--json"],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return rec, prefix, json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]


def record_iter(rec, **kw):
    import mxnet as mx
    return mx.io.ImageRecordIter_v1(path_imgrec=rec, path_imgidx=rec[:-4] + ".idx", data_shape=(3, 8, 8),
                                 batch_size=32, preprocess_threads=1, **kw)


def test_soft_labels_follow_the_indices_of_a_shuffling_record_iter(rec_cache, caplog):
    from kdcache.pipeline.images import RecordIODataset
    from kdcache.pipeline.teacher import Teacher
    from kdcache.store import CacheReader
    from kdcache.trainer import SoftTargetIter
    rec, prefix, cache = rec_cache
    ds = RecordIODataset(rec, "train", None, 10)
    teacher = Teacher(prefix)
    caplog.set_level(logging.WARNING, logger="kdcache.trainer")
    it = SoftTargetIter(record_iter(rec, shuffle=True, seed=3, round_batch=False), CacheReader(cache))
    assert [d.name for d in it.provide_label] == ["softmax_label", "soft_label"]
    assert it.provide_label[1].shape == (32, 10)
    orders = []
    for epoch in range(3):
        it.reset() if epoch else None
        seen = []
        for b in it:
            idx = np.asarray(b.index)
            x, soft = b.data[0].asnumpy(), b.label[1].asnumpy()
            want_x, want_y = ds.get_batch(idx)
            assert np.allclose(x / 255.0, want_x, atol=1e-6), "the iterator's images are the indexed samples"
            assert np.array_equal(b.label[0].asnumpy(), want_y)
            np.testing.assert_allclose(soft, teacher.forward(want_x), rtol=1e-4, atol=1e-4)
            seen += idx.tolist()  # padding rows included: they are samples too
        assert set(seen) == set(range(N))
        orders.append(seen)
    assert orders[0] != orders[1], "the iterator shuffles"
    assert "augments" not in caplog.text


def test_an_iterator_without_indices_is_refused(rec_cache):
    import mxnet as mx
    from kdcache.store import CacheReader
    from kdcache.trainer import SoftTargetIter
    it = SoftTargetIter(mx.io.NDArrayIter(np.zeros((N, 3, 8, 8), np.float32), np.zeros(N), batch_size=10),
                        CacheReader(rec_cache[2]))
    with pytest.raises(ValueError, match="no sample indices.*ImageRecordIter_v1"):
        it.next()
    v2 = mx.io.ImageRecordIter(path_imgrec=rec_cache[0], path_imgidx=rec_cache[0][:-4] + ".idx", data_shape=(3, 8, 8),
                               batch_size=8, preprocess_threads=1)
    with pytest.raises(ValueError, match="index 0 for every sample.*ImageRecordIter_v1"):
        SoftTargetIter(v2, CacheReader(rec_cache[2])).next()


def test_record_keys_that_are_not_positions_are_mapped(rec_cache):
    from kdcache.store import CacheReader
    from kdcache.trainer import SoftTargetIter
    rec, _, cache = rec_cache
    reader = CacheReader(cache)
    keys = np.arange(N) * 10 + 1000  # as if the .idx held other keys: key k is sample (k - 1000) / 10

    import mxnet as mx

    class KeyedIter(mx.io.DataIter):
        def __init__(self):
            super().__init__(32)
            self.inner = record_iter(rec)
            self.provide_data, self.provide_label = self.inner.provide_data, self.inner.provide_label

        def reset(self):
            self.inner.reset()

        def next(self):
            b = self.inner.next()
            b.index = np.asarray(b.index) * 10 + 1000
            return b
    it = SoftTargetIter(KeyedIter(), reader, keys=keys)
    b = it.next()
    raw = record_iter(rec).next()
    assert np.array_equal(b.label[1].asnumpy(), reader.get(np.asarray(raw.index)))
    with pytest.raises(ValueError, match="not among the cache's keys"):
        SoftTargetIter(KeyedIter(), reader, keys=keys + 1).next()


def test_an_iterator_that_augments_is_reported_once(rec_cache, caplog):
    import mxnet as mx
    from kdcache.store import CacheReader
    from kdcache.trainer import SoftTargetIter
    rec, _, cache = rec_cache
    caplog.set_level(logging.WARNING, logger="kdcache.trainer")
    it = SoftTargetIter(record_iter(rec, shuffle=True, rand_mirror=True, rand_crop=True, pad=2), CacheReader(cache))
    for epoch in range(3):
        it.reset() if epoch else None
        for _ in it:
            pass
    assert caplog.text.count("augments on its own") == 1 and it.augments is True
    caplog.clear()  # mx.image.ImageIter names its augmenters: said at once
    aug = mx.image.ImageIter(batch_size=10, data_shape=(3, 8, 8), path_imgrec=rec, path_imgidx=rec[:-4] + ".idx",
                             aug_list=[mx.image.HorizontalFlipAug(0.5)])
    it = SoftTargetIter(aug, CacheReader(cache))
    assert it.augments is True and caplog.text.count("augments on its own") == 1
    caplog.clear()
    SoftTargetIter(aug, CacheReader(cache), augments=False)
    assert "augments" not in caplog.text


def test_an_index_past_the_cache_is_refused_before_anything_is_sized_by_it(rec_cache):
    """An iterator giving index 2e8 for a cache of 150 samples: the range error comes first, with
    no allocation for 2e8 samples (the augmentation probe once sized an array by the largest index)."""
    import tracemalloc

    import mxnet as mx
    from kdcache.store import CacheReader
    from kdcache.store.errors import BadInputError
    from kdcache.trainer import SoftTargetIter

    class FarIter(mx.io.DataIter):
        def __init__(self):
            super().__init__(4)
            self.provide_data = [mx.io.DataDesc("data", (4, 3, 8, 8))]
            self.provide_label = [mx.io.DataDesc("softmax_label", (4,))]

        def next(self):
            return mx.io.DataBatch(data=[mx.nd.zeros((4, 3, 8, 8))], label=[mx.nd.zeros(4)], pad=0,
                                   index=np.array([0, 1, 2, 2 * 10 ** 8]))
    it = SoftTargetIter(FarIter(), CacheReader(rec_cache[2]))
    tracemalloc.start()
    try:
        with pytest.raises(BadInputError, match=r"sample indices \[200000000\] out of range \[0, 150\)"):
            it.next()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, f"{peak / 2 ** 20:.0f} MiB allocated before the range error"
