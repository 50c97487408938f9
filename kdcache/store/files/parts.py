"""Immutable parts: a cache filled by many hosts, one file per task, each published exactly once.

NOTE [parts]
A task owns a fixed block [a, b) of the flat key space and computes the keys of it still owed.
It writes them as one part file in local scratch (the layout of a closed segment: codec fields,
contiguous as in a finished file, keys, state = [rows, closed], item records, plus `part_checksums`,
a CRC-32 of each dataset's bytes), fsyncs it, copies it into the shared `P.parts/` folder under a temporary name of its own,
fsyncs that, and publishes it with link(2) under its fixed name
`part-<a>-<b>-<crc32 of its keys>.h5`. link(2) never replaces: of two tasks that computed the same
part (a retried task, two drivers on one cache) the first publish wins; the second compares its
bytes with the published part and is dropped when equal, refused and named when not. Nothing in
the shared folder is ever opened for writing after it has its name, so readers on other hosts
read only files no one writes (no SWMR across a network file system). The part's name carries
its keys' digest: a part computed for another set of owed keys of the same block (after a crash
of a producer that had filled some of them) is another part, never mistaken for this one.

Readers, `verify`, resumed producers and compaction see parts as closed segments
(segment.list_segments lists both). `finish` checks every part (its checksums, its name, its
metadata against the cache's spec) before the cache is compacted: a damaged part is set aside
(named) and its keys are owed again; a key held by two parts with different rows is refused.
"""
import errno
import json
import os
import re
import socket
import zlib

import h5py
import numpy as np

from ..format import items as item_records, schema
from ..errors import DamagedFileError, StoreError
from ..osutil import fsync_dir, is_ours, listdir, write_all
from .paths import PART, PART_TMP  # noqa: F401 (PART_TMP: re-exported)
from .segment import chunk_rows

CHECKSUMS = "part_checksums"   # uint32 [datasets]: zlib.crc32 of each dataset's bytes; attribute `datasets`
A_RANGE = "part_range"         # "[a, b)" as JSON [a, b]
A_HOST = "part_host"           # JSON: host name, CPU model, vector instruction set, kdcache version
KIND_PART = "part"
HOST = socket.gethostname()


class PartConflictError(StoreError):
    """Two computations of one part gave different rows: the first published is kept, the other named."""


def key_digest(keys):
    return zlib.crc32(np.ascontiguousarray(keys, dtype="<i8").tobytes()) & 0xFFFFFFFF


def part_name(a, b, keys):
    return f"part-{int(a):012d}-{int(b):012d}-{key_digest(keys):08x}.h5"


def parse_name(name):
    """(a, b, digest) of a part's file name, or None."""
    m = PART.match(name)
    return (int(m.group(1)), int(m.group(2)), int(m.group(3), 16)) if m else None


def list_parts(parts_dir):
    return sorted(os.path.join(parts_dir, n) for n in listdir(parts_dir) if PART.match(n))


VECTOR_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "amx_tile")


def host_identity():
    """This host as a part records it: a retried task on another CPU can give other float bits."""
    from kdcache import __version__
    model, flags = "unknown", []
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                k, _, v = line.partition(":")
                k = k.strip()
                if k == "model name" and model == "unknown":
                    model = v.strip()
                elif k == "flags":
                    have = set(v.split())
                    flags = [f for f in VECTOR_FLAGS if f in have]
                    break
    except OSError:
        pass
    return {"host": HOST, "cpu": model, "vector": flags, "kdcache": __version__}


def _crc(arr):
    return zlib.crc32(memoryview(np.ascontiguousarray(arr)).cast("B")) & 0xFFFFFFFF


