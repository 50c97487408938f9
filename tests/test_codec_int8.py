"""The int8 codec: every class's logit in 8 bits over its row's range, within half a step of the teacher's,
C + 8 bytes a row, wherever a codec works (writer, reader, compaction, verify, ring, the command lines)."""
import json
import os
import secrets
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.store import BadInputError, CacheReader, CacheSpec, CacheWriter, StoreError, make_codec, path_for
from kdcache.store.format import schema
from kdcache.store.folder.registry import final_path, parts_path, verify
from tests.helpers import CHILD_ENV, expected_logits, make_spec, produce

ENV = CHILD_ENV


def round_trip(x):
    codec = make_codec("int8", x.shape[1])
    enc = codec.encode(x)
    return enc, codec.decode(enc)


def within_half_a_step(x, enc, got):
    """|decoded - x| <= scale / 2 for every class, plus float32's rounding of lo + q * scale."""
    x = np.asarray(x, dtype=np.float64)
    slack = np.abs(x).max(axis=1) * 2.0 ** -22 + 1e-37
    bound = enc[schema.INT8_SCALE].astype(np.float64) / 2 + slack
    err = np.abs(got.astype(np.float64) - x).max(axis=1)
    return err <= bound, err, bound


def test_bytes_per_row_and_fields():
    codec = make_codec("int8", 1000)
    assert codec.bytes_per_row == 1000 + 8 and make_codec("INT8 ", 10).bytes_per_row == 18
    assert [(n, s, np.dtype(d)) for n, s, d in codec.fields] == [
        (schema.INT8_CODES, (1000,), np.uint8), (schema.INT8_LO, (), np.float32), (schema.INT8_SCALE, (), np.float32)]
    assert codec.spec == "int8" and codec.version == 1


@pytest.mark.parametrize("c,scale", [(10, 6.0), (100, 0.01), (1000, 40.0), (3, 1e4)])
def test_every_class_within_half_a_step(c, scale):
    x = (np.random.default_rng(c).standard_normal((500, c)) * scale).astype(np.float32)
    enc, got = round_trip(x)
    ok, err, bound = within_half_a_step(x, enc, got)
    assert ok.all(), (err[~ok][:3], bound[~ok][:3])
    assert got.dtype == np.float32 and enc[schema.INT8_CODES].dtype == np.uint8
    # the row's ends are stored exactly: its smallest logit is code 0, its largest code 255
    assert np.array_equal(enc[schema.INT8_LO], x.min(axis=1))
    assert (enc[schema.INT8_CODES].min(axis=1) == 0).all() and (enc[schema.INT8_CODES].max(axis=1) == 255).all()
    assert np.allclose(enc[schema.INT8_SCALE], (x.max(axis=1) - x.min(axis=1)) / 255, rtol=1e-6)


def test_constant_rows_come_back_exactly():
    x = np.array([[3.25] * 7, [0.0] * 7, [-1e30] * 7, [65504.0] * 7], dtype=np.float32)
    enc, got = round_trip(x)
    assert np.array_equal(got, x)
    assert (enc[schema.INT8_SCALE] == 0).all() and (enc[schema.INT8_CODES] == 0).all()


def test_huge_ranges_neither_overflow_nor_lose_the_bound():
    big = np.finfo(np.float32).max
    x = np.array([[-big, big, 0.0, 1.0], [-3e38, 3e38, 1e38, -1e38], [1e5, -1e5, 7e4, 0.0],
                  [1e-30, 2e-30, 0.0, 3e-30]], dtype=np.float32)
    enc, got = round_trip(x)
    assert np.isfinite(got).all() and np.isfinite(enc[schema.INT8_SCALE]).all()
    ok, err, bound = within_half_a_step(x, enc, got)
    assert ok.all(), (err, bound)
    assert got[0, 1] == big and got[0, 0] == -big
    # full float16 refuses what int8 stores: |x| > 65504
    with pytest.raises(BadInputError, match="overflow float16"):
        make_codec("full", 4, "float16").encode(x[2:3])


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_are_refused_as_by_the_other_codecs(bad, cache_dir):
    x = expected_logits(np.arange(6), 5)
    x[4, 2] = bad
    with pytest.raises(BadInputError, match="NaN or Inf"):
        make_codec("int8", 5).encode(x, keys=np.arange(6))
    spec = make_spec(num_samples=6, num_classes=5, codec="int8", dtype="float16")
    with CacheWriter(path_for(cache_dir, spec.fingerprint), spec) as w:
        with pytest.raises(BadInputError, match="NaN or Inf"):
            w.write(np.arange(6), x)
        assert w.missing().size == 6  # nothing of the batch was written


