"""A user's own pieces by name, MODULE:FUNCTION: a data set, an augmentation, a student.

* --dataset MODULE:FUNCTION   FUNCTION(split) -> a data set (split "train" or "test") whose items
  are (image float32 [C, H, W] in [0, 1], label); its class count is its `num_classes`, else the
  largest label + 1.
* --augment MODULE:FUNCTION   FUNCTION(image, rng) -> image (pipeline.augment.UserAugment).
* --student MODULE:FUNCTION   FUNCTION(classes) -> a Gluon HybridBlock (trainer.models).

MODULE is imported as Python imports it, with the current folder on the path (as `python -m`
has it). A piece's identity is its name and a digest of its source (and, for a data set, of
every item), so a cache built with other code or other data is never reused. Every failure is
one line naming the piece: PieceError, a DatasetError (so both command lines report it so).
"""
import hashlib
import importlib
import inspect
import os
import re
import sys

import numpy as np

from .dataset_base import Dataset, DatasetError

PIECE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
# A data set is read item by item once (its digest) and holds one int64 label per item: a length past
# this is a wrong __len__, not a data set (ImageNet-21k has 14 million images).
MAX_ITEMS = 1 << 30
# What a user's code may raise and is reported as its failure: sys.exit() in a piece is a mistake
# in it, not the command's exit status (KeyboardInterrupt stays the user's stop).
USER_ERRORS = (Exception, SystemExit)


class PieceError(DatasetError):
    """A user's piece cannot be loaded or misbehaves; the message names it."""


def raised(e):
    """What a user's code raised, in words: 'raised ValueError: ...', or 'called sys.exit(0)'."""
    if isinstance(e, SystemExit):
        return f"called sys.exit({e.code!r}) (a piece must return or raise, not end the command)"
    return f"raised {type(e).__name__}: {e}"


def is_piece(spec):
    return isinstance(spec, str) and PIECE.fullmatch(spec.strip()) is not None


def load_piece(spec, flag):
    """The callable MODULE:FUNCTION names."""
    spec = spec.strip()
    module, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
    try:
        obj = importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise PieceError(f"{flag} {spec}: no module named {e.name!r}: run from the folder that holds {module}.py, "
                         f"or add its folder to PYTHONPATH") from None
    except USER_ERRORS as e:
        raise PieceError(f"{flag} {spec}: importing {module} {raised(e)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise PieceError(f"{flag} {spec}: {module} has no {attr!r}: name a function defined in {module}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise PieceError(f"{flag} {spec}: {attr} is a {type(obj).__name__}, not a function")
    return obj


def source_digest(obj, spec, flag):
    """16 hex digits of the SHA-256 of the piece's source code."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        raise PieceError(f"{flag} {spec}: its source cannot be read (it is part of the cache's name): define it "
                         f"with def in a .py file") from None
    return hashlib.sha256(source.encode()).hexdigest()[:16]


def piece_identity(spec, flag):
    """'MODULE:FUNCTION@digest': what a fingerprint records of a piece."""
    return f"{spec.strip()}@{source_digest(load_piece(spec, flag), spec, flag)}"


def _image(item, i, spec):
    if not isinstance(item, (tuple, list)) or len(item) != 2:
        raise PieceError(f"--dataset {spec}: item {i} is {type(item).__name__}"
                         f"{' of ' + str(len(item)) if isinstance(item, (tuple, list)) else ''}, not (image, label)")
    image, label = item
    image = np.asarray(image.asnumpy() if hasattr(image, "asnumpy") else image)
    if image.ndim != 3 or not np.issubdtype(image.dtype, np.number):
        raise PieceError(f"--dataset {spec}: item {i}'s image is {image.dtype} {image.shape}, not float32 [C, H, W]")
    try:
        label = int(np.asarray(label).reshape(()))
    except (TypeError, ValueError):
        raise PieceError(f"--dataset {spec}: item {i}'s label {label!r} is not an integer class") from None
    if label < 0:
        raise PieceError(f"--dataset {spec}: item {i}'s label is {label}: classes are 0, 1, ...")
    return image.astype(np.float32, copy=False), label


class UserDataset(Dataset):
    """The data set FUNCTION(split) returns, checked item by item as it is digested once."""

    def __init__(self, spec, split):
        self.spec = spec.strip()
        fn = load_piece(self.spec, "--dataset")
        self.source = source_digest(fn, self.spec, "--dataset")
        try:
            ds = fn(split)
            n = len(ds)
        except PieceError:
            raise
        except USER_ERRORS as e:
            raise PieceError(f"--dataset {self.spec}: {self.spec}({split!r}) {raised(e)}") from None
        if n == 0:
            raise PieceError(f"--dataset {self.spec}: the {split} split has no items")
        if n > MAX_ITEMS:  # checked before the labels are allocated
            raise PieceError(f"--dataset {self.spec}: the {split} split says it has {n} items, more than the limit "
                             f"of {MAX_ITEMS} (each is read once for its digest): check its __len__")
        self.inner, self.name, self.split = ds, self.spec, split
        h = hashlib.sha256()
        labels = np.empty(n, dtype=np.int64)
        self.shape = None
        for i in range(n):
            image, labels[i] = self._item(i)
            if self.shape is None:
                self.shape = image.shape
            elif image.shape != self.shape:
                raise PieceError(f"--dataset {self.spec}: item {i}'s image is {image.shape}, item 0's {self.shape}: "
                                 f"every image must have one shape (resize them in the data set)")
            h.update(np.ascontiguousarray(image).data)
            h.update(int(labels[i]).to_bytes(8, "little"))
        self.labels = labels
        declared = getattr(ds, "num_classes", None)
        self.num_classes = int(declared) if declared is not None else int(labels.max()) + 1
        if labels.max() >= self.num_classes:
            raise PieceError(f"--dataset {self.spec}: label {int(labels.max())} but num_classes is {self.num_classes}")
        self._digest = h.hexdigest()

    def _item(self, i):
        try:
            item = self.inner[i]
        except USER_ERRORS as e:
            raise PieceError(f"--dataset {self.spec}: item {i} {raised(e)}") from None
        return _image(item, i, self.spec)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self._item(int(i))

    def get_batch(self, indices):
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not len(idx):
            return np.zeros((0,) + tuple(self.shape), np.float32), self.labels[idx]
        return np.stack([self._item(int(i))[0] for i in idx]), self.labels[idx]

    def digest(self):
        return self._digest

    def identity(self):
        return {"name": self.spec, "source": self.source, "split": self.split, "length": len(self),
                "num_classes": self.num_classes, "shape": list(self.shape), "digest": self._digest}
