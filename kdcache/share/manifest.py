"""A published cache's manifest.json (every file with its size and sha256, the cache's whole identity) and its card.

NOTE [what a publication is]
A published cache is a folder (local, served over HTTP, or in object storage) holding the finished cache
file `<fingerprint>.h5` exactly as the builder's compaction wrote it, `manifest.json` beside it, and
`README.md`, a card for people. The manifest is written last: a folder without one is not a publication
yet. It names every file with its size and sha256, and the cache's identity as the file's own metadata
records it -- the fingerprint and every input behind it (`fingerprint_inputs`, from which a receiver
recomputes the fingerprint), codec, dtype, views, augmentation, seed, sample count -- with the build's
date and kdcache version and the command that builds the same cache. The receiver checks the manifest
against itself, each file against the manifest, then the file against its own seal and checksums
(kdcache verify) before anything is installed. The manifest's own sha256 is what a user pins
(`kdcache pull --expect-sha256`): whoever can write to the server can replace the files and the
manifest together, and only a digest received another way tells the two apart.
"""
import hashlib
import json
import re

from kdcache.args import human_bytes
from kdcache.store.format import schema
from kdcache.store.errors import NewerFormatError, StoreError
from kdcache.store.format.fingerprint import fingerprint, is_fingerprint

MANIFEST = "manifest.json"
CARD = "README.md"
MANIFEST_VERSION = 1     # bump when a manifest written by this code cannot be read by older code
MANIFEST_LIMIT = 1 << 20  # bytes: a manifest names a few files; anything longer is not one
SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ShareError(StoreError):
    """Publishing or receiving a cache was refused or failed; the message is one line with the cause and the fix."""


def sha256_hex(data):
    return hashlib.sha256(data).hexdigest()


def cache_file_name(fp):
    return fp + schema.FINAL_SUFFIX


def rebuild_command(spec):
    """The `kdcache cache` line that builds this cache from its inputs (TEACHER: the checkpoint whose files have
    the digests the identity records)."""
    inputs = spec.inputs if isinstance(spec.inputs, dict) else {}
    ds = inputs.get("dataset") if isinstance(inputs.get("dataset"), dict) else {}
    words = ["kdcache", "cache", "--teacher", "TEACHER", "--dataset", str(ds.get("name") or "DATASET")]
    if spec.sources.get("data_root"):
        words += ["--data-root", "DATA_ROOT"]
    if ds.get("split") not in (None, "train"):
        words += ["--split", str(ds["split"])]
    words += ["--views", str(spec.views)]
    if inputs.get("augment"):
        words += ["--augment", str(inputs["augment"]).rpartition("@")[0] or str(inputs["augment"])]
    if inputs.get("augment_seed") is not None:
        words += ["--seed", str(inputs["augment_seed"])]
    words += ["--codec", spec.make_codec().spec, "--dtype", spec.dtype]
    return " ".join(words)


def build(spec, meta, files, *, checksums, publisher_version, published, command, teacher_accuracy=None):
    """The manifest of the finished cache `spec` (its file's metadata `meta`) published as `files`
    [{"path", "size", "sha256"}]."""
    inputs = spec.inputs if isinstance(spec.inputs, dict) else {}
    return {
        "kdcache_manifest": MANIFEST_VERSION,
        "fingerprint": spec.fingerprint,
        "files": files,
        "cache": {
            "format_version": int(meta[schema.A_FORMAT]),
            "fingerprint_inputs": spec.fingerprint_inputs(),
            "teacher": inputs.get("teacher"),
            "teacher_accuracy": teacher_accuracy,
            "dataset": inputs.get("dataset"),
            "num_samples": spec.num_samples,
            "views": spec.views,
            "num_classes": spec.num_classes,
            "codec": spec.make_codec().spec,
            "codec_version": spec.codec_version,
            "dtype": spec.dtype,
            "augment": inputs.get("augment") or "none",
            "seed": inputs.get("augment_seed"),
            "bytes_per_row": spec.make_codec().bytes_per_row,
            "checksums": checksums,
            "key_layout": schema.KEY_LAYOUT,
        },
        "build": {
            "date": meta.get(schema.A_CREATED) if isinstance(meta.get(schema.A_CREATED), str) else None,
            "kdcache_version": meta.get(schema.A_TOOL_VERSION) if isinstance(meta.get(schema.A_TOOL_VERSION), str)
            else None,
            "command": rebuild_command(spec),
        },
        "published": {"date": published, "kdcache_version": publisher_version, "command": command},
    }


