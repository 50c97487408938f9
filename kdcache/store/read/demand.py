"""Demand: readers tell producers which keys they wait for and which they will read next.

A trainer whose order kdcache does not know (a user's shuffled DataLoader) still overlaps with
a producer: each reader process publishes the flat keys it is waiting for
(`P.parts/demand-<pid>-wait.npy`) and, when it knows them, the keys it will read next, in order
(`demand-<pid>-next.npy`), each file written whole and renamed into place. A producer polls the folder between batches (one directory scan,
files read only when they change) and serves the keys waited for first, then the announced
ones, then the rest in key order. A reader's file goes when it closes; files of processes that
are gone (on this host) are ignored, and so are files of another user or of another user's
process (osutil's NOTE on entries kdcache did not write).
"""
import io
import os
import re
import stat

import numpy as np

from ..osutil import NotOurs, is_ours, pid_ours, read_regular, skipped, write_atomic

PREFIX = "demand-"
NAME = re.compile(r"^demand-(\d+)-(wait|next)\.npy$", re.ASCII)
MAX_KEYS = 1 << 25  # 256 MiB of keys: larger files are not demand files kdcache wrote
VERSION = 1


def demand_path(parts, kind, pid=None):
    return os.path.join(parts, f"{PREFIX}{os.getpid() if pid is None else pid}-{kind}.npy")


def publish(parts, kind, keys):
    """Replace this process's demand file of `kind` ("wait" or "next") with these flat keys.
    Returns False when it cannot be written (a read-only or removed folder): demand is a hint,
    never an error."""
    keys = np.asarray(keys, dtype=np.int64).reshape(-1)
    arr = np.concatenate([np.array([VERSION], dtype=np.int64), keys])
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    try:  # what stands there and is not this uid's regular file is left alone (NotOurs)
        write_atomic(demand_path(parts, kind), buf.getbuffer(), fsync=False)  # a hint: a crash loses nothing
        return True
    except OSError:
        return False


def withdraw(parts):
    for kind in ("wait", "next"):
        p = demand_path(parts, kind)
        try:
            if is_ours(p):
                os.unlink(p)
        except OSError:
            pass


def _parse(raw):
    """The int64 vector a demand file holds, or None. The header's shape is checked against the
    bytes that follow it before anything is allocated (a 144-byte file may declare 2**33 keys)."""
    fh = io.BytesIO(raw)
    try:
        version = np.lib.format.read_magic(fh)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(fh)
        elif version == (2, 0) and int.from_bytes(raw[8:12], "little") <= 4096:  # np.save writes ~128 bytes
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(fh)
        else:
            return None
    except (ValueError, EOFError, SyntaxError, TypeError, KeyError, OverflowError, RecursionError, MemoryError):
        return None
    if dtype != np.dtype("<i8") or len(shape) != 1 or fortran:
        return None
    body = raw[fh.tell():]
    if not isinstance(shape[0], int) or shape[0] * 8 != len(body):
        return None
    return np.frombuffer(body, dtype="<i8").astype(np.int64)


def _load(path, num_keys):
    """The keys of a demand file, or None when it is not a sound one (nor a regular file of ours)."""
    try:
        arr = _parse(read_regular(path, 8 * (MAX_KEYS + 1) + 4096, mine=True))
    except NotOurs as e:
        skipped(e)
        return None
    except OSError:
        return None
    if arr is None or arr.size < 1 or arr[0] != VERSION:
        return None
    keys = arr[1:]
    if keys.size and (keys.min() < 0 or keys.max() >= num_keys):
        return None
    return keys


class Demand:
    """A producer's view of the readers' demand on one cache (this shard's keys only)."""

    def __init__(self, parts, num_keys, shard=0, nshards=1):
        self.parts, self.num_keys = parts, num_keys
        self.shard, self.nshards = shard, nshards
        self._files = {}  # name -> [stamp, kind, keys of this shard, cursor (next: the done prefix skipped)]
        self.served = 0

    def poll(self):
        """Take in changed demand files; forget those of processes that are gone."""
        try:
            entries = [e for e in os.scandir(self.parts) if NAME.match(e.name)]
        except OSError:
            entries = []
        names = set()
        for e in entries:
            if not pid_ours(NAME.match(e.name).group(1)):  # gone, impossible, or another user's
                continue
            names.add(e.name)
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                skipped(e.path, "not a regular file")
                continue
            stamp = (st.st_mtime_ns, st.st_size, st.st_ino)
            cur = self._files.get(e.name)
            if cur is not None and cur[0] == stamp:
                continue
            got = _load(e.path, self.num_keys)
            if got is None:
                self._files.pop(e.name, None)
                continue
            self._files[e.name] = [stamp, NAME.match(e.name).group(2), got[got % self.nshards == self.shard], 0]
        for name in set(self._files) - names:
            del self._files[name]
        return bool(self._files)

    def take(self, is_done, n):
        """Up to n keys readers want that are not done, each once: those waited for first, then the
        announced ones in order (each announcement's cursor skips what is already done)."""
        out, taken = [], set()

        def add(keys):
            for k in keys.tolist():
                if len(out) >= n:
                    return
                if k not in taken:
                    taken.add(k)
                    out.append(k)
        for f in self._files.values():
            if f[1] == "wait" and f[2].size:
                f[2] = f[2][~is_done(f[2])]
                add(f[2])
        for f in self._files.values():
            if f[1] != "next":
                continue
            up, at, pos, prefix = f[2], f[3], f[3], True
            while pos < up.size and len(out) < n:
                chunk = up[pos:pos + 4096]
                missing = ~is_done(chunk)
                if missing.any():
                    add(chunk[missing])
                    if prefix:  # the cursor skips the done keys before the first one still owed
                        at, prefix = pos + int(np.flatnonzero(missing)[0]), False
                elif prefix:
                    at = pos + chunk.size
                pos += chunk.size
            f[3] = at
        self.served += len(out)
        return np.array(out, dtype=np.int64)
