"""Demand: a reader's waiting and announced keys reach the producer, which serves them first; the
files are kdcache's own (gc and compaction remove them), stale or malformed ones are ignored."""
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.store import CacheReader, CacheWriter, path_for
from kdcache.store.format import schema
from kdcache.store.read.demand import Demand, demand_path, publish, withdraw
from kdcache.store.files.paths import OWN_PART
from kdcache.store.folder.registry import final_path, parts_path
from kdcache.store.files.segment import list_segments
from tests.helpers import make_spec


class FakeTeacher:
    forwards = 0

    def forward(self, x):
        FakeTeacher.forwards += len(x)
        return np.tile(np.arange(10, dtype=np.float32), (len(x), 1)) + x.reshape(len(x), -1)[:, :1]


def written_order(parts):
    keys = []
    for seg in list_segments(parts):
        with h5py.File(seg, "r", swmr=True) as f:
            n = int(f[schema.SEG_STATE][0])
            keys += f[schema.SEG_KEYS][:n].tolist()
    return keys


@given(done=st.lists(st.booleans(), min_size=40, max_size=40), wait=st.lists(st.integers(0, 39), max_size=10),
       nxt=st.permutations(list(range(40))), n=st.integers(1, 50))
@settings(max_examples=120, deadline=None)
def test_take_serves_waiting_then_announced_keys_never_done_ones(tmp_path_factory, done, wait, nxt, n):
    parts = str(tmp_path_factory.mktemp("p"))
    done = np.array(done)
    publish(parts, "wait", wait)
    publish(parts, "next", nxt)
    d = Demand(parts, 40)
    assert d.poll()
    got = d.take(lambda k: done[k], n)
    owed_wait = list(dict.fromkeys(k for k in wait if not done[k]))
    owed_next = [k for k in nxt if not done[k] and k not in owed_wait]
    assert got.tolist() == (owed_wait + owed_next)[:n]
    withdraw(parts)
    assert not d.poll()


def test_stale_malformed_and_foreign_demand_files_are_ignored(tmp_path):
    parts = str(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    np.save(demand_path(parts, "next", dead), np.array([1, 5, 6], dtype=np.int64))  # its process is gone
    with open(demand_path(parts, "wait", os.getppid()), "wb") as fh:
        fh.write(b"\x93NUMPY garbage")
    np.save(os.path.join(parts, f"demand-{os.getpid()}-next.npy"), np.array([1, 99], dtype=np.int64))  # out of range
    d = Demand(parts, 10)
    assert not d.poll() and d.take(lambda k: np.zeros(len(k), bool), 5).size == 0
    for kind in ("wait", "next"):
        assert OWN_PART.match(os.path.basename(demand_path(parts, kind)))
        assert OWN_PART.match(os.path.basename(demand_path(parts, kind)) + ".tmp-77")


def test_the_producer_writes_what_a_reader_announces_first_and_compacts(tmp_path):
    from kdcache.cache_builder.produce import produce_offline
    from kdcache.pipeline import Augment, load_dataset
    from kdcache.pipeline.cachespec import build_spec
    data = load_dataset("synthetic:n=300,classes=10,shape=1x4x4")
    spec = build_spec({"name": "fake"}, data, codec="full", dtype="float32")
    base = path_for(str(tmp_path), spec.fingerprint)
    w = CacheWriter(base, spec)
    w.write(np.arange(32), FakeTeacher().forward(data.get_batch(np.arange(32))[0]))  # some rows exist already
    r = CacheReader(base, spec=spec)
    order = np.random.default_rng(1).permutation(300)
    assert r.announce(order)
    assert os.path.exists(demand_path(parts_path(base), "next"))
    stats = produce_offline(FakeTeacher(), data, w, seed=0, augment=Augment(), batch_size=25, progress=False)
    written = written_order(parts_path(base))[32:]
    want = [k for k in order.tolist() if k >= 32]  # the announced order, what was done skipped
    for a in range(0, len(want), 25):  # batch by batch (a batch is committed in key order)
        assert sorted(written[a:a + 25]) == sorted(want[a:a + 25])
    assert stats.demand_rows == 300 - 32
    r.close()
    assert not os.path.exists(demand_path(parts_path(base), "next"))
    assert w.close() and os.path.exists(final_path(base)) and not os.path.exists(parts_path(base))
    with CacheReader(base, spec=spec) as r2:
        x, _ = data.get_batch(np.arange(300))
        assert np.array_equal(r2.get(np.arange(300)), FakeTeacher().forward(x))


def test_a_waiting_reader_is_served_before_key_order(tmp_path):
    """A reader waits for the last key; a producer started afterwards writes it in its first batch."""
    spec = make_spec(num_samples=2000, num_classes=10)
    base = path_for(str(tmp_path), spec.fingerprint)
    w = CacheWriter(base, spec)
    w.write(np.array([0]), np.zeros((1, 10), np.float32))
    w.close()
    r = CacheReader(base, spec=spec, timeout=0.3, heartbeat_timeout=0.2)
    with pytest.raises(Exception):
        r.get(np.array([1999, 1500]))  # no producer: it fails, having published what it waits for
    d = Demand(parts_path(base), spec.num_keys)
    assert d.poll() and d.take(lambda k: np.zeros(len(k), bool), 8).tolist() == [1999, 1500]
    r.close()
    assert not Demand(parts_path(base), spec.num_keys).poll()


@pytest.mark.parametrize("announce", [False, True])
def test_a_dataset_that_waits_without_its_order_says_once_how_to_announce_it(tmp_path, announce):
    import threading
    import warnings

    from kdcache.pipeline import load_dataset
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.trainer import SoftTargetDataset
    data = load_dataset("synthetic:n=60,classes=10,shape=1x4x4")
    spec = build_spec({"name": "fake"}, data, codec="full", dtype="float32")
    base = path_for(str(tmp_path), spec.fingerprint)
    w = CacheWriter(base, spec)
    w.write(np.arange(30), FakeTeacher().forward(data.get_batch(np.arange(30))[0]))
    ds = SoftTargetDataset(data, base, heartbeat_timeout=5.0)
    if announce:
        order = list(ds.sampler())  # what a DataLoader's sampler does at each epoch
        assert sorted(order) == list(range(60))
    late = threading.Timer(0.3, lambda: w.write(np.arange(30, 60),
                                                FakeTeacher().forward(data.get_batch(np.arange(30, 60))[0])))
    late.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        items = [ds[5]]  # written: no wait, no hint
        assert ds.reader().waits == 0 and not caught
        items += [ds[i] for i in (45, 50, 59)]  # 45 is not written yet: the reader waits
    late.join()
    assert ds.reader().waits == 1
    x, _ = data.get_batch(np.array([5, 45, 50, 59]))
    assert np.array_equal(np.stack([it[2] for it in items]), FakeTeacher().forward(x))
    hints = [c for c in caught if "sampler=ds.sampler()" in str(c.message)]
    assert len(hints) == (0 if announce else 1), [str(c.message) for c in caught]  # once, and only without order
    ds.reader().close()
    w.close()
