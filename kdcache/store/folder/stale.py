"""Files a dead kdcache process left in a cache directory, found and removed without touching a live one's."""
import contextlib
import fcntl
import os
import stat

from ..osutil import is_ours, listdir, open_regular, own, skipped
from ..files.paths import ASIDE, COMPACT_TMP, PULL_FILE, PULL_STAGE, finish_discard, parts_path, pid_alive
from ..write.settle import locked


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
