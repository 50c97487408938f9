"""The cache directory: where caches live, how a fingerprint names one, and ls/inspect/verify/gc."""
import os
import shutil
import time

import numpy as np

from . import schema
from .errors import StoreError
from .fingerprint import is_fingerprint

DEFAULT_DIR = "caches"
ENV_DIR = "KDCACHE_DIR"


def resolve_cache_dir(cache_dir=None):
    """--cache-dir, else $KDCACHE_DIR, else ./caches."""
    return os.path.abspath(cache_dir or os.environ.get(ENV_DIR) or DEFAULT_DIR)


def base_path(path):
    """A cache's base path from any of P, P.h5 or P.parts (trailing slashes allowed)."""
    p = os.fspath(path).rstrip("/")
    for suffix in (schema.FINAL_SUFFIX, schema.PARTS_SUFFIX):
        if p.endswith(suffix):
            return p[: -len(suffix)]
    return p


def final_path(path):
    return base_path(path) + schema.FINAL_SUFFIX


def parts_path(path):
    return base_path(path) + schema.PARTS_SUFFIX


def path_for(cache_dir, fp):
    """Base path of the cache named by fingerprint `fp`; refuses names that could leave the directory."""
    if not is_fingerprint(fp):
        raise StoreError(f"{fp!r} is not a cache fingerprint (8-64 lowercase hex digits): pass the "
                         f"fingerprint `python -m store ls` shows")
    return os.path.join(resolve_cache_dir(cache_dir), fp)


def exists(path):
    return os.path.exists(final_path(path)) or os.path.isdir(parts_path(path))


def touch_used(path):
    """Record 'last used' as the finished file's access time (explicitly set, whatever the mount)."""
    p = final_path(path)
    try:
        st = os.stat(p)
        os.utime(p, (time.time(), st.st_mtime))
    except OSError:
        pass  # read-only caches are still usable


def write_position(path, position, *, epoch=None, step=None, run=None):
    """A trainer reports how far it has read (a step count of the shared schedule) so producers
    can show their lead. One small JSON file per trainer process, replaced atomically."""
    from .segment import write_json_atomic
    parts = parts_path(path)
    if not os.path.isdir(parts):
        return
    try:
        write_json_atomic(os.path.join(parts, f"trainer-{os.getpid()}.json"),
                          {"position": int(position), "epoch": epoch, "step": step, "run": run,
                           "pid": os.getpid(), "time": time.time()})
    except OSError:
        pass  # progress display only


def read_positions(path, max_age_s=30.0):
    """Positions reported by trainers in the last max_age_s seconds."""
    import json
    parts = parts_path(path)
    out = []
    try:
        names = [n for n in os.listdir(parts) if n.startswith("trainer-") and n.endswith(".json")]
    except OSError:
        return out
    now = time.time()
    for n in names:
        try:
            with open(os.path.join(parts, n), encoding="utf-8") as fh:
                p = json.load(fh)
            if now - float(p.get("time", 0)) <= max_age_s:
                out.append(p)
        except (OSError, ValueError):
            continue
    return out


def _restore_atime(path, st):
    try:
        os.utime(path, (st.st_atime, st.st_mtime))
    except OSError:
        pass


def _size(path):
    if os.path.isdir(path):
        return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs
                   if os.path.exists(os.path.join(d, f)))
    return os.path.getsize(path) if os.path.exists(path) else 0


def cache_bases(cache_dir):
    """Base paths of every cache (finished or in progress) in the directory."""
    d = resolve_cache_dir(cache_dir)
    if not os.path.isdir(d):
        return []
    bases = set()
    for n in os.listdir(d):
        for suffix in (schema.FINAL_SUFFIX, schema.PARTS_SUFFIX):
            if n.endswith(suffix) and not n.startswith("."):
                bases.add(os.path.join(d, n[: -len(suffix)]))
    return sorted(bases)


