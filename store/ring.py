"""Bounded shared-memory ring buffer of soft targets: the store's streaming mode, nothing persisted."""
# One segment in /dev/shm (POSIX shared memory, mode 0o600), all numpy views over one buffer:
#   header   one record of _HEADER: magic, layout version, geometry (capacity, num_classes,
#            codec spec, dtype), creator pid, then per side (producer, consumer): pid, process
#            start time (tells a reused pid apart), heartbeat (time.monotonic, system-wide on
#            Linux), state (running / finished / left); and the producer's write counter.
#   state    uint8 [capacity]: EMPTY or READY. The producer writes row, then key, then READY;
#            the consumer copies a READY row out, then sets EMPTY. x86 keeps stores in order,
#            so the byte written last publishes the row (single producer, single consumer).
#   keys     int64 [capacity, 2]: (sample index, epoch) of each slot.
#   fields   one array [capacity, *shape] per codec field (codec.fields), 64-byte aligned.
# The producer fills slots in FIFO order from its head (slot write_count % capacity) and waits
# while that slot is not EMPTY; the consumer finds keys wherever they are, so correctness never
# depends on order, but the producer waits on the oldest unread row: read in about the order
# written, within a window of `capacity` rows.
import mmap
import os
import re
import secrets
import threading
import time
import weakref
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from . import schema
from .codec import _finite_or_raise, make_codec
from .errors import (BadInputError, CacheNotFoundError, ConsumerGoneError, FingerprintMismatchError,
                     MissingTargetsError, ProducerGoneError, StoreError, UnsupportedFormatError,
                     WriterBusyError)

try:  # what SharedMemory itself uses on POSIX; lets a peer map a segment without its tracker
    import _posixshmem
except ImportError:  # pragma: no cover - Windows has no /dev/shm rings
    _posixshmem = None

PREFIX = "kdcache-ring-"
SHM_DIR = "/dev/shm"
LAYOUT_VERSION = 2     # bump when a ring written by this code cannot be read by older code (2: fingerprint)
MAGIC = b"KDCRING1"

EMPTY, READY = 0, 1
RUNNING, FINISHED, LEFT = 0, 1, 2          # a side's state in the header
PRODUCER, CONSUMER = "producer", "consumer"

DEFAULT_CAPACITY = 4096
DEFAULT_CODEC = "full"
DEFAULT_DTYPE = "float16"

_HEADER = np.dtype([
    ("magic", "S8"), ("version", "<i8"), ("capacity", "<i8"), ("num_classes", "<i8"),
    ("codec", "S32"), ("dtype", "S16"), ("total_bytes", "<i8"),
    ("creator_pid", "<i8"), ("creator_start", "<i8"),
    ("producer_pid", "<i8"), ("producer_start", "<i8"), ("producer_beat", "<f8"), ("producer_state", "<i8"),
    ("consumer_pid", "<i8"), ("consumer_start", "<i8"), ("consumer_beat", "<f8"), ("consumer_state", "<i8"),
    ("write_count", "<i8"), ("fingerprint", "S32"),
])
_ALIGN = 64
_BEAT_S = 0.5          # heartbeat period of the background thread
_CHECK_S = 0.05        # how often a blocked call looks at the peer's liveness
_MIN_SLEEP, _MAX_SLEEP = 50e-6, 5e-3
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_NAME_PID_RE = re.compile(r"^" + re.escape(PREFIX) + r"(\d+)-")


# --- processes ------------------------------------------------------------------------------

