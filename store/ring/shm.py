"""The ring's POSIX shared-memory segment and the liveness of the processes that share it."""
import mmap
import os
import re
import secrets
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from ..errors import StoreError
from .layout import _HEADER, MAGIC

try:  # what SharedMemory itself uses on POSIX; lets a peer map a segment without its tracker
    import _posixshmem
except ImportError:  # pragma: no cover - Windows has no /dev/shm rings
    _posixshmem = None

PREFIX = "kdcache-ring-"
SHM_DIR = "/dev/shm"

_BEAT_S = 0.5          # heartbeat period of the background thread
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


# --- the segment ----------------------------------------------------------------------------

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


# --- stale segments -------------------------------------------------------------------------

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
