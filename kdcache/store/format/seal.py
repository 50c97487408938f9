"""The seal of a finished cache file: a digest of every byte HDF5 parses, checked before HDF5 sees the file.

NOTE [the seal]
A finished cache's rows are covered by their CRC-32 checksums (store.format.checksums), but the rest of the
file -- superblock, object headers, B-trees, heaps, attribute values, the checksum table itself -- is
read by the HDF5 library, and HDF5 trusts it: one flipped bit there has made HDF5 spin forever with
signals ignored, die of SIGSEGV, raise, or read a renamed `checksums` dataset as absent (and so serve
changed rows as sound). The newer HDF5 formats checksum most of their metadata, not all of it (the
global heap has none, and a flipped version byte turns a checked superblock into an unchecked one).

So compaction reserves the file's first SEAL_BYTES as an HDF5 user block (HDF5 skips it; h5py and
h5dump read the file as before) and writes the seal there last: the file's size, the byte ranges of
the codec fields and the `done` flags (the rows, which the checksums cover, and flags a reader checks
are all 1), and the SHA-256 of every other byte after the user block -- everything HDF5 parses. Every
kdcache tool opens a finished file through `check` first: one read of that metadata (kilobytes to a
few MiB at any cache size) and a hash. Any change there, or to the seal, or to the file's length, is
DamagedFileError before the HDF5 library reads a byte, so no bit of the file can hang, crash or
mislead a tool that goes through it.

A file that starts with HDF5's own signature was written before seals existed (format version 1):
`check` returns None and the caller opens it in a child process first, under a time limit
(store.files.probe), so a damaged old file cannot take the tool down either.

Layout of the user block (little-endian): MAGIC (16 bytes), the length L of the JSON record (uint32),
its CRC-32 (uint32), the JSON record {"size", "skip": [[offset, length], ...], "sha256"}, zeros.
"""
import hashlib
import json
import os
import struct
import zlib

from ..errors import DamagedFileError, UnsupportedFormatError

SEAL_BYTES = 4096  # the HDF5 user block: a power of two >= 512; a page, so mapped datasets stay page aligned
MAGIC = b"KDCACHE-SEAL-1\n\x00"  # far from HDF5's signature in bits: a flip cannot turn one into the other
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_HEAD = struct.Struct("<16sII")
FIX = ("the file changed after it was written (a flipped bit, a bad disk or copy): remove it (kdcache gc removes "
       "damaged caches) and rebuild it, or copy it again from its source")


def _damaged(where, what):
    return DamagedFileError(f"{where}: {what}: {FIX}")


def _read_at(fd, size, offset):
    out, got = [], 0
    while got < size:
        b = os.pread(fd, min(size - got, 8 << 20), offset + got)
        if not b:
            break
        out.append(b)
        got += len(b)
    return b"".join(out)


def _digest(fd, size, skip):
    """SHA-256 of bytes [SEAL_BYTES, size) of the file, the `skip` ranges left out."""
    h = hashlib.sha256()
    at = SEAL_BYTES
    for off, length in sorted(skip) + [(size, 0)]:
        while at < off:
            b = os.pread(fd, min(off - at, 8 << 20), at)
            if not b:
                return None  # shorter than its seal says
            h.update(b)
            at += len(b)
        at = max(at, off + length)
    return h.hexdigest()


def write(fd, skip):
    """Seal the finished file open (read-write) at `fd`, whose data ranges `skip` [(offset, length)]
    are already written and whose first SEAL_BYTES HDF5 left as its user block."""
    size = os.fstat(fd).st_size
    skip = sorted([int(o), int(n)] for o, n in skip)
    record = json.dumps({"size": size, "skip": skip, "sha256": _digest(fd, size, skip)},
                        separators=(",", ":")).encode()
    block = _HEAD.pack(MAGIC, len(record), zlib.crc32(record)) + record
    if len(block) > SEAL_BYTES:
        raise ValueError(f"a seal of {len(block)} bytes does not fit the {SEAL_BYTES}-byte user block")
    block += bytes(SEAL_BYTES - len(block))
    os.pwrite(fd, block, 0)


def sniff(path):
    """"sealed" for a file that starts like a sealed kdcache file (its seal intact or not), "hdf5" for one
    that starts with HDF5's signature (unsealed), None for anything else (a FIFO or link is not read)."""
    from ..osutil import open_regular
    try:
        fd, _ = open_regular(path)
    except OSError:
        return None
    try:
        head = _read_at(fd, 16, 0)
        if head[:8] == HDF5_SIGNATURE:
            return "hdf5"
        if head == MAGIC or _read_at(fd, 8, SEAL_BYTES) == HDF5_SIGNATURE:
            return "sealed"
        return None
    finally:
        os.close(fd)


def check(fd, where):
    """Check the seal of the finished file open at `fd` (a regular file). Returns the checked record,
    None for a file written before seals existed (it starts with HDF5's signature), and raises
    DamagedFileError for a sealed file that changed, UnsupportedFormatError for anything else."""
    size = os.fstat(fd).st_size
    head = _read_at(fd, SEAL_BYTES, 0)
    if head[:8] == HDF5_SIGNATURE:
        return None
    if len(head) < _HEAD.size or head[:len(MAGIC)] != MAGIC:
        if _read_at(fd, 8, SEAL_BYTES) == HDF5_SIGNATURE:  # HDF5 after a user block: a seal, damaged
            raise _damaged(where, "its seal's first bytes are damaged")
        raise UnsupportedFormatError(f"{where}: not a kdcache cache file (it starts with neither a kdcache seal nor "
                                     f"HDF5's signature): move it out of the cache directory")
    _, length, crc = _HEAD.unpack_from(head)
    if length > SEAL_BYTES - _HEAD.size:
        raise _damaged(where, f"its seal claims {length} bytes, more than its user block holds")
    raw = head[_HEAD.size:_HEAD.size + length]
    if zlib.crc32(raw) != crc:
        raise _damaged(where, "its seal does not match its own CRC-32")
    try:
        rec = json.loads(raw)
        want, skip, digest = int(rec["size"]), [(int(o), int(n)) for o, n in rec["skip"]], str(rec["sha256"])
    except (ValueError, KeyError, TypeError) as e:  # cannot pass the CRC by chance; a forged seal can
        raise _damaged(where, f"its seal is not a kdcache seal ({type(e).__name__})") from None
    if size != want:
        raise _damaged(where, f"it holds {size:,} bytes, its seal says {want:,} (truncated or extended)")
    end = SEAL_BYTES
    for off, n in sorted(skip):
        if off < end or n < 0 or off + n > size:
            raise _damaged(where, f"its seal's data range ({off}, {n}) overlaps another or lies outside the file")
        end = off + n
    if _digest(fd, size, skip) != digest:
        raise _damaged(where, "its metadata (the bytes HDF5 reads: structure, names, attributes, the checksum "
                              "table) does not match its seal's SHA-256")
    rec["skip"] = skip
    return rec