def _proc_stat(pid):
    """(state letter, start time in clock ticks) from /proc/<pid>/stat, or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    rest = data[data.rfind(b")") + 2:].split()
    try:
        return rest[0].decode(), int(rest[19])
    except (IndexError, ValueError):
        return None


def _start_time(pid):
    st = _proc_stat(pid)
    return st[1] if st else 0


def _pid_alive(pid, start=0):
    """True while process `pid` runs; a zombie, or another process that reused the pid, is dead."""
    pid = int(pid)
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    st = _proc_stat(pid)
    if st is None:
        return True
    state, started = st
    if state in ("Z", "X", "x"):
        return False
    return not (start and started != start)


# --- the segment ----------------------------------------------------------------------------

def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(capacity, codec):
    """{part: (offset, shape, dtype)} and the total size in bytes."""
    parts, off = {}, _align(_HEADER.itemsize)
    for name, shape, dtype in [("state", (), np.uint8), ("keys", (2,), np.int64)] + \
            [("f:" + n, s, d) for n, s, d in codec.fields]:
        shape = (capacity,) + tuple(shape)
        parts[name] = (off, shape, np.dtype(dtype))
        off = _align(off + int(np.prod(shape)) * np.dtype(dtype).itemsize)
    return parts, off


def _ring_name(name, create):
    if name is None:
        if not create:
            raise StoreError("attaching to a ring (create=False) needs its name: pass the name the "
                             "creating side reports as .name")
        return f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    name = str(name).lstrip("/")
    if not name.startswith(PREFIX):
        name = PREFIX + name  # every ring carries the prefix, so cleanup_stale() finds it
    if not _NAME_RE.match(name):
        raise StoreError(f"ring name {name!r} is invalid: use letters, digits, '.', '_' or '-' "
                         f"(at most 200 characters)")
    return name


def _unlink_name(name):
    """Remove the segment's name (mappings stay valid); False if it was already gone."""
    try:
        if _posixshmem is not None:
            _posixshmem.shm_unlink("/" + name)
        else:  # pragma: no cover
            os.unlink(os.path.join(SHM_DIR, name))
        return True
    except FileNotFoundError:
        return False


class _NotReady(Exception):
    """The segment exists but its creator has not sized it yet."""


class _Segment:
    """A mapped segment. The creator goes through SharedMemory, whose resource_tracker unlinks
    the name if the creator is killed. A peer maps it directly: SharedMemory(create=False) would
    register it with the peer's tracker too, and unregistering afterwards is not safe either,
    because spawn and fork children share their parent's tracker (and one process may hold
    both sides): the unregister would drop the creator's own entry."""

    def __init__(self, name, size=None):
        self.name, self._shm, self._mm = name, None, None
        if size is not None:
            self._shm = shared_memory.SharedMemory(name, create=True, size=size)
            self.buf = self._shm.buf
            try:
                # Commit the pages now: a full /dev/shm then fails here with a clear error
                # instead of killing a later write with SIGBUS.
                os.posix_fallocate(self._shm._fd, 0, size)
            except OSError as e:
                if e.errno == 28:  # ENOSPC
                    self.close()
                    self.unlink()
                    raise StoreError(
                        f"ring {name}: {size / 2**20:.1f} MiB do not fit in {SHM_DIR} (no space left): "
                        f"lower capacity, use codec topk:K, or give the machine/container more "
                        f"shared memory (docker run --shm-size)") from None
            except AttributeError:  # pragma: no cover
                pass
        else:
            if _posixshmem is not None:
                fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
            else:  # pragma: no cover
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
            try:
                size = os.fstat(fd).st_size
                if size < _HEADER.itemsize:
                    raise _NotReady
                self._mm = mmap.mmap(fd, size)
            finally:
                os.close(fd)
            self.buf = memoryview(self._mm)
        self.size = len(self.buf)

    def close(self):
        try:
            if self._shm is not None:
                self._shm.close()
            elif self._mm is not None:
                self.buf.release()
                self._mm.close()
        except BufferError:
            # A view is still referenced (say by a traceback); the mapping ends with the process.
            pass

    def unlink(self):
        if self._shm is None:
            return _unlink_name(self.name)
        try:
            self._shm.unlink()
            return True
        except FileNotFoundError:
            # The peer removed the name already (it took us for dead); drop our tracker entry.
            resource_tracker.unregister(self._shm._name, "shared_memory")
            return False


def _beat_loop(hdr, role, name, watch_creator, stop, period):
    """Background heartbeat, so a slow teacher step is not taken for death. A peer also removes
    the segment's name as soon as its creator is dead (a crashed creator's tracker may belong
    to a parent process that lives on)."""
    field = role + "_beat"
    while not stop.wait(period):
        hdr[field] = time.monotonic()
        if watch_creator and not _pid_alive(int(hdr["creator_pid"]), int(hdr["creator_start"])):
            _unlink_name(name)
            watch_creator = False


