"""Tests of what the ring trusts in /dev/shm: files it opens, headers it believes, segments a kill leaves.

Names in the shared directory are anyone's to plant: a FIFO, a symbolic link, a segment others may
write, a header with fields no kdcache creator writes. Each is refused with one StoreError line (or
skipped by cleanup_stale()), promptly, and left as it was. And the segment's name goes as soon as
both sides hold the mapping, so `kill -9` of a whole process group leaves nothing behind."""
import os
import secrets
import signal
import stat
import subprocess
import sys
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.store.errors import FingerprintMismatchError, StoreError
from kdcache.store.ring import (_HEADER, LAYOUT_VERSION, MAGIC, PREFIX, SHM_DIR, RingReader, RingWriter, _align,
                        cleanup_stale)
from tests.test_ring import EXPECTED_SRC, expected, ring_name, seg  # noqa: F401 (ring_name: a fixture)
from tests.test_ring_processes import REPO, spawn, wait_ready

DEAD_PID = 2**22 + 1  # above any kernel's pid_max: never a live process
SETTINGS = dict(deadline=None, derandomize=True, database=None)
ENV = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture
def dead_name():
    """A ring name whose creator pid (in the name) is dead: cleanup_stale() judges it stale."""
    name = f"{PREFIX}{DEAD_PID}-trust-{secrets.token_hex(4)}"
    yield name
    if os.path.lexists(seg(name)):
        seg(name).unlink()


def run_cleanup(within=20):
    """cleanup_stale() in a fresh process, as `python -m kdcache.store gc` runs it; the names it removed."""
    out = subprocess.run([sys.executable, "-c", "from kdcache.store.ring import cleanup_stale; print(*cleanup_stale())"],
                         cwd=REPO, env=ENV, capture_output=True, text=True, timeout=within)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def stale_and_removed(name):
    """cleanup_stale() removed ring `name` as stale. Any `python -m kdcache.store gc` on this machine (other
    test suites run it) may have removed it first, by the same judgement: then it is gone all the same."""
    return name in run_cleanup() or not os.path.lexists(seg(name))


def refused(make, within=2.0):
    """The one-line StoreError `make()` raises, raised within `within` seconds (not after a timeout)."""
    t0 = time.monotonic()
    with pytest.raises(StoreError) as ei:
        make()
    assert time.monotonic() - t0 < within, "refused only after waiting"
    msg = str(ei.value)
    assert "\n" not in msg and msg, msg
    return ei.value


def ring_bytes_of_dead_creator():
    """The bytes of a valid ring whose creator is dead: what cleanup_stale() would judge stale."""
    with RingWriter(capacity=4, num_classes=3, fingerprint="abc") as w:
        data = bytearray(seg(w.name).read_bytes())
    h = np.ndarray((), _HEADER, buffer=data)
    h["creator_pid"] = h["producer_pid"] = DEAD_PID
    del h
    return bytes(data)


# --- files that are not a ring of ours ------------------------------------------------------------

@pytest.mark.timeout(60)
def test_a_fifo_named_like_a_ring_is_left_alone_and_never_blocks(dead_name):
    os.mkfifo(seg(dead_name), 0o600)
    t0 = time.monotonic()
    removed = run_cleanup(within=20)  # opening the FIFO to read a header would block for ever
    assert time.monotonic() - t0 < 15
    assert dead_name not in removed and stat.S_ISFIFO(os.lstat(seg(dead_name)).st_mode)
    e = refused(lambda: RingReader(dead_name, timeout=10))
    assert f"{SHM_DIR}/{dead_name}" in str(e) and "FIFO" in str(e)
    assert stat.S_ISFIFO(os.lstat(seg(dead_name)).st_mode)


def test_a_symlink_named_like_a_ring_is_not_followed(dead_name, tmp_path):
    target = tmp_path / "mine"
    target.write_bytes(ring_bytes_of_dead_creator())  # a stale ring, if the link were followed
    before = (target.read_bytes(), target.stat().st_mtime_ns)
    os.symlink(target, seg(dead_name))
    e = refused(lambda: RingReader(dead_name, timeout=10))
    assert f"{SHM_DIR}/{dead_name}" in str(e) and "symbolic link" in str(e)
    assert dead_name not in run_cleanup()
    assert os.path.islink(seg(dead_name))
    assert (target.read_bytes(), target.stat().st_mtime_ns) == before
    e = refused(lambda: RingWriter(dead_name, num_classes=3))  # creating never goes through it either
    assert "exists already" in str(e) and (target.read_bytes(), target.stat().st_mtime_ns) == before


