"""The sampled:K codec: K draws from the teacher's distribution (T = 1), stored as classes and counts; an
unbiased estimate, the same rows whatever the batch order or sharding, 3K bytes a row, through the store."""
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.store import CacheReader, CacheSpec, make_codec
from kdcache.store.format import schema
from kdcache.store.format.codec import SAMPLED_FLOOR
from kdcache.store.errors import DamagedRowsError
from kdcache.store.folder.registry import final_path
from tests.helpers import CHILD_ENV, ROOT, expected_logits, make_spec, produce


def softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - x.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


def test_fields_bytes_and_spec():
    c = make_codec(" Sampled:16", 1000)
    assert c.spec == "sampled:16" and c.name == "sampled" and c.version == 1
    assert c.bytes_per_row == 16 * 2 + 16  # uint16 classes, uint8 counts: 3K bytes
    assert make_codec("sampled:300", 10).bytes_per_row == 300 * 4
    with pytest.raises(Exception, match="sampled:16"):
        make_codec("sampled:x", 10)
    with pytest.raises(Exception, match="float32 does not apply"):  # the same bytes under a second name
        make_codec("sampled:4", 10, dtype="float32")


def test_the_estimate_is_unbiased():
    """The mean over many cache seeds of the rebuilt distribution converges to the teacher's p, within
    5 standard errors for every class (also the small ones a top-k drops)."""
    x = expected_logits(np.arange(6), 20, scale=2.0)
    p = softmax(x)
    k, n = 4, 3000
    total = np.zeros_like(p)
    for seed in range(n):
        codec = make_codec("sampled:4", 20, seed=seed)
        q = codec.probabilities(codec.encode(x, keys=np.arange(6)))
        assert np.allclose(q.sum(axis=1), 1.0)
        total += q
    se = np.sqrt(p * (1 - p) / (k * n))
    err = np.abs(total / n - p)
    assert (err <= 5 * se + 1e-12).all(), (err / (se + 1e-30)).max()
    assert (total / n)[p < 0.05].sum() > 0  # the tail is drawn too


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2 ** 32), st.integers(1, 64), st.integers(2, 300))
def test_same_rows_whatever_the_batch(seed, k, c):
    """A row depends on its key and the cache's seed only: split into other batches, or in another order, it
    is stored the same; counts sum to K and name distinct classes."""
    keys = np.arange(40) * 7 + 3
    x = expected_logits(keys, c)
    codec = make_codec(f"sampled:{k}", c, seed=seed)
    whole = codec.encode(x, keys=keys)
    perm = np.random.default_rng(seed).permutation(keys.size)
    parts = [codec.encode(x[perm[a:a + 9]], keys=keys[perm[a:a + 9]]) for a in range(0, keys.size, 9)]
    for name in whole:
        again = np.empty_like(whole[name])
        again[perm] = np.concatenate([p[name] for p in parts])
        assert np.array_equal(again, whole[name])
    cnt = whole[schema.SAMPLED_COUNTS].astype(int)
    assert (cnt.sum(axis=1) == k).all()
    idx = whole[schema.SAMPLED_INDICES].astype(int)
    for row_i, row_c in zip(idx, cnt):
        used = row_i[row_c > 0]
        assert len(set(used.tolist())) == used.size and (used < c).all()


def test_decode_gives_log_estimate_and_a_finite_floor():
    codec = make_codec("sampled:8", 5)
    fields = {schema.SAMPLED_INDICES: np.array([[4, 1, 0, 0, 0, 0, 0, 0]], dtype=np.uint16),
              schema.SAMPLED_COUNTS: np.array([[6, 2, 0, 0, 0, 0, 0, 0]], dtype=np.uint8)}
    got = codec.decode(fields)
    want = np.array([[SAMPLED_FLOOR, np.log(2 / 8), SAMPLED_FLOOR, SAMPLED_FLOOR, np.log(6 / 8)]], np.float32)
    assert np.allclose(got, want) and np.isfinite(got).all()
    assert np.allclose(softmax(got), [[0, 0.25, 0, 0, 0.75]])  # at T = 1 the loss's target is the estimate


def test_damaged_rows_are_named():
    codec = make_codec("sampled:4", 5)
    fields = {schema.SAMPLED_INDICES: np.array([[1, 0, 0, 0], [9, 0, 0, 0]], dtype=np.uint16),
              schema.SAMPLED_COUNTS: np.array([[4, 0, 0, 0], [4, 0, 0, 0]], dtype=np.uint8)}
    with pytest.raises(DamagedRowsError) as e:
        codec.decode(fields)
    assert e.value.rows.tolist() == [1]
    fields[schema.SAMPLED_INDICES][1, 0] = 2
    fields[schema.SAMPLED_COUNTS][0, 0] = 3  # the counts no longer sum to K
    with pytest.raises(DamagedRowsError):
        codec.decode(fields)


