"""SoftTargetDataset: any (image, label) data set, with the teacher's soft target of each item's view.

For a user's own Gluon loop: wrap the data set the cache was built from, hand it to
`gluon.data.DataLoader(..., shuffle=True, num_workers=N)`, call `set_epoch(e)` before each epoch.
Item i of epoch e is view v = e mod views of sample i (the keyed augmentation rebuilds it from
(seed, i, v), as the producer did) and the teacher's raw logits for that same view.

Worker processes: the DataLoader forks its workers once and keeps them, so the epoch lives in
shared memory (set_epoch reaches workers already running), and each process opens the store for
itself on first use, after the fork: a finished cache is then mapped once for all of them (its
pages shared), and a cache still being written is followed as the producer commits rows.
Threads (a DataLoader with thread_pool=True) share their process's reader, which is safe for them
(store.read.reader's NOTE [threads]).

A plain data set (no identity(), a user's own) is compared with the cache item by item, each item the
first time any process reads it (trainer.itemcheck NOTE [item check]).
"""
import ctypes
import json
import multiprocessing
import os
import threading
import warnings

import numpy as np
from mxnet import gluon

from kdcache.errors import BadTypeError
from kdcache.pipeline.augment import apply_one, as_augment, mix_one, mixes
from kdcache.store import CacheReader, StoreError
from kdcache.store.derive.ensemble import EnsembleReader
from kdcache.trainer.errors import BadValueError
from kdcache.trainer.itemcheck import EAGER, ItemCheck
from kdcache.trainer.loss import check_targets

# Values in shared memory, so that worker processes forked before a change see it: the epoch, and whether an
# order was (or will be) announced.
SHARED = {"_epoch": ctypes.c_int64, "_announced": ctypes.c_bool}
# Threads of one process open its reader once. A module's lock, not a data set's: it must not be pickled
# into worker processes, and it is made anew in a forked child (a thread may have held it at the fork).
_opening = threading.Lock()


def _fresh_lock():
    global _opening
    _opening = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock)


