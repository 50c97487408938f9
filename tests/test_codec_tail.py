"""The top-k codec keeps the tail: the rebuilt soft targets are as close to the teacher's as an ideal
top-K with an even tail (exact values, exact tail mass) at T = 1, 4 and 20, for confident teachers
too; caches written before the tail was stored are read where their tail can be rebuilt and refused
in one line where it cannot."""
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.store import CacheReader, CacheSpec, CacheWriter, path_for
from kdcache.store.format import schema
from kdcache.store.format.codec import LOGTAIL_NONE, make_codec
from kdcache.store.errors import UnsupportedFormatError
from kdcache.store.format.fingerprint import fingerprint
from tests.conftest import ROOT
from tests.helpers import seal_again

TEMPERATURES = (1, 4, 20)


def softmax(x):
    x = x - x.max(axis=1, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=1, keepdims=True)


def kd_distance(z, r, t):
    """Mean T^2 * KL(softmax(z/T) || softmax(r/T)): the KD loss's soft term between teacher and rebuilt."""
    p, q = softmax(z.astype(np.float64) / t), softmax(r.astype(np.float64) / t)
    return float(t * t * (p * (np.log(np.maximum(p, 1e-300)) - np.log(np.maximum(q, 1e-300)))).sum(axis=1).mean())


def ideal_topk(z, k):
    """Top-K from the exact float32 logits, and the exact tail mass spread evenly."""
    z = z.astype(np.float64)
    c = z.shape[1]
    idx = np.argsort(-z, axis=1, kind="stable")[:, :k]
    m = z.max(axis=1)
    lse = m + np.log(np.exp(z - m[:, None]).sum(axis=1))
    out = np.empty_like(z)
    if k < c:
        tail = z.copy()
        np.put_along_axis(tail, idx, -np.inf, axis=1)
        tm = tail.max(axis=1)
        logtail = tm + np.log(np.exp(tail - tm[:, None]).sum(axis=1)) - lse
        out[...] = (lse + logtail - np.log(c - k))[:, None]
    np.put_along_axis(out, idx, np.take_along_axis(z, idx, axis=1), axis=1)
    return out