def info(path):
    """Summary of one cache: fingerprint, inputs, state, percent done, size, created, last used."""
    from .segment import (committed_rows, list_segments, lock_holders, open_final, open_swmr,
                          read_manifest, read_meta)
    base = base_path(path)
    fin, parts = final_path(base), parts_path(base)
    out = {"path": fin if os.path.exists(fin) else parts, "name": os.path.basename(base)}
    try:
        if os.path.exists(fin):
            st = os.stat(fin)  # before reading: looking at a cache is not using it
            with open_final(fin) as f:
                meta = read_meta(f, fin)
            _restore_atime(fin, st)
            out.update(state="complete", done=1.0, size=st.st_size, last_used=st.st_atime)
        else:
            meta = read_manifest(parts)
            if meta is None:
                raise StoreError(f"{parts}: no manifest")
            nk = int(meta[schema.A_NUM_SAMPLES]) * int(meta[schema.A_VIEWS])
            done = np.zeros(nk, dtype=bool)
            for seg in list_segments(parts):
                with open_swmr(seg, retry_s=0.5) as f:
                    rows, _ = committed_rows(f)
                    k = f[schema.SEG_KEYS]
                    k.refresh()
                    done[k[:rows]] = True
            alive = lock_holders(parts)
            st = os.stat(parts)
            out.update(state="producing" if alive else "incomplete", done=float(done.mean()) if nk else 0.0,
                       size=_size(parts), last_used=st.st_mtime,
                       producers=[h.get("pid") for _, h in alive])
    except StoreError as e:
        out.update(state="damaged", error=str(e), size=_size(fin) + _size(parts), done=0.0,
                   last_used=os.stat(fin if os.path.exists(fin) else parts).st_mtime)
        return out
    inputs = meta.get("inputs") or {}
    out.update(
        fingerprint=meta.get(schema.A_FINGERPRINT), format_version=int(meta[schema.A_FORMAT]),
        teacher=_describe(inputs.get("teacher")), dataset=_describe(inputs.get("dataset")),
        num_samples=int(meta[schema.A_NUM_SAMPLES]), views=int(meta[schema.A_VIEWS]),
        num_classes=int(meta[schema.A_NUM_CLASSES]), codec=meta[schema.A_CODEC], dtype=meta[schema.A_DTYPE],
        created=meta.get(schema.A_CREATED), tool_version=meta.get(schema.A_TOOL_VERSION))
    return out


def _describe(x):
    """Short human label of a teacher/dataset identity dict."""
    if isinstance(x, dict):
        name = x.get("name") or x.get("prefix") or ""
        dig = x.get("digest") or x.get("sha256") or ""
        return f"{name}@{dig[:8]}" if dig else str(name)
    return "" if x is None else str(x)


def gc(cache_dir=None, *, older_than_days=None, max_bytes=None, incomplete=True, damaged=True,
       dry_run=False, min_age_s=60.0):
    """Remove caches: incomplete ones no producer is writing (idle for min_age_s), damaged ones,
    unused ones (last used more than older_than_days ago) and, with max_bytes, the least recently
    used finished caches until the directory fits. Returns [(path, reason, bytes)]."""
    now = time.time()
    entries = [info(b) for b in cache_bases(cache_dir)]
    victims = []
    for e in entries:
        base = os.path.join(resolve_cache_dir(cache_dir), e["name"])
        if e["state"] == "producing":
            continue
        if e["state"] == "damaged" and damaged:
            victims.append((base, "damaged", e["size"]))
        elif e["state"] == "incomplete" and incomplete and now - e["last_used"] >= min_age_s:
            victims.append((base, "incomplete", e["size"]))
        elif e["state"] == "complete" and older_than_days is not None \
                and now - e["last_used"] > older_than_days * 86400:
            victims.append((base, f"unused for {(now - e['last_used']) / 86400:.1f} days", e["size"]))
    if max_bytes is not None:
        chosen = {v[0] for v in victims}
        left = [e for e in entries if e["state"] == "complete"
                and os.path.join(resolve_cache_dir(cache_dir), e["name"]) not in chosen]
        total = sum(e["size"] for e in entries) - sum(v[2] for v in victims)
        for e in sorted(left, key=lambda e: e["last_used"]):
            if total <= max_bytes:
                break
            victims.append((os.path.join(resolve_cache_dir(cache_dir), e["name"]), "over the size limit", e["size"]))
            total -= e["size"]
    if not dry_run:
        for base, _, _ in victims:
            remove(base)
    return victims


def remove(path):
    base = base_path(path)
    try:
        os.unlink(final_path(base))
    except FileNotFoundError:
        pass
    shutil.rmtree(parts_path(base), ignore_errors=True)


