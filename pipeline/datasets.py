"""Data sets: the embedded default (scikit-learn's digits), synthetic data, and users' formats.

Every data set yields (x float32 [C, H, W] in [0, 1], label int), batches with `get_batch`,
and has an identity (name, split, length, content digest) that goes into cache fingerprints.
Nothing is downloaded: real formats are read from local files under --data-root.
"""
import gzip
import hashlib
import os
import struct
import zlib

import numpy as np


class Dataset:
    """gluon.data.Dataset's protocol (__getitem__ -> (x, label), __len__), so gluon's DataLoader
    takes these data sets; not a subclass, so that loading array data sets and fingerprinting
    them does not import MXNet (the trainer fixes its thread count before MXNet loads)."""

    def __getitem__(self, idx):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError


class DatasetError(ValueError):
    """A data set cannot be loaded; the message names the cause and the fix."""


class ArrayDataset(Dataset):
    """A data set held in RAM as uint8 or float arrays (N, C, H, W) with integer labels."""

    def __init__(self, name, split, data, labels, num_classes, scale, digest=None, params=None):
        if data.ndim != 4:
            raise DatasetError(f"{name}: samples must be images [N, C, H, W] or [N, H, W, C], got {data.shape}")
        if len(data) != len(labels):
            raise DatasetError(f"{name}: {len(data)} samples but {len(labels)} labels: the files do not belong together")
        if len(data) == 0:
            raise DatasetError(f"{name} ({split}): no samples: check --data-root")
        self.name, self.split = name, split
        self.data = data
        self.labels = np.asarray(labels, dtype=np.int64)
        self.num_classes = int(num_classes)
        if self.labels.min() < 0 or self.labels.max() >= self.num_classes:
            raise DatasetError(f"{name}: labels outside [0, {self.num_classes}): the label file is damaged")
        self.scale = float(scale)
        self.shape = tuple(int(s) for s in data.shape[1:])
        self.params = params or {}
        self._digest = digest

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return self.data[i].astype(np.float32) * np.float32(1.0 / self.scale), int(self.labels[i])

    def get_batch(self, indices):
        idx = np.asarray(indices, dtype=np.int64)
        return self.data[idx].astype(np.float32) * np.float32(1.0 / self.scale), self.labels[idx]

    def digest(self):
        if self._digest is None:
            h = hashlib.sha256()
            h.update(str(self.data.dtype).encode() + str(self.data.shape).encode())
            h.update(np.ascontiguousarray(self.data).data)
            h.update(np.ascontiguousarray(self.labels).data)
            self._digest = h.hexdigest()
        return self._digest

    def identity(self):
        """What the fingerprint records of this data set."""
        return {"name": self.name, "split": self.split, "length": len(self), "num_classes": self.num_classes,
                "shape": list(self.shape), "digest": self.digest(), **self.params}


def _nchw(x):
    """[N, H, W] -> [N, 1, H, W]; [N, H, W, C] (C in 1, 3, 4) -> [N, C, H, W]."""
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return x


# --- digits: the embedded default ------------------------------------------------------------
DIGITS_TEST_FRACTION = 0.2


def load_digits(split="train"):
    """scikit-learn's digits (1797 8x8 images, 10 classes, pixel values 0..16), shipped inside
    its wheel: a fixed split, 1438 train / 359 test samples (a seeded permutation)."""
    from sklearn.datasets import load_digits as _ld
    d = _ld()
    x = d.images.astype(np.uint8)[:, None]  # values 0..16
    y = d.target.astype(np.int64)
    perm = np.random.default_rng(0).permutation(len(x))
    n_test = int(round(len(x) * DIGITS_TEST_FRACTION))
    idx = perm[n_test:] if split == "train" else perm[:n_test]
    idx = np.sort(idx)
    return ArrayDataset("digits", split, x[idx], y[idx], 10, scale=16.0)


