"""The cache directory: what is in it (ls, inspect) and what may go (gc); only kdcache's caches are touched."""
import os
import time

from ..format import schema, seal
from ..errors import DamagedFileError, NewerFormatError, NoSpaceError, StoreError
from ..format.fingerprint import is_fingerprint
from ..write.settle import last_write, locked, settle
from .stale import remove_stale, stale_files
from ..osutil import NotOurs, NotTrusted, listdir, own, read_regular, regular, skipped
from ..files.paths import (DEFAULT_DIR, ENV_DIR, OWN_PART, base_path, discard, exists, final_path, foreign_files,  # noqa: F401
                    parts_path, path_for, resolve_cache_dir)
from ..files.segment import count_done, final_spec, lock_holders, open_final, parts_spec
from .verify import verify  # noqa: F401 (python -m kdcache.store verify)

NOT_A_CACHE = "not a cache"
NEWER = "newer format"  # written by a newer kdcache: listed, never removed by this one
NOT_TRUSTED = "not trusted"  # another user can write it (osutil.check_trusted): listed, never read or removed

def touch_used(path):
    """Record 'last used' as the finished file's access time (explicitly set, whatever the mount)."""
    p = final_path(path)
    try:
        st = regular(p, mine=True)  # another user's cache is read, never touched
        os.utime(p, (time.time(), st.st_mtime), follow_symlinks=False)
    except OSError:
        pass  # read-only caches are still usable


def write_position(path, position, *, epoch=None, step=None, run=None):
    """A trainer reports how far it has read (a step count of the shared schedule) so producers
    can show their lead. One small JSON file per trainer process, replaced atomically."""
    from ..osutil import write_json_atomic
    parts = parts_path(path)
    if not os.path.isdir(parts):
        return
    try:
        write_json_atomic(os.path.join(parts, f"trainer-{os.getpid()}.json"),
                          {"position": int(position), "epoch": epoch, "step": step, "run": run,
                           "pid": os.getpid(), "time": time.time()}, indent=1, sort_keys=True,
                          fsync=False)  # read by live producers only: a crash loses nothing
    except OSError:
        pass  # progress display only


def read_positions(path, max_age_s=30.0):
    """Positions reported by trainers in the last max_age_s seconds."""
    import json
    parts = parts_path(path)
    out = []
    names = [n for n in listdir(parts) if n.startswith("trainer-") and n.endswith(".json")]
    now = time.time()
    for n in names:
        try:
            p = json.loads(read_regular(os.path.join(parts, n), 65536, mine=True).decode("utf-8"))
            if isinstance(p, dict) and now - float(p.get("time", 0)) <= max_age_s:
                out.append(p)
        except NotOurs as e:
            skipped(e)
        except (OSError, ValueError, TypeError, OverflowError, RecursionError):
            continue
    return out


def _restore_atime(path, st):
    try:
        os.utime(path, (st.st_atime, st.st_mtime), follow_symlinks=False)
    except OSError:
        pass


