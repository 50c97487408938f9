"""Tests of store/ring/ in one process: round trips, back-pressure, peers closing, geometry, bad input.

The tests across processes (streaming, a peer killed or hung, leaked segments) are in
test_ring_processes.py, which takes its helpers from here."""
import os
import re
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kdcache.store.format.codec import make_codec
from kdcache.store.errors import (BadInputError, CacheNotFoundError, ConsumerGoneError, FingerprintMismatchError,
                          MissingTargetsError, ProducerGoneError, StoreError, UnsupportedFormatError,
                          WriterBusyError)
from kdcache.store.ring import MAX_BYTES, SHM_DIR, RingReader, RingWriter, _layout

# The teacher's deterministic "logits" for key (index, epoch); the child processes exec the same source.
EXPECTED_SRC = '''
import numpy as np
def expected(idx, ep, c):
    idx = np.asarray(idx, np.float64).reshape(-1, 1)
    ep = np.broadcast_to(np.asarray(ep, np.float64).reshape(-1, 1), idx.shape)
    j = np.arange(c)[None, :]
    return (8 * np.sin(0.37 * idx + 1.3 * ep + 0.11 * j * (1 + ep))).astype(np.float32)
'''
exec(EXPECTED_SRC)


def seg(name):
    return Path(SHM_DIR) / name


@pytest.fixture
def ring_name():
    name = f"kdcache-ring-{os.getpid()}-test-{secrets.token_hex(4)}"
    yield name
    try:  # a failed test must not leak its segment
        seg(name).unlink()
    except FileNotFoundError:
        pass


# --- in one process ---------------------------------------------------------------------------

@pytest.mark.parametrize("codec,dtype", [("full", "float32"), ("full", "float16"),
                                         ("topk:3", "float16"), ("topk:3", "float32")])
def test_round_trip_matches_codec_by_key_in_any_order(ring_name, codec, dtype):
    c = 10
    with RingWriter(ring_name, capacity=32, num_classes=c, codec=codec, dtype=dtype) as w, \
            RingReader(ring_name, timeout=5) as r:
        assert (r.num_classes, r.codec, r.dtype, r.capacity) == (c, codec, dtype, 32)
        idx = np.tile(np.arange(10), 2)
        ep = np.repeat([0, 1], 10)
        x = expected(idx, ep, c)
        w.write(idx[:10], 0, x[:10])           # one epoch for the whole batch
        w.write(idx[10:], ep[10:], x[10:])
        ref = make_codec(codec, c, dtype)
        want = ref.decode(ref.encode(x))
        # out of order, epoch 1 first, a key asked twice in one batch
        order = np.array([15, 3, 3, 19, 0, 10, 7])
        got = r.get(idx[order], ep[order])
        assert got.dtype == np.float32 and got.shape == (7, c)
        np.testing.assert_array_equal(got, want[order])
        if (codec, dtype) == ("full", "float32"):
            np.testing.assert_array_equal(got, x[order])
        # the slots read are free again, the others still there
        gone = r.missing(idx, ep)
        assert gone.tolist() == [i in set(order.tolist()) for i in range(20)]
        rest = np.flatnonzero(~gone)
        np.testing.assert_array_equal(r.get(idx[rest], ep[rest]), want[rest])
        assert r.missing(idx, ep).all()


def test_batch_larger_than_capacity_streams_through(ring_name):
    c, n = 6, 100
    with RingReader(ring_name, create=True, capacity=8, num_classes=c, dtype="float32", timeout=10) as r, \
            RingWriter(ring_name, create=False, timeout=10) as w:
        idx = np.arange(n)
        errors = []

        def produce():
            try:
                for s in range(0, n, 7):
                    w.write(idx[s:s + 7], 3, expected(idx[s:s + 7], 3, c))
            except Exception as e:  # surfaced below
                errors.append(e)
        t = threading.Thread(target=produce)
        t.start()
        got = r.get(idx, 3)
        t.join(10)
        assert not errors
        np.testing.assert_array_equal(got, expected(idx, 3, c))


@pytest.mark.parametrize("dtype,bad", [("float32", np.nan), ("float32", np.inf), ("float16", np.nan),
                                       ("float16", -np.inf), ("float16", 1e6)])  # 1e6 overflows float16
def test_non_finite_logits_rejected_and_nothing_written(ring_name, dtype, bad):
    with RingWriter(ring_name, num_classes=4, dtype=dtype) as w, RingReader(ring_name) as r:
        x = expected(np.arange(3), 0, 4)
        x[1, 2] = bad
        with pytest.raises(BadInputError, match="NaN or Inf"):
            w.write(np.arange(3), 0, x)
        assert w.written == 0
        assert r.missing(np.arange(3), 0).all()


