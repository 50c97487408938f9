"""The shared input pipeline: every loader on real-format files written here, the batch
contract and identity digests, errors users cause, keyed augmentation views and the schedule."""
import gzip
import io
import os
import shutil
import struct
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from PIL import Image

from pipeline import (Augment, DatasetError, epoch_batches, epoch_permutation, load_dataset, make_views,
                      schedule)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- writers of the real formats ---------------------------------------------------------
def rng_for(*key):
    return np.random.default_rng(list(key))


def write_idx(path, arr, gz=False):
    """An IDX file: magic 0x0000080<ndim>, big-endian dims, then the bytes."""
    arr = np.ascontiguousarray(arr, dtype=np.uint8)
    data = bytes([0, 0, 8, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    if gz:
        path, data = str(path) + ".gz", gzip.compress(data)
    with open(path, "wb") as fh:
        fh.write(data)
    return str(path)


def mutate(x, y, classes, pixel, label):
    """One pixel (the last byte of the last sample) and/or one label (of sample 0) changed."""
    x, y = x.copy(), y.copy()
    if pixel:
        x[-1].flat[-1] ^= 1
    if label:
        y[0] = (y[0] + 1) % classes
    return x, y


def make_mnist(root, *, sub="", gz=False, hw=(7, 6), pixel=False, label=False):
    """train (10) and t10k (4) IDX files; returns {split: (x uint8 [N, H, W], y)}."""
    d = os.path.join(root, sub)
    os.makedirs(d, exist_ok=True)
    out = {}
    for split, pre, n in (("train", "train", 10), ("test", "t10k", 4)):
        r = rng_for(1, n)
        x = r.integers(0, 256, (n,) + hw, dtype=np.uint8)
        y = r.permutation(np.arange(n) % 10).astype(np.uint8)
        if split == "train":
            x, y = mutate(x, y, 10, pixel, label)
        write_idx(os.path.join(d, f"{pre}-images-idx3-ubyte"), x, gz)
        write_idx(os.path.join(d, f"{pre}-labels-idx1-ubyte"), y, gz)
        out[split] = (x, y.astype(np.int64))
    return out


def make_cifar(root, c100, *, pixel=False, label=False):
    """The binary version: CIFAR-10 5 train batches + test_batch.bin (label byte + 3072), CIFAR-100
    train.bin + test.bin (coarse byte, fine byte, 3072). Returns {split: (x [N,3,32,32], fine y, coarse)}."""
    d = os.path.join(root, "cifar-100-binary" if c100 else "cifar-10-batches-bin")
    os.makedirs(d, exist_ok=True)
    if c100:
        files = {"train": [("train.bin", 7)], "test": [("test.bin", 3)]}
    else:
        files = {"train": [(f"data_batch_{i}.bin", n) for i, n in zip(range(1, 6), (3, 1, 2, 2, 1))],
                 "test": [("test_batch.bin", 4)]}
    classes = 100 if c100 else 10
    out = {}
    for split, parts in files.items():
        total = sum(n for _, n in parts)
        r = rng_for(2, int(c100), total)
        x = r.integers(0, 256, (total, 3, 32, 32), dtype=np.uint8)
        fine = r.integers(0, classes, total).astype(np.uint8)
        fine[0] = classes - 1
        coarse = r.integers(0, 20, total).astype(np.uint8)
        if split == "train":
            x, fine = mutate(x, fine, classes, pixel, label)
        a = 0
        for fn, n in parts:
            labels = [coarse[a:a + n, None], fine[a:a + n, None]] if c100 else [fine[a:a + n, None]]
            np.concatenate(labels + [x[a:a + n].reshape(n, -1)], axis=1).tofile(os.path.join(d, fn))
            a += n
        out[split] = (x, fine.astype(np.int64), coarse.astype(np.int64))
    return out


def png_bytes(img):
    b = io.BytesIO()
    Image.fromarray(img).save(b, format="PNG")
    return b.getvalue()


def write_rec(rec_path, images, labels):
    """A .rec with its .idx beside it, each record an IRHeader(label) and a PNG."""
    rec_path = str(rec_path)
    w = mx.recordio.MXIndexedRecordIO(rec_path[:-4] + ".idx", rec_path, "w")
    for i, (img, lab) in enumerate(zip(images, labels)):
        w.write_idx(i, mx.recordio.pack(mx.recordio.IRHeader(0, float(lab), i, 0), png_bytes(img)))
    w.close()
    return rec_path


def make_rec(root, *, pixel=False, label=False):
    r = rng_for(3)
    x = r.integers(0, 256, (6, 5, 4, 3), dtype=np.uint8)  # HWC, as images are
    y = np.array([2, 0, 1, 2, 1, 0])
    x, y = mutate(x, y, 3, pixel, label)
    os.makedirs(root, exist_ok=True)
    return write_rec(os.path.join(root, "train.rec"), x, y), x, y


FOLDER_CLASSES = ("zebra", "ant", "moth")  # written out of sorted order


def make_folder(root, *, pixel=False, label=False):
    """root/<class>/<image>.png; returns {class: [(file name, HWC image), ...]}."""
    out = {}
    for c, cls in enumerate(FOLDER_CLASSES):
        r = rng_for(4, c)
        imgs = r.integers(0, 256, (2, 5, 4, 3), dtype=np.uint8)
        if pixel and cls == "ant":
            imgs[1, 4, 3, 2] ^= 1
        os.makedirs(os.path.join(root, cls), exist_ok=True)
        out[cls] = [(f"img{k}.png", imgs[k]) for k in range(2)]
    if label:  # one image moves to another class
        out["moth"].append(("moved.png", out["zebra"].pop(0)[1]))
    for cls, items in out.items():
        for fn, img in items:
            Image.fromarray(img).save(os.path.join(root, cls, fn))
    return out


def assert_pixels(x, expected_uint8):
    """x float32 holds expected/255 (to float rounding)."""
    assert x.dtype == np.float32
    assert x.shape == expected_uint8.shape
    np.testing.assert_allclose(x, expected_uint8.astype(np.float32) / 255, rtol=0, atol=1e-6)


def dataset_error(fn, *needles):
    """fn raises DatasetError and its message names each needle (the cause and the fix)."""
    with pytest.raises(DatasetError) as e:
        fn()
    msg = str(e.value)
    for n in needles:
        assert n in msg, f"{n!r} not in {msg!r}"
    return msg


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


# --- the contract every loader keeps --------------------------------------------------------
def build(kind, root, pixel=False, label=False):
    """(name, load_dataset options) of a small data set of this kind, written under root."""
    root = str(root)
    if kind in ("mnist", "fashion-mnist"):
        make_mnist(root, pixel=pixel, label=label)
        return kind, {"data_root": root}
    if kind in ("cifar10", "cifar100"):
        make_cifar(root, kind == "cifar100", pixel=pixel, label=label)
        return kind, {"data_root": root}
    if kind == "npz":
        r = rng_for(8)
        x, y = mutate(r.integers(0, 256, (9, 6, 5, 3), dtype=np.uint8), np.arange(9) % 4, 4, pixel, label)
        os.makedirs(root, exist_ok=True)
        np.savez(os.path.join(root, "d.npz"), x_train=x, y_train=y)
        return kind, {"data_root": os.path.join(root, "d.npz"), "num_classes": 4}
    if kind == "recordio":
        return kind, {"data_root": make_rec(root, pixel=pixel, label=label)[0]}
    if kind == "imagefolder":
        make_folder(root, pixel=pixel, label=label)
        return kind, {"data_root": root}
    if kind == "digits":
        return kind, {}
    return "synthetic:n=30,classes=3,shape=3x6x5,seed=2", {}


ALL_KINDS = ["digits", "synthetic", "mnist", "fashion-mnist", "cifar10", "cifar100", "npz", "recordio",
             "imagefolder"]
FILE_KINDS = ALL_KINDS[2:]


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


# --- errors users cause ------------------------------------------------------------------
def test_missing_files_name_the_file_and_data_root(tmp_path):
    (tmp_path / "empty").mkdir()
    empty = str(tmp_path / "empty")
    dataset_error(lambda: load_dataset("mnist", data_root=empty), "train-images-idx3-ubyte", "--data-root")
    dataset_error(lambda: load_dataset("fashion-mnist", data_root=empty, split="test"), "t10k-images", "--data-root")
    dataset_error(lambda: load_dataset("cifar10", data_root=empty), "data_batch_1.bin", "--data-root")
    dataset_error(lambda: load_dataset("cifar100", data_root=empty), "train.bin", "--data-root")
    dataset_error(lambda: load_dataset("imagefolder", data_root=empty), "no images", "<class>")
    dataset_error(lambda: load_dataset("npz", data_root=str(tmp_path / "nope.npz")), "nope.npz", "does not exist")
    dataset_error(lambda: load_dataset("npz", data_root=empty), "pass the .npz file")
    # the labels file alone missing
    make_mnist(tmp_path / "m")
    os.remove(tmp_path / "m" / "train-labels-idx1-ubyte")
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path / "m")), "train-labels-idx1-ubyte")
    # one CIFAR-10 batch of five missing
    make_cifar(tmp_path / "c", c100=False)
    os.remove(tmp_path / "c" / "cifar-10-batches-bin" / "data_batch_5.bin")
    dataset_error(lambda: load_dataset("cifar10", data_root=str(tmp_path / "c")), "data_batch_5.bin")


