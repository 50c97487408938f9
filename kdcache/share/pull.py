"""kdcache pull: a published cache fetched beside the cache directory, resumed, checked, installed by its fingerprint.

NOTE [a pulled file is untrusted]
Everything a pull fetches is input from someone else until it is checked. The manifest is read as JSON and
checked against itself (and against --expect-sha256) before any file is fetched. Each file is written to
`<cache dir>/.pull-<fingerprint>/<name>.part`, hashed as it arrives; nothing opens it with HDF5 before its
sha256 is the manifest's. Only then does `kdcache verify` read it (the file's seal, metadata, fingerprint
against its name, every chunk's CRC-32, every value), and only a sound file is installed: linked under
`<cache dir>/<fingerprint>.h5` (link(2) never replaces a file there), under the cache's locks, so no
producer's compaction races it. A refusal installs nothing and leaves the cache directory as it was.

An interrupted pull (a kill, a dropped connection, a stalled server) leaves the staged folder; the next pull
of the same publication (the same manifest bytes) goes on from the bytes already there with a range request,
re-reading them only to hash them. A file whose fetched bytes do not match after a resume is fetched once
more, whole (what was kept from before could be what is wrong); a second mismatch is the server's file.
"""
import errno
import fcntl
import hashlib
import json
import os
import sys

from kdcache.args import Dir, Float, Parser
from kdcache.errors import KdcacheError, as_command
from kdcache.store.errors import NewerFormatError, StoreError
from kdcache.store.write.settle import locked, remote_holders, settle
from kdcache.store.osutil import fsync_dir, write_atomic
from kdcache.store.files.paths import parts_path, resolve_cache_dir
from kdcache.store.files.segment import lock_holders

from . import manifest as M
from .remote import Flusher, failure, place

STAGE_PREFIX = ".pull-"  # kdcache.store.files.paths.PULL_STAGE: gc removes a staging folder no pull holds
LOCK = "lock"
PART = ".part"


class Refused(M.ShareError):
    """The publication itself is wrong (its manifest, a file's bytes or size, the cache in it): nothing is kept."""


def _progress(total, initial, enabled, desc):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                file=sys.stderr, disable=None if enabled else True, leave=False)


def sha256_of(path, bar=None):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while True:
            b = fh.read(8 << 20)
            if not b:
                return h.hexdigest()
            h.update(b)
            if bar is not None:
                bar.update(len(b))


def _hash_prefix(fd, size, h, bar):
    at = 0
    while at < size:
        b = os.pread(fd, min(8 << 20, size - at), at)
        if not b:
            break
        h.update(b)
        at += len(b)
        bar.update(len(b))
    return at


