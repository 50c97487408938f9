"""`kdcache ls | inspect | verify | gc` (python -m kdcache.store): list, inspect, verify and clean the caches in a
cache directory."""
import argparse
import datetime
import json
import os
import sys

from kdcache.args import ByteSize, Dir, Float, Parser, human_bytes
from kdcache.errors import as_command

from .folder import registry
from .errors import StoreError


def _when(t):
    if t is None:
        return "-"
    return str(_iso(t)).replace("+00:00", "Z")  # both columns in one form: ISO 8601, UTC


def _augment(e):
    """The views' augmentation and, when the views vary with it, their seed: what a trainer must pass."""
    if "augment" not in e:
        return ""
    return e["augment"] + (f" seed {e['augment_seed']}" if e.get("augment_seed") is not None else "")


def _iso(t):
    """A time as ISO 8601 in UTC (seconds since the epoch, or text already written so)."""
    if isinstance(t, (int, float)) and not isinstance(t, bool):
        return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat(timespec="seconds")
    return t


def _table(rows, cols):
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths))]
    lines += ["  ".join(str(r.get(c, "")).ljust(w) for c, w in zip(cols, widths)) for r in rows]
    return "\n".join(lines)


def cmd_ls(args):
    entries = [registry.info(b) for b in registry.cache_bases(args.cache_dir)]
    if args.json:
        print(json.dumps(entries, indent=1, default=str))
        return 0
    d = registry.resolve_cache_dir(args.cache_dir)
    others = [e for e in entries if e["state"] == registry.NOT_A_CACHE]
    entries = [e for e in entries if e["state"] != registry.NOT_A_CACHE]
    for e in others:
        print(f"not a cache, left alone: {e['path']} ({e['error']})", file=sys.stderr)
    if not entries:
        print(f"no caches in {d}")
        return 0
    rows = [{"fingerprint": e.get("fingerprint") or e["name"], "state": e["state"],
             "teacher": e.get("teacher", ""), "dataset": e.get("dataset", ""), "views": e.get("views", ""),
             "augment": _augment(e),
             "codec": f"{e.get('codec', '')}/{e.get('dtype', '')}" if e.get("codec") else "",
             "done": f"{100 * e.get('done', 0):.1f}%", "size": human_bytes(e["size"]),
             "created": _when(e.get("created")), "last used": _when(e.get("last_used"))} for e in entries]
    print(f"caches in {d}:")
    print(_table(rows, list(rows[0])))
    for e in entries:
        if e.get("error"):
            print(f"{e['name']}: {e['error']}")
    full = [e["no_space"] for e in entries if e.get("no_space")]
    for line in full:  # a committed cache the disk has no room to compact: the user must act
        print(f"error: {line}", file=sys.stderr)
    return 2 if full else 0


def _existing(path):
    """The base path of the cache at `path`; a path that holds no cache is a mistake (exit 2)."""
    base = registry.base_path(path)
    if not base or not registry.exists(base):
        raise StoreError(f"no cache at {path!r}: pass a path that `kdcache ls` shows (P, P.h5 or P.parts)")
    return base


def cmd_inspect(args):
    from .format import checksums
    from .files.segment import final_spec, parts_spec
    from .files.segment import open_final
    from .folder.verify import NO_CHECKSUMS
    base = _existing(args.path)
    fin, parts = registry.final_path(base), registry.parts_path(base)
    entry = registry.info(base)
    if entry["state"] in ("damaged", registry.NEWER, registry.NOT_A_CACHE, registry.NOT_TRUSTED):
        raise StoreError(f"{entry['path']}: {entry['error']}" if entry["path"] not in entry["error"]
                         else entry["error"])
    if os.path.exists(fin):
        st0 = os.stat(fin)
        try:
            spec, meta = final_spec(fin, os.path.basename(base))
            with open_final(fin) as f:
                meta["datasets"] = {k: {"shape": list(f[k].shape), "dtype": str(f[k].dtype)} for k in f.keys()}
                sums = checksums.load(f, fin, spec)
                meta["checksums"] = sums.describe() if sums else NO_CHECKSUMS
        finally:  # looking at a cache is not using it: gc ages caches by their last use (atime)
            registry._restore_atime(fin, st0)
    else:
        _, meta = parts_spec(parts, os.path.basename(base))
    meta.update({k: v for k, v in entry.items() if k not in meta})
    meta["last_used"] = _iso(meta.get("last_used"))  # a date, in JSON too: created is one already
    if args.json:
        print(json.dumps(meta, indent=1, sort_keys=True, default=str))
    else:
        for k in sorted(meta):
            print(f"{k:24s} {json.dumps(meta[k], default=str) if isinstance(meta[k], (dict, list)) else meta[k]}")
    return 0


