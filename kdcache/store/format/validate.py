"""What a reader may trust: a cache file's metadata, links, shapes and sizes, checked before any
row is read or any buffer sized from the file is allocated.

A file's metadata names its fingerprint; the fingerprint is recomputed from the inputs the
metadata records, so a file whose metadata was edited is refused, not read with another layout.
Every refusal is one UnsupportedFormatError line that names the file and the fix.
"""
import json
import os

import h5py
import numpy as np

from . import schema
from ..errors import FingerprintMismatchError, NewerFormatError, StoreError, UnsupportedFormatError
from .fingerprint import is_fingerprint
from ..osutil import available_memory, open_regular

FIX = "it is damaged or not a kdcache cache: remove it (kdcache gc removes damaged caches) and rebuild"
REQUIRED = (schema.A_FORMAT, schema.A_FINGERPRINT, schema.A_INPUTS, schema.A_NUM_SAMPLES, schema.A_VIEWS,
            schema.A_NUM_CLASSES, schema.A_CODEC, schema.A_DTYPE)


def bad(where, what, fix=FIX):
    return UnsupportedFormatError(f"{where}: {what}: {fix}")


def read_meta(f, where):
    """Metadata of an open cache file or segment, with its format version checked; a file whose
    attributes cannot be read as plain values is refused in one line."""
    try:
        if schema.A_FORMAT not in f.attrs:
            raise UnsupportedFormatError(
                f"{where}: an HDF5 file without kdcache metadata ({schema.A_FORMAT} missing): it is not a "
                f"kdcache cache. Move it out of the cache directory or pass the right path")
        schema.check_format_version(f.attrs[schema.A_FORMAT], where)
        return schema.meta_from_attrs(f.attrs)
    except UnsupportedFormatError:
        raise
    except Exception as e:  # h5py raises OSError, TypeError or ValueError for unreadable attributes
        raise bad(where, f"unreadable metadata ({type(e).__name__}: {str(e).splitlines()[0][:160]})") from None


def spec_from_meta(meta, where, *, name=None):
    """The CacheSpec a file's metadata describes, after checking every field and recomputing the
    fingerprint from the recorded inputs. `name`: the cache's base name, when it is a fingerprint."""
    from .spec import CacheSpec
    missing = [k for k in REQUIRED if k not in meta]
    if missing:
        raise bad(where, f"kdcache metadata {', '.join(missing)} missing")
    for k in (schema.A_NUM_SAMPLES, schema.A_VIEWS, schema.A_NUM_CLASSES):
        v = meta[k]
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise bad(where, f"attribute {k} is {v!r}, not a positive integer")
    for k in (schema.A_FINGERPRINT, schema.A_CODEC, schema.A_DTYPE, schema.A_INPUTS):
        if not isinstance(meta[k], str):
            raise bad(where, f"attribute {k} is {meta[k]!r}, not text")
    inputs = meta.get("inputs")
    if inputs is None:
        try:
            inputs = json.loads(meta[schema.A_INPUTS])
        except ValueError as e:
            raise bad(where, f"attribute {schema.A_INPUTS} is not JSON ({e})") from None
    if not isinstance(inputs, dict):
        raise bad(where, f"attribute {schema.A_INPUTS} is not a JSON object")
    try:
        spec = CacheSpec.from_meta({**meta, "inputs": inputs})
        fp = spec.fingerprint
    except NewerFormatError as e:
        raise NewerFormatError(f"{where}: {e}") from None
    except (StoreError, ValueError, TypeError, KeyError) as e:
        raise bad(where, f"metadata invalid ({str(e).splitlines()[0][:200]})") from None
    if fp != meta[schema.A_FINGERPRINT]:
        raise bad(where, f"fingerprint attribute {meta[schema.A_FINGERPRINT]} does not match the inputs its "
                         f"metadata records ({fp}): the metadata was altered")
    if name is not None and is_fingerprint(name) and name != fp:
        raise FingerprintMismatchError(f"{where} is named for the cache {name} but holds the cache {fp} (another "
                                       f"teacher, data set, view count or codec): it was renamed or copied; "
                                       f"remove it or give it its own name")
    return spec


def check_links(f, where):
    """Every member of the file is a dataset stored in it: no soft, external or virtual links."""
    for k in f.keys():
        link = f.get(k, getlink=True)
        if not isinstance(link, h5py.HardLink):
            raise bad(where, f"{k!r} is a {type(link).__name__}, not data stored in this file")
        obj = f.get(k)
        if not isinstance(obj, h5py.Dataset):
            raise bad(where, f"{k!r} is a {type(obj).__name__}, not a dataset")
        if obj.is_virtual or obj.external:
            raise bad(where, f"dataset {k!r} keeps its data outside this file (virtual or external storage)")


def _dataset(f, name, where, shape, dtype):
    if name not in f:
        raise bad(where, f"dataset {name} is missing")
    d = f[name]
    if d.shape != tuple(shape) or d.dtype != np.dtype(dtype):
        raise bad(where, f"dataset {name} is {d.shape} {d.dtype}, its metadata implies {tuple(shape)} "
                         f"{np.dtype(dtype)}")
    return d


