"""One reader shared by threads: a thread_pool DataLoader over SoftTargetDataset, and plain threads
over a CacheReader, on a cache a producer process is still writing (and compacts at the end). Every
target returned is the teacher's row for its key; no thread fails.

Each run is under a second; KDCACHE_TORTURE=1 repeats them many more times."""
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from kdcache.store import CacheReader, path_for
from tests.helpers import CHILD_ENV, ROOT, expected_logits, make_spec

TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"
RUNS = 200 if TORTURE else 20
N, C = 600, 10


def start_producer(tmp_path, name, seed, views=1):
    """A producer process writing N samples in small batches, slowly enough to be read while it
    writes; returns (process, cache path, spec) once its first rows are committed."""
    spec = make_spec(num_samples=N, num_classes=C, views=views)  # the spec tests.helpers produce builds
    d = tmp_path / name
    d.mkdir()
    p = path_for(str(d), spec.fingerprint)
    progress = d / "progress"
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers", "produce", "--path", p, "--num-samples", str(N),
                             "--num-classes", str(C), "--views", str(views), "--batch", "12", "--delay", "0.002",
                             "--seed", str(seed), "--progress-file", str(progress)],
                            cwd=ROOT, env=CHILD_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (progress.exists() and progress.read_text()):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.005)
    return proc, p, spec


def finish(proc):
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]


class Items:
    """A data set of N (image, label) items: the label is the index."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        return np.zeros((1, 2, 2), dtype=np.float32), i


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:SoftTargetDataset. waited")  # reading in an order not announced, on purpose
@pytest.mark.parametrize("budget", [None, 0], ids=["ram", "disk"])
def test_a_thread_pool_dataloader_reads_a_cache_being_written(tmp_path, budget):
    from mxnet import gluon

    from kdcache.trainer import SoftTargetDataset
    want = expected_logits(np.arange(N), C)
    for run in range(RUNS // 2):
        proc, p, spec = start_producer(tmp_path, f"{budget}-{run}", run)
        try:
            ds = SoftTargetDataset(Items(), p, timeout=30, memory_budget=budget)
            loader = gluon.data.DataLoader(ds, batch_size=8, shuffle=True, num_workers=4, thread_pool=True)
            seen = 0
            for _, label, soft in loader:
                idx = label.asnumpy().astype(np.int64)
                assert np.array_equal(soft.asnumpy(), want[idx]), f"run {run}: wrong targets"
                seen += idx.size
            assert seen == N
        finally:
            finish(proc)


@pytest.mark.parametrize("budget,views", [(None, 1), (0, 1), (None, 2), (0, 2)],
                         ids=["ram", "disk", "ram-views", "disk-views"])
def test_threads_sharing_one_reader_of_a_cache_being_written(tmp_path, budget, views):
    runs = max(1, RUNS // 4)
    for run in range(runs):
        proc, p, spec = start_producer(tmp_path, f"{budget}-{views}-{run}", run, views)
        want = expected_logits(np.arange(spec.num_keys), C)
        errors, counts = [], []
        try:
            r = CacheReader(p, spec=spec, timeout=30, memory_budget=budget)

            def read(t):
                try:
                    order = np.random.default_rng([run, t]).permutation(spec.num_keys)
                    n = 0
                    for a in range(0, order.size, 5):
                        keys = order[a:a + 5]
                        got = r.get(keys // views, keys % views if views > 1 else 0)
                        if not np.array_equal(got, want[keys]):
                            errors.append(f"thread {t}: wrong targets for keys {keys.tolist()}")
                            return
                        n += keys.size
                    counts.append(n)
                except Exception as e:  # reported below, with the run
                    errors.append(f"thread {t}: {type(e).__name__}: {e}")

            threads = [threading.Thread(target=read, args=(t,)) for t in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            r.close()
        finally:
            finish(proc)
        assert not errors, f"run {run}: {errors[:3]}"
        assert counts == [spec.num_keys] * len(threads)
