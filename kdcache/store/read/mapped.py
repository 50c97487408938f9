"""A finished cache file mapped read-only: each codec field as a numpy array over the file's pages.

Compaction writes every dataset of `P.h5` contiguous and unfiltered (store.write.compact), so its
bytes sit at one offset in the file, which h5py reports. Mapping them costs nothing at open
time at any size: rows are paged in as a batch touches them, and every process that maps the
file shares one copy in the page cache. float16 stays float16 (the reader widens per batch).

`map_fields` raises MapUnavailable, with the reason, where a file cannot be mapped this way
(chunked or filtered datasets, foreign byte order, a file system that refuses mmap); the reader
then falls back to reading the file and logs why.

A mapped file that shrinks (truncated, or overwritten in place) would kill the reading process with
SIGBUS at the first page past its new end. `FileMap.check()`, one fstat of the mapping's own
descriptor (about 0.4 us, against tens of us for a batch's gather), turns that into
CacheChangedError before each batch; only a truncation in the microseconds between the check and
the gather is still a SIGBUS.
"""
import mmap
import os

import numpy as np

from ..errors import CacheChangedError
from ..osutil import open_regular


class MapUnavailable(Exception):
    """This file cannot be mapped; the message says why."""


class FileMap:
    """The read-only mapping of one file, and the size it had when mapped."""
    __slots__ = ("path", "mm", "size")

    def __init__(self, path, mm):
        self.path, self.mm, self.size = path, mm, len(mm)

    def check(self):
        """CacheChangedError when the mapped file (whatever its name now) is shorter than when mapped."""
        try:
            now = self.mm.size()  # fstat of the mapping's own descriptor: the file mapped, even if renamed
        except (OSError, ValueError):  # closed, or the file system cannot say: the map itself is intact
            return
        if now < self.size:
            raise CacheChangedError(
                f"the cache file {self.path} shrank from {self.size:,} to {now:,} bytes while being read: it was "
                f"replaced or truncated; reopen it, or check it with `kdcache verify {self.path}`")


def _layout(f, size, fields, num_keys):
    """[(name, offset, dtype, row shape)] of `fields` in the open h5py file `f` of `size` bytes."""
    out = []
    for name, shape, dtype in fields:
        d = f[name]
        if d.chunks is not None:
            raise MapUnavailable(f"dataset {name} is chunked (written by an older kdcache)")
        if d.id.get_create_plist().get_nfilters():
            raise MapUnavailable(f"dataset {name} is filtered")
        dt = np.dtype(dtype)
        if d.dtype != dt or not d.dtype.isnative:
            raise MapUnavailable(f"dataset {name} is {d.dtype}, not native {dt}")
        want = num_keys * int(np.prod(shape, dtype=np.int64)) * dt.itemsize
        if d.size * dt.itemsize != want:
            raise MapUnavailable(f"dataset {name} holds {d.size * dt.itemsize} bytes, not {want}")
        off = d.id.get_offset()
        if off is None:
            raise MapUnavailable(f"dataset {name} has no storage in the file")
        if off < 0 or off + want > size:
            raise MapUnavailable(f"dataset {name} lies outside the file ({off} + {want} > {size} bytes)")
        out.append((name, int(off), dt, tuple(shape)))
    return out


def map_fields(f, path, fields, num_keys):
    """({field: read-only array [num_keys, *shape]}, FileMap) over a read-only mapping of `path`, whose
    h5py file `f` is open (and was checked by validate.check_final). The arrays keep the mapping alive."""
    try:
        fd, st = open_regular(path)  # no link followed, no FIFO waited on
    except OSError as e:
        raise MapUnavailable(f"it cannot be opened as a regular file ({e})") from None
    with open(fd, "rb") as fh:
        try:
            same = os.path.samestat(st, os.stat(f.filename))
        except OSError:
            same = False
        if not same:
            raise MapUnavailable("the file was replaced while it was opened")
        layout = _layout(f, st.st_size, fields, num_keys)
        try:
            mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise MapUnavailable(f"the file system refused to map it ({e})") from None
    # No madvise: the kernel's default read-ahead makes a cold file's first epoch about 11x faster than
    # MADV_RANDOM (page by page) even in random order (bench.read_scale), and costs nothing once warm.
    out = {}
    for name, off, dt, shape in layout:
        count = num_keys * int(np.prod(shape, dtype=np.int64))
        a = np.frombuffer(mm, dtype=dt, count=count, offset=off).reshape((num_keys,) + shape)
        out[name] = a
    return out, FileMap(path, mm)

