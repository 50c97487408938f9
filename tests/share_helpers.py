"""What the publishing tests share: finished caches made with the store's writer, the command run as a user runs it,
and the checks every refusal must pass (one line, exit 2, nothing installed)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np

from kdcache.store import CacheWriter, path_for
from tests.helpers import expected_logits, make_spec


def finished(cache_dir, spec, *, scale=6.0):
    """A finished cache of `spec` in `cache_dir` (rows expected_logits(keys) * scale / 6): its P.h5."""
    path = path_for(str(cache_dir), spec.fingerprint)
    with CacheWriter(path, spec) as w:
        for a in range(0, spec.num_keys, 4096):
            k = np.arange(a, min(spec.num_keys, a + 4096))
            w.write(k // spec.views, expected_logits(k, spec.num_classes, scale), views=k % spec.views)
    return path + ".h5"


def big_spec(rows=8000, classes=1000):
    """A cache of rows x classes float16 (16 MB at the defaults): long enough to be interrupted on a slow link."""
    return make_spec(num_samples=rows, num_classes=classes, dtype="float16", tag="share")


def sha(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for b in iter(lambda: fh.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def env():
    e = {k: v for k, v in os.environ.items() if k != "KDCACHE_DIR"}
    e.update(OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    return e


def cli(*args, timeout=300, cwd=None):
    """`kdcache ARGS` as a user runs it."""
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env(), cwd=cwd)


def one_line(r, *words):
    """A refusal as users see it: exit 2, one line on stderr that starts with 'error:' and names `words`."""
    err = r.stderr.strip()
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert err.startswith("error: ") and "\n" not in err, err
    for w in words:
        assert w in err, (w, err)
    return err


def nothing_installed(cache_dir, *, staged=False):
    """No cache file in `cache_dir`; without `staged`, nothing else either (a refused publication leaves nothing)."""
    names = os.listdir(cache_dir) if os.path.isdir(cache_dir) else []
    assert not [n for n in names if n.endswith(".h5")], names
    if not staged:
        assert names == [], names


def copy_publication(src, dst, *, change=None):
    """A copy of the publication folder `src` at `dst`; change(folder, manifest dict) edits it (the manifest is
    written back with the changes)."""
    shutil.copytree(src, dst)
    if change is not None:
        path = os.path.join(dst, "manifest.json")
        m = json.load(open(path))
        change(dst, m)
        with open(path, "w") as fh:
            json.dump(m, fh, indent=1, sort_keys=True)
    return dst


def flip_byte(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x01]))


def rows_offset(path, field="logits"):
    """Where the middle of a finished file's rows of `field` lies in the file (its datasets are contiguous)."""
    import h5py
    with h5py.File(path, "r") as f:
        d = f[field]
        return d.id.get_offset() + d.id.get_storage_size() // 2
