"""The schedule: from (seed, epoch) the order in which training asks for samples.

The producer and the trainer both call these functions with the same options, so the producer
writes keys in exactly the order the trainer will read them. Correctness never depends on it:
targets are found by key; order only decides whether the trainer waits.
"""
import dataclasses
import hashlib

import numpy as np


def epoch_permutation(seed, epoch, n):
    """The shuffled sample order of one epoch (numpy's PCG64 seeded with [seed, epoch])."""
    return np.random.default_rng([int(seed), int(epoch)]).permutation(int(n))


def epoch_batches(seed, epoch, n, batch_size):
    """The batches of sample indices of one epoch; the last batch may be smaller."""
    perm = epoch_permutation(seed, epoch, n)
    return [perm[a:a + batch_size] for a in range(0, n, batch_size)]


def view_of_epoch(epoch, views):
    """Epoch e uses augmentation view e mod V."""
    return int(epoch) % int(views)


@dataclasses.dataclass(frozen=True)
class Step:
    epoch: int
    step: int          # batch number within the epoch
    position: int      # batch number since the start of training
    indices: np.ndarray
    view: int


def schedule(seed, epochs, n, batch_size, views=1, start_epoch=0):
    """Every training step in order: (epoch, step, position, sample indices, view)."""
    steps_per_epoch = -(-n // batch_size)
    for e in range(start_epoch, epochs):
        for s, idx in enumerate(epoch_batches(seed, e, n, batch_size)):
            yield Step(e, s, e * steps_per_epoch + s, idx, view_of_epoch(e, views))


def steps_per_epoch(n, batch_size):
    return -(-int(n) // int(batch_size))


class EpochDigests:
    """SHA-256 of the (sample, view) keys each epoch of a schedule visits, in order.

    The producer reports the digests of the epochs it followed and the trainer those it read:
    equal digests show that both walked the same schedule, key for key."""

    def __init__(self, n, batch_size):
        self.steps = steps_per_epoch(n, batch_size)
        self._h, self._count = {}, {}

    def add(self, st):
        h = self._h.get(st.epoch)
        if h is None:
            h = self._h[st.epoch] = hashlib.sha256()
        h.update(np.asarray(st.indices, dtype="<i8").tobytes())
        h.update(int(st.view).to_bytes(8, "little"))
        self._count[st.epoch] = self._count.get(st.epoch, 0) + 1

    def complete(self):
        """{epoch (as a string, for JSON): digest} of every epoch followed from its first step to its last."""
        return {str(e): h.hexdigest()[:20] for e, h in sorted(self._h.items()) if self._count[e] == self.steps}
