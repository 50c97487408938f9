"""Low-level access to cache files: SWMR segments (append logs) and the finished cache file.

Shared by the writer, the reader, the registry and verify, so the rules for what a reader may
trust live in one place: rows [0, state[ROWS]) of a segment are durable; nothing else is.
"""
import json
import os
import socket
import time

import h5py
import numpy as np

from . import probe
from ..format import schema, seal
from ..errors import CacheChangedError, CacheNotFoundError, DamagedFileError, StoreError, UnsupportedFormatError
from .paths import PART
from ..osutil import NotOurs, check_trusted, listdir, open_regular, read_regular, regular, skipped
from ..format.validate import (check_committed, check_final, check_keys, check_segment, read_meta,  # noqa: F401 (read_meta: re-exported)
                       spec_from_meta)

HOST = socket.gethostname()
MANIFEST_LIMIT = 64 << 20  # a manifest is metadata: kilobytes; a larger file is not one kdcache wrote
LOCK_LIMIT = 4096          # a lock file holds one line of JSON


def quiet_h5py_dealloc_errors():
    """After a failed write (disk full), h5py reports each failed close of a dataset handle as an
    'Exception ignored' traceback on stderr. The writer has already raised one clear error; drop
    these echoes, let every other unraisable exception through."""
    import sys
    if getattr(sys.unraisablehook, "_kdcache", False):
        return
    previous = sys.unraisablehook

    def hook(u):
        if "h5py" in repr(getattr(u, "object", "")) or "_dealloc" in repr(getattr(u, "object", "")):
            return
        previous(u)
    hook._kdcache = True
    sys.unraisablehook = hook


