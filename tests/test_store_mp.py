"""The store across processes: live readers, kill -9 of the producer, resume, liveness."""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader, ProducerGoneError, path_for
from kdcache.store.format import schema
from kdcache.store.folder.registry import final_path, parts_path, verify
from tests.conftest import ROOT
from tests.helpers import expected_logits, make_spec, produce

ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}


def helper(*args, **kw):
    return subprocess.Popen([sys.executable, "-m", "tests.helpers", *map(str, args)], env=ENV,
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def spec_args(spec):
    return ["--num-samples", spec.num_samples, "--num-classes", spec.num_classes, "--views", spec.views,
            "--codec", spec.codec, "--dtype", spec.dtype]


@pytest.mark.slow
def test_two_reader_processes_verify_every_row_while_the_producer_writes(cache_dir):
    spec = make_spec(num_samples=3000, num_classes=20, views=2, codec="full", dtype="float16")
    p = path_for(cache_dir, spec.fingerprint)
    readers = [helper("follow", "--path", p, *spec_args(spec)) for _ in range(2)]
    time.sleep(0.3)
    prod = helper("produce", "--path", p, "--batch", 50, "--delay", 0.01, *spec_args(spec))
    out, err = prod.communicate(timeout=120)
    assert prod.returncode == 0, err
    assert out.strip() == "complete"
    for r in readers:
        out, err = r.communicate(timeout=120)
        assert r.returncode == 0, err
        res = json.loads(out.strip().splitlines()[-1])
        assert res == {"verified": spec.num_keys, "mismatched": 0, "complete": True}


def _committed_rows_are_right(p, spec):
    """After a crash: the cache opens, and every row marked done is exactly the teacher's."""
    with CacheReader(p, spec=spec) as r:
        done = np.flatnonzero(r._done)
        if done.size:
            got = r.get(done // spec.views, views=done % spec.views, wait=False)
            assert np.array_equal(got, expected_logits(done, spec.num_classes))
        return done.size


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_is_bitwise_equal(cache_dir, tmp_path):
    spec = make_spec(num_samples=6000, num_classes=16, views=1)
    clean = path_for(str(tmp_path), spec.fingerprint)
    assert produce(clean, spec, batch=40, seed=1)
    p = path_for(cache_dir, spec.fingerprint)
    rng = np.random.default_rng(1234)
    kills, progress = 0, []
    while kills < 12:
        prod = helper("produce", "--path", p, "--batch", 10, "--delay", 0.01, "--seed", kills, *spec_args(spec))
        time.sleep(float(rng.uniform(0.3, 1.2)))  # start-up included: kills land anywhere
        if prod.poll() is not None:
            out, err = prod.communicate()
            assert prod.returncode == 0, err
            break
        prod.send_signal(signal.SIGKILL)
        prod.wait()
        kills += 1
        if os.path.exists(final_path(p)):  # the kill came after it finished the cache, before it exited
            assert verify(p)[1] == [], "a killed producer left a finished cache with wrong rows"
            break
        progress.append(_committed_rows_are_right(p, spec))
    assert kills >= 10, f"the producer finished after {kills} kills: slow it down"
    assert progress[-1] > 0
    prod = helper("produce", "--path", p, "--batch", 40, *spec_args(spec))
    out, err = prod.communicate(timeout=120)
    assert prod.returncode == 0 and out.strip() == "complete", err
    assert verify(p)[1] == []
    with h5py.File(final_path(clean)) as a, h5py.File(final_path(p)) as b:
        for name in (schema.LOGITS, schema.DONE):
            assert a[name][...].tobytes() == b[name][...].tobytes()


@pytest.mark.slow
def test_reader_waiting_on_a_killed_producer_errors_within_seconds(cache_dir):
    spec = make_spec(num_samples=100000, num_classes=10)
    p = path_for(cache_dir, spec.fingerprint)
    prod = helper("produce", "--path", p, "--batch", 10, "--delay", 0.05, *spec_args(spec))
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(parts_path(p), schema.MANIFEST)):  # the lock comes first
        assert time.monotonic() < deadline
        time.sleep(0.05)
    r = CacheReader(p, spec=spec, grace_s=0.0)
    r.get([int(np.random.default_rng(0).permutation(100000)[0])], timeout=30)  # alive: it waits and gets it
    prod.send_signal(signal.SIGKILL)
    t = time.monotonic()
    with pytest.raises(ProducerGoneError, match="no producer is running"):
        r.get(np.arange(100000), timeout=60)
    assert time.monotonic() - t < 5
    prod.wait()
    r.close()


def test_the_producer_lock_is_released_by_a_kill(cache_dir):
    spec = make_spec(num_samples=100000)
    p = path_for(cache_dir, spec.fingerprint)
    prod = helper("produce", "--path", p, "--batch", 10, "--delay", 0.05, *spec_args(spec))
    deadline = time.monotonic() + 30
    from kdcache.store.files.segment import lock_holders
    while not lock_holders(parts_path(p)):
        assert time.monotonic() < deadline and prod.poll() is None
        time.sleep(0.05)
    second = helper("produce", "--path", p, *spec_args(spec))
    _, err = second.communicate(timeout=60)
    assert second.returncode != 0 and "another producer" in err
    prod.send_signal(signal.SIGKILL)
    prod.wait()
    assert lock_holders(parts_path(p)) == []