def confident(n, c, margin, seed=0, spread=2.0):
    """Logits of a confident teacher: one class `margin` above noise of scale `spread`."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0, spread, (n, c)).astype(np.float32)
    z[np.arange(n), rng.integers(0, c, n)] += margin
    return z


def rebuilt(z, codec, k, dtype="float16", version=None):
    cod = make_codec(f"topk:{k}", z.shape[1], dtype, version)
    return cod.decode(cod.encode(z))


@pytest.mark.parametrize("c,k,margin", [(10, 3, 12), (10, 3, 20), (10, 5, 25), (1000, 5, 15), (1000, 10, 25)])
@pytest.mark.parametrize("t", TEMPERATURES)
def test_a_confident_teacher_s_tail_survives(c, k, margin, t):
    z = confident(2000, c, margin)
    got, ideal = kd_distance(z, rebuilt(z, "topk", k), t), kd_distance(z, ideal_topk(z, k), t)
    assert got <= 1.5 * ideal + 1e-9, (got, ideal)


@pytest.mark.parametrize("t", TEMPERATURES)
def test_the_codec_before_the_stored_tail_fails_this_check(t):
    """Version 1 rebuilt the tail from the rounded top values: the check above catches it."""
    z = confident(2000, 10, 20)
    got, ideal = kd_distance(z, rebuilt(z, "topk", 3, version=1), t), kd_distance(z, ideal_topk(z, 3), t)
    assert got > 10 * ideal


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(c=st.sampled_from([2, 10, 100, 1000]), k=st.integers(1, 12), margin=st.floats(0, 60),
       spread=st.floats(0.01, 8), dtype=st.sampled_from(["float16", "float32"]), seed=st.integers(0, 2**16))
def test_any_teacher_within_1_5x_of_the_ideal_and_no_tail_ever_negative(c, k, margin, spread, dtype, seed):
    k = min(k, c)
    z = confident(64, c, margin, seed, spread)
    r = rebuilt(z, "topk", k, dtype)
    assert np.isfinite(r).all()
    # Rounding the stored values (by up to d = max|z| * 2^-11 in float16) alone moves T^2 * KL by up to
    # d^2 / 2 at any T: the ideal is made from the exact logits.
    rounding = 0.5 * (float(np.abs(z).max()) * (2.0 ** -11 if dtype == "float16" else 2.0 ** -24)) ** 2
    for t in TEMPERATURES:
        got, ideal = kd_distance(z, r, t), kd_distance(z, ideal_topk(z, k), t)
        assert got <= 1.5 * ideal + rounding + 1e-9, (t, got, ideal)
    if k < c:  # the log of the tail's mass at T = 1, stored: exact to float32 however small the tail
        z64 = z.astype(np.float64)
        top = np.argsort(-z64, axis=1, kind="stable")[:, :k]
        tail = z64.copy()
        np.put_along_axis(tail, top, -np.inf, axis=1)
        tm, m = tail.max(axis=1), z64.max(axis=1)
        want = (tm + np.log(np.exp(tail - tm[:, None]).sum(axis=1))) - (m + np.log(np.exp(z64 - m[:, None]).sum(axis=1)))
        have = make_codec(f"topk:{k}", c, dtype).encode(z)[schema.TOPK_LOGTAIL].astype(np.float64)
        assert (have <= 0).all() and np.isfinite(have).all()
        assert np.allclose(have, np.maximum(want, LOGTAIL_NONE), rtol=1e-5, atol=1e-5), (have, want)


def test_bytes_per_row_and_fingerprints():
    assert make_codec("topk:5", 1000).bytes_per_row == 4 * 5 + 8
    assert make_codec("topk:5", 1000, version=1).bytes_per_row == 4 * 5 + 4
    new, old = (CacheSpec(num_samples=10, num_classes=20, codec="topk:3", codec_version=v) for v in (None, 1))
    assert new.codec_version == 2 and new.fingerprint != old.fingerprint  # never mixed, never resumed as one
    # version 1 caches keep the fingerprint they were named with (no codec_version among its inputs)
    assert old.fingerprint == fingerprint({"inputs": {}, "num_samples": 10, "views": 1, "num_classes": 20,
                                           "codec": "topk:3", "dtype": "float16"})
    full = CacheSpec(num_samples=10, num_classes=20)
    assert "codec_version" not in full.fingerprint_inputs()


def legacy_cache(cache_dir, z):
    """A finished top-k:3 cache as kdcache wrote it before the tail was stored (no codec_version)."""
    spec = CacheSpec(num_samples=len(z), num_classes=z.shape[1], codec="topk:3", codec_version=1,
                     inputs={"teacher": "legacy"})
    p = path_for(cache_dir, spec.fingerprint)
    w = CacheWriter(p, spec)
    w.write(np.arange(len(z)), z)
    w.close()
    with h5py.File(p + ".h5", "r+") as f:
        del f.attrs[schema.A_CODEC_VERSION]
    seal_again(p + ".h5")  # as that kdcache wrote it, sealed
    return p, spec


def test_an_older_cache_whose_tail_can_be_rebuilt_is_read(cache_dir):
    z = confident(200, 10, 3, spread=1.0)  # unconfident: the tail holds a few percent
    p, spec = legacy_cache(cache_dir, z)
    with CacheReader(p, spec=spec) as r:
        got = r.get(np.arange(200))
    top = np.argsort(-z, axis=1, kind="stable")[:, :3]
    assert np.allclose(np.take_along_axis(got, top, axis=1), np.take_along_axis(z, top, axis=1), atol=0.02)
    for t in TEMPERATURES:
        assert kd_distance(z, got, t) <= 1.5 * kd_distance(z, ideal_topk(z, 3), t) + 1e-6
    out = subprocess.run([sys.executable, "-m", "kdcache.store", "verify", p], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_an_older_cache_whose_tail_was_lost_is_refused_in_one_line(cache_dir):
    z = confident(200, 10, 20)
    p, spec = legacy_cache(cache_dir, z)
    with pytest.raises(UnsupportedFormatError) as ei:
        CacheReader(p, spec=spec)
    msg = str(ei.value)
    assert "\n" not in msg and "lost their tail" in msg and "rebuild" in msg and p in msg
    for cmd in (["verify", p], ["inspect", p]):
        out = subprocess.run([sys.executable, "-m", "kdcache.store", *cmd], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and "lost their tail" in out.stderr
    ls = subprocess.run([sys.executable, "-m", "kdcache.store", "--cache-dir", cache_dir, "--json", "ls"], cwd=ROOT,
                        capture_output=True, text=True)
    assert ls.returncode == 0 and '"damaged"' in ls.stdout
