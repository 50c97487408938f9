"""What sits under kdcache's names in a cache directory without being kdcache's: FIFOs, symbolic links
(to a file elsewhere, to /dev/zero, to nothing), folders, other users' files, headers that declare
more than the file holds, pids no process of ours can have.

Every tool (ls, inspect, verify, gc, a reader, a producer resuming) finishes promptly, with exit 0
or one line and exit 2, skips what is not its own and neither deletes nor changes any of it. And
`gc` ages a build by its last write (a committed row, a heartbeat), not by its folder's mtime."""
import contextlib
import io
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.store import CacheReader, CacheWriter, path_for
from kdcache.store.format import schema
from kdcache.store import command as store_main
from kdcache.store.read.demand import Demand
from kdcache.store.errors import StoreError
from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, make_spec, produce
from tests.test_store_trust import partial

TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"
ROOT_USER = os.geteuid() == 0
OTHER_UID = 65534  # nobody: the owner of 'another user's' entries (planted as root)
WITHIN = 20  # seconds any tool may take here; a blocked open never ends
SETTINGS = dict(deadline=None, derandomize=True, database=None)
A = make_spec(num_samples=40, tag="entries-complete")
B = make_spec(num_samples=40, tag="entries-partial")
C = make_spec(num_samples=40, tag="entries-absent")
NPY_2_33 = (b"\x93NUMPY\x01\x00v\x00{'descr': '<i8', 'fortran_order': False, 'shape': (8589934592,), }"
            .ljust(10 + 118, b" ") + b"\n" + b"\x01" + b"\x00" * 15)  # 144 bytes declaring 2**33 keys


class Hang(Exception):
    """A tool did not finish within WITHIN seconds."""


@contextlib.contextmanager
def within(seconds=WITHIN):
    def ring(*_):
        raise Hang(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, ring)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def store_cmd(*args):
    """`kdcache ls|inspect|verify|gc` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with within(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = store_main.main([*map(str, args)], prog="kdcache")
    return code, out.getvalue(), err.getvalue()


def one_line(code, err, allowed=(0, 2)):
    assert code in allowed and "Traceback" not in err, (code, err)
    if code == 2:
        assert len([ln for ln in err.splitlines() if ln.startswith("error:")]) == 1, err


def foreign_process():
    """A live process of another user (nobody)."""
    return subprocess.Popen(["sleep", "300"], user=OTHER_UID, stdin=subprocess.DEVNULL)


# --- planting -----------------------------------------------------------------------------------
def plant(path, kind, outside):
    """Put an entry of `kind` at `path` (replacing what is there). Returns True when it is not
    kdcache's (so it must be left exactly as it is), False for a file of ours under its name."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link-outside":
        os.symlink(outside, path)
    elif kind == "link-zero":
        os.symlink("/dev/zero", path)
    elif kind == "link-dangling":
        os.symlink(path + "-nowhere", path)
    elif kind == "folder":
        os.mkdir(path)
        open(os.path.join(path, "inside"), "w").write("a user's\n")
    elif kind in ("huge-npy", "foreign-npy"):
        open(path, "wb").write(NPY_2_33)
    elif kind == "huge-json":
        open(path, "w").write("[" * 200_000)
    elif kind == "hdf5-garbage":
        open(path, "wb").write(b"\x89HDF\r\n\x1a\n" + b"\xff" * 4000)
    elif kind == "mode-000":
        open(path, "w").write('{"pid": 1}')
        os.chmod(path, 0)
    elif kind == "foreign-fifo":
        os.mkfifo(path)
    if kind.startswith("foreign"):
        os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
        return True
    return kind in ("fifo", "folder") or kind.startswith("link")


def snapshot(path):
    st = os.lstat(path)
    out = (st.st_mode, st.st_uid, st.st_ino, st.st_size, st.st_mtime_ns)
    if stat.S_ISDIR(st.st_mode):
        out += (tuple(sorted(os.listdir(path))),)
    return out


KINDS = ["fifo", "link-outside", "link-zero", "link-dangling", "folder", "huge-npy", "huge-json", "hdf5-garbage",
         "mode-000"] + (["foreign-npy", "foreign-fifo"] if ROOT_USER else [])