def test_dtype_float32_is_refused_it_does_not_apply():
    with pytest.raises(StoreError, match="int8.*float32.*does not apply"):
        make_codec("int8", 10, "float32")
    with pytest.raises(StoreError, match="does not apply"):
        CacheSpec(num_samples=5, num_classes=10, codec="int8", dtype="float32")
    assert CacheSpec(num_samples=5, num_classes=10, codec="int8").dtype == "float16"


def test_the_command_lines_take_int8_and_refuse_it_with_float32(capsys):
    from kdcache.pipeline.options import Codec
    from kdcache.trainer.options import parse_args
    assert Codec()(" INT8") == "int8" and "int8" in Codec().allowed()
    args = parse_args(["--teacher-mode", "none", "--codec", "int8"])
    assert (args.codec, args.dtype) == ("int8", "float16")
    with pytest.raises(SystemExit) as ei:
        parse_args(["--teacher-mode", "none", "--codec", "int8", "--dtype", "float32"])
    err = capsys.readouterr().err.strip().splitlines()
    assert ei.value.code == 2 and len(err) == 1 and err[0].startswith("error: argument --dtype") and "int8" in err[0]


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(c=st.sampled_from([1, 2, 10, 257, 1000]), rows=st.integers(1, 20),
       scale=st.floats(1e-6, 1e6), offset=st.floats(-1e6, 1e6), margin=st.floats(0, 100),
       seed=st.integers(0, 2 ** 16))
def test_any_logits_within_half_a_step_and_a_clear_top_1_kept(c, rows, scale, offset, margin, seed):
    rng = np.random.default_rng(seed)
    x = (offset + scale * rng.standard_normal((rows, c))).astype(np.float32)
    x[np.arange(rows), rng.integers(0, c, rows)] += np.float32(margin * scale)
    enc, got = round_trip(x)
    assert np.isfinite(got).all()
    ok, err, bound = within_half_a_step(x, enc, got)
    assert ok.all(), (err, bound)
    # a top class more than a step above the next keeps its place
    if c > 1:
        top2 = -np.sort(-x.astype(np.float64), axis=1)[:, :2]
        clear = top2[:, 0] - top2[:, 1] > 2 * bound
        assert (got.argmax(axis=1) == x.argmax(axis=1))[clear].all()


