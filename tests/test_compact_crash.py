"""kill -9 at every step of compaction loses no committed row: whichever tool comes next (ls, inspect,
verify, the reader, the producer, gc) finishes or tidies what the crash left, and the cache ends sound.

The producer that writes a cache's last rows compacts it in close(); store.write.compact.step names each
step ("locked", "writing", "written", "renamed", "removing"), and the killed producer replaces it
with a SIGKILL of itself at one of them. gc, which renames a cache aside before deleting it, never
touches a cache whose lock a live process holds, and a producer that starts in that window begins
a clean cache.
"""
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader, CacheWriter, path_for
from kdcache.store.format import schema
from kdcache.store.files.paths import ASIDE, COMPACT_TMP
from tests.conftest import ROOT
from tests.helpers import expected_logits, make_spec

STEPS = ("locked", "writing", "written", "renamed", "removing")
TOOLS = ("ls", "inspect", "verify", "reader", "producer", "gc")
ENV = {**os.environ, "PYTHONPATH": ROOT}
SMALL = dict(num_samples=300, num_classes=10, views=2, tag="compact-crash")
LARGE = dict(num_samples=400_000, num_classes=20, views=1, tag="compact-crash-large")
LAST = 64  # rows the killed producer writes itself before it compacts
DEAD_PID = 2 ** 22 + 1  # above the largest pid_max Linux allows: never a live process

# The killed producer: writes the rows still missing, then close() compacts, and dies at `step`
# ("timer:START:S": S seconds after START, "locked" or "tmp", the opening of the temporary file;
# "time": not killed, prints when each step came, in seconds after the compaction lock was taken).
PRODUCER = """
import json, os, signal, sys, threading, time
import h5py
import kdcache.store.write.compact
from kdcache import store
from kdcache.store import CacheWriter
from tests.helpers import expected_logits, make_spec
spec, base, when = make_spec(**json.loads(sys.argv[1])), sys.argv[2], sys.argv[3]
budget = None if sys.argv[4] == "ram" else 0
marks = {}
def mark(name):
    marks.setdefault(name, time.monotonic())
    if name == when:
        os.kill(os.getpid(), signal.SIGKILL)
    if when.startswith("timer:" + name + ":"):
        threading.Timer(float(when.rsplit(":", 1)[1]), os.kill, (os.getpid(), signal.SIGKILL)).start()
class H5py:  # compaction's h5py, marking when its temporary file is opened
    def File(self, name, mode="r", **kw):
        mark("tmp")
        return h5py.File(name, mode, **kw)
store.write.compact.step, store.write.compact.h5py = mark, H5py()
with CacheWriter(base, spec, memory_budget=budget) as w:
    keys = w.missing()
    w.write(keys // spec.views, expected_logits(keys, spec.num_classes), views=keys % spec.views)
mark("end")
print(json.dumps({"complete": w.complete, **{k: t - marks["locked"] for k, t in marks.items()}}))
"""

# A reader in its own process: every key, compared with the teacher's rows exactly.
READER = """
import json, sys
import numpy as np
from kdcache.store import CacheReader
from tests.helpers import expected_logits, make_spec
spec, base = make_spec(**json.loads(sys.argv[1])), sys.argv[2]
with CacheReader(base, spec=spec, timeout=5) as r:
    keys = np.arange(spec.num_keys)
    got = r.get(keys // spec.views, views=keys % spec.views, wait=False)
    bad = int((~np.all(got == expected_logits(keys, spec.num_classes), axis=1)).sum())
    print(json.dumps({"complete": r.complete, "mismatched": bad}))
"""

# A rerun of the producer on the same inputs.
RERUN = """
import json, sys
from tests.helpers import make_spec, produce
print(json.dumps({"complete": produce(sys.argv[2], make_spec(**json.loads(sys.argv[1])))}))
"""


def py(code, *args, timeout=300):
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)


