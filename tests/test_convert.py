"""kdcache convert: a cache in another codec derived without the teacher, byte for byte what the teacher's
build writes where the source holds everything; refused in one line where it would invent information."""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader, CacheWriter, path_for
from kdcache.store.format import schema
from kdcache.store.derive.convert import convert, target_spec
from kdcache.store.errors import DamagedRowsError, StoreError
from tests.helpers import CHILD_ENV, expected_logits, make_spec, produce

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def kdcache(*argv):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=ROOT, timeout=300)


def last_json(r):
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def rows(fin):
    """{dataset: array} of a finished cache's row datasets (the codec's fields)."""
    with h5py.File(fin, "r") as f:
        spec_codec = f.attrs[schema.A_CODEC].decode()  # text attributes are fixed-length bytes
        names = [k for k in f.keys() if k not in (schema.DONE, schema.CHECKSUMS)]
        return spec_codec, {k: f[k][()] for k in names}


def built(folder, codec="full", dtype="float32", samples=300, views=2, classes=12):
    spec = make_spec(num_samples=samples, num_classes=classes, views=views, codec=codec, dtype=dtype)
    p = path_for(str(folder), spec.fingerprint)
    assert produce(p, spec)
    return p, spec


@pytest.mark.parametrize("codec", ["int8", "topk:5"])
def test_full_float32_converted_equals_the_teachers_build_byte_for_byte(tmp_path, teacher, codec):
    src = last_json(kdcache("cache", "--teacher", teacher, "--dtype", "float32", "--cache-dir", tmp_path / "a",
                            "--quiet", "--json"))
    direct = last_json(kdcache("cache", "--teacher", teacher, "--codec", codec, "--cache-dir", tmp_path / "b",
                               "--quiet", "--json"))
    conv = last_json(kdcache("convert", src["cache_path"], "--codec", codec, "--json"))
    assert not conv["reused"] and conv["rows_written"] > 0 and conv["source_fingerprint"] == src["fingerprint"]
    assert os.path.dirname(conv["cache_path"]) == os.path.dirname(src["cache_path"])  # beside its source
    c1, a = rows(conv["cache_path"])
    c2, b = rows(direct["cache_path"])
    assert c1 == c2 == codec and a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].tobytes() == b[k].tobytes(), k
    # its own identity: not the teacher's build, and it says where it came from
    assert conv["fingerprint"] != direct["fingerprint"]
    meta = json.loads(kdcache("inspect", conv["cache_path"], "--json").stdout)
    assert meta["inputs"]["converted_from"]["fingerprint"] == src["fingerprint"]
    assert meta["inputs"]["converted_from"]["codec"] == "full" and meta["codec"] == codec
    assert kdcache("verify", conv["cache_path"]).returncode == 0
    # found again: the same command reuses it and prints the same path
    again = kdcache("convert", src["cache_path"], "--codec", codec)
    assert again.returncode == 0 and again.stdout.strip() == conv["cache_path"] and "reused" in again.stderr
    listed = json.loads(kdcache("ls", "--cache-dir", tmp_path / "a", "--json").stdout)
    assert conv["fingerprint"] in {e.get("fingerprint") for e in listed}


@pytest.mark.parametrize("src_codec, src_dtype, codec, dtype, match", [
    ("topk:3", "float16", "full", "float16", "would have to invent"),
    ("topk:3", "float16", "int8", "float16", "would have to invent"),
    ("topk:3", "float16", "topk:5", "float16", "holds the 3 largest"),
    ("int8", "float16", "full", "float16", "8-bit codes"),
    ("full", "float16", "full", "float32", "would only widen"),
    ("full", "float16", "topk:3", "float32", "would only widen"),
    ("full", "float32", "full", "float32", "already is codec full"),
    ("full", "float32", "zip", "float16", "codec 'zip' is unknown"),
    ("full", "float32", "int8", "float32", "codec int8 stores 8-bit codes"),
])
def test_conversions_that_would_invent_information_are_one_line_and_write_nothing(
        tmp_path, src_codec, src_dtype, codec, dtype, match):
    p, _ = built(tmp_path / "c", src_codec, src_dtype)
    before = sorted(os.listdir(tmp_path / "c"))
    r = kdcache("convert", p, "--codec", codec, "--dtype", dtype)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and match in lines[0], r.stderr
    assert sorted(os.listdir(tmp_path / "c")) == before and r.stdout == ""


