"""Errors users cause when loading a data set: each names the file, the cause and the fix."""
import io
import os
import shutil

import mxnet as mx
import numpy as np
import pytest
from PIL import Image

import kdcache
from kdcache.pipeline import load_dataset
from tests.datafiles import (ALL_KINDS, FILE_KINDS, dataset_error, make_cifar, make_folder, make_mnist, make_rec,
                             png_bytes, rng_for, write_idx, write_rec)


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
    dataset_error(lambda: load_dataset("recordio", data_root=rec, num_classes=2), "record 0: label 2 is not below",
                  "--num-classes")
    img = np.zeros((4, 4, 3), np.uint8)
    neg = write_rec(tmp_path / "neg.rec", [img, img], [1, -1])
    dataset_error(lambda: load_dataset("recordio", data_root=neg), "record 1: label -1 is negative")


def test_recordio_mixed_sizes_need_image_size(tmp_path):
    r = rng_for(9)
    imgs = [r.integers(0, 256, s, dtype=np.uint8) for s in ((5, 4, 3), (6, 6, 3), (5, 4, 3))]
    rec = write_rec(tmp_path / "m.rec", imgs, [0, 1, 0])
    ds = load_dataset("recordio", data_root=rec)
    assert ds[1][0].shape == (3, 6, 6)
    assert ds.get_batch([0, 2])[0].shape == (2, 3, 5, 4)  # same sizes batch fine
    dataset_error(lambda: ds.get_batch([0, 1]), "different sizes", "--image-size")
    ds = kdcache.load_dataset("recordio", data_root=rec, image_size="3x2")  # the API reads HxW, as --image-size
    x, y = ds.get_batch([0, 1, 2])
    assert x.shape == (3, 3, 3, 2) and x.dtype == np.float32 and ds.shape == (3, 3, 2)
    assert 0 <= x.min() and x.max() <= 1 and y.tolist() == [0, 1, 0]
    assert np.array_equal(x[1], ds[1][0])
    dataset_error(lambda: kdcache.load_dataset("recordio", data_root=rec, image_size="32"), "HxW")


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


def test_imagefolder_without_a_test_folder_never_evaluates_on_training_images(tmp_path):
    make_folder(tmp_path)
    assert len(load_dataset("imagefolder", data_root=str(tmp_path))) > 0
    dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path), split="test"), "test/", "root/train")


# --- images that cannot be read or decoded ------------------------------------------------
def image_file_bytes(kind):
    """The bytes of an image file damaged in one way."""
    img = rng_for(10).integers(0, 256, (6, 5, 3), dtype=np.uint8)
    if kind == "empty":
        return b""
    if kind == "not-an-image":
        return b"GIF? no: a text file named like an image\n"
    if kind == "truncated-png":
        return png_bytes(img)[:60]
    if kind == "png-cut-in-its-header":  # MXNet alone decoded this to zeros
        return png_bytes(img)[:30]
    assert kind == "truncated-jpeg"  # MXNet alone decoded this, the missing part gray
    b = io.BytesIO()
    Image.fromarray(img).save(b, format="JPEG")
    return b.getvalue()[:-40]


BAD_IMAGES = ["empty", "not-an-image", "truncated-png", "png-cut-in-its-header", "truncated-jpeg"]


def one_line(msg):
    assert "\n" not in msg and "Traceback" not in msg and "MXNetError" not in msg, msg
    return msg


@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_imagefolder_image_that_does_not_decode_names_the_file(tmp_path, kind):
    make_folder(tmp_path)
    ext = ".jpg" if "jpeg" in kind or kind == "not-an-image" else ".png"
    bad = tmp_path / "zebra" / f"zz-{kind}{ext}"  # sorted last: decoded only when a batch asks for it
    bad.write_bytes(image_file_bytes(kind))
    ds = load_dataset("imagefolder", data_root=str(tmp_path))
    last = len(ds) - 1
    assert ds.get_batch([0, 1])[0].shape == (2, 3, 5, 4)  # the sound images still load
    one_line(dataset_error(lambda: ds.get_batch(np.arange(len(ds))), str(bad), "remove or replace it"))
    one_line(dataset_error(lambda: ds[last], str(bad), "cannot be decoded", "remove or replace it"))


