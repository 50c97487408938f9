"""Operating-system helpers of the store: OS errors in one line, fsync, atomic writes, free memory, quiet stderr,
safe opening. Every package may use them (this module imports nothing above the store)."""
import contextlib
import errno
import json
import logging
import os
import re
import stat
import sys

from .errors import StoreError


def fs_error(e, where, fix):
    """One line naming the operating system's reason (h5py's messages hold it as 'error message')."""
    text = getattr(e, "strerror", None) or str(e)  # h5py's OSError carries HDF5's whole report as strerror
    m = re.search(r"error message = '([^']+)'", text)
    reason = m.group(1) if m else " ".join(text.split())[:160]
    return StoreError(f"{where}: {reason} ({type(e).__name__}): {fix}")


def exit_at_once(code):
    """End the process with `code` now, without the interpreter's clean-up: after HDF5 failed a write (a
    full disk), its own clean-up at exit can crash the process (SIGSEGV) after the error line was
    printed. Whatever was committed is on disk already."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def stderr_silenced(active):
    """Closing a segment after a failed write makes HDF5 retry its flushes, and h5py prints each
    failure from a deallocator, straight to file descriptor 2. The writer has already raised one
    clear error; keep those echoes off the terminal."""
    if not active:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def fsync_dir(d):
    """Make a rename in directory `d` durable (best effort: some file systems refuse it)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_all(fd, data):
    """Write every byte of `data` to the descriptor `fd` (one os.write may take fewer)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_atomic(path, data, *, fsync=True, tmp=None):
    """Replace `path` whole with the bytes `data`: written under a temporary name in the same folder, then
    renamed into place, so a reader sees the old file or the new one, never a part. `tmp`: that name
    (default PATH.tmp-PID, as `kdcache gc` knows a leftover). `fsync`: the bytes reach the disk before the
    rename and the rename itself after (the folder is fsynced): once this returns, a crash keeps the new
    file. What stands at either name and is not this uid's regular file (a FIFO, a link, another user's
    file) is left there and NotOurs (an OSError) raised; the temporary file never stays behind a failure."""
    tmp = f"{path}.tmp-{os.getpid()}" if tmp is None else tmp
    for p in (tmp, path):
        if os.path.lexists(p) and not is_ours(p):
            raise NotOurs(p, "in the way, and not a file kdcache wrote")
    if os.path.lexists(tmp):
        os.unlink(tmp)  # this pid's own leftover (a pid is reused)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if fsync:
        fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_json_atomic(path, obj, *, fsync=True, tmp=None, end="", **dump):
    """`obj` as JSON (json.dumps with `dump`: indent, sort_keys, ...; then `end`) written by write_atomic."""
    write_atomic(path, (json.dumps(obj, **dump) + end).encode("utf-8"), fsync=fsync, tmp=tmp)


def available_memory():
    """MemAvailable from /proc/meminfo in bytes (a conservative 1 GiB if unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30


# NOTE [entries kdcache did not write]
# Anything may sit under the names kdcache uses in a cache directory: a FIFO (whose plain open
# blocks until a writer comes), a symbolic link (to /dev/zero, to a file elsewhere, to nothing),
# a folder, a file of another user or one far larger than its header says. kdcache opens every
# such file without following links and without blocking, then insists on a regular file (and,
# for what it deletes or takes as a signal -- demand, positions, pids -- on one of its own uid)
# before it reads a byte; whatever fails is "not ours": skipped, logged once, never an error of
# the command and never removed.
log = logging.getLogger("kdcache.store")
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_skipped = set()


class NotOurs(OSError):
    """An entry under one of kdcache's names that is not a regular file kdcache may use."""

    def __init__(self, path, why):
        super().__init__(f"{path}: {why}")
        self.path, self.why = os.fspath(path), why


def skipped(path, why=None):
    """Log once per entry and reason that an entry was left alone (`path` may be a NotOurs)."""
    if isinstance(path, NotOurs):
        path, why = path.path, path.why
    key = (os.fspath(path), why)
    if key not in _skipped:
        _skipped.add(key)
        log.warning("%s: not ours, skipped (%s)", path, why)


def own(st):
    return st.st_uid == os.geteuid()


def _refuse(path, st, mine):
    """Why an entry with lstat/fstat result `st` is not one kdcache may use, or None."""
    if not stat.S_ISREG(st.st_mode):
        return ("a symbolic link" if stat.S_ISLNK(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
    if mine and not own(st):
        return f"owned by uid {st.st_uid}, not {os.geteuid()}"
    return None


# NOTE [files other users can write]
# A cache's checksums and seal catch damage, not a file someone planted: whoever can write a cache file
# (or the folder that holds it, which lets them replace it) can give a reader any targets, sealed and
# checksummed. So a cache file, segment or manifest is read only when this user or root owns it and
# no one else can write it, and its folder is this user's or root's and writable by no one else (or
# sticky, as /tmp: there others cannot replace what is ours). Anything else is refused in one line,
# as the rings refuse another user's ring -- unless the user declares that they trust the others who
# can write there: `kdcache --trust-others ...`, or KDCACHE_TRUST_OTHERS=1 in the environment (which
# the command line option sets for the processes it starts).
TRUST_ENV = "KDCACHE_TRUST_OTHERS"
_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


class NotTrusted(StoreError):
    """A cache file, or its folder, that another user owns or can write (NOTE [files other users can write])."""


def trusting_others():
    return os.environ.get(TRUST_ENV, "") not in ("", "0")


def _untrusted(st, *, folder):
    """Why a file or folder with stat result `st` lets another user change what a reader reads, or None. In a
    sticky folder (mode 1777, as /tmp) others cannot replace a file that is not theirs: the file's own check decides."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & _WRITABLE_BY_OTHERS and not (folder and st.st_mode & stat.S_ISVTX):
        return (f"writable by {'others' if st.st_mode & stat.S_IWOTH else 'its group'} "
                f"(mode {stat.S_IMODE(st.st_mode):04o})")
    return None


def check_trusted(path, st):
    """NotTrusted unless the file at `path` (its fstat or lstat `st`) and its folder can be written only by
    this user (or root); nothing when the user trusts the others (NOTE [files other users can write])."""
    if trusting_others():
        return
    why, where = _untrusted(st, folder=False), path
    if why is None:
        where = os.path.dirname(os.path.abspath(path))
        try:
            why = _untrusted(os.stat(where), folder=True)  # the folder itself, through any link to it
        except OSError:
            why = None
    if why:
        real = os.path.realpath(where)
        where = where if real == os.path.abspath(where) else f"{where} (a link to {real})"
        raise NotTrusted(f"{where} is {why}: a cache another user can write is not trusted (its checksums catch "
                         f"damage, not a planted file); use a cache directory of your own (--cache-dir), or, if you "
                         f"trust everyone who can write there, run kdcache --trust-others (or set {TRUST_ENV}=1)")


def regular(path, *, mine=False):
    """lstat of `path` when it is a regular file (of this uid, with `mine`); NotOurs otherwise.
    For names handed to a library that opens them itself (h5py): a FIFO would block it."""
    st = os.lstat(path)
    why = _refuse(path, st, mine)
    if why:
        raise NotOurs(path, why)
    return st


def is_ours(path, *, mine=True):
    """True when `path` is a regular file (of this uid, with `mine`): kdcache may replace or remove it."""
    try:
        regular(path, mine=mine)
        return True
    except OSError:
        return False


# The errors that say the entry is not a file kdcache may use (a link, a socket or device, another user's).
_NOT_OURS = (errno.ELOOP, errno.EACCES, errno.EPERM, errno.ENXIO, errno.ENODEV, errno.EISDIR, errno.ENOTDIR,
             errno.EOPNOTSUPP)


def open_regular(path, *, mine=False, flags=0, follow=False):
    """(fd, fstat) of a regular file, opened without following a link and without blocking (a FIFO
    opens at once, then is refused); NotOurs for anything else, FileNotFoundError when absent.
    `follow`: a symbolic link is followed (a user's data files), its target held to the same rules."""
    try:
        fd = os.open(path, (_READ & ~os.O_NOFOLLOW if follow else _READ) | flags, 0o644)
    except OSError as e:  # ELOOP: a symbolic link; EACCES, EPERM: not ours to read; ENXIO: a socket
        if e.errno not in _NOT_OURS:
            raise  # absent, or the file system's own error (read-only, full, I/O): the caller says what to do
        raise NotOurs(path, f"cannot be opened: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
        why = _refuse(path, st, mine)
        if why:
            raise NotOurs(path, why)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def read_regular(path, limit, *, mine=False, trusted=False):
    """The bytes of a regular file of at most `limit` bytes (open_regular's rules); NotOurs when
    larger: nothing is allocated from what a file claims before its size is known. `trusted`: NotTrusted
    for a file another user can write (check_trusted)."""
    fd, st = open_regular(path, mine=mine)
    try:
        if trusted:
            check_trusted(path, st)
        if st.st_size > limit:
            raise NotOurs(path, f"{st.st_size:,} bytes, more than the {limit:,} kdcache writes there")
        chunks, left = [], limit + 1
        while left > 0:
            b = os.read(fd, min(left, 1 << 20))
            if not b:
                break
            chunks.append(b)
            left -= len(b)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise NotOurs(path, f"grew past {limit:,} bytes while read")
    return data


def listdir(path):
    """Names in a folder; [] when it is gone, not a folder, or not readable (logged)."""
    try:
        return os.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as e:
        skipped(path, e.strerror or type(e).__name__)
        return []


def pid_max():
    """The largest pid this kernel gives out (2**22, the kernel's ceiling, if unknown)."""
    try:
        with open("/proc/sys/kernel/pid_max", "rb") as fh:
            return max(1, min(int(fh.read(32).strip()), 1 << 22))
    except (OSError, ValueError):
        return 1 << 22


def parse_pid(text):
    """A pid written in a file name (ASCII digits, 1..pid_max), or None when it cannot be one."""
    s = str(text)
    if not (s.isascii() and s.isdigit()) or len(s) > 8:
        return None
    pid = int(s)
    return pid if 0 < pid <= pid_max() else None


def pid_ours(pid):
    """True when `pid` is a live process of this uid on this host (a pid of another user is not a
    kdcache process of ours, whatever it is doing)."""
    pid = parse_pid(pid)
    if pid is None:
        return False
    try:
        return os.stat(f"/proc/{pid}").st_uid == os.geteuid()
    except FileNotFoundError:
        return False
    except OSError:
        pass
    try:  # no /proc: signal 0 tells alive, and EPERM tells another user's
        os.kill(pid, 0)
    except OSError:
        return False
    return True


# --- network file systems --------------------------------------------------------------------
# HDF5's SWMR (a reader following a cache while its producer writes it) needs POSIX write ordering,
# which network file systems do not give: on them a reader behind a live writer may fail or see
# rows before their data. Finished caches read fine from any host, and each host's producer may
# fill its own shard (its own segment file): only live reading is not supported there. Cluster file
# systems that claim POSIX semantics (Lustre, GPFS, BeeGFS) are not listed.
MOUNTINFO = "/proc/self/mountinfo"
NETWORK_FS = frozenset({"nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "ceph", "glusterfs",
                        "davfs", "fuse.sshfs", "fuse.glusterfs", "fuse.cephfs", "fuse.s3fs", "fuse.gcsfuse",
                        "fuse.rclone", "fuse.davfs2", "fuse.juicefs", "fuse.goofys", "fuse.blobfuse"})
_warned_mounts = set()


def _unescape(field):
    """A mountinfo path field: the kernel writes space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mount_of(path, mountinfo=None):
    """(mount point, file system type) of the mount that holds `path` (which need not exist yet), from
    /proc/self/mountinfo (or the table `mountinfo` names); None where that cannot be read (not Linux)."""
    try:
        with open(mountinfo or MOUNTINFO, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(path)
    best = None
    for line in lines:
        left, sep, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if not sep or len(fields) < 5 or not tail:
            continue
        point = _unescape(fields[4])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best[0])):  # the deepest; a later mount shadows
            best = (point, tail[0])
    return best


def network_filesystem(path, mountinfo=None):
    """(mount point, type) when `path` lies on a network file system, else None."""
    found = mount_of(path, mountinfo)
    if found is None:
        return None
    kind = found[1]
    return found if kind in NETWORK_FS or kind.startswith("nfs") else None


def warn_if_network(path, mountinfo=None):
    """Warn once per mount (kdcache.store logger) that a cache directory on a network file system
    cannot be read while it is being written. Returns whether `path` is on one."""
    found = network_filesystem(path, mountinfo)
    if found is None:
        return False
    if found not in _warned_mounts:
        _warned_mounts.add(found)
        log.warning("%s is on a network file system (%s at %s): HDF5 cannot read a cache there while it is being "
                    "written (SWMR needs a local file system), so a trainer must not read behind a live producer "
                    "in it; finished caches read fine from every host, and producers on several hosts may each "
                    "fill their own --shard. For live reading use a local --cache-dir (or --store ring)",
                    path, found[1], found[0])
    return True