def test_idx_with_a_wrong_magic_is_refused(tmp_path):
    make_mnist(tmp_path)
    img = tmp_path / "train-images-idx3-ubyte"
    good = img.read_bytes()
    img.write_bytes(b"\x12\x34\x56\x78" + good[4:])
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path)), "magic", "right file")
    img.write_bytes(bytes([0, 0, 0x0D, 3]) + good[4:])  # IDX of floats, not of bytes
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path)), "magic")
    # the images and labels files swapped
    lab = tmp_path / "train-labels-idx1-ubyte"
    labels = lab.read_bytes()
    img.write_bytes(labels)
    lab.write_bytes(good)
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path)), "0x00000803", "swapped")


def test_truncated_idx_is_refused(tmp_path):
    make_mnist(tmp_path / "raw")
    img = tmp_path / "raw" / "train-images-idx3-ubyte"
    good = img.read_bytes()
    img.write_bytes(good[:-5])
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path / "raw")), "truncated")
    img.write_bytes(good[:10])  # inside the header's dims
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path / "raw")), "truncated")
    make_mnist(tmp_path / "gz", gz=True)
    gzf = tmp_path / "gz" / "train-images-idx3-ubyte.gz"
    gzf.write_bytes(gzf.read_bytes()[:-30])  # the gzip stream cut short
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path / "gz")), "truncated")