def _size(path):
    """Bytes of a file or folder as it stands (links not followed: a link to a large file is not ours)."""
    def size(p):
        try:
            return os.lstat(p).st_size
        except OSError:
            return 0
    if os.path.isdir(path) and not os.path.islink(path):
        return sum(size(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
    return size(path)


def cache_bases(cache_dir):
    """Base paths of every entry named like a cache (P.h5 or P.parts) in the directory; `info` tells
    which of them are kdcache's."""
    d = resolve_cache_dir(cache_dir)
    if not os.path.isdir(d):
        return []
    try:
        names = os.listdir(d)
    except OSError as e:
        raise StoreError(f"cache directory {d} cannot be read ({e.strerror}): fix its permissions or pass "
                         f"another --cache-dir") from None
    bases = set()
    for n in names:
        for suffix in (schema.FINAL_SUFFIX, schema.PARTS_SUFFIX):
            if n.endswith(suffix) and not n.startswith("."):
                bases.add(os.path.join(d, n[: -len(suffix)]))
    return sorted(bases)


def _not_ours(base):
    """Why the entry at `base` is not a kdcache cache, or None when it is one (sound or not)."""
    name, fin, parts = os.path.basename(base), final_path(base), parts_path(base)
    if not is_fingerprint(name):
        return "its name is not a cache fingerprint"
    for p in (fin, parts):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        except OSError as e:
            return f"not readable ({e.strerror})"
        if not own(st):
            return f"owned by another user (uid {st.st_uid})"
    if os.path.lexists(fin):
        if os.path.islink(fin) or not os.path.isfile(fin):
            return "not a regular file"
        kind = seal.sniff(fin)
        if kind is None:
            return "not an HDF5 file"
        try:
            with open_final(fin) as f:
                if schema.A_FORMAT not in f.attrs:
                    return "an HDF5 file without kdcache metadata"
        except DamagedFileError as e:
            if kind == "sealed" or e.ours:
                return None  # kdcache's own, damaged: info says so and gc removes it
            if "without kdcache metadata" in str(e):  # what the child that read it found
                return "an HDF5 file without kdcache metadata"
            return "an HDF5 file that cannot be opened (remove it by hand if it is a damaged cache)"
        except NotTrusted:
            return None  # info says so; never removed
            return "an HDF5 file that cannot be opened (remove it by hand if it is a damaged cache)"
        except (StoreError, OSError):
            return "an HDF5 file that cannot be opened (remove it by hand if it is a damaged cache)"
        return None
    if os.path.islink(parts) or not os.path.isdir(parts):
        return "not a folder"
    try:
        names = os.listdir(parts)
    except OSError as e:
        return f"not readable ({e.strerror})"
    if schema.MANIFEST not in names and any(not OWN_PART.match(n) for n in names):
        return "a folder without a kdcache manifest"
    return None


def info(path, *, tidy=True, held=False):
    """Summary of one entry: fingerprint, inputs, state, percent done, size, created, last used.

    States: complete, producing, committed (every key committed, compaction pending), incomplete,
    damaged (kdcache's, but unusable), "newer format" and "not a cache" (both never touched). With
    `tidy`, what a crash left is finished first (settle). `held`: the caller holds every lock of the
    cache (so no producer is alive)."""
    base = base_path(path)
    fin, parts = final_path(base), parts_path(base)
    name = os.path.basename(base)
    try:
        st0 = regular(fin, mine=True)  # before reading: looking at a cache is not using it
    except OSError:
        st0 = None  # absent, or not this user's to touch
    try:
        return _info(base, fin, parts, name, tidy, held, st0)
    finally:
        if st0 is not None:
            _restore_atime(fin, st0)


def _info(base, fin, parts, name, tidy, held, st0):
    why = _not_ours(base)
    if why is not None:
        return {"path": fin if os.path.lexists(fin) else parts, "name": name, "state": NOT_A_CACHE,
                "error": why, "size": _size(fin) + _size(parts), "done": 0.0, "last_used": None}
    full = None
    if tidy:
        try:
            settle(base)
        except NoSpaceError as e:  # shown by ls (exit 2); gc goes on, to free space
            full = str(e)
    out = {"path": fin if os.path.exists(fin) else parts, "name": name}
    if full:
        out["no_space"] = full
    try:
        if os.path.exists(fin):
            st = os.stat(fin)
            spec, meta = final_spec(fin, name)
            last_used = st0.st_atime if st0 is not None and os.path.samestat(st0, st) else st.st_atime
            out.update(state="complete", done=1.0, size=st.st_size, last_used=last_used)
            if os.path.isdir(parts):
                out["segments_left"] = parts
        else:
            spec, meta = parts_spec(parts, name)
            done = count_done(parts, spec)
            alive = [] if held else lock_holders(parts)
            state = "producing" if alive else "committed" if done == spec.num_keys else "incomplete"
            # The build's last write, never the folder's mtime: a segment appended to for hours (or a
            # heartbeat) leaves the folder as it was when the segment was created.
            out.update(state=state, done=done / spec.num_keys, size=_size(parts),
                       last_used=last_write(parts), producers=[h.get("pid") for _, h in alive])
    except (StoreError, OSError) as e:
        where = fin if os.path.exists(fin) else parts
        try:
            when = os.stat(where).st_mtime
        except OSError:
            when = None
        out.update(state=NEWER if isinstance(e, NewerFormatError) else NOT_TRUSTED if isinstance(e, NotTrusted)
                   else "damaged",
                   error=str(e).splitlines()[0] if str(e) else type(e).__name__,
                   size=_size(fin) + _size(parts), done=0.0, last_used=when)
        return out
    inputs = meta.get("inputs") or {}
    out.update(
        fingerprint=spec.fingerprint, format_version=int(meta[schema.A_FORMAT]),
        teacher=_describe(inputs.get("teacher")), dataset=_describe(inputs.get("dataset")),
        augment=inputs.get("augment") or "none", augment_seed=inputs.get("augment_seed"),
        num_samples=spec.num_samples, views=spec.views, num_classes=spec.num_classes, codec=spec.codec,
        dtype=spec.dtype, created=_text(meta.get(schema.A_CREATED)), tool_version=meta.get(schema.A_TOOL_VERSION))
    return out


def _text(x):
    """An informational attribute shown as written when it is text, else not at all (it is not checked)."""
    return x if isinstance(x, str) else None


def _describe(x):
    """Short human label of a teacher/dataset identity dict."""
    if isinstance(x, dict):
        name = x.get("name") or x.get("prefix") or ""
        dig = str(x.get("digest") or x.get("sha256") or "")  # inputs are free-form JSON
        return f"{name}@{dig[:8]}" if dig else str(name)
    return "" if x is None else str(x)


def gc(cache_dir=None, *, older_than_days=None, max_bytes=None, incomplete=True, damaged=True,
       dry_run=False, min_age_s=60.0, kept=None):
    """Remove kdcache caches: incomplete ones no producer is writing (idle for min_age_s), damaged
    ones, unused ones (last used more than older_than_days ago) and, with max_bytes, the least
    recently used finished caches until the directory fits; and files dead kdcache processes left.
    Never an entry that is not a kdcache cache, one a live process holds a lock of, or one whose
    every key is committed. Returns [(path, reason, bytes)]; `kept` (a list) receives
    [(path, why)] of what was chosen but left."""
    now = time.time()
    d = resolve_cache_dir(cache_dir)
    entries = [info(b) for b in cache_bases(d)]
    victims = []
    for e in entries:
        base = os.path.join(d, e["name"])
        age = now - e["last_used"] if e.get("last_used") is not None else float("inf")
        if e["state"] == "damaged" and damaged:
            victims.append((base, "damaged", e["size"], e["state"]))
        elif e["state"] == "incomplete" and incomplete and age >= min_age_s:
            victims.append((base, "incomplete", e["size"], e["state"]))
        elif e["state"] == "complete" and older_than_days is not None and age > older_than_days * 86400:
            victims.append((base, f"unused for {age / 86400:.1f} days", e["size"], e["state"]))
    if max_bytes is not None:
        chosen = {v[0] for v in victims}
        left = [e for e in entries if e["state"] == "complete" and os.path.join(d, e["name"]) not in chosen]
        total = sum(e["size"] for e in entries if e["state"] != NOT_A_CACHE) - sum(v[2] for v in victims)
        for e in sorted(left, key=lambda e: e["last_used"]):
            if total <= max_bytes:
                break
            victims.append((os.path.join(d, e["name"]), "over the size limit", e["size"], "complete"))
            total -= e["size"]
    stale = [(p, why, _size(p)) for p, why in stale_files(d, min_age_s=min_age_s)]
    if dry_run:
        return [v[:3] for v in victims] + stale
    removed = []
    for base, reason, size, state in victims:
        why = remove(base, expect=state)
        if why is None:
            removed.append((base, reason, size))
        elif kept is not None:
            kept.append((base, why))
    for p, why, size in stale:
        remove_stale(p)
        removed.append((p, why, size))
    return removed


def remove(path, *, expect=None):
    """Remove one kdcache cache (its finished file and its segments) under its locks, taken without
    blocking: renamed aside, then deleted. With `expect`, only while its state is still that.
    Returns None when removed, else why it was left."""
    base = base_path(path)
    why = _not_ours(base)
    if why is not None:
        return why
    other = foreign_files(parts_path(base))
    if other:  # checked before its locks are taken: taking them makes a lock file there
        return (f"{parts_path(base)} holds files kdcache did not write ({', '.join(other[:3])}): left alone; move "
                f"them out, then run gc again")
    with locked(parts_path(base)) as held:
        if not held:
            return "a live process holds one of its locks"
        if expect is not None:
            state = info(base, tidy=False, held=True)["state"]
            if state != expect:
                return f"it is {state} now"
        fin, parts = final_path(base), parts_path(base)
        targets = (fin, parts)
        if expect == "damaged" and os.path.exists(fin) and os.path.isdir(parts):
            # the finished file is what is damaged: segments beside it may still hold every row (a
            # crash after the rename); they are kept, and compacted again by the next tool
            targets = (fin,)
        try:
            for p in targets:
                discard(p)
        except (StoreError, OSError) as e:
            return str(e).splitlines()[0]
    return None
