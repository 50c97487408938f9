"""Content digests (sha256) of the files a data set reads, remembered per user so a rerun reads nothing; and of its items.

A data set's identity goes into cache fingerprints, so it covers every byte of every file it reads:
a file changed in place must never keep its digest. Reading a large data set takes minutes, so each
file's digest is remembered in a small JSON memo, keyed by (real path, device, inode, size, mtime and
ctime in ns), and one entry remembers a whole set of files (an image folder holds more files than the
memo keeps entries). The ctime is there because the mtime alone can be put back: `touch -d`, `cp -p`,
`rsync -t` and `tar x` restore it after writing, so a file edited in place with its size kept would
keep its key; no user call sets the ctime, and every write or restored mtime moves it. The memo is
$KDCACHE_DIGEST_MEMO, else $XDG_CACHE_HOME/kdcache/digests.json (default ~/.cache/kdcache/). It is
only a shortcut: a memo that cannot be read or written is ignored.

item_digest / item_records: one item's digest, what a cache records of each item (NOTE [item digests]).
"""
import hashlib
import json
import os
import secrets
import stat
import sys
import time

import numpy as np

from kdcache.store import file_digest
from kdcache.store.osutil import NotOurs, open_regular, write_json_atomic

from .dataset_base import DatasetError

MEMO_ENV = "KDCACHE_DIGEST_MEMO"
MEMO_ENTRIES = 10_000  # the newest entries kept; an entry is ~150 bytes of JSON
MEMO_VERSION = 2  # 2: keys hold the ctime too (older entries cannot be trusted)
BLOCK = 1 << 20
PROGRESS_BYTES = 256 << 20  # a first digest reading more than this shows a progress bar on stderr
# A file modified (mtime) or changed (ctime) within this long before its digest began is not
# remembered: file systems stamp times coarsely (ext4 by the kernel tick, FAT by 2 s), so a change
# made just after the digest could keep the same times and the memo would hide it (git's "racy"
# entries).
RACY_NS = 3_000_000_000
READ_FIX = "make it readable, or remove or replace it"


def memo_path():
    """Where the memo lives: $KDCACHE_DIGEST_MEMO, else $XDG_CACHE_HOME/kdcache/digests.json."""
    if os.environ.get(MEMO_ENV):
        return os.environ[MEMO_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "kdcache", "digests.json")


def _load_memo(path):
    """{key: {"d": hex digest, "t": ns when it was computed}}; {} for a missing, unreadable or corrupt memo."""
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        entries = data["entries"] if data.get("version") == MEMO_VERSION else {}
        return {k: e for k, e in entries.items()
                if isinstance(e, dict) and isinstance(e.get("d"), str) and isinstance(e.get("t"), int)}
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return {}


def _save_memo(path, new):
    """Add `new` entries to the memo on disk (re-read first: another process may have added its own),
    keep the newest MEMO_ENTRIES, write to a temporary name and rename into place."""
    entries = {**_load_memo(path), **new}
    if len(entries) > MEMO_ENTRIES:
        entries = dict(sorted(entries.items(), key=lambda kv: kv[1]["t"])[-MEMO_ENTRIES:])
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        # a temporary name of its own: processes on other hosts may share this memo (a home over NFS)
        write_json_atomic(path, {"version": MEMO_VERSION, "entries": entries}, separators=(",", ":"), fsync=False,
                          tmp=os.path.join(folder, f".digests.{secrets.token_hex(8)}.tmp"))
    except OSError:  # a read-only home or a full disk: the memo is only a shortcut
        pass


def unreadable(path, e, fix):
    """The DatasetError for a file that cannot be read (OSError `e`), naming it and the fix."""
    return DatasetError(f"{path}: cannot be read ({e.strerror or e}): {fix}")


# NOTE [a user's data files are regular files]
# Whatever a data set reads from a user's folder -- an image, a .rec and its .idx, an IDX, CIFAR or
# .npz file -- must be a regular file, or a symbolic link to one (photo folders are often links into
# a shared store). Anything else is refused in one line before a byte is read: a FIFO (a plain open
# waits for a writer forever), a link to /dev/zero (it never ends), a socket or device (opening some
# has effects), a dangling link, a folder named like a file. The entry is judged by stat() first, so
# a device is never opened; then it is opened with O_NONBLOCK (an entry swapped for a FIFO in
# between opens at once) and judged again by fstat() on what was opened, and that descriptor is what
# is read. Not skipped: an entry the owner put under an image's name stands for a sample, and a data
# set that silently lost samples would train and be cached as if whole.
NOT_REGULAR_FIX = "replace it with the file it stands for, or remove it"
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def _kind(mode):
    return next((what for test, what in _KINDS if test(mode)), "not a regular file")


def not_regular(path, st):
    """The DatasetError for a data file whose stat() result `st` is not a regular file's, or None."""
    if stat.S_ISREG(st.st_mode):
        return None
    what = _kind(st.st_mode)
    if os.path.islink(path):
        what = f"a symbolic link to {os.path.realpath(path)}, {what}"
    return DatasetError(f"{path}: {what}, not a regular file: refused unread; {NOT_REGULAR_FIX}")


