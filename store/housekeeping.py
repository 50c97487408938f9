"""Keeping a cache directory tidy without ever losing finished work or touching a live process's files.

`settle` finishes what a crash interrupted: a cache whose every key is committed is compacted,
segments left beside a sound finished file are removed. `locked` takes every lock of a cache in
progress without blocking, so a removal never races a producer or a compaction.
"""
import contextlib
import fcntl
import os

from . import schema
from .compact import finalize, remove_parts
from .errors import StoreError
from .paths import ASIDE, COMPACT_TMP, final_path, finish_discard, parts_path, pid_alive
from .segment import HOST, count_done, lock_holders, open_final, read_manifest
from .validate import check_final, read_meta, spec_from_meta


@contextlib.contextmanager
def locked(parts):
    """Hold the compaction lock and every shard lock of `parts` (taken without blocking). Yields
    True when all are held, False when a live process holds one (then nothing may be removed)."""
    fds = []
    try:
        names = [schema.COMPACT_LOCK] + sorted(n for n in os.listdir(parts)
                                               if n.startswith("shard-") and n.endswith(".lock"))
    except FileNotFoundError:
        yield True
        return
    try:
        for n in names:
            flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if n == schema.COMPACT_LOCK else 0)
            try:
                fd = os.open(os.path.join(parts, n), flags, 0o644)
            except FileNotFoundError:
                continue
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
    sound finished file. Returns what it did, or None."""
    fin, parts = final_path(base), parts_path(base)
    name = os.path.basename(base)
    if not os.path.isdir(parts) or lock_holders(parts):
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
    except (StoreError, OSError):
        return None  # reported by whoever looks at it (ls: damaged; the reader: its own error)
    return None


def stale_files(cache_dir, *, min_age_s=0.0):
    """Files a dead kdcache process left in the cache directory: compaction temporaries and entries
    renamed aside for removal. [(path, reason)]."""
    import time
    out = []
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return out
    now = time.time()
    for n in names:
        p = os.path.join(cache_dir, n)
        m, a = COMPACT_TMP.match(n), ASIDE.match(n)
        pid = m.group(2) if m else a.group(3) if a else None
        if pid is None or pid_alive(pid):
            continue
        try:
            if now - os.lstat(p).st_mtime < min_age_s:
                continue
        except FileNotFoundError:
            continue
        if m:
            with locked(parts_path(os.path.join(cache_dir, m.group(1)))) as held:
                if held:  # no compaction of that cache is running (one on another host would hold it)
                    out.append((p, "temporary file of a compaction that died"))
        else:
            out.append((p, "left by a removal that died"))
    return out


def remove_stale(path):
    """Remove one of stale_files' findings, checking again under the cache's locks."""
    d, n = os.path.split(path)
    m = COMPACT_TMP.match(n)
    if not m:
        finish_discard(path)
        return
    with locked(parts_path(os.path.join(d, m.group(1)))) as held:
        if held and not pid_alive(m.group(2)):
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
