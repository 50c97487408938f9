"""Read-time ensembles: several teachers' caches of the same data combined per key (mean of logits, or of
probabilities at each member's temperature), whatever their codecs; a member of other data refused in one
line; the trainer's data sets and `kdcache train --ensemble` take it and record its identity."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdcache.store import CacheReader, CacheSpec, CacheWriter, StoreError
from kdcache.store.derive.ensemble import EnsembleReader, Member, parse_members
from tests.helpers import CHILD_ENV, ROOT, expected_logits

N, C = 200, 12
TEACHERS = {  # each member's exact logits by flat key: three different teachers
    "a": lambda k: expected_logits(k, C, scale=6.0),
    "b": lambda k: expected_logits(3 * k + 1, C, scale=3.0),
    "c": lambda k: -expected_logits(k + 7, C, scale=4.0),
}


def build(tmp_path, teacher, codec="full", dtype="float32", views=1, num_samples=N, dataset="synthetic", seed=None):
    inputs = {"teacher": {"name": teacher}, "dataset": {"name": dataset, "length": num_samples},
              "augment": "crop:1" if seed is not None else None, "augment_seed": seed}
    spec = CacheSpec(num_samples=num_samples, num_classes=C, views=views, codec=codec, dtype=dtype, inputs=inputs)
    path = str(tmp_path / f"{teacher}-{codec.replace(':', '')}-{dtype}-{views}-{num_samples}-{dataset}-{seed}")
    with CacheWriter(path, spec) as w:
        keys = np.random.default_rng(0).permutation(spec.num_keys)
        for a in range(0, keys.size, 64):
            k = keys[a:a + 64]
            w.write(k // views, TEACHERS[teacher](k), views=k % views)
    return path


def log_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    z = x - x.max(axis=1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=1, keepdims=True))


def topk_rebuilt(x, k):
    """numpy's top-k with the tail's mass spread evenly over the other classes (what topk:K keeps)."""
    x = np.asarray(x, dtype=np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    idx = np.argsort(-x, axis=1)[:, :k]
    top = np.take_along_axis(x, idx, 1)
    tail = np.log1p(-np.exp(top - lse[:, None]).sum(1).clip(max=1 - 1e-16))
    out = np.repeat((lse + tail - np.log(x.shape[1] - k))[:, None], x.shape[1], 1)
    np.put_along_axis(out, idx, top, 1)
    return out


def test_mean_of_logits_across_codecs(tmp_path):
    """full float32 + int8 + topk:4 members, weights 2:1:1: numpy's weighted mean of the exact logits (the top-k
    member as numpy rebuilds it), within each codec's rounding: float32 exact, int8 half a step, float16 top values."""
    paths = [build(tmp_path, "a"), build(tmp_path, "b", codec="int8", dtype="float16"),
             build(tmp_path, "c", codec="topk:4", dtype="float16")]
    keys = np.arange(N)
    xa, xb, xc = (TEACHERS[t](keys) for t in "abc")
    want = 0.5 * xa + 0.25 * xb + 0.25 * topk_rebuilt(xc, 4)
    with EnsembleReader(f"{paths[0]}:2,{paths[1]},{paths[2]}:1") as ens:
        got = ens.get(keys)
        assert got.shape == (N, C) and got.dtype == np.float32
        step = (xb.max(1) - xb.min(1)) / 255
        bound = 0.25 * step / 2 + 0.25 * np.abs(xc).max(1) * 2.0 ** -11 + 1e-5
        err = np.abs(got - want).max(1)
        assert (err <= bound).all(), (err - bound).max()
        ident = ens.identity()
        assert ident["rule"] == "logits" and [m["weight"] for m in ident["members"]] == [0.5, 0.25, 0.25]
        assert [m["codec"] for m in ident["members"]] == ["full", "int8", "topk:4"]
        with CacheReader(paths[1]) as r:
            assert ident["members"][1]["fingerprint"] == r.fingerprint
        fp = ens.fingerprint
    with EnsembleReader(paths, weights=[1, 1, 1]) as other:
        assert other.fingerprint != fp  # other weights: another combination
        assert np.allclose(other.get(keys[:5]), (xa[:5] + xb[:5] + topk_rebuilt(xc[:5], 4)) / 3, atol=0.05)


