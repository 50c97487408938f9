"""SoftTargetDataset in a user's own Gluon loop: every soft target it returns is the teacher's
output for that item's view, in a DataLoader with worker processes, epoch after epoch."""
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import CHILD_ENV, ROOT, gluon_teacher

ENV = CHILD_ENV


def build_cache(tmp_path, prefix, *args):
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--teacher", prefix, "--dataset", "digits",
                        "--cache-dir", str(tmp_path / "caches"), "--threads", "1", "--quiet", "--json", *args],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]


@pytest.fixture(scope="module")
def digits_views(tmp_path_factory):
    """A teacher, and its cache of 2 augmented views (crop:1) of digits' training split, float32."""
    tmp = tmp_path_factory.mktemp("softdata")
    prefix = str(tmp / "teacher")
    gluon_teacher(prefix, classes=10, seed=1)
    cache = build_cache(tmp, prefix, "--views", "2", "--augment", "crop:1", "--seed", "5", "--dtype", "float32")
    return prefix, cache


@pytest.mark.parametrize("workers", [0, 2])
def test_each_soft_target_is_the_teachers_output_for_that_view(digits_views, workers):
    from mxnet import gluon

    from kdcache.pipeline.datasets import load_digits
    from kdcache.pipeline.teacher import Teacher
    from kdcache.trainer import SoftTargetDataset
    prefix, cache = digits_views
    ds = SoftTargetDataset(load_digits("train"), cache, seed=5, views=2, augment="crop:1")
    teacher = Teacher(prefix)
    loader = gluon.data.DataLoader(ds, batch_size=97, shuffle=True, num_workers=workers, last_batch="keep")
    ordered = gluon.data.DataLoader(ds, batch_size=500, shuffle=False, num_workers=workers, last_batch="keep")
    plain = load_digits("train")
    for epoch in (0, 1, 2):
        ds.set_epoch(epoch)
        seen, moved = 0, 0
        for x, y, soft in loader:
            x, soft = x.asnumpy(), soft.asnumpy()
            assert x.shape[1:] == (1, 8, 8) and soft.shape[1:] == (10,) and soft.dtype == np.float32
            np.testing.assert_allclose(soft, teacher.forward(x), rtol=1e-4, atol=1e-4)
            seen += len(x)
            moved += int((np.abs(x).sum(axis=(1, 2, 3)) > 0).sum())
        assert seen == len(plain) and moved == seen
        # workers forked in epoch 0 follow set_epoch: in order, their items are the parent's
        got = np.concatenate([b[0].asnumpy() for b in ordered])
        assert np.array_equal(got, np.stack([ds[i][0] for i in range(len(ds))]))
    # the views differ between epochs 0 and 1 and repeat at epoch 2 (views=2)
    ds.set_epoch(0)
    a = ds[7]
    ds.set_epoch(1)
    b = ds[7]
    ds.set_epoch(2)
    c = ds[7]
    assert not np.array_equal(a[0], b[0]) and np.array_equal(a[0], c[0]) and np.array_equal(a[2], c[2])
    assert a[1] == b[1] == plain[7][1]


def test_a_cache_for_other_images_is_refused(digits_views):
    from kdcache.pipeline.datasets import load_digits
    from kdcache.store import StoreError
    from kdcache.trainer import SoftTargetDataset
    _, cache = digits_views
    train = load_digits("train")
    for kwargs, words in [(dict(seed=5, views=2, augment="crop:2"), "augmentation crop:1"),
                          (dict(seed=5, views=2, augment=None), "augmentation crop:1"),
                          (dict(seed=4, views=2, augment="crop:1"), "seed 5"),
                          (dict(seed=5, views=1, augment="crop:1"), "2 view")]:
        with pytest.raises(StoreError, match=words):
            SoftTargetDataset(train, cache, **kwargs)
    with pytest.raises(StoreError, match="1438"):
        SoftTargetDataset(load_digits("test"), cache, seed=5, views=2, augment="crop:1")
