"""The Module API with your own symbol and your own data iterator: SoftTargetIter wraps the
iterator and attaches the soft labels by the sample indices its batches carry.

Run (from any folder):
    kdcache teacher --epochs 5 --quiet
    kdcache cache --json --quiet
    python module_fit.py CACHE

An iterator over a RecordIO file does this too: mx.io.ImageRecordIter_v1(path_imgrec=...,
path_imgidx=...) reports each record's index (MXNet 1.x's ImageRecordIter reports 0 for all, and
SoftTargetIter refuses it). An iterator without indices (NDArrayIter) is refused in one line.
"""
import sys

import mxnet as mx
import numpy as np

from kdcache.pipeline import load_dataset
from kdcache.store import CacheReader
from kdcache.trainer import SoftTargetIter, kd_symbol


class ShuffledIter(mx.io.DataIter):
    """Your own iterator: shuffled batches of (data, label), each carrying its samples' indices."""

    def __init__(self, x, y, batch_size, seed=0):
        super().__init__(batch_size)
        self.x, self.y = x, y.astype(np.float32)
        self.rng = np.random.default_rng(seed)
        self.provide_data = [mx.io.DataDesc("data", (batch_size,) + x.shape[1:])]
        self.provide_label = [mx.io.DataDesc("softmax_label", (batch_size,))]
        self.reset()

    def reset(self):
        self.order, self.at = self.rng.permutation(len(self.x)), 0

    def next(self):
        if self.at >= len(self.order):
            raise StopIteration
        idx = self.order[self.at:self.at + self.batch_size]
        self.at += self.batch_size
        pad = self.batch_size - len(idx)
        idx = np.concatenate([idx, self.order[:pad]])  # a full batch; `pad` says how many repeat
        return mx.io.DataBatch([mx.nd.array(self.x[idx])], [mx.nd.array(self.y[idx])], pad=pad, index=idx)


def main(cache, epochs=10):
    train, test = load_dataset("digits"), load_dataset("digits", split="test")
    x, y = train.get_batch(np.arange(len(train)))
    it = SoftTargetIter(ShuffledIter(x, y, batch_size=64), CacheReader(cache))
    data = mx.sym.var("data")
    hidden = mx.sym.relu(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=64))
    logits = mx.sym.FullyConnected(hidden, num_hidden=10, name="logits")
    mod = mx.mod.Module(kd_symbol(logits, temperature=4.0, alpha=0.7), data_names=["data"],
                        label_names=["softmax_label", "soft_label"])
    mod.fit(it, num_epoch=epochs, optimizer="adam", optimizer_params={"learning_rate": 5e-3})
    x_test, y_test = test.get_batch(np.arange(len(test)))
    prob = mod.predict(mx.io.NDArrayIter(x_test, batch_size=64))[1]  # outputs: the KD loss, the softmax
    print(f"student test accuracy {(prob.asnumpy().argmax(axis=1) == y_test).mean():.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
