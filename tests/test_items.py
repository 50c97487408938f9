"""A user's own data set is checked item by item against the cache (store.format.items, trainer.itemcheck): a data
set of the same length with other items (another split) is refused naming the first item that differs,
through SoftTargetDataset, SoftTargetIter (DataLoader workers too) and build_cache onto an existing cache."""
import os
import subprocess
import sys
import warnings

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kdcache
from kdcache.store import CacheSpec, CacheWriter, StoreError, UnsupportedFormatError, path_for

PY = sys.executable


def item_records(images, labels):
    from kdcache.pipeline.digests import item_records as records
    return records(images, labels)


def known(records):
    from kdcache.store.format.items import known as is_known
    return is_known(records)

# A user's loader module, as `kdcache cache --dataset resplit:load` imports it: digits' train split drawn with
# the seed $SPLIT_SEED (the same length whatever the seed, other images).
RESPLIT = '''import os
import numpy as np
from mxnet import gluon
from sklearn.datasets import load_digits


def items(seed):
    raw = load_digits()
    x = raw.images.astype(np.float32)[:, None] / 16
    idx = np.sort(np.random.default_rng(seed).permutation(len(x))[int(round(len(x) * 0.2)):])
    return x[idx], raw.target[idx]


def load(split):
    return gluon.data.ArrayDataset(*items(int(os.environ.get("SPLIT_SEED", "0"))))
'''


def split(seed):
    """A plain Gluon data set: digits' train split drawn with `seed` (the built-in split is seed 0's)."""
    from mxnet import gluon
    from sklearn.datasets import load_digits
    raw = load_digits()
    x = raw.images.astype(np.float32)[:, None] * np.float32(1 / 16)
    idx = np.sort(np.random.default_rng(seed).permutation(len(x))[int(round(len(x) * 0.2)):])
    return gluon.data.ArrayDataset(x[idx], raw.target[idx])


def first_differing(a, b):
    return next(i for i in range(len(a)) if not (np.array_equal(a[i][0], b[i][0]) and a[i][1] == b[i][1]))


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory, teacher):
    return kdcache.build_cache(teacher, "digits", cache_dir=str(tmp_path_factory.mktemp("items") / "c"))


def test_the_cache_records_each_item_the_producer_read(digits_cache):
    digits = kdcache.load_dataset("digits")
    with kdcache.CacheReader(digits_cache) as r:
        want = item_records(*digits.get_batch(np.arange(len(digits))))
        assert np.array_equal(r.items(np.arange(len(digits))), want)


def test_another_split_of_the_same_length_is_refused_naming_the_first_differing_item(digits_cache):
    same, other = split(0), split(1)
    assert len(same) == len(other) == 1438
    ds = kdcache.SoftTargetDataset(same, digits_cache)  # the items the cache was built from: accepted
    assert all(ds[i][2].shape == (10,) for i in range(len(ds)))
    assert ds._items.bits().all()  # every item read was compared once
    k = first_differing(same, other)
    with pytest.raises(StoreError) as e:
        kdcache.SoftTargetDataset(other, digits_cache)
    msg = str(e.value)
    assert "\n" not in msg and f"item {k} (the first item read that differs)" in msg, msg
    assert "pass the data set the cache was built from" in msg and "another data set" in msg, msg
    with kdcache.CacheReader(digits_cache) as reader:
        it = kdcache.SoftTargetIter(same, reader, batch_size=100)  # accepted, and serves the cache's targets
        b = it.next()
        assert np.array_equal(b.label[1].asnumpy(), reader.get(b.index, 0))
        with pytest.raises(StoreError, match=f"item {k} \\(the first item read that differs\\)"):
            kdcache.SoftTargetIter(other, reader, batch_size=100)


def test_one_changed_item_is_named_when_first_read_by_the_loop(digits_cache):
    from mxnet import gluon
    x, y = split(0)._data
    y = y.copy()
    y[900] = (y[900] + 1) % 10
    ds = kdcache.SoftTargetDataset(gluon.data.ArrayDataset(x, y), digits_cache)  # item 900 is not read yet
    ds[899]
    with pytest.raises(StoreError, match=rf"item 900 .* another label \({y[900]} here, {(y[900] - 1) % 10} in"):
        ds[900]


def test_dataloader_workers_check_each_item_once_and_raise_the_difference(digits_cache):
    from mxnet import gluon
    ds = kdcache.SoftTargetDataset(split(0), digits_cache)
    for epoch in range(2):
        ds.set_epoch(epoch)
        seen = sum(b[0].shape[0] for b in gluon.data.DataLoader(ds, batch_size=64, shuffle=True, num_workers=2))
        assert seen == 1438
        assert ds._items.bits().all()  # the workers' checks are seen here: one bit per item, shared
    x, y = split(0)._data
    x = x.copy()
    x[700, 0, 3, 3] += np.float32(0.25)
    bad = kdcache.SoftTargetDataset(gluon.data.ArrayDataset(x, y), digits_cache)
    with pytest.raises(StoreError, match=r"item 700 \(the first item read that differs\) has another image"):
        for _ in gluon.data.DataLoader(bad, batch_size=64, shuffle=True, num_workers=2):
            pass


