"""Faults: disk full, read-only file systems, kills and Ctrl-C of either side, soak, security.

Every fault ends in one clear error line (no traceback), a non-zero exit, and no cached row
lost or wrong. `make torture` runs the long versions (KDCACHE_TORTURE=1).
"""
import glob
import json
import os
import signal
import stat
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader, CacheWriter, StoreError, UnsupportedFormatError, path_for
from kdcache.store.folder.registry import final_path, parts_path, verify
from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, expected_logits, gluon_teacher, make_spec, seal_again

TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"
ENV = CHILD_ENV
SYNTH = "synthetic:n=40000,classes=10,shape=1x8x8"


@pytest.fixture
def tmpfs(tmp_path):
    """A small file system of our own (root can mount tmpfs here): a real full disk, a real
    read-only file system."""
    d = tmp_path / "fs"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.strip()})")
    yield d
    subprocess.run(["umount", "-l", str(d)], capture_output=True)


def remount(d, opts):
    subprocess.run(["mount", "-o", f"remount,{opts}", str(d)], check=True)


def producer(*args, **kw):
    return subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--json", *map(str, args)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600, **kw)


def one_error_line(r):
    assert r.returncode != 0
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:"), r.stderr[-2000:]
    return last


def committed_rows_match_teacher(base, teacher, data=SYNTH):
    """Every committed row of the cache equals the teacher's output for its key."""
    from kdcache.pipeline import load_dataset
    from kdcache.pipeline.teacher import Teacher
    with CacheReader(base) as r:
        done = np.flatnonzero(r._done)
        if done.size:
            x, _ = load_dataset(data).get_batch(done)
            want = Teacher(teacher).forward(x).astype(np.float32)
            got = r.get(done, wait=False)
            if r.spec.dtype == "float16":
                want = want.astype(np.float16).astype(np.float32)
            # teacher batches differ from the producer's: MKL-DNN may differ in the last bits
            assert np.allclose(got, want, rtol=2e-3, atol=1e-4)
        return done.size


def test_disk_full_clear_error_sound_cache_and_resume(teacher, tmpfs, tmp_path):
    args = ["--teacher", teacher, "--dataset", SYNTH, "--dtype", "float32", "--batch-size", 256]
    r = producer(*args, "--cache-dir", tmpfs)
    last = one_error_line(r)
    assert "No space left" in last and "free disk space" in last and "resumes" in last
    base = glob.glob(str(tmpfs / "*.parts"))[0][:-len(".parts")]
    kept = committed_rows_match_teacher(base, teacher)
    assert kept > 0
    report, problems = verify(base)
    assert len(problems) == 1 and "incomplete" in problems[0]
    remount(tmpfs, "size=64m")
    r = producer(*args, "--cache-dir", tmpfs)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["complete"] and out["rows_written"] == 40000 - kept
    clean = json.loads(producer(*args, "--cache-dir", tmp_path / "clean").stdout.strip().splitlines()[-1])
    with h5py.File(clean["cache_path"]) as a, h5py.File(out["cache_path"]) as b:
        assert a["logits"][...].tobytes() == b["logits"][...].tobytes()


