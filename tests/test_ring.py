"""Tests of store/ring.py: the shared-memory ring buffer (streaming mode), across processes."""
import os
import secrets
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from store.codec import make_codec
from store.errors import (BadInputError, CacheNotFoundError, ConsumerGoneError, FingerprintMismatchError,
                          MissingTargetsError, ProducerGoneError, StoreError, WriterBusyError)
from store.ring import SHM_DIR, RingReader, RingWriter, cleanup_stale

REPO = Path(__file__).resolve().parents[1]

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


def wait_gone(name, within=5.0):
    deadline = time.monotonic() + within
    while seg(name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not seg(name).exists()


@pytest.fixture
def ring_name():
    name = f"kdcache-ring-{os.getpid()}-test-{secrets.token_hex(4)}"
    yield name
    try:  # a failed test must not leak its segment
        seg(name).unlink()
    except FileNotFoundError:
        pass


def spawn(code, name, tmp_path):
    """Run `code` (with `expected` defined and sys.argv[1] = name) in a fresh Python process."""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    err = open(tmp_path / f"child-{secrets.token_hex(3)}.err", "w")
    proc = subprocess.Popen([sys.executable, "-c", EXPECTED_SRC + textwrap.dedent(code), name],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    proc.err_path = err.name
    err.close()
    return proc


def wait_ready(proc):
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"child failed: {Path(proc.err_path).read_text()}"


def kill_later(proc, delay):
    """Send SIGKILL to proc after `delay` s; returns a list that receives the kill time."""
    when = []

    def go():
        when.append(time.monotonic())
        os.kill(proc.pid, signal.SIGKILL)
    threading.Timer(delay, go).start()
    return when


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


def test_one_producer_at_a_time_and_a_new_one_takes_over(ring_name):
    with RingReader(ring_name, create=True, num_classes=3, timeout=5) as r:
        w1 = RingWriter(ring_name, create=False)
        w1.write([0], 0, expected([0], 0, 3))
        with pytest.raises(WriterBusyError, match="has a producer already"):
            RingWriter(ring_name, create=False)
        w1.close(finished=False)                   # say it stopped on an error; a restart takes over
        with RingWriter(ring_name, create=False) as w2:
            assert r.producer_alive()
            w2.write([1], 0, expected([1], 0, 3))
            np.testing.assert_array_equal(r.get([0, 1], 0),
                                          expected([0, 1], 0, 3).astype(np.float16).astype(np.float32))


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
    with RingWriter(ring_name, num_classes=3) as w:  # no fingerprint: no check, as before
        assert w.fingerprint is None
        with RingReader(ring_name, fingerprint="abc", timeout=1) as r:
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


# --- across processes -------------------------------------------------------------------------

PRODUCER_STREAM = '''
import sys
from store.ring import RingWriter
create = sys.argv[2] == "1"
opts = dict(create=True, capacity=64, num_classes=10, codec="topk:4", dtype="float16") if create else dict(create=False)
with RingWriter(sys.argv[1], timeout=20, **opts) as w:
    n = 5000
    idx, ep = np.arange(n) % 2500, np.arange(n) // 2500
    for s in range(0, n, 37):
        w.write(idx[s:s + 37], ep[s:s + 37], expected(idx[s:s + 37], ep[s:s + 37], 10))
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("creator", ["reader", "writer"])
def test_stream_5000_rows_between_processes(ring_name, tmp_path, creator):
    n, c = 5000, 10
    code = PRODUCER_STREAM.replace("sys.argv[2]", repr("1" if creator == "writer" else "0"))
    if creator == "reader":
        r = RingReader(ring_name, create=True, capacity=64, num_classes=c, dtype="float32", timeout=20)
        proc = spawn(code, ring_name, tmp_path)
        ref = make_codec("full", c, "float32")
    else:
        proc = spawn(code, ring_name, tmp_path)
        r = RingReader(ring_name, timeout=20)   # waits for the producer to create it
        ref = make_codec("topk:4", c, "float16")
        assert (r.capacity, r.codec) == (64, "topk:4")
    idx, ep = np.arange(n) % 2500, np.arange(n) // 2500
    for s in range(0, n, 50):
        got = r.get(idx[s:s + 50], ep[s:s + 50])
        x = expected(idx[s:s + 50], ep[s:s + 50], c)
        np.testing.assert_array_equal(got, ref.decode(ref.encode(x)))
    assert proc.wait(20) == 0, Path(proc.err_path).read_text()
    assert not r.producer_alive()
    if creator == "writer":   # the creator's close removed the name; the reader read on regardless
        assert not seg(ring_name).exists()
    r.close()
    assert not seg(ring_name).exists()


def test_segment_removed_when_creator_exits_without_close(ring_name, tmp_path):
    proc = spawn('''
import sys
from store.ring import RingWriter
w = RingWriter(sys.argv[1], num_classes=3)
w.write([0], 0, expected([0], 0, 3))
''', ring_name, tmp_path)
    assert proc.wait(20) == 0, Path(proc.err_path).read_text()
    assert not seg(ring_name).exists()


PRODUCER_THEN_SLEEP = '''
import sys, time
from multiprocessing import resource_tracker
from store.ring import RingWriter
w = RingWriter(sys.argv[1], capacity=64, num_classes=10, dtype="float32")
if HIDE:  # as when the creator's tracker is a parent's that lives on: only the survivor can clean up
    resource_tracker.unregister("/" + w.name, "shared_memory")
w.write(np.arange(10), 0, expected(np.arange(10), 0, 10))
print("ready", flush=True)
time.sleep(60)
'''


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hide_from_tracker", [False, True])
def test_producer_killed_while_consumer_waits(ring_name, tmp_path, hide_from_tracker):
    proc = spawn(PRODUCER_THEN_SLEEP.replace("HIDE", str(hide_from_tracker)), ring_name, tmp_path)
    try:
        wait_ready(proc)
        # liveness_timeout is long: only the pid check can see the death this fast
        with RingReader(ring_name, timeout=30, liveness_timeout=30) as r:
            np.testing.assert_array_equal(r.get(np.arange(10), 0), expected(np.arange(10), 0, 10))
            assert r.producer_alive()
            killed = kill_later(proc, 0.3)
            with pytest.raises(ProducerGoneError, match="died.*10 of the 10 requested keys"):
                r.get(np.arange(10, 20), 0)
            assert time.monotonic() - killed[0] < 6
            assert wait_gone(ring_name), "the dead creator's segment was left in /dev/shm"
    finally:
        proc.kill()
        proc.wait()
    assert not seg(ring_name).exists()


SLOW_PRODUCER = '''
import sys, time
from store.ring import RingWriter
w = RingWriter(sys.argv[1], capacity=64, num_classes=3, liveness_timeout=0.6)
w.write([0], 0, expected([0], 0, 3))
print("ready", flush=True)
time.sleep(1.5)  # a teacher step slower than liveness_timeout: the heartbeat thread covers it
w.write([1], 0, expected([1], 0, 3))
time.sleep(60)
'''


@pytest.mark.timeout(60)
def test_slow_producer_is_alive_and_stopped_one_is_hung(ring_name, tmp_path):
    proc = spawn(SLOW_PRODUCER, ring_name, tmp_path)
    try:
        wait_ready(proc)
        with RingReader(ring_name, timeout=30, liveness_timeout=0.6) as r:
            r.get([0], 0)
            r.get([1], 0)                       # waited ~1.5 s for it, producer never stale
            assert r.stall_s > 1.0
            os.kill(proc.pid, signal.SIGSTOP)   # alive, but no heartbeat any more
            t0 = time.monotonic()
            with pytest.raises(ProducerGoneError, match="no heartbeat"):
                r.get([2], 0)
            assert time.monotonic() - t0 < 3
    finally:
        proc.kill()
        proc.wait()


CONSUMER_THEN_SLEEP = '''
import sys, time
from store.ring import RingReader
r = RingReader(sys.argv[1], timeout=20)
print("ready", flush=True)
time.sleep(60)
'''


@pytest.mark.timeout(60)
def test_consumer_killed_while_producer_blocked(ring_name, tmp_path):
    w = RingWriter(ring_name, capacity=8, num_classes=4, timeout=30, liveness_timeout=30)
    proc = spawn(CONSUMER_THEN_SLEEP, ring_name, tmp_path)
    try:
        wait_ready(proc)
        assert w.consumer_alive()
        w.write(np.arange(8), 0, expected(np.arange(8), 0, 4))
        killed = kill_later(proc, 0.3)
        with pytest.raises(ConsumerGoneError, match="consumer.*died"):
            w.write([8], 0, expected([8], 0, 4))
        assert time.monotonic() - killed[0] < 6
    finally:
        w.close(finished=False)
        proc.kill()
        proc.wait()
    assert not seg(ring_name).exists()


@pytest.mark.timeout(60)
def test_cleanup_stale_removes_leaked_segment_of_dead_creator(ring_name, tmp_path):
    # The child creates a ring, hides it from its resource tracker and dies: a true leak.
    proc = spawn('''
import os, signal, sys
from multiprocessing import resource_tracker
from store.ring import RingWriter
w = RingWriter(sys.argv[1], num_classes=3)
resource_tracker.unregister("/" + w.name, "shared_memory")
os.kill(os.getpid(), signal.SIGKILL)
''', ring_name, tmp_path)
    assert proc.wait(20) == -signal.SIGKILL, Path(proc.err_path).read_text()
    # (A concurrent `python -m store gc` may legitimately remove it from here on: keep this short.)
    assert seg(ring_name).exists()
    with RingWriter(num_classes=3) as live:
        assert ring_name in cleanup_stale(dry_run=True)
        assert seg(ring_name).exists()
        removed = cleanup_stale()
        assert ring_name in removed and live.name not in removed
        assert not seg(ring_name).exists()
        assert seg(live.name).exists()
