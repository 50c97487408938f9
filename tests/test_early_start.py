"""The producer python -m kdcache.trainer starts first: held until the plan names the cache, ended unused
when the plan needs none, and a ring producer that never attaches named at once."""
import glob
import json
import os
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from tests.conftest import ROOT
from tests.helpers import CHILD_ENV

ENV = CHILD_ENV
DATA = "synthetic:n=700,classes=10,shape=1x8x8"


def held(teacher, cache_dir, *extra):
    return subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--json", "--teacher", teacher,
                             "--dataset", DATA, "--batch-size", "64", "--epochs", "2", "--cache-dir", str(cache_dir),
                             "--online", "--hold", *extra], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)


def fingerprint(teacher):
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.pipeline.teacher_files import teacher_identity
    from kdcache.pipeline.datasets import load_dataset
    return build_spec(teacher_identity(teacher), load_dataset(DATA)).fingerprint


def test_a_held_producer_fills_the_cache_it_is_named_as_an_ordinary_one_does(teacher, tmp_path):
    from kdcache.store import CacheReader, path_for
    fp = fingerprint(teacher)
    p = held(teacher, tmp_path / "unused")
    time.sleep(0.5)
    assert p.poll() is None and not (tmp_path / "unused").exists()  # nothing opened while held
    base = str(tmp_path / "named" / fp)
    out, err = p.communicate(json.dumps({"cache": base, "fingerprint": fp}) + "\n", timeout=300)
    assert p.returncode == 0, err[-2000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["complete"] and res["rows_written"] == res["teacher_forwards"] == 700
    assert res["cache_path"] == base + ".h5" and not (tmp_path / "unused").exists()
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--teacher", teacher, "--dataset", DATA,
                        "--batch-size", "64", "--epochs", "2", "--cache-dir", str(tmp_path / "plain"), "--online"],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    keys = np.arange(700)
    with CacheReader(base) as a, CacheReader(path_for(str(tmp_path / "plain"), fp)) as b:
        assert np.array_equal(a.get(keys, wait=False), b.get(keys, wait=False))


def test_a_held_producer_ends_with_nothing_written_at_end_of_input(teacher, tmp_path):
    p = held(teacher, tmp_path / "c")
    out, err = p.communicate("", timeout=300)
    assert p.returncode == 0 and "nothing written" in err, err[-2000:]
    assert not (tmp_path / "c").exists() and not out.strip()


@pytest.mark.parametrize("line,says", [('{"cache": "X", "fingerprint": "0123abcd"}', "0123abcd"),
                                       ("go\n", "not one JSON line"), ('{"cache": 3}', "not one JSON line")])
def test_a_held_producer_named_another_cache_refuses_in_one_line(teacher, tmp_path, line, says):
    p = held(teacher, tmp_path / "c")
    _, err = p.communicate(line.replace("X", str(tmp_path / "c" / "x")) + "\n", timeout=300)
    assert p.returncode == 2 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: --hold:") and says in last
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("extra", [[], ["--online", "--ring", "r1"], ["--online", "--cache", "x"],
                                   ["--online", "--shards", "2"]])
def test_hold_is_refused_where_it_means_nothing(teacher, tmp_path, extra):
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--teacher", teacher, "--dataset", DATA, "--hold",
                        "--cache-dir", str(tmp_path), *extra], capture_output=True, text=True, env=ENV, cwd=ROOT,
                       timeout=120)
    assert r.returncode == 2 and "argument --hold" in r.stderr.strip().splitlines()[-1]


def _args(teacher, tmp_path, *extra):
    from kdcache.trainer.options import parse_args
    args = parse_args(["--teacher", teacher, "--dataset", DATA, "--batch-size", "64", "--epochs", "1",
                       "--runs-dir", str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "c"), "--run", "r", *extra])
    args.run_name = args.run
    return args