@pytest.mark.parametrize("mapped,budget,source", [(True, None, "map"), (False, None, "ram"), (False, 0, "disk")])
def test_a_cache_written_in_shuffled_order_and_read_back(cache_dir, mapped, budget, source):
    spec = make_spec(num_samples=300, num_classes=12, views=3, codec="int8", dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    assert produce(p, spec, seed=1, batch=32)  # segments, then compaction into P.h5
    assert not os.path.exists(parts_path(p))
    keys = np.arange(spec.num_keys)
    x = expected_logits(keys, 12)
    codec = spec.make_codec()
    want = codec.decode(codec.encode(x))
    assert within_half_a_step(x, codec.encode(x), want)[0].all()
    with CacheReader(p, spec=spec, memory_budget=budget, mmap=mapped) as r:
        assert r.complete and r.source == source
        idx, views = np.array([5, 299, 0, 5, 17]), np.array([2, 0, 1, 2, 1])
        assert np.array_equal(r.get(idx, views), want[idx * 3 + views])
        assert np.array_equal(r.get(np.arange(300), 1), want[np.arange(300) * 3 + 1])
    with h5py.File(final_path(p), "r") as f:  # self-describing for plain h5py
        assert f.attrs[schema.A_CODEC] == b"int8" and f.attrs[schema.A_CODEC_VERSION] == 1
        assert f[schema.INT8_CODES].shape == (300, 3, 12) and f[schema.INT8_CODES].dtype == np.uint8
        assert f[schema.INT8_LO].shape == f[schema.INT8_SCALE].shape == (300, 3)
        q, lo, s = f[schema.INT8_CODES][7, 1], f[schema.INT8_LO][7, 1], f[schema.INT8_SCALE][7, 1]
        assert np.allclose(lo + q * s.astype(np.float64), want[7 * 3 + 1], rtol=0, atol=1e-5)
    report, problems = verify(p)
    assert not problems, problems


def test_a_cache_read_while_it_is_being_written(cache_dir):
    spec = make_spec(num_samples=50, num_classes=7, codec="int8", dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    x = expected_logits(np.arange(50), 7)
    codec = spec.make_codec()
    with CacheWriter(p, spec) as w:
        w.write(np.arange(20), x[:20])
        with CacheReader(p, spec=spec) as r:
            assert np.array_equal(r.get(np.arange(20)), codec.decode(codec.encode(x[:20])))
            assert r.missing(np.arange(50)).tolist() == list(range(20, 50))
        _, problems = verify(p)
        assert any("incomplete" in q for q in problems)


def test_the_ring_streams_int8_rows():
    from kdcache.store.ring import SHM_DIR, RingReader, RingWriter
    name = f"kdcache-ring-{os.getpid()}-test-{secrets.token_hex(4)}"
    try:
        with RingWriter(name, capacity=16, num_classes=10, codec="int8") as w, RingReader(name, timeout=5) as r:
            assert (r.codec, r.dtype) == ("int8", "float16")
            x = expected_logits(np.arange(12), 10)
            w.write(np.arange(12), 0, x)
            codec = make_codec("int8", 10)
            order = np.array([11, 3, 3, 0, 7])
            assert np.array_equal(r.get(order, 0), codec.decode(codec.encode(x))[order])
        with pytest.raises(StoreError, match="does not apply"):
            RingWriter(name + "-f32", capacity=4, num_classes=10, codec="int8", dtype="float32")
    finally:
        for n in (name, name + "-f32"):
            try:
                os.unlink(os.path.join(SHM_DIR, n))
            except FileNotFoundError:
                pass


def test_verify_compares_every_decoded_class_with_the_teacher():
    from kdcache.cache_builder.teacher_check import compare_rows, rule
    fresh = expected_logits(np.arange(64), 10).astype(np.float64)
    stored = make_codec("int8", 10).encode(fresh.astype(np.float32))
    diff, tol, top, want, agree, ok = compare_rows(stored, fresh, "int8", "float16")
    assert ok.all() and agree.all() and (diff <= tol).all()
    assert np.allclose(tol, stored[schema.INT8_SCALE] / 2 + np.abs(fresh).max(axis=1) * 1e-4 + 1e-5)
    altered = {k: v.copy() for k, v in stored.items()}
    altered[schema.INT8_CODES][[3, 40], 5] ^= 0x10  # 16 steps off
    ok2 = compare_rows(altered, fresh, "int8", "float16")[-1]
    assert ok2.tolist() == [i not in (3, 40) for i in range(64)]
    assert "scale / 2" in rule("int8", "float16") and "float16" in rule("topk", "float16")


@pytest.mark.slow
def test_kdcache_cache_and_verify_teacher_with_int8(tmp_path):
    """The producer writes an int8 cache of a real teacher; verify --teacher finds it within tolerance."""
    from tests.helpers import gluon_teacher
    gluon_teacher(str(tmp_path / "teacher"), scale=4.0)

    def kdcache(*argv):
        return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                              env=ENV, cwd=tmp_path, timeout=300)
    r = kdcache("cache", "--teacher", "teacher", "--codec", "int8", "--cache-dir", "caches", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    path = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    r = kdcache("verify", path, "--teacher", "teacher", "--sample", "all", "--quiet", "--json")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    t = json.loads(r.stdout)["teacher_check"]
    assert t["match"] and t["codec"] == "int8" and t["keys_checked"] == 1438 and t["top1_agreement"] == 1.0
    assert "scale / 2" in t["tolerance_rule"]
    r = kdcache("cache", "--teacher", "teacher", "--codec", "int8", "--dtype", "float32", "--cache-dir", "caches")
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: argument --dtype"), r.stderr
