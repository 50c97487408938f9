"""SoftTargetIter: an mx.io.DataIter for the Module API with the soft target as a second label.

Each batch carries `data`, `softmax_label` (the hard labels) and `soft_label` (the teacher's
raw logits from the store, float32 [B, C]), so a Module whose symbol takes both labels trains
with the KD loss and never runs the teacher. Two ways to get the batches:

* over a kdcache data set: the keys of the training schedule, augmented by the keyed
  augmentation exactly as the producer augmented them (view epoch mod views);
* over the user's own DataIter (an ImageRecordIter_v1 over a .rec with its .idx, say): its batches
  pass through, and the soft labels are attached by the sample indices each batch carries
  (`batch.index`). An iterator that gives no indices is refused. An iterator that augments on
  its own shows the student images the teacher never saw: that is said once (see the README).
"""
import logging

import mxnet as mx
import numpy as np

from kdcache.errors import BadTypeError
from kdcache.pipeline.augment import Augment, as_augment, make_views, mixes
from kdcache.pipeline.schedule import epoch_batches, view_of_epoch
from kdcache.store.format.schema import index_error
from kdcache.trainer.defaults import DEFAULT_ALPHA, DEFAULT_TEMPERATURE
from kdcache.trainer.errors import BadValueError
from kdcache.trainer.itemcheck import EAGER, ItemCheck
from kdcache.trainer.loss import check_targets, kd_formula, smoothing_of, temperature_of

log = logging.getLogger("kdcache.trainer")

# Random augmenters of mx.image.ImageIter's auglist (the ones that change an image between epochs).
_RANDOM_AUGS = ("RandomCropAug", "RandomSizedCropAug", "HorizontalFlipAug", "BrightnessJitterAug", "ContrastJitterAug",
                "SaturationJitterAug", "HueJitterAug", "ColorJitterAug", "LightingAug", "RandomGrayAug",
                "RandomOrderAug")
_PROBES = 16  # pixels per image compared across epochs to notice an iterator that augments


