"""Where caches live, what names they use, and which files in a cache directory are kdcache's own."""
import errno
import os
import re
import stat

from ..format import schema
from ..errors import StoreError
from ..format.fingerprint import is_fingerprint
from ..osutil import is_ours, listdir, own, parse_pid

DEFAULT_DIR = "caches"
ENV_DIR = "KDCACHE_DIR"

# Entries of a cache directory that kdcache writes (and so may remove), besides P.h5 and P.parts:
# ASCII digits only: Python's \d also matches other scripts' digits, which kdcache never writes.
COMPACT_TMP = re.compile(r"^([0-9a-f]{8,64})\.h5\.tmp-(\d+)$", re.ASCII)        # a compaction's temporary file
ASIDE = re.compile(r"^\.([0-9a-f]{8,64})\.(h5|parts)\.gc-(\d+)$", re.ASCII)      # an entry renamed aside for removal
# A pull's staging folder (kdcache.share.pull), beside the caches: its lock, the manifest it fetched, the cache file
# being fetched (.part) or fetched and checked. `gc` removes one that no pull holds.
PULL_STAGE = re.compile(r"^\.pull-([0-9a-f]{8,64})$", re.ASCII)
PULL_FILE = re.compile(r"^(lock|manifest\.json(\.tmp-\d+)?|[0-9a-f]{8,64}\.h5(\.part)?)$", re.ASCII)
# Immutable parts (store.files.parts): a published part, and what a publish writes before its link (named for
# its host and pid), or a damaged part set aside.
PART = re.compile(r"^part-(\d{12})-(\d{12})-([0-9a-f]{8})\.h5$", re.ASCII)
PART_TMP = re.compile(r"^\.part-\d{12}-\d{12}-[0-9a-f]{8}\.h5\.(tmp-[A-Za-z0-9_.-]{1,64}-\d+|damaged-\d+)$", re.ASCII)
_PARTS = r"|\.?part-\d{12}-\d{12}-[0-9a-f]{8}\.h5(\.(tmp-[A-Za-z0-9_.-]{1,64}-\d+|damaged-\d+))?|fleet-[A-Za-z0-9_.-]{1,64}-\d+\.lock"
# A producer's files inside P.parts/: segments (also while created), parts, shard locks and a fleet
# driver's lock (their heartbeats).
BUILD_FILE = re.compile(r"^(\.?seg-\d+of\d+-\d+-\d+\.h5(\.tmp)?|shard-\d+of\d+\.lock" + _PARTS + r")$", re.ASCII)
# Files kdcache writes inside P.parts/ (see schema.py for what each holds).
OWN_PART = re.compile(r"^(manifest\.json(\.tmp-\d+)?|\.?seg-\d+of\d+-\d+-\d+\.h5(\.tmp)?|shard-\d+of\d+\.lock" + _PARTS +
                      r"|compact\.lock|trainer-\d+\.json(\.tmp-\d+)?|\.compact-[a-z_]+\.tmp"
                      r"|demand-\d+-(wait|next)\.npy(\.tmp-\d+)?)$", re.ASCII)


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
                         f"fingerprint `kdcache ls` shows")
    return os.path.join(resolve_cache_dir(cache_dir), fp)


def exists(path):
    return os.path.exists(final_path(path)) or os.path.isdir(parts_path(path))


def compact_tmp(final, pid=None):
    """The temporary name a compaction writes `final` under before renaming it into place."""
    return f"{final}.tmp-{os.getpid() if pid is None else pid}"


def pid_alive(pid):
    """True when a process with this pid exists on this host (a reused pid counts as alive: safe).
    A number no process can have (0, above pid_max, 20 digits) is no live process."""
    p = parse_pid(pid)
    if p is None:
        return False
    try:
        os.kill(p, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def own_part(parts, name):
    """True when `name` in a parts folder is kdcache's: one of its names, a regular file of this uid."""
    return bool(OWN_PART.match(name)) and is_ours(os.path.join(parts, name))


def foreign_files(parts):
    """Names inside a parts folder that kdcache did not write (nothing of them is ever removed)."""
    return sorted(n for n in listdir(parts) if not own_part(parts, n))


def discard(path, *, between=None):
    """Remove a cache's finished file or parts folder: first renamed aside (one atomic step, so no
    tool sees half of it under its real name, and a process that locks it afterwards finds it
    gone), then only kdcache's own files are deleted. A parts folder holding anything else is
    left where it is, and StoreError names what is not kdcache's. Returns True if it was there."""
    path = os.fspath(path).rstrip("/")
    why = _not_removable(path)
    if why:
        raise StoreError(f"{path} is {why}: left alone; remove it by hand if it is yours")
    if os.path.isdir(path) and not os.path.islink(path):
        try:
            os.listdir(path)
        except OSError as e:
            raise StoreError(f"{path} cannot be read ({e.strerror}): left alone; fix its permissions, "
                             f"then run gc again") from None
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


def _not_removable(path):
    """Why kdcache may not remove the entry at `path` (a cache file or parts folder), or None: it
    must be a regular file or a folder of this uid, never a link, FIFO or another user's."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"not readable ({e.strerror})"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "neither a regular file nor a folder"
    if not own(st):
        return f"owned by another user (uid {st.st_uid})"
    return None


def finish_discard(aside):
    """Delete an entry renamed aside (also one a crashed removal left behind)."""
    if _not_removable(aside):
        return
    if os.path.isdir(aside) and not os.path.islink(aside):
        for n in listdir(aside):
            if own_part(aside, n):  # a folder, link or FIFO under one of kdcache's names is not kdcache's: kept
                try:
                    os.unlink(os.path.join(aside, n))
                except FileNotFoundError:
                    pass
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
