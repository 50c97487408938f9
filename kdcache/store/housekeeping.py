"""Keeping a cache directory tidy without ever losing finished work or touching a live process's files.

`settle` finishes what a crash interrupted: a cache whose every key is committed is compacted,
segments left beside a sound finished file are removed. `locked` takes every lock of a cache in
progress without blocking, so a removal never races a producer or a compaction.
"""
import contextlib
import fcntl
import os
import stat

from . import schema
from .compact import finalize, remove_parts
from .errors import NoSpaceError, StoreError
from .osutil import NotOurs, is_ours, listdir, open_regular, own, regular, skipped
from .paths import (ASIDE, BUILD_FILE, COMPACT_TMP, PULL_FILE, PULL_STAGE, final_path, finish_discard, foreign_files,
                    parts_path, pid_alive)
from .segment import HOST, count_done, lock_holders, open_final, read_manifest
from .validate import check_final, read_meta, spec_from_meta


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


def final_spec(fin, name):
    """The spec of a finished cache file after every check a reader makes (StoreError otherwise)."""
    with open_final(fin) as f:
        meta = read_meta(f, fin)
        spec = spec_from_meta(meta, fin, name=name)
        check_final(f, fin, spec)
    return spec, meta


def parts_spec(parts, name):
    meta = read_manifest(parts)
    if meta is None:
        raise StoreError(f"{parts}: no manifest")
    spec = spec_from_meta(meta, os.path.join(parts, schema.MANIFEST), name=name)
    return spec, meta


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


def stale_files(cache_dir, *, min_age_s=0.0):
    """Files a dead kdcache process left in the cache directory: compaction temporaries and entries
    renamed aside for removal. [(path, reason)]."""
    import time
    out = []
    now = time.time()
    for n in listdir(cache_dir):
        p = os.path.join(cache_dir, n)
        if PULL_STAGE.match(n):
            if _stopped_pull(p, now - min_age_s):
                out.append((p, "left by a pull that stopped (the same pull would have resumed it)"))
            continue
        m, a = COMPACT_TMP.match(n), ASIDE.match(n)
        pid = m.group(2) if m else a.group(3) if a else None
        if pid is None or pid_alive(pid):
            continue
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if not own(st) or not (stat.S_ISREG(st.st_mode) or (a and stat.S_ISDIR(st.st_mode))):
            skipped(p, "not a file or folder kdcache wrote")  # a link, FIFO or another user's entry
            continue
        if now - st.st_mtime < min_age_s:
            continue
        if m:
            with locked(parts_path(os.path.join(cache_dir, m.group(1)))) as held:
                if held:  # no compaction of that cache is running (one on another host would hold it)
                    out.append((p, "temporary file of a compaction that died"))
        else:
            out.append((p, "left by a removal that died"))
    return out


@contextlib.contextmanager
def _pull_lock(stage):
    """Hold the lock of a pull's staging folder without blocking: yields True when held (no pull uses it)."""
    try:
        fd, _ = open_regular(os.path.join(stage, "lock"))
    except FileNotFoundError:
        yield True  # a pull takes its lock first thing: one that died before it left nothing to race
        return
    except OSError:
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        yield False
        return
    try:
        yield True
    finally:
        os.close(fd)


def _stopped_pull(stage, before):
    """True for a pull's staging folder of this uid that no pull holds, untouched since `before`."""
    try:
        st = os.lstat(stage)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode) or not own(st):
        skipped(stage, "not a folder kdcache wrote")
        return False
    newest = st.st_mtime
    for n in listdir(stage):
        try:
            newest = max(newest, os.lstat(os.path.join(stage, n)).st_mtime)
        except OSError:
            continue
    if newest > before:
        return False
    with _pull_lock(stage) as free:
        return free


def _remove_pull_stage(stage):
    """Remove a stopped pull's staging folder under its lock: only the files a pull writes; a folder holding
    anything else is left (and named by the next gc)."""
    with _pull_lock(stage) as free:
        if not free:
            return
        for n in listdir(stage):
            p = os.path.join(stage, n)
            if PULL_FILE.match(n) and is_ours(p) and n != "lock":
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        try:
            os.unlink(os.path.join(stage, "lock"))
        except FileNotFoundError:
            pass
    try:
        os.rmdir(stage)
    except OSError:
        pass


def remove_stale(path):
    """Remove one of stale_files' findings, checking again under the cache's locks."""
    d, n = os.path.split(path)
    if PULL_STAGE.match(n):
        _remove_pull_stage(path)
        return
    m = COMPACT_TMP.match(n)
    if not m:
        finish_discard(path)
        return
    with locked(parts_path(os.path.join(d, m.group(1)))) as held:
        if held and not pid_alive(m.group(2)) and is_ours(path):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
