"""Array data set files read with numpy alone: IDX (MNIST, Fashion-MNIST), CIFAR binary and .npz."""
import gzip
import os
import struct
import zlib

import numpy as np

from .dataset_base import ArrayDataset, DatasetError, nchw


# --- MNIST / Fashion-MNIST (IDX files) ------------------------------------------------------
def _open_maybe_gz(path):
    for p in (path, path + ".gz"):
        if os.path.exists(p):
            return gzip.open(p, "rb") if p.endswith(".gz") else open(p, "rb")
    raise DatasetError(f"missing file {path} (or {path}.gz): put the data set's standard files under --data-root")


def read_idx(path, ndim=None):
    """An IDX file (MNIST's format): magic 0x00 0x00 type ndim, big-endian dims, then data.
    `ndim`: the number of dimensions the caller expects (3 for images, 1 for labels)."""
    with _open_maybe_gz(path) as fh:
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
            data = np.frombuffer(fh.read(), dtype=np.uint8)
        except (OSError, EOFError, zlib.error, struct.error) as e:
            raise DatasetError(f"{path}: cannot be read ({e}): the file is truncated or damaged; "
                               f"fetch it again") from None
    if data.size != int(np.prod(dims)):
        raise DatasetError(f"{path}: holds {data.size} bytes of data, its header promises {int(np.prod(dims))}: "
                           f"the file is truncated; fetch it again")
    return data.reshape(dims)


def load_mnist_like(name, root, split="train"):
    pre = "train" if split == "train" else "t10k"
    for sub in ("", name, name.replace("-", "_"), "raw", os.path.join(name, "raw")):
        d = os.path.join(root, sub)
        if os.path.exists(os.path.join(d, f"{pre}-images-idx3-ubyte")) or \
                os.path.exists(os.path.join(d, f"{pre}-images-idx3-ubyte.gz")):
            root = d
            break
    x = read_idx(os.path.join(root, f"{pre}-images-idx3-ubyte"), ndim=3)
    y = read_idx(os.path.join(root, f"{pre}-labels-idx1-ubyte"), ndim=1)
    return ArrayDataset(name, split, x[:, None], y.astype(np.int64), 10, scale=255.0)


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
        if not os.path.exists(p):
            raise DatasetError(f"missing file {p}: {name} is read from its binary version "
                               f"({sub}/{files[0]} ...) under --data-root; the Python (pickle) version is "
                               f"not read, for safety")
        raw = np.fromfile(p, dtype=np.uint8)
        if raw.size % rec:
            raise DatasetError(f"{p}: {raw.size} bytes is not a whole number of {rec}-byte records: the file "
                               f"is truncated or not {name}'s binary format")
        raw = raw.reshape(-1, rec)
        ys.append(raw[:, nlab - 1].astype(np.int64))  # CIFAR-100: fine label (the second byte)
        xs.append(raw[:, nlab:].reshape(-1, 3, 32, 32))
    return ArrayDataset(name, split, np.concatenate(xs), np.concatenate(ys), 100 if c100 else 10, scale=255.0)


# --- .npz arrays ---------------------------------------------------------------------------
NPZ_KEYS = {"train": [("x_train", "y_train"), ("x", "y"), ("data", "labels"), ("data", "label"), ("X", "y")],
            "test": [("x_test", "y_test")]}


def load_npz(path, split="train", num_classes=None):
    if not os.path.isfile(path):
        raise DatasetError(f"--data-root {path!r} is not a file: for --dataset npz pass the .npz file itself")
    try:
        z = np.load(path, allow_pickle=False)  # data only: object arrays are refused
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: not a readable .npz file ({e})") from None
    if not isinstance(z, np.lib.npyio.NpzFile):  # a single .npy array
        raise DatasetError(f"{path}: a .npy array, not an .npz archive: save images and labels together with "
                           f"np.savez(path, x_train=..., y_train=...)")
    with z:
        for xk, yk in NPZ_KEYS[split]:
            if xk in z.files and yk in z.files:
                try:  # members are read here: object arrays fail only now, under allow_pickle=False
                    x, y = z[xk], z[yk]
                except ValueError as e:
                    raise DatasetError(f"{path}: {xk}/{yk} cannot be read as plain arrays ({e}); object arrays "
                                       f"(pickled Python objects) are refused for safety: save numeric "
                                       f"arrays, e.g. np.stack the images to uint8 [N, H, W, C]") from None
                break
        else:
            raise DatasetError(f"{path}: no {split} arrays; expected one of "
                               f"{', '.join(f'{a}/{b}' for a, b in NPZ_KEYS[split])}, found {', '.join(z.files)}")
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
    return ArrayDataset("npz", split, x, y, classes, scale=scale)
