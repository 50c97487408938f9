"""Finishing what a crash left in one cache's folder, and the locks that make removal safe.

`settle` finishes what a crash interrupted: a cache whose every key is committed is compacted,
segments left beside a sound finished file are removed. `locked` takes every lock of a cache in
progress without blocking, so a removal never races a producer or a compaction.
"""
import contextlib
import fcntl
import os
import stat

from ..format import schema
from .compact import finalize, remove_parts
from ..errors import NoSpaceError, StoreError
from ..osutil import NotOurs, is_ours, listdir, open_regular, own, regular, skipped
from ..files.paths import BUILD_FILE, final_path, foreign_files, parts_path
from ..files.segment import HOST, count_done, final_spec, lock_holders, parts_spec


@contextlib.contextmanager
def locked(parts):
    """Hold the compaction lock and every shard or fleet driver's lock of `parts` (taken without blocking). Yields
    True when all are held, False when a live process holds one (then nothing may be removed)."""
    fds = []
    if not os.path.isdir(parts):
        yield True
        return
    names = [schema.COMPACT_LOCK] + sorted(n for n in listdir(parts) if n.startswith(("shard-", "fleet-"))
                                            and n.endswith(".lock"))
    try:
        for n in names:
            p = os.path.join(parts, n)
            try:
                regular(p)
            except NotOurs as e:  # a FIFO, link or folder under a lock's name locks nothing (and is never removed)
                skipped(e)
                continue
            except FileNotFoundError:
                pass
            except OSError:
                yield False
                return
            # flock needs no write access: read-only, so a lock file of another user can be held too
            try:
                fd, _ = open_regular(p, flags=os.O_CREAT if n == schema.COMPACT_LOCK else 0)
            except FileNotFoundError:
                continue
            except OSError:  # cannot be taken: as good as held by someone
                yield False
                return
            fds.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
        yield True
    finally:
        for fd in fds:
            os.close(fd)  # closing drops the lock


def remote_holders(parts):
    """Producers on other hosts whose heartbeat is fresh. For use under `locked`: there every local
    lock is this process's own, and lock_holders would count this process as a producer."""
    return [h for _, h in lock_holders(parts) if h.get("host", HOST) != HOST]


def settle(base):
    """Finish what a crash left, best effort (a read-only directory stays as it is): compact a cache
    whose every key is committed and that no producer is writing; remove the segments beside a
    sound finished file. Returns what it did, or None. A compaction the disk has no room for is
    NoSpaceError: the user must hear of it (every row is kept; the next tool tries again)."""
    fin, parts = final_path(base), parts_path(base)
    name = os.path.basename(base)
    if not _own_folder(parts) or (os.path.lexists(fin) and not is_ours(fin)) or foreign_files(parts):
        return None  # nothing to finish, or not this user's to finish (not even a lock file is made there)
    if lock_holders(parts):
        return None
    try:
        if os.path.exists(fin):
            final_spec(fin, name)
            with locked(parts) as held:
                if held and not remote_holders(parts):
                    remove_parts(parts)
                    return "removed the segments beside the finished file"
            return None
        spec, _ = parts_spec(parts, name)
        if count_done(parts, spec) == spec.num_keys and finalize(base, spec):
            return "compacted: every key was committed"
    except NoSpaceError:
        raise
    except (StoreError, OSError):
        return None  # reported by whoever looks at it (ls: damaged; the reader: its own error)
    return None


def last_write(parts):
    """When a build last did work: the newest mtime of its segments (rows committed), its shard
    locks (the producer's heartbeat) and its manifest; None when it holds none of them."""
    newest = None
    for n in listdir(parts):
        if n == schema.MANIFEST or BUILD_FILE.match(n):
            try:
                st = os.lstat(os.path.join(parts, n))
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and (newest is None or st.st_mtime > newest):
                newest = st.st_mtime
    return newest


def _own_folder(path):
    try:
        st = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and own(st)
