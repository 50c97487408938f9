"""Array data set files read with numpy alone: IDX (MNIST, Fashion-MNIST), CIFAR binary and .npz.

Headers are untrusted: IDX dims, CIFAR record counts and .npy shapes are checked against the file's
(or the zip member's) size before anything is allocated or read, and a .gz is never expanded past
what its header promises. The identity digests every byte of every file read (pipeline/digests.py).
"""
import contextlib
import gzip
import math
import os
import struct
import zipfile
import zlib

import numpy as np

from .dataset_base import ArrayDataset, DatasetError, nchw
from .digests import files_digest, open_data


# --- MNIST / Fashion-MNIST (IDX files) ------------------------------------------------------
# Deflate expands at most ~1032:1: a .gz whose header promises more than this cannot hold its data.
GZ_MAX_RATIO = 1032


def _find_maybe_gz(path):
    for p in (path, path + ".gz"):
        if os.path.lexists(p):  # a dangling link too: open_data names it
            return p
    raise DatasetError(f"missing file {path} (or {path}.gz): put the data set's standard files under --data-root")


def read_idx(path, ndim=None):
    """An IDX file (MNIST's format): magic 0x00 0x00 type ndim, big-endian dims, then data.
    `ndim`: the number of dimensions the caller expects (3 for images, 1 for labels). The header is
    checked against the file's size before the data is read, and a .gz is never read past the size
    its header promises (a small .gz can expand to gigabytes)."""
    path = _find_maybe_gz(path)
    gz = path.endswith(".gz")
    with open_data(path) as raw, (gzip.GzipFile(fileobj=raw) if gz else contextlib.nullcontext(raw)) as fh:
        size = os.fstat(raw.fileno()).st_size
        try:  # a damaged or truncated .gz fails inside read(), a short header in unpack()
            head = fh.read(4)
            if len(head) < 4 or head[0] != 0 or head[1] != 0 or head[2] != 0x08:
                raise DatasetError(f"{path}: not an IDX file of unsigned bytes (bad magic {head!r}): is it the "
                                   f"right file, un-truncated?")
            if ndim is not None and head[3] != ndim:
                raise DatasetError(f"{path}: IDX magic 0x{head.hex()} holds {head[3]}-d data, expected "
                                   f"0x0000080{ndim} ({'images' if ndim == 3 else 'labels'}): are the images "
                                   f"and labels files swapped?")
            dims = struct.unpack(">" + "I" * head[3], fh.read(4 * head[3]))
            want = math.prod(dims)
            _check_idx_size(path, gz, size, 4 + 4 * head[3], want)
            data = np.empty(want, dtype=np.uint8)
            got = _read_into(fh, data)
            extra = len(fh.read(1)) if got == want else 0
        except (OSError, EOFError, zlib.error, struct.error) as e:
            raise DatasetError(f"{path}: cannot be read ({e}): the file is truncated or damaged; "
                               f"fetch it again") from None
    if got != want:
        raise DatasetError(f"{path}: holds {got} bytes of data, its header promises {want}: "
                           f"the file is truncated; fetch it again")
    if extra:
        raise DatasetError(f"{path}: holds more data than the {want} bytes its header promises ({dims}): "
                           f"the file is damaged or not an IDX file; fetch it again")
    return data.reshape(dims)


def _check_idx_size(path, gz, size, head, want):
    """Refuse a header whose data cannot fit the file, before anything is allocated or read."""
    if not gz and size - head != want:
        raise DatasetError(f"{path}: holds {size - head} bytes of data, its header promises {want}: the file "
                           f"is {'truncated' if size - head < want else 'damaged'}; fetch it again")
    if gz and head + want > size * GZ_MAX_RATIO:
        raise DatasetError(f"{path}: its header promises {want} bytes of data, more than a {size}-byte .gz "
                           f"can expand to ({GZ_MAX_RATIO}:1 at most): the file is damaged or not an IDX "
                           f"file; fetch it again")


def _read_into(fh, data):
    """Read into `data` in blocks until full or the stream ends; the number of bytes read."""
    view, got = memoryview(data), 0
    while got < len(data):
        n = fh.readinto(view[got:got + (1 << 20)])
        if not n:
            break
        got += n
    return got


def load_mnist_like(name, root, split="train"):
    pre = "train" if split == "train" else "t10k"
    for sub in ("", name, name.replace("-", "_"), "raw", os.path.join(name, "raw")):
        d = os.path.join(root, sub)
        if os.path.exists(os.path.join(d, f"{pre}-images-idx3-ubyte")) or \
                os.path.exists(os.path.join(d, f"{pre}-images-idx3-ubyte.gz")):
            root = d
            break
    xp = _find_maybe_gz(os.path.join(root, f"{pre}-images-idx3-ubyte"))
    yp = _find_maybe_gz(os.path.join(root, f"{pre}-labels-idx1-ubyte"))
    x = read_idx(xp, ndim=3)
    y = read_idx(yp, ndim=1)
    return ArrayDataset(name, split, x[:, None], y.astype(np.int64), 10, scale=255.0, digest=_digest_of([xp, yp]))


def _digest_of(paths):
    """The digest of every byte of these files (the data set's identity), named by their base names."""
    return files_digest([(p, os.path.basename(p)) for p in paths], desc=f"digest of {paths[0]}")


