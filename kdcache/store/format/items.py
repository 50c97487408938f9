"""The data set's items a cache was built from: one record (digest, label) per sample, kept beside the rows.

NOTE [item records]
A cache's fingerprint records the data set's identity, but a plain data set of the user's own (a Gluon
Dataset with no identity()) can only be compared with a cache item by item. So the producer records,
for every row it appends, the item the row's input was made from (pipeline.digests.item_records: a
digest of the item's image as float32 values, before any augmentation, and its label), in the
segment's `items` dataset; compaction gathers them by sample into the finished file's `items` [N],
written only when every sample's record is known. A reader serves them by sample (CacheReader.items);
SoftTargetDataset and SoftTargetIter compare each item with its record the first time they read it.
The records are one more plain dataset: the format version, and with it every fingerprint, is
unchanged, and a kdcache that predates them reads such files. A file without them (written before
they existed, or finished from segments of an older producer) has only its length compared.
The finished file's records carry a CRC-32 of their bytes (attribute `crc32`), checked when they are
loaded: a flipped bit there is a damaged file, not a differing item.
"""
import zlib

import numpy as np

from . import schema
from ..errors import UnsupportedFormatError


def unknown(n):
    """n records not written yet (label ITEM_UNKNOWN)."""
    out = np.zeros(int(n), dtype=schema.ITEM_DTYPE)
    out["label"] = schema.ITEM_UNKNOWN
    return out


def known(records):
    """bool [n]: which records were written."""
    return records["label"] != schema.ITEM_UNKNOWN


def crc(records):
    return zlib.crc32(memoryview(np.ascontiguousarray(records)).cast("B"))


def as_records(items, n, where="items"):
    """`items` (None, or anything numpy reads as ITEM_DTYPE [n]) as records; None stays None."""
    if items is None:
        return None
    rec = np.asarray(items)
    if rec.dtype != schema.ITEM_DTYPE or rec.shape != (n,):
        raise ValueError(f"{where}: {rec.shape} {rec.dtype}, not {n} records of {schema.ITEM_DTYPE}")
    return rec


def write_final(h5file, records):
    """The finished file's `items` dataset and its CRC-32, when every record is known; else nothing."""
    if records is None or not known(records).all():
        return
    d = h5file.create_dataset(schema.ITEMS, data=records)
    d.attrs[schema.ITEMS_CRC] = np.uint32(crc(records))


def load_final(f, where, num_samples):
    """The records of an open finished cache file, or None when it has none. Records that do not fit
    the file or their CRC-32 are refused in one line: the file is damaged."""
    if schema.ITEMS not in f:
        return None
    fix = "remove it (kdcache gc removes damaged caches) and rebuild it, or copy it again from its source"
    try:
        d = f[schema.ITEMS]
        if d.shape != (num_samples,) or d.dtype != schema.ITEM_DTYPE:
            raise ValueError(f"the table is {d.shape} {d.dtype}, the cache needs ({num_samples},) {schema.ITEM_DTYPE}")
        want = d.attrs.get(schema.ITEMS_CRC)
        if not isinstance(want, (int, np.integer)):
            raise ValueError(f"attribute {schema.ITEMS_CRC} is {want!r}")
        records = d[()]
    except (KeyError, TypeError, ValueError, OSError, RuntimeError) as e:
        raise UnsupportedFormatError(f"{where}: its item records are unreadable ({str(e).splitlines()[0][:160]}): "
                                     f"{fix}") from None
    if int(want) != crc(records) or not known(records).all():
        raise UnsupportedFormatError(f"{where}: its item records do not match their crc32 checksum: the file changed "
                                     f"after it was written; {fix}")
    return records
