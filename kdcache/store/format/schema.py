"""The cache file format: every dataset and attribute name, the key space and the format version.

A cache lives at a base path P (by default ``<cache dir>/<fingerprint>``):

* ``P.h5`` -- the finished cache, written once every key is done (temporary name, fsync,
  rename). Its first 4 KiB are an HDF5 user block holding the file's seal (store.format.seal): the
  digest of every byte HDF5 parses, checked before the HDF5 library reads the file. Datasets are indexed ``[sample, view, ...]`` so plain h5py/h5dump users see the
  layout directly; attribute ``complete`` is 1.
* ``P.parts/`` -- the cache while producers fill it: ``manifest.json`` (the metadata),
  one SWMR segment file per producer run ``seg-*.h5`` (rows appended in the order they were
  produced, with their keys), and one lock file per shard that is also the producer's heartbeat.

Key space: (sample index, view); the flat key is ``index * views + view``.
"""
import json

import numpy as np

from ..errors import BadInputError, NewerFormatError, UnsupportedFormatError

FORMAT_VERSION = 2  # bump when a file written by this code cannot be read by older code
SEALED_SINCE = 2    # finished files of this format version and later carry a seal (store.format.seal) and checksums
# The version of what a fingerprint names -- the rows a producer writes -- apart from the file's format:
# a new container (the seal of version 2) keeps every cache's fingerprint, so caches built before are found.
KEY_FORMAT = 1

# --- file names -------------------------------------------------------------------------
FINAL_SUFFIX = ".h5"
PARTS_SUFFIX = ".parts"
MANIFEST = "manifest.json"
COMPACT_LOCK = "compact.lock"


def segment_name(shard, nshards, stamp, pid):
    return f"seg-{shard}of{nshards}-{stamp}-{pid}.h5"


def lock_name(shard, nshards):
    return f"shard-{shard}of{nshards}.lock"


# --- datasets ---------------------------------------------------------------------------
# Codec fields (see codec.py); in the final file shaped [N, V, ...], in segments [rows, ...].
LOGITS = "logits"               # full codec: raw logits, temperature 1
TOPK_VALUES = "topk_values"     # topk codec: the K largest logits, descending
TOPK_INDICES = "topk_indices"   # topk codec: their class indices
TOPK_LSE = "topk_lse"           # topk codec: log-sum-exp of all C logits
TOPK_LOGTAIL = "topk_logtail"   # topk codec (version 2): log of the probability mass of the C-K classes not stored
INT8_CODES = "int8_codes"       # int8 codec: uint8 codes of all C logits, (x - lo) / scale rounded
INT8_LO = "int8_lo"             # int8 codec: the row's smallest logit (float32)
INT8_SCALE = "int8_scale"       # int8 codec: the row's step, (max - min) / 255 (float32; 0 for a constant row)
SAMPLED_INDICES = "sampled_indices"  # sampled codec: the distinct classes drawn (K slots, count 0 in unused slots)
SAMPLED_COUNTS = "sampled_counts"    # sampled codec: how many of the K draws gave each class (estimate: count / K)
DONE = "done"                   # final file: uint8 [N, V], 1 where the row holds the teacher's output
CHECKSUMS = "checksums"         # final file: uint32 [chunks, fields], a CRC-32 of each codec field's bytes per
                                # chunk of samples (store.format.checksums); absent in files written before it existed
CK_ALGORITHM = "algorithm"      # checksums attribute: "crc32" (zlib.crc32 of the row bytes, as stored)
CK_SAMPLES = "samples_per_chunk"  # checksums attribute: samples (all their views) per chunk; the last may be short
CK_FIELDS = "fields"            # checksums attribute: JSON list of the codec fields, in the table's column order
ITEMS = "items"                 # ITEM_DTYPE records of the data set's items (what the teacher's input was made
                                # from): in the final file [N], one per sample, only when every sample's is known;
                                # in a segment [rows], one per appended row (label ITEM_UNKNOWN: not recorded).
                                # Absent in files written before it existed (store.format.items)
ITEMS_CRC = "crc32"             # items attribute in the final file: zlib.crc32 of the records' bytes
ITEM_DTYPE = np.dtype([("digest", "u1", (16,)), ("label", "<i8")])  # digest: pipeline.digests.item_digest
ITEM_UNKNOWN = -1               # the label of a record not written (a row appended without its item's record)
SEG_KEYS = "keys"               # segment: int64 [rows], flat key of each appended row
SEG_STATE = "state"             # segment: int64 [STATE_LEN], see STATE_* below
STATE_ROWS = 0                  # rows committed (durable; readers trust rows [0, rows))
STATE_CLOSED = 1                # 1 once the producer closed the segment cleanly
STATE_LEN = 2