@pytest.mark.parametrize("kind", BAD_IMAGES)
def test_imagefolder_first_image_that_does_not_decode_names_the_file_at_load(tmp_path, kind):
    make_folder(tmp_path)
    bad = tmp_path / "ant" / "a-first.png"  # sorted first: decoded at load time, for the shape
    bad.write_bytes(image_file_bytes(kind))
    one_line(dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path)), str(bad),
                           "remove or replace it"))


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their permissions")
def test_imagefolder_unreadable_image_names_the_file(tmp_path):
    make_folder(tmp_path)
    bad = tmp_path / "moth" / "img1.png"
    ds = load_dataset("imagefolder", data_root=str(tmp_path))
    bad.chmod(0)
    try:
        for fn in (lambda: ds.get_batch(np.arange(len(ds))),  # read when a batch asks for it
                   lambda: load_dataset("imagefolder", data_root=str(tmp_path))):  # read for the digest
            one_line(dataset_error(fn, str(bad), "Permission denied", "make it readable", "remove or replace it"))
    finally:
        bad.chmod(0o644)


def test_imagefolder_entry_that_is_no_file_names_it(tmp_path):
    """What cannot be read even by root: a folder or a dangling link named like an image."""
    make_folder(tmp_path)
    (tmp_path / "moth" / "folder.png").mkdir()
    one_line(dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path)),
                           str(tmp_path / "moth" / "folder.png"), "a folder, not a regular file", "remove it"))
    shutil.rmtree(tmp_path / "moth" / "folder.png")
    os.symlink(tmp_path / "gone.png", tmp_path / "moth" / "link.png")
    one_line(dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path)),
                           str(tmp_path / "moth" / "link.png"), "a dangling symbolic link", "remove it"))


@pytest.mark.parametrize("kind", ["not-an-image", "empty", "truncated-png", "truncated-jpeg"])
def test_recordio_record_that_does_not_decode_names_the_file_and_record(tmp_path, kind):
    imgs = rng_for(11).integers(0, 256, (4, 5, 4, 3), dtype=np.uint8)
    rec = str(tmp_path / "d.rec")
    w = mx.recordio.MXIndexedRecordIO(rec[:-4] + ".idx", rec, "w")
    for i in range(4):
        payload = image_file_bytes(kind) if i == 2 else png_bytes(imgs[i])
        w.write_idx(i, mx.recordio.pack(mx.recordio.IRHeader(0, float(i % 2), i, 0), payload))
    w.close()
    ds = load_dataset("recordio", data_root=rec)  # record 2 is decoded only when a batch asks for it
    assert ds.get_batch([0, 1, 3])[0].shape == (3, 3, 5, 4)
    for fn in (lambda: ds.get_batch(np.arange(4)), lambda: ds[2]):
        one_line(dataset_error(fn, rec, "record 2", "cannot be decoded", "d.idx"))
    bad_first = write_rec(tmp_path / "first.rec", [np.zeros((4, 4, 3), np.uint8)] * 2, [0, 1])
    data = open(bad_first, "rb").read()
    with open(bad_first, "wb") as fh:  # record 0's PNG made invalid: decoded at load time, for the shape
        fh.write(data.replace(b"\x89PNG", b"\x00PNG", 1))
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=bad_first), bad_first, "record 0"))


def test_recordio_truncated_or_foreign_files_name_the_file_and_record(tmp_path):
    rec, _, _ = make_rec(tmp_path)
    good = open(rec, "rb").read()
    with open(rec, "wb") as fh:  # the last record cut short
        fh.write(good[:-50])
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=rec), rec, "record 5", "truncated"))
    offset = int(open(rec[:-4] + ".idx").read().splitlines()[3].split("\t")[1])
    damaged = bytearray(good)
    damaged[offset] ^= 0xFF  # record 3's header no longer starts with RecordIO's magic number
    with open(rec, "wb") as fh:
        fh.write(bytes(damaged))
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=rec), rec, "record 3", "damaged"))
    for index in ("not\tan index\n", "0\tzero\n"):
        with open(rec[:-4] + ".idx", "w") as fh:
            fh.write(index)
        one_line(dataset_error(lambda: load_dataset("recordio", data_root=rec), "train.idx", "RecordIO index"))