def test_the_producer_starts_before_the_plan_and_fills_the_cache_the_plan_names(teacher, tmp_path, monkeypatch):
    import kdcache.pipeline.datasets
    from kdcache import pipeline
    from kdcache.trainer.run_plan import make_plan
    from kdcache.trainer.targets import Targets

    def no_data(*a, **k):
        raise AssertionError("the data set was loaded before the producer started")
    args = _args(teacher, tmp_path)
    monkeypatch.setattr(pipeline.datasets, "load_dataset", no_data)
    early = Targets.start(args, str(tmp_path / "runs" / "r"), 1, 2)
    monkeypatch.undo()
    try:
        assert early.held and early.producer.poll() is None
        plan = make_plan(args)
        early.settle(args, plan)
        assert not early.held and early.producer.wait(timeout=300) == 0
        assert plan.complete and json.load(open(tmp_path / "runs" / "r" / "producer.json"))["rows_written"] == 700
    finally:
        early.close()


def test_a_held_producer_the_plan_does_not_need_is_ended_at_once(teacher, tmp_path):
    from kdcache.trainer.targets import Targets
    args = _args(teacher, tmp_path)
    for plan in (types.SimpleNamespace(complete=True, base=str(tmp_path / "c" / "x")), None):
        early = Targets.start(args, str(tmp_path / "runs" / "r"), 1, 2)
        proc = early.producer
        t = time.monotonic()
        if plan is not None:
            early.settle(args, plan)  # the cache is complete: no producer
        else:
            early.close()  # the trainer failed before its plan
        assert proc.poll() is not None and time.monotonic() - t < 5
        assert early.producer is None or early.producer.poll() is not None
        assert not glob.glob(str(tmp_path / "c" / "*"))
    assert Targets.start(args, str(tmp_path / "runs" / "r"), 1, 1) == Targets()  # one core: nothing to overlap


def test_a_ring_producer_that_exits_before_attaching_is_named_at_once(tmp_path):
    from kdcache.pipeline.schedule import schedule
    from kdcache.store.ring import RingReader, RingWriter
    from kdcache.trainer.errors import TrainError
    from kdcache.trainer.targets import ring_targets
    st = next(schedule(0, 1, 8, 4, 1))
    name = f"kdcache-ring-test-{os.getpid()}"
    log = tmp_path / "producer.log"
    log.write_text("error: the teacher predicts 3 classes, data set synthetic has 10\n")
    gone = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(2)"])
    gone.wait()
    with RingReader(name, create=True, capacity=16, num_classes=10, timeout=60) as ring:
        t = time.monotonic()
        with pytest.raises(TrainError, match="exited before it attached.*predicts 3 classes"):
            ring_targets(ring, gone, str(log), 60)(st)
        assert time.monotonic() - t < 10
    # one that attached, wrote every row and left before the first read: its rows are read
    with RingReader(name, create=True, capacity=16, num_classes=10, timeout=60) as ring:
        want = np.arange(40, dtype=np.float32).reshape(4, 10)
        with RingWriter(name, create=False) as w:
            w.write(st.indices, np.full(4, st.epoch), want)
            done = subprocess.Popen([sys.executable, "-c", "pass"])
            done.wait()
        assert np.array_equal(ring_targets(ring, done, str(log), 60)(st), want)


def test_the_reader_opens_as_soon_as_a_live_producer_creates_the_cache(tmp_path):
    """A trainer that gets to its cache before its producer has created it opens it once it is
    there, not after asking the live producer how it exited (which gives it seconds to exit)."""
    import threading
    from kdcache.store import CacheWriter, path_for
    from tests.helpers import make_spec
    from kdcache.trainer.targets import open_reader
    spec = make_spec(num_samples=64)
    base = path_for(str(tmp_path), spec.fingerprint)
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    writers = []
    timer = threading.Timer(0.5, lambda: writers.append(CacheWriter(base, spec)))
    try:
        t = time.monotonic()
        timer.start()
        reader = open_reader(types.SimpleNamespace(wait_timeout=10), types.SimpleNamespace(base=base, spec=spec),
                             live, 0, str(tmp_path / "producer.log"))
        took = time.monotonic() - t
        reader.close()
        assert live.poll() is None and took < 3, took
    finally:
        timer.join()
        for w in writers:
            w.abort()
        live.kill()
        live.wait()