def chunk_rows(bytes_per_row, target=64 * 1024):
    """Rows per HDF5 chunk: ~64 KiB chunks keep appends and partial reads cheap."""
    return max(1, target // max(1, int(bytes_per_row)))


def segment_bytes(codec, rows):
    """The most a segment of `rows` rows (create_segment's layout) takes once written: whole chunks of
    each codec field, of the keys and of the item records, and its metadata."""
    def chunked(row_bytes, per_chunk):
        per_chunk = min(max(1, rows), per_chunk)
        return -(-rows // per_chunk) * per_chunk * row_bytes
    data = chunked(codec.bytes_per_row, chunk_rows(codec.bytes_per_row))
    records = chunked(schema.ITEM_DTYPE.itemsize, chunk_rows(schema.ITEM_DTYPE.itemsize * 64))  # `items`, if kept
    return data + chunked(8, chunk_rows(8 * 64)) + records + (64 << 10) + rows // 64


def create_segment(directory, spec, codec, rows, shard, nshards, items=False):
    """Create a segment for up to `rows` appended rows, switch it to SWMR and only then give it
    its visible name, so a reader never opens a segment that is not yet readable. `items`: with
    the `items` dataset, a record of each row's data set item (store.format.items)."""
    stamp = time.time_ns()
    name = schema.segment_name(shard, nshards, stamp, os.getpid())
    tmp = os.path.join(directory, "." + name + ".tmp")
    final = os.path.join(directory, name)
    f = h5py.File(tmp, "w", libver="latest")
    try:
        for k, v in spec.meta().items():
            f.attrs[k] = schema.attr_value(v)
        f.attrs[schema.A_KIND] = schema.attr_value(schema.KIND_SEGMENT)
        f.attrs[schema.A_SHARD] = schema.attr_value(f"{shard}/{nshards}")
        f.attrs[schema.A_COMPLETE] = 0
        for fname, shape, dtype in codec.fields:
            f.create_dataset(fname, shape=(rows,) + tuple(shape), dtype=dtype,
                             chunks=(min(rows, chunk_rows(codec.bytes_per_row)),) + tuple(shape))
        f.create_dataset(schema.SEG_KEYS, shape=(rows,), dtype=np.int64,
                         chunks=(min(rows, chunk_rows(8 * 64)),), fillvalue=-1)
        if items:
            f.create_dataset(schema.ITEMS, shape=(rows,), dtype=schema.ITEM_DTYPE,
                             chunks=(min(rows, chunk_rows(schema.ITEM_DTYPE.itemsize * 64)),))
        # Chunked, not contiguous: HDF5 >= 1.14.4 readers reject contiguous datasets of a file
        # in SWMR write ("invalid dataset size") -- HDFGroup/hdf5 issue 5251.
        f.create_dataset(schema.SEG_STATE, shape=(schema.STATE_LEN,), dtype=np.int64,
                         chunks=(schema.STATE_LEN,))
        f.swmr_mode = True
        f.flush()
        os.replace(tmp, final)
    except BaseException:
        try:
            f.close()
        except (OSError, RuntimeError):  # HDF5 failed a write (a full disk): its close fails too
            pass
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return f, final


def open_swmr(path, retry_s=5.0):
    """Open a segment for reading while its producer may still write it. Retries while the
    writer is still switching to SWMR; a file that never opens is reported as damaged."""
    _check_regular(path, "segment")
    deadline = time.monotonic() + retry_s
    delay = 0.001
    while True:
        try:
            # No chunk cache: a chunk read while half written must never be served again later.
            return h5py.File(path, "r", libver="latest", swmr=True, rdcc_nbytes=0)
        except (OSError, RuntimeError) as e:  # RuntimeError: HDF5 cannot decode what it found (never retried)
            if isinstance(e, RuntimeError) or time.monotonic() >= deadline:
                raise UnsupportedFormatError(
                    f"{path}: cannot be opened as an HDF5 segment ({e}): it is damaged or not a kdcache "
                    f"segment; move it away or run `kdcache gc` and let the producer rebuild") from None
            time.sleep(delay)
            delay = min(0.05, delay * 2)


def _check_regular(path, what):
    """h5py opens by name: a FIFO would block it, a link lead it anywhere. Refused in one line."""
    try:
        st = regular(path)
        if what == "segment":
            check_trusted(path, st)  # NOTE [files other users can write]
    except NotOurs as e:
        raise UnsupportedFormatError(f"{path} is {e.why}, not a kdcache {what}: move it out of the cache "
                                     f"directory") from None
    except FileNotFoundError:
        pass  # h5py names it


def open_final(path):
    """Open a finished cache file read-only once its seal says the HDF5 library may read it (NOTE [the
    seal]); a file written before seals existed is read by a child process first (store.files.probe). A
    damaged file is DamagedFileError, anything else that is not a cache UnsupportedFormatError: one line."""
    try:
        fd, st = open_regular(path)  # no link followed, no FIFO waited on
    except NotOurs as e:
        raise UnsupportedFormatError(f"{path} is {e.why}, not a kdcache cache file: move it out of the cache "
                                     f"directory") from None
    except FileNotFoundError:
        raise CacheNotFoundError(f"{path}: no such cache file (removed or compacted meanwhile): run the "
                                 f"command again") from None
    try:
        check_trusted(path, st)  # NOTE [files other users can write]
        record = seal.check(fd, path)
        if record is None and not probe.in_child():
            probe.check(path, st)
        try:
            f = h5py.File(path, "r")
        except (OSError, RuntimeError) as e:
            raise UnsupportedFormatError(
                f"{path}: not a readable HDF5 file ({e}): it is truncated, damaged or of another format. "
                f"Remove it (kdcache gc removes damaged caches, or rm) and rebuild the cache") from None
        try:
            if not os.path.samestat(os.fstat(f.id.get_vfd_handle()), os.fstat(fd)):
                raise CacheChangedError(f"{path} was replaced while it was opened: run the command again")
            _check_sealed(f, path, record)
        except BaseException:
            f.close()
            raise
    finally:
        os.close(fd)
    return f


def _check_sealed(f, path, record):
    """The seal left out exactly the rows and the done flags; a file of a sealed format has its seal
    and its checksums (a version number alone could otherwise switch both checks off)."""
    try:
        version = int(f.attrs.get(schema.A_FORMAT, 0))
    except (TypeError, ValueError, OverflowError):
        version = 0  # named by read_meta, which every caller runs next
    if record is None:
        if version >= schema.SEALED_SINCE:
            raise DamagedFileError(f"{path}: format version {version} promises a seal, the file has none (its first "
                                   f"bytes were changed): {seal.FIX}")
        return
    if schema.CHECKSUMS not in f:
        raise DamagedFileError(f"{path}: a sealed cache file without its {schema.CHECKSUMS} dataset: {seal.FIX}")
    # a finished file holds the codec's fields, the done flags and the checksum table: all but the table
    left_out = sorted(tuple(r) for r in record["skip"])
    if left_out != stored_rows(f):
        raise DamagedFileError(f"{path}: its seal leaves out other bytes than its rows: {seal.FIX}")


def stored_rows(f):
    """[(offset, bytes)] of the datasets of a finished file stored in it, but the checksum table: what its
    seal leaves out. Links, groups and data kept elsewhere are not followed (validate.check_links names them)."""
    out = []
    for k in f.keys():
        if k == schema.CHECKSUMS or not isinstance(f.get(k, getlink=True), h5py.HardLink):
            continue
        d = f.get(k)
        # no storage yet: HDF5's "undefined address" (offset None, or wrapped past the user block)
        if isinstance(d, h5py.Dataset) and not d.is_virtual and not d.external and d.id.get_storage_size() > 0 \
                and d.id.get_offset() is not None:
            out.append((d.id.get_offset(), d.id.get_storage_size()))
    return sorted(out)


def committed_rows(f, spec=None):
    """(rows committed, closed flag) of a segment, re-read from disk. With the cache's `spec`, the
    segment is checked first (validate.check_segment) and so is the count against its room and size."""
    if spec is not None:
        capacity = check_segment(f, f.filename, spec)
    st = f[schema.SEG_STATE]
    st.refresh()
    s = st[...]
    rows = int(s[schema.STATE_ROWS])
    if spec is not None:
        check_committed(f, rows, capacity, spec.make_codec().bytes_per_row)
    return rows, bool(s[schema.STATE_CLOSED])


def read_segment_rows(f, codec, start, stop, num_keys=None):
    """Keys and encoded fields of committed rows [start, stop) of a segment; with `num_keys`,
    keys outside the cache's key space are refused (a key indexes the reader's tables)."""
    ks = f[schema.SEG_KEYS]
    ks.refresh()
    keys = ks[start:stop]
    if num_keys is not None:
        check_keys(keys, num_keys, f.filename)
    fields = {}
    for name, _, _ in codec.fields:
        d = f[name]
        d.refresh()
        fields[name] = d[start:stop]
    return keys, fields


def read_segment_items(f, start, stop):
    """The item records of rows [start, stop) of a segment (store.format.items), or None when it has none."""
    if schema.ITEMS not in f:
        return None
    d = f[schema.ITEMS]
    d.refresh()
    return d[start:stop]


def committed_keys(parts_dir, spec):
    """Every committed key of every segment (crashed segments included), each segment checked:
    one array, as long as the rows on disk (never sized by what a manifest declares)."""
    out = []
    for seg in list_segments(parts_dir):
        with open_swmr(seg) as f:
            rows, _ = committed_rows(f, spec)
            ks = f[schema.SEG_KEYS]
            ks.refresh()
            keys = ks[:rows]
            check_keys(keys, spec.num_keys, seg)
            out.append(keys)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)


def count_done(parts_dir, spec):
    """How many distinct keys the segments have committed."""
    return int(np.unique(committed_keys(parts_dir, spec)).size)


def scan_done(parts_dir, spec):
    """Boolean mask [num_keys] of keys some segment has committed (crashed segments included)."""
    done = np.zeros(spec.num_keys, dtype=bool)
    done[committed_keys(parts_dir, spec)] = True
    return done


def read_manifest(parts_dir):
    path = os.path.join(parts_dir, schema.MANIFEST)
    try:
        meta = json.loads(read_regular(path, MANIFEST_LIMIT, trusted=True).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise UnsupportedFormatError(
            f"{path}: unreadable manifest ({e}): remove the directory {parts_dir} to rebuild the cache") from None
    if not isinstance(meta, dict):
        raise UnsupportedFormatError(f"{path}: not a kdcache manifest: remove {parts_dir} to rebuild the cache")
    schema.check_format_version(meta.get(schema.A_FORMAT), path)
    try:
        meta["inputs"] = json.loads(meta[schema.A_INPUTS])
    except (KeyError, TypeError, ValueError):
        meta.pop("inputs", None)  # spec_from_meta names what is missing or malformed
    return meta


def list_segments(parts_dir):
    """The segments and published parts (store.files.parts: closed segments of fixed names) of a parts folder;
    an entry named like one that is not a regular file (a FIFO, a link, a folder) is skipped."""
    out = []
    for n in listdir(parts_dir):
        if (n.startswith("seg-") and n.endswith(".h5")) or PART.match(n):
            p = os.path.join(parts_dir, n)
            try:
                regular(p)
            except NotOurs as e:
                skipped(e)
                continue
            except OSError:
                continue
            out.append(p)
    return sorted(out)


def lock_holders(parts_dir, heartbeat_timeout=10.0):
    """The producers alive on this cache: [(lock path, info dict)].

    A fleet driver (cache_builder.fleet) holds a `fleet-<host>-<pid>.lock` the same way.
    On this host a producer is alive exactly while it holds its shard's flock (the kernel drops
    it when the process dies, even by kill -9, and a zombie holds nothing). For a producer on
    another host (shared file system) its heartbeat, the lock file's mtime, must be fresh.
    """
    import fcntl
    out = []
    names = sorted(n for n in listdir(parts_dir) if n.endswith(".lock") and n.startswith(("shard-", "fleet-")))
    for n in names:
        path = os.path.join(parts_dir, n)
        try:
            fd, _ = open_regular(path)
        except FileNotFoundError:
            continue
        except NotOurs as e:  # a FIFO or link under a lock's name locks nothing
            skipped(e)
            continue
        try:
            with open(fd, "rb") as fh:
                raw = fh.read(LOCK_LIMIT)
                try:
                    info = json.loads(raw.decode("utf-8") or "{}")
                except (ValueError, RecursionError):
                    info = {}
                if not isinstance(info, dict):
                    info = {}
                if info.get("host", HOST) == HOST:
                    try:
                        fcntl.flock(fh.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except BlockingIOError:
                        out.append((path, info))
                    else:
                        fcntl.flock(fh.fileno(), fcntl.LOCK_UN)
                elif time.time() - os.fstat(fh.fileno()).st_mtime < heartbeat_timeout:
                    out.append((path, info))
        except FileNotFoundError:
            continue
    return out


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
