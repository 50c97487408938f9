"""Where caches live, what names they use, and which files in a cache directory are kdcache's own."""
import errno
import os
import re

from . import schema
from .errors import StoreError
from .fingerprint import is_fingerprint

DEFAULT_DIR = "caches"
ENV_DIR = "KDCACHE_DIR"

# Entries of a cache directory that kdcache writes (and so may remove), besides P.h5 and P.parts:
COMPACT_TMP = re.compile(r"^([0-9a-f]{8,64})\.h5\.tmp-(\d+)$")        # a compaction's temporary file
ASIDE = re.compile(r"^\.([0-9a-f]{8,64})\.(h5|parts)\.gc-(\d+)$")      # an entry renamed aside for removal
# Files kdcache writes inside P.parts/ (see schema.py for what each holds).
OWN_PART = re.compile(r"^(manifest\.json(\.tmp-\d+)?|\.?seg-\d+of\d+-\d+-\d+\.h5(\.tmp)?|shard-\d+of\d+\.lock"
                      r"|compact\.lock|trainer-\d+\.json(\.tmp-\d+)?|\.compact-[a-z_]+\.tmp"
                      r"|demand-\d+-(wait|next)\.npy(\.tmp-\d+)?)$")


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


def compact_tmp(final, pid=None):
    """The temporary name a compaction writes `final` under before renaming it into place."""
    return f"{final}.tmp-{os.getpid() if pid is None else pid}"


def pid_alive(pid):
    """True when a process with this pid exists on this host (a reused pid counts as alive: safe)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True
    return True


def foreign_files(parts):
    """Names inside a parts folder that kdcache did not write (nothing of them is ever removed)."""
    try:
        return sorted(n for n in os.listdir(parts) if not OWN_PART.match(n))
    except FileNotFoundError:
        return []


def discard(path, *, between=None):
    """Remove a cache's finished file or parts folder: first renamed aside (one atomic step, so no
    tool sees half of it under its real name, and a process that locks it afterwards finds it
    gone), then only kdcache's own files are deleted. A parts folder holding anything else is
    left where it is, and StoreError names what is not kdcache's. Returns True if it was there."""
    path = os.fspath(path).rstrip("/")
    if os.path.isdir(path) and not os.path.islink(path):
        other = foreign_files(path)
        if other:
            raise StoreError(f"{path} holds files kdcache did not write ({', '.join(other[:3])}): left alone; "
                             f"move them out, then run gc again")
    d, name = os.path.split(path)
    aside = os.path.join(d, f".{name}.gc-{os.getpid()}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    if between is not None:
        between()
    finish_discard(aside)
    return True


def finish_discard(aside):
    """Delete an entry renamed aside (also one a crashed removal left behind)."""
    if os.path.isdir(aside) and not os.path.islink(aside):
        for n in os.listdir(aside):
            if OWN_PART.match(n):
                try:
                    os.unlink(os.path.join(aside, n))
                except (FileNotFoundError, IsADirectoryError):
                    pass  # a folder under one of kdcache's names is not kdcache's: kept
        try:
            os.rmdir(aside)
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENOTEMPTY):
                raise
    else:
        try:
            os.unlink(aside)
        except FileNotFoundError:
            pass
