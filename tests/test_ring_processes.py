"""Tests of store/ring/ across processes: streaming, a peer killed, hung or slow, leaked segments."""
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

from kdcache.store.format.codec import make_codec
from kdcache.store.errors import ConsumerGoneError, ProducerGoneError
from kdcache.store.ring import RingReader, RingWriter, cleanup_stale
from tests.test_ring import EXPECTED_SRC, expected, ring_name, seg  # noqa: F401 (ring_name: a fixture)

REPO = Path(__file__).resolve().parents[1]


def wait_gone(name, within=5.0):
    deadline = time.monotonic() + within
    while seg(name).exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    return not seg(name).exists()


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


# --- across processes -------------------------------------------------------------------------

PRODUCER_STREAM = '''
import sys
from kdcache.store.ring import RingWriter
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
from kdcache.store.ring import RingWriter
w = RingWriter(sys.argv[1], num_classes=3)
w.write([0], 0, expected([0], 0, 3))
''', ring_name, tmp_path)
    assert proc.wait(20) == 0, Path(proc.err_path).read_text()
    assert not seg(ring_name).exists()


PRODUCER_THEN_SLEEP = '''
import sys, time
from multiprocessing import resource_tracker
from kdcache.store.ring import RingWriter
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
from kdcache.store.ring import RingWriter
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
from kdcache.store.ring import RingReader
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
from kdcache.store.ring import RingWriter
w = RingWriter(sys.argv[1], num_classes=3)
resource_tracker.unregister("/" + w.name, "shared_memory")
os.kill(os.getpid(), signal.SIGKILL)
''', ring_name, tmp_path)
    assert proc.wait(20) == -signal.SIGKILL, Path(proc.err_path).read_text()
    # (A concurrent `python -m kdcache.store gc` may legitimately remove it from here on: keep this short.)
    assert seg(ring_name).exists()
    with RingWriter(num_classes=3) as live:
        assert ring_name in cleanup_stale(dry_run=True)
        assert seg(ring_name).exists()
        removed = cleanup_stale()
        assert ring_name in removed and live.name not in removed
        assert not seg(ring_name).exists()
        assert seg(live.name).exists()