def write_part(path, spec, a, b, keys, encoded, items=None, identity=None):
    """Write the part of keys `keys` (ascending, inside [a, b)) with `encoded` {field: rows} at `path`
    (local scratch), and fsync it. `items`: the rows' item records (store.format.items), or None."""
    keys = np.asarray(keys, dtype=np.int64)
    n = keys.size
    if n == 0 or (np.diff(keys) <= 0).any() or keys[0] < a or keys[-1] >= b:
        raise StoreError(f"a part of [{a}, {b}) takes ascending distinct keys inside it: a bug in the task")
    codec = spec.make_codec()
    names = []
    sums = []
    with h5py.File(path, "w", libver="latest") as f:
        for k, v in spec.meta().items():
            f.attrs[k] = schema.attr_value(v)
        f.attrs[schema.A_KIND] = schema.attr_value(KIND_PART)
        f.attrs[schema.A_SHARD] = schema.attr_value(f"part {a}-{b}")
        f.attrs[schema.A_COMPLETE] = 0
        f.attrs[A_RANGE] = schema.attr_value(json.dumps([int(a), int(b)]))
        f.attrs[A_HOST] = schema.attr_value(json.dumps(identity or host_identity(), sort_keys=True))
        # The codec's fields contiguous (the finished file's layout): one offset a field, which a reader
        # could map (store.read.mapped) as it maps P.h5; keys and item records chunked, as in a segment.
        data = [(fname, np.asarray(encoded[fname], dtype=dtype).reshape((n,) + tuple(shape)), None)
                for fname, shape, dtype in codec.fields]
        data.append((schema.SEG_KEYS, keys, chunk_rows(8 * 64)))
        if items is not None:
            data.append((schema.ITEMS, item_records.as_records(items, n), chunk_rows(schema.ITEM_DTYPE.itemsize * 64)))
        for name, arr, per_chunk in data:
            f.create_dataset(name, data=arr, chunks=(min(n, per_chunk),) + arr.shape[1:] if per_chunk else None)
            names.append(name)
            sums.append(_crc(arr))
        f.create_dataset(schema.SEG_STATE, data=np.array([n, 1], dtype=np.int64), chunks=(schema.STATE_LEN,))
        d = f.create_dataset(CHECKSUMS, data=np.array(sums, dtype=np.uint32))
        d.attrs["datasets"] = schema.attr_value(json.dumps(names))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return path


def read_part(path, spec):
    """Check a part against its checksums, its name and `spec`; returns (keys, {dataset: array}).
    A part that fails any check is DamagedFileError naming the part and what failed."""
    from .segment import check_segment, open_swmr
    name = os.path.basename(path)
    parsed = parse_name(name)
    if parsed is None:
        raise DamagedFileError(f"{path}: not a part's name")
    a, b, digest = parsed
    fix = "it is set aside and its keys computed again by the next run"
    try:
        with open_swmr(path, retry_s=0) as f:
            rows = check_segment(f, path, spec)
            try:
                names = json.loads(f[CHECKSUMS].attrs["datasets"])
                sums = f[CHECKSUMS][...]
            except (KeyError, ValueError, TypeError, OSError) as e:
                raise DamagedFileError(f"{path}: no readable {CHECKSUMS} ({type(e).__name__}): {fix}") from None
            want = {n for n, _, _ in spec.make_codec().fields} | {schema.SEG_KEYS}
            if not want <= set(names) or len(names) != len(sums):
                raise DamagedFileError(f"{path}: its {CHECKSUMS} do not cover {sorted(want - set(names))}: {fix}")
            out = {}
            for n_, s in zip(names, sums):
                if n_ not in f:
                    raise DamagedFileError(f"{path}: dataset {n_} is missing: {fix}")
                arr = f[n_][...]
                if _crc(arr) != int(s):
                    raise DamagedFileError(f"{path}: dataset {n_} fails its CRC-32 (the file changed after it "
                                           f"was written): {fix}")
                out[n_] = arr
            state = f[schema.SEG_STATE][...]
            if int(state[schema.STATE_ROWS]) != rows or int(state[schema.STATE_CLOSED]) != 1:
                raise DamagedFileError(f"{path}: its state {state.tolist()} is not that of a whole part of {rows} "
                                       f"rows: {fix}")
            rng = f.attrs.get(A_RANGE)
    except DamagedFileError:
        raise
    except StoreError as e:
        raise DamagedFileError(f"{e}") from None
    except (OSError, RuntimeError, ValueError, KeyError) as e:
        raise DamagedFileError(f"{path}: unreadable ({type(e).__name__}: {str(e).splitlines()[0][:160]}): {fix}") from None
    keys = out[schema.SEG_KEYS]
    try:
        stated = json.loads(rng if isinstance(rng, str) else rng.decode())
    except (ValueError, AttributeError, TypeError):
        stated = None
    if stated != [a, b] or key_digest(keys) != digest or keys.size == 0 or keys[0] < a or keys[-1] >= b \
            or (np.diff(keys) <= 0).any() or b > spec.num_keys:
        raise DamagedFileError(f"{path}: its keys or its range do not match its name (range {stated}, keys digest "
                               f"{key_digest(keys):08x}): {fix}")
    return keys, out


def same_rows(x, y):
    """True when two parts' datasets hold the same bytes (items aside: records, not rows)."""
    if set(x) - {schema.ITEMS} != set(y) - {schema.ITEMS}:
        return False
    return all(np.array_equal(x[k].view(np.uint8), y[k].view(np.uint8)) for k in x if k != schema.ITEMS)


