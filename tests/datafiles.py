"""Small data sets in their real file formats, written by the pipeline tests, and the checks they share.

IDX (MNIST), CIFAR binary, RecordIO, image folders and .npz, written into a test's tmp_path.
"""
import gzip
import io
import os
import struct
import zipfile
import zlib

import mxnet as mx
import numpy as np
import pytest
from PIL import Image

from kdcache.pipeline import DatasetError


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


# --- files for the identity and header tests ------------------------------------------------
def write_big_rec(rec_path, n=64, hw=(128, 128)):
    """A .rec of noise PNGs (they do not compress): n=64 of 128x128 is over 3 MiB. Returns its offsets."""
    r = rng_for(12)
    write_rec(rec_path, r.integers(0, 256, (n,) + tuple(hw) + (3,), dtype=np.uint8), np.arange(n) % 3)
    return [int(line.split("\t")[1]) for line in open(str(rec_path)[:-4] + ".idx").read().splitlines()]


def flip_byte(path, offset=None):
    """One byte of the file changed in place (the middle one unless told), its size kept."""
    size = os.path.getsize(path)
    offset = size // 2 if offset is None else offset
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))
    return offset


def age_files(root, seconds=3600):
    """Every file under root dated `seconds` ago, as data sets are when loaded again (a file changed
    within the last few seconds is read again whatever the memo holds)."""
    t = os.path.getmtime(root) - seconds
    paths = [root] if os.path.isfile(root) else [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs]
    for p in paths:
        os.utime(p, (t, t))


def png_declaring(width, height):
    """A whole PNG (signature, IHDR, one IDAT, IEND, valid CRCs) whose header declares width x height."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(bytes(64)))
            + chunk(b"IEND", b""))


def write_gz_bomb(path, dims, zeros_mib):
    """An IDX .gz whose header declares `dims` (bytes) followed by `zeros_mib` MiB of zeros: a few
    hundred KiB on disk."""
    with gzip.open(path, "wb", compresslevel=9) as fh:
        fh.write(bytes([0, 0, 8, len(dims)]) + struct.pack(f">{len(dims)}I", *dims))
        block = bytes(1 << 20)
        for _ in range(zeros_mib):
            fh.write(block)
    return str(path)


def write_npz_declaring(path, shape, data=b"\0" * 16):
    """An .npz whose x_train member's .npy header declares `shape` of uint8 but holds `data`."""
    head = io.BytesIO()
    np.lib.format.write_array_header_1_0(head, {"descr": "|u1", "fortran_order": False, "shape": tuple(shape)})
    y = io.BytesIO()
    np.save(y, np.zeros(2, np.int64))
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("x_train.npy", head.getvalue() + data)  # the header starts with the .npy magic
        z.writestr("y_train.npy", y.getvalue())
    return str(path)