class _Ring:
    """The mapping, the views and the liveness logic shared by RingWriter and RingReader."""

    def __init__(self, role, name, *, create, capacity, num_classes, codec, dtype, timeout,
                 liveness_timeout, fingerprint=None):
        self.role, self.peer = role, (CONSUMER if role == PRODUCER else PRODUCER)
        self.timeout = float(timeout)
        self.liveness_timeout = float(liveness_timeout)
        if self.timeout < 0 or self.liveness_timeout <= 0:
            raise StoreError(f"timeout must be >= 0 and liveness_timeout > 0 (got {timeout}, "
                             f"{liveness_timeout})")
        self.name = _ring_name(name, create)
        self.creator = bool(create)
        self.closed = False
        self.hdr = self.state = self.keys = None
        self.fields = {}
        self._seg = None
        try:
            if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint.isalnum()
                                            or len(fingerprint) > 32):
                raise StoreError(f"fingerprint must be a cache fingerprint (letters and digits, at most 32), "
                                 f"got {fingerprint!r}")
            if create:
                self._create(capacity, num_classes, codec, dtype, fingerprint)
            else:
                self._attach(capacity, num_classes, codec, dtype, fingerprint)
            self._claim()
        except BaseException:
            self._release()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_beat_loop, daemon=True, name=f"{self.name}-{role}-heartbeat",
            args=(self.hdr, role, self.name, not self.creator, self._stop,
                  min(_BEAT_S, self.liveness_timeout / 4)))
        self._thread.start()

    # --- setting up ---
    def _create(self, capacity, num_classes, codec, dtype, fingerprint):
        if num_classes is None:
            raise StoreError("creating a ring (create=True) needs num_classes: pass the teacher's "
                             "number of classes")
        capacity = DEFAULT_CAPACITY if capacity is None else capacity
        if isinstance(capacity, bool) or not isinstance(capacity, (int, np.integer)) or capacity < 1:
            raise StoreError(f"capacity must be a positive integer (rows), got {capacity!r}")
        if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or num_classes < 1:
            raise StoreError(f"num_classes must be a positive integer, got {num_classes!r}")
        self.codec = make_codec(DEFAULT_CODEC if codec is None else codec, int(num_classes),
                                DEFAULT_DTYPE if dtype is None else dtype)
        self.capacity, self.num_classes = int(capacity), int(num_classes)
        self.dtype = self.codec.dtype.name
        parts, total = _layout(self.capacity, self.codec)
        try:
            self._seg = _Segment(self.name, size=total)
        except FileExistsError:
            raise StoreError(f"ring {self.name} exists already: attach to it with create=False, or, "
                             f"if its creator is gone, remove it with store.ring.cleanup_stale()") from None
        self._map(parts)
        h, me = self.hdr, os.getpid()
        h["version"], h["capacity"], h["num_classes"] = LAYOUT_VERSION, self.capacity, self.num_classes
        h["codec"], h["dtype"] = self.codec.spec.encode(), self.dtype.encode()
        h["total_bytes"], h["creator_pid"], h["creator_start"] = total, me, _start_time(me)
        h["fingerprint"] = (fingerprint or "").encode()
        self.fingerprint = fingerprint
        h["magic"] = MAGIC  # last: a peer trusts the header once it sees the magic

    def _attach(self, capacity, num_classes, codec, dtype, fingerprint):
        deadline = time.monotonic() + self.timeout
        while True:
            seen = False
            try:
                self._seg = _Segment(self.name)
                seen = True
                hdr = np.ndarray((), _HEADER, buffer=self._seg.buf)
                ok = bytes(hdr["magic"]) == MAGIC
                del hdr
                if ok:
                    break
                self._seg.close()
                self._seg = None
            except (FileNotFoundError, _NotReady):
                pass
            except PermissionError:
                raise StoreError(f"ring {self.name} belongs to another user (mode 0o600): run both "
                                 f"sides as the same user") from None
            if time.monotonic() > deadline:
                if seen:
                    raise UnsupportedFormatError(
                        f"{SHM_DIR}/{self.name} is not a kdcache ring (no valid header after "
                        f"{self.timeout:g} s): pass the right name, or remove it with cleanup_stale()")
                raise CacheNotFoundError(
                    f"no ring named {self.name} appeared within {self.timeout:g} s: start the side that "
                    f"creates it (create=True) first, pass its .name to this side, or raise timeout=")
            time.sleep(0.01)
        h = np.ndarray((), _HEADER, buffer=self._seg.buf)
        version = int(h["version"])
        if version != LAYOUT_VERSION:
            raise UnsupportedFormatError(
                f"ring {self.name} has layout version {version}, this kdcache reads "
                f"{LAYOUT_VERSION}: run the same kdcache version on both sides")
        self.capacity, self.num_classes = int(h["capacity"]), int(h["num_classes"])
        self.fingerprint = h["fingerprint"].item().decode() or None
        if fingerprint is not None and self.fingerprint is not None and fingerprint != self.fingerprint:
            del h
            raise FingerprintMismatchError(
                f"ring {self.name} streams targets for fingerprint {self.fingerprint}, this side expects "
                f"{fingerprint} (another teacher, data set, views or codec): start the producer with the "
                f"trainer's options, or let the trainer start it")
        spec, self.dtype = h["codec"].item().decode(), h["dtype"].item().decode()
        del h
        if num_classes is not None and int(num_classes) != self.num_classes:
            raise StoreError(f"ring {self.name} holds {self.num_classes} classes, you passed "
                             f"num_classes={num_classes}: pass the same number on both sides, or "
                             f"leave it out (None) to take the ring's")
        if dtype is not None and _dtype_name(dtype) != self.dtype:
            raise StoreError(f"ring {self.name} stores dtype {self.dtype}, you passed dtype={dtype}: "
                             f"pass the same dtype on both sides, or leave it out (None)")
        self.codec = make_codec(spec, self.num_classes, self.dtype)
        if codec is not None:
            wanted = make_codec(codec, self.num_classes, self.dtype).spec
            if wanted != self.codec.spec:
                raise StoreError(f"ring {self.name} stores codec {self.codec.spec}, you passed "
                                 f"codec={wanted}: pass the same codec on both sides, or leave it "
                                 f"out (None) to take the ring's")
        if capacity is not None and int(capacity) != self.capacity:
            raise StoreError(f"ring {self.name} has capacity {self.capacity}, you passed "
                             f"capacity={capacity}: only the creating side sets the capacity; "
                             f"leave it out (None) here")
        parts, total = _layout(self.capacity, self.codec)
        if self._seg.size < total:
            raise UnsupportedFormatError(f"ring {self.name} is {self._seg.size} bytes, its header "
                                         f"needs {total}: it is damaged; remove it with cleanup_stale()")
        self._map(parts)

    def _map(self, parts):
        buf = self._seg.buf
        self.hdr = np.ndarray((), _HEADER, buffer=buf)
        views = {name: np.ndarray(shape, dtype, buffer=buf, offset=off)
                 for name, (off, shape, dtype) in parts.items()}
        self.state, self.keys = views.pop("state"), views.pop("keys")
        self.fields = {name[2:]: v for name, v in views.items()}
        self.fast_take = (self.codec.spec == "full" and self.codec.dtype == np.float32)

    def _claim(self):
        h, r, me = self.hdr, self.role, os.getpid()
        pid = int(h[r + "_pid"])
        if pid and int(h[r + "_state"]) == RUNNING and self._alive(r):
            err = WriterBusyError if r == PRODUCER else StoreError
            raise err(f"ring {self.name} has a {r} already (pid {pid}): a ring takes one producer "
                      f"and one consumer; create another ring for another {r}")
        h[r + "_beat"], h[r + "_start"] = time.monotonic(), _start_time(me)
        h[r + "_state"] = RUNNING
        h[r + "_pid"] = me

    # --- liveness ---
    def beat(self):
        self.hdr[self.role + "_beat"] = time.monotonic()

    def _alive(self, side):
        h = self.hdr
        if not _pid_alive(int(h[side + "_pid"]), int(h[side + "_start"])):
            return False
        return time.monotonic() - float(h[side + "_beat"]) <= self.liveness_timeout

    def peer_status(self):
        """None while the peer is attached and alive; else 'absent', 'finished', 'left', 'dead'
        or 'hung'. Removes the segment's name when the peer was its creator and is dead."""
        h, p = self.hdr, self.peer
        pid = int(h[p + "_pid"])
        if pid == 0:
            return "absent"
        state = int(h[p + "_state"])
        if state == FINISHED:
            return "finished"
        if state == LEFT:
            return "left"
        if not _pid_alive(pid, int(h[p + "_start"])):
            if not self.creator and pid == int(h["creator_pid"]):
                _unlink_name(self.name)
            return "dead"
        if time.monotonic() - float(h[p + "_beat"]) > self.liveness_timeout:
            return "hung"
        return None

    def describe_peer(self, status):
        h, p = self.hdr, self.peer
        pid = int(h[p + "_pid"])
        return {
            "finished": f"the {p} (pid {pid}) finished (closed the ring)",
            "left": f"the {p} (pid {pid}) closed the ring without finishing (it stopped on an error)",
            "dead": f"the {p} (pid {pid}) died (its process is gone)",
            "hung": f"the {p} (pid {pid}) has shown no heartbeat for "
                    f"{time.monotonic() - float(h[p + '_beat']):.1f} s (liveness_timeout="
                    f"{self.liveness_timeout:g} s): it is hung or stopped",
            "absent": f"no {p} has attached",
        }[status]

    def check_open(self):
        if self.closed:
            raise StoreError(f"ring {self.name} is closed: open a new RingWriter/RingReader")

    # --- finding keys ---
    def find(self, q, guess):
        """Slot of each key of q [n, 2] among READY slots, -1 where absent; and the next guess.
        In-order reads hit the fast path (the slots right after the last one read); otherwise
        one hash sort of the READY slots, O(R log R), with exact key comparison."""
        n, cap = len(q), self.capacity
        cand = (guess + np.arange(n)) % cap
        ok = self.state[cand] == READY  # state before key: the producer sets READY last
        ok &= (self.keys[cand] == q).all(axis=1)
        slots = np.where(ok, cand, -1)
        rest = np.flatnonzero(~ok)
        if rest.size:
            ready = np.flatnonzero(self.state == READY)
            if ready.size:
                k = self.keys[ready]
                h = _hash(k)
                order = np.argsort(h, kind="stable")
                hs = h[order]
                qr = q[rest]
                qh = _hash(qr)
                pos = np.minimum(np.searchsorted(hs, qh), ready.size - 1)
                same_hash = hs[pos] == qh
                at = order[pos]
                match = same_hash & (k[at] == qr).all(axis=1)
                slots[rest[match]] = ready[at[match]]
                for j in np.flatnonzero(same_hash & ~match):  # a 64-bit hash collision: scan exactly
                    hit = np.flatnonzero((k[:, 0] == qr[j, 0]) & (k[:, 1] == qr[j, 1]))
                    if hit.size:
                        slots[rest[j]] = ready[hit[0]]
        found = np.flatnonzero(slots >= 0)
        if found.size:
            guess = (int(slots[found[-1]]) + 1) % cap
        return slots, guess

    # --- closing ---
    def close(self, state):
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2.0)
        try:
            self.hdr[self.role + "_state"] = state
            self.beat()
        except Exception:  # pragma: no cover - closing must not fail
            pass
        self._release()

    def _release(self):
        self.hdr = self.state = self.keys = None
        self.fields = {}
        if self._seg is not None:
            self._seg.close()
            if self.creator:
                self._seg.unlink()
            self._seg = None