@pytest.mark.parametrize("how", ["group-writable", "writable by others", "another user's"])
def test_a_segment_others_could_write_is_refused(ring_name, how):
    with RingWriter(ring_name, capacity=4, num_classes=3) as w:
        if how == "another user's":
            if os.getuid() != 0:
                pytest.skip("making a file of another user needs root")
            os.chown(seg(ring_name), 65534, -1)
        else:
            os.chmod(seg(ring_name), 0o620 if how == "group-writable" else 0o606)
        e = refused(lambda: RingReader(ring_name, timeout=10))
        assert f"{SHM_DIR}/{ring_name}" in str(e)
        assert ("user 65534" if how == "another user's" else "writable by") in str(e)
        assert int(w._ring.hdr["consumer_pid"]) == 0 and seg(ring_name).exists()


def test_cleanup_leaves_another_users_stale_segment_alone(dead_name):
    if os.getuid() != 0:
        pytest.skip("making a file of another user needs root")
    seg(dead_name).write_bytes(ring_bytes_of_dead_creator())
    os.chmod(seg(dead_name), 0o600)
    os.chown(seg(dead_name), 65534, -1)
    assert dead_name not in run_cleanup() and seg(dead_name).exists()
    os.chown(seg(dead_name), os.getuid(), -1)  # ours, and its creator dead: stale
    assert stale_and_removed(dead_name) and not seg(dead_name).exists()


# --- header fields ----------------------------------------------------------------------------------

def attach_refused(mutate, expect="abc", codec="full"):
    """Create a ring, let mutate(hdr, path) damage it, attach: one StoreError line naming the ring,
    within a second; the ring is left as it was (no side claimed, the name kept)."""
    name = f"{PREFIX}{os.getpid()}-hdr-{secrets.token_hex(4)}"
    with RingWriter(name, capacity=8, num_classes=3, codec=codec, fingerprint="abc") as w:
        mutate(w._ring.hdr, seg(name))
        unclaimed = int(w._ring.hdr["consumer_pid"])  # 0, or what mutate() put there
        e = refused(lambda: RingReader(name, timeout=10, fingerprint=expect))
        assert f"ring {name}" in str(e), str(e)
        assert int(w._ring.hdr["consumer_pid"]) == unclaimed and seg(name).exists()
    return e


def setter(field, value):
    def mutate(hdr, path):
        hdr[field] = value
    return mutate


ints = st.integers(-2**63, 2**63 - 1)


@settings(max_examples=25, **SETTINGS)
@given(st.one_of(st.integers(-2**63, 0), st.integers(2**36, 2**63 - 1), ints.filter(lambda v: v != 8)))
def test_any_other_capacity_is_refused(capacity):
    """0, negative, so large that the size overflows or passes 1 TiB, or merely another size than the file."""
    attach_refused(setter("capacity", capacity))


@settings(max_examples=25, **SETTINGS)
@given(ints.filter(lambda v: v != 3))
def test_any_other_class_count_is_refused(num_classes):
    attach_refused(setter("num_classes", num_classes))


@settings(max_examples=20, **SETTINGS)
@given(st.binary(min_size=8, max_size=8).filter(lambda b: b.rstrip(b"\0") not in (b"", MAGIC)))
def test_a_foreign_magic_is_refused_at_once(magic):
    """Not 'waiting for the creator' until the timeout: a magic that is neither unset nor ours."""
    e = attach_refused(setter("magic", magic))
    assert "not a kdcache ring" in str(e)


@settings(max_examples=20, **SETTINGS)
@given(ints.filter(lambda v: v != LAYOUT_VERSION))
def test_another_layout_version_is_refused(version):
    assert "layout version" in str(attach_refused(setter("version", version)))


