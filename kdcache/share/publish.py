"""kdcache publish: a finished, verified cache written, unchanged, to a folder or URL with its manifest and card."""
import datetime
import hashlib
import json
import os
import sys

from kdcache.args import Dir, Parser
from kdcache.errors import KdcacheError, as_command
from kdcache.store.folder import registry
from kdcache.store.errors import StoreError
from kdcache.store.format.fingerprint import is_fingerprint
from kdcache.store.files.segment import final_spec, open_final
from kdcache.store.osutil import NotOurs, open_regular
from kdcache.store.files.paths import base_path, final_path, parts_path, path_for

from . import manifest as M
from .remote import CHUNK, Flusher, place

BUILDING = ("producing", "incomplete", "committed")


def _progress(total, enabled, desc):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                disable=None if enabled else True, leave=False)


def find_cache(cache, cache_dir=None):
    """The base path of the cache `cache` names: a path (P, P.h5, P.parts) or a fingerprint in the cache directory."""
    cache = os.fspath(cache)
    base = base_path(cache)
    if registry.exists(base):
        return base
    if is_fingerprint(cache) and registry.exists(path_for(cache_dir, cache)):
        return path_for(cache_dir, cache)
    raise M.ShareError(f"no cache at {cache!r}: pass a path `kdcache ls` shows (P.h5), or a fingerprint with its "
                       f"--cache-dir")


def check_finished(base):
    """The finished cache at `base` must be complete and sound (kdcache verify): (spec, meta, checksums text)."""
    from kdcache.store.format.checksums import load
    from kdcache.store.folder.verify import NO_CHECKSUMS, verify
    entry = registry.info(base)
    state = entry["state"]
    if state in BUILDING:
        raise M.ShareError(f"{entry['path']}: the cache is still being built ({state}, {100 * entry.get('done', 0):.1f}% "
                           f"done): publish it once it is complete (kdcache cache finishes it)")
    if state != "complete":
        why = entry.get("error") or state
        raise M.ShareError(why if entry["path"] in why else f"{entry['path']}: {why}")
    report, problems = verify(base)
    if problems:
        raise M.ShareError(f"{final_path(base)}: fails kdcache verify ({problems[0]}): nothing published")
    if report["suspect"]:
        raise M.ShareError(f"{report['suspect'][0]}: nothing published")
    fin = final_path(base)
    spec, meta = final_spec(fin, os.path.basename(base))
    with open_final(fin) as f:
        sums = load(f, fin, spec)
    return spec, meta, sums.describe() if sums else NO_CHECKSUMS


def teacher_accuracy(teacher, spec):
    """The teacher's test accuracy as `kdcache teacher` recorded it (PREFIX-info.json), for the card: only when
    PREFIX's files are the ones the cache's fingerprint records ({"test_acc", "on", "from"})."""
    from kdcache.pipeline.teacher_files import TeacherError, checkpoint_files, parse_teacher_arg
    from kdcache.store.format.fingerprint import file_digest
    recorded = spec.inputs.get("teacher") if isinstance(spec.inputs.get("teacher"), dict) else {}
    prefix, epoch = parse_teacher_arg(teacher)
    try:
        sym, params, epoch = checkpoint_files(prefix, recorded.get("epoch") if epoch is None else epoch)
    except TeacherError as e:
        raise M.ShareError(f"--teacher {teacher}: {e}") from None
    if (file_digest(sym), file_digest(params)) != (recorded.get("symbol_sha256"), recorded.get("params_sha256")):
        raise M.ShareError(f"--teacher {teacher}: its files are not those of the teacher the cache was built with "
                           f"(symbol sha256 {str(recorded.get('symbol_sha256'))[:12]}...): pass that checkpoint, or "
                           f"leave --teacher out")
    info = f"{prefix}-info.json"
    try:
        with open(info, encoding="utf-8") as fh:
            rec = json.load(fh)
        acc = rec["test_acc"]
        if not isinstance(acc, (int, float)) or isinstance(acc, bool) or not 0 <= acc <= 1:
            raise ValueError(f"test_acc {acc!r}")
    except FileNotFoundError:
        raise M.ShareError(f"--teacher {teacher}: {info} not found (kdcache teacher writes the teacher's test accuracy "
                           f"there): leave --teacher out to publish without it") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise M.ShareError(f"--teacher {teacher}: {info} holds no test accuracy ({type(e).__name__}: {e}): leave "
                           f"--teacher out to publish without it") from None
    return {"test_acc": float(acc), "on": f"{rec.get('dataset', 'its data set')}, test split",
            "from": os.path.basename(info)}


def _copy(fd, dest, name, bar):
    """Copy the open file `fd` to `dest`/`name`, hashing the bytes as they are sent; their sha256."""
    h = hashlib.sha256()
    out, commit, abort = dest.writer(name)
    try:
        try:
            flusher = Flusher(out.fileno())  # a local file: written back while the copy goes on
        except (AttributeError, OSError, ValueError):
            flusher = None  # an object store's upload has no descriptor
        try:
            at = 0
            while True:
                b = os.pread(fd, CHUNK, at)
                if not b:
                    break
                h.update(b)
                out.write(b)
                at += len(b)
                bar.update(len(b))
                if flusher is not None:
                    out.flush()
                    flusher.wrote(len(b))
        finally:
            if flusher is not None:
                flusher.stop()
        commit()
    except BaseException:
        abort()
        raise
    return h.hexdigest(), at