def check_regular(path, fix=READ_FIX):
    """stat() of a data file (links followed) when it is a regular file; DatasetError naming it, what
    it is and the fix otherwise (a dangling link, a FIFO, a device ...). Nothing is opened."""
    try:
        st = os.stat(path)
    except FileNotFoundError as e:
        if os.path.islink(path):
            raise DatasetError(f"{path}: a dangling symbolic link (to {os.readlink(path)}, which does not "
                               f"exist): refused unread; {NOT_REGULAR_FIX}") from None
        raise unreadable(path, e, fix) from None
    except OSError as e:
        raise unreadable(path, e, fix) from None
    bad = not_regular(path, st)
    if bad:
        raise bad
    return st


def open_data(path, fix=READ_FIX):
    """A data file opened for reading in binary, never blocking: a regular file or a link to one
    (NOTE [a user's data files are regular files]); DatasetError naming it otherwise."""
    check_regular(path, fix)
    try:
        fd, _ = open_regular(path, follow=True)
    except NotOurs as e:  # it changed since the stat(): a FIFO or a device now
        raise DatasetError(f"{path}: {e.why}, not a regular file: refused unread; {NOT_REGULAR_FIX}") from None
    except OSError as e:
        raise unreadable(path, e, fix) from None
    return os.fdopen(fd, "rb")


def _stat_key(path, fix):
    """(memo key, size, ns of its last change: the later of mtime and ctime) of one file; DatasetError
    naming it when it cannot be reached or is not a regular file."""
    try:
        real = os.path.realpath(path)
    except OSError as e:
        raise unreadable(path, e, fix) from None
    st = check_regular(path, fix)
    key = json.dumps([real, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns])
    return key, st.st_size, max(st.st_mtime_ns, st.st_ctime_ns)


def sha256_file(path, fix, progress=None):
    """Hex sha256 of a file's bytes, read in blocks; `progress(n)` is told of each block."""
    with open_data(path, fix) as fh:
        try:
            return file_digest(fh, BLOCK, progress)
        except OSError as e:
            raise unreadable(path, e, fix) from None


def files_digest(files, *, desc="digest", fix=READ_FIX):
    """Hex sha256 over each (path, name) in `files`: its name, its size and the sha256 of all its bytes.
    The names (e.g. a path relative to the data root and a label) tie each file to its place in the data
    set. A file read before and unchanged since (same real path, device, inode, size, mtime and ctime)
    is not read again; one whose mtime was put back after an edit is (its ctime moved)."""
    started = time.time_ns()
    stats = [_stat_key(p, fix) for p, _ in files]
    h = hashlib.sha256()
    for (_, name), (key, _, _) in zip(files, stats):
        h.update(f"{name}\0{key}\0".encode())
    set_key = "set:" + h.hexdigest()
    memo_file = memo_path()
    memo = _load_memo(memo_file)
    settled = all(changed + RACY_NS < started for _, _, changed in stats)
    if settled and set_key in memo:
        return memo[set_key]["d"]
    todo = [i for i, (key, _, _) in enumerate(stats) if key not in memo]
    total = sum(stats[i][1] for i in todo)
    bar = None
    if total > PROGRESS_BYTES:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, dynamic_ncols=True)
    new = {}
    try:
        digests = []
        for (path, _), (key, size, changed) in zip(files, stats):
            if key in memo:
                digests.append(memo[key]["d"])
                continue
            d = sha256_file(path, fix, bar.update if bar is not None else None)
            digests.append(d)
            if changed + RACY_NS < started and _stat_key(path, fix)[0] == key:  # unchanged while read
                new[key] = {"d": d, "t": started}
    finally:
        if bar is not None:
            bar.close()
    out = hashlib.sha256()
    for (_, name), (_, size, _), d in zip(files, stats, digests):
        out.update(f"{name}\0{size}\0{d}\n".encode())
    digest = out.hexdigest()
    if settled:
        new[set_key] = {"d": digest, "t": started}
    if new:
        _save_memo(memo_file, new)
    return digest


# --- a data set's items, one by one -----------------------------------------------------------
# NOTE [item digests]
# What a cache records of each item of its data set (store.format.items) and what SoftTargetDataset and
# SoftTargetIter compare a user's own data set with: the item's image as float32 values (the teacher's
# input before any augmentation: kdcache's keyed views are made from (seed, index, view), so they are
# no part of the item) with its shape, and its label. float32 values, not the bytes as stored: a uint8
# image and the float32 image kdcache feeds the teacher are one item, and the producer sees only the
# latter. 16 bytes of a SHA-256 per item: two different items share one with probability 2^-128.
ITEM_DIGEST_BYTES = 16


def item_digest(image):
    """16 bytes: the SHA-256 of an image's shape and its values as float32 (little-endian, C order)."""
    x = np.ascontiguousarray(image, dtype="<f4")
    h = hashlib.sha256(("x".join(str(s) for s in x.shape) + ":").encode())
    h.update(memoryview(x).cast("B"))
    return h.digest()[:ITEM_DIGEST_BYTES]


def item_records(images, labels):
    """store.format.schema.ITEM_DTYPE [B]: each item's digest (item_digest) and label, of a batch of images
    [B, ...] and labels [B]."""
    from kdcache.store.format.schema import ITEM_DTYPE
    labels = np.asarray(labels).reshape(-1)
    out = np.empty(len(labels), dtype=ITEM_DTYPE)
    for i in range(len(labels)):
        out["digest"][i] = np.frombuffer(item_digest(images[i]), dtype=np.uint8)
    out["label"] = labels.astype(np.int64)
    return out
