"""Compaction on a full disk, in memory and through the spill file (a cache larger than half the free
memory): one line naming the directory and the bytes needed, exit status 2, never a SIGBUS; the
temporary files are removed, every row stays in the segments, and once space is freed the next tool
compacts the cache and every row reads back. On a small tmpfs (mounted by the test, as root) and with
ENOSPC injected (everywhere)."""
import errno
import glob
import os
import subprocess
import sys

import numpy as np
import pytest

import kdcache.store.write.compact
import kdcache.store.write.writer
from kdcache import store
from kdcache.store import CacheReader, CacheWriter, StoreError, path_for
from kdcache.store.errors import NoSpaceError
from kdcache.store.folder.registry import final_path, parts_path
from tests.helpers import CHILD_ENV, ROOT, expected_logits, make_spec

N, C = 20_000, 20  # 1.6 MB of float32 rows
LAST = 50  # rows the producer writes before it compacts
SPEC = dict(num_samples=N, num_classes=C, tag="nospace")

# A tool in its own process (a SIGBUS shows as exit -7): `kdcache ls`, or a producer writing the last rows
# (its close compacts). "spill" makes the cache larger than half the free memory, as compaction sees it.
TOOL = """
import json, sys
import numpy as np
import kdcache.store.write.compact
from kdcache import store
from kdcache.store import CacheWriter, StoreError
from tests.helpers import expected_logits, make_spec
tool, path, how = sys.argv[1], sys.argv[2], sys.argv[3]
if how == "spill":
    store.write.compact.available_memory = lambda: 0
if tool == "ls":
    from kdcache.cli import main
    sys.exit(main(["ls", "--cache-dir", path]))
spec = make_spec(**json.loads(sys.argv[4]))
try:
    with CacheWriter(path, spec) as w:
        keys = w.missing()
        w.write(keys, expected_logits(keys, spec.num_classes))
except StoreError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 6 MiB tmpfs, unmounted after the test."""
    d = tmp_path / "disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(r.stderr or r.stdout).strip()[:200]}): the ENOSPC "
                    f"injection tests cover the same paths")
    try:
        yield str(d)
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


def committed_cache(d, monkeypatch, rows):
    """Segments holding the first `rows` keys, not compacted."""
    spec = make_spec(**SPEC)
    p = path_for(d, spec.fingerprint)
    with monkeypatch.context() as m:
        m.setattr(store.write.writer, "finalize", lambda *a, **k: False)
        with CacheWriter(p, spec) as w:
            keys = np.arange(rows)
            w.write(keys, expected_logits(keys, C))
    return spec, p


def fill(d, leave):
    """A file taking all but `leave` bytes of the file system at d."""
    st = os.statvfs(d)
    with open(os.path.join(d, "filler"), "wb") as fh:
        fh.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))
    return os.path.join(d, "filler")


def temporaries(d, p):
    return glob.glob(os.path.join(d, "*.tmp-*")) + glob.glob(os.path.join(parts_path(p), ".compact-*"))


def every_row_reads_back(spec, p):
    with CacheReader(p, spec=spec) as r:
        assert r.complete and r.source == "map"
        assert np.array_equal(r.get(np.arange(N)), expected_logits(np.arange(N), C))


def run(*args):
    return subprocess.run([sys.executable, "-c", TOOL, *map(str, args)], cwd=ROOT, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("how", ["ram", "spill"])
@pytest.mark.parametrize("tool", ["ls", "producer"])
def test_compaction_on_a_full_disk_is_one_line_and_keeps_every_row(small_disk, monkeypatch, tool, how):
    d = small_disk
    spec, p = committed_cache(d, monkeypatch, N if tool == "ls" else N - LAST)
    segments = sorted(os.listdir(parts_path(p)))
    filler = fill(d, 300_000)  # room for the last rows' segment, not for the cache file
    r = run(tool, d if tool == "ls" else p, how, '{"num_samples": %d, "num_classes": %d, "tag": "nospace"}' % (N, C))
    assert r.returncode == 2, f"exit {r.returncode} (-7 is SIGBUS): {r.stdout[-1000:]} {r.stderr[-3000:]}"
    line = r.stderr.strip()
    assert "\n" not in line and line.startswith(f"error: {d}: no space left to compact the cache: it needs about ")
    assert "free space on that file system" in line and "every row is kept in the segments" in line
    assert ("spill file" in line) == (how == "spill")
    assert not temporaries(d, p), "the temporary files are removed"
    assert not os.path.exists(final_path(p))
    assert set(segments) <= set(os.listdir(parts_path(p))), "the segments are untouched"
    os.unlink(filler)
    r = run("ls", d, how)
    assert r.returncode == 0 and " complete " in r.stdout, r.stdout + r.stderr
    every_row_reads_back(spec, p)


@pytest.mark.parametrize("how", ["ram", "spill"])
@pytest.mark.parametrize("where", ["fallocate", "pwrite"])
def test_an_injected_enospc_is_one_line_and_compaction_is_retried(cache_dir, monkeypatch, how, where):
    spec, p = committed_cache(cache_dir, monkeypatch, N)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    budget = 0 if how == "spill" else None
    with monkeypatch.context() as m:
        m.setattr(store.write.compact.os, "posix_fallocate" if where == "fallocate" else "pwrite", full)
        with pytest.raises(NoSpaceError) as e:
            store.write.compact.finalize(p, spec, memory_budget=budget)
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{cache_dir}: no space left to compact the cache")
    assert ("spill file" in str(e.value)) == (how == "spill")
    assert not temporaries(cache_dir, p) and not os.path.exists(final_path(p))
    assert store.write.compact.finalize(p, spec, memory_budget=budget)
    every_row_reads_back(spec, p)


def test_a_reader_of_a_committed_cache_on_a_full_disk_reads_the_segments(cache_dir, monkeypatch):
    spec, p = committed_cache(cache_dir, monkeypatch, N)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(store.write.compact.os, "posix_fallocate", full)
    with CacheReader(p, spec=spec) as r:  # compaction failed (logged): the rows are read from the segments
        assert r.complete and r.source == "ram"
        assert np.array_equal(r.get(np.arange(N)), expected_logits(np.arange(N), C))
    assert not os.path.exists(final_path(p))
    with pytest.raises(StoreError, match="no space left"):
        CacheWriter(p, spec)  # a producer is told (one line) instead of being started on a full disk