def dumps(manifest):
    return (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8")


def _refuse(where, what):
    return ShareError(f"{where}: {what}: it is not a kdcache publication, or it was changed or damaged; ask its "
                      f"publisher, or publish the cache again (kdcache publish)")


def parse(raw, where):
    """The manifest in the bytes `raw`, checked against itself: its version, its files' names and digests, the
    cache file named for its fingerprint, and the fingerprint recomputed from the inputs it lists. A cache whose
    format is newer than this kdcache's is refused here, before any file is fetched."""
    try:
        m = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise _refuse(where, f"not JSON ({type(e).__name__})") from None
    if not isinstance(m, dict) or not isinstance(m.get("kdcache_manifest"), int) \
            or isinstance(m.get("kdcache_manifest"), bool):
        raise _refuse(where, "no kdcache_manifest version")
    if m["kdcache_manifest"] > MANIFEST_VERSION:
        raise NewerFormatError(f"{where}: a manifest of version {m['kdcache_manifest']}, this kdcache reads up to "
                               f"{MANIFEST_VERSION}: upgrade kdcache")
    fp, cache, files = m.get("fingerprint"), m.get("cache"), m.get("files")
    if not is_fingerprint(fp):
        raise _refuse(where, f"fingerprint {fp!r} is not a cache fingerprint")
    if not isinstance(cache, dict) or not isinstance(files, list) or not files:
        raise _refuse(where, "no cache identity or no files")
    version = cache.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise _refuse(where, f"format_version {version!r} is not an integer")
    if version > schema.FORMAT_VERSION:
        raise NewerFormatError(f"{where}: the cache {fp} is of format version {version}, this kdcache reads up to "
                               f"{schema.FORMAT_VERSION}: upgrade kdcache, then pull it again")
    try:
        again = fingerprint(cache.get("fingerprint_inputs"))
    except (TypeError, ValueError, AttributeError, RecursionError):
        again = None
    if not isinstance(cache.get("fingerprint_inputs"), dict) or again != fp:
        raise _refuse(where, f"its fingerprint {fp} is not the fingerprint of the inputs it lists ({again})")
    names = set()
    for f in files:
        if not isinstance(f, dict) or set(f) != {"path", "size", "sha256"}:
            raise _refuse(where, "a file entry is not {path, size, sha256}")
        name, size, digest = f["path"], f["size"], f["sha256"]
        # a file's name is one plain name: nothing a receiver writes can land outside its own folder
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", name) \
                or name in names or name in (MANIFEST, CARD):
            raise _refuse(where, f"file name {name!r} is not one plain file name")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise _refuse(where, f"{name}: size {size!r} is not a byte count")
        if not isinstance(digest, str) or not SHA256.match(digest):
            raise _refuse(where, f"{name}: sha256 {digest!r} is not 64 lowercase hex digits")
        names.add(name)
    if names != {cache_file_name(fp)}:
        raise _refuse(where, f"its files {sorted(names)} are not the one cache file {cache_file_name(fp)}")
    return m


def _identity_lines(x):
    if not isinstance(x, dict):
        return ["not recorded"]
    return [f"{k}: `{json.dumps(v)}`" for k, v in sorted(x.items()) if v is not None]


def card(manifest, manifest_sha, *, where=None):
    """README.md of a publication: what a person needs to decide whether these targets are theirs and to fetch
    them. `where`: the address it is served at, when known."""
    c, b = manifest["cache"], manifest["build"]
    fp = manifest["fingerprint"]
    teacher = c.get("teacher") if isinstance(c.get("teacher"), dict) else {}
    dataset = c.get("dataset") if isinstance(c.get("dataset"), dict) else {}
    f = manifest["files"][0]
    acc = (c.get("teacher_accuracy") or {}).get("test_acc") if isinstance(c.get("teacher_accuracy"), dict) else None
    src = where or "URL"
    row = {"full": f"the teacher's {c['num_classes']} raw logits (temperature 1), {c['dtype']}",
           "int8": f"the teacher's {c['num_classes']} logits as 8-bit codes with the row's minimum and step"}.get(
        c["codec"].split(":")[0],
        f"the teacher's logits in codec {c['codec']} (docs/codecs.md of kdcache says how it is read)")
    lines = [
        f"# Soft targets {fp}",
        "",
        f"The outputs of a frozen teacher for every sample of a data set, cached by kdcache {b.get('kdcache_version')}"
        f" on {b.get('date')}, for knowledge distillation without running the teacher again.",
        "",
        "## What it holds",
        "",
        f"- teacher: {teacher.get('name', 'unnamed')}",
        *[f"  - {x}" for x in _identity_lines(teacher)],
        f"- data set: {dataset.get('name', 'unnamed')} ({c['num_samples']:,} samples)",
        *[f"  - {x}" for x in _identity_lines(dataset)],
        "- the teacher's test accuracy: " + (f"{acc:.2%} on {c['teacher_accuracy'].get('on')} (from "
                                             f"{c['teacher_accuracy'].get('from')}, published with it)"
                                             if isinstance(acc, (int, float)) else
                                             "not recorded (the cache does not hold it; kdcache publish --teacher "
                                             "PREFIX adds it from the teacher's PREFIX-info.json)"),
        f"- views per sample: {c['views']}; augmentation: {c['augment']}"
        + (f", seed {c['seed']}" if c.get("seed") is not None else ""),
        f"- each row (sample, view): {row}; codec {c['codec']}, {c['bytes_per_row']} bytes per row",
        f"- rows: {c['num_samples'] * c['views']:,}; the file: `{f['path']}`, {f['size']:,} bytes "
        f"({human_bytes(f['size'])}), kdcache format version {c['format_version']}",
        f"- checksums: {c.get('checksums')}",
        "",
        "## Receiving it",
        "",
        "```sh",
        f"kdcache pull {src} --expect-sha256 {manifest_sha}",
        "```",
        "",
        f"`--expect-sha256` pins this manifest ({MANIFEST}, sha256 `{manifest_sha}`): take the digest from a source "
        "you trust, not from the server that serves the files. The pull checks every file against the manifest and "
        "the cache's own checksums, then installs it in the cache directory under its fingerprint, where `kdcache "
        "train` and `kdcache cache` with the same teacher files, data set, views, augmentation and codec find it and "
        "run the teacher zero times. The same inputs build the same cache:",
        "",
        "```sh",
        b.get("command") or "",
        "```",
        "",
        "## Files",
        "",
        "| file | bytes | sha256 |",
        "|---|---|---|",
        *[f"| `{x['path']}` | {x['size']:,} | `{x['sha256']}` |" for x in manifest["files"]],
        f"| `{MANIFEST}` | | `{manifest_sha}` |",
        "",
    ]
    return "\n".join(lines).encode("utf-8")
