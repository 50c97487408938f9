"""The data set types every format builds on: the protocol, DatasetError and the in-RAM ArrayDataset.

Every data set yields (x float32 [C, H, W] in [0, 1], label int), batches with `get_batch`,
and has an identity (name, split, length, content digest) that goes into cache fingerprints.
"""
import hashlib

import numpy as np

from kdcache.pipeline.errors import PipelineError


class Dataset:
    """gluon.data.Dataset's protocol (__getitem__ -> (x, label), __len__), so gluon's DataLoader
    takes these data sets; not a subclass, so that loading array data sets and fingerprinting
    them does not import MXNet (the trainer fixes its thread count before MXNet loads)."""

    def __getitem__(self, idx):
        raise NotImplementedError

    def __len__(self):
        raise NotImplementedError


class DatasetError(PipelineError):
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


def nchw(x):
    """[N, H, W] -> [N, 1, H, W]; [N, H, W, C] (C in 1, 3, 4) -> [N, C, H, W]."""
    if x.ndim == 3:
        return x[:, None]
    if x.ndim == 4 and x.shape[-1] in (1, 3, 4) and x.shape[1] not in (1, 3, 4):
        return np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    return x