PIDS = ["self", "1", "99999999999999999999", "-5", "\u0661\u0662\u0663", str(2 ** 22 + 1), "foreign"]
PART_NAMES = ["manifest.json", "manifest.json.tmp-{pid}", "seg-0of1-1700000000000000000-{pid}.h5",
              ".seg-0of1-1700000000000000000-{pid}.h5.tmp", "shard-0of1.lock", "shard-1of2.lock", "compact.lock",
              "trainer-{pid}.json", "trainer-{pid}.json.tmp-{pid}", ".compact-logits.tmp", "demand-{pid}-wait.npy",
              "demand-{pid}-next.npy", "demand-{pid}-wait.npy.tmp-{pid}"]
DIR_NAMES = ["{a}.h5", "{a}.parts", "{b}.h5", "{b}.parts", "{c}.h5", "{c}.parts", "{a}.h5.tmp-{pid}",
             "{b}.h5.tmp-{pid}", ".{b}.parts.gc-{pid}", ".{a}.h5.gc-{pid}"]


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    """A cache directory holding a finished cache (A) and one in progress (B, 10 of 40 rows)."""
    d = str(tmp_path_factory.mktemp("entries") / "caches")
    os.makedirs(d)
    assert produce(path_for(d, A.fingerprint), A)
    partial(d, B)
    return d


@pytest.fixture(scope="module")
def other_pid():
    p = foreign_process() if ROOT_USER else None
    yield p.pid if p else 1
    if p:
        p.kill()
        p.wait()


def run_every_tool(d):
    """Each tool on the directory, in this process, each within WITHIN seconds."""
    for base in (path_for(d, A.fingerprint), path_for(d, B.fingerprint)):
        for cmd in ("inspect", "verify"):
            code, _, err = store_cmd(cmd, base)
            one_line(code, err, allowed=(0, 1, 2))
        try:
            with within():
                r = CacheReader(base, timeout=0.5)
                try:
                    r.get(np.arange(5))
                finally:
                    r.close()
        except StoreError as e:
            assert "\n" not in str(e)
        try:
            with within():
                spec = A if base.endswith(A.fingerprint) else B
                with CacheWriter(base, spec, lock_wait_s=0.2) as w:
                    demand = Demand(w.parts, spec.num_keys)
                    demand.poll()
                    demand.take(w.is_done, 8)
        except StoreError as e:
            assert "\n" not in str(e)
    for args in (("ls", "--cache-dir", d), ("gc", "--cache-dir", d, "--min-age", "0"), ("ls", "--cache-dir", d)):
        code, _, err = store_cmd(*args)
        one_line(code, err)
    with within():  # the producer finishes the cache in progress (or refuses in one line)
        try:
            produce(path_for(d, B.fingerprint), B)
        except StoreError as e:
            assert "\n" not in str(e)


entries = st.lists(st.tuples(st.sampled_from(["A.parts", "B.parts", "dir"]), st.integers(0, 99),
                             st.sampled_from(KINDS), st.sampled_from(PIDS)), min_size=1, max_size=6)


