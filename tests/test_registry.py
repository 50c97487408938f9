"""The cache directory and `python -m kdcache.store ls|inspect|verify|gc`."""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from kdcache.store import CacheWriter, path_for, resolve_cache_dir
from kdcache.store.format import schema
from kdcache.store.folder.registry import final_path, parts_path
from tests.conftest import ROOT
from tests.test_compact_crash import SMALL, after_every_tool, crash, small, store_cli, what_is_left  # noqa: F401
from tests.helpers import expected_logits, make_spec, produce, seal_again


def cli(*args, env=None):
    e = {**os.environ, "PYTHONPATH": ROOT, **(env or {})}
    return subprocess.run([sys.executable, "-m", "kdcache.store", *args], capture_output=True, text=True, env=e, cwd=ROOT)


def test_cache_dir_resolution(monkeypatch, tmp_path):
    monkeypatch.delenv("KDCACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert resolve_cache_dir() == str(tmp_path / "caches")
    monkeypatch.setenv("KDCACHE_DIR", str(tmp_path / "env"))
    assert resolve_cache_dir() == str(tmp_path / "env")
    assert resolve_cache_dir(str(tmp_path / "flag")) == str(tmp_path / "flag")


@pytest.fixture
def populated(cache_dir):
    full = make_spec(num_samples=50, tag="complete-one")
    produce(path_for(cache_dir, full.fingerprint), full)
    part = make_spec(num_samples=50, tag="partial-one", codec="topk:2", dtype="float16", views=2)
    w = CacheWriter(path_for(cache_dir, part.fingerprint), part)
    w.write(np.arange(25), expected_logits(np.arange(25) * 2, 10), views=0)
    w.abort()
    return cache_dir, full, part


def test_ls_lists_both_states_in_json_and_text(populated):
    d, full, part = populated
    r = cli("ls", "--cache-dir", d, "--json")
    assert r.returncode == 0, r.stderr
    rows = {e["fingerprint"]: e for e in json.loads(r.stdout)}
    assert rows[full.fingerprint]["state"] == "complete" and rows[full.fingerprint]["done"] == 1.0
    assert rows[part.fingerprint]["state"] == "incomplete"
    assert rows[part.fingerprint]["done"] == pytest.approx(0.25)
    assert rows[part.fingerprint]["codec"] == "topk:2" and rows[part.fingerprint]["views"] == 2
    assert rows[full.fingerprint]["teacher"].startswith("complete-one")
    for e in rows.values():
        assert e["size"] > 0 and e["created"] and e["last_used"]
    text = cli("ls", "--cache-dir", d).stdout
    assert full.fingerprint in text and "25.0%" in text and "last used" in text


def test_ls_follows_kdcache_dir(populated):
    d, full, _ = populated
    r = cli("ls", env={"KDCACHE_DIR": d})
    assert full.fingerprint in r.stdout


def test_inspect_shows_all_metadata(populated):
    d, full, _ = populated
    r = cli("inspect", final_path(path_for(d, full.fingerprint)), "--json")
    meta = json.loads(r.stdout)
    assert meta[schema.A_FINGERPRINT] == full.fingerprint
    assert meta["inputs"] == full.inputs
    assert meta[schema.A_FORMAT] == schema.FORMAT_VERSION
    assert meta["datasets"][schema.LOGITS]["shape"] == [50, 1, 10]
    for k in (schema.A_TOOL_VERSION, schema.A_CREATED, schema.A_NUM_CLASSES, schema.A_CODEC, schema.A_DTYPE):
        assert k in meta


def test_verify_exit_codes(populated):
    d, full, part = populated
    good = path_for(d, full.fingerprint)
    r = cli("verify", good)
    assert r.returncode == 0 and "sound" in r.stdout
    r = cli("verify", path_for(d, part.fingerprint), "--json")
    assert r.returncode == 1 and "incomplete" in json.loads(r.stdout)["problems"][0]
    # a NaN slipped into a finished file
    with h5py.File(final_path(good), "r+") as f:
        f[schema.LOGITS][3, 0, 2] = np.nan
    r = cli("verify", good)
    assert r.returncode == 1 and "NaN" in r.stdout
    # metadata edited by hand: the seal no longer matches, the file is NOT sound
    with h5py.File(final_path(good), "r+") as f:
        f[schema.LOGITS][3, 0, 2] = 0
        f.attrs[schema.A_VIEWS] = 2
    r = cli("verify", good)
    assert r.returncode == 1 and "NOT sound" in r.stdout and "seal" in r.stdout, r.stdout + r.stderr
    # ... and sealed again by a writer that recorded inputs which do not give the fingerprint: not a cache
    # this kdcache can check (exit 2, one line)
    seal_again(final_path(good))
    r = cli("verify", good)
    assert r.returncode == 2 and "does not match" in r.stderr and len(r.stderr.splitlines()) == 1
    # not a cache at all: could not check
    r = cli("verify", os.path.join(d, "nothing-here"))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1


def test_gc_dry_run_then_remove_incomplete_and_unused(populated):
    d, full, part = populated
    r = cli("gc", "--cache-dir", d, "--dry-run", "--min-age", "0", "--json")
    out = json.loads(r.stdout)
    assert [os.path.basename(c["path"]) for c in out["caches"]] == [part.fingerprint]
    assert os.path.isdir(parts_path(path_for(d, part.fingerprint))), "dry run removes nothing"
    r = cli("gc", "--cache-dir", d, "--min-age", "0")
    assert r.returncode == 0 and "removed" in r.stdout
    assert not os.path.exists(parts_path(path_for(d, part.fingerprint)))
    fin = final_path(path_for(d, full.fingerprint))
    assert os.path.exists(fin)
    old = time.time() - 10 * 86400
    os.utime(fin, (old, old))
    r = cli("gc", "--cache-dir", d, "--older-than", "30", "--json")
    assert os.path.exists(fin) and json.loads(r.stdout)["caches"] == []
    cli("gc", "--cache-dir", d, "--older-than", "5")
    assert not os.path.exists(fin)


def test_gc_keeps_a_cache_a_producer_is_writing(cache_dir):
    spec = make_spec()
    w = CacheWriter(path_for(cache_dir, spec.fingerprint), spec)
    w.write([0], expected_logits([0], 10))
    try:
        r = cli("gc", "--cache-dir", cache_dir, "--min-age", "0", "--json")
        assert json.loads(r.stdout)["caches"] == []
        assert os.path.isdir(parts_path(path_for(cache_dir, spec.fingerprint)))
    finally:
        w.abort()


def test_gc_max_size_removes_least_recently_used(cache_dir):
    paths = []
    for i in range(3):
        s = make_spec(num_samples=400, tag=f"t{i}")
        p = path_for(cache_dir, s.fingerprint)
        produce(p, s)
        t = time.time() - (3 - i) * 1000
        os.utime(final_path(p), (t, t))
        paths.append(final_path(p))
    one = os.path.getsize(paths[0])
    cli("gc", "--cache-dir", cache_dir, "--max-size", str(one * 2 + 10))
    assert [os.path.exists(p) for p in paths] == [False, True, True]


def test_gc_removes_damaged_caches_and_nothing_that_is_not_a_cache(cache_dir):
    spec = make_spec(num_samples=20)
    p = path_for(cache_dir, spec.fingerprint)
    produce(p, spec)
    with h5py.File(final_path(p), "r+") as f:
        f.attrs[schema.A_NUM_CLASSES] = "ten"  # kdcache's file, its metadata malformed
    junk = os.path.join(cache_dir, "0123456789abcdef0123.h5")  # named like a cache, not HDF5
    with open(junk, "wb") as fh:
        fh.write(b"\0" * 100)
    r = cli("ls", "--cache-dir", cache_dir)
    assert r.returncode == 0 and "damaged" in r.stdout and "not a cache" in r.stderr
    r = cli("gc", "--cache-dir", cache_dir)
    assert r.returncode == 0, r.stderr
    assert not os.path.exists(final_path(p)) and os.path.exists(junk)


def test_cli_help_and_errors(cache_dir):
    r = cli("--help")
    assert r.returncode == 0 and "fingerprint" in r.stdout
    for cmd in ("ls", "inspect", "verify", "gc"):
        assert cli(cmd, "--help").returncode == 0
    r = cli("inspect", os.path.join(cache_dir, "nothing"))
    assert r.returncode == 2 and r.stderr.startswith("error:") and "Traceback" not in r.stderr
    r = cli("gc", "--cache-dir", cache_dir, "--max-size", "lots")
    assert r.returncode == 2 and "500M" in r.stderr
    assert "no caches" in cli("ls", "--cache-dir", cache_dir).stdout


@pytest.mark.slow
def test_gc_of_a_damaged_final_keeps_the_segments_beside_it(small, tmp_path):  # noqa: F811 (small: a fixture)
    """A crash after the rename leaves the segments beside the finished file; if that file is then
    damaged, gc removes it and keeps the segments: the next tool compacts them again, no row lost."""
    d, spec, r = crash(small, tmp_path, SMALL, "renamed")
    assert r.returncode == -signal.SIGKILL and what_is_left(d)["parts"]
    fin = os.path.join(d, spec.fingerprint + ".h5")
    with h5py.File(fin, "r+") as f:
        f.attrs[schema.A_COMPLETE] = 0  # a finished file no reader may trust
    r = store_cli("gc", "--cache-dir", d, "--min-age", "0")
    assert r.returncode == 0 and "damaged" in r.stdout, r.stdout + r.stderr
    assert not os.path.exists(fin) and what_is_left(d)["parts"]
    after_every_tool(d, spec, SMALL, "ls", np.arange(spec.num_keys))