def test_a_rebuild_is_identical_whatever_the_order_or_sharding(tmp_path):
    """Two caches of the same inputs, one written by one producer in one shuffled order, one by three
    shards in other orders and batch sizes, hold the same bytes; a cache with another seed differs."""
    spec = make_spec(num_samples=300, num_classes=50, views=2, codec="sampled:12", dtype="float16")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    assert produce(a, spec, seed=1, batch=64)
    done = [produce(b, spec, shard=(i, 3), seed=10 + i, batch=7 + i) for i in range(3)]
    assert done[-1]
    with h5py.File(final_path(a), "r") as fa, h5py.File(final_path(b), "r") as fb:
        for name, _, _ in spec.make_codec().fields:
            assert np.array_equal(fa[name][...], fb[name][...])
    other = CacheSpec(num_samples=300, num_classes=50, views=2, codec="sampled:12", dtype="float16",
                      inputs={**spec.inputs, "augment_seed": 5})
    assert other.draw_seed == 5 and spec.draw_seed == 0 and other.fingerprint != spec.fingerprint
    c = str(tmp_path / "c")
    assert produce(c, other, seed=1)
    with h5py.File(final_path(a), "r") as fa, h5py.File(final_path(c), "r") as fc:
        assert not np.array_equal(fa[schema.SAMPLED_INDICES][...], fc[schema.SAMPLED_INDICES][...])
    with CacheReader(a, spec=spec) as r:
        got = r.get(np.arange(300), views=1)
    keys = np.arange(300) * 2 + 1
    codec = spec.make_codec()
    assert np.array_equal(got, codec.decode(codec.encode(expected_logits(keys, 50), keys=keys)))
    assert np.allclose(softmax(got).sum(axis=1), 1.0)


def test_the_command_line_takes_the_codec(tmp_path):
    from kdcache.pipeline.options import Codec
    from tests.helpers import gluon_teacher
    gluon_teacher(str(tmp_path / "teacher"))
    assert Codec()("SAMPLED:16") == "sampled:16"
    proc = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--codec", "sampled:0"], cwd=ROOT,
                          env=CHILD_ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "sampled:K" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--codec", "sampled:4", "--dtype", "float32",
                           "--teacher", str(tmp_path / "teacher")], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "argument --dtype" in lines[0], proc.stderr


def test_kdcache_convert_encodes_it_from_full_logits(tmp_path):
    """A full float32 cache converted to sampled:8 holds the rows a producer writing sampled:8 from the same
    teacher writes: the conversion goes through the codec's own encode, keyed the same way."""
    from kdcache.store.derive.convert import convert
    full = make_spec(num_samples=120, num_classes=30, codec="full", dtype="float32")
    assert produce(str(tmp_path / "full"), full, seed=3)
    out = convert(str(tmp_path / "full"), "sampled:8", "float16", cache_dir=str(tmp_path / "conv"))
    direct = CacheSpec(num_samples=120, num_classes=30, codec="sampled:8", dtype="float16", inputs=full.inputs)
    assert produce(str(tmp_path / "direct"), direct, seed=4)
    with h5py.File(out["cache_path"], "r") as fa, h5py.File(final_path(str(tmp_path / "direct")), "r") as fb:
        for name in (schema.SAMPLED_INDICES, schema.SAMPLED_COUNTS):
            assert np.array_equal(fa[name][...], fb[name][...])


def test_the_students_calibration_error():
    """The trainer's test_ece (the codec table's calibration column): 15 equal bins of the softmax's confidence,
    |accuracy - confidence| weighted by the items in each."""
    import mxnet as mx
    from kdcache.trainer.train import expected_calibration_error

    class Items:
        def __init__(self, y):
            self.y = np.asarray(y)

        def __len__(self):
            return len(self.y)

        def get_batch(self, idx):
            return np.asarray(idx, dtype=np.float32)[:, None], self.y[idx]

    # confidence 0.9 on class 0 for every item: 6 of 10 right -> |0.6 - 0.9| = 0.3
    logit = float(np.log(0.9 / (0.1 / 3)))
    net = lambda x: mx.nd.array(np.tile([logit, 0.0, 0.0, 0.0], (x.shape[0], 1)))  # noqa: E731
    y = [0] * 6 + [1] * 4
    assert abs(expected_calibration_error(net, Items(y), [mx.cpu()], batch_size=3) - 0.3) < 1e-6
    y = [0] * 9 + [1]  # right as often as it is confident: 0
    assert expected_calibration_error(net, Items(y), [mx.cpu()]) < 1e-6


def test_kdcache_cache_and_verify_teacher_with_sampled(tmp_path):
    """The producer writes a sampled:8 cache of a real teacher, with 2 views; verify --teacher draws every key
    again from the teacher's logits and finds the stored rows; a changed count is named."""
    import json
    from tests.helpers import gluon_teacher
    gluon_teacher(str(tmp_path / "teacher"), scale=4.0)

    def kdcache(*argv):
        return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                              env=CHILD_ENV, cwd=tmp_path, timeout=300)
    r = kdcache("cache", "--teacher", "teacher", "--codec", "sampled:8", "--views", "2", "--seed", "4",
                "--cache-dir", "caches", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    path = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    r = kdcache("verify", path, "--teacher", "teacher", "--sample", "all", "--quiet", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    t = json.loads(r.stdout)["teacher_check"]
    assert t["match"] and t["codec"] == "sampled:8" and t["keys_checked"] == 1438 * 2
    assert "drawn again" in t["tolerance_rule"]
    from kdcache.cache_builder.teacher_check import compare_rows
    codec = make_codec("sampled:8", 10, seed=4)
    fresh = expected_logits(np.arange(30), 10)
    stored = codec.encode(fresh, keys=np.arange(30))
    assert compare_rows(stored, fresh, "sampled", "float16", keys=np.arange(30), sampler=codec)[-1].all()
    stored[schema.SAMPLED_COUNTS][7, 0] += 1
    stored[schema.SAMPLED_COUNTS][7, 1 if stored[schema.SAMPLED_COUNTS][7, 1] else 0] -= 1
    ok = compare_rows(stored, fresh, "sampled", "float16", keys=np.arange(30), sampler=codec)[-1]
    assert ok.tolist() == [i != 7 for i in range(30)]
