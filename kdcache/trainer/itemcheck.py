"""A user's own data set checked item by item against the cache: each item the first time it is read.

NOTE [item check]
A plain data set (a Gluon Dataset without kdcache's identity()) cannot be compared with a cache as a
whole without reading all of it, and a data set re-split with another seed has the same length and
other items. The cache records each item its targets were made from (store.format.items: a digest of the
image as float32 values before augmentation, and the label; pipeline.digests NOTE [item digests]).
SoftTargetDataset and SoftTargetIter compare an item with its record the first time they read it:
one SHA-256 of the image (measured in docs/api.md), then one bit per item says it was checked, so
later epochs pay nothing. The bits live in shared memory made before DataLoader worker processes
are forked, so an item checked by one worker is not checked again by another, nor by the workers
of the next epoch's DataLoader. The first items (EAGER) are checked when the data set is made,
so a wrong data set is refused there, before any loop starts. An item whose record is not known
(a cache written before records existed, or a row a producer has not committed yet) is not
checked and not marked: it is checked once its record is there.
"""
import ctypes
import multiprocessing
import warnings

import numpy as np

from kdcache.pipeline.digests import item_digest
from kdcache.store import StoreError
from kdcache.store.format.items import known

EAGER = 8  # items checked when the data set is made


def item_label(label):
    """An item's label as an integer class, or None when it is not one (then only its image is compared)."""
    try:
        value = np.asarray(label.asnumpy() if hasattr(label, "asnumpy") else label)
        return int(value.reshape(()))
    except (TypeError, ValueError):
        return None


def _hex(digest):
    return bytes(digest).hex()[:12] + "…"


class ItemCheck:
    """Which items of a data set of `n` items were compared with the cache's records, and the comparison.
    `where` names the cache in messages; `fix` is what the user does about a difference."""

    def __init__(self, n, where, fix):
        self.n, self.where, self.fix = int(n), where, fix
        self._checked = multiprocessing.RawArray(ctypes.c_uint8, self.n)
        self._view = None  # this process's numpy view of the bits

    def bits(self):
        view = self._view
        if view is None:
            view = self._view = np.frombuffer(self._checked, dtype=np.uint8)
        return view

    def unchecked(self, indices):
        """The positions in `indices` whose items have not been checked yet."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return np.flatnonzero(self.bits()[idx] == 0)

    def check(self, reader, indices, images, labels, reread=None):
        """Compare items `indices` (their images, float32 before augmentation, and labels) with the records
        `reader` holds; StoreError naming the first that differs. `reread(i)`, when given, reads item i
        again: an item that reads differently each time is said to be so."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        if not idx.size:
            return
        records = reader.items(idx)
        ok = known(records)
        for j in np.flatnonzero(ok):
            i = int(idx[j])
            mine_label = item_label(labels[j])
            digest = item_digest(images[j])
            same_image = digest == bytes(records["digest"][j])
            same_label = mine_label is None or mine_label == int(records["label"][j])
            if not (same_image and same_label):
                raise StoreError(self._differs(i, records[j], digest, mine_label, same_image, same_label, reread))
        bits = self.bits()
        bits[idx[ok]] = 1

    def _differs(self, i, record, digest, label, same_image, same_label, reread):
        parts = []
        if not same_image:
            parts.append(f"image (digest {_hex(digest)} here, {_hex(record['digest'])} in the cache)")
        if not same_label:
            parts.append(f"label ({label} here, {int(record['label'])} in the cache)")
        what = " and ".join(parts)
        if reread is not None and not same_image:
            again = reread(i)
            if again is not None and item_digest(again) != digest:
                return (f"{self.where}: item {i} of this data set is another image each time it is read (it augments "
                        f"or changes in __getitem__): the cache holds the teacher's targets for one image per item; "
                        f"make items fixed and let kdcache augment them (augment=...), then build the cache again")
        return (f"{self.where} was built from another data set: item {i} (the first item read that differs) has "
                f"another {what}: {self.fix}")

    def warn_unrecorded(self, reader):
        """Say once that a finished cache records no items (written before records existed)."""
        if getattr(reader, "complete", False) and not known(reader.items(np.arange(min(self.n, 1)))).any():
            warnings.warn(f"{self.where}: no record of its data set's items (written by a kdcache before it kept "
                          f"them): this data set is checked by its length only; build the cache again to have "
                          f"every item checked", stacklevel=3)

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_view"] = None
        if multiprocessing.context.get_spawning_popen() is None:  # pickled outside process start: plain bytes
            state["_checked"] = bytes(self._checked)
        return state

    def __setstate__(self, state):
        if isinstance(state["_checked"], bytes):
            raw = multiprocessing.RawArray(ctypes.c_uint8, len(state["_checked"]))
            raw[:] = state["_checked"]
            state["_checked"] = raw
        self.__dict__.update(state)