def store_cli(*args):
    return subprocess.run([sys.executable, "-m", "kdcache.store", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=300)


def last_json(r):
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def whole_json(r):
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    return json.loads(r.stdout)


def committed_template(root, kw):
    """A cache directory whose cache has every key but the last LAST committed, in three segments
    of two shards (two of them crashed: aborted, never closed)."""
    spec = make_spec(**kw)
    d = os.path.join(root, "template")
    os.makedirs(d)
    base = path_for(d, spec.fingerprint)
    todo = np.random.default_rng(1).permutation(spec.num_keys)[:-LAST]
    even, odd = todo[todo % 2 == 0], todo[todo % 2 == 1]
    for shard, keys in ((0, even[: even.size // 2]), (1, odd), (0, even[even.size // 2:])):
        w = CacheWriter(base, spec, shard=(shard, 2))
        for batch in np.array_split(keys, 4):
            w.write(batch // spec.views, expected_logits(batch, spec.num_classes), views=batch % spec.views)
        w.abort()
    return d, spec


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return committed_template(str(tmp_path_factory.mktemp("small")), SMALL)


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    return committed_template(str(tmp_path_factory.mktemp("large")), LARGE)


def rows_kept(d, spec):
    """Keys whose teacher rows the directory still holds, read with plain h5py: from the finished file
    when there is one (all of them, or it is wrong), else from every segment's committed rows."""
    want = lambda keys: expected_logits(keys, spec.num_classes)
    fin = os.path.join(d, spec.fingerprint + ".h5")
    if os.path.exists(fin):
        with h5py.File(fin, "r") as f:
            got = f["logits"][...].reshape(spec.num_keys, spec.num_classes)
            done = f["done"][...].reshape(-1) == 1
        keys = np.arange(spec.num_keys)
        return np.unique(keys[done & np.all(got == want(keys), axis=1)])
    kept = []
    for seg in glob.glob(os.path.join(d, spec.fingerprint + ".parts", "seg-*.h5")):
        with h5py.File(seg, "r", libver="latest", swmr=True) as f:
            n = int(f["state"][0])
            keys, got = f["keys"][:n], f["logits"][:n]
            kept.append(keys[np.all(got == want(keys), axis=1)])
    return np.unique(np.concatenate(kept)) if kept else np.zeros(0, dtype=np.int64)


def what_is_left(d):
    """The crash's leftovers by kind, for the report of where a kill landed."""
    names = os.listdir(d)
    return {"final": any(n.endswith(".h5") and not n.startswith(".") for n in names),
            "parts": any(n.endswith(".parts") and not n.startswith(".") for n in names),
            "tmp": any(COMPACT_TMP.match(n) for n in names), "aside": any(ASIDE.match(n) for n in names)}


def run_tool(tool, d, spec, kw):
    base, fin = path_for(d, spec.fingerprint), path_for(d, spec.fingerprint) + ".h5"
    if tool == "ls":
        entries = {e["name"]: e for e in whole_json(store_cli("ls", "--cache-dir", d, "--json"))}
        e = entries[spec.fingerprint]
        assert e["state"] in ("complete", "committed") and e["done"] == 1.0, e
    elif tool == "inspect":
        meta = whole_json(store_cli("inspect", fin, "--json"))
        assert meta["state"] == "complete" and meta["fingerprint"] == spec.fingerprint, meta
    elif tool == "verify":
        r = store_cli("verify", fin)
        assert r.returncode == 0 and "sound" in r.stdout and not r.stderr, r.stdout + r.stderr
    elif tool == "reader":
        assert last_json(py(READER, json.dumps(kw), base)) == {"complete": True, "mismatched": 0}
    elif tool == "producer":
        assert last_json(py(RERUN, json.dumps(kw), base)) == {"complete": True}
    else:
        r = store_cli("gc", "--cache-dir", d, "--min-age", "0")
        assert r.returncode == 0 and not r.stderr and f"removed {base} " not in r.stdout, r.stdout + r.stderr


def after_every_tool(d, spec, kw, first, committed):
    """Each tool from a fresh process, `first` first: no committed row is ever lost on the way, and
    the directory ends holding the sound finished file and nothing else."""
    for tool in (first,) + tuple(t for t in TOOLS if t != first):
        run_tool(tool, d, spec, kw)
        left = what_is_left(d)
        assert left["final"] and not left["parts"] and not left["tmp"], (tool, left)
        lost = np.setdiff1d(committed, rows_kept(d, spec))
        assert lost.size == 0, f"after {tool}: {lost.size} committed rows lost"
    assert sorted(os.listdir(d)) == [spec.fingerprint + ".h5"], os.listdir(d)
    assert rows_kept(d, spec).size == spec.num_keys
    r = store_cli("verify", os.path.join(d, spec.fingerprint + ".h5"))
    assert r.returncode == 0, r.stdout + r.stderr


def crash(template, tmp_path, kw, when, budget="ram"):
    """A copy of the template; its producer writes the last rows and is killed while compacting."""
    src, spec = template
    d = str(tmp_path / "caches")
    shutil.copytree(src, d)
    r = py(PRODUCER, json.dumps(kw), path_for(d, spec.fingerprint), when, budget)
    return d, spec, r


@pytest.mark.slow
@pytest.mark.parametrize("first", TOOLS)
@pytest.mark.parametrize("step", STEPS)
def test_a_kill_at_each_step_of_compaction_loses_nothing(small, tmp_path, step, first):
    d, spec, r = crash(small, tmp_path, SMALL, step)
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    left = what_is_left(d)
    assert left == {"locked": dict(final=False, parts=True, tmp=False, aside=False),
                    "writing": dict(final=False, parts=True, tmp=True, aside=False),
                    "written": dict(final=False, parts=True, tmp=True, aside=False),
                    "renamed": dict(final=True, parts=True, tmp=False, aside=False),
                    "removing": dict(final=True, parts=False, tmp=False, aside=True)}[step], left
    # every key was committed before the kill: the producer's own rows first, then compaction began
    committed = np.arange(spec.num_keys)
    assert np.array_equal(rows_kept(d, spec), committed)
    after_every_tool(d, spec, SMALL, first, committed)


@pytest.mark.slow
@pytest.mark.parametrize("step", ("writing", "written"))
def test_a_kill_while_compacting_out_of_core_loses_nothing(small, tmp_path, step):
    """Tables larger than the memory budget spill to a memmap inside the parts folder; a kill leaves
    it there, and the next compaction, and gc, cope with it."""
    d, spec, r = crash(small, tmp_path, SMALL, step, budget="spill")
    assert r.returncode == -signal.SIGKILL, r.stdout + r.stderr
    assert glob.glob(os.path.join(d, "*.parts", ".compact-logits.tmp"))
    after_every_tool(d, spec, SMALL, "gc", np.arange(spec.num_keys))


@pytest.mark.slow
@pytest.mark.parametrize("start,stop", [("locked", "end"), ("tmp", "written")], ids=["compaction", "writing"])
def test_a_kill_at_a_random_moment_of_compaction_loses_nothing(large, tmp_path, start, stop):
    """kill -9 at a uniformly random moment of the whole compaction (from taking its lock to the end
    of close()), or of writing the finished file (from opening its temporary file until it is
    synced), timed first on an unkilled copy; four seeds each, then every tool in turn."""
    src, spec = large
    calib = tmp_path / "calibration"
    shutil.copytree(src, calib)
    timing = last_json(py(PRODUCER, json.dumps(LARGE), path_for(str(calib), spec.fingerprint), "time", "ram"))
    assert timing["complete"] and timing[stop] - timing[start] > 0.01, timing
    shutil.rmtree(calib)
    landed = []
    for seed in range(4):
        delay = float(np.random.default_rng(seed).uniform(0.0, timing[stop] - timing[start]))
        d, spec, r = crash(large, tmp_path / f"seed{seed}", LARGE, f"timer:{start}:{delay:.4f}")
        assert r.returncode in (0, -signal.SIGKILL), r.stdout + r.stderr
        landed.append((round(delay, 3), r.returncode, what_is_left(d)))
        committed = np.arange(spec.num_keys)
        assert np.array_equal(rows_kept(d, spec), committed)
        after_every_tool(d, spec, LARGE, TOOLS[seed % len(TOOLS)], committed)
        shutil.rmtree(d)
    print(f"timing {timing}; kills landed: {landed}")
    assert sum(rc == -signal.SIGKILL for _, rc, _ in landed) >= 3, landed


def test_compaction_temporaries_of_dead_processes_go_those_of_live_ones_stay(cache_dir):
    """gc removes a compaction's temporary file once its process is dead (and the file older than
    --min-age), and an entry a dead gc renamed aside; never the temporary file of a live process."""
    fp = make_spec(tag="tmp").fingerprint
    live_proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead, live = (os.path.join(cache_dir, f"{fp}.h5.tmp-{pid}") for pid in (DEAD_PID, live_proc.pid))
    aside = os.path.join(cache_dir, f".{fp}.h5.gc-{DEAD_PID}")
    try:
        for p in (dead, live, aside):
            open(p, "wb").write(b"\x89HDF\r\n\x1a\n" + b"\0" * 100)
        r = store_cli("gc", "--cache-dir", cache_dir)
        assert r.returncode == 0 and os.path.exists(dead), "younger than --min-age: kept"
        old = time.time() - 86400
        for p in (dead, live, aside):
            os.utime(p, (old, old))
        r = store_cli("gc", "--cache-dir", cache_dir)
        assert r.returncode == 0 and not r.stderr, r.stderr
        assert not os.path.exists(dead) and not os.path.exists(aside) and os.path.exists(live), r.stdout
    finally:
        live_proc.communicate(b"")


# --- gc and live processes -------------------------------------------------------------------
def popen(code, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=ENV, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def idle_partial(cache_dir, spec, rows=10):
    """A cache in progress whose producer stopped after its first `rows` keys, idle for a day."""
    base = path_for(cache_dir, spec.fingerprint)
    w, keys = CacheWriter(base, spec), np.arange(rows)
    w.write(keys // spec.views, expected_logits(keys, spec.num_classes), views=keys % spec.views)
    w.abort()
    old = time.time() - 86400
    os.utime(base + ".parts", (old, old))
    return base


HOLD = """
import fcntl, sys
fh = open(sys.argv[1], "a+")
fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
print("held", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize("lock", ["shard-0of1.lock", schema.COMPACT_LOCK])
def test_gc_leaves_a_cache_whose_lock_a_live_process_holds(cache_dir, lock):
    spec = make_spec(tag="held")
    base = idle_partial(cache_dir, spec)
    holder = popen(HOLD, os.path.join(base + ".parts", lock), stdin=subprocess.PIPE)
    try:
        assert holder.stdout.readline().strip() == "held"
        ls = json.loads(store_cli("ls", "--cache-dir", cache_dir, "--json").stdout)
        assert ls[0]["state"] == ("producing" if lock.startswith("shard") else "incomplete")
        r = store_cli("gc", "--cache-dir", cache_dir, "--min-age", "0")
        assert r.returncode == 0 and os.path.exists(os.path.join(base + ".parts", schema.MANIFEST)), r.stdout
        if not lock.startswith("shard"):
            assert f"kept {base}: a live process holds one of its locks" in r.stdout, r.stdout
    finally:
        holder.communicate("")
    assert store_cli("gc", "--cache-dir", cache_dir, "--min-age", "0").returncode == 0
    assert not os.path.exists(base + ".parts"), "released: an idle incomplete cache is removed"


# The producer stops just before it locks its shard (or just before its flock, the lock file open)
# until gc has renamed the cache folder aside; gc waits half a second before deleting it.
RESUMING = """
import fcntl, os, sys, time, json
import kdcache.store.write.writer
from kdcache import store
from tests.helpers import make_spec, produce
base, ready, renamed, where = sys.argv[1:5]
calls = []
def pause():
    if not calls:
        open(ready, "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(renamed) and time.monotonic() < deadline:
            time.sleep(0.005)
    calls.append(1)
if where == "open":
    lock = store.write.writer.CacheWriter._lock
    def _lock(self, wait_s):
        pause()
        return lock(self, wait_s)
    store.write.writer.CacheWriter._lock = _lock
else:
    class Fcntl:
        def __getattr__(self, name):
            return getattr(fcntl, name)
        def flock(self, fd, op):
            pause()
            return fcntl.flock(fd, op)
    store.write.writer.fcntl = Fcntl()
print(json.dumps({"complete": produce(base, make_spec(tag="resumed")), "pauses": len(calls)}))
"""
GC_SLOW = """
import sys, time
import kdcache.store.files.paths
from kdcache import store
from kdcache.store.command import main
finish, renamed = store.files.paths.finish_discard, sys.argv[2]
def slow(aside):
    open(renamed, "w").close()
    time.sleep(0.5)
    finish(aside)
store.files.paths.finish_discard = slow
sys.exit(main(["gc", "--cache-dir", sys.argv[1], "--min-age", "0"]))
"""


@pytest.mark.parametrize("where", ["open", "flock"])
def test_a_producer_resuming_while_gc_renames_its_cache_aside_starts_again_cleanly(cache_dir, tmp_path, where):
    spec = make_spec(tag="resumed")
    base = idle_partial(cache_dir, spec, rows=100)
    ready, renamed = tmp_path / "ready", tmp_path / "renamed"
    prod = popen(RESUMING, base, ready, renamed, where)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert prod.poll() is None and time.monotonic() < deadline, prod.communicate()
        time.sleep(0.01)
    gc = popen(GC_SLOW, cache_dir, renamed)
    out, err = prod.communicate(timeout=120)
    gc_out, gc_err = gc.communicate(timeout=120)
    assert prod.returncode == 0 and not err, err
    res = json.loads(out.strip().splitlines()[-1])
    assert res["complete"] and res["pauses"] >= 2, res  # its first try found the folder gone, and it tried again
    assert gc.returncode == 0 and f"removed {base} (incomplete" in gc_out, gc_out + gc_err
    assert sorted(os.listdir(cache_dir)) == [spec.fingerprint + ".h5"]
    with CacheReader(base, spec=spec) as r:
        assert np.array_equal(r.get(np.arange(spec.num_samples)), expected_logits(np.arange(spec.num_samples), 10))

