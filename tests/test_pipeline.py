"""Every data set loader on real-format files, and the batch contract and digests every loader keeps."""
import numpy as np
import pytest

from kdcache.pipeline import load_dataset
from tests.datafiles import (ALL_KINDS, FILE_KINDS, FOLDER_CLASSES, assert_pixels, build, make_cifar, make_folder,
                             make_mnist, make_rec, rng_for)


# --- each loader on its real format --------------------------------------------------------
@pytest.mark.parametrize("name", ["mnist", "fashion-mnist"])
@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
@pytest.mark.parametrize("sub", ["", "raw"], ids=["root", "raw-subfolder"])
def test_idx_loader_reads_mnist_layouts(tmp_path, name, gz, sub):
    made = make_mnist(tmp_path, sub=sub, gz=gz)
    for split in ("train", "test"):
        ds = load_dataset(name, data_root=str(tmp_path), split=split)
        x, y = made[split]
        assert len(ds) == len(x) and ds.num_classes == 10 and ds.shape == (1, 7, 6)
        bx, by = ds.get_batch(np.arange(len(ds)))
        assert_pixels(bx, x[:, None])
        assert np.array_equal(by, y)
        assert ds.identity()["name"] == name and ds.identity()["split"] == split


def test_cifar10_binary_reads_five_batches_in_order(tmp_path):
    made = make_cifar(tmp_path, c100=False)
    for split, n in (("train", 9), ("test", 4)):
        ds = load_dataset("cifar10", data_root=str(tmp_path), split=split)
        x, y, _ = made[split]
        assert len(ds) == n and ds.num_classes == 10 and ds.shape == (3, 32, 32)
        bx, by = ds.get_batch(np.arange(n))
        assert_pixels(bx, x)
        assert np.array_equal(by, y)
    # --data-root may also name the cifar-10-batches-bin folder itself
    ds = load_dataset("cifar10", data_root=str(tmp_path / "cifar-10-batches-bin"))
    assert np.array_equal(ds.get_batch(np.arange(9))[1], made["train"][1])


def test_cifar100_binary_label_is_the_fine_label(tmp_path):
    made = make_cifar(tmp_path, c100=True)
    for split in ("train", "test"):
        ds = load_dataset("cifar100", data_root=str(tmp_path), split=split)
        x, fine, coarse = made[split]
        assert not np.array_equal(fine, coarse)
        assert ds.num_classes == 100 and len(ds) == len(x)
        bx, by = ds.get_batch(np.arange(len(ds)))
        assert_pixels(bx, x)
        assert np.array_equal(by, fine)


def test_npz_nhwc_uint8_is_transposed_and_scaled(tmp_path):
    r = rng_for(5)
    x = r.integers(0, 256, (8, 5, 4, 3), dtype=np.uint8)
    x[0, 0, 0, 0], x[1, 0, 0, 0] = 0, 255
    y = np.arange(8) % 5
    xt = r.integers(0, 256, (3, 5, 4, 3), dtype=np.uint8)
    p = tmp_path / "d.npz"
    np.savez(p, x_train=x, y_train=y, x_test=xt, y_test=np.array([4, 0, 1]))
    ds = load_dataset("npz", data_root=str(p))
    assert ds.shape == (3, 5, 4) and ds.num_classes == 5 and len(ds) == 8
    bx, by = ds.get_batch(np.arange(8))
    assert_pixels(bx, x.transpose(0, 3, 1, 2))
    assert bx.min() == 0.0 and bx.max() == 1.0
    assert np.array_equal(by, y)
    ts = load_dataset("npz", data_root=str(p), split="test")
    assert_pixels(ts.get_batch([0, 1, 2])[0], xt.transpose(0, 3, 1, 2))
    assert np.array_equal(ts.get_batch([0, 1, 2])[1], [4, 0, 1])