class SoftTargetIter(mx.io.DataIter):
    """Iterate one epoch per reset(); `targets` is a store reader (CacheReader, or anything with
    get(indices, views)).

    `source` is a kdcache data set or a gluon Dataset of (image [C, H, W], label) items (batches
    follow the schedule of `seed`; the last partial batch
    is padded by wrapping around, `pad` tells how many, as NDArrayIter's 'pad' mode does), or the
    user's own mx.io.DataIter whose batches carry `index` (batch_size, seed and augment are then
    its own business). `keys`: the record keys of the cache's samples, in order, when the
    iterator's indices are record keys that are not 0..N-1 (RecordIODataset.keys). `augments`:
    whether the user's iterator augments (None: find out).
    """

    def __init__(self, source, targets, *, batch_size=64, seed=0, views=1, augment=None,
                 data_name="data", label_name="softmax_label", soft_label_name="soft_label", start_epoch=0,
                 keys=None, augments=None):
        self.inner = source if isinstance(source, mx.io.DataIter) else None
        if self.inner is None and not hasattr(source, "get_batch"):
            source = _ItemSource(source, targets)
        super().__init__(self.inner.batch_size if self.inner is not None else batch_size)
        self.dataset, self.targets = (None if self.inner is not None else source), targets
        self.seed, self.views = seed, views
        self.augment = as_augment(augment)  # None, a spec, an Augment, or FUNCTION(image, rng)
        self.data_name, self.label_name, self.soft_label_name = data_name, label_name, soft_label_name
        self.num_classes = int(getattr(targets, "spec", source).num_classes) if self.inner is not None \
            else int(source.num_classes)
        self.epoch = start_epoch - 1
        self._batches = []
        self._i = 0
        if self.inner is not None:
            self._keys = None
            if keys is not None:  # record keys in sample order: sorted, with their positions
                k = np.asarray(keys, dtype=np.int64).reshape(-1)
                order = np.argsort(k, kind="stable")
                self._keys = (k[order], order)
            self.augments = self._declared_augments(augments)
            self._probe_sig, self._probe_pos = np.empty(0), None
            self._warned = False
            if self.augments:
                self._say_augments("its augmenters")
            self.epoch += 1
            return
        self.reset()

    @property
    def provide_data(self):
        if self.inner is not None:
            return self.inner.provide_data
        shape = self.augment.out_shape(self.dataset.shape)  # rrc:SIZE and eval views have their own size
        return [mx.io.DataDesc(self.data_name, (self.batch_size,) + tuple(shape), np.float32)]

    @property
    def provide_label(self):
        soft = mx.io.DataDesc(self.soft_label_name, (self.batch_size, self.num_classes), np.float32)
        if self.inner is not None:
            return list(self.inner.provide_label) + [soft]
        rows = (self.batch_size, 3) if self.mixes else (self.batch_size,)  # mixed: (label, partner's label, λ)
        return [mx.io.DataDesc(self.label_name, rows, np.float32), soft]

    @property
    def mixes(self):
        """Whether the views are mixed (mixup, cutmix): the hard labels are then rows (label, partner's
        label, λ), for kd_symbol(..., mixed=True)."""
        return self.inner is None and mixes(self.augment)

    def reset(self):
        self.epoch += 1
        if self.inner is not None:
            self.inner.reset()
            return
        self._batches = epoch_batches(self.seed, self.epoch, len(self.dataset), self.batch_size)
        self._i = 0

    def next(self):
        if self.inner is not None:
            return self._next_wrapped()
        if self._i >= len(self._batches):
            raise StopIteration
        idx = self._batches[self._i]
        self._i += 1
        pad = self.batch_size - idx.size
        if pad:
            idx = np.concatenate([idx, self._batches[0][:pad]])
        view = view_of_epoch(self.epoch, self.views)
        t = self.targets.get(idx, view)  # first: a plain data set's items are then compared with their records
        x, y = make_views(self.dataset, idx, view, seed=self.seed, augment=self.augment)
        check_targets(t, idx, view, cache=getattr(self.targets, "base", None))
        return mx.io.DataBatch(data=[mx.nd.array(x)], label=[mx.nd.array(y.astype(np.float32)), mx.nd.array(t)],
                               pad=pad, index=idx, provide_data=self.provide_data,
                               provide_label=self.provide_label)

    # -- the user's own iterator ----------------------------------------------------------------
    def _next_wrapped(self):
        b = self.inner.next()
        if b.index is None:
            raise BadValueError(f"{type(self.inner).__name__} gives no sample indices (batch.index is None), so the "
                                f"soft targets cannot be matched to its samples: use an iterator that does "
                                f"(mx.io.ImageRecordIter_v1 over a .rec with its .idx, path_imgidx=...), or "
                                f"SoftTargetIter(dataset, ...) over a kdcache data set")
        index = np.asarray(b.index.asnumpy() if hasattr(b.index, "asnumpy") else b.index).astype(np.int64).reshape(-1)
        if index.size - (b.pad or 0) > 1 and not index.any():
            raise BadValueError(f"{type(self.inner).__name__} reports index 0 for every sample of a batch, as MXNet "
                                f"1.x's ImageRecordIter does (it never fills the index in): use "
                                f"mx.io.ImageRecordIter_v1 with the same arguments, which reports each record's index")
        if self._keys is not None:
            ks, pos = self._keys
            at = np.minimum(np.searchsorted(ks, index), ks.size - 1)
            if ks.size == 0 or not np.array_equal(ks[at], index):
                bad = index[ks[at] != index][:5].tolist() if ks.size else index[:5].tolist()
                raise BadValueError(f"the iterator gave record keys {bad}, which are not among the cache's keys: "
                                    f"the cache was built from another .idx")
            index = pos[at]
        # The indices are checked before anything is sized by them (the augmentation probe keeps one
        # value per sample up to the largest index): an index of 2e8 is a range error, not 1.6 GB.
        n = getattr(getattr(self.targets, "spec", None), "num_samples", None)
        if n is not None and index.size and (index.min() < 0 or index.max() >= n):
            raise index_error(index, n)
        t = self.targets.get(index, view_of_epoch(self.epoch, self.views))
        check_targets(t, index, view_of_epoch(self.epoch, self.views), cache=getattr(self.targets, "base", None))
        if self.augments is None:
            self._probe(b.data[0], index, b.pad or 0)
        ctx = b.data[0].context
        return mx.io.DataBatch(data=b.data, label=list(b.label or []) + [mx.nd.array(t, ctx=ctx)], pad=b.pad,
                               index=index, provide_data=self.provide_data, provide_label=self.provide_label)

    def _declared_augments(self, augments):
        if augments is not None:
            return bool(augments)
        augs = getattr(self.inner, "auglist", None)
        if augs is not None:  # mx.image.ImageIter: its augmenters say
            return any(type(a).__name__ in _RANDOM_AUGS for a in augs)
        return None

    def _probe(self, data, index, pad):
        """Notice an iterator that augments: the same sample's pixels differ between epochs (a few
        pixels per image, 8 bytes per sample, compared in the first two epochs only)."""
        if self.epoch >= 2:
            self.augments = False
            return
        n = data.shape[0] - pad
        flat = data.reshape((data.shape[0], -1))
        if self._probe_pos is None:
            self._probe_pos = mx.nd.array(np.random.default_rng(0).integers(0, flat.shape[1], _PROBES),
                                          ctx=data.context)
        w = np.random.default_rng(1).uniform(0.5, 1.5, _PROBES)
        sig = mx.nd.take(flat, self._probe_pos, axis=1).asnumpy()[:n].astype(np.float64) @ w
        idx = index[:n]
        if idx.size and idx.max() >= self._probe_sig.size:
            grown = np.full(max(int(idx.max()) + 1, 2 * self._probe_sig.size), np.nan)
            grown[:self._probe_sig.size] = self._probe_sig
            self._probe_sig = grown
        old = self._probe_sig[idx]
        differ = ~np.isnan(old) & ~np.isclose(old, sig, rtol=1e-5, atol=1e-5)
        if differ.any():
            self.augments = True
            self._probe_sig = np.empty(0)
            return self._say_augments(f"sample {int(idx[differ][0])}'s pixels differ between epochs")
        self._probe_sig[idx] = sig

    def _say_augments(self, why):
        if not self._warned:
            self._warned = True
            log.warning("the data iterator augments on its own (%s): the teacher's targets are for the images the "
                        "producer saw, not for these views; for consistent targets let kdcache augment "
                        "(--views, --augment) and turn the iterator's augmentation off", why)