@settings(max_examples=20, **SETTINGS)
@given(ints.filter(lambda v: v != 0))
def test_a_header_size_claim_unlike_the_geometry_is_refused(delta):
    attach_refused(lambda hdr, path: hdr.__setitem__("total_bytes", int(hdr["total_bytes"]) + delta
                                                     if abs(delta) < 2**62 else delta))


@settings(max_examples=15, **SETTINGS)
@given(st.data())
def test_a_file_of_another_size_than_its_header_says_is_refused(data):
    def mutate(hdr, path):
        total = int(hdr["total_bytes"])
        size = data.draw(st.one_of(st.integers(_HEADER.itemsize, total - 1), st.integers(total + 1, 2 * total)))
        os.truncate(path, size)
    assert "bytes" in str(attach_refused(mutate))


def test_an_empty_fingerprint_is_refused_unless_created_without_one():
    """Both kdcache sides always pass a fingerprint: an empty one in the header is damage (or a ring
    made for another purpose), and a ring created without one is refused by a side expecting one."""
    assert "fingerprint" in str(attach_refused(setter("fingerprint", b"")))
    assert "fingerprint" in str(attach_refused(setter("fingerprint", b""), expect=None))
    name = f"{PREFIX}{os.getpid()}-nofp-{secrets.token_hex(4)}"
    with RingWriter(name, num_classes=3) as w:   # explicitly none: a side that expects none attaches
        e = refused(lambda: RingReader(name, fingerprint="abc", timeout=10))
        assert isinstance(e, FingerprintMismatchError) and "without a fingerprint" in str(e)
        with RingReader(name, timeout=10) as r:
            assert r.fingerprint is None and w.fingerprint is None


@settings(max_examples=20, **SETTINGS)
@given(st.text("0123456789abcdefABCDEF", min_size=1, max_size=32).filter(lambda f: f != "abc"))
def test_a_wrong_fingerprint_is_refused(fingerprint):
    e = attach_refused(setter("fingerprint", fingerprint.encode()))
    assert isinstance(e, FingerprintMismatchError) and fingerprint in str(e)


@settings(max_examples=30, **SETTINGS)
@given(st.sampled_from(["write_count", "producer_pid", "consumer_pid", "creator_pid", "attached"]),
       st.integers(-2**63, -1))
def test_negative_counters_and_pids_are_refused(field, value):
    attach_refused(setter(field, value))


@settings(max_examples=20, **SETTINGS)
@given(st.sampled_from(["producer_state", "consumer_state"]), ints.filter(lambda v: v not in (0, 1, 2)))
def test_a_side_state_out_of_range_is_refused(field, value):
    attach_refused(setter(field, value))


@settings(max_examples=20, **SETTINGS)
@given(st.integers(1, 8), st.integers(0, 7))
def test_more_rows_ready_than_ever_written_is_refused(ready, written):
    """The slots' states against the write counter: positions that no producer could have left."""
    def mutate(hdr, path):
        hdr["write_count"] = min(written, ready - 1)
        with open(path, "r+b") as f:  # state bytes follow the header, 64-byte aligned
            f.seek(_align(_HEADER.itemsize))
            f.write(b"\1" * ready)
    assert "write_count" in str(attach_refused(mutate))


@settings(max_examples=15, **SETTINGS)
@given(st.integers(2, 255), st.integers(0, 7))
def test_a_slot_state_no_side_writes_is_refused(value, slot):
    def mutate(hdr, path):
        with open(path, "r+b") as f:
            f.seek(_align(_HEADER.itemsize) + slot)
            f.write(bytes([value]))
    attach_refused(mutate)


# --- the name goes once both sides hold the mapping -------------------------------------------------

def test_the_name_goes_as_soon_as_both_sides_hold_the_ring(ring_name):
    with RingReader(ring_name, create=True, capacity=8, num_classes=3, fingerprint="abc", timeout=5) as r:
        assert seg(ring_name).exists()                        # waiting for its producer
        with RingWriter(ring_name, create=False, fingerprint="abc", timeout=5) as w:
            assert not seg(ring_name).exists()                # both hold it: nothing to leak
            w.write([0, 1], 0, expected([0, 1], 0, 3))
            np.testing.assert_array_equal(r.get([1, 0], 0), expected([1, 0], 0, 3).astype(np.float16))
            e = refused(lambda: RingWriter(ring_name, create=False, timeout=0.3), within=5)
            assert "no ring named" in str(e) and "one producer and one consumer" in str(e)
            assert w.consumer_alive() and r.producer_alive()
    assert ring_name not in cleanup_stale(dry_run=True)


