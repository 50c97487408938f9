"""Your own data set, augmentation and student, by name (MODULE:FUNCTION), in kdcache's commands.

Run (from the folder that holds this file):
    kdcache teacher --epochs 5 --quiet
    kdcache train --teacher teachers/digits --dataset own_pieces:load --augment own_pieces:jitter --views 2 --student own_pieces:student --epochs 10 --quiet

The producer and the trainer both load these by name; their names and a digest of their source
(and every item of the data set) name the cache, so editing one makes a new cache.
"""
import numpy as np
from sklearn.datasets import load_digits


class Digits:
    """A data set as you may already have one: items (image float32 [C, H, W] in [0, 1], label)."""
    num_classes = 10

    def __init__(self, split):
        d = load_digits()
        x = (d.images / 16.0).astype(np.float32)[:, None]
        test = np.arange(len(x)) % 5 == 0
        keep = ~test if split == "train" else test
        self.items = list(zip(x[keep], d.target[keep]))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def load(split):
    """--dataset own_pieces:load: split is "train" or "test"."""
    return Digits(split)


def jitter(image, rng):
    """--augment own_pieces:jitter: rng is seeded by (seed, sample, view), so the producer and the
    trainer make the same view. It must keep the image's shape."""
    shift = int(rng.integers(-1, 2))
    return np.roll(image, shift, axis=2) * np.float32(rng.uniform(0.9, 1.1))


def student(classes):
    """--student own_pieces:student: a Gluon HybridBlock for `classes` classes."""
    from mxnet import gluon
    net = gluon.nn.HybridSequential(prefix="own_")
    with net.name_scope():
        net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(classes))
    return net
