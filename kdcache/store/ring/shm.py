"""The ring's POSIX shared-memory segment and the liveness of the processes that share it."""
import errno
import fcntl
import mmap
import os
import re
import secrets
import stat
import threading
import time
from multiprocessing import resource_tracker

import numpy as np

from ..errors import StoreError
from .layout import _HEADER, MAGIC, MAX_BYTES

PREFIX = "kdcache-ring-"
SHM_DIR = "/dev/shm"

_BEAT_S = 0.5          # heartbeat period of the background thread
_NAME_RE = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_NAME_PID_RE = re.compile(r"^" + re.escape(PREFIX) + r"(\d+)-")
# Names in /dev/shm are anyone's to plant: never follow a link, never block (a FIFO would).
_OPEN = os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


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


def _beat_loop(hdr, role, stop, period, on_attached=None):
    """Background heartbeat, so a slow teacher step is not taken for death. The creator also
    learns here that the peer attached (and removed the segment's name): on_attached()."""
    field = role + "_beat"
    while not stop.wait(period):
        hdr[field] = time.monotonic()
        if on_attached is not None and int(hdr["attached"]):
            on_attached()
            on_attached = None


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


def _path(name):
    return os.path.join(SHM_DIR, name)


def _kind(mode):
    """What a file of st_mode `mode` is, when it is not a regular file; None when it is."""
    for is_kind, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                          (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                          (stat.S_ISBLK, "a block device"), (stat.S_ISDIR, "a directory")):
        if is_kind(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


def _distrust(path, st):
    """Why the file of os.stat_result `st` at `path` cannot be a ring of this user's; None if it can."""
    kind = _kind(st.st_mode)
    if kind:
        return f"{path} is {kind}, not a ring (a regular file)"
    if st.st_uid != os.getuid():
        return f"{path} belongs to user {st.st_uid}, not to this user ({os.getuid()})"
    if st.st_mode & 0o022:
        who = " and ".join(w for bit, w in ((0o020, "its group"), (0o002, "others")) if st.st_mode & bit)
        return f"{path} is writable by {who} (mode 0o{stat.S_IMODE(st.st_mode):03o})"
    return None


def _open_trusted(name):
    """(fd, os.stat_result) of /dev/shm/<name>, opened read-write without following a symbolic link
    or blocking (a FIFO would), once it is known to be a regular file of this user that no one else
    may write. FileNotFoundError while there is no such name; StoreError, one line naming the path,
    for anything else found there. Nothing is opened that is not a regular file: opening a device
    can act on it."""
    path = _path(name)
    st = os.lstat(path)
    why = _distrust(path, st)
    if why is None:
        try:
            fd = os.open(path, _OPEN)
        except FileNotFoundError:
            raise
        except OSError as e:  # ELOOP: a link put there meanwhile
            why = f"{path} cannot be opened without following links or blocking ({e.strerror})"
        else:
            try:
                st = os.fstat(fd)  # what was opened, not what the name pointed at before
                why = _distrust(path, st)
            except BaseException:
                os.close(fd)
                raise
            if why is None:
                return fd, st
            os.close(fd)
    raise StoreError(f"ring {name}: {why}; a kdcache ring is a regular file of the user running both sides, "
                     f"writable by that user only (mode 0600): pass another ring name, or remove {path} "
                     f"if nothing of yours uses it")


def _unlink_if(name, ident):
    """Remove /dev/shm/<name> if it is still the file `ident` (st_dev, st_ino): never a file put
    under the same name since. False when it was gone or another file."""
    try:
        st = os.lstat(_path(name))
        if (st.st_dev, st.st_ino) != ident:
            return False
        os.unlink(_path(name))
        return True
    except FileNotFoundError:
        return False


# The creator's resource tracker removes the name if the creator dies before the peer attaches.
# Counted per name in this process: two rings of one name (the first's name gone) share one entry.
_tracked, _tracked_lock = {}, threading.Lock()


def _track(name, add):
    with _tracked_lock:
        n = _tracked.get(name, 0) + (1 if add else -1)
        if add and n == 1:
            resource_tracker.register("/" + name, "shared_memory")
        elif not add and n == 0:
            resource_tracker.unregister("/" + name, "shared_memory")
        if n > 0:
            _tracked[name] = n
        else:
            _tracked.pop(name, None)


class _Segment:
    """A mapped segment: buf (a memoryview), size, and its name while it is this segment's.

    create() makes it under a temporary name (the creator's pid in it, so cleanup_stale() knows
    whose it is), O_CREAT|O_EXCL, mode 0600; publish() gives it its name once its header is
    written (a hard link, which never replaces a file: a peer sees a whole ring or none).
    attach() maps an existing one (see _open_trusted) and keeps its descriptor, flocked, until
    done_attaching(): two peers attaching at once take turns."""

    def __init__(self, name, fd, mm, st, temp=None):
        self.name, self.fd, self._mm, self.temp = name, fd, mm, temp
        self.buf, self.size = memoryview(mm), len(mm)
        self.ident, self.pid = (st.st_dev, st.st_ino), os.getpid()
        self.named = self.tracked = False
        self._lock = threading.Lock()  # drop_name(): the creator's heartbeat thread, or close()

    @classmethod
    def create(cls, name, size):
        if os.path.lexists(_path(name)):
            raise FileExistsError(name)
        temp = f"{PREFIX}{os.getpid()}-new-{secrets.token_hex(6)}"
        fd = os.open(_path(temp), _OPEN | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            os.ftruncate(fd, size)
            try:
                # Commit the pages now: a full /dev/shm then fails here with a clear error
                # instead of killing a later write with SIGBUS.
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
                raise StoreError(
                    f"ring {name}: {size / 2**20:.1f} MiB do not fit in {SHM_DIR} (no space left): "
                    f"lower capacity, use codec topk:K, or give the machine/container more "
                    f"shared memory (docker run --shm-size)") from None
            seg = cls(name, None, mmap.mmap(fd, size), os.fstat(fd), temp)
        except BaseException:
            os.unlink(_path(temp))
            raise
        finally:
            os.close(fd)
        return seg

    def publish(self):
        """Give the segment its name; FileExistsError (nothing named) when the name is taken."""
        try:
            os.link(_path(self.temp), _path(self.name), follow_symlinks=False)
        finally:
            _unlink_if(self.temp, self.ident)
            self.temp = None
        self.named = True
        _track(self.name, True)
        self.tracked = True

    @classmethod
    def attach(cls, name):
        """FileNotFoundError while absent, BlockingIOError while another peer attaches, StoreError
        (one line) when what is there is not to be trusted or cannot be a ring's size."""
        fd, st = _open_trusted(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if not _HEADER.itemsize <= st.st_size <= MAX_BYTES:
                raise StoreError(f"ring {name} is not a kdcache ring: {_path(name)} is {st.st_size} bytes, "
                                 f"a ring takes {_HEADER.itemsize} to {MAX_BYTES}; pass the right ring name, "
                                 f"or remove it if nothing of yours uses it")
            seg = cls(name, fd, mmap.mmap(fd, st.st_size), st)
        except BaseException:
            os.close(fd)
            raise
        seg.named = True
        return seg

    def done_attaching(self):
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None

    def drop_name(self):
        """Remove the segment's name if it still names this segment, and stop the tracker's watch.
        Idempotent; a no-op in a forked child (the name is the parent's to drop)."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            if self.temp is not None:
                _unlink_if(self.temp, self.ident)
                self.temp = None
            if self.named:
                self.named = False
                _unlink_if(self.name, self.ident)
            if self.tracked:
                self.tracked = False
                _track(self.name, False)

    def close(self):
        self.done_attaching()
        try:
            self.buf.release()
            self._mm.close()
        except BufferError:
            # A view is still referenced (say by a traceback); the mapping ends with it.
            pass


# --- stale segments -------------------------------------------------------------------------

def cleanup_stale(dry_run=False):
    """Remove /dev/shm/kdcache-ring-* segments whose creator process is gone (pid from the header,
    or from the name while there is no header); return their names. dry_run: only list them.
    Left alone: what is not a regular file (never opened, so a FIFO cannot block this), another
    user's, one others may write, or one whose creator cannot be told."""
    if not os.path.isdir(SHM_DIR):
        return []
    removed = []
    for name in sorted(os.listdir(SHM_DIR)):
        if not name.startswith(PREFIX):
            continue
        try:
            fd, st = _open_trusted(name)
        except (OSError, StoreError):
            continue
        try:
            pid, start = _creator_of(name, fd)
        finally:
            os.close(fd)
        if pid is None or _pid_alive(pid, start):
            continue
        try:
            if dry_run or _unlink_if(name, (st.st_dev, st.st_ino)):
                removed.append(name)
        except OSError:
            continue
    return removed


def _creator_of(name, fd):
    """(pid, start time) of the creator of the segment open as `fd`: from its header when it has a
    kdcache one (any layout version keeps the creator where it is), else from its name."""
    data = os.pread(fd, _HEADER.itemsize, 0)
    if len(data) == _HEADER.itemsize:
        h = np.frombuffer(data, _HEADER)[0]
        if bytes(h["magic"]) == MAGIC and int(h["creator_pid"]) > 0:
            return int(h["creator_pid"]), max(int(h["creator_start"]), 0)
    m = _NAME_PID_RE.match(name)
    return (int(m.group(1)), 0) if m else (None, 0)