@settings(max_examples=200 if TORTURE else 6, **SETTINGS)
@given(planted=entries)
def test_no_entry_under_kdcache_names_hangs_crashes_or_is_touched(template, other_pid, planted):
    work = tempfile.mkdtemp(prefix="kdcache-entries-")
    try:
        d = os.path.join(work, "caches")
        shutil.copytree(template, d, symlinks=True)
        outside = os.path.join(work, "outside.txt")
        open(outside, "w").write("a user's file elsewhere\n")
        before_outside = snapshot(outside)
        names = {"a": A.fingerprint, "b": B.fingerprint, "c": C.fingerprint}
        keep = {}
        for where, i, kind, pid in planted:
            pid = {"self": str(os.getpid()), "foreign": str(other_pid)}.get(pid, pid)
            if where == "dir":
                name = DIR_NAMES[i % len(DIR_NAMES)].format(pid=pid, **names)
                path = os.path.join(d, name)
            else:
                folder = path_for(d, A.fingerprint if where == "A.parts" else B.fingerprint) + ".parts"
                if not os.path.isdir(folder) or os.path.islink(folder):
                    continue  # replaced by an entry planted before
                path = os.path.join(folder, PART_NAMES[i % len(PART_NAMES)].format(pid=pid))
            if any(path.startswith(k + os.sep) for k in keep):
                continue  # inside an entry that is itself planted
            for k in [k for k in keep if k == path or k.startswith(path + os.sep)]:
                del keep[k]  # replaced with what is planted now
            if plant(path, kind, outside):
                keep[path] = None
        for p in keep:
            keep[p] = snapshot(p)
        run_every_tool(d)
        for p, before in keep.items():
            assert os.path.lexists(p), f"{p} (not kdcache's) was removed"
            assert snapshot(p) == before, f"{p} (not kdcache's) was changed"
        assert snapshot(outside) == before_outside and open(outside).read() == "a user's file elsewhere\n"
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --- the cases found, one by one -------------------------------------------------------------
def store_cli(*args):
    return subprocess.run([sys.executable, "-m", "kdcache.store", *map(str, args)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=ROOT, timeout=WITHIN)


def test_a_fifo_named_like_a_shard_lock_hangs_no_tool(cache_dir):
    base = partial(cache_dir, B)
    fin = path_for(cache_dir, A.fingerprint)
    assert produce(fin, A)
    os.makedirs(fin + ".parts")
    for folder in (base + ".parts", fin + ".parts"):
        os.mkfifo(os.path.join(folder, "shard-1of2.lock"))
    for args in (("ls", "--cache-dir", cache_dir), ("inspect", base), ("verify", base), ("verify", fin),
                 ("gc", "--cache-dir", cache_dir, "--min-age", "0")):
        r = store_cli(*args)  # subprocess.TimeoutExpired: it hung
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (args, r.stdout, r.stderr)
    assert "kept" in r.stdout and stat.S_ISFIFO(os.lstat(os.path.join(base + ".parts", "shard-1of2.lock")).st_mode)
    with within():
        CacheReader(fin).close()
        with pytest.raises(StoreError):
            CacheReader(base, timeout=0.5).get(np.arange(40))


def test_demand_files_that_are_not_a_readers_are_ignored_by_the_producer(cache_dir, other_pid):
    base = partial(cache_dir, B)
    parts = base + ".parts"
    me = os.getpid()
    os.mkfifo(os.path.join(parts, f"demand-{me}-wait.npy"))                   # blocks a plain open
    open(os.path.join(parts, f"demand-{'9' * 20}-wait.npy"), "wb").write(b"")  # int overflow in os.kill
    open(os.path.join(parts, f"demand-{me}-next.npy"), "wb").write(NPY_2_33)   # 2**33 keys in 144 bytes
    with within():
        d = Demand(parts, B.num_keys)
        assert not d.poll() and d.take(lambda k: np.zeros(len(k), bool), 8).size == 0
    # a file of another user, and a file of ours naming another user's process: neither is a reader of ours
    good = io.BytesIO()
    np.save(good, np.array([1, 7, 8], dtype=np.int64))
    os.unlink(os.path.join(parts, f"demand-{me}-next.npy"))
    open(os.path.join(parts, f"demand-{other_pid}-wait.npy"), "wb").write(good.getvalue())
    if ROOT_USER:
        open(os.path.join(parts, f"demand-{me}-next.npy"), "wb").write(good.getvalue())
        os.chown(os.path.join(parts, f"demand-{me}-next.npy"), OTHER_UID, OTHER_UID)
    with within():
        assert not Demand(parts, B.num_keys).poll()
    # and a sound one of ours is served
    os.unlink(os.path.join(parts, f"demand-{me}-wait.npy"))
    open(os.path.join(parts, f"demand-{me}-wait.npy"), "wb").write(good.getvalue())
    d = Demand(parts, B.num_keys)
    assert d.poll() and d.take(lambda k: np.zeros(len(k), bool), 8).tolist() == [7, 8]


@pytest.mark.skipif(not ROOT_USER, reason="planting another user's folder needs root")
def test_another_users_private_parts_folder_is_left_alone(cache_dir):
    base = partial(cache_dir, B)
    parts = base + ".parts"
    for n in os.listdir(parts):
        os.chown(os.path.join(parts, n), OTHER_UID, OTHER_UID)
    os.chown(parts, OTHER_UID, OTHER_UID)
    os.chmod(parts, 0o700)
    os.utime(parts, (1, 1))
    before = snapshot(parts)
    code, out, err = store_cmd("ls", "--cache-dir", cache_dir)
    one_line(code, err, allowed=(0,))
    assert "owned by another user" in err
    code, out, err = store_cmd("gc", "--cache-dir", cache_dir, "--min-age", "0")
    one_line(code, err, allowed=(0,))
    assert snapshot(parts) == before
    with pytest.raises(StoreError, match="uid"):
        CacheWriter(base, B)
    assert snapshot(parts) == before


def test_a_folder_that_cannot_be_read_is_skipped_not_a_traceback(cache_dir, monkeypatch):
    """As root nothing is refused for permissions; the refusal a user meets is simulated."""
    base = partial(cache_dir, B)
    parts = base + ".parts"
    real_listdir, real_scandir, real_open = os.listdir, os.scandir, os.open

    def refuse(real):
        def call(p, *a, **k):
            if os.fspath(p).startswith(parts):
                raise PermissionError(13, "Permission denied", os.fspath(p))
            return real(p, *a, **k)
        return call
    monkeypatch.setattr(os, "listdir", refuse(real_listdir))
    monkeypatch.setattr(os, "scandir", refuse(real_scandir))
    monkeypatch.setattr(os, "open", refuse(real_open))
    code, out, err = store_cmd("ls", "--cache-dir", cache_dir)
    one_line(code, err, allowed=(0,))
    assert "Permission denied" in err
    code, out, err = store_cmd("gc", "--cache-dir", cache_dir, "--min-age", "0")
    one_line(code, err, allowed=(0,))
    assert "nothing to remove" in out
    monkeypatch.undo()
    assert os.path.exists(os.path.join(parts, schema.MANIFEST))


# --- gc by the last write ------------------------------------------------------------------------
def test_gc_ages_a_build_by_its_last_write_not_its_folder(cache_dir):
    spec = make_spec(num_samples=200_000)  # what `python -m tests.helpers produce` builds
    base = path_for(cache_dir, spec.fingerprint)
    parts = base + ".parts"
    p = subprocess.Popen([sys.executable, "-m", "tests.helpers", "produce", "--path", base, "--num-samples",
                          str(spec.num_samples), "--batch", "64", "--delay", "0.01"],
                         env=CHILD_ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(n.startswith("seg-") for n in
                                                      (os.listdir(parts) if os.path.isdir(parts) else [])):
            time.sleep(0.02)
        time.sleep(0.5)  # rows appended to the segment: its folder is not touched by them
    finally:
        p.kill()
        p.wait()
    assert p.returncode == -signal.SIGKILL
    hours_ago = time.time() - 3 * 3600
    os.utime(parts, (hours_ago, hours_ago))  # the folder as it stands after hours of teacher work
    code, out, err = store_cmd("gc", "--cache-dir", cache_dir, "--min-age", "4")
    one_line(code, err, allowed=(0,))
    assert "nothing to remove" in out and os.path.isdir(parts), out
    ls = json.loads(store_cmd("--json", "ls", "--cache-dir", cache_dir)[1])
    assert ls[0]["state"] == "incomplete" and time.time() - ls[0]["last_used"] < 30
    for n in os.listdir(parts):  # the last write 5 s ago: past --min-age 4
        os.utime(os.path.join(parts, n), (time.time() - 5, time.time() - 5))
    code, out, err = store_cmd("gc", "--cache-dir", cache_dir, "--min-age", "4")
    one_line(code, err, allowed=(0,))
    assert f"removed {base}" in out and not os.path.exists(parts), out


# --- the producer command -------------------------------------------------------------------------
@pytest.mark.slow
def test_the_producer_stays_interruptible_beside_a_fifo_demand_file(teacher, tmp_path):
    d = tmp_path / "caches"
    cmd = [sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--teacher", teacher, "--dataset",
           "synthetic:n=200000,classes=10,shape=1x8x8", "--batch-size", "16", "--cache-dir", str(d)]
    p = subprocess.Popen(cmd, env=CHILD_ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        parts = None
        while time.monotonic() < deadline and p.poll() is None:
            found = [n for n in (os.listdir(d) if d.exists() else []) if n.endswith(".parts")]
            if found and any(n.startswith("seg-") for n in os.listdir(d / found[0])):
                parts = d / found[0]
                break
            time.sleep(0.05)
        assert parts is not None, p.communicate()
        for pid in (p.pid, os.getpid()):
            os.mkfifo(parts / f"demand-{pid}-wait.npy")
        (parts / f"demand-{p.pid}-next.npy").write_bytes(NPY_2_33)
        (parts / f"demand-{'9' * 20}-next.npy").write_bytes(NPY_2_33)
        time.sleep(1.0)  # a few polls of the demand files
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=WITHIN)  # TimeoutExpired: it hung, deaf to Ctrl-C
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode in (0, 130) and "Traceback" not in err, err
    assert stat.S_ISFIFO(os.lstat(parts / f"demand-{p.pid}-wait.npy").st_mode)