def _dtype_name(dtype):
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _hash(k):
    """64-bit mix of (index, epoch) rows; collisions are resolved by exact comparison."""
    a = k[:, 0].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    b = k[:, 1].astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
    return a ^ (b + (a >> np.uint64(29)))


def _as_keys(indices, epochs):
    idx, ep = np.asarray(indices), np.asarray(epochs)
    if idx.ndim == 0:
        idx = idx.reshape(1)
    if idx.ndim != 1:
        raise BadInputError(f"indices must be a 1-D array of sample indices, got shape {idx.shape}")
    if ep.ndim == 0:
        ep = np.broadcast_to(ep, idx.shape)
    if ep.shape != idx.shape:
        raise BadInputError(f"epochs must be one integer or one per index: got shape {ep.shape} "
                            f"for {idx.shape[0]} indices")
    for what, a in (("indices", idx), ("epochs", ep)):
        if a.size and a.dtype.kind not in "iu":
            raise BadInputError(f"{what} must be integers, got dtype {a.dtype}")
    idx, ep = idx.astype(np.int64), ep.astype(np.int64)
    if idx.size and (idx.min() < 0 or ep.min() < 0):
        raise BadInputError("sample indices and epochs must be >= 0")
    return idx, ep


def _show(keys, limit=3):
    shown = ", ".join(f"({int(i)}, {int(e)})" for i, e in keys[:limit])
    return shown + (" ..." if len(keys) > limit else "")