def test_topk_to_fewer_and_int8_to_topk_keep_what_the_source_holds(tmp_path):
    p5, s5 = built(tmp_path, "topk:5", "float16")
    p3, s3 = built(tmp_path, "topk:3", "float16")  # the same logits, built directly
    out = convert(p5, "topk:3")
    _, a = rows(out["cache_path"])
    _, b = rows(p3 + ".h5")
    assert np.array_equal(a[schema.TOPK_VALUES], b[schema.TOPK_VALUES])
    # the same classes, except where float16 rounding made the source's values tie (their order is lost)
    _, src = rows(p5 + ".h5")
    v = src[schema.TOPK_VALUES]
    tied = (np.diff(v[..., :4].astype(np.float32), axis=-1) == 0).any(axis=-1)
    assert tied.mean() < 0.2
    assert np.array_equal(a[schema.TOPK_INDICES][~tied], b[schema.TOPK_INDICES][~tied])
    # the log-sum-exp and the tail's mass are kept to within the source's float16 rounding of its values
    # (they are recomputed from the decoded row, as a teacher's row is encoded)
    assert np.allclose(a[schema.TOPK_LSE], b[schema.TOPK_LSE], atol=1e-2)
    assert np.allclose(np.exp(a[schema.TOPK_LOGTAIL]), np.exp(b[schema.TOPK_LOGTAIL]), rtol=2e-2, atol=1e-4)
    p8, s8 = built(tmp_path, "int8", "float16")
    out = convert(p8, "topk:4")
    with CacheReader(p8) as r8, CacheReader(out["cache_path"]) as rk:
        k = np.arange(s8.num_samples)
        x = r8.get(k, 1)
        top = np.sort(x, axis=1)[:, ::-1][:, :4]
        got = rk.get(k, 1)
        assert np.allclose(np.sort(got, axis=1)[:, ::-1][:, :4], top.astype(np.float16), rtol=1e-3)


def test_a_killed_conversion_resumes_and_ends_as_an_uninterrupted_one(tmp_path):
    p, spec = built(tmp_path / "src", "full", "float32")
    whole = convert(p, "int8", cache_dir=str(tmp_path / "whole"))
    target = target_spec(spec, "int8", "float16")
    out = path_for(str(tmp_path / "part"), target.fingerprint)
    w = CacheWriter(out, target)  # a conversion killed after half of its rows: committed, not compacted
    keys = np.arange(spec.num_keys // 2)
    w.write(keys // spec.views, expected_logits(keys, spec.num_classes), views=keys % spec.views)
    w.abort()
    res = convert(p, "int8", cache_dir=str(tmp_path / "part"))
    assert res["rows_written"] == spec.num_keys - keys.size and res["cache_path"] == out + ".h5"
    _, a = rows(res["cache_path"])
    _, b = rows(whole["cache_path"])
    assert all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_an_unfinished_or_damaged_source_is_refused_in_one_line(tmp_path):
    spec = make_spec(num_samples=200, num_classes=12, dtype="float32")
    p = path_for(str(tmp_path), spec.fingerprint)
    with CacheWriter(p, spec) as w:
        w.write(np.arange(50), expected_logits(np.arange(50), 12))
    with pytest.raises(StoreError, match="not finished yet"):
        convert(p, "int8")
    r = kdcache("convert", p, "--codec", "int8")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "not finished" in r.stderr
    q, _ = built(tmp_path / "d", "full", "float32")
    with h5py.File(q + ".h5", "r") as f:
        off = f[schema.LOGITS].id.get_offset()
    with open(q + ".h5", "r+b") as fh:
        fh.seek(off + 100)
        b = fh.read(1)[0]
        fh.seek(off + 100)
        fh.write(bytes([b ^ 1]))
    with pytest.raises(DamagedRowsError, match="do not match their crc32 checksum"):
        convert(q, "int8")
    r = kdcache("convert", q, "--codec", "int8")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "kdcache verify" in r.stderr
