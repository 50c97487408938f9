"""A cache another user can write is not trusted silently (NOTE [files other users can write] in
kdcache/store/osutil.py): checksums and the seal catch damage, not a planted file. Real files, real owners
(chown to `nobody`, which needs root: CI runs as root), real modes and links."""
import os
import subprocess
import sys

import numpy as np
import pytest

from kdcache.store import CacheReader, CacheWriter, path_for
from kdcache.store.osutil import TRUST_ENV, NotTrusted
from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, expected_logits, make_spec, produce

NOBODY = 65534
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root (CI runs as root)")


def kdcache(*args, env=None):
    e = {k: v for k, v in CHILD_ENV.items() if k != TRUST_ENV}
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], capture_output=True, text=True,
                          env={**e, **(env or {})}, cwd=ROOT, timeout=120)


def cache_in(folder, tag="trust", mode=None, owner=None):
    spec = make_spec(num_samples=40, tag=tag)
    os.makedirs(folder, exist_ok=True)
    p = path_for(str(folder), spec.fingerprint)
    assert produce(p, spec)
    if mode is not None:
        os.chmod(p + ".h5", mode)
    if owner is not None:
        os.chown(p + ".h5", owner, owner)
    return p, spec


@pytest.fixture(autouse=True)
def no_trust(monkeypatch):
    monkeypatch.delenv(TRUST_ENV, raising=False)


def refused_everywhere(p, spec, why, monkeypatch):
    with pytest.raises(NotTrusted, match=why):
        CacheReader(p)
    with pytest.raises(NotTrusted, match=why):  # the producer would take it as done: 0 teacher forwards
        CacheWriter(p, spec)
    r = kdcache("verify", p + ".h5")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "--trust-others" in r.stderr, r.stderr
    r = kdcache("--trust-others", "verify", p + ".h5")  # declared: read as any cache
    assert r.returncode == 0 and "sound" in r.stdout, r.stdout + r.stderr
    monkeypatch.setenv(TRUST_ENV, "1")
    with CacheReader(p) as rd:
        assert np.array_equal(rd.get(np.arange(5)), expected_logits(np.arange(5), spec.num_classes))
    monkeypatch.delenv(TRUST_ENV)


def test_another_users_world_writable_cache_in_a_shared_folder_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    p, spec = cache_in(shared, mode=0o666, owner=NOBODY)
    refused_everywhere(p, spec, "owned by uid 65534", monkeypatch)
    r = kdcache("ls", "--cache-dir", shared)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    r = kdcache("gc", "--cache-dir", shared)
    assert r.returncode == 0 and os.path.exists(p + ".h5"), "another user's file is never removed"


def test_a_cache_of_ones_own_that_others_can_write_is_refused_and_kept(tmp_path, monkeypatch):
    p, spec = cache_in(tmp_path / "c", mode=0o666)
    refused_everywhere(p, spec, r"writable by others \(mode 0666\)", monkeypatch)
    r = kdcache("ls", "--cache-dir", tmp_path / "c")
    assert r.returncode == 0 and "not trusted" in r.stdout, r.stdout + r.stderr
    r = kdcache("gc", "--cache-dir", tmp_path / "c")
    assert r.returncode == 0 and os.path.exists(p + ".h5"), "a cache that is not trusted is not removed either"
    os.chmod(p + ".h5", 0o640)  # group may read, not write: trusted
    with CacheReader(p) as rd:
        assert rd.spec.fingerprint == spec.fingerprint


def test_a_cache_folder_that_links_to_another_users_folder_is_refused(tmp_path, monkeypatch):
    theirs = tmp_path / "theirs"
    p0, spec = cache_in(theirs)
    for q in (theirs, p0 + ".h5"):
        os.chown(q, NOBODY, NOBODY)
    os.symlink(theirs, tmp_path / "mine")
    p = path_for(str(tmp_path / "mine"), spec.fingerprint)
    refused_everywhere(p, spec, "owned by uid 65534", monkeypatch)
    os.chown(p0 + ".h5", 0, 0)  # the file ours, the folder theirs: they could replace it
    with pytest.raises(NotTrusted, match=f"a link to {theirs}\\) is owned by uid 65534"):
        CacheReader(p)


def test_a_folder_others_can_write_is_refused_unless_sticky(tmp_path, monkeypatch):
    d = tmp_path / "group"
    p, spec = cache_in(d)
    os.chmod(d, 0o775)
    with pytest.raises(NotTrusted, match=r"writable by its group \(mode 0775\)"):
        CacheReader(p)
    os.chmod(d, 0o1777)  # sticky: others cannot replace a file that is not theirs
    with CacheReader(p) as rd:
        assert rd.spec.fingerprint == spec.fingerprint


def test_a_cache_in_progress_with_a_manifest_or_segment_others_can_write_is_refused(tmp_path):
    spec = make_spec(num_samples=40, tag="parts")
    p = path_for(str(tmp_path / "c"), spec.fingerprint)
    w = CacheWriter(p, spec)
    keys = np.arange(10)
    w.write(keys, expected_logits(keys, spec.num_classes))
    w.abort()
    parts = p + ".parts"
    manifest = os.path.join(parts, "manifest.json")
    os.chmod(manifest, 0o666)
    with pytest.raises(NotTrusted, match="manifest.json is writable by others"):
        CacheReader(p, spec=spec)
    os.chmod(manifest, 0o644)
    seg = [n for n in os.listdir(parts) if n.startswith("seg-")][0]
    os.chown(os.path.join(parts, seg), NOBODY, NOBODY)
    with pytest.raises(NotTrusted, match="owned by uid 65534"):
        CacheReader(p, spec=spec)