# --- synthetic: deterministic, any size, learnable --------------------------------------------
def load_synthetic(split="train", n=10000, classes=10, shape=(3, 32, 32), seed=0):
    """Class prototypes plus noise, as uint8 images; deterministic in (n, classes, shape, seed).
    The test split (n // 5 samples, at least 1) uses other noise and labels, same prototypes."""
    shape = tuple(int(s) for s in shape)
    if split == "test":
        n = max(1, n // 5)
    d = int(np.prod(shape))
    protos = np.random.default_rng([seed, 0]).uniform(40, 215, size=(classes, d)).astype(np.float32)
    rng = np.random.default_rng([seed, 1 if split == "train" else 2])
    labels = rng.integers(0, classes, size=n)
    data = np.empty((n, d), dtype=np.uint8)
    step = max(1, (1 << 24) // d)
    for a in range(0, n, step):
        b = min(n, a + step)
        noise = rng.normal(0, 45, size=(b - a, d)).astype(np.float32)
        data[a:b] = np.clip(protos[labels[a:b]] + noise, 0, 255).astype(np.uint8)
    params = {"n": n, "classes": classes, "seed": seed}
    return ArrayDataset("synthetic", split, data.reshape((n,) + shape), labels, classes, scale=255.0,
                        digest=hashlib.sha256(repr(sorted({**params, "shape": shape, "split": split}.items()))
                                              .encode()).hexdigest(), params=params)


def parse_synthetic(spec):
    """'synthetic' or 'synthetic:n=20000,classes=10,shape=3x32x32,seed=0'."""
    kw = {}
    if ":" in spec:
        for part in spec.split(":", 1)[1].split(","):
            if not part.strip():
                continue
            k, _, v = part.partition("=")
            k = k.strip()
            try:
                if k == "shape":
                    kw["shape"] = tuple(int(s) for s in v.lower().split("x"))
                elif k in ("n", "classes", "seed"):
                    kw[k] = int(v)
                else:
                    raise ValueError
            except ValueError:
                raise DatasetError(f"data set {spec!r}: cannot read {part!r}; use synthetic:n=20000,classes=10,"
                                   f"shape=3x32x32,seed=0") from None
    return kw


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
    x = _nchw(x if x.ndim > 2 else x.reshape(len(x), 1, 1, -1))
    scale = 255.0 if x.dtype == np.uint8 else 1.0
    if x.dtype != np.uint8 and x.size:
        lo, hi = x.min(), x.max()
        if not (lo >= 0 and hi <= 1):  # also catches NaN
            raise DatasetError(f"{path}: images of dtype {x.dtype} hold values in [{lo}, {hi}], outside [0, 1]: "
                               f"store uint8 pixels 0..255, or floats scaled to [0, 1]")
    classes = num_classes or (int(y.max()) + 1 if y.size else 0)
    return ArrayDataset("npz", split, x, y, classes, scale=scale)


# --- decoded image formats: RecordIO and image folders ---------------------------------------
class DecodedDataset(Dataset):
    """Images decoded by MXNet on demand, resized to `size`; the file handle opens lazily per
    process (as MXRecordIO does after a fork)."""

    def __init__(self, name, split, n, labels, num_classes, size, params):
        self.name, self.split = name, split
        self.labels = np.asarray(labels, dtype=np.int64)
        self.num_classes = int(num_classes)
        self.size = size
        self.params = params
        self._n = n
        self._pid = None
        if n == 0:
            raise DatasetError(f"{name} ({split}): no images: check --data-root")
        if self.labels.min() < 0 or self.labels.max() >= self.num_classes:
            raise DatasetError(f"{name}: labels outside [0, {self.num_classes}): pass --num-classes to match "
                               f"the labels, or fix the labels in the data set")
        first = self._decode(0)
        self.shape = tuple(first.shape)

    def __len__(self):
        return self._n

    def _image(self, nd_img):
        import mxnet as mx
        if self.size is not None:
            nd_img = mx.image.imresize(nd_img, self.size[1], self.size[0])
        a = nd_img.asnumpy()
        if a.ndim == 2:
            a = a[:, :, None]
        return a.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)

    def __getitem__(self, i):
        return self._decode(i), int(self.labels[i])

    def get_batch(self, indices):
        xs = [self._decode(int(i)) for i in np.asarray(indices).reshape(-1)]
        shapes = {x.shape for x in xs}
        if len(shapes) > 1:
            raise DatasetError(f"{self.name}: images of different sizes {sorted(shapes)} in one batch: "
                               f"pass --image-size HxW to resize them")
        return np.stack(xs), self.labels[np.asarray(indices, dtype=np.int64)]

    def identity(self):
        return {"name": self.name, "split": self.split, "length": len(self), "num_classes": self.num_classes,
                "shape": list(self.shape), **self.params}


class RecordIODataset(DecodedDataset):
    """MXNet RecordIO (`.rec` + `.idx`, as written by im2rec or MXIndexedRecordIO)."""

    def __init__(self, rec_path, split="train", size=None, num_classes=None):
        import mxnet as mx
        if not rec_path.endswith(".rec"):
            raise DatasetError(f"--data-root {rec_path!r}: for --dataset recordio pass the .rec file "
                               f"(its .idx beside it)")
        idx_path = rec_path[:-4] + ".idx"
        for p in (rec_path, idx_path):
            if not os.path.isfile(p):
                raise DatasetError(f"missing {p}: RecordIO needs the .rec file and its .idx index (im2rec writes both)")
        self.rec_path, self.idx_path = rec_path, idx_path
        with open(idx_path) as fh:
            self.keys = [int(line.split("\t")[0]) for line in fh if line.strip()]
        rec = mx.recordio.MXIndexedRecordIO(idx_path, rec_path, "r")
        labels = []
        for k in self.keys:
            header, _ = mx.recordio.unpack(rec.read_idx(k))
            lab = header.label
            labels.append(int(lab if np.isscalar(lab) else np.asarray(lab).reshape(-1)[0]))
        rec.close()
        h = hashlib.sha256(open(idx_path, "rb").read())
        st = os.path.getsize(rec_path)
        with open(rec_path, "rb") as fh:  # head and tail: a full digest of a huge .rec would take minutes
            h.update(fh.read(1 << 20))
            fh.seek(max(0, st - (1 << 20)))
            h.update(fh.read())
        h.update(str(st).encode())
        classes = num_classes or (max(labels) + 1 if labels else 0)
        super().__init__("recordio", split, len(self.keys), labels, classes, size,
                         {"digest": h.hexdigest(), "file": os.path.basename(rec_path)})

    def _decode(self, i):
        import mxnet as mx
        if self._pid != os.getpid():
            self._rec = mx.recordio.MXIndexedRecordIO(self.idx_path, self.rec_path, "r")
            self._pid = os.getpid()
        _, img = mx.recordio.unpack(self._rec.read_idx(self.keys[i]))
        return self._image(mx.image.imdecode(img))


class ImageFolderDataset(DecodedDataset):
    """root/<class name>/<image>, classes in sorted order (gluon's ImageFolderDataset)."""

    def __init__(self, root, split="train", size=None):
        from mxnet.gluon.data.vision import ImageFolderDataset as _IFD
        if os.path.isdir(os.path.join(root, split)):
            root = os.path.join(root, split)
        elif split == "test" or os.path.isdir(os.path.join(root, "test")):
            # never evaluate on the training images, nor train on a 'test' class
            raise DatasetError(f"--data-root {root!r} has no {split}/ folder: lay the images out as "
                               f"root/train/<class>/... and root/test/<class>/...")
        if not os.path.isdir(root):
            raise DatasetError(f"--data-root {root!r} is not a directory of class folders")
        self._folder = _IFD(root)
        if len(self._folder) == 0:
            raise DatasetError(f"{root}: no images found in class sub-folders (root/<class>/<image>.jpg)")
        items = self._folder.items
        h = hashlib.sha256()
        total = sum(os.path.getsize(p) for p, _ in items)
        for p, lab in items:  # full content digest up to 1 GiB of images, else names and sizes
            h.update(f"{os.path.relpath(p, root)}\0{lab}\0{os.path.getsize(p)}\0".encode())
            if total <= (1 << 30):
                with open(p, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
        super().__init__("imagefolder", split, len(items), [lab for _, lab in items], len(self._folder.synsets),
                         size, {"digest": h.hexdigest(), "classes": list(self._folder.synsets)})

    def _decode(self, i):
        import mxnet as mx
        return self._image(mx.image.imread(self._folder.items[i][0]))


# --- the registry of names -------------------------------------------------------------------
DATASETS = ("digits", "synthetic", "mnist", "fashion-mnist", "cifar10", "cifar100", "npz", "recordio",
            "imagefolder")


def _size(s):
    if s is None:
        return None
    try:
        h, w = (int(v) for v in str(s).lower().split("x"))
        return h, w
    except ValueError:
        raise DatasetError(f"--image-size {s!r}: use HxW, e.g. 224x224") from None


def load_dataset(name, *, data_root=None, split="train", image_size=None, num_classes=None):
    """A data set by name: digits | synthetic[:n=..,classes=..,shape=CxHxW,seed=..] | mnist |
    fashion-mnist | cifar10 | cifar100 (files under data_root) | npz | recordio (a file) | imagefolder (a dir)."""
    if split not in ("train", "test"):
        raise DatasetError(f"split {split!r}: use train or test")
    base = name.split(":", 1)[0].strip().lower()
    if base not in DATASETS:
        raise DatasetError(f"unknown data set {name!r}: use one of {', '.join(DATASETS)}")
    if base == "digits":
        return load_digits(split)
    if base == "synthetic":
        return load_synthetic(split, **parse_synthetic(name))
    if not data_root:
        raise DatasetError(f"--dataset {base} reads local files: pass --data-root (nothing is downloaded)")
    if not os.path.exists(data_root):
        raise DatasetError(f"--data-root {data_root!r} does not exist")
    if base in ("mnist", "fashion-mnist"):
        return load_mnist_like(base, data_root, split)
    if base in ("cifar10", "cifar100"):
        return load_cifar(base, data_root, split)
    if base == "npz":
        return load_npz(data_root, split, num_classes)
    if base == "recordio":
        path = data_root
        if os.path.isdir(path):
            path = os.path.join(path, f"{split}.rec")
        return RecordIODataset(path, split, _size(image_size), num_classes)
    return ImageFolderDataset(data_root, split, _size(image_size))