def test_write_blocks_when_full_then_times_out_clearly(ring_name):
    c = 4
    with RingWriter(ring_name, capacity=8, num_classes=c, timeout=30) as w:
        w.write(np.arange(8), 0, expected(np.arange(8), 0, c))
        t0 = time.monotonic()
        with pytest.raises(MissingTargetsError, match="full.*no consumer has attached") as ei:
            w.write([8], 0, expected([8], 0, c), timeout=0.5)
        assert 0.45 <= time.monotonic() - t0 < 3
        assert isinstance(ei.value, TimeoutError)
        assert ei.value.missing.tolist() == [[8, 0]]
        assert w.written == 8
        with RingReader(ring_name) as r:           # attached and alive, but not reading
            with pytest.raises(MissingTargetsError, match="is alive but freed no slot"):
                w.write([8], 0, expected([8], 0, c), timeout=0.3)
            np.testing.assert_array_equal(r.get([0], 0), expected([0], 0, c).astype(np.float16))
            t0 = time.monotonic()
            w.write([8], 0, expected([8], 0, c), timeout=5)   # one slot freed: goes through at once
            assert time.monotonic() - t0 < 0.5
            assert w.written == 9


def test_get_times_out_while_producer_alive(ring_name):
    with RingWriter(ring_name, num_classes=3) as w, RingReader(ring_name) as r:
        w.write([0], 0, expected([0], 0, 3))
        assert r.producer_alive()
        t0 = time.monotonic()
        with pytest.raises(MissingTargetsError, match=r"1 of 2 requested keys.*\(1, 0\).*alive") as ei:
            r.get([0, 1], 0, timeout=0.3)
        assert 0.25 <= time.monotonic() - t0 < 3
        assert ei.value.missing.tolist() == [[1, 0]]
        assert r.stall_s >= 0.2


def test_get_times_out_when_no_producer_attached(ring_name):
    with RingReader(ring_name, create=True, num_classes=3, timeout=0.3) as r:
        assert not r.producer_alive()
        with pytest.raises(MissingTargetsError, match="no producer has attached"):
            r.get([0], 0)


def test_producer_finished_without_keys_raises_at_once(ring_name):
    with RingReader(ring_name, create=True, num_classes=3, timeout=30) as r:
        w = RingWriter(ring_name, create=False)
        w.write([0], 0, expected([0], 0, 3))
        w.close()
        assert not r.producer_alive()
        t0 = time.monotonic()
        with pytest.raises(ProducerGoneError, match="finished.*1 of the 2 requested keys"):
            r.get([0, 1], 0)
        assert time.monotonic() - t0 < 2


def test_consumer_close_makes_write_raise(ring_name):
    with RingWriter(ring_name, num_classes=3) as w:
        r = RingReader(ring_name)
        assert w.consumer_alive()
        r.close()
        with pytest.raises(ConsumerGoneError, match="closed the ring"):
            w.write([0], 0, expected([0], 0, 3))


def test_one_producer_and_one_consumer_per_ring(ring_name):
    """A second producer is refused while the creator's name is up; once the peer attached the name
    is gone (a crash of both leaves nothing), so a restarted producer needs a new ring."""
    with RingWriter(ring_name, num_classes=3, timeout=5) as w:
        with pytest.raises(WriterBusyError, match=f"has a producer already \\(pid {os.getpid()}\\)"):
            RingWriter(ring_name, create=False, timeout=1)
        assert seg(ring_name).exists()
        w.write([0], 0, expected([0], 0, 3))
        with RingReader(ring_name, timeout=1) as r:
            with pytest.raises(CacheNotFoundError, match="no ring named.*one producer and one consumer"):
                RingWriter(ring_name, create=False, timeout=0.2)
            np.testing.assert_array_equal(r.get([0], 0), expected([0], 0, 3).astype(np.float16))
    with RingReader(ring_name, create=True, num_classes=3, timeout=5) as r:
        w1 = RingWriter(ring_name, create=False)
        w1.write([0], 0, expected([0], 0, 3))
        w1.close(finished=False)                   # stopped on an error: the ring cannot be taken over
        with pytest.raises(CacheNotFoundError, match="no ring named"):
            RingWriter(ring_name, create=False, timeout=0.2)
        with pytest.raises(ProducerGoneError, match="without finishing.*1 of the 2"):
            r.get([0, 1], 0)


def test_geometry_disagreement_on_attach_names_both(ring_name):
    with RingWriter(ring_name, capacity=16, num_classes=10, codec="full", dtype="float16"):
        with pytest.raises(StoreError, match=r"holds 10 classes.*num_classes=12"):
            RingReader(ring_name, num_classes=12, timeout=1)
        with pytest.raises(StoreError, match=r"codec full.*codec=topk:3"):
            RingReader(ring_name, codec="topk:3", timeout=1)
        with pytest.raises(StoreError, match=r"dtype float16.*dtype=float32"):
            RingReader(ring_name, dtype="float32", timeout=1)
        with pytest.raises(StoreError, match=r"capacity 16.*capacity=32"):
            RingReader(ring_name, capacity=32, timeout=1)
        with RingReader(ring_name, num_classes=10, codec="FULL", dtype="float16", capacity=16) as r:
            assert r.num_classes == 10


