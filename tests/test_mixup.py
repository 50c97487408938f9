"""Keyed mixup and cutmix views: the teacher's image is the student's, pixel for pixel, on every path;
partner and λ come from (seed, sample, view) alone; the hard-label term mixes the labels by λ; label
smoothing and the student's own normalisation; bad specs are one line and exit 2."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import CHILD_ENV, ROOT, gluon_teacher

ENV = CHILD_ENV
SEED = 5
SPECS = ("crop:1,flip,mixup:0.4", "crop:1,cutmix:1.0")


def digits():
    from kdcache.pipeline.datasets import load_digits
    return load_digits("train")


def run(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], env=ENV, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """A digits teacher and, per spec of SPECS, its cache of 2 mixed views (seed 5, float32), written by the
    producer with 2 decode worker processes."""
    tmp = tmp_path_factory.mktemp("mixup")
    prefix = str(tmp / "teacher")
    gluon_teacher(prefix, classes=10, seed=1)
    out = {}
    for spec in SPECS:
        r = run("cache", "--teacher", prefix, "--dataset", "digits", "--cache-dir", tmp / "caches", "--threads", 1,
                "--quiet", "--json", "--views", 2, "--augment", spec, "--seed", SEED, "--dtype", "float32",
                "--decode-workers", 2)
        assert r.returncode == 0, r.stderr[-2000:]
        out[spec] = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    return prefix, out


# --- the keys ----------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_partner_and_lambda_depend_on_the_key_alone(spec):
    from kdcache.pipeline.augment import Augment, make_views
    ds, aug = digits(), Augment.parse(spec)
    idx = np.array([3, 900, 17, 3, 1200, 42])
    views = np.array([0, 1, 1, 1, 0, 0])
    x, y = make_views(ds, idx, views, seed=SEED, augment=aug)
    assert y.shape == (6, 3) and y.dtype == np.float32
    for k in range(len(idx)):  # alone, and in another batch, in another order: the same image and labels
        xa, ya = make_views(ds, idx[k:k + 1], views[k:k + 1], seed=SEED, augment=aug)
        assert np.array_equal(xa[0], x[k]) and np.array_equal(ya[0], y[k])
    xr, yr = make_views(ds, idx[::-1], views[::-1], seed=SEED, augment=aug)
    assert np.array_equal(xr[::-1], x) and np.array_equal(yr[::-1], y)
    j, lam = aug.partners(SEED, idx, views, len(ds))
    assert np.array_equal(y[:, 0], ds.labels[idx]) and np.array_equal(y[:, 1], ds.labels[j])
    assert ((0 <= y[:, 2]) & (y[:, 2] <= 1)).all()
    assert not np.array_equal(j, aug.partners(SEED + 1, idx, views, len(ds))[0])  # another seed, other partners
    if aug.mix == "cutmix":  # λ is the exact share of pixels kept: a whole number of pixels of 64
        assert np.allclose(y[:, 2] * 64, np.round(y[:, 2] * 64))
    else:  # mixup: the image is λ times its own view plus (1 - λ) times its partner's
        own = Augment.parse("crop:1,flip")
        xi, xj = own.apply(ds.get_batch(idx)[0], SEED, idx, views), own.apply(ds.get_batch(j)[0], SEED, j, views)
        lam32 = y[:, 2][:, None, None, None]
        np.testing.assert_allclose(x, lam32 * xi + (1 - lam32) * xj, rtol=1e-6, atol=1e-6)


def test_lambda_follows_beta_alpha_alpha():
    from kdcache.pipeline.augment import Augment
    keys = np.arange(20000)
    for alpha, lo in ((0.2, 0.6), (4.0, 0.0)):
        lam = Augment.parse(f"mixup:{alpha}").partners(SEED, keys, 0, 100)[1]
        assert abs(lam.mean() - 0.5) < 0.01
        assert abs(lam.var() - 1 / (4 * (2 * alpha + 1))) < 0.01  # Beta(a, a)'s variance
        assert ((lam < 0.1) | (lam > 0.9)).mean() >= lo  # a small alpha: most λ near 0 or 1


def test_evaluation_never_mixes():
    from kdcache.pipeline.augment import Augment, eval_views
    ds = digits()
    assert eval_views(ds, Augment.parse("crop:1,mixup:0.2")) is ds
    assert Augment.parse("rrc:8,flip,cutmix:1").eval_view() == Augment.parse("center:8")
    assert Augment.parse("eval:10/8,mixup:0.2").eval_view().spec == "eval:10/8"


# --- the teacher's image is the student's ------------------------------------------------------
@pytest.mark.parametrize("spec", SPECS)
def test_the_image_the_teacher_saw_is_the_image_every_trainer_path_builds(caches, spec):
    import mxnet as mx
    from mxnet import gluon

    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.decode_workers import Decoder
    from kdcache.pipeline.schedule import schedule
    from kdcache.pipeline.teacher import Teacher
    from kdcache.store import CacheReader
    from kdcache.trainer import SoftTargetDataset, SoftTargetIter
    from kdcache.trainer.prefetch import Prefetcher
    prefix, paths = caches
    ds, aug = digits(), Augment.parse(spec)
    n = len(ds)
    for epoch in (0, 1):
        v = epoch % 2
        with Decoder(ds, seed=SEED, augment=aug, workers=2) as dec:  # the producer's decode workers
            producer = np.concatenate([np.array(dec.take(dec.submit(np.arange(a, min(n, a + 300)), v))[0])
                                       for a in range(0, n, 300)])
        ours, labels = make_views(ds, np.arange(n), v, seed=SEED, augment=aug)
        assert np.array_equal(producer, ours)
        # Gluon: SoftTargetDataset through a DataLoader with 2 worker processes
        sd = SoftTargetDataset(digits(), paths[spec], seed=SEED, views=2, augment=spec)
        assert sd.mixes
        sd.set_epoch(epoch)
        got = [(a.asnumpy(), b.asnumpy(), c.asnumpy()) for a, b, c in
               gluon.data.DataLoader(sd, batch_size=300, shuffle=False, num_workers=2, last_batch="keep")]
        assert np.array_equal(np.concatenate([g[0] for g in got]), producer)
        assert np.array_equal(np.concatenate([g[1] for g in got]), labels)
        soft = np.concatenate([g[2] for g in got])
        np.testing.assert_allclose(soft, Teacher(prefix).forward(producer), rtol=1e-4, atol=1e-4)
        # the Module API's iterator, in the schedule's order
        it = SoftTargetIter(ds, CacheReader(paths[spec]), batch_size=64, seed=SEED, views=2, augment=spec,
                            start_epoch=epoch)
        assert it.mixes and it.provide_label[0].shape == (64, 3)
        for b in it:
            idx = b.index[:64 - b.pad]
            assert np.array_equal(b.data[0].asnumpy()[:len(idx)], producer[idx])
            assert np.array_equal(b.label[0].asnumpy()[:len(idx)], labels[idx])
            assert np.allclose(b.label[1].asnumpy()[:len(idx)], soft[idx])
        # the trainer's own loop: its Prefetcher's batches
        for st, x, y, t in Prefetcher(schedule(SEED, epoch + 1, n, 64, 2, start_epoch=epoch), ds, seed=SEED,
                                      augment=aug, targets=None):
            assert np.array_equal(x, producer[st.indices]) and np.array_equal(y, labels[st.indices])
    mx.nd.waitall()


# --- the fingerprint ---------------------------------------------------------------------------
class _Stub:
    num_classes = 10

    def __len__(self):
        return 1437

    def identity(self):
        return {"name": "stub", "split": "train", "length": 1437, "digest": "0" * 64}


def fingerprint(spec, views=2):
    from kdcache.pipeline.augment import Augment
    from kdcache.pipeline.cachespec import build_spec
    return build_spec("teacher-id", _Stub(), views=views, augment=Augment.parse(spec), seed=5).fingerprint


def test_the_fingerprint_names_the_mixing_and_specs_without_it_keep_theirs():
    # the fingerprints these inputs had before mixing existed: caches built then stay valid
    before = {"crop:4,flip": "e91819b509a2cc019d8b", "crop:1": "9a0847dd5521f3f5715c", "flip": "fa60dadc2fad626b23b1",
              "rrc:224,flip": "b55ff1fc776df0e19758", "rrc:224,scale=0.35-1,flip": "5d2ff7d35082c6610315"}
    assert {s: fingerprint(s) for s in before} == before
    assert fingerprint("none", 1) == "b5df3994b24f04b155ee" and fingerprint("eval:256/224", 1) == "f67ed016437a03a31f60"
    mixed = [fingerprint(s) for s in ("crop:4,flip", "crop:4,flip,mixup:0.2", "crop:4,flip,mixup:0.4",
                                      "crop:4,flip,cutmix:0.2", "mixup:0.2")]
    assert len(set(mixed)) == len(mixed)
    assert fingerprint("crop:4 , FLIP, mixup:0.20") == fingerprint("crop:4,flip,mixup:0.2")  # the canonical spec


def test_spec_parsing_and_its_canonical_form():
    from kdcache.pipeline.augment import Augment
    assert Augment.parse("rrc:224,flip,cutmix:1.0").spec == "rrc:224,flip,cutmix:1"
    assert Augment.parse("mixup:0.2,crop:4,flip").spec == "crop:4,flip,mixup:0.2"
    a = Augment.parse("crop:4,flip,mixup:0.2")
    assert (a.mix, a.mix_alpha, a.unmixed) == ("mixup", 0.2, Augment(4, True)) and a.varies and a.active
    assert Augment.parse("mixup:0.2").varies  # --views 2 with mixing alone: the views differ


BAD = {"mixup:0": "ALPHA must be a number > 0", "mixup:-1": "ALPHA must be a number > 0",
       "crop:4,mixup:abc": "ALPHA must be a number > 0", "cutmix:inf": "ALPHA must be a number > 0",
       "crop:4,flip,mixup:0.2,cutmix:1": "one of mixup:ALPHA and cutmix:ALPHA", "crop:4,mixup": "needs its ALPHA",
       "cutmix": "needs its ALPHA"}


@pytest.mark.parametrize("spec", sorted(BAD))
def test_a_bad_mixing_spec_is_one_line_naming_cause_and_fix(spec, capsys):
    from kdcache.pipeline.augment import Augment
    from kdcache.trainer.options import parse_args
    with pytest.raises(ValueError) as e:
        Augment.parse(spec)
    assert BAD[spec] in str(e.value) and "e.g." in str(e.value)
    with pytest.raises(SystemExit) as ex:
        parse_args(["--teacher-mode", "none", "--augment", spec])
    err = capsys.readouterr().err
    assert ex.value.code == 2 and len(err.strip().splitlines()) == 1 and BAD[spec] in err


def test_a_bad_spec_on_the_command_lines_exits_2_in_one_line():
    for cmd in (["cache"], ["train", "--teacher-mode", "none"], ["teacher"]):
        r = run(*cmd, "--augment", "crop:2,mixup:0")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "mixup's ALPHA must be a number > 0" in r.stderr and "Traceback" not in r.stderr
    r = run("teacher", "--augment", "crop:1,mixup:0.2")  # the teacher's own training does not mix
    assert r.returncode == 2 and "mixing" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- the hard-label term -----------------------------------------------------------------------
def _logsm(z):
    z = z - z.max(1, keepdims=True)
    return z - np.log(np.exp(z).sum(1, keepdims=True))


def _hard(s, y, eps):
    lp = _logsm(s.astype(np.float64))
    return -(1 - eps) * lp[np.arange(len(y)), y] - eps * lp.mean(1)


@pytest.mark.parametrize("eps", [0.0, 0.1])
def test_the_hard_term_mixes_the_two_labels_by_lambda(eps):
    import mxnet as mx

    from kdcache.pipeline.augment import mixed_labels
    from kdcache.trainer import kd_symbol
    from kdcache.trainer.loss import KDLoss
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(6, 7)).astype(np.float32), rng.normal(size=(6, 7)).astype(np.float32) * 3
    yi, yj, lam = rng.integers(0, 7, 6), rng.integers(0, 7, 6), rng.uniform(size=6).astype(np.float32)
    rows = mixed_labels(yi, yj, lam)
    T, a = 4.0, 0.7
    kl = (np.exp(_logsm(t / T)) * (_logsm(t / T) - _logsm(s / T))).sum(1)
    hard = lam * _hard(s, yi, eps) + (1 - lam) * _hard(s, yj, eps)
    want = a * T * T * kl + (1 - a) * hard
    loss = KDLoss(T, a, label_smoothing=eps, mixed=True)
    np.testing.assert_allclose(loss(mx.nd.array(s), mx.nd.array(t), mx.nd.array(rows)).asnumpy(), want, rtol=1e-4)
    loss.hybridize()
    np.testing.assert_allclose(loss(mx.nd.array(s), mx.nd.array(t), mx.nd.array(rows)).asnumpy(), want, rtol=1e-4)
    np.testing.assert_allclose(KDLoss(T, 0.0, label_smoothing=eps, mixed=True)(
        mx.nd.array(s), mx.nd.array(t), mx.nd.array(rows)).asnumpy(), hard, rtol=1e-4)
    # λ = 1 is the unmixed loss of label i
    ones = mixed_labels(yi, yj, np.ones(6))
    np.testing.assert_allclose(KDLoss(T, a, label_smoothing=eps, mixed=True)(
        mx.nd.array(s), mx.nd.array(t), mx.nd.array(ones)).asnumpy(), KDLoss(T, a, label_smoothing=eps)(
        mx.nd.array(s), mx.nd.array(t), mx.nd.array(yi)).asnumpy(), rtol=1e-5)
    # the Module API's symbol: the same per-sample loss
    sym = kd_symbol(mx.sym.var("data"), temperature=T, alpha=a, label_smoothing=eps, mixed=True)
    ex = sym.bind(mx.cpu(), {"data": mx.nd.array(s), "soft_label": mx.nd.array(t),
                             "softmax_label": mx.nd.array(rows)})
    np.testing.assert_allclose(ex.forward()[0].asnumpy(), want, rtol=1e-4)


def test_label_smoothing_matches_the_smoothed_one_hot_target():
    import mxnet as mx

    from kdcache.trainer.errors import BadValueError
    from kdcache.trainer.loss import KDLoss
    rng = np.random.default_rng(1)
    s, y, eps = rng.normal(size=(5, 10)).astype(np.float32), rng.integers(0, 10, 5), 0.1
    target = np.full((5, 10), eps / 10) + (1 - eps) * np.eye(10)[y]  # GluonCV's smoothed one-hot
    want = -(target * _logsm(s.astype(np.float64))).sum(1)
    got = KDLoss(4.0, 0.0, label_smoothing=eps)(mx.nd.array(s), mx.nd.array(s), mx.nd.array(y)).asnumpy()
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for bad in (1.0, -0.1, "x"):
        with pytest.raises(BadValueError, match="label_smoothing"):
            KDLoss(label_smoothing=bad)


def test_the_student_input_is_normalised_per_channel():
    from kdcache.trainer.errors import BadValueError
    from kdcache.trainer.models import StudentInput
    x = np.random.default_rng(0).uniform(size=(2, 3, 4, 4)).astype(np.float32)
    assert StudentInput(channels=3)(x) is x
    got = StudentInput([0.5, 0.4, 0.3], [0.2], channels=3)(x)
    np.testing.assert_allclose(got, (x - np.array([0.5, 0.4, 0.3])[None, :, None, None]) / 0.2, rtol=1e-6, atol=1e-6)
    with pytest.raises(BadValueError, match="--student-mean has 2 values"):
        StudentInput([0.5, 0.4], None, channels=3)


# --- end to end --------------------------------------------------------------------------------
def test_cache_then_train_with_mixed_views_reads_every_target_from_the_cache(tmp_path):
    import mxnet as mx

    from kdcache.pipeline.datasets import load_digits
    prefix = str(tmp_path / "teacher")
    gluon_teacher(prefix, classes=10, seed=1)
    common = ["--teacher", prefix, "--cache-dir", tmp_path / "caches", "--augment", "crop:2,mixup:0.2", "--views", 2,
              "--epochs", 1, "--seed", 3, "--quiet", "--json"]
    r = run("cache", *common, "--threads", 1)
    assert r.returncode == 0, r.stderr[-2000:]
    built = json.loads(r.stdout.strip().splitlines()[-1])
    assert built["complete"] and built["teacher_forwards"] == 2 * len(load_digits("train"))
    r = run("train", *common, "--runs-dir", tmp_path / "runs", "--run", "mix", "--threads", 1, "--no-producer",
            "--label-smoothing", 0.1, "--student-mean", 0.3, "--student-std", 0.4, "--student", "small_cnn")
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["teacher_forwards"] == 0 and not m["producer_started"] and m["cache_path"] == built["cache_path"]
    m = json.load(open(tmp_path / "runs" / "mix" / "metrics.json"))
    assert np.isfinite(m["history"][0]["loss"]) and m["history"][0]["samples"] > 0
    # the test accuracy was measured on normalised images: the checkpoint takes them
    net = mx.gluon.SymbolBlock.imports(m["checkpoint"], ["data"], m["last_checkpoint"])
    test = load_digits("test")
    x, y = test.get_batch(np.arange(len(test)))
    acc = float((net(mx.nd.array((x - np.float32(0.3)) / np.float32(0.4))).asnumpy().argmax(1) == y).mean())
    assert acc == pytest.approx(m["test_acc"], abs=1.5 / len(test))