def publish(cache, dest, *, cache_dir=None, url=None, teacher=None, progress=False, command=None):
    """Write the finished cache `cache` (a path, or a fingerprint in `cache_dir`) to `dest` (a folder, or a URL an
    installed fsspec back end writes: file://, s3://, gs://, ...): its file unchanged, then manifest.json, then
    README.md. `url`: where `dest` will be served, for the card's pull line. `teacher`: the teacher's checkpoint
    prefix, whose PREFIX-info.json (kdcache teacher writes it) gives the card the teacher's test accuracy; its files
    must be the ones the cache records. Returns {"fingerprint", "dest", "manifest_sha256", "files", "pull"}. A
    cache still being built, damaged or failing verify raises ShareError (one line) and nothing is written; so does
    every other refusal or failure (the store's own errors, the file system's)."""
    try:
        return _publish(cache, dest, cache_dir=cache_dir, url=url, teacher=teacher, progress=progress,
                        command=command)
    except M.ShareError:
        raise
    except StoreError as e:
        raise M.ShareError(str(e)) from None
    except OSError as e:
        raise M.ShareError(f"{e.filename or dest}: {e.strerror or e} ({type(e).__name__}): check the cache and the "
                           f"destination, then run the same command again") from None


def _publish(cache, dest, *, cache_dir, url, teacher, progress, command):
    from kdcache import __version__
    base = find_cache(cache, cache_dir)
    if os.path.isdir(parts_path(base)) and not os.path.exists(final_path(base)):
        info = registry.info(base)
        raise M.ShareError(f"{parts_path(base)}: the cache is still being built ({info['state']}, "
                           f"{100 * info.get('done', 0):.1f}% done): publish it once it is complete (kdcache cache "
                           f"finishes it)")
    spec, meta, sums = check_finished(base)
    fp = spec.fingerprint
    accuracy = teacher_accuracy(teacher, spec) if teacher else None
    out = place(dest)
    out.prepare()
    if out.exists(M.MANIFEST):  # a folder holds one publication: another cache's is never overwritten
        try:
            other = json.loads(out.read_small(M.MANIFEST, M.MANIFEST_LIMIT).decode("utf-8")).get("fingerprint")
        except (ValueError, UnicodeDecodeError, AttributeError):
            other = None
        if other != fp:
            raise M.ShareError(f"{out.where} holds another publication ({M.MANIFEST} of cache {other}): publish each "
                               f"cache into a folder of its own")
    fin = final_path(base)
    try:
        fd, st = open_regular(fin)
    except NotOurs as e:
        raise M.ShareError(f"{fin}: {e}") from None
    name = M.cache_file_name(fp)
    try:
        with _progress(st.st_size, progress, f"publish {fp}") as bar:
            digest, size = _copy(fd, out, name, bar)
        now = os.stat(fin)
        if (now.st_ino, now.st_size, now.st_mtime_ns) != (st.st_ino, st.st_size, st.st_mtime_ns) or size != st.st_size:
            raise M.ShareError(f"{fin} changed while it was copied: publish it again")
    finally:
        os.close(fd)
    published = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    man = M.build(spec, meta, [{"path": name, "size": size, "sha256": digest}], checksums=sums,
                  publisher_version=__version__, published=published, teacher_accuracy=accuracy,
                  command=command or f"kdcache publish {fp} {dest}")
    raw = M.dumps(man)
    sha = M.sha256_hex(raw)
    for fname, data in ((M.MANIFEST, raw), (M.CARD, M.card(man, sha, where=url or str(dest)))):
        fh, commit, abort = out.writer(fname)
        try:
            fh.write(data)
            commit()
        except BaseException:
            abort()
            raise
    where = url or str(dest)
    return {"fingerprint": fp, "dest": out.where, "manifest_sha256": sha, "files": man["files"],
            "pull": f"kdcache pull {where} --expect-sha256 {sha}"}


@as_command  # a KdcacheError is one line and exit 2; anything else shows as the bug it is
def main(argv=None, prog="kdcache publish"):
    p = Parser(prog=prog, description=(
        "Publish a finished cache: its file, unchanged, a manifest.json (every file's size and sha256, the cache's "
        "whole identity) and a README.md card, into a folder or to a URL fsspec writes (file://; s3://, gs://, ... "
        "with their fsspec back end). The cache must be complete and sound (kdcache verify); the manifest is "
        "written last. Prints the manifest's sha256, which receivers pin with kdcache pull --expect-sha256."))
    p.add_argument("cache", help="the cache: a path (P.h5) or its fingerprint in --cache-dir")
    p.add_argument("dest", help="a folder (created when missing) or a URL: file://..., s3://..., gs://... "
                                "(pip install 'kdcache[share]' and the back end's package)")
    p.add_argument("--cache-dir", type=Dir(), help="where a fingerprint is looked up (default: $KDCACHE_DIR, "
                                                   "else ./caches)")
    p.add_argument("--url", help="the address DEST will be served at (https://...), for the card's pull line")
    p.add_argument("--teacher", metavar="PREFIX", help="the teacher's checkpoint (the files the cache records): "
                                                       "its PREFIX-info.json gives the card its test accuracy")
    p.add_argument("--json", action="store_true", help="end with the result as one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        out = publish(args.cache, args.dest, cache_dir=args.cache_dir, url=args.url, teacher=args.teacher,
                      progress=not args.quiet,
                      command=" ".join([prog] + list(sys.argv[2:] if argv is None else argv)))
    except KdcacheError:
        raise  # its one line (as_command); before OSError: CacheNotFoundError is one too
    except OSError as e:  # the destination's (unwritable, unreachable, full): the user's to fix, as one line
        print(f"error: {args.dest}: {e.strerror or e} ({type(e).__name__}): check the destination and run the same "
              f"command again", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(out))
    else:
        f = out["files"][0]
        print(f"published {out['fingerprint']} to {out['dest']}: {f['path']} ({f['size']:,} bytes), "
              f"{M.MANIFEST}, {M.CARD}")
        print(f"manifest sha256 {out['manifest_sha256']}")
        print(f"receive it with: {out['pull']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