def cmd_verify(args):
    report, problems = registry.verify(_existing(args.path))
    report["sound"] = not problems
    report["problems"] = problems
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        from .folder.verify import verdict
        print(f"{report['path']}: {verdict(report)}")
        for p in problems + report["suspect"]:
            print(f"  - {p}")
        if report.get("checksums", "").startswith("no checksums"):
            print(f"  {report['checksums']}")
    # suspect: well formed, but its rows cannot be a teacher's targets for real inputs
    return 0 if not problems and not report["suspect"] else 1


def cmd_gc(args):
    from .ring import cleanup_stale
    kept = []
    victims = registry.gc(args.cache_dir, older_than_days=args.older_than, max_bytes=args.max_size,
                          incomplete=not args.keep_incomplete, dry_run=args.dry_run, min_age_s=args.min_age,
                          kept=kept)
    rings = cleanup_stale(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    if args.json:
        print(json.dumps({"dry_run": args.dry_run, "caches": [{"path": p, "reason": r, "bytes": b}
                                                              for p, r, b in victims], "rings": rings,
                          "kept": [{"path": p, "why": w} for p, w in kept]}))
        return 0
    for p, r, b in victims:
        print(f"{verb} {p} ({r}, {human_bytes(b)})")
    for p, w in kept:
        print(f"kept {p}: {w}")
    for name in rings:
        print(f"{verb} stale shared-memory ring {name}")
    if not victims and not rings:
        print("nothing to remove")
    else:
        print(f"{verb} {len(victims)} cache(s), {human_bytes(sum(b for _, _, b in victims))}")
    return 0


@as_command  # a StoreError is one line and exit 2 (verify: could not check); anything else shows as the bug it is
def main(argv=None, prog="python -m kdcache.store"):
    p = Parser(prog=prog, description=(
        "Inspect and maintain kdcache soft-target caches. A cache is named by its fingerprint: "
        "<cache-dir>/<fingerprint>.h5 when complete, <fingerprint>.parts/ while producers fill it."))
    p.add_argument("--cache-dir", type=Dir(), help="cache directory (default: $KDCACHE_DIR, else ./caches)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("ls", help="list caches: fingerprint, teacher, data set, views, codec, done, size, dates")
    s.set_defaults(fn=cmd_ls)
    s = sub.add_parser("inspect", help="print all metadata of one cache")
    s.add_argument("path", help="cache path (P, P.h5 or P.parts)")
    s.set_defaults(fn=cmd_inspect)
    s = sub.add_parser("verify", help="check schema, flags, finite values and completeness; exit 0 only when sound "
                                          "and not suspect (every row the same)")
    s.add_argument("path", help="cache path (P, P.h5 or P.parts)")
    s.set_defaults(fn=cmd_verify)
    s = sub.add_parser("gc", help="remove incomplete, damaged or unused caches and stale shared-memory rings")
    s.add_argument("--older-than", type=Float(0, None), metavar="DAYS",
                   help="also remove complete caches unused for DAYS")
    s.add_argument("--max-size", type=ByteSize(), metavar="SIZE", help="then remove least recently used caches "
                                                                      "until the directory fits SIZE (e.g. 20G)")
    s.add_argument("--keep-incomplete", action="store_true", help="keep incomplete caches")
    s.add_argument("--min-age", type=Float(0, None), default=60.0, metavar="S",
                   help="leave incomplete caches touched in the last S seconds (default 60)")
    s.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    s.set_defaults(fn=cmd_gc)
    for s in sub.choices.values():  # accept the global options after the command too
        s.add_argument("--cache-dir", type=Dir(), default=argparse.SUPPRESS, help=argparse.SUPPRESS)
        s.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # verify's exit status is a verdict: 0 sound, 1 NOT sound, 2 could not check; a crash is errors.BUG, never 1
    return args.fn(args)