# --- kill -9 of the whole process group ---------------------------------------------------------------

# The trainer's side: creates the ring, starts the producer in its own process group (as python -m
# trainer does), reports how far it got, reads until killed.
GROUP = '''
import subprocess, sys, time
from kdcache.store.ring import RingReader
name, moment = sys.argv[1], sys.argv[2]
r = RingReader(name, create=True, capacity=16, num_classes=4, fingerprint="abc", timeout=60)
if moment == "before":
    print("ready", flush=True)
    time.sleep(60)
subprocess.Popen([sys.executable, "-c", PRODUCER, name, moment])  # its "ready" once attached
e = 0
while True:
    r.get(range(40), e)
    if e == 3 and moment == "streaming":
        print("ready", flush=True)
    e += 1
'''
PRODUCER = '''
import sys
from kdcache.store.ring import RingWriter
w = RingWriter(sys.argv[1], create=False, fingerprint="abc", timeout=60)
if sys.argv[2] == "attached":
    print("ready", flush=True)
e = 0
while True:
    w.write(np.arange(40), e, expected(np.arange(40), e, 4))
    e += 1
'''


def start_group(name, moment, tmp_path):
    code = GROUP.replace("PRODUCER", repr(EXPECTED_SRC + "import numpy as np\n" + PRODUCER))
    proc = subprocess.Popen([sys.executable, "-c", code, name, moment], cwd=REPO, env=ENV, text=True,
                            stdout=subprocess.PIPE, stderr=open(tmp_path / "group.err", "w"),
                            start_new_session=True)
    proc.err_path = tmp_path / "group.err"
    return proc


def group_alive(pgid):
    """Pids of the group's processes that still run (zombies excepted: an init may never reap them)."""
    alive = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                state, _, pgrp = f.read().rsplit(b")", 1)[1].split()[:3]
        except (OSError, ValueError):
            continue
        if int(pgrp) == pgid and state != b"Z":
            alive.append(int(pid))
    return alive


def kill_group(proc):
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(20)
    deadline = time.monotonic() + 10
    while group_alive(proc.pid):  # the producer, the resource tracker: all of the group gone
        assert time.monotonic() < deadline, "the process group outlived SIGKILL"
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("moment", ["before", "attached", "streaming"])
def test_kill_9_of_the_process_group_leaves_nothing(ring_name, tmp_path, moment):
    for _ in range(2):
        proc = start_group(ring_name, moment, tmp_path)
        try:
            wait_ready(proc)
            assert seg(ring_name).exists() == (moment == "before")  # only the creator holds it: named
        finally:
            kill_group(proc)
        if moment == "before":   # its creator is dead: gc's cleanup removes it
            assert stale_and_removed(ring_name)
        assert not seg(ring_name).exists(), "a shared-memory ring was left behind"


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_kill_9_of_the_process_group_at_random_moments_then_gc(ring_name, tmp_path):
    rng = np.random.default_rng(7)
    for delay in rng.uniform(0.0, 2.5, 8):
        proc = start_group(ring_name, "streaming", tmp_path)
        time.sleep(delay)
        kill_group(proc)
        run_cleanup()
        assert not seg(ring_name).exists(), f"a ring was left behind (killed after {delay:.2f} s)"


def test_the_name_goes_when_the_peer_is_another_process(ring_name, tmp_path):
    proc = spawn('''
import sys, time
from kdcache.store.ring import RingReader
r = RingReader(sys.argv[1], create=True, num_classes=3, fingerprint="abc", timeout=5)
print("ready", flush=True)
time.sleep(60)
''', ring_name, tmp_path)
    try:
        wait_ready(proc)
        with RingWriter(ring_name, create=False, fingerprint="abc", timeout=5) as w:
            assert w.consumer_alive() and not seg(ring_name).exists()
    finally:
        proc.kill()
        proc.wait()