def check_final(f, path, spec):
    """A finished cache file: its datasets exactly as the metadata implies, every byte of them
    written and inside the file (so a 7 KB file cannot declare 10^11 rows)."""
    check_links(f, path)
    flag = f.attrs.get(schema.A_COMPLETE)
    if not isinstance(flag, np.integer) or flag != 1:  # compaction writes 1 before the file gets its name
        raise bad(path, f"attribute {schema.A_COMPLETE} is {flag!r}, not 1: the file was not finished by kdcache")
    n, v = spec.num_samples, spec.views
    size = open_file_size(f)
    need = spec.num_keys * (spec.make_codec().bytes_per_row + 1)
    if need > size:
        raise bad(path, f"declares {n} samples x {v} views ({need:,} bytes of targets) but the file holds "
                        f"{size:,} bytes")
    for name, shape, dtype in spec.make_codec().fields + [(schema.DONE, (), np.uint8)]:
        d = _dataset(f, name, path, (n, v) + tuple(shape), dtype)
        if d.id.get_create_plist().get_nfilters():
            raise bad(path, f"dataset {name} is compressed or filtered; kdcache writes plain datasets")
        if d.id.get_storage_size() < d.size * d.dtype.itemsize:
            raise bad(path, f"dataset {name} was never (fully) written")
    if schema.ITEMS in f:  # the data set's item records (store.format.items), in files written since they exist
        d = _dataset(f, schema.ITEMS, path, (n,), schema.ITEM_DTYPE)
        if d.id.get_storage_size() < d.size * d.dtype.itemsize:
            raise bad(path, f"dataset {schema.ITEMS} was never (fully) written")
    check_tail(f, path, spec)


def check_tail(f, path, spec, *, block=65536):
    """A top-k file of codec version 1 (no stored tail) is read only when every row's tail can be
    rebuilt from its stored values (codec.TopKCodec.unrecoverable); otherwise it is refused."""
    codec = spec.make_codec()
    if codec.name != "topk" or codec.version != 1 or codec.k >= codec.num_classes:
        return
    n, lost = spec.num_samples, 0
    step = max(1, block // spec.views)
    for a in range(0, n, step):
        rows = {name: f[name][a:a + step].reshape((-1,) + tuple(shape))
                for name, shape, _ in codec.fields if name in (schema.TOPK_VALUES, schema.TOPK_LSE)}
        lost += int(codec.unrecoverable(rows).sum())
    if lost:
        raise bad(path, f"{lost:,} of {spec.num_keys:,} rows of this top-k cache (codec version 1, written before "
                        f"kdcache stored the tail's mass) lost their tail to float16 rounding",
                  fix="remove it (kdcache gc removes it) and rebuild it: the codec now stores the tail")


def check_segment(f, path, spec):
    """A segment of a cache in progress: its metadata names `spec`'s cache, its datasets hold one
    row per appended key. Returns the number of rows it has room for."""
    meta = read_meta(f, path)
    own = spec_from_meta(meta, path)
    if own.fingerprint != spec.fingerprint:
        raise FingerprintMismatchError(f"{path} belongs to the cache {own.fingerprint}, not {spec.fingerprint}: "
                                       f"it was copied into the wrong cache; move it away")
    check_links(f, path)
    if schema.SEG_KEYS not in f or f[schema.SEG_KEYS].ndim != 1:
        raise bad(path, f"dataset {schema.SEG_KEYS} is missing or not one-dimensional")
    rows = f[schema.SEG_KEYS].shape[0]
    _dataset(f, schema.SEG_KEYS, path, (rows,), np.int64)
    _dataset(f, schema.SEG_STATE, path, (schema.STATE_LEN,), np.int64)
    for name, shape, dtype in spec.make_codec().fields:
        _dataset(f, name, path, (rows,) + tuple(shape), dtype)
    if schema.ITEMS in f:
        _dataset(f, schema.ITEMS, path, (rows,), schema.ITEM_DTYPE)
    return rows


def open_file_size(f):
    """The size of an open HDF5 file's bytes, through its descriptor: a compaction may have removed the
    path since it was opened (the open file stays readable)."""
    try:
        return os.fstat(f.id.get_vfd_handle()).st_size
    except (OSError, ValueError, TypeError, AttributeError):  # a driver without a POSIX descriptor
        return os.path.getsize(f.filename)


def check_committed(f, rows, capacity, row_bytes):
    """The committed row count a segment's state holds is possible: within its room and its file."""
    if not 0 <= rows <= capacity:
        raise bad(f.filename, f"its state says {rows} rows are committed, it has room for {capacity}")
    size = open_file_size(f)
    if rows * row_bytes > size:
        raise bad(f.filename, f"its state says {rows} rows ({rows * row_bytes:,} bytes) are committed but "
                              f"the file holds {size:,} bytes")


def check_keys(keys, num_keys, where):
    if keys.size and (keys.min() < 0 or keys.max() >= num_keys):
        raise bad(where, f"holds keys outside [0, {num_keys})")


def check_scale(spec, where):
    """A cache in progress has no finished file to bound its size by; its reader indexes every key
    (13 bytes each). Refuse a manifest that declares more keys than this machine could index."""
    need = spec.num_keys * 13
    free = available_memory()
    if need > free:
        raise bad(where, f"declares {spec.num_keys:,} keys: indexing them needs {need:,} bytes, more than the "
                         f"{free:,} bytes of memory available", fix="check the manifest, or read it on a "
                                                                      "machine with more memory")