def test_npz_nchw_float_is_kept_as_is(tmp_path):
    x = rng_for(6).uniform(0, 1, (6, 3, 5, 4)).astype(np.float32)
    p = tmp_path / "d.npz"
    np.savez(p, x=x, y=np.array([0, 1, 2, 0, 1, 2]))  # keys x/y
    ds = load_dataset("npz", data_root=str(p))
    assert ds.shape == (3, 5, 4)
    assert np.array_equal(ds.get_batch(np.arange(6))[0], x)


def test_npz_flat_rows_become_1x1xD_images(tmp_path):
    x = rng_for(7).integers(0, 256, (5, 12), dtype=np.uint8)
    p = tmp_path / "d.npz"
    np.savez(p, data=x, labels=np.array([0, 1, 0, 1, 1]))  # keys data/labels
    ds = load_dataset("npz", data_root=str(p))
    assert ds.shape == (1, 1, 12)
    assert_pixels(ds.get_batch(np.arange(5))[0], x[:, None, None, :])


def test_npz_keras_labels_n_by_1_become_a_vector(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x_train=np.zeros((4, 6, 6, 3), np.uint8), y_train=np.array([[0], [2], [1], [2]]))
    ds = load_dataset("npz", data_root=str(p))
    _, y = ds.get_batch([0, 1, 3])
    assert y.shape == (3,) and np.array_equal(y, [0, 2, 2]) and ds[1][1] == 2


def test_recordio_decodes_png_pixels_and_labels(tmp_path):
    rec, x, y = make_rec(tmp_path)
    ds = load_dataset("recordio", data_root=rec)
    assert len(ds) == 6 and ds.num_classes == 3 and ds.shape == (3, 5, 4)
    bx, by = ds.get_batch(np.arange(6))
    assert_pixels(bx, x.transpose(0, 3, 1, 2))  # PNG is lossless, RGB order kept
    assert np.array_equal(by, y)
    assert load_dataset("recordio", data_root=rec, num_classes=7).num_classes == 7
    # a directory holds <split>.rec
    assert load_dataset("recordio", data_root=str(tmp_path)).identity() == ds.identity()


def test_imagefolder_classes_sorted_pixels_and_labels(tmp_path):
    made = make_folder(tmp_path)
    ds = load_dataset("imagefolder", data_root=str(tmp_path))
    classes = sorted(FOLDER_CLASSES)
    assert ds.identity()["classes"] == classes and ds.num_classes == 3
    expected = [(img, classes.index(c)) for c in classes for _, img in sorted(made[c], key=lambda t: t[0])]
    bx, by = ds.get_batch(np.arange(len(ds)))
    assert_pixels(bx, np.stack([img.transpose(2, 0, 1) for img, _ in expected]))
    assert by.tolist() == [lab for _, lab in expected]


def test_digits_fixed_disjoint_split_of_the_embedded_set():
    from sklearn.datasets import load_digits
    tr, te = load_dataset("digits"), load_dataset("digits", split="test")
    assert (len(tr), len(te)) == (1438, 359)
    assert tr.num_classes == te.num_classes == 10 and tr.shape == (1, 8, 8)
    xtr, ytr = tr.get_batch(np.arange(len(tr)))
    xte, yte = te.get_batch(np.arange(len(te)))
    for x, y in ((xtr, ytr), (xte, yte)):
        assert x.min() == 0.0 and x.max() == 1.0
        assert set(y.tolist()) == set(range(10))
    # the two splits partition the 1797 samples: together they are the whole set, each once
    d = load_digits()
    rows = lambda x, y: sorted(bytes(np.round(a.reshape(-1) * 16).astype(np.uint8)) + bytes([b]) for a, b in zip(x, y))
    both = rows(np.concatenate([xtr, xte]), np.concatenate([ytr, yte]))
    assert both == rows(d.images / 16.0, d.target)
    # and it is fixed: another load gives the same samples
    assert np.array_equal(load_dataset("digits", split="test").get_batch(np.arange(359))[0], xte)