def test_file_size_limit_is_a_clear_error_too(tmp_path):
    """RLIMIT_FSIZE: writes fail with EFBIG (SIGXFSZ ignored) in the store, not a crash."""
    code = f"""
import resource, signal, sys, numpy as np
sys.path.insert(0, {ROOT!r})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (300000, 300000))
from tests.helpers import make_spec, expected_logits
from kdcache.store import CacheWriter, StoreError, path_for
spec = make_spec(num_samples=20000, num_classes=10)
w = CacheWriter(path_for({str(tmp_path)!r}, spec.fingerprint), spec)
try:
    for a in range(0, 20000, 500):
        w.write(np.arange(a, a + 500), expected_logits(np.arange(a, a + 500), 10))
except StoreError as e:
    print("STOREERROR", e)
    w.abort()
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV)
    assert "STOREERROR" in r.stdout and "file size limit" in r.stdout, r.stdout + r.stderr
    spec = make_spec(num_samples=20000, num_classes=10)
    with CacheReader(path_for(str(tmp_path), spec.fingerprint)) as rd:
        done = np.flatnonzero(rd._done)
        assert done.size > 0 and np.array_equal(rd.get(done, wait=False), expected_logits(done, 10))


def test_read_only_file_system(tmpfs):
    spec = make_spec(num_samples=100)
    done = make_spec(num_samples=100, tag="finished")
    from tests.helpers import produce
    produce(path_for(str(tmpfs), done.fingerprint), done)
    w = CacheWriter(path_for(str(tmpfs), spec.fingerprint), spec)
    w.write(np.arange(10), expected_logits(np.arange(10), 10))
    w.abort()
    remount(tmpfs, "ro")
    # reading works, finished or not
    with CacheReader(path_for(str(tmpfs), done.fingerprint)) as r:
        assert np.array_equal(r.get(np.arange(100)), expected_logits(np.arange(100), 10))
    with CacheReader(path_for(str(tmpfs), spec.fingerprint)) as r:
        assert r.missing(np.arange(100)).size == 90
    # a complete cache needs no writing: reused
    assert CacheWriter(path_for(str(tmpfs), done.fingerprint), done).complete
    # producing into it is refused clearly
    with pytest.raises(StoreError, match="Read-only file system.*writable"):
        CacheWriter(path_for(str(tmpfs), spec.fingerprint), spec)
    other = make_spec(num_samples=100, tag="new")
    with pytest.raises(StoreError, match="writable"):
        CacheWriter(path_for(str(tmpfs), other.fingerprint), other)


def test_cache_files_and_rings_are_not_writable_by_others(cache_dir):
    from tests.helpers import produce
    spec = make_spec()
    p = path_for(cache_dir, spec.fingerprint)
    w = CacheWriter(p, spec)
    w.write([0], expected_logits([0], 10))
    for f in glob.glob(parts_path(p) + "/*"):
        assert not os.stat(f).st_mode & stat.S_IWOTH, f
    w.abort()
    produce(p, spec)
    assert not os.stat(final_path(p)).st_mode & (stat.S_IWOTH | stat.S_IWGRP)
    from kdcache.store.ring import RingReader
    with RingReader(create=True, capacity=8, num_classes=10) as r:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{r.name}").st_mode) == 0o600


def test_nothing_in_a_cache_is_unpickled_or_evaluated(cache_dir):
    """Attributes are JSON strings or numbers; an attribute holding a pickle stays inert bytes."""
    import pickle
    from tests.helpers import produce
    spec = make_spec()
    p = path_for(cache_dir, spec.fingerprint)
    produce(p, spec)
    marker = os.path.join(cache_dir, "PWNED")

    class Evil:
        def __reduce__(self):
            return (open, (marker, "w"))
    with h5py.File(final_path(p), "r+") as f:
        f.attrs["evil"] = np.void(pickle.dumps(Evil()))
    seal_again(final_path(p))  # a file written so, not damaged later: what kdcache reads of it is the question
    for cmd in ("inspect", "verify"):
        r = subprocess.run([sys.executable, "-m", "kdcache.store", cmd, final_path(p)], env=ENV, cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    CacheReader(p).close()  # an extra attribute is inert: the cache stays usable
    with h5py.File(final_path(p), "r+") as f:
        f.attrs["inputs_json"] = json.dumps({"__class__": "os.system", "teacher": "x"})
    seal_again(final_path(p))
    for cmd in ("inspect", "verify"):
        r = subprocess.run([sys.executable, "-m", "kdcache.store", cmd, final_path(p)], env=ENV, cwd=ROOT,
                           capture_output=True, text=True)
        assert r.returncode == 2 and "altered" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    with pytest.raises(UnsupportedFormatError, match="altered"):
        CacheReader(p)
    assert not os.path.exists(marker)


def test_wrong_dataset_or_teacher_for_an_explicit_cache_is_refused(teacher, tmp_path):
    other = str(tmp_path / "other")
    gluon_teacher(other, seed=3)
    out = json.loads(producer("--teacher", teacher, "--cache-dir", tmp_path).stdout.strip().splitlines()[-1])
    cache = out["cache_path"][:-3]
    before = open(out["cache_path"], "rb").read()
    for args in (["--teacher", other], ["--teacher", teacher, "--dataset", "synthetic:n=1438,classes=10,shape=1x8x8"],
                 ["--teacher", teacher, "--views", "2"], ["--teacher", teacher, "--codec", "topk:2"]):
        r = producer(*args, "--cache", cache)
        line = one_error_line(r)
        assert "named for fingerprint" in line or "built for fingerprint" in r.stderr or \
            "built from another data set" in line, r.stderr
    assert open(out["cache_path"], "rb").read() == before


def _kill_tree_check(pids):
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = [p for p in pids if os.path.exists(f"/proc/{p}") and
                 open(f"/proc/{p}/stat").read().split(")")[-1].split()[0] != "Z"]
        if not alive:
            return
        time.sleep(0.1)
    raise AssertionError(f"processes left behind: {alive}")


def _start_trainer(tmp_path, teacher, *extra):
    args = ["--teacher", teacher, "--dataset", SYNTH, "--epochs", 2, "--batch-size", 32, "--threads", 1, "--quiet",
            "--runs-dir", tmp_path / "runs", "--cache-dir", tmp_path / "caches", "--run", "r", *extra]
    return subprocess.Popen([sys.executable, "-m", "kdcache.trainer", *map(str, args)], env=ENV, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _producer_pid(tmp_path, timeout=120):
    from kdcache.store.files.segment import lock_holders
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for d in glob.glob(str(tmp_path / "caches" / "*.parts")):
            for _, h in lock_holders(d):
                if "pid" in h:  # the lock is taken a moment before its holder's record is written
                    return h["pid"]
        time.sleep(0.05)
    raise AssertionError("no producer started")


def _shm_rings():
    return {f for f in os.listdir("/dev/shm") if f.startswith("kdcache-ring-")}


@pytest.mark.slow
@pytest.mark.parametrize("sig,store", [(signal.SIGKILL, "cache"), (signal.SIGINT, "cache"), (signal.SIGTERM, "cache"),
                                       (signal.SIGKILL, "ring"), (signal.SIGINT, "ring"), (signal.SIGTERM, "ring")])
def test_killing_or_interrupting_the_trainer_leaves_nothing_behind(teacher, tmp_path, sig, store):
    rings = _shm_rings()
    p = _start_trainer(tmp_path, teacher, "--store", store)
    if store == "cache":
        ppid = _producer_pid(tmp_path)
    else:
        deadline = time.monotonic() + 120
        while not (_shm_rings() - rings) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(3)
        ppid = None
    time.sleep(1.5)
    p.send_signal(sig)
    out, err = p.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert p.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-2000:]
    if sig == signal.SIGTERM:  # taken at a safe point, like Ctrl-C, not the default's abrupt end
        assert p.returncode == 143 and "stopped by SIGTERM" in err and "Traceback" not in err, err[-2000:]
    kids = [int(x) for x in open(f"/proc/{p.pid}/task/{p.pid}/children").read().split()] \
        if os.path.exists(f"/proc/{p.pid}") else []
    _kill_tree_check(kids + ([ppid] if ppid else []))
    deadline = time.monotonic() + 10
    while (_shm_rings() - rings) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not (_shm_rings() - rings), "a shared-memory ring was left behind"
    if store == "cache":
        base = glob.glob(str(tmp_path / "caches" / "*.parts"))
        if base:  # the cache is sound: every committed row is the teacher's
            assert committed_rows_match_teacher(base[0][:-6], teacher) >= 0


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupted_producer_resumes(teacher, tmp_path, sig):
    n = 60000  # enough rows that the producer is still writing when Ctrl-C comes (~30k rows/s here, 0.5 s in)
    data = f"synthetic:n={n},classes=10,shape=1x8x8"
    p = subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--teacher", teacher, "--dataset", data,
                          "--batch-size", "16", "--cache-dir", str(tmp_path)], env=ENV, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not glob.glob(str(tmp_path / "*.parts" / "seg-*")):
        assert p.poll() is None, p.communicate()[1][-2000:]
        time.sleep(0.05)
    time.sleep(0.5)
    p.send_signal(sig)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 128 + sig and "resume" in err and "Traceback" not in err, err[-2000:]
    base = glob.glob(str(tmp_path / "*.parts"))[0][:-6]
    kept = committed_rows_match_teacher(base, teacher, data)
    assert 0 < kept < n
    r = producer("--teacher", teacher, "--dataset", data, "--batch-size", 16, "--cache-dir", tmp_path)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["complete"] and out["rows_written"] == n - kept


@pytest.mark.slow
def test_soak_one_producer_four_readers(cache_dir):
    """A bounded soak: zero torn or mismatched reads (10 s here, 60 s in make torture)."""
    seconds = 60 if TORTURE else 10
    spec = make_spec(num_samples=2_000_000, num_classes=16, dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    env = {**ENV}
    prod = subprocess.Popen([sys.executable, "-m", "tests.helpers", "produce", "--path", p, "--num-samples", "2000000",
                             "--num-classes", "16", "--dtype", "float16", "--batch", "64", "--delay", "0.001"],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    code = f"""