# --- root attributes --------------------------------------------------------------------
A_FORMAT = "kdcache_format_version"
A_KIND = "kind"                 # "cache" (final file) or "segment"
A_FINGERPRINT = "fingerprint"
A_INPUTS = "inputs_json"        # JSON of the inputs the fingerprint was made from
A_SOURCES = "sources_json"      # JSON: where the producer read its inputs ({"data_root": absolute path,
                                # "image_size": [H, W] or null}); not part of the fingerprint (the data's
                                # content is), so a moved folder keeps its caches; absent in older files
A_NUM_SAMPLES = "num_samples"
A_VIEWS = "views"
A_NUM_CLASSES = "num_classes"
A_CODEC = "codec"
A_CODEC_VERSION = "codec_version"  # absent: version 1 (see codec.VERSIONS)
A_DTYPE = "dtype"
A_TOOL_VERSION = "tool_version"
A_CREATED = "created"           # ISO 8601, UTC
A_COMPLETE = "complete"
A_KEY_LAYOUT = "key_layout"
A_SHARD = "shard"               # segment only: "i/n"
KEY_LAYOUT = "flat key = sample_index * views + view; final datasets are [sample, view, ...]"

KIND_CACHE = "cache"
KIND_SEGMENT = "segment"


def attr_value(v):
    """An attribute value as kdcache stores it: text as fixed-length UTF-8 bytes, so it sits in the
    object header that HDF5 checksums, never in the global heap that it does not."""
    if isinstance(v, str):
        return np.bytes_(v.encode("utf-8"))
    return v


def flat_keys(indices, views, num_samples, num_views, *, check_upper=True):
    """Flat keys (index * num_views + view) of sample indices and view(s), range-checked.

    check_upper=False leaves indices >= num_samples to the caller's gather, which refuses them
    anyway (a key >= num_samples * num_views): one reduction less on the reader's hot path.
    """
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    if np.ndim(views) == 0:
        v = int(views)
        if not 0 <= v < num_views:
            raise BadInputError(f"view {v} out of range [0, {num_views}): the cache holds {num_views} view(s); "
                                f"pass the same --views as when it was built")
        keys = idx if (num_views == 1 and v == 0) else idx * num_views + v
    else:
        vs = np.asarray(views, dtype=np.int64).reshape(-1)
        if vs.size and (vs.min() < 0 or vs.max() >= num_views):
            raise BadInputError(f"views {vs[(vs < 0) | (vs >= num_views)][:5].tolist()} out of range "
                                f"[0, {num_views}): the cache holds {num_views} view(s); pass the same --views "
                                f"as when it was built")
        keys = idx * num_views + vs
    if idx.size and (idx.min() < 0 or (check_upper and idx.max() >= num_samples)):
        raise index_error(idx, num_samples)
    return keys


def name_keys(indices, views, limit=3):
    """Keys as a user reads them, in one line: 'sample 12 view 0, sample 40 view 1 and 5 more'."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    vs = np.broadcast_to(np.asarray(views, dtype=np.int64), idx.shape)
    shown = ", ".join(f"sample {int(i)} view {int(v)}" for i, v in zip(idx[:limit], vs[:limit]))
    return shown + (f" and {idx.size - limit} more" if idx.size > limit else "")


def index_error(idx, num_samples):
    bad = idx[(idx < 0) | (idx >= num_samples)][:5]
    return BadInputError(f"sample indices {bad.tolist()} out of range [0, {num_samples}): this cache is for a "
                         f"data set of {num_samples} samples; pass the matching --dataset or cache")


def meta_from_attrs(attrs):
    """Plain-Python metadata dict from an HDF5 attribute mapping (no pickle involved)."""
    out = {}
    for k, v in attrs.items():
        if hasattr(v, "item") and getattr(v, "shape", None) == ():
            v = v.item()
        if isinstance(v, np.void):
            v = v.tobytes()
        if isinstance(v, bytes):  # never unpickled: text if it is text, else shown as hex
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                v = "0x" + v[:32].hex() + ("..." if len(v) > 32 else "")
        elif isinstance(v, np.ndarray):
            v = v.tolist()
        out[k] = v
    if isinstance(out.get(A_INPUTS), str):
        out["inputs"] = json.loads(out[A_INPUTS])
    return out


def check_format_version(version, where):
    """Integer comparison of a file's format version with ours; raise a typed error if unreadable."""
    try:
        version = int(version)
    except (TypeError, ValueError, OverflowError):
        raise UnsupportedFormatError(
            f"{where}: format version {version!r} is not an integer: the file is not a kdcache "
            f"cache or is damaged; remove it (kdcache gc) and rebuild") from None
    if version > FORMAT_VERSION:
        raise NewerFormatError(
            f"{where}: written with kdcache format version {version}, this kdcache reads up to "
            f"{FORMAT_VERSION}: upgrade kdcache, or rebuild the cache with this version")
    if version < 1:
        raise UnsupportedFormatError(f"{where}: format version {version} is invalid: rebuild the cache")
    return version
