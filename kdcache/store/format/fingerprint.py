"""Fingerprints: a short digest of the stated inputs a cache was built from (never of live objects)."""
import contextlib
import hashlib
import json
import os

from kdcache.errors import BadTypeError

from .schema import KEY_FORMAT

FINGERPRINT_HEX = 20  # 80 bits: collisions are not a practical concern for a cache directory


def canonical(inputs):
    """Canonical JSON of the inputs: keys sorted, None (defaulted) values left out, so adding a
    new defaulted option keeps old fingerprints valid."""
    def clean(v):
        if isinstance(v, dict):
            return {str(k): clean(x) for k, x in sorted(v.items()) if x is not None}
        if isinstance(v, (list, tuple)):
            return [clean(x) for x in v]
        if isinstance(v, float) and v.is_integer():
            return int(v)
        if hasattr(v, "item"):  # numpy scalar
            return clean(v.item())
        if isinstance(v, (str, int, float, bool)):
            return v
        raise BadTypeError(f"fingerprint input {v!r} ({type(v).__name__}) is not plain data: "
                           "pass strings, numbers, lists or dicts")
    return json.dumps(clean(inputs), sort_keys=True, separators=(",", ":"))


def fingerprint(inputs):
    """Hex digest naming a cache built from `inputs` (a dict of plain data)."""
    payload = canonical({"format": KEY_FORMAT, **inputs})
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:FINGERPRINT_HEX]


def file_digest(path, chunk=1 << 20, progress=None):
    """sha256 of a file's bytes (for teacher checkpoints and data files), read in blocks; `path` may
    be a binary file already open (read from where it stands, not closed). `progress(n)`, when given,
    is told the size of each block."""
    h = hashlib.sha256()
    with contextlib.nullcontext(path) if hasattr(path, "read") else open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
            if progress is not None:
                progress(len(b))
    return h.hexdigest()


def is_fingerprint(name):
    """True for a string that can safely name a cache file (hex digits only: no path escape)."""
    return (isinstance(name, str) and 8 <= len(name) <= 64
            and all(c in "0123456789abcdef" for c in name) and os.sep not in name)
