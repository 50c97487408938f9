"""`sampled:K` through the shared-memory ring: each row's K draws are keyed by (seed, sample, view, epoch)
(kdcache.store.format.codec.stream_keys). A ring carries every epoch anew, so every epoch draws new classes and
another --seed draws others, while the same (seed, sample, view, epoch) draws the same classes whatever the
batch it was written in. Before, the draws were keyed by the sample alone: the same classes every epoch,
whatever --seed (the estimate's variance never averaged out over training)."""
import os
import secrets
import subprocess
import sys

import numpy as np
import pytest

from kdcache.store.ring import RingReader, RingWriter
from tests.helpers import CHILD_ENV

C, N = 10, 64


def spread_logits(n, c=C):
    return np.random.default_rng(7).normal(0, 0.5, (n, c)).astype(np.float32)  # mass over many classes


@pytest.fixture
def names():
    made = []

    def make():
        made.append(f"kdcache-ring-{os.getpid()}-sampled-{secrets.token_hex(4)}")
        return made[-1]
    yield make
    for n in made:
        try:
            os.unlink(os.path.join("/dev/shm", n))
        except FileNotFoundError:
            pass


def streamed(name, seed, epochs, *, views=0, batch=N, order=None):
    """The decoded rows [epoch][sample] a sampled:8 ring carries, written in `order` and batches of `batch`."""
    x = spread_logits(N)
    order = np.arange(N) if order is None else order
    with RingWriter(name, capacity=N * len(epochs), num_classes=C, codec="sampled:8", seed=seed) as w, \
            RingReader(name, timeout=10) as r:
        for e in epochs:
            for a in range(0, N, batch):
                idx = order[a:a + batch]
                w.write(idx, e, x[idx], views=views)
        return np.stack([r.get(np.arange(N), e) for e in epochs])


def differ(a, b):
    return float(np.mean([not np.array_equal(p, q) for p, q in zip(a, b)]))


def test_each_epoch_and_seed_draws_anew_and_each_key_the_same(names):
    rows = streamed(names(), seed=0, epochs=[0, 1, 2])
    assert differ(rows[0], rows[1]) > 0.9 and differ(rows[1], rows[2]) > 0.9, "epochs draw anew"
    other_seed = streamed(names(), seed=1, epochs=[0])
    assert differ(rows[0], other_seed[0]) > 0.9, "another seed draws others"
    other_view = streamed(names(), seed=0, epochs=[0], views=1)
    assert differ(rows[0], other_view[0]) > 0.9, "another view draws others"
    order = np.random.default_rng(3).permutation(N)
    again = streamed(names(), seed=0, epochs=[2, 0], batch=5, order=order)  # other batches, order, epochs
    assert np.array_equal(again[0], rows[2]) and np.array_equal(again[1], rows[0]), "a key draws the same"
    # each row is still K draws of the teacher's distribution: over the epochs the counts average towards it
    p = np.exp(spread_logits(N).astype(np.float64))
    p /= p.sum(1, keepdims=True)
    many = streamed(names(), seed=0, epochs=list(range(40)))
    mean = np.exp(many.astype(np.float64)).mean(0)
    one = np.exp(many[0].astype(np.float64))
    assert np.abs(mean - p).mean() < 0.4 * np.abs(one - p).mean()


def test_the_producer_streams_new_draws_every_epoch_and_for_every_seed(tmp_path, teacher, names):
    """The real producer (`kdcache cache --ring`): its --seed and each epoch key the draws."""
    def run(seed):
        name = names()
        proc = subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--teacher", teacher, "--dataset",
                                 "digits", "--codec", "sampled:8", "--epochs", "2", "--seed", str(seed), "--ring", name,
                                 "--ring-capacity", "4096", "--quiet"], cwd=tmp_path, env=CHILD_ENV,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            with RingReader(name, create=False, timeout=120) as r:
                n = 1438
                rows = np.stack([r.get(np.arange(n), e, timeout=120) for e in (0, 1)])
            out, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, err[-2000:]
        return rows
    a, b = run(0), run(1)
    assert differ(a[0], a[1]) > 0.3, "the same classes every epoch"
    assert differ(a[0], b[0]) > 0.3, "the same classes whatever --seed"