class SoftTargetDataset(gluon.data.Dataset):
    """Items (image float32 [C, H, W], label, soft target float32 [classes]) of `dataset`.

    `targets`: a cache (its path P, P.h5 or P.parts, or an open CacheReader) built from this data
    set with this seed, view count and augmentation, or an EnsembleReader over several such caches; `augment`: None (no augmentation), a spec
    ("crop:4,flip"), or FUNCTION(image, rng) -> image. The cache's record of the augmentation and
    seed must match, or the targets would be for other images: StoreError says so.
    With mixing (mixup:ALPHA or cutmix:ALPHA in the spec) an item's image is its view mixed with its
    keyed partner's, and its label float32 [3] (label, partner's label, λ): `mixes` says so, for
    KDLoss(..., mixed=ds.mixes).
    `reader_options` go to each process's CacheReader (timeout, heartbeat_timeout, ...).
    """

    def __init__(self, dataset, targets, *, seed=0, views=1, augment=None, **reader_options):
        self.dataset = dataset
        self.seed, self.views = int(seed), int(views)
        self.augment = as_augment(augment)
        self._options = reader_options
        self._recipe = None  # an ensemble: how each process opens its own
        if isinstance(targets, EnsembleReader):
            self._path, self._fp, reader = None, targets.fingerprint, targets
            self._recipe = targets.recipe()
        elif isinstance(targets, CacheReader):
            self._path, self._fp, reader = targets.base, targets.fingerprint, targets
        else:
            self._path, self._fp = os.fspath(targets), None
            reader = CacheReader(self._path, **reader_options)
            self._fp = reader.fingerprint
        self._items = None  # a plain data set's items, each compared with the cache's record once (NOTE [item check])
        self._check(reader)
        self.num_classes = reader.spec.num_classes
        self._reader, self._pid = reader, os.getpid()
        for name, kind in SHARED.items():
            setattr(self, name, multiprocessing.RawValue(kind, 0))
        self._hinted = False

    def _check(self, reader):
        spec = reader.spec
        where = f"cache {reader.base}" if reader.base else f"the ensemble's caches ({reader.readers[0].base}, ...)"
        if len(self.dataset) != spec.num_samples:
            raise StoreError(f"{where} holds targets for {spec.num_samples} samples, the data set has "
                             f"{len(self.dataset)}: pass the data set the cache was built from")
        if self.views != spec.views:
            raise StoreError(f"{where} holds {spec.views} view(s) per sample, views={self.views} was passed: "
                             f"pass views={spec.views}")
        inputs = getattr(spec, "inputs", None) or {}
        if callable(getattr(self.dataset, "identity", None)):
            self._check_content(where, inputs.get("dataset"))
        else:  # a plain data set: item by item, each the first time it is read
            self._items = ItemCheck(len(self.dataset), where, "pass the data set the cache was built from (the same "
                                    "items in the same order), or build a cache for this one (kdcache.build_cache)")
            self._items.warn_unrecorded(reader)
            first = np.arange(min(len(self.dataset), EAGER))
            images, labels = zip(*(self._item(int(i)) for i in first))
            self._items.check(reader, first, images, labels, reread=self._reread)
        if "augment" in inputs:
            mine = self.augment.spec if self.augment.active else None
            if inputs.get("augment") != mine:
                raise StoreError(f"{where} was built with augmentation {inputs.get('augment') or 'none'}, this data "
                                 f"set applies {mine or 'none'}: the teacher saw other images; pass the same "
                                 f"augment, or build a cache for this one")
            if mine is not None and getattr(self.augment, "varies", True) and inputs.get("augment_seed") != self.seed:
                raise StoreError(f"{where} was built with seed {inputs.get('augment_seed')}, seed={self.seed} "
                                 f"was passed: the views differ; pass seed={inputs.get('augment_seed')}")

    def _check_content(self, where, recorded):
        """The data set's identity (name, split, length, content digest: what the command line's
        fingerprint records) must be the cache's. Computed once, here: the digest is remembered by
        the data set (and by the digest memo for files), so later epochs and workers pay nothing.
        The fingerprint records one digest of the whole data set, so a content mismatch names the
        digests, not an item. A data set without identity() (a plain gluon Dataset) is checked item by
        item instead (NOTE [item check])."""
        identity = getattr(self.dataset, "identity", None)
        if not isinstance(recorded, dict) or not callable(identity):
            return
        mine = json.loads(json.dumps(identity()))  # as the cache stores it (tuples become lists)
        differ = [k for k in sorted(set(recorded) | set(mine)) if recorded.get(k) != mine.get(k)]
        if not differ:
            return
        said = "; ".join(f"{k} {_short(recorded.get(k))} in the cache, {_short(mine.get(k))} here" for k in differ)
        content = (" (the cache keeps one digest of all images and labels, so no single item can be named)"
                   if "digest" in differ else "")
        raise StoreError(f"{where} was built from another data set: {said}{content}: pass the data set the cache "
                         f"was built from (same files, split and order), or build a cache for this one")

    @property
    def mixes(self):
        """Whether items are mixed views: labels are then float32 [3] rows (label, partner's label, λ)."""
        return mixes(self.augment)

    # -- the epoch, shared with worker processes ----------------------------------------------
    def set_epoch(self, epoch):
        """Select the epoch: its items are view (epoch mod views) of every sample."""
        if int(epoch) < 0:
            raise BadValueError(f"epoch {epoch} < 0: epochs count from 0")
        self._epoch.value = int(epoch)

    @property
    def epoch(self):
        return int(self._epoch.value)

    @property
    def view(self):
        return self.epoch % self.views

    # -- items ----------------------------------------------------------------------------------
    def reader(self):
        """This process's CacheReader, opened after a fork on first use; shared by its threads."""
        reader = self._reader
        if reader is not None and self._pid == os.getpid():
            return reader
        with _opening:
            if self._reader is None or self._pid != os.getpid():
                self._reader = (EnsembleReader(**self._recipe) if self._recipe is not None else
                                CacheReader(self._path, fingerprint=self._fp, **self._options))
                self._pid = os.getpid()
            return self._reader

    def __len__(self):
        return len(self.dataset)

    def announce(self, order):
        """Tell a producer still filling the cache the order this epoch reads samples in: it serves
        them in that order (without it, it serves what the workers wait for, then key order)."""
        self._announced.value = True
        return self.reader().announce(np.asarray(order, dtype=np.int64), self.view)

    def sampler(self, shuffle=True):
        """A sampler for DataLoader(..., sampler=ds.sampler()): each epoch a permutation seeded by
        (seed, epoch), announced to the producer before the first batch."""
        self._announced.value = True  # before the DataLoader forks its workers: they see it
        return _Announcing(self, shuffle)

    def _item(self, i):
        """Item i of the data set: (image float32, label), before augmentation."""
        item = self.dataset[i]
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise BadTypeError(f"item {i} of {type(self.dataset).__name__} is {type(item).__name__}, not "
                               f"(image, label)")
        image, label = item[0], item[1]
        return np.asarray(image.asnumpy() if hasattr(image, "asnumpy") else image, dtype=np.float32), label

    def _reread(self, i):
        return self._item(i)[0]

    def __getitem__(self, idx):
        i = int(idx)
        if not 0 <= i < len(self.dataset):
            raise IndexError(f"index {idx} out of range [0, {len(self.dataset)})")
        v = self.view
        image, label = self._item(i)
        reader = self.reader()
        waits = reader.waits
        soft = reader.get(np.array([i]), v)[0]
        items = self._items
        if items is not None and not items.bits()[i]:  # a plain data set: its item's first read (NOTE [item check])
            items.check(reader, [i], [image], [label], reread=self._reread)
        image = apply_one(self.augment, image, self.seed, i, v)
        if self.mixes:  # the partner's view, mixed in as the producer mixed it (pipeline.augment NOTE (mixed views))
            image, label = mix_one(self.augment, image, label, self._item, self.seed, i, v, len(self.dataset))
        # A reader serves what the file holds: a damaged value would put NaN into every weight at the
        # first step of the user's own loop (kdcache.trainer.loss NOTE), so it is refused here, by key.
        check_targets(soft[None], [i], v, cache=self._path)
        if reader.waits != waits and not self._announced.value and not self._hinted:
            self._hinted = True  # once per process
            warnings.warn(f"SoftTargetDataset: waited for the target of sample {i}, which the producer has not "
                          f"written yet; without the epoch's order it serves one waited item at a time, then key "
                          f"order. Pass sampler=ds.sampler() to the DataLoader (or call ds.announce(order) before "
                          f"each epoch) and it fills the order you read in", stacklevel=2)
        return image, label, soft

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_reader"] = None  # each process opens its own
        if multiprocessing.context.get_spawning_popen() is None:  # pickled outside process start: plain values
            for name in SHARED:
                state[name] = getattr(self, name).value
        return state

    def __setstate__(self, state):
        for name, kind in SHARED.items():
            value = state.get(name, 0)
            if isinstance(value, int):  # a plain value (bool is an int too)
                state[name] = multiprocessing.RawValue(kind, value)
        self.__dict__.update(state)


def _short(value):
    """A recorded identity value for a one-line message: digests cut to 12 characters."""
    if isinstance(value, str) and len(value) == 64:
        return value[:12] + "…"
    return "none" if value is None else json.dumps(value)


class _Announcing(gluon.data.Sampler):
    """Each epoch's order, seeded by (seed, epoch) and announced before it is read."""

    def __init__(self, data, shuffle):
        self.data, self.shuffle = data, bool(shuffle)

    def __iter__(self):
        n = len(self.data)
        order = (np.random.default_rng([self.data.seed, self.data.epoch]).permutation(n) if self.shuffle
                 else np.arange(n))
        self.data.announce(order)
        return iter(order.tolist())

    def __len__(self):
        return len(self.data)
