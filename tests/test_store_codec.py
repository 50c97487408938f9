"""The store's pure parts, no files: codecs, fingerprints, the names a cache may have, the cache spec."""
import numpy as np
import pytest

from kdcache.store import CacheSpec, StoreError, fingerprint, make_codec, path_for
from kdcache.store.format import schema
from kdcache.store.format.fingerprint import is_fingerprint
from tests.helpers import expected_logits, make_spec, reseal


def softmax(z):
    z = z - z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


# --- codecs ------------------------------------------------------------------------------
def test_full_codec_round_trip_float32_exact_and_float16_rounded():
    x = expected_logits(np.arange(64), 37)
    c32 = make_codec("full", 37, "float32")
    assert np.array_equal(c32.decode(c32.encode(x)), x)
    c16 = make_codec("full", 37, "float16")
    assert np.array_equal(c16.decode(c16.encode(x)), x.astype(np.float16).astype(np.float32))
    assert c16.bytes_per_row == 74 and c32.bytes_per_row == 148


@pytest.mark.parametrize("k", [1, 5, 20])
def test_topk_keeps_top_values_and_the_tail_mass(k):
    c = 100
    x = expected_logits(np.arange(200), c, scale=4.0)
    codec = make_codec(f"topk:{k}", c)
    assert codec.bytes_per_row <= 4 * k + 8
    enc = codec.encode(x)
    rebuilt = codec.decode(enc)
    top = np.argsort(-x, axis=1)[:, :k]
    # the K largest classes are stored exactly (to float16) at their indices
    assert np.array_equal(np.sort(enc[schema.TOPK_INDICES], axis=1), np.sort(top, axis=1))
    got = np.take_along_axis(rebuilt, top, axis=1)
    assert np.allclose(got, np.take_along_axis(x, top, axis=1), atol=2e-2)
    # the tail keeps its probability mass (top-k alone would drop it)
    p, q = softmax(x), softmax(rebuilt)
    mask = np.zeros_like(p, dtype=bool)
    np.put_along_axis(mask, top, True, axis=1)
    assert np.allclose(q.sum(axis=1), 1.0, atol=1e-5)
    assert np.allclose((q * ~mask).sum(axis=1), (p * ~mask).sum(axis=1), atol=2e-3)
    # and the rebuilt distribution is closer to the teacher's than renormalised top-k
    trunc = np.where(mask, x, -np.inf)
    kl = lambda a, b: (a * (np.log(a + 1e-30) - np.log(b + 1e-30))).sum(axis=1).mean()
    if k < 20:
        assert kl(p, q) < kl(p, softmax(trunc))


def test_topk_equal_to_classes_is_lossless_to_float16():
    x = expected_logits(np.arange(10), 6)
    codec = make_codec("topk:6", 6)
    assert np.allclose(codec.decode(codec.encode(x)), x, atol=1e-2)


@pytest.mark.parametrize("bad", ["topk", "topk:x", "topk:0", "topk:11", "gzip", "full:3"])
def test_bad_codec_names_the_fix(bad):
    with pytest.raises(StoreError, match="codec|K"):
        make_codec(bad, 10)


def test_bad_dtype():
    with pytest.raises(StoreError, match="float16"):
        make_codec("full", 10, "int8")


# --- fingerprints ------------------------------------------------------------------------
def test_fingerprint_is_canonical_and_leaves_out_defaults():
    a = fingerprint({"teacher": "x", "views": 1, "extra": None})
    assert a == fingerprint({"views": 1, "teacher": "x"})
    assert a != fingerprint({"views": 2, "teacher": "x"})
    assert is_fingerprint(a)


def test_fingerprint_changes_with_each_input():
    base = make_spec()
    fps = {base.fingerprint}
    for kw in [dict(views=2), dict(codec="topk:3"), dict(dtype="float16"), dict(num_samples=501),
               dict(num_classes=11), dict(tag="other-teacher")]:
        fps.add(make_spec(**{**dict(num_samples=500, num_classes=10, views=1, codec="full",
                                   dtype="float32", tag="test"), **kw}).fingerprint)
    assert len(fps) == 7


def test_fingerprint_refuses_live_objects():
    with pytest.raises(TypeError):
        fingerprint({"teacher": object()})


@pytest.mark.parametrize("name", ["../etc", "abc/def", "..", "", "ABCDEF0123", "x" * 20])
def test_names_that_could_escape_the_cache_dir_are_refused(cache_dir, name):
    with pytest.raises(StoreError):
        path_for(cache_dir, name)


def test_spec_validation():
    with pytest.raises(StoreError, match="positive integer"):
        CacheSpec(num_samples=0, num_classes=10)
    with pytest.raises(StoreError, match="positive integer"):
        CacheSpec(num_samples=10, num_classes=10, views=1.5)


def test_a_stored_class_index_past_the_class_count_is_named_as_damage_not_as_the_callers_indices(cache_dir):
    """A topk cache whose file was changed after it was written: its reader names the cache as damaged
    and `kdcache verify`, never the caller's sample indices; verify lists the same rows."""
    import h5py

    from kdcache.store import CacheReader, UnsupportedFormatError
    from kdcache.store.folder.verify import verify
    from tests.helpers import produce
    spec = make_spec(num_samples=40, num_classes=10, codec="topk:3", dtype="float16")
    base = path_for(cache_dir, spec.fingerprint)
    assert produce(base, spec)
    with h5py.File(base + ".h5", "r+") as f:
        f[schema.TOPK_INDICES][7, 0, 1] = 12  # sample 7, view 0, its second class
    reseal(base)  # as if written so: the codec's own check, not the checksums, must name it
    r = CacheReader(base)
    assert r.get(np.arange(7)).shape == (7, 10)  # the sound rows still read
    with pytest.raises(UnsupportedFormatError) as e:
        r.get(np.arange(5, 10))
    msg = str(e.value)
    for words in (f"cache {base}", "topk_indices holds class index 12", "damaged", "flat keys [7]",
                  f"kdcache verify {base}"):
        assert words in msg, msg
    assert "out of range" not in msg and "\n" not in msg
    r.close()
    _, problems = verify(base)
    assert any(schema.TOPK_INDICES in p for p in problems)