import sys, time, json, numpy as np
sys.path.insert(0, {ROOT!r})
from kdcache.store import CacheReader, CacheNotFoundError
from tests.helpers import expected_logits, make_spec
spec = make_spec(num_samples=2_000_000, num_classes=16, dtype="float16")
end = time.monotonic() + {seconds}
while True:
    try:
        r = CacheReader({p!r}, spec=spec); break
    except CacheNotFoundError:
        time.sleep(0.01)
rng = np.random.default_rng()
reads = bad = 0
while time.monotonic() < end:
    r.refresh()
    done = np.flatnonzero(r._done)
    if done.size:
        keys = rng.choice(done, size=min(256, done.size))
        got = r.get(keys, wait=False)
        want = expected_logits(keys, 16).astype(np.float16).astype(np.float32)
        bad += int((~np.all(got == want, axis=1)).sum())
        reads += keys.size
print(json.dumps({{"reads": reads, "bad": bad, "done": int(r._done.sum())}}))
"""
    readers = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for _ in range(4)]
    results = []
    for r in readers:
        out, err = r.communicate(timeout=seconds + 120)
        assert r.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    prod.kill()
    prod.wait()
    assert all(res["bad"] == 0 for res in results), results
    assert all(res["reads"] > 1000 and res["done"] > 0 for res in results), results


@pytest.mark.slow
def test_kills_of_the_producer_cli_at_random_moments(teacher, tmp_path):
    """kill -9 of python -m kdcache.cache_builder at random moments after it starts writing (3 times;
    20 under make torture), then a resumed build: bitwise equal to a clean one."""
    # ~30k rows per kill (the producer writes ~30k rows/s here; each kill comes up to 0.8 s into a run's writing)
    wanted, n = (20, 600000) if TORTURE else (3, 120000)
    args = ["--teacher", teacher, "--dataset", f"synthetic:n={n},classes=10,shape=1x8x8", "--batch-size", 16,
            "--dtype", "float32"]
    rng = np.random.default_rng(7)
    kills = 0
    segs = lambda: glob.glob(str(tmp_path / "k" / "*.parts" / "seg-*"))
    while kills < wanted:
        before = len(segs())
        p = subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--quiet", *map(str, args), "--cache-dir",
                              str(tmp_path / "k")], env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while len(segs()) == before and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until this run writes: then kill it at a random moment
        time.sleep(float(rng.uniform(0.0, 0.8)))
        if p.poll() is not None:
            break
        p.kill()
        p.wait()
        kills += 1
    assert kills == wanted
    out = json.loads(producer(*args, "--cache-dir", tmp_path / "k").stdout.strip().splitlines()[-1])
    clean = json.loads(producer(*args, "--cache-dir", tmp_path / "c").stdout.strip().splitlines()[-1])
    with h5py.File(clean["cache_path"]) as a, h5py.File(out["cache_path"]) as b:
        assert a["logits"][...].tobytes() == b["logits"][...].tobytes()
