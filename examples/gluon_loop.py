"""Your own Gluon training loop on kdcache soft targets: SoftTargetDataset over your data set, in a
DataLoader with worker processes, each item's target the teacher's logits for that item's view.

Run (from any folder):
    kdcache teacher --epochs 5 --quiet
    kdcache cache --views 2 --json --quiet
    python gluon_loop.py CACHE

`kdcache teacher` trains a digits teacher into teachers/ (or bring your own checkpoint with
--teacher); `kdcache cache --views 2` stores its logits for 2 augmented views of every digit (crop:1,
digits' usual augmentation) and prints the cache's path, CACHE.
"""
import sys

import mxnet as mx
import numpy as np
from mxnet import autograd, gluon

from kdcache.pipeline import load_dataset
from kdcache.trainer import SoftTargetDataset
from kdcache.trainer.loss import KDLoss


def student(classes):
    net = gluon.nn.HybridSequential(prefix="student_")
    with net.name_scope():
        net.add(gluon.nn.Dense(128, activation="relu"), gluon.nn.Dense(classes))
    return net


def main(cache, epochs=10):
    train, test = load_dataset("digits"), load_dataset("digits", split="test")
    # the same seed, views and augmentation the cache was built with (it refuses others)
    data = SoftTargetDataset(train, cache, seed=0, views=2, augment="crop:1")
    loader = gluon.data.DataLoader(data, batch_size=64, shuffle=True, num_workers=2, last_batch="keep")
    ctx = mx.gpu() if mx.context.num_gpus() else mx.cpu()
    net = student(data.num_classes)
    net.initialize(mx.init.Xavier(), ctx=ctx)
    net.hybridize()
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 5e-3})
    kd = KDLoss(temperature=4.0, alpha=0.7)
    for epoch in range(epochs):
        data.set_epoch(epoch)  # items are view epoch mod 2: reaches the workers already running
        for batch in loader:  # workers hand over shared-memory arrays: move them to the device
            x, y, soft = (a.as_in_context(ctx) for a in batch)
            with autograd.record():
                loss = kd(net(x), soft, y)
            loss.backward()
            trainer.step(x.shape[0])
    x, y = test.get_batch(np.arange(len(test)))
    accuracy = (net(mx.nd.array(x, ctx=ctx)).asnumpy().argmax(axis=1) == y).mean()
    print(f"student test accuracy {accuracy:.3f}")


if __name__ == "__main__":
    main(sys.argv[1])