class _Waiter:
    """Backoff sleeps (50 us doubling to 5 ms), a timeout counted from the last progress, and a
    flag every _CHECK_S seconds to look at the peer."""

    def __init__(self, timeout):
        self.timeout = timeout
        self.last_progress = time.monotonic()
        self.next_check = 0.0
        self.delay = _MIN_SLEEP
        self.waited = 0.0

    def progress(self):
        self.last_progress = time.monotonic()
        self.delay = _MIN_SLEEP

    def check_due(self):
        now = time.monotonic()
        if now >= self.next_check:
            self.next_check = now + _CHECK_S
            return True
        return False

    def expired(self):
        return time.monotonic() - self.last_progress > self.timeout

    def sleep(self):
        t = time.monotonic()
        time.sleep(self.delay)
        self.waited += time.monotonic() - t
        self.delay = min(self.delay * 2, _MAX_SLEEP)


# --- the two sides --------------------------------------------------------------------------

class RingWriter:
    """The producer's side: writes rows of teacher logits by (sample index, epoch) key.

    create=True makes the segment (capacity rows of num_classes logits stored with codec/dtype;
    defaults 4096, "full", "float16"); create=False attaches to `name`, waiting up to `timeout`
    seconds for it to appear, and takes the geometry from its header (num_classes, codec, dtype or
    capacity passed here must agree, else StoreError). `fingerprint` (the cache fingerprint of the
    targets: teacher, data, views, codec) is stored by the creator; an attaching side that passes
    another one is refused (FingerprintMismatchError); None on either side skips the check. The creator removes the segment when it
    closes; an attached peer keeps reading through its mapping, so attach before the creator
    closes. write() blocks while the ring is full; `timeout` counts seconds without progress and
    `liveness_timeout` how long the consumer may go without a heartbeat before it counts as dead.
    """

    def __init__(self, name=None, *, create=True, capacity=None, num_classes=None, codec=None,
                 dtype=None, timeout=60.0, liveness_timeout=5.0, fingerprint=None):
        self._ring = _Ring(PRODUCER, name, create=create, capacity=capacity, num_classes=num_classes,
                           codec=codec, dtype=dtype, timeout=timeout, liveness_timeout=liveness_timeout,
                           fingerprint=fingerprint)
        r = self._ring
        self.name, self.capacity, self.num_classes, self.fingerprint = r.name, r.capacity, r.num_classes, \
            r.fingerprint
        self.codec, self.dtype = r.codec.spec, r.dtype
        self._count = int(r.hdr["write_count"])
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, r.close, LEFT)

    @property
    def written(self):
        """Rows this ring has received from producers so far."""
        return self._count

    def write(self, indices, epochs, logits, *, timeout=None):
        """Write rows logits[i] (float [B, num_classes]) under keys (indices[i], epochs[i]);
        `epochs` may be one integer for the whole batch. Blocks while the ring is full.
        Raises BadInputError (nothing written) for NaN/Inf or bad shapes, ConsumerGoneError if
        the consumer died or left, MissingTargetsError (a TimeoutError; .missing holds the
        [n, 2] keys not written) after `timeout` seconds without a free slot. Returns B."""
        r = self._ring
        r.check_open()
        idx, ep = _as_keys(indices, epochs)
        x = np.asarray(logits)
        if x.ndim != 2 or x.shape != (idx.size, self.num_classes):
            raise BadInputError(f"logits must be [batch, num_classes] = [{idx.size}, {self.num_classes}], "
                                f"got shape {x.shape}")
        if x.dtype.kind != "f":
            x = x.astype(np.float32)
        _finite_or_raise(x, idx, f"RingWriter.write to ring {self.name}")
        enc = r.codec.encode(x, keys=idx)
        timeout = r.timeout if timeout is None else float(timeout)
        with self._lock:
            r.beat()
            state = int(r.hdr["consumer_state"]) if int(r.hdr["consumer_pid"]) else RUNNING
            if state != RUNNING:  # header flags only: a pid check per call costs a /proc read
                self._consumer_gone("finished" if state == FINISHED else "left", idx.size)
            self._write_encoded(idx, ep, enc, timeout)
        return idx.size

    def _write_encoded(self, idx, ep, enc, timeout):
        r, cap, n, done = self._ring, self._ring.capacity, idx.size, 0
        waiter = _Waiter(timeout)
        while done < n:
            m = min(n - done, cap)
            slots = (self._count + np.arange(m)) % cap
            free = r.state[slots] == EMPTY
            k = m if free.all() else int(np.argmin(free))  # free slots from the head on
            if k:
                sl, src = slots[:k], slice(done, done + k)
                for name in r.fields:  # no loop variable holding a view: close() must unmap
                    r.fields[name][sl] = enc[name][src]  # the one copy into shared memory
                r.keys[sl, 0] = idx[src]
                r.keys[sl, 1] = ep[src]
                r.state[sl] = READY                 # last: publishes the rows
                self._count += k
                r.hdr["write_count"] = self._count
                done += k
                waiter.progress()
                continue
            if waiter.check_due():
                r.beat()
                status = r.peer_status()
                if status not in (None, "absent"):
                    self._consumer_gone(status, n - done)
                if waiter.expired():
                    missing = np.stack([idx[done:], ep[done:]], axis=1)
                    if status == "absent":
                        why = (f"no consumer has attached within {timeout:g} s: start the trainer "
                               f"reading ring {self.name}, or raise timeout=")
                    else:
                        why = (f"the consumer (pid {int(r.hdr['consumer_pid'])}) is alive but freed "
                               f"no slot for {timeout:g} s. The producer fills slots in order and "
                               f"waits for the oldest unread row, so the trainer must read about in "
                               f"the order written, within capacity={cap} rows: check both sides use "
                               f"the same schedule, raise capacity, or raise timeout=")
                    raise MissingTargetsError(
                        f"ring {self.name} is full ({cap} rows); {n - done} of {n} rows not written "
                        f"(first: {_show(missing)}): {why}", missing=missing)
            waiter.sleep()

    def _consumer_gone(self, status, left):
        raise ConsumerGoneError(
            f"ring {self.name}: {self._ring.describe_peer(status)}; {left} row(s) of this batch were "
            f"not written and nobody will read them. Look at the trainer's log for why it stopped, "
            f"then restart the trainer and the producer together")

    def consumer_alive(self):
        """True while a consumer is attached, has not closed, runs and beats."""
        return not self._ring.closed and self._ring.peer_status() is None

    def close(self, finished=True):
        """Mark the producer finished (finished=True) or gone without finishing (False), stop the
        heartbeat, unmap, and remove the segment if this side created it. Idempotent."""
        self._ring.close(FINISHED if finished else LEFT)
        self._finalizer.detach()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close(finished=exc_type is None)