@pytest.mark.parametrize("c100", [False, True], ids=["cifar10", "cifar100"])
def test_cifar_file_of_partial_records_is_refused(tmp_path, c100):
    make_cifar(tmp_path, c100)
    d = tmp_path / ("cifar-100-binary" if c100 else "cifar-10-batches-bin")
    f = d / ("test.bin" if c100 else "test_batch.bin")
    f.write_bytes(f.read_bytes()[:-100])
    rec = 3074 if c100 else 3073
    dataset_error(lambda: load_dataset("cifar100" if c100 else "cifar10", data_root=str(tmp_path), split="test"),
                  f"{rec}-byte records", "truncated")


class _Payload:
    """Unpickling this runs os.mkdir: proof that a loader unpickled what a file held."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_npz_object_array_is_refused_unread(tmp_path):
    marker = str(tmp_path / "unpickled")
    x = np.empty(2, dtype=object)
    x[0], x[1] = _Payload(marker), np.zeros((4, 4))
    p = tmp_path / "evil.npz"
    np.savez(p, x_train=x, y_train=np.array([0, 1]))
    dataset_error(lambda: load_dataset("npz", data_root=str(p)), "object arrays", "refused", "numeric")
    assert not os.path.exists(marker)


def test_npz_without_known_keys_lists_them(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, images=np.zeros((2, 4, 4), np.uint8), targets=np.array([0, 1]))
    dataset_error(lambda: load_dataset("npz", data_root=str(p)), "x_train/y_train", "x/y", "images")
    np.savez(p, x=np.zeros((2, 4, 4), np.uint8), y=np.array([0, 1]))  # no test arrays
    dataset_error(lambda: load_dataset("npz", data_root=str(p), split="test"), "x_test/y_test")
    np.save(tmp_path / "a.npy", np.zeros((2, 4, 4), np.uint8))
    dataset_error(lambda: load_dataset("npz", data_root=str(tmp_path / "a.npy")), ".npy", "np.savez")


def test_npz_values_outside_the_unit_range_or_bad_labels_are_refused(tmp_path):
    p = tmp_path / "d.npz"
    np.savez(p, x=np.full((2, 3, 4, 4), 200.0), y=np.array([0, 1]))  # floats in 0..255
    dataset_error(lambda: load_dataset("npz", data_root=str(p)), "outside [0, 1]", "uint8")
    np.savez(p, x=np.zeros((2, 4, 4), np.uint8), y=np.array([0.0, 1.0]))
    dataset_error(lambda: load_dataset("npz", data_root=str(p)), "integer")
    np.savez(p, x=np.zeros((2, 4, 4), np.uint8), y=np.eye(2, dtype=np.int64))  # one-hot
    dataset_error(lambda: load_dataset("npz", data_root=str(p)), "one-hot")


def test_labels_out_of_range_are_refused(tmp_path):
    make_mnist(tmp_path / "m")
    write_idx(tmp_path / "m" / "train-labels-idx1-ubyte", np.array([10] + [0] * 9))
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path / "m")), "labels outside [0, 10)")
    made = make_cifar(tmp_path / "c", c100=False)
    x, y, _ = made["test"]
    np.concatenate([np.full((len(x), 1), 10, np.uint8), x.reshape(len(x), -1)], 1).tofile(
        tmp_path / "c" / "cifar-10-batches-bin" / "test_batch.bin")
    dataset_error(lambda: load_dataset("cifar10", data_root=str(tmp_path / "c"), split="test"), "labels outside")
    p = tmp_path / "d.npz"
    np.savez(p, x=np.zeros((3, 4, 4), np.uint8), y=np.array([0, 3, 1]))
    dataset_error(lambda: load_dataset("npz", data_root=str(p), num_classes=3), "labels outside [0, 3)")
    np.savez(p, x=np.zeros((3, 4, 4), np.uint8), y=np.array([0, -1, 1]))
    dataset_error(lambda: load_dataset("npz", data_root=str(p)), "labels outside")
    rec, _, _ = make_rec(tmp_path / "r")  # labels 0..2
    dataset_error(lambda: load_dataset("recordio", data_root=rec, num_classes=2), "labels outside [0, 2)",
                  "--num-classes")
    img = np.zeros((4, 4, 3), np.uint8)
    neg = write_rec(tmp_path / "neg.rec", [img, img], [1, -1])
    dataset_error(lambda: load_dataset("recordio", data_root=neg), "labels outside")


def test_recordio_mixed_sizes_need_image_size(tmp_path):
    r = rng_for(9)
    imgs = [r.integers(0, 256, s, dtype=np.uint8) for s in ((5, 4, 3), (6, 6, 3), (5, 4, 3))]
    rec = write_rec(tmp_path / "m.rec", imgs, [0, 1, 0])
    ds = load_dataset("recordio", data_root=rec)
    assert ds[1][0].shape == (3, 6, 6)
    assert ds.get_batch([0, 2])[0].shape == (2, 3, 5, 4)  # same sizes batch fine
    dataset_error(lambda: ds.get_batch([0, 1]), "different sizes", "--image-size")
    ds = load_dataset("recordio", data_root=rec, image_size="3x2")
    x, y = ds.get_batch([0, 1, 2])
    assert x.shape == (3, 3, 3, 2) and x.dtype == np.float32 and ds.shape == (3, 3, 2)
    assert 0 <= x.min() and x.max() <= 1 and y.tolist() == [0, 1, 0]
    assert np.array_equal(x[1], ds[1][0])
    dataset_error(lambda: load_dataset("recordio", data_root=rec, image_size="32"), "HxW")


def test_recordio_needs_its_idx(tmp_path):
    rec, _, _ = make_rec(tmp_path)
    os.remove(rec[:-4] + ".idx")
    dataset_error(lambda: load_dataset("recordio", data_root=rec), "train.idx", ".rec file and its .idx")
    shutil.copy(rec, tmp_path / "data.bin")
    dataset_error(lambda: load_dataset("recordio", data_root=str(tmp_path / "data.bin")), "pass the .rec file")


def test_unknown_name_and_missing_data_root(tmp_path):
    msg = dataset_error(lambda: load_dataset("imagenet"), "unknown data set 'imagenet'")
    assert all(n in msg for n in ALL_KINDS)
    for name in FILE_KINDS:
        dataset_error(lambda: load_dataset(name), f"--dataset {name}", "pass --data-root")
    dataset_error(lambda: load_dataset("mnist", data_root=str(tmp_path / "absent")), "does not exist")
    dataset_error(lambda: load_dataset("digits", split="val"), "use train or test")
    dataset_error(lambda: load_dataset("synthetic:n=ten"), "synthetic:n=20000")


# --- keyed augmentation views ------------------------------------------------------------
SPEC = "synthetic:n=64,classes=4,shape=3x12x10,seed=3"  # H != W: flips must reverse W
SEED = (1 << 33) + 7
KEYS_I = np.array([5, 0, 63, 17, 17, 42, 8, 33, 5, 60])
KEYS_V = np.array([0, 1, 2, 0, 3, 1, 1, 2, 4, 0])


@pytest.fixture(scope="module")
def small():
    return load_dataset(SPEC)


def views_by_key(ds, indices, views, augment, seed=SEED):
    x, _ = make_views(ds, indices, views, seed=seed, augment=augment)
    return {(int(i), int(v)): x[k] for k, (i, v) in enumerate(zip(indices, np.broadcast_to(views, len(indices))))}


def test_same_key_same_view_whatever_the_batch(small):
    aug = Augment.parse("crop:3,flip")
    a = views_by_key(small, KEYS_I, KEYS_V, aug)
    order = np.random.default_rng(0).permutation(len(KEYS_I))
    others = np.array([1, 2, 3, 50])  # another batch: other samples around, another order
    b = views_by_key(small, np.concatenate([others, KEYS_I[order]]),
                     np.concatenate([np.array([0, 3, 2, 1]), KEYS_V[order]]), aug)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    for i, v in a:  # one at a time, a scalar view as the schedule passes it
        assert np.array_equal(views_by_key(small, np.array([i]), v, aug)[(i, v)], a[(i, v)])


def test_same_key_same_view_in_another_process(small, tmp_path):
    out = tmp_path / "views.npy"
    code = ("import sys, numpy as np\n"
            "from pipeline import Augment, load_dataset, make_views\n"
            f"x, _ = make_views(load_dataset({SPEC!r}), np.array({KEYS_I[::-1].tolist()}), "
            f"np.array({KEYS_V[::-1].tolist()}), seed={SEED}, augment=Augment.parse('crop:3,flip'))\n"
            "np.save(sys.argv[1], x)\n")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    theirs = np.load(out)
    ours, _ = make_views(small, KEYS_I, KEYS_V, seed=SEED, augment=Augment.parse("crop:3,flip"))
    assert np.array_equal(theirs[::-1], ours)


def test_teacher_side_and_student_side_see_the_same_views():
    """The producer fills keys in key order (index = key // V, view = key % V, in batches of 7);
    the student follows the schedule (a scalar view per epoch, batches of 5); each side loads
    the data set and parses the augmentation itself."""
    n, views, seed, spec = 20, 3, 123, "crop:2,flip"
    teacher_ds, student_ds = load_dataset(SPEC.replace("n=64", f"n={n}")), load_dataset(SPEC.replace("n=64", f"n={n}"))
    teacher = {}
    keys = np.arange(n * views)
    for a in range(0, keys.size, 7):
        k = keys[a:a + 7]
        teacher.update(views_by_key(teacher_ds, k // views, k % views, Augment.parse(spec), seed=seed))
    seen = 0
    for st in schedule(seed, views, n, 5, views):
        student = views_by_key(student_ds, st.indices, st.view, Augment.parse(spec), seed=seed)
        for key, x in student.items():
            assert np.array_equal(x, teacher[key]), key
            seen += 1
    assert seen == n * views


def test_views_of_one_sample_differ(small):
    idx = np.arange(64)
    for spec, lo, hi in (("crop:4,flip", 0.9, 1.0), ("flip", 0.25, 0.75), ("crop:2", 0.8, 1.0)):
        aug = Augment.parse(spec)
        v0, _ = make_views(small, idx, 0, seed=SEED, augment=aug)
        v1, _ = make_views(small, idx, 1, seed=SEED, augment=aug)
        differ = np.mean([not np.array_equal(a, b) for a, b in zip(v0, v1)])
        assert lo <= differ <= hi, (spec, differ)
    # another seed gives other views too
    a, _ = make_views(small, idx, 0, seed=SEED, augment=Augment.parse("crop:4,flip"))
    for other in (SEED + 1, SEED + (1 << 32)):  # every bit of a 64-bit seed counts
        b, _ = make_views(small, idx, 0, seed=other, augment=Augment.parse("crop:4,flip"))
        assert np.mean([not np.array_equal(p, q) for p, q in zip(a, b)]) > 0.9


def test_no_augmentation_returns_the_samples_unchanged(small):
    x, y = small.get_batch(KEYS_I)
    for aug in (Augment(), Augment.parse("none"), Augment.parse("")):
        assert aug == Augment() and not aug.active
        for v in (0, 1, 2):
            xv, yv = make_views(small, KEYS_I, v, seed=SEED, augment=aug)
            assert np.array_equal(xv, x) and np.array_equal(yv, y)


def test_crop_is_a_window_of_the_zero_padded_image(small):
    pad = 3
    aug = Augment.parse(f"crop:{pad}")
    idx, v = np.arange(64), np.arange(64) % 5
    x, _ = small.get_batch(idx)
    out, _ = make_views(small, idx, v, seed=SEED, augment=aug)
    assert out.shape == x.shape and out.dtype == np.float32
    dy, dx, flip = aug.params(SEED, idx, v)
    assert not flip.any()
    assert set(dy.tolist()) == set(dx.tolist()) == set(range(2 * pad + 1))  # every offset is used
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    for k in range(64):
        assert np.array_equal(out[k], padded[k, :, dy[k]:dy[k] + 12, dx[k]:dx[k] + 10])


def test_flip_reverses_the_last_axis_exactly(small):
    aug = Augment.parse("flip")
    idx = np.arange(64)
    x, _ = small.get_batch(idx)
    out, _ = make_views(small, idx, 2, seed=SEED, augment=aug)
    _, _, flip = aug.params(SEED, idx, 2)
    assert 0 < flip.sum() < 64
    for k in range(64):
        assert np.array_equal(out[k], x[k][:, :, ::-1] if flip[k] else x[k])


def test_params_of_a_key_do_not_depend_on_the_batch():
    aug = Augment.parse("crop:4,flip")
    r = np.random.default_rng(5)
    idx, v = r.integers(0, 10 ** 6, 200), r.integers(0, 8, 200)
    batch = aug.params(SEED, idx, v)
    for k in range(0, 200, 13):
        alone = aug.params(SEED, [idx[k]], [v[k]])
        assert [p[0] for p in alone] == [p[k] for p in batch]
    rev = aug.params(SEED, idx[::-1], v[::-1])
    assert all(np.array_equal(a[::-1], b) for a, b in zip(rev, batch))


def test_augment_spec_parsing():
    assert Augment.parse("crop:4,flip") == Augment(4, True) and Augment(4, True).spec == "crop:4,flip"
    assert Augment.parse(" Flip ") == Augment(0, True) and Augment.parse("crop:2") == Augment(2, False)
    assert Augment.parse(Augment(3, True).spec) == Augment(3, True) and Augment().spec == "none"
    for bad in ("crop:x", "rotate", "crop:-1", "crop", "crop:4,rotate", "crop:"):
        with pytest.raises(ValueError) as e:
            Augment.parse(bad)
        assert repr(bad.strip().lower()) in str(e.value)
        assert "crop:PAD" in str(e.value) and "flip" in str(e.value), str(e.value)


# --- the schedule ---------------------------------------------------------------------------
def test_permutation_is_the_same_in_another_process(tmp_path):
    out = tmp_path / "perm.npy"
    code = ("import sys, numpy as np\n"
            "from pipeline.schedule import epoch_permutation\n"
            "np.save(sys.argv[1], np.stack([epoch_permutation(7, e, 1000) for e in range(3)]))\n")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": ROOT})
    assert np.array_equal(np.load(out), np.stack([epoch_permutation(7, e, 1000) for e in range(3)]))


def test_permutations_differ_by_epoch_and_seed():
    p = epoch_permutation(7, 0, 1000)
    assert np.array_equal(np.sort(p), np.arange(1000)) and not np.array_equal(p, np.arange(1000))
    assert np.array_equal(p, epoch_permutation(7, 0, 1000))
    assert not np.array_equal(p, epoch_permutation(7, 1, 1000))
    assert not np.array_equal(p, epoch_permutation(8, 0, 1000))


def test_epoch_batches_cover_every_index_once():
    b = epoch_batches(3, 2, 103, 10)
    assert [len(x) for x in b] == [10] * 10 + [3]
    assert np.array_equal(np.concatenate(b), epoch_permutation(3, 2, 103))
    assert np.array_equal(np.sort(np.concatenate(b)), np.arange(103))
    assert [len(x) for x in epoch_batches(3, 2, 100, 10)] == [10] * 10


def test_schedule_steps_positions_and_views():
    n, bs, epochs, views = 23, 5, 7, 3
    steps = list(schedule(11, epochs, n, bs, views))
    assert [s.position for s in steps] == list(range(epochs * 5))
    for e in range(epochs):
        mine = [s for s in steps if s.epoch == e]
        assert [s.step for s in mine] == list(range(5))
        assert all(s.view == e % views for s in mine)
        assert all(np.array_equal(s.indices, b) for s, b in zip(mine, epoch_batches(11, e, n, bs)))
    # resuming at an epoch continues the same steps
    resumed = list(schedule(11, epochs, n, bs, views, start_epoch=4))
    assert [(s.epoch, s.step, s.position, s.view) for s in resumed] == \
        [(s.epoch, s.step, s.position, s.view) for s in steps[20:]]


def test_imagefolder_without_a_test_folder_never_evaluates_on_training_images(tmp_path):
    make_folder(tmp_path)
    assert len(load_dataset("imagefolder", data_root=str(tmp_path))) > 0
    dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path), split="test"), "test/", "root/train")