# --- CIFAR-10 / CIFAR-100 (binary version: no pickle) ------------------------------------------
def load_cifar(name, root, split="train"):
    c100 = name == "cifar100"
    sub = "cifar-100-binary" if c100 else "cifar-10-batches-bin"
    if os.path.isdir(os.path.join(root, sub)):
        root = os.path.join(root, sub)
    if c100:
        files = ["train.bin"] if split == "train" else ["test.bin"]
    else:
        files = [f"data_batch_{i}.bin" for i in range(1, 6)] if split == "train" else ["test_batch.bin"]
    nlab = 2 if c100 else 1
    rec = nlab + 3072
    xs, ys = [], []
    for fn in files:
        p = os.path.join(root, fn)
        if not os.path.lexists(p):
            raise DatasetError(f"missing file {p}: {name} is read from its binary version "
                               f"({sub}/{files[0]} ...) under --data-root; the Python (pickle) version is "
                               f"not read, for safety")
        with open_data(p) as fh:
            size = os.fstat(fh.fileno()).st_size
            if size % rec:  # checked before anything is read
                raise DatasetError(f"{p}: {size} bytes is not a whole number of {rec}-byte records: the file "
                                   f"is truncated or not {name}'s binary format; fetch it again")
            raw = np.fromfile(fh, dtype=np.uint8)
        if raw.size != size:
            raise DatasetError(f"{p}: changed while it was read: load it again")
        raw = raw.reshape(-1, rec)
        ys.append(raw[:, nlab - 1].astype(np.int64))  # CIFAR-100: fine label (the second byte)
        xs.append(raw[:, nlab:].reshape(-1, 3, 32, 32))
    return ArrayDataset(name, split, np.concatenate(xs), np.concatenate(ys), 100 if c100 else 10, scale=255.0,
                        digest=_digest_of([os.path.join(root, fn) for fn in files]))


# --- .npz arrays ---------------------------------------------------------------------------
NPZ_KEYS = {"train": [("x_train", "y_train"), ("x", "y"), ("data", "labels"), ("data", "label"), ("X", "y")],
            "test": [("x_test", "y_test")]}


def load_npz(path, split="train", num_classes=None):
    if os.path.isdir(path):
        raise DatasetError(f"--data-root {path!r} is not a file: for --dataset npz pass the .npz file itself")
    fh = open_data(path)
    with fh:
        if fh.read(6) == b"\x93NUMPY":  # a single .npy array: refused unread
            raise DatasetError(f"{path}: a .npy array, not an .npz archive: save images and labels together "
                               f"with np.savez(path, x_train=..., y_train=...)")
        fh.seek(0)
        try:
            z = np.load(fh, allow_pickle=False)  # data only: object arrays are refused
        except (OSError, ValueError) as e:
            raise DatasetError(f"{path}: not a readable .npz file ({e})") from None
        x, y = _npz_arrays(path, z, split)
    if not np.issubdtype(y.dtype, np.integer):
        raise DatasetError(f"{path}: labels have dtype {y.dtype}: store integer class labels")
    if y.ndim == 2 and y.shape[1] == 1:  # Keras stores labels as [N, 1]
        y = y.reshape(-1)
    if y.ndim != 1:
        raise DatasetError(f"{path}: labels have shape {y.shape}: store one integer class per sample, [N] "
                           f"(not one-hot)")
    x = nchw(x if x.ndim > 2 else x.reshape(len(x), 1, 1, -1))
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    if x.dtype != np.uint8 and x.size:
        lo, hi = x.min(), x.max()
        if not (lo >= 0 and hi <= 1):  # also catches NaN
            raise DatasetError(f"{path}: images of dtype {x.dtype} hold values in [{lo}, {hi}], outside [0, 1]: "
                               f"store uint8 pixels 0..255, or floats scaled to [0, 1]")
    classes = num_classes or (int(y.max()) + 1 if y.size else 0)
    return ArrayDataset("npz", split, x, y, classes, scale=scale, digest=_digest_of([path]))


def _npz_arrays(path, z, split):
    """(images, labels) of an open .npz, under the first pair of NPZ_KEYS names it holds."""
    with z:
        for xk, yk in NPZ_KEYS[split]:
            if xk in z.files and yk in z.files:
                for k in (xk, yk):
                    _check_npz_member(path, z, k)
                try:  # members are read here: object arrays fail only now, under allow_pickle=False
                    x, y = z[xk], z[yk]
                except ValueError as e:
                    raise DatasetError(f"{path}: {xk}/{yk} cannot be read as plain arrays ({e}); "
                                       f"{OBJECT_FIX}") from None
                break
        else:
            raise DatasetError(f"{path}: no {split} arrays; expected one of "
                               f"{', '.join(f'{a}/{b}' for a, b in NPZ_KEYS[split])}, found {', '.join(z.files)}")
    return x, y


OBJECT_FIX = ("object arrays (pickled Python objects) are refused for safety: save numeric arrays, e.g. np.stack "
              "the images to uint8 [N, H, W, C]")


def _check_npz_member(path, z, key):
    """Refuse a member whose .npy header promises more (or less) than the member holds, or objects,
    before numpy allocates the array its header declares."""
    try:
        info = z.zip.getinfo(key + ".npy")
        bound = info.compress_size * (GZ_MAX_RATIO if info.compress_type != zipfile.ZIP_STORED else 1)
        with z.zip.open(info) as fh:
            version = np.lib.format.read_magic(fh)
            shape, _, dtype = np.lib.format._read_array_header(fh, version)  # numpy's own parser (pinned)
            head = fh.tell()
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DatasetError(f"{path}: member {key} is not a readable .npy array ({e}): save the file again "
                           f"with np.savez") from None
    if dtype.hasobject:
        raise DatasetError(f"{path}: {key} cannot be read as a plain array (dtype {dtype}); {OBJECT_FIX}")
    need = math.prod(shape) * dtype.itemsize
    if need != info.file_size - head or info.file_size > bound:
        raise DatasetError(f"{path}: member {key} declares shape {shape} of {dtype} ({need} bytes) but holds "
                           f"{info.file_size - head} bytes: the file is damaged; save it again with np.savez")