class RingReader:
    """The trainer's side: reads rows by (sample index, epoch) key as float32 logits.

    Same options as RingWriter (create=False by default: attach to the producer's ring).
    get() blocks until every requested key is present and frees their slots; `timeout` counts
    seconds without progress, `liveness_timeout` how long the producer may go without a heartbeat.
    """

    def __init__(self, name=None, *, create=False, capacity=None, num_classes=None, codec=None,
                 dtype=None, timeout=60.0, liveness_timeout=5.0, fingerprint=None):
        self._ring = _Ring(CONSUMER, name, create=create, capacity=capacity, num_classes=num_classes,
                           codec=codec, dtype=dtype, timeout=timeout, liveness_timeout=liveness_timeout,
                           fingerprint=fingerprint)
        r = self._ring
        self.name, self.capacity, self.num_classes, self.fingerprint = r.name, r.capacity, r.num_classes, \
            r.fingerprint
        self.codec, self.dtype = r.codec.spec, r.dtype
        self.stall_s = 0.0  # total seconds get() spent waiting for rows
        self._guess = 0
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, r.close, LEFT)

    def get(self, indices, epochs, *, timeout=None):
        """float32 [B, num_classes] logits of keys (indices[i], epochs[i]) (`epochs` may be one
        integer); blocks until every key is present, copies the rows out and frees their slots.
        Rows are consumed as they arrive (so B may exceed the capacity): if get() raises, rows it
        already took are gone. Raises ProducerGoneError when the producer died, hung or closed
        without writing them, MissingTargetsError (.missing: [n, 2] keys) after `timeout` seconds
        without a new row."""
        r = self._ring
        r.check_open()
        idx, ep = _as_keys(indices, epochs)
        q = np.stack([idx, ep], axis=1)
        out = np.empty((idx.size, self.num_classes), np.float32)
        timeout = r.timeout if timeout is None else float(timeout)
        with self._lock:
            r.beat()
            waiter = _Waiter(timeout)
            pending = np.arange(idx.size)
            seen = None
            try:
                while pending.size:
                    count = int(r.hdr["write_count"])
                    if count != seen:  # nothing can have appeared unless the counter moved
                        seen = count
                        if self._take(q, pending, out):
                            pending = pending[self._left]
                            waiter.progress()
                            continue
                    if waiter.check_due():
                        r.beat()
                        status = r.peer_status()
                        if status not in (None, "absent"):
                            # The producer stopped; what it wrote before that is visible now.
                            if self._take(q, pending, out):
                                pending = pending[self._left]
                            if pending.size:
                                self._producer_gone(status, q[pending], idx.size)
                            break
                        if waiter.expired():
                            self._timed_out(status, q[pending], idx.size, timeout)
                    waiter.sleep()
            finally:
                self.stall_s += waiter.waited
        return out

    def _take(self, q, pending, out):
        """Copy out the pending rows present now and free their slots; sets self._left (mask of
        pending rows still missing). Returns whether any row was taken."""
        r = self._ring
        slots, self._guess = r.find(q[pending], self._guess)
        hit = slots >= 0
        self._left = ~hit
        if not hit.any():
            return False
        s = slots[hit]
        if hit.all() and pending.size == len(out):
            if r.fast_take:
                np.take(r.fields[schema.LOGITS], s, axis=0, out=out, mode="clip")
            else:
                r.codec.decode({name: arr[s] for name, arr in r.fields.items()}, out=out)
        else:
            out[pending[hit]] = r.codec.decode({name: arr[s] for name, arr in r.fields.items()})
        r.state[s] = EMPTY  # after the copy: the producer may overwrite from here on
        return True

    def _producer_gone(self, status, missing, n):
        fix = {"finished": "the producer and the trainer disagree on the keys: check both use the "
                           "same schedule (seed, epochs, views) and data set, and that the producer "
                           "was not stopped early",
               "left": "see the producer's log for its error, fix it and restart the producer",
               "dead": "see the producer's log (or the kernel log: out of memory is common), then "
                       "restart the producer",
               "hung": "see what the producer is doing (py-spy dump), or raise liveness_timeout "
                       "if its steps are that slow"}[status]
        raise ProducerGoneError(
            f"ring {self.name}: {self._ring.describe_peer(status)}; {len(missing)} of the {n} "
            f"requested keys were never written (first: {_show(missing)}): {fix}")

    def _timed_out(self, status, missing, n, timeout):
        r = self._ring
        if status == "absent":
            why = (f"no producer has attached: start the producer (cache builder) writing to ring "
                   f"{self.name}, or raise timeout=")
        else:
            why = (f"the producer (pid {int(r.hdr['producer_pid'])}) is alive but slower than the "
                   f"trainer, stuck, or producing other keys: check both sides use the same "
                   f"schedule, give the producer more cores, or raise timeout=")
            if np.count_nonzero(r.state == READY) == r.capacity:
                why += (f". The ring is full of rows the trainer did not ask for: read about in the "
                        f"order written, or raise capacity (now {r.capacity})")
        raise MissingTargetsError(
            f"ring {self.name}: {len(missing)} of {n} requested keys (first: {_show(missing)}) did "
            f"not appear within {timeout:g} s; {why}", missing=missing)

    def missing(self, indices, epochs):
        """Boolean mask, one per key: True where (indices[i], epochs[i]) is not in the ring now.
        Does not wait and frees nothing."""
        r = self._ring
        r.check_open()
        idx, ep = _as_keys(indices, epochs)
        slots, _ = r.find(np.stack([idx, ep], axis=1), self._guess)
        return slots < 0

    def producer_alive(self):
        """True while a producer is attached, has not closed, runs and beats."""
        return not self._ring.closed and self._ring.peer_status() is None

    def close(self):
        """Mark the consumer gone, stop the heartbeat, unmap, and remove the segment if this side
        created it. Idempotent."""
        self._ring.close(LEFT)
        self._finalizer.detach()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()


def cleanup_stale(dry_run=False):
    """Remove /dev/shm/kdcache-ring-* segments whose creator process is gone (pid from the header,
    or from the name while the header is unwritten); return their names. dry_run: only list them.
    Segments of other users, or whose creator cannot be told, are left alone."""
    if not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(PREFIX):
            continue
        pid, start = _creator_of(name)
        if pid is None or _pid_alive(pid, start):
            continue
        if not dry_run:
            try:
                if not _unlink_name(name):
                    continue
            except PermissionError:
                continue
        removed.append(name)
    return removed


def _creator_of(name):
    try:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
    except OSError:
        return None, 0
    try:
        data = os.read(fd, _HEADER.itemsize)
    finally:
        os.close(fd)
    if len(data) == _HEADER.itemsize:
        h = np.frombuffer(data, _HEADER)[0]
        if bytes(h["magic"]) == MAGIC:
            return int(h["creator_pid"]), int(h["creator_start"])
    m = _NAME_PID_RE.match(name)
    return (int(m.group(1)), 0) if m else (None, 0)