def test_mean_of_probabilities_at_each_members_temperature(tmp_path):
    pa, pb = build(tmp_path, "a", views=2), build(tmp_path, "b", views=2)
    idx, views = np.arange(N), np.arange(N) % 2
    keys = idx * 2 + views
    with EnsembleReader([Member(pa, 1.0, 4.0), Member(pb, 3.0, 1.0)], rule="probs") as ens:
        got = ens.get(idx, views)
    want = np.log(0.25 * np.exp(log_softmax(TEACHERS["a"](keys) / 4)) + 0.75 * np.exp(log_softmax(TEACHERS["b"](keys))))
    assert np.allclose(got, want, atol=1e-5)
    assert np.allclose(np.exp(got).sum(1), 1.0, atol=1e-5)  # log-probabilities: a softmax leaves them as they are


def test_a_sampled_member_combines_by_probabilities(tmp_path):
    pa, pb = build(tmp_path, "a"), build(tmp_path, "b", codec="sampled:2000", dtype="float16")
    keys = np.arange(N)
    with pytest.raises(StoreError, match="rule probs"):
        EnsembleReader([pa, pb])
    with EnsembleReader([pa, pb], rule="probs") as ens:
        got = np.exp(ens.get(keys))
    want = 0.5 * np.exp(log_softmax(TEACHERS["a"](keys))) + 0.5 * np.exp(log_softmax(TEACHERS["b"](keys)))
    assert np.abs(got - want).max() < 0.05  # 2000 draws: the estimate's error is ~0.01


@pytest.mark.parametrize("other,word", [({"views": 2}, "views"), ({"num_samples": N + 1}, "sample count"),
                                        ({"dataset": "other"}, "data set identity"),
                                        ({"seed": 3}, "augmentation")])
def test_a_member_of_other_data_is_refused_naming_the_difference(tmp_path, other, word):
    pa, pb = build(tmp_path, "a"), build(tmp_path, "b", **other)
    with pytest.raises(StoreError) as e:
        EnsembleReader([pa, pb])
    msg = str(e.value)
    assert "\n" not in msg and word in msg and pb in msg and pa in msg


def test_parsing_members():
    assert parse_members("x,y:2,z:0.5:4") == (Member("x"), Member("y", 2.0), Member("z", 0.5, 4.0))
    assert parse_members("a:b/c,d") == (Member("a:b/c"), Member("d"))
    for bad, word in (("x", "two or more"), ("x,,y", "empty"), ("x:-1,y", "positive"), ("x:0,y", "positive")):
        with pytest.raises(StoreError, match=word):
            parse_members(bad)
    from kdcache.trainer.options import Ensemble
    assert Ensemble().format(parse_members("x,y:2,z:0.5:4")) == "x,y:2,z:0.5:4"


def test_the_data_set_and_the_iterator_take_an_ensemble(tmp_path):
    """SoftTargetDataset (also in worker processes, which open the ensemble anew) and SoftTargetIter serve the
    combined targets."""
    from mxnet import gluon
    from kdcache.trainer import SoftTargetDataset, SoftTargetIter
    pa, pb = build(tmp_path, "a"), build(tmp_path, "b", codec="topk:3", dtype="float16")
    images = np.random.default_rng(0).random((N, 1, 4, 4)).astype(np.float32)
    labels = np.arange(N) % C
    base = gluon.data.ArrayDataset(images, labels)
    with EnsembleReader([pa, pb], rule="probs") as ens:
        want = ens.get(np.arange(N))
        ds = SoftTargetDataset(base, ens)
        assert np.array_equal(ds[7][2], want[7])
        loader = gluon.data.DataLoader(ds, batch_size=50, num_workers=2)
        got = np.concatenate([b[2].asnumpy() for b in loader])
        assert np.array_equal(got, want)
        it = SoftTargetIter(base, ens, batch_size=50)
        batch = next(iter(it))
        soft = batch.label[1].asnumpy()
        assert soft.shape == (50, C) and np.array_equal(soft, want[np.asarray(batch.index)])
    with pytest.raises(StoreError, match="samples"):
        SoftTargetDataset(gluon.data.ArrayDataset(images[:10], labels[:10]), EnsembleReader([pa, pb]))