def publish(local, parts_dir, spec):
    """Publish the part at `local` (written and fsynced in scratch) into `parts_dir` under its fixed
    name, never replacing: returns "published", "duplicate" when an equal part was there first, or "finished"
    when the cache was compacted (its parts folder removed) meanwhile.
    A different part there first is PartConflictError (the published one is kept)."""
    name = os.path.basename(local)
    if parse_name(name) is None:
        raise StoreError(f"{local}: not a part's name")
    dest = os.path.join(parts_dir, name)
    tmp = os.path.join(parts_dir, f".{name}.tmp-{re.sub(r'[^A-Za-z0-9_.-]', '_', HOST)[:64]}-{os.getpid()}")
    if os.path.lexists(tmp):
        if not is_ours(tmp):
            raise StoreError(f"{tmp}: in the way and not a file kdcache wrote: move it away")
        os.unlink(tmp)  # this pid's own leftover
    try:
        _copy(local, tmp)
        try:
            os.link(tmp, dest)
            outcome = "published"
        except FileExistsError:
            outcome = "duplicate"
        except OSError as e:
            if e.errno != errno.EEXIST:
                raise
            outcome = "duplicate"
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
    if outcome == "published":
        fsync_dir(parts_dir)
        return outcome
    _, mine = read_part(local, spec)
    try:
        _, theirs = read_part(dest, spec)
    except DamagedFileError:
        if os.path.lexists(dest):
            raise  # a damaged published part: finish sets it aside and its keys are computed again
        if os.path.lexists(parts_dir):  # set aside (damaged) since the link failed: this copy takes its place
            return publish(local, parts_dir, spec)
        return "finished"  # compacted since the link failed: the cache holds these rows already
    if not same_rows(mine, theirs):
        ident = _identity(dest)
        raise PartConflictError(
            f"{dest}: the same task computed twice gave different rows (published by {ident.get('host', '?')}, "
            f"CPU {ident.get('cpu', '?')} {'+'.join(ident.get('vector', []))}; this one on {HOST}, CPU "
            f"{host_identity()['cpu']}): the teacher's output depends on the host; the published part is kept. "
            f"Run the producers on one CPU type, or use the float16 codec's tolerance (kdcache verify)")
    return outcome


def _identity(path):
    from .segment import open_swmr
    try:
        with open_swmr(path, retry_s=0) as f:
            v = f.attrs.get(A_HOST)
            return json.loads(v if isinstance(v, str) else v.decode())
    except Exception:  # a part that cannot say who wrote it: named without a host
        return {}


def _copy(src, dst):
    """Copy `src` to a new file `dst` (O_EXCL: never through a link) and fsync it."""
    fd = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        with open(src, "rb") as fh:
            while True:
                chunk = fh.read(1 << 20)
                if not chunk:
                    break
                write_all(fd, chunk)
        os.fsync(fd)
    finally:
        os.close(fd)


def check_parts(parts_dir, spec):
    """Before a cache built from parts is compacted: every part checked (`read_part`); a damaged one is
    set aside (renamed `.part-....damaged-<pid>`, named in the result) so its keys are owed again; a key in
    two parts must have equal rows in both (else PartConflictError). Returns {"parts", "damaged":
    [(name, why)], "rows", "keys"}: rows counted over the sound parts, keys their distinct keys."""
    damaged, sound = [], []
    rows = 0
    owner = np.full(spec.num_keys, -1, dtype=np.int32)  # which sound part holds each key first
    for p in list_parts(parts_dir):
        try:
            keys, data = read_part(p, spec)
        except DamagedFileError as e:
            aside = os.path.join(parts_dir, f".{os.path.basename(p)}.damaged-{os.getpid()}")
            try:
                os.rename(p, aside)
            except FileNotFoundError:
                continue
            damaged.append((os.path.basename(p), str(e)))
            continue
        rows += keys.size
        for o in np.unique(owner[keys][owner[keys] >= 0]):
            okeys, odata = read_part(sound[o], spec)
            common, i, j = np.intersect1d(keys, okeys, assume_unique=True, return_indices=True)
            if not all(np.array_equal(data[k][i].view(np.uint8), odata[k][j].view(np.uint8))
                       for k in data if k not in (schema.ITEMS, schema.SEG_KEYS)):
                raise PartConflictError(
                    f"{p} and {sound[o]} both hold key {int(common[0])} with different rows: two computations "
                    f"of these keys disagree; remove one of the two parts (the cache is finished from the other)")
        fresh = owner[keys] < 0
        owner[keys[fresh]] = len(sound)
        sound.append(p)
    return {"parts": len(sound), "damaged": damaged, "rows": rows, "keys": int((owner >= 0).sum())}