def test_a_ring_carries_its_fingerprint_and_refuses_another(ring_name):
    """The creator names the targets it streams (the cache fingerprint); a peer expecting another
    teacher, data set, views or codec is refused before it reads or writes a row."""
    with RingReader(ring_name, create=True, num_classes=10, fingerprint="0123456789abcdef0123", timeout=5) as r:
        assert r.fingerprint == "0123456789abcdef0123"
        with pytest.raises(FingerprintMismatchError, match=r"fingerprint 0123456789abcdef0123.*expects ffff"):
            RingWriter(ring_name, create=False, fingerprint="ffff", timeout=1)
        with RingWriter(ring_name, create=False, fingerprint="0123456789abcdef0123", timeout=1) as w:
            assert w.fingerprint == r.fingerprint
    with RingWriter(ring_name, num_classes=3) as w:  # no fingerprint: only a side expecting none attaches
        assert w.fingerprint is None
        with pytest.raises(FingerprintMismatchError, match="without a fingerprint, this side expects abc"):
            RingReader(ring_name, fingerprint="abc", timeout=1)
        with RingReader(ring_name, timeout=1) as r:
            assert r.fingerprint is None
    with pytest.raises(StoreError, match="fingerprint must be"):
        RingWriter(ring_name, num_classes=3, fingerprint="../x")
    assert not seg(ring_name).exists()


def test_attach_to_missing_ring_fails_clearly(ring_name):
    t0 = time.monotonic()
    with pytest.raises(CacheNotFoundError, match="no ring named"):
        RingReader(ring_name, timeout=0.2)
    assert time.monotonic() - t0 < 2


def test_segment_is_private_to_its_user(ring_name):
    with RingWriter(ring_name, num_classes=3):
        assert seg(ring_name).stat().st_mode & 0o777 == 0o600


def test_generated_name_and_close_removes_segment():
    w = RingWriter(num_classes=3)
    assert w.name.startswith(f"kdcache-ring-{os.getpid()}-")
    assert seg(w.name).exists()
    w.close()
    assert not seg(w.name).exists()


@pytest.mark.parametrize("capacity,num_classes,codec,named", [
    (2**62, 10, "full", f"capacity={2**62}"),         # wrapped to a negative int64 size
    (2**63, 3, "full", f"capacity={2**63}"),          # beyond the header's int64
    (2**31, 2**33, "full", f"num_classes={2**33}"),   # rows x classes wrapped to 0
    (16, 2**62, "full", f"num_classes={2**62}"),
    (16, 2**62, "topk:3", f"num_classes={2**62}"),    # a small ring, but no row could be decoded
])
def test_a_ring_too_large_is_refused_naming_the_value(ring_name, capacity, num_classes, codec, named):
    """Sizes are computed in Python ints: a huge capacity or class count is refused before
    anything is created, never turned into an overflowed (small or negative) size."""
    for side in (RingWriter, lambda *a, **k: RingReader(*a, create=True, **k)):
        with pytest.raises(BadInputError, match=re.escape(named) + r".*1 TiB"):
            side(ring_name, capacity=capacity, num_classes=num_classes, codec=codec)
        assert not seg(ring_name).exists()
    _, total = _layout(2**31, make_codec("full", 2**33, "float16"))
    assert total > 2**31 * 2**33 * 2 > MAX_BYTES


@pytest.mark.parametrize("field,value,named", [
    ("capacity", 0, "capacity=0"), ("capacity", -8, "capacity=-8"),
    ("num_classes", -3, "num_classes=-3"), ("num_classes", 0, "num_classes=0"),
    ("fingerprint", b"../x", "fingerprint='../x'"), ("fingerprint", b"\xff\xfe", "fingerprint=b'\\xff\\xfe'"),
    ("codec", b"\xff", "codec=b'\\xff'"),
])
def test_a_damaged_header_is_refused_on_attach(ring_name, field, value, named):
    """A header no kdcache creator writes (a damaged segment, or another program's) is refused
    by the attaching side, naming the ring and the field, before it claims a side or maps a row.
    (More fields, and planted files, in test_ring_trust.py.)"""
    with RingWriter(ring_name, capacity=8, num_classes=3, fingerprint="abc") as w:
        w._ring.hdr[field] = value
        refused = re.escape(f"ring {ring_name} has {named} in its header")
        with pytest.raises(UnsupportedFormatError, match=refused):
            RingReader(ring_name, timeout=1)
        assert not w.consumer_alive() and int(w._ring.hdr["consumer_pid"]) == 0