def verify(path, *, block_rows=65536):
    """Check a cache: schema, flags, fingerprint, finite values, key ranges, completeness.

    Returns (report dict, [problems]); the cache is sound exactly when problems is empty.
    """
    import json as _json

    from .errors import StoreError as _SE
    from .segment import committed_rows, list_segments, open_final, open_swmr, read_manifest, read_meta
    from .spec import CacheSpec
    base = base_path(path)
    fin, parts = final_path(base), parts_path(base)
    problems = []
    report = {"path": fin if os.path.exists(fin) else parts}

    def check_meta(meta, where):
        try:
            spec = CacheSpec.from_meta(meta)
        except (_SE, KeyError, ValueError, TypeError) as e:
            problems.append(f"{where}: metadata incomplete or invalid ({e})")
            return None
        if spec.fingerprint != meta.get(schema.A_FINGERPRINT):
            problems.append(f"{where}: fingerprint attribute {meta.get(schema.A_FINGERPRINT)} does not match "
                            f"the inputs it records ({spec.fingerprint}): metadata was altered")
        if is_fingerprint(os.path.basename(base)) and os.path.basename(base) != meta.get(schema.A_FINGERPRINT):
            problems.append(f"{where}: file is named {os.path.basename(base)} but holds fingerprint "
                            f"{meta.get(schema.A_FINGERPRINT)}")
        return spec

    def check_rows(fields, codec, where, c):
        for name, arr in fields.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                problems.append(f"{where}: dataset {name} holds NaN/Inf values")
        if schema.TOPK_INDICES in fields:
            ix = fields[schema.TOPK_INDICES]
            if ix.size and (ix.min() < 0 or ix.max() >= c):
                problems.append(f"{where}: {schema.TOPK_INDICES} has class indices outside [0, {c})")

    try:
        if os.path.exists(fin):
            with open_final(fin) as f:
                meta = read_meta(f, fin)
                spec = check_meta(meta, fin)
                if spec is None:
                    return report, problems
                codec = spec.make_codec()
                n, v = spec.num_samples, spec.views
                report.update(fingerprint=spec.fingerprint, num_keys=spec.num_keys, kind=meta.get(schema.A_KIND))
                if int(meta.get(schema.A_COMPLETE, 0)) != 1:
                    problems.append(f"{fin}: complete flag is not set")
                for name, shape, dtype in codec.fields + [(schema.DONE, (), np.dtype(np.uint8))]:
                    if name not in f:
                        problems.append(f"{fin}: dataset {name} is missing")
                    elif f[name].shape != (n, v) + tuple(shape) or f[name].dtype != dtype:
                        problems.append(f"{fin}: dataset {name} is {f[name].shape} {f[name].dtype}, expected "
                                        f"{(n, v) + tuple(shape)} {dtype}")
                if problems:
                    return report, problems
                if not np.all(f[schema.DONE][...] == 1):
                    problems.append(f"{fin}: some rows are not marked done")
                step = max(1, block_rows // v)
                for a in range(0, n, step):
                    check_rows({name: f[name][a:a + step] for name, _, _ in codec.fields}, codec,
                               f"{fin} samples [{a}, {min(n, a + step)})", spec.num_classes)
                report["done"] = 1.0
        elif os.path.isdir(parts):
            meta = read_manifest(parts)
            if meta is None:
                problems.append(f"{parts}: no manifest")
                return report, problems
            spec = check_meta(meta, parts)
            if spec is None:
                return report, problems
            codec = spec.make_codec()
            done = np.zeros(spec.num_keys, dtype=bool)
            for seg in list_segments(parts):
                with open_swmr(seg, retry_s=1.0) as f:
                    sm = read_meta(f, seg)
                    if sm.get(schema.A_FINGERPRINT) != spec.fingerprint:
                        problems.append(f"{seg}: belongs to fingerprint {sm.get(schema.A_FINGERPRINT)}")
                        continue
                    rows, _ = committed_rows(f)
                    from .segment import read_segment_rows
                    for a in range(0, rows, block_rows):
                        keys, fields = read_segment_rows(f, codec, a, min(rows, a + block_rows))
                        if keys.size and (keys.min() < 0 or keys.max() >= spec.num_keys):
                            problems.append(f"{seg}: keys outside [0, {spec.num_keys})")
                            continue
                        check_rows(fields, codec, f"{seg} rows [{a}, {a + keys.size})", spec.num_classes)
                        done[keys] = True
            report.update(fingerprint=spec.fingerprint, num_keys=spec.num_keys, done=float(done.mean()))
            problems.append(f"{parts}: incomplete: {int((~done).sum())} of {spec.num_keys} keys not done yet "
                            f"(run the producer to finish it)")
        else:
            problems.append(f"no cache at {base}")
    except _SE as e:
        problems.append(str(e))
    except (OSError, KeyError, ValueError, _json.JSONDecodeError) as e:
        problems.append(f"{report['path']}: unreadable ({type(e).__name__}: {e})")
    return report, problems
