"""The offline producer runs the teacher on one batch while it makes the next and writes the last:
two executors per input shape over one set of parameters, each batch's logits its own, bitwise
those of a forward at a time; batches written in the order started, no key run twice (a reader's
demand never takes the keys in the teacher), and the batch the teacher ran kept on an error."""
import numpy as np
import pytest

from kdcache.cache_builder.produce import produce_offline
from kdcache.pipeline import Augment, load_dataset
from kdcache.pipeline.cachespec import build_spec
from kdcache.pipeline.dataset_base import ArrayDataset
from kdcache.pipeline.teacher import Teacher
from kdcache.store import CacheReader, CacheWriter, path_for
from kdcache.store.registry import parts_path
from tests.helpers import gluon_teacher
from tests.test_demand import written_order


@pytest.fixture(scope="module")
def prefix(tmp_path_factory):
    p = str(tmp_path_factory.mktemp("teacher") / "t")
    gluon_teacher(p)
    return p


def test_two_batches_in_flight_each_get_their_own_logits_over_shared_parameters(prefix):
    t = Teacher(prefix, 0, mean=[0.1], std=[0.3])
    rng = np.random.default_rng(0)
    x1, x2 = (rng.uniform(0, 1, (16, 1, 8, 8)).astype(np.float32) for _ in range(2))
    a, b = t.submit(x1, 0), t.submit(x2, 1)
    out2, out1 = t.collect(b), t.collect(a)  # collected in either order
    assert out1.tobytes() == t.forward(x1).tobytes() and out2.tobytes() == t.forward(x2).tobytes()
    assert out1.tobytes() != out2.tobytes() and t.forwards == 64
    first, second = t._execs[((16, 1, 8, 8), 0)], t._execs[((16, 1, 8, 8), 1)]
    for name, arr in first.arg_dict.items():  # the parameters are one copy; the inputs are two
        assert (arr.handle.value == second.arg_dict[name].handle.value) == (name != t.input_name), name


class ForwardOnly:
    """The same teacher behind forward(x) alone: the producer runs it one batch at a time."""

    def __init__(self, teacher):
        self.teacher = teacher

    def forward(self, x):
        return self.teacher.forward(x)


class Counting:
    """A teacher with submit/collect that records every sample it runs (row 0 of the image keys it)."""

    def __init__(self):
        self.seen = []

    def submit(self, x, slot=0):
        return np.asarray(x).copy()

    def collect(self, x):
        self.seen += x.reshape(len(x), -1)[:, 0].round().astype(int).tolist()
        return np.tile(np.arange(10, dtype=np.float32), (len(x), 1)) + x.reshape(len(x), -1)[:, :1]


def keyed(n):
    """n images of 1x4x4 whose first pixel is their key (the Counting teacher reads it back)."""
    x = np.zeros((n, 1, 4, 4), np.float32)
    x[:, 0, 0, 0] = np.arange(n)
    return ArrayDataset("keyed", "train", x, np.arange(n) % 10, 10, scale=1.0)


def _cache(tmp_path, name, data):
    spec = build_spec({"name": "t"}, data, codec="full", dtype="float32")
    base = path_for(str(tmp_path / name), spec.fingerprint)
    return spec, base, CacheWriter(base, spec)


def test_the_overlapped_producer_writes_the_cache_a_forward_at_a_time_writes_in_key_order(prefix, tmp_path):
    data = load_dataset("synthetic:n=500,classes=10,shape=1x8x8")
    caches = {}
    for name, teacher in (("overlapped", Teacher(prefix, 0)), ("one_at_a_time", ForwardOnly(Teacher(prefix, 0)))):
        spec, base, w = _cache(tmp_path, name, data)
        stats = produce_offline(teacher, data, w, seed=0, augment=Augment(), batch_size=32, progress=False)
        assert stats.rows_written == stats.teacher_forwards == 500
        assert written_order(parts_path(base)) == list(range(500))
        w.close()
        with CacheReader(base, spec=spec) as r:
            caches[name] = r.get(np.arange(500))
    assert caches["overlapped"].tobytes() == caches["one_at_a_time"].tobytes()


def test_a_readers_demand_never_takes_the_keys_in_the_teacher(tmp_path):
    """A reader announces its order: the producer serves it batch by batch. The next batch is taken
    while the last is in the teacher; taken without it, every batch would be run twice."""
    n = 300
    data = keyed(n)
    spec, base, w = _cache(tmp_path, "c", data)
    r = CacheReader(base, spec=spec)
    order = np.random.default_rng(1).permutation(n)
    assert r.announce(order)
    teacher = Counting()
    stats = produce_offline(teacher, data, w, seed=0, augment=Augment(), batch_size=25, progress=False)
    assert sorted(teacher.seen) == list(range(n)), "a key ran through the teacher twice, or never"
    assert stats.demand_rows == n and stats.rows_written == n
    written = written_order(parts_path(base))
    for a in range(0, n, 25):  # the announced order, batch by batch
        assert sorted(written[a:a + 25]) == sorted(order[a:a + 25].tolist())
    r.close()
    assert w.close()
    with CacheReader(base, spec=spec) as r2:
        assert np.array_equal(r2.get(np.arange(n))[:, 1] - 1, np.arange(n, dtype=np.float32))


def test_an_error_making_the_next_batch_keeps_the_batch_the_teacher_ran(tmp_path):
    data = keyed(200)
    data.data[70, 0, 1, 1] = np.nan  # in the third batch of 32
    spec, base, w = _cache(tmp_path, "c", data)
    with pytest.raises(Exception, match="NaN or Inf"):
        produce_offline(Counting(), data, w, seed=0, augment=Augment(), batch_size=32, progress=False)
    w.abort()
    with CacheReader(base, spec=spec) as r:
        assert r.missing(np.arange(200), 0).tolist() == list(range(64, 200))  # the two batches before it