class _ItemSource:
    """A gluon Dataset of (image [C, H, W], label) items seen as a kdcache data set: batches stacked
    from its items, the class count the cache's. The cache must have been built from the same items
    (`kdcache cache --dataset MODULE:FUNCTION` builds one from them): the length is checked, and each
    item against the cache's record of it the first time it is read (trainer.itemcheck NOTE [item check])."""

    def __init__(self, items, targets):
        if not (hasattr(items, "__getitem__") and hasattr(items, "__len__")):
            raise BadTypeError(f"SoftTargetIter takes a data set (a gluon Dataset of (image, label) items, or a "
                               f"kdcache data set) or an mx.io.DataIter whose batches carry `index`; got "
                               f"{type(items).__name__}")
        spec = getattr(targets, "spec", None)
        if spec is None:
            raise BadTypeError("SoftTargetIter over a gluon Dataset needs `targets` with a .spec (a CacheReader): "
                               "the class count and the sample count come from the cache")
        if len(items) != spec.num_samples:
            raise BadValueError(f"the data set has {len(items)} items, the cache holds targets for {spec.num_samples} "
                                f"samples: pass the data set the cache was built from")
        self.items, self.num_classes, self.name = items, int(spec.num_classes), type(items).__name__
        self.shape = tuple(self._item(0)[0].shape)
        self.targets = targets
        self.check = None
        if callable(getattr(targets, "items", None)):
            base = getattr(targets, "base", None)
            self.check = ItemCheck(len(items), f"cache {base}" if base else "the ensemble's caches",
                                   "pass the data set the cache was built from (the same items in the same order), "
                                   "or build a cache for this one (kdcache.build_cache)")
            self.check.warn_unrecorded(targets)
            self.get_batch(np.arange(min(len(items), EAGER)))

    def _item(self, i):
        item = self.items[int(i)]
        if not isinstance(item, (tuple, list)) or len(item) < 2:
            raise BadTypeError(f"item {int(i)} of {self.name} is {type(item).__name__}, not (image, label)")
        x = item[0].asnumpy() if hasattr(item[0], "asnumpy") else np.asarray(item[0])
        y = item[1].asscalar() if hasattr(item[1], "asscalar") else item[1]
        if x.ndim != 3:
            raise BadValueError(f"item {int(i)} of {self.name}: image of shape {x.shape}, not [C, H, W] (transform "
                                f"it, e.g. with gluon.data.vision.transforms.ToTensor)")
        return x.astype(np.float32, copy=False), int(y)

    def __len__(self):
        return len(self.items)

    def get_batch(self, indices):
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        xs, ys = zip(*(self._item(i) for i in idx))
        if self.check is not None:
            todo = self.check.unchecked(idx)
            if todo.size:
                self.check.check(self.targets, idx[todo], [xs[j] for j in todo], [ys[j] for j in todo],
                                 reread=lambda i: self._item(i)[0])
        return np.stack(xs), np.asarray(ys, dtype=np.int64)


def kd_symbol(student_logits, *, temperature=DEFAULT_TEMPERATURE, alpha=DEFAULT_ALPHA, num_classes=None,
              label_name="softmax_label", soft_label_name="soft_label", label_smoothing=0.0, mixed=False):
    """A Module API training symbol: the KD loss (the same formula as trainer.loss.KDLoss) as a
    MakeLoss head, with the student's softmax as a second, gradient-free output for metrics.
    `mixed`: the iterator's labels are rows (label, partner's label, λ) (SoftTargetIter.mixes: mixup
    or cutmix views); `label_smoothing` as KDLoss's."""
    s = student_logits
    per_sample = kd_formula(mx.sym, s, mx.sym.var(soft_label_name), mx.sym.var(label_name),
                            temperature=temperature_of(temperature), alpha=alpha,
                            label_smoothing=smoothing_of(label_smoothing), mixed=bool(mixed))
    loss = mx.sym.MakeLoss(per_sample, normalization="batch", name="kd_loss")  # the batch's mean, as Gluon's trainer.step(B)
    prob = mx.sym.BlockGrad(mx.sym.softmax(s, axis=1), name="prob")
    return mx.sym.Group([loss, prob])