def _unlink(path):
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class Stage:
    """The folder a pull fetches into: beside the cache directory's entries, on its file system (so installing is
    a link), named for the fingerprint (so a second pull resumes), locked while a pull uses it."""

    def __init__(self, cache_dir, fp):
        self.path = os.path.join(cache_dir, STAGE_PREFIX + fp)
        self.fd = None

    def __enter__(self):
        try:
            os.mkdir(self.path, 0o700)
        except FileExistsError:
            if os.path.islink(self.path) or not os.path.isdir(self.path):
                raise M.ShareError(f"{self.path}: in the way, and not a folder a pull made: move it away") from None
        self.fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self.fd)
            raise M.ShareError(f"another pull of this cache is running into {os.path.dirname(self.path)} (its folder "
                               f"{self.path} is locked): wait for it") from None
        return self

    def file(self, name):
        return os.path.join(self.path, name)

    def keep_only(self, names):
        """Remove what an older pull of another publication left (files this module writes only)."""
        for n in os.listdir(self.path):
            if n != LOCK and n not in names:
                p = self.file(n)
                if os.path.isfile(p) and not os.path.islink(p):
                    _unlink(p)

    def remove(self):
        """The whole folder, after an install or a refusal (nothing in it is worth keeping then)."""
        for n in os.listdir(self.path):
            p = self.file(n)
            if os.path.isfile(p) and not os.path.islink(p):
                _unlink(p)
        try:
            os.rmdir(self.path)
        except OSError:
            pass

    def __exit__(self, *exc):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def fetch(src, entry, stage, bar, *, again=True):
    """Fetch one file of the manifest into the stage, resuming what is there; its path once its sha256 matches."""
    name, size, want = entry["path"], entry["size"], entry["sha256"]
    done, part = stage.file(name), stage.file(name + PART)
    where = src.address(name)
    if os.path.exists(done):  # fetched whole by an earlier pull: hashed again, never fetched again
        if sha256_of(done, bar) == want:
            return done
        _unlink(done)
    fd = os.open(part, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        have = os.fstat(fd).st_size
        if have > size:
            os.ftruncate(fd, 0)
            have = 0
        h = hashlib.sha256()
        have = _hash_prefix(fd, have, h, bar)
        resumed = have
        flusher = Flusher(fd)
        try:
            for b in (src.blocks(name, have, size) if have < size else ()):
                if have + len(b) > size:
                    raise Refused(f"{where}: the server sends more than the {size:,} bytes the manifest gives the "
                                  f"file: the publication changed or is damaged; ask its publisher")
                view = memoryview(b)
                at = have
                while view:
                    k = os.pwrite(fd, view, at)
                    view, at = view[k:], at + k
                h.update(b)
                have += len(b)
                bar.update(len(b))
                flusher.wrote(len(b))
        finally:
            flusher.stop()
        os.fsync(fd)
    finally:
        os.close(fd)
    if have < size:
        raise Refused(f"{where}: the server sent {have:,} of the {size:,} bytes the manifest gives the file (it is "
                      f"truncated there, or still being copied): nothing installed; ask its publisher")
    if h.hexdigest() != want:
        _unlink(part)
        if resumed and again:  # the bytes kept from before may be what is wrong: once more, whole
            bar.reset(total=size)
            return fetch(src, entry, stage, bar, again=False)
        raise Refused(f"{where}: its sha256 {h.hexdigest()} is not the manifest's {want} (the file was changed or "
                      f"damaged on the server or on the way): nothing installed; ask its publisher")
    os.replace(part, done)
    fsync_dir(stage.path)
    return done


def check_cache(staged, fp):
    """The cache's own checks (its seal, metadata and fingerprint against its name, the done flags, every chunk's
    checksum), after its sha256 matched. Its values were scanned by the publisher's verify; the same bytes hold
    the same values, so they are not scanned again here."""
    from kdcache.store.folder.verify import verify
    try:
        report, problems = verify(staged, values=False)
    except NewerFormatError as e:
        raise Refused(f"{e}") from None
    except StoreError as e:
        raise Refused(f"{e}: nothing installed") from None
    if problems:
        raise Refused(f"{problems[0]}: nothing installed")
    if report.get("fingerprint") != fp:
        raise Refused(f"{staged}: holds the cache {report.get('fingerprint')}, the manifest names {fp}: nothing "
                      f"installed; ask its publisher")


def install(staged, fin, want):
    """Link the checked file under its fingerprint's name, under the cache's locks (no producer of the same cache
    alive, no compaction of it running): a file already there is never replaced."""
    base = fin[: -len(".h5")]
    parts = parts_path(base)
    with locked(parts) as held:
        if not held or (os.path.isdir(parts) and remote_holders(parts)):
            who = ", ".join(f"pid {h.get('pid')} on {h.get('host', '?')}" for _, h in lock_holders(parts)) or \
                "a live process"
            raise M.ShareError(f"{parts}: a build of this cache is in progress ({who}): it makes the same cache; wait "
                               f"for it to finish, or stop it and pull again: nothing installed")
        try:
            os.link(staged, fin)
        except FileExistsError:
            _installed_already(fin, want)
        except OSError as e:
            if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
                raise
            if os.path.lexists(fin):  # a file system without hard links: a rename, the lock held, nothing there
                _installed_already(fin, want)
            else:
                os.rename(staged, fin)
        fsync_dir(os.path.dirname(fin))
    _unlink(staged)
    try:
        settle(base)  # segments a dead build of the same cache left beside it
    except StoreError:
        pass


def _installed_already(fin, want):
    """A file under the name: the same bytes (done already) or another cache under that name (refused)."""
    if os.path.islink(fin) or not os.path.isfile(fin):
        raise M.ShareError(f"{fin}: in the way and not a cache file: move it away, then pull again")
    have = sha256_of(fin)
    if have != want:
        raise M.ShareError(f"{fin}: the cache directory already holds a different cache under this name (sha256 "
                           f"{have[:12]}..., the published one is {want[:12]}...: another build of the same inputs): "
                           f"nothing installed; keep yours, or remove it (kdcache gc) or pass another --cache-dir to "
                           f"pull the published one")


def pull(src, *, cache_dir=None, expect_sha256=None, timeout=30.0, progress=False):
    """Fetch the publication at `src` (a folder, or a URL: http(s):// through fsspec's HTTP back end, file://,
    s3://, ... where installed), check it and install it in the cache directory under its fingerprint.
    Returns {"fingerprint", "path", "fetched" (bytes fetched by this call), "installed" (False when the same
    file was there already), "manifest_sha256"}. Raises ShareError (one line) when refused or when it fails;
    nothing is installed then. `expect_sha256`: the manifest's sha256 as its publisher gave it; any other
    manifest is refused."""
    try:
        return _pull(src, cache_dir=cache_dir, expect_sha256=expect_sha256, timeout=timeout, progress=progress)
    except M.ShareError:
        raise
    except StoreError as e:
        raise M.ShareError(str(e)) from None
    except OSError as e:
        raise M.ShareError(f"{e.filename or src}: {e.strerror or e} ({type(e).__name__}): check the cache directory "
                           f"and run the same command again") from None


def _pull(src, *, cache_dir, expect_sha256, timeout, progress):
    if expect_sha256 is not None:
        expect_sha256 = str(expect_sha256).strip().lower()
        if not M.SHA256.match(expect_sha256):
            raise M.ShareError(f"--expect-sha256 {expect_sha256!r}: give the 64 hex digits `kdcache publish` printed")
    s = place(src, timeout=timeout)
    where = s.address(M.MANIFEST)
    try:
        raw = s.read_small(M.MANIFEST, M.MANIFEST_LIMIT)
    except FileNotFoundError:
        raise M.ShareError(f"{where}: not found: SRC must be a folder kdcache publish wrote (it holds "
                           f"{M.MANIFEST})") from None
    except OSError as e:
        raise failure(e, where, timeout) from None
    if len(raw) > M.MANIFEST_LIMIT:
        raise M.ShareError(f"{where}: more than {M.MANIFEST_LIMIT:,} bytes: not a kdcache manifest")
    sha = M.sha256_hex(raw)
    if expect_sha256 is not None and sha != expect_sha256:
        raise M.ShareError(f"{where}: its sha256 is {sha}, not the {expect_sha256} you pinned: the publication was "
                           f"replaced, or the digest is of another one; nothing fetched")
    man = M.parse(raw, where)
    fp = man["fingerprint"]
    entry = man["files"][0]
    d = resolve_cache_dir(cache_dir)
    os.makedirs(d, exist_ok=True)
    fin = os.path.join(d, M.cache_file_name(fp))
    out = {"fingerprint": fp, "path": fin, "fetched": 0, "installed": False, "manifest_sha256": sha}
    if os.path.lexists(fin):  # nothing to fetch when the same bytes are there; another cache there is refused
        _installed_already(fin, entry["sha256"])
        return out
    with Stage(d, fp) as stage:
        kept = stage.file(M.MANIFEST)
        same = os.path.isfile(kept) and open(kept, "rb").read() == raw
        names = {M.MANIFEST, entry["path"], entry["path"] + PART}
        stage.keep_only(names if same else set())
        if not same:
            write_atomic(kept, raw)  # fsynced, and the rename too
        try:
            try:  # every file is there with its size before a byte of any is fetched
                size = s.size(entry["path"])
            except FileNotFoundError:
                raise Refused(f"{s.address(entry['path'])}: the manifest names this file and the server has none: "
                              f"the publication is incomplete; ask its publisher") from None
            if size != entry["size"]:
                raise Refused(f"{s.address(entry['path'])}: {size:,} bytes, the manifest says {entry['size']:,}: the "
                              f"manifest does not match its files (truncated or replaced); ask its publisher")
            before = _staged_bytes(stage, entry)
            with _progress(entry["size"], 0, progress, f"pull {fp}") as bar:
                try:
                    staged = fetch(s, entry, stage, bar)
                except FileNotFoundError:
                    raise Refused(f"{s.address(entry['path'])}: gone from the server while it was fetched: the "
                                  f"publication changed; pull it again once it is whole") from None
            out["fetched"] = max(0, entry["size"] - before)
            check_cache(staged, fp)
        except Refused:
            stage.remove()
            raise
        try:
            install(staged, fin, entry["sha256"])
        except M.ShareError:
            raise  # the checked file stays staged: the next pull installs it without fetching it again
        stage.remove()
    out["installed"] = True
    return out


def _staged_bytes(stage, entry):
    for n in (entry["path"], entry["path"] + PART):
        try:
            return os.stat(stage.file(n)).st_size
        except FileNotFoundError:
            continue
    return 0


@as_command  # a KdcacheError is one line and exit 2; anything else shows as the bug it is
def main(argv=None, prog="kdcache pull"):
    p = Parser(prog=prog, description=(
        "Fetch a published cache (a folder kdcache publish wrote, local or served: https://, http:// and other "
        "URLs through fsspec), check every file against its manifest's sha256 and the cache's own checksums, and "
        "install it in the cache directory under its fingerprint, where kdcache train and kdcache cache with the "
        "same inputs find it. An interrupted pull resumes where it stopped."))
    p.add_argument("src", help="the publication: a folder or URL holding manifest.json")
    p.add_argument("--cache-dir", type=Dir(), help="cache directory (default: $KDCACHE_DIR, else ./caches)")
    p.add_argument("--expect-sha256", metavar="HEX", help="the manifest's sha256 as its publisher gave it: any "
                                                          "other manifest is refused")
    p.add_argument("--timeout", type=Float(0, None, gt=True), default=30.0, metavar="S",
                   help="seconds to wait for the server at each step (default 30)")
    p.add_argument("--json", action="store_true", help="end with the result as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        out = pull(args.src, cache_dir=args.cache_dir, expect_sha256=args.expect_sha256, timeout=args.timeout,
                   progress=not args.quiet)
    except KdcacheError:
        raise  # its one line (as_command); before OSError: CacheNotFoundError is one too
    except OSError as e:  # the source's or the cache directory's (unreachable, unwritable, full): the user's to fix
        print(f"error: {args.src}: {e.strerror or e} ({type(e).__name__}): check the cache directory and run the "
              f"same command again", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    elif out["installed"]:
        print(f"installed {out['path']} (fingerprint {out['fingerprint']}; {out['fetched']:,} bytes fetched)")
    else:
        print(f"{out['path']} is there already, the same bytes (fingerprint {out['fingerprint']}): nothing fetched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