def test_an_item_that_changes_each_read_is_said_to(digits_cache):
    class Jitter:
        def __init__(self):
            self.base, self.rng = split(0), np.random.default_rng()

        def __len__(self):
            return len(self.base)

        def __getitem__(self, i):
            x, y = self.base[i]
            return x + self.rng.uniform(0, 0.01, x.shape).astype(np.float32), y

    with pytest.raises(StoreError, match="item 0 of this data set is another image each time it is read"):
        kdcache.SoftTargetDataset(Jitter(), digits_cache)


def test_build_cache_onto_a_cache_of_another_split_names_the_first_differing_item(tmp_path, teacher, monkeypatch):
    """A cache at an explicit path, half built from split 0 (one shard of two), then build_cache for split 1 at
    that path: refused naming the item; for split 0: resumed, and the plain data set is accepted."""
    (tmp_path / "resplit.py").write_text(RESPLIT)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SPLIT_SEED", "0")
    where = str(tmp_path / "mine" / "digits-split")
    r = subprocess.run([PY, "-m", "kdcache.cache_builder", "--teacher", teacher, "--dataset", "resplit:load",
                        "--cache", where, "--shard", "0/2", "--quiet"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert os.path.isdir(where + ".parts") and not os.path.exists(where + ".h5")
    sys.path.insert(0, str(tmp_path))
    try:
        import resplit
        a, b = [list(zip(*resplit.items(s))) for s in (0, 1)]
    finally:
        sys.path.remove(str(tmp_path))
    k = first_differing(a, b)
    monkeypatch.setenv("SPLIT_SEED", "1")
    with pytest.raises(kdcache.BuildError) as e:
        kdcache.build_cache(teacher, "resplit:load", cache=where)
    msg = str(e.value)
    assert f"was built from another data set of the same length: item {k} (the first that differs)" in msg, msg
    assert "\n" not in msg and not os.path.exists(where + ".h5")
    monkeypatch.setenv("SPLIT_SEED", "0")
    assert kdcache.build_cache(teacher, "resplit:load", cache=where) == where + ".h5"
    ds = kdcache.SoftTargetDataset(split(0), where)
    ds[len(ds) - 1]
    with pytest.raises(StoreError, match=f"item {k} "):
        kdcache.SoftTargetDataset(split(1), where)


def test_a_cache_written_before_item_records_is_checked_by_length_and_says_so(tmp_path):
    n = 12
    data = np.random.default_rng(0).random((n, 1, 4, 4), dtype=np.float32)
    spec = CacheSpec(num_samples=n, num_classes=3, dtype="float32", inputs={"test": "old"})
    path = path_for(str(tmp_path), spec.fingerprint)
    with CacheWriter(path, spec) as w:
        w.write(np.arange(n), np.zeros((n, 3), np.float32))  # no records: as written before they existed
    with h5py.File(path + ".h5", "r") as f:
        assert "items" not in f
    other = [(data[i] + 1, 0) for i in range(n)]
    with pytest.warns(UserWarning, match="no record of its data set's items .* checked by its length only"):
        ds = kdcache.SoftTargetDataset(other, path)
    assert ds[n - 1][2].shape == (3,)


def test_damaged_item_records_are_refused_as_damage(tmp_path):
    n = 10
    data = np.random.default_rng(0).random((n, 1, 4, 4), dtype=np.float32)
    labels = np.arange(n) % 3
    path = write_cache(tmp_path, data, labels)
    with h5py.File(path + ".h5", "r") as f:
        offset = f["items"].id.get_offset()
    with open(path + ".h5", "r+b") as fh:
        fh.seek(offset + 40)
        b = fh.read(1)
        fh.seek(offset + 40)
        fh.write(bytes([b[0] ^ 4]))
    with pytest.raises(UnsupportedFormatError, match="item records do not match their crc32"):
        kdcache.SoftTargetDataset([(data[i], labels[i]) for i in range(n)], path)


def test_convert_carries_the_item_records(digits_cache, tmp_path):
    from kdcache.store.derive.convert import convert
    out = convert(digits_cache, "topk:3", cache_dir=str(tmp_path))
    with kdcache.CacheReader(digits_cache) as a, kdcache.CacheReader(out["cache_path"]) as b:
        assert np.array_equal(a.items(np.arange(1438)), b.items(np.arange(1438)))


# --- the property: any small data set, one item changed or none ------------------------------------------
def write_cache(root, data, labels):
    """A finished cache recording these items (as the producer records them); its base path."""
    n = len(data)
    spec = CacheSpec(num_samples=n, num_classes=4, dtype="float32",
                     inputs={"test": "items", "digest": item_records(data, labels)["digest"].tobytes().hex()[:32]})
    path = path_for(str(root), spec.fingerprint)
    with CacheWriter(path, spec) as w:
        order = np.random.default_rng(n).permutation(n)  # rows appended in any order: records follow their keys
        for a in range(0, n, 5):
            k = order[a:a + 5]
            w.write(k, np.zeros((k.size, 4), np.float32), items=item_records(data[k].astype(np.float32), labels[k]))
    return path


@st.composite
def datasets(draw):
    n = draw(st.integers(1, 30))
    shape = draw(st.sampled_from([(1, 2, 2), (3, 4, 4), (1, 1, 5)]))
    dtype = draw(st.sampled_from([np.uint8, np.float32]))
    seed = draw(st.integers(0, 2 ** 32 - 1))
    rng = np.random.default_rng(seed)
    data = (rng.integers(0, 256, (n,) + shape) if dtype == np.uint8 else rng.random((n,) + shape)).astype(dtype)
    labels = rng.integers(0, 4, n)
    change = draw(st.one_of(st.none(), st.tuples(st.integers(0, n - 1), st.sampled_from(["pixel", "label", "both"]))))
    return data, labels, change


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=datasets(), use_iter=st.booleans())
def test_property_one_changed_item_is_named_exactly_and_the_same_items_are_accepted(tmp_path_factory, case, use_iter):
    data, labels, change = case
    path = write_cache(tmp_path_factory.mktemp("p"), data, labels)
    mine_x, mine_y = data.copy(), labels.copy()
    if change is not None:
        k, what = change
        if what in ("pixel", "both"):
            flat = mine_x[k].reshape(-1)
            if data.dtype == np.uint8:
                flat[0] = flat[0] + 1 if flat[0] < 255 else flat[0] - 1
            else:
                flat[0] += np.float32(0.5)
        if what in ("label", "both"):
            mine_y[k] = (mine_y[k] + 1) % 4
    items = [(mine_x[i], int(mine_y[i])) for i in range(len(data))]

    def read_all():
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*no record of its data set's items")  # a cache recording them says nothing
            if use_iter:
                with kdcache.CacheReader(path) as reader:
                    it = kdcache.SoftTargetIter(items, reader, batch_size=7)
                    for _ in it:
                        pass
            else:
                ds = kdcache.SoftTargetDataset(items, path)
                for i in range(len(ds)):
                    ds[i]
                assert ds._items.bits().all()

    if change is None:
        read_all()  # accepted: a valid data set is never refused
        return
    with pytest.raises(StoreError) as e:
        read_all()
    msg = str(e.value)
    assert f"item {k} (the first item read that differs) has another " in msg and "\n" not in msg, msg
    assert ("image" in msg) == (what in ("pixel", "both")) and ("label (" in msg) == (what in ("label", "both")), msg


def test_records_follow_rows_of_a_cache_still_being_written(tmp_path):
    """A reader following the segments serves each record once its row is committed; the finished file gathers
    them by sample whatever the order rows were appended in."""
    n = 9
    data = np.random.default_rng(3).random((n, 1, 2, 2), dtype=np.float32)
    labels = np.arange(n) % 4
    spec = CacheSpec(num_samples=n, num_classes=4, views=2, dtype="float32", inputs={"test": "following"})
    path = path_for(str(tmp_path), spec.fingerprint)
    want = item_records(data, labels)
    w = CacheWriter(path, spec)
    w.write(np.array([4, 1]), np.zeros((2, 4), np.float32), views=1, items=want[[4, 1]])
    with kdcache.CacheReader(path, timeout=0) as r:
        got = r.items(np.arange(n))
        assert known(got).tolist() == [i in (1, 4) for i in range(n)]
        assert np.array_equal(got[[1, 4]], want[[1, 4]])
    keys = np.array([k for k in range(2 * n) if k not in (4 * 2 + 1, 1 * 2 + 1)])
    w.write(keys // 2, np.zeros((keys.size, 4), np.float32), views=keys % 2, items=want[keys // 2])
    assert w.close()
    with kdcache.CacheReader(path) as r:
        assert np.array_equal(r.items(np.arange(n)), want)


def test_a_cache_of_several_views_records_each_sample_once(tmp_path, teacher):
    """Only view 0's rows are digested (one digest a sample), and every sample's record is in the finished file."""
    path = kdcache.build_cache(teacher, "digits", cache_dir=str(tmp_path / "c"), views=2, augment="crop:1", seed=3)
    digits = kdcache.load_dataset("digits")
    with kdcache.CacheReader(path) as r:
        assert np.array_equal(r.items(np.arange(len(digits))), item_records(*digits.get_batch(np.arange(len(digits)))))
    ds = kdcache.SoftTargetDataset(split(0), path, views=2, augment="crop:1", seed=3)
    ds.set_epoch(1)
    assert ds[10][2].shape == (10,)
    with pytest.raises(StoreError, match="another data set: item"):
        kdcache.SoftTargetDataset(split(1), path, views=2, augment="crop:1", seed=3)