def kdcache(*args, cwd, timeout=600):
    return subprocess.run([os.path.join(os.path.dirname(sys.executable), "kdcache"), *map(str, args)], cwd=cwd,
                          env=CHILD_ENV, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_kdcache_train_with_an_ensemble_of_two_teachers(tmp_path):
    """Two tiny digits teachers (seeds 1 and 2), their caches, a student from their ensemble: 0 teacher forwards,
    the combination in metrics.json; a member of other views is one line and exit 2."""
    paths = []
    for s in (1, 2):
        r = kdcache("teacher", "--dataset", "digits", "--epochs", "2", "--seed", s, "--out", f"t{s}/digits",
                    cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        r = kdcache("cache", "--teacher", f"t{s}/digits", "--cache-dir", "caches", "--quiet", "--json", cwd=tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        paths.append(json.loads(r.stdout.strip().splitlines()[-1])["cache_path"])
    r = kdcache("train", "--ensemble", f"{paths[0]}:3,{paths[1]}", "--ensemble-rule", "probs", "--epochs", "2",
                "--run", "ens", "--quiet", "--json", "-T", "4", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "runs" / "ens" / "metrics.json").read_text())
    assert m["teacher_forwards"] == 0 and m["test_acc"] > 0.5 and 0 <= m["test_ece"] < 0.5
    assert m["ensemble"]["rule"] == "probs"
    assert [x["weight"] for x in m["ensemble"]["members"]] == [0.75, 0.25]
    fps = []
    for p in paths:
        with CacheReader(os.path.join(tmp_path, p)) as rd:
            fps.append(rd.fingerprint)
    assert [x["fingerprint"] for x in m["ensemble"]["members"]] == fps
    r = kdcache("cache", "--teacher", "t2/digits", "--cache-dir", "caches", "--views", "2", "--quiet", "--json",
                cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    two_views = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    r = kdcache("train", "--ensemble", f"{paths[0]},{two_views}", "--epochs", "1", "--run", "bad", "--quiet",
                cwd=tmp_path)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "views" in r.stderr, r.stderr[-2000:]
    said = [line for line in r.stderr.strip().splitlines() if not line.startswith("[trainer")]  # its log aside
    assert len(said) == 1 and said[0].startswith("error: ensemble member"), r.stderr


@pytest.mark.slow
def test_bench_ensemble_quick(tmp_path):
    """make bench-ensemble QUICK=1: three mnist5k teachers alone and together, a student from each, the
    ensemble built with 0 teacher forwards, its tables printed."""
    from tests.helpers import run_bench
    (tmp_path / "results").mkdir()
    proc, rep = run_bench("ensemble", tmp_path, timeout=900)
    assert rep["quick"] is True and rep["settings"]["seeds"] == [0] and rep["settings"]["rule"] == "probs"
    assert set(rep["teachers"]) == {"cnn-s0", "cnn-s1", "small-s2"}
    assert all(0.5 < t["test_acc"] <= 1 and t["cache_teacher_forwards"] == 4000 for t in rep["teachers"].values())
    assert 0.5 < rep["ensemble"]["test_acc"] <= 1 and rep["ensemble"]["teacher_forwards_to_build"] == 0
    assert [m["fingerprint"] for m in rep["ensemble"]["identity"]["members"]] == \
        [t["cache_fingerprint"] for t in rep["teachers"].values()]
    assert set(rep["students"]) == {"scratch", "cnn-s0", "cnn-s1", "small-s2", "ensemble"}
    assert all(len(s["accs"]) == 1 and 0 < s["mean"] <= 1 for s in rep["students"].values())
    assert "| ensemble (probs, equal weights) |" in proc.stdout and "paired by seed" in proc.stdout.lower()


def _bench_ensemble(*args):
    return subprocess.run([sys.executable, "-m", "bench.ensemble", *args], cwd=ROOT, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)


def test_bench_ensemble_without_fashion_mnist_files_says_how_to_install_them(tmp_path):
    """--dataset fashion-mnist with no IDX files where it looks: one line naming the Debian package, exit 2,
    before anything runs or is written."""
    out = tmp_path / "report.json"
    r = _bench_ensemble("--dataset", "fashion-mnist", "--data-root", str(tmp_path / "none"), "--out", str(out))
    said = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(said) == 1, r.stderr
    assert "apt-get install dataset-fashion-mnist" in said[0] and str(tmp_path / "none") in said[0]
    assert not out.exists() and "Traceback" not in r.stderr


@pytest.mark.parametrize("args, word", [(["--data-root", "/tmp"], "only --dataset fashion-mnist"),
                                        (["--dataset", "cifar10"], "use one of mnist5k, fashion-mnist")])
def test_bench_ensemble_refuses_a_data_root_mnist5k_ignores_and_other_data_sets(args, word):
    r = _bench_ensemble(*args)
    said = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(said) == 1 and word in said[0], r.stderr


def _write_idx(path, array):
    """An IDX file of unsigned bytes, gzipped, as the Debian package dataset-fashion-mnist ships them."""
    import gzip
    import struct
    with gzip.open(path, "wb") as fh:
        fh.write(bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape))
        fh.write(np.ascontiguousarray(array, dtype=np.uint8).tobytes())


def fake_fashion_mnist(root, n_train=400, n_test=200):
    """A tiny Fashion-MNIST folder: 28x28 images whose bright 4x4 patch's place is the class, plus noise."""
    rng = np.random.default_rng(0)
    root.mkdir()
    for pre, n in (("train", n_train), ("t10k", n_test)):
        y = rng.integers(0, 10, n)
        x = rng.integers(0, 60, (n, 28, 28))
        for i, c in enumerate(y):
            r, col = 4 + 8 * (c // 4), 2 + 6 * (c % 4)
            x[i, r:r + 4, col:col + 4] = 255
        _write_idx(root / f"{pre}-images-idx3-ubyte.gz", x)
        _write_idx(root / f"{pre}-labels-idx1-ubyte.gz", y)


@pytest.mark.slow
def test_bench_ensemble_quick_on_fashion_mnist_files(tmp_path):
    """--dataset fashion-mnist reads the IDX files under --data-root (a tiny set here): every teacher, cache and
    student runs on them, and the report names the data set, under the teachers' and students' tables."""
    from tests.helpers import run_bench
    (tmp_path / "results").mkdir()
    fake_fashion_mnist(tmp_path / "fashion")
    proc, rep = run_bench("ensemble", tmp_path, "--dataset", "fashion-mnist", "--data-root", tmp_path / "fashion",
                          timeout=600)
    from bench.ensemble.run import QUICK_TEACHER_EPOCHS
    assert rep["settings"]["dataset"] == "fashion-mnist" and rep["settings"]["teacher_epochs"] == QUICK_TEACHER_EPOCHS
    assert [t["epochs"] for t in rep["teachers"].values()] == [QUICK_TEACHER_EPOCHS] * 3
    assert all(0 < t["test_acc"] <= 1 and t["cache_teacher_forwards"] == 400 for t in rep["teachers"].values())
    assert [t["arch"] for t in rep["teachers"].values()] == ["mnist_teacher", "mnist_teacher", "mlp800x2"]
    assert rep["ensemble"]["teacher_forwards_to_build"] == 0
    assert set(rep["students"]) == {"scratch", "cnn-s0", "cnn-s1", "mlp-s2", "ensemble"}
    assert all(len(s["accs"]) == 1 and 0 < s["mean"] <= 1 for s in rep["students"].values())
    assert "Teachers and their ensemble (fashion-mnist test split)" in proc.stdout
