"""SoftTargetIter: an mx.io.DataIter for the Module API with the soft target as a second label.

Each batch carries `data`, `softmax_label` (the hard labels) and `soft_label` (the teacher's
raw logits from the store, float32 [B, C]) for the keys of the training schedule, so a Module
whose symbol takes both labels trains with the KD loss and never runs the teacher.
"""
import mxnet as mx
import numpy as np

from pipeline.augment import Augment, make_views
from pipeline.schedule import epoch_batches, view_of_epoch


class SoftTargetIter(mx.io.DataIter):
    """Iterate one epoch of the schedule per reset(); `targets` is a store reader (CacheReader,
    or anything with get(indices, views)). The last partial batch is padded by wrapping around
    (`pad` tells how many), as NDArrayIter's 'pad' mode does."""

    def __init__(self, dataset, targets, *, batch_size=64, seed=0, views=1, augment=None,
                 data_name="data", label_name="softmax_label", soft_label_name="soft_label", start_epoch=0):
        super().__init__(batch_size)
        self.dataset, self.targets = dataset, targets
        self.seed, self.views = seed, views
        self.augment = augment or Augment()
        self.data_name, self.label_name, self.soft_label_name = data_name, label_name, soft_label_name
        self.num_classes = int(dataset.num_classes)
        self.epoch = start_epoch - 1
        self._batches = []
        self._i = 0
        self.reset()

    @property
    def provide_data(self):
        return [mx.io.DataDesc(self.data_name, (self.batch_size,) + tuple(self.dataset.shape), np.float32)]

    @property
    def provide_label(self):
        return [mx.io.DataDesc(self.label_name, (self.batch_size,), np.float32),
                mx.io.DataDesc(self.soft_label_name, (self.batch_size, self.num_classes), np.float32)]

    def reset(self):
        self.epoch += 1
        self._batches = epoch_batches(self.seed, self.epoch, len(self.dataset), self.batch_size)
        self._i = 0

    def next(self):
        if self._i >= len(self._batches):
            raise StopIteration
        idx = self._batches[self._i]
        self._i += 1
        pad = self.batch_size - idx.size
        if pad:
            idx = np.concatenate([idx, self._batches[0][:pad]])
        view = view_of_epoch(self.epoch, self.views)
        x, y = make_views(self.dataset, idx, view, seed=self.seed, augment=self.augment)
        t = self.targets.get(idx, view)
        return mx.io.DataBatch(data=[mx.nd.array(x)], label=[mx.nd.array(y.astype(np.float32)), mx.nd.array(t)],
                               pad=pad, index=idx, provide_data=self.provide_data,
                               provide_label=self.provide_label)


def kd_symbol(student_logits, *, temperature=20.0, alpha=0.5, num_classes=None,
              label_name="softmax_label", soft_label_name="soft_label"):
    """A Module API training symbol: the KD loss (the same formula as trainer.loss.KDLoss) as a
    MakeLoss head, with the student's softmax as a second, gradient-free output for metrics."""
    s = student_logits
    y = mx.sym.var(label_name)
    t = mx.sym.var(soft_label_name)
    ce = -mx.sym.pick(mx.sym.log_softmax(s, axis=1), y, axis=1)
    log_ps = mx.sym.log_softmax(s / temperature, axis=1)
    log_pt = mx.sym.log_softmax(t / temperature, axis=1)
    kl = mx.sym.sum(mx.sym.exp(log_pt) * (log_pt - log_ps), axis=1)
    loss = mx.sym.MakeLoss(alpha * temperature * temperature * kl + (1 - alpha) * ce, normalization="batch",
                           name="kd_loss")
    prob = mx.sym.BlockGrad(mx.sym.softmax(s, axis=1), name="prob")
    return mx.sym.Group([loss, prob])
