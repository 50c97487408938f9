"""Checksums of a finished cache's rows: a CRC-32 per codec field per chunk of samples, written at compaction.

NOTE [checksums]
Compaction hashes each codec field's bytes, as they are written to `P.h5`, in chunks of whole samples
(every view of a sample in one chunk; about 1 MiB of rows per chunk) and stores the table as the
dataset `checksums` (uint32 [chunks, fields]) beside the rows. The file stays readable by a kdcache
that predates it (one more plain dataset; the format version is unchanged, and with it every
fingerprint). `kdcache verify` checks every chunk; the mapped reader checks each chunk the first time
a batch touches it (a boolean per chunk; nothing once every chunk was checked), so opening stays
milliseconds at any size. The hash is zlib's CRC-32: no CRC-32C or xxhash package is installed, and
zlib's runs at several GB/s here (bench.checksums), far faster than a disk delivers pages. A CRC-32
catches every flipped bit and every burst of up to 32 bits; it guards against damage, not against
someone who forges a file.
"""
import json
import zlib

import numpy as np

from . import schema
from ..errors import DamagedRowsError, NewerFormatError, UnsupportedFormatError

ALGORITHM = "crc32"
CHUNK_BYTES = 1 << 20


def samples_per_chunk(spec):
    """Samples per chunk: about CHUNK_BYTES of rows (all views of a sample together), at least one."""
    return max(1, CHUNK_BYTES // max(1, spec.views * spec.make_codec().bytes_per_row))


def _crc(rows):
    return zlib.crc32(memoryview(np.ascontiguousarray(rows)).cast("B"))


def compute(tables, spec, samples=None):
    """uint32 [chunks, fields] of `tables` {field: array [num_keys, ...]} (key order, as stored)."""
    samples = samples or samples_per_chunk(spec)
    fields = [name for name, _, _ in spec.make_codec().fields]
    span = samples * spec.views
    out = np.zeros((-(-spec.num_samples // samples), len(fields)), dtype=np.uint32)
    for j, name in enumerate(fields):
        t = tables[name]
        for c in range(out.shape[0]):
            out[c, j] = _crc(t[c * span:(c + 1) * span])
    return out


def write(h5file, table, spec, samples=None):
    """The checksums dataset and its attributes in an open (new) cache file."""
    d = h5file.create_dataset(schema.CHECKSUMS, data=table)
    d.attrs[schema.CK_ALGORITHM] = schema.attr_value(ALGORITHM)
    d.attrs[schema.CK_SAMPLES] = int(samples or samples_per_chunk(spec))
    d.attrs[schema.CK_FIELDS] = schema.attr_value(json.dumps([name for name, _, _ in spec.make_codec().fields]))


class Sums:
    """The checksums of one finished file: which rows each chunk covers, and the check of a chunk."""

    def __init__(self, table, samples, fields, spec, where):
        self.table, self.samples, self.fields, self.where = table, samples, fields, where
        self.views, self.num_samples = spec.views, spec.num_samples
        self.span = samples * spec.views  # flat keys per chunk
        self.chunks = table.shape[0]

    def describe(self):
        return f"{ALGORITHM} per {self.samples} sample(s), {self.chunks} chunk(s)"

    def rows(self, c):
        """(first sample, end sample) of chunk c."""
        return c * self.samples, min(self.num_samples, (c + 1) * self.samples)

    def bad_fields(self, c, tables):
        """Fields of chunk c whose bytes in `tables` {field: array [keys, ...] from key 0} do not match."""
        a, b = c * self.span, (c + 1) * self.span
        return [name for j, name in enumerate(self.fields) if _crc(tables[name][a:b]) != int(self.table[c, j])]

    def bad_fields_of(self, c, rows):
        """The same for `rows` {field: the chunk's own rows}."""
        return [name for j, name in enumerate(self.fields) if _crc(rows[name]) != int(self.table[c, j])]

    def damage(self, c, names, fix):
        a, b = self.rows(c)
        v = self.views
        return (f"{self.where}: samples [{a}, {b}) (flat keys [{a * v}, {b * v})) do not match their {ALGORITHM} "
                f"checksum ({', '.join(names)}): the file changed after it was written (a flipped bit, a bad "
                f"disk or copy); {fix}")


def load(f, where, spec):
    """The Sums of the open cache file `f`, or None when it has none (written before checksums existed).
    A checksum table that does not fit the file's rows is refused in one line: it is damaged."""
    if schema.CHECKSUMS not in f:
        return None
    fix = "remove it (kdcache gc removes damaged caches) and rebuild it, or copy it again from its source"
    try:
        d = f[schema.CHECKSUMS]
        algo = d.attrs.get(schema.CK_ALGORITHM)
        algo = algo.decode() if isinstance(algo, bytes) else algo
        if algo != ALGORITHM:
            raise NewerFormatError(f"{where}: its checksums are {algo!r}, this kdcache knows {ALGORITHM!r}: upgrade "
                                   f"kdcache to check them")
        samples = d.attrs.get(schema.CK_SAMPLES)
        raw = d.attrs.get(schema.CK_FIELDS)
        fields = json.loads(raw.decode() if isinstance(raw, bytes) else raw)
        want = [name for name, _, _ in spec.make_codec().fields]
        if not isinstance(samples, (int, np.integer)) or samples < 1:
            raise ValueError(f"{schema.CK_SAMPLES} is {samples!r}")
        samples = int(samples)
        chunks = -(-spec.num_samples // samples)
        if fields != want or d.shape != (chunks, len(want)) or d.dtype != np.uint32:
            raise ValueError(f"the table is {d.shape} {d.dtype} for fields {fields}, the rows need "
                             f"({chunks}, {len(want)}) uint32 for {want}")
        table = d[()]
    except NewerFormatError:
        raise
    except (KeyError, TypeError, ValueError, OSError) as e:
        raise UnsupportedFormatError(f"{where}: its checksums are unreadable ({str(e).splitlines()[0][:160]}): "
                                     f"{fix}") from None
    return Sums(table, samples, fields, spec, where)


class Guard:
    """The mapped reader's check: each chunk of `tables` (the file's mapped fields) is hashed the first
    time a batch touches it; once every chunk has been, `done` is True and the reader drops the guard."""

    def __init__(self, sums, tables, base):
        self.sums, self.tables, self.base = sums, tables, base
        self.ok = np.zeros(sums.chunks, dtype=bool)
        self.left = sums.chunks
        self.done = self.left == 0

    def check(self, keys):
        """Raise DamagedRowsError when a chunk holding one of flat `keys` (all valid) does not match."""
        c = np.asarray(keys).reshape(-1) // self.sums.span
        todo = c[~self.ok[c]]
        if not todo.size:
            return
        for chunk in np.unique(todo).tolist():
            if self.ok[chunk]:  # another thread checked it meanwhile
                continue
            names = self.sums.bad_fields(chunk, self.tables)
            if names:
                raise DamagedRowsError(self.sums.damage(
                    chunk, names, f"check it with `kdcache verify {self.base}`, then remove it (kdcache gc) and "
                                  f"rebuild it, or copy it again from its source"))
            self.ok[chunk] = True
            self.left -= 1  # two threads may both count one chunk: `done` is decided by `ok` itself
        if self.left <= 0 and self.ok.all():
            self.done = True
