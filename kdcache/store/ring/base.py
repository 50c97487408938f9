"""What RingWriter and RingReader share: open the ring, claim a side, watch the peer, wait, close."""
import os
import threading
import time
import weakref

import numpy as np

from kdcache.signals import sleep as wait  # a command's Ctrl-C ends a wait for the other side at once
from ..format.codec import make_codec
from ..errors import CacheNotFoundError, FingerprintMismatchError, StoreError, WriterBusyError
from .layout import (_HEADER, CONSUMER, DEFAULT_CAPACITY, DEFAULT_CODEC, DEFAULT_DTYPE, FINISHED,
                     LAYOUT_VERSION, LEFT, MAGIC, PRODUCER, RUNNING, _bad_slot_state, _check_header, _find_slots,
                     _read_header, _ready_beyond_count, _sized_layout)
from .shm import _BEAT_S, SHM_DIR, _beat_loop, _pid_alive, _ring_name, _Segment, _start_time

_CHECK_S = 0.05        # how often a blocked call looks at the peer's liveness
_IN_FLIGHT_S = 0.5     # how long a running producer may take between marking rows READY and counting them
_MIN_SLEEP, _MAX_SLEEP = 50e-6, 5e-3


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
        except BaseException:
            self._release()
            raise
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=_beat_loop, daemon=True, name=f"{self.name}-{role}-heartbeat",
            args=(self.hdr, role, self._stop, min(_BEAT_S, self.liveness_timeout / 4),
                  self._seg.drop_name if self.creator else None))
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
        parts, total = _sized_layout(self.name, self.capacity, self.num_classes, self.codec)
        taken = StoreError(f"ring {self.name} exists already ({SHM_DIR}/{self.name}): attach to it with "
                           f"create=False, pass another name, or, if its creator is gone, remove it with "
                           f"store.ring.cleanup_stale()")
        try:
            self._seg = _Segment.create(self.name, total)
        except FileExistsError:
            raise taken from None
        self._map(parts)
        h, me = self.hdr, os.getpid()
        h["version"], h["capacity"], h["num_classes"] = LAYOUT_VERSION, self.capacity, self.num_classes
        h["codec"], h["dtype"] = self.codec.spec.encode(), self.dtype.encode()
        h["total_bytes"], h["creator_pid"], h["creator_start"] = total, me, _start_time(me)
        h["fingerprint"], h["fingerprinted"] = (fingerprint or "").encode(), fingerprint is not None
        self.fingerprint = fingerprint
        self._claim()
        h["magic"] = MAGIC
        try:
            self._seg.publish()  # under its name only now: a peer never sees half a header
        except FileExistsError:
            raise taken from None

    def _attach(self, capacity, num_classes, codec, dtype, fingerprint):
        """Map the ring named self.name, check all of it, claim the side its creator left free and
        remove its name: both sides hold the mapping, and a crash of either leaves nothing behind."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                self._seg = _Segment.attach(self.name)
                break
            except FileNotFoundError:
                busy = False
            except BlockingIOError:
                busy = True
            if time.monotonic() > deadline:
                if busy:
                    raise StoreError(f"ring {self.name} was being attached by another process for "
                                     f"{self.timeout:g} s: a ring takes one producer and one consumer")
                raise CacheNotFoundError(
                    f"no ring named {self.name} appeared within {self.timeout:g} s: start the side that "
                    f"creates it (create=True) first, pass its .name to this side, or raise timeout= "
                    f"(a ring takes one producer and one consumer: its name goes once both hold it)")
            wait(0.01)
        try:
            self._check(capacity, num_classes, codec, dtype, fingerprint)
            self._claim()
            self.hdr["attached"] = 1
            self._seg.drop_name()
        finally:
            self._seg.done_attaching()

    def _check(self, capacity, num_classes, codec, dtype, fingerprint):
        """Take the geometry from the header once every field of it checks out, then the slots."""
        h = _check_header(self.name, _read_header(self._seg.buf), self._seg.size)
        self.capacity, self.num_classes, self.fingerprint = h["capacity"], h["num_classes"], h["fingerprint"]
        if fingerprint is not None and fingerprint != self.fingerprint:
            found = ("was created without a fingerprint" if self.fingerprint is None else
                     f"streams targets for fingerprint {self.fingerprint}")
            raise FingerprintMismatchError(
                f"ring {self.name} {found}, this side expects {fingerprint} (another teacher, data set, "
                f"views or codec): start the producer with the trainer's options, or let the trainer start it")
        self.codec, self.dtype = h["codec"], h["dtype"]
        if num_classes is not None and int(num_classes) != self.num_classes:
            raise StoreError(f"ring {self.name} holds {self.num_classes} classes, you passed "
                             f"num_classes={num_classes}: pass the same number on both sides, or "
                             f"leave it out (None) to take the ring's")
        if dtype is not None and _dtype_name(dtype) != self.dtype:
            raise StoreError(f"ring {self.name} stores dtype {self.dtype}, you passed dtype={dtype}: "
                             f"pass the same dtype on both sides, or leave it out (None)")
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
        self._map(h["parts"])
        damage = _bad_slot_state(self.name, self.state)
        if damage is not None:
            raise damage
        deadline = time.monotonic() + _IN_FLIGHT_S
        while True:
            state = np.array(self.state)  # the states, then the counter: a producer counts rows after it marks them
            damage = _ready_beyond_count(self.name, state, int(self.hdr["write_count"]))
            if damage is None:
                return
            if time.monotonic() > deadline or not (int(self.hdr["producer_state"]) == RUNNING and
                                                   self._alive(PRODUCER)):
                raise damage
            time.sleep(0.005)  # a running producer between marking rows and counting them: look again

    def _map(self, parts):
        buf = self._seg.buf
        self.hdr = np.ndarray((), _HEADER, buffer=buf)
        views = {name: np.ndarray(shape, dtype, buffer=buf, offset=off)
                 for name, (off, shape, dtype) in parts.items()}
        self.state, self.keys = views.pop("state"), views.pop("keys")
        self.fields = {name[2:]: v for name, v in views.items()}
        self.fast_take = (self.codec.spec == "full" and self.codec.dtype == np.float32)

    def _claim(self):
        """Take this side's place in the header. A place is taken once: by the creator, then by the
        one peer that attaches (the ring's name goes then)."""
        h, r, me = self.hdr, self.role, os.getpid()
        pid = int(h[r + "_pid"])
        if pid:
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
        or 'hung'."""
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

    def find(self, q, guess):
        """Slots of the keys q [n, 2] (-1 where absent) and the next guess: _find_slots()."""
        return _find_slots(self.state, self.keys, q, guess)

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
            if self.creator:
                self._seg.drop_name()
            self._seg.close()
            self._seg = None


class _Side:
    """The public face both sides share: open a _Ring for `role`, copy its geometry out, report
    on the peer, close (also when dropped without close(): as gone without finishing)."""

    role = None            # PRODUCER or CONSUMER
    _PEER_GONE = StoreError  # what a call raises once the peer died, hung or closed
    _CLEAN_EXIT = LEFT     # the state a `with` block that ends without an exception leaves

    def __init__(self, name, create, *, capacity=None, num_classes=None, codec=None, dtype=None,
                 timeout=60.0, liveness_timeout=5.0, fingerprint=None):
        self._ring = _Ring(self.role, name, create=create, capacity=capacity, num_classes=num_classes,
                           codec=codec, dtype=dtype, timeout=timeout, liveness_timeout=liveness_timeout,
                           fingerprint=fingerprint)
        r = self._ring
        self.name, self.capacity, self.num_classes, self.fingerprint = r.name, r.capacity, r.num_classes, \
            r.fingerprint
        self.codec, self.dtype = r.codec.spec, r.dtype
        self._lock = threading.Lock()
        # Dropped without close(): the peer is told this side left, never that it finished.
        self._finalizer = weakref.finalize(self, r.close, LEFT)

    def _peer_alive(self):
        """True while the peer (the consumer of a writer, the producer of a reader) is attached,
        has not closed, runs and beats."""
        return not self._ring.closed and self._ring.peer_status() is None

    def _peer_gone(self, status, consequence):
        raise self._PEER_GONE(f"ring {self.name}: {self._ring.describe_peer(status)}; {consequence}")

    def _close(self, state):
        self._ring.close(state)
        self._finalizer.detach()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self._close(self._CLEAN_EXIT if exc_type is None else LEFT)


def _dtype_name(dtype):
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


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
        wait(self.delay)
        self.waited += time.monotonic() - t
        self.delay = min(self.delay * 2, _MAX_SLEEP)