def test_synthetic_is_deterministic_and_follows_its_spec():
    spec = "synthetic:n=50,classes=4,shape=2x5x7,seed=3"
    a, b = load_dataset(spec), load_dataset(spec)
    assert len(a) == 50 and a.num_classes == 4 and a.shape == (2, 5, 7)
    xa, ya = a.get_batch(np.arange(50))
    xb, yb = b.get_batch(np.arange(50))
    assert np.array_equal(xa, xb) and np.array_equal(ya, yb) and a.identity() == b.identity()
    assert set(ya.tolist()) == {0, 1, 2, 3}
    other = load_dataset("synthetic:n=50,classes=4,shape=2x5x7,seed=4")
    assert not np.array_equal(other.get_batch(np.arange(50))[0], xa)
    assert other.identity()["digest"] != a.identity()["digest"]
    test = load_dataset(spec, split="test")
    assert len(test) == 10  # n // 5
    assert not np.array_equal(test.get_batch(np.arange(10))[0], xa[:10])


def test_synthetic_is_learnable_by_nearest_class_mean():
    spec = "synthetic:n=400,classes=5,shape=3x8x8,seed=1"
    tr, te = load_dataset(spec), load_dataset(spec, split="test")
    x, y = tr.get_batch(np.arange(len(tr)))
    means = np.stack([x[y == c].reshape(-1, 192).mean(0) for c in range(5)])
    xt, yt = te.get_batch(np.arange(len(te)))
    pred = ((xt.reshape(-1, 1, 192) - means[None]) ** 2).sum(-1).argmin(1)
    assert (pred == yt).mean() > 0.8


@pytest.mark.parametrize("kind", ALL_KINDS)
def test_batches_are_stacked_samples(tmp_path, kind):
    name, kw = build(kind, tmp_path)
    ds = load_dataset(name, **kw)
    idx = np.array([len(ds) - 1, 0, 2, 2, 1])  # out of order, with a repeat
    x, y = ds.get_batch(idx)
    assert x.dtype == np.float32 and x.shape == (len(idx),) + tuple(ds.shape) and len(ds.shape) == 3
    assert y.dtype == np.int64 and y.shape == (len(idx),)
    assert 0.0 <= x.min() and x.max() <= 1.0
    assert ((0 <= y) & (y < ds.num_classes)).all()
    samples = [ds[int(i)] for i in idx]
    assert all(s[0].dtype == np.float32 for s in samples)
    assert np.array_equal(x, np.stack([s[0] for s in samples]))
    assert y.tolist() == [s[1] for s in samples]
    ident = ds.identity()
    assert ident["name"] == kind and ident["split"] == "train" and ident["length"] == len(ds)
    assert isinstance(ident["digest"], str) and len(ident["digest"]) >= 32


@pytest.mark.parametrize("kind", FILE_KINDS)
def test_digest_follows_the_files_content(tmp_path, kind):
    name, kw = build(kind, tmp_path / "base")
    digest = load_dataset(name, **kw).identity()["digest"]
    assert load_dataset(name, **kw).identity()["digest"] == digest  # reload of unchanged files
    for change in ("pixel", "label"):
        name, kw = build(kind, tmp_path / change, **{change: True})
        assert load_dataset(name, **kw).identity()["digest"] != digest, f"one {change} changed"


def test_embedded_data_sets_have_fixed_digests():
    d = load_dataset("digits").identity()["digest"]
    assert load_dataset("digits").identity()["digest"] == d != load_dataset("digits", split="test").identity()["digest"]
    s = load_dataset("synthetic:n=20,seed=1").identity()["digest"]
    assert load_dataset("synthetic:n=20,seed=1").identity()["digest"] == s
    for other in ("synthetic:n=21,seed=1", "synthetic:n=20,seed=2", "synthetic:n=20,seed=1,classes=3",
                  "synthetic:n=20,seed=1,shape=3x16x16"):
        assert load_dataset(other).identity()["digest"] != s, other
