"""Decode workers: the producer's images made in worker processes are the in-process images, bit for bit;
a damaged photo, a killed worker and a stop are each one line, with the rows before kept and no process left."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import CHILD_ENV, ROOT, gluon_teacher

PHOTOS, BATCH = 48, 16
COMMON = ("--image-size", "40x40", "--augment", "rrc:8,flip", "--batch-size", BATCH, "--dtype", "float32")


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """48 JPEG photos of 300-500 px (bench.decode's set), a RecordIO of their first 24, and a teacher for 3x8x8."""
    from bench.decode.photos import make_photos
    d = tmp_path_factory.mktemp("photos")
    make_photos(str(d / "folder"), PHOTOS)
    from tests.datafiles import write_rec
    from kdcache.pipeline.images import ImageFolderDataset
    items = ImageFolderDataset(str(d / "folder"), "train", (40, 40)).items[:24]
    from PIL import Image
    imgs = [np.asarray(Image.open(p).convert("RGB")) for p, _ in items]
    write_rec(str(d / "p.rec"), imgs, [lab for _, lab in items])
    gluon_teacher(str(d / "t"), classes=10, in_ch=3)
    (d / "slowaug.py").write_text("import time\n\ndef slow(image, rng):\n    time.sleep(0.05)\n    return image\n")
    return d


def producer(photos, cache_dir, *args, check=True, **kw):
    env = dict(CHILD_ENV, PYTHONPATH=os.pathsep.join([ROOT, str(photos)]))
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--json", "--dataset", "imagefolder",
                        "--data-root", str(photos / "folder"), "--teacher", str(photos / "t"), "--cache-dir",
                        str(cache_dir), *map(str, COMMON), *map(str, args)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, **kw)
    if check:
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


@pytest.mark.parametrize("kind", ["imagefolder", "recordio"])
def test_workers_make_the_in_process_images_bit_for_bit(photos, kind):
    """Keys -> images through 1 and 3 workers, batches asked for ahead and taken out of order, equal
    make_views in this process byte for byte (rrc with flip: every key its own crop)."""
    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.decode_workers import Decoder
    root = photos / ("folder" if kind == "imagefolder" else "p.rec")
    ds = load_dataset(kind, data_root=str(root), image_size=(40, 40))
    aug = Augment.parse("rrc:8,flip")
    idx = np.random.default_rng(3).permutation(len(ds))
    views = np.arange(len(ds)) % 3
    want = make_views(ds, idx, views, seed=7, augment=aug)[0]
    for workers in (1, 3):
        with Decoder(ds, seed=7, augment=aug, workers=workers) as d:
            tickets = [d.submit(idx[a:a + 10], views[a:a + 10]) for a in range(0, len(ds), 10)]
            got = [None] * len(tickets)
            for t in tickets[2:] + tickets[:2]:  # a later batch first: the earlier ones are kept for their turn
                got[t], finite = d.take(t)
                assert finite.all() and finite.shape == (len(got[t]),)
        assert np.concatenate(got).tobytes() == want.tobytes()


class Frames:
    """A data set in RAM, of images [3, 6, 5] with NaN in some: what a worker makes of it is plain."""
    name, decodes = "frames", True

    def __init__(self, n=23, nan=(3, 7, 20)):
        self.x = np.random.default_rng(0).random((n, 3, 6, 5), dtype=np.float32)
        self.x[list(nan), 1, 2, 3] = np.nan
        self.nan = np.isin(np.arange(n), nan)

    def __len__(self):
        return len(self.x)

    def get_batch(self, indices):
        return self.x[np.asarray(indices)], np.zeros(len(indices), dtype=np.int64)


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_take_gives_the_images_and_which_are_finite_and_kept_batches_outlive_the_slots(workers):
    """Every take() equals make_views and names the images with NaN (judged in the workers); a batch
    read before its turn is a copy that outlives its slot being written again; a batch taken in its
    turn is the arena itself, read-only (valid until the next submit)."""
    from kdcache.pipeline.augment import Augment
    from kdcache.pipeline.decode_workers import SLOTS, Decoder
    ds, aug = Frames(), Augment.parse("flip")
    batches = [np.arange(a, min(a + 5, len(ds))) for a in range(0, len(ds), 5)]
    want = [aug.apply(ds.x[b], 3, b, 1) for b in batches]
    with Decoder(ds, seed=3, augment=aug, workers=workers) as d:
        first = d.submit(batches[0], 1)
        early, _ = d.take(d.submit(batches[1], 1))  # batch 0 is read now, kept for its turn
        assert early.tobytes() == want[1].tobytes()
        later = [d.submit(b, 1) for b in batches[2:]]  # SLOTS - 1 more: batch 0's slot is written again
        assert len(later) >= SLOTS - 1
        for t, b, w in zip(later + [first], batches[2:] + batches[:1], want[2:] + want[:1]):  # batch 0 last
            x, finite = d.take(t)
            assert x.tobytes() == w.tobytes(), t
            assert np.array_equal(finite, ~ds.nan[b])
            if workers and t != first:
                assert not x.flags.writeable  # the arena: the producer only reads it


def test_a_batch_too_large_for_a_slot_comes_whole_through_the_pipe(monkeypatch):
    """Chunks that do not fit their slot (SLOT_BYTES made small here) come through the pipe; the batch
    is whole and in order, whichever of its chunks fit."""
    from kdcache.pipeline import decode_workers as decode
    from kdcache.pipeline.augment import Augment
    ds = Frames(nan=())
    row = ds.x[0].nbytes
    for slot_rows in (0, 6, 12):  # nothing fits, the first worker's chunk fits, two of three fit
        monkeypatch.setattr(decode, "SLOT_BYTES", max(slot_rows * row, 8))
        with decode.Decoder(ds, seed=0, augment=Augment(), workers=3) as d:
            x, finite = d.take(d.submit(np.arange(18), 0))
        assert x.tobytes() == ds.x[:18].tobytes() and finite.all(), slot_rows


@pytest.mark.parametrize("mode", [(), ("--online", "--epochs", 2)])
def test_cache_with_workers_equals_cache_without(photos, tmp_path, mode):
    from kdcache.store import CacheReader
    outs = [producer(photos, tmp_path / f"c{w}", "--views", 2, "--decode-workers", w, *mode) for w in (0, 2)]
    assert outs[0]["fingerprint"] == outs[1]["fingerprint"] and outs[1]["complete"]
    keys = np.arange(PHOTOS)
    rows = []
    for out in outs:
        with CacheReader(out["cache_path"]) as r:
            rows.append(np.concatenate([r.get(keys, v) for v in (0, 1)]))
    assert rows[0].tobytes() == rows[1].tobytes()


def test_default_workers_follow_the_cores_the_teacher_leaves(photos):
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.decode_workers import default_workers
    files = load_dataset("imagefolder", data_root=str(photos / "folder"), image_size=(40, 40))
    assert default_workers(files, 1, 2) == 1 and default_workers(files, 3, 8) == 5
    assert default_workers(files, 2, 2) == 0 and default_workers(files, 1, 4, producers=4) == 0
    assert default_workers(load_dataset("digits"), 1, 8) == 0  # in RAM: made in the producer's process


def test_a_damaged_photo_in_a_worker_is_one_line_naming_it_and_rows_before_are_kept(photos, tmp_path):
    import shutil
    from kdcache.store.folder.registry import cache_bases, info
    shutil.copytree(photos, tmp_path / "p")
    from kdcache.pipeline.datasets import load_dataset
    items = load_dataset("imagefolder", data_root=str(tmp_path / "p" / "folder"), image_size=(40, 40)).items
    bad = items[40][0]  # in the third batch
    data = open(bad, "rb").read()
    open(bad, "wb").write(data[:len(data) // 2])
    r = producer(tmp_path / "p", tmp_path / "c", "--decode-workers", 2, check=False)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and bad in last and "truncated JPEG" in last, r.stderr
    assert "Traceback" not in r.stderr
    (base,) = cache_bases(str(tmp_path / "c"))
    assert info(base)["done"] == pytest.approx(2 * BATCH / PHOTOS)  # the two batches before it


def children_of(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as fh:
            return [int(c) for c in fh.read().split()]
    except OSError:
        return []


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def start_slow(photos, cache_dir):
    """A producer whose 2 workers take 50 ms per image (the user's augmentation sleeps), in its own
    session (a terminal's Ctrl-C reaches its whole group); (process, worker pids) once both work."""
    env = dict(CHILD_ENV, PYTHONPATH=os.pathsep.join([ROOT, str(photos)]))
    p = subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--dataset", "imagefolder",
                          "--data-root", str(photos / "folder"), "--teacher", str(photos / "t"), "--cache-dir",
                          str(cache_dir), "--image-size", "8x8", "--augment", "slowaug:slow", "--batch-size", str(BATCH),
                          "--decode-workers", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(children_of(p.pid)) < 2:
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()[1]
        time.sleep(0.02)
    time.sleep(0.3)  # inside their first chunks
    return p, children_of(p.pid)


@pytest.mark.parametrize("how,status,word", [("group-sigint", 130, "interrupted"), ("sigterm", 143, "SIGTERM")])
def test_a_stop_ends_the_workers_cleanly(photos, tmp_path, how, status, word):
    p, workers = start_slow(photos, tmp_path / "c")
    if how == "group-sigint":
        os.killpg(p.pid, signal.SIGINT)  # Ctrl-C at a terminal: the producer and its workers get it
    else:
        p.send_signal(signal.SIGTERM)
    _, err = p.communicate(timeout=60)
    assert p.returncode == status, err
    assert word in err.strip().splitlines()[-1] and "Traceback" not in err, err
    assert not any(alive(w) for w in workers)


def test_a_worker_killed_is_one_line_and_no_process_is_left(photos, tmp_path):
    p, workers = start_slow(photos, tmp_path / "c")
    os.kill(workers[1], signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 2, err
    last = err.strip().splitlines()[-1]
    assert f"decode worker process {workers[1]} was killed by signal 9 (SIGKILL)" in last and "Traceback" not in err
    assert not any(alive(w) for w in workers)


def test_the_workers_die_with_a_producer_killed_by_9(photos, tmp_path):
    p, workers = start_slow(photos, tmp_path / "c")
    p.kill()
    p.communicate(timeout=60)
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)


# --- the decode benchmark --------------------------------------------------------------------
def test_the_docs_decode_table_is_made_from_the_report():
    """docs/images.md's block is what bench.docs makes of bench/results/decode.json, a full run's."""
    from bench.docs import benchmark_block
    results = os.path.join(ROOT, "bench", "results")
    report = json.load(open(os.path.join(results, "decode.json")))
    assert not report["quick"] and report["photos"] >= 1000
    text = open(os.path.join(ROOT, "docs", "images.md")).read()
    block = text.split("<!-- generated: bench.decode (python -m bench.docs) -->\n")[1].split(
        "<!-- end: bench.decode -->")[0]
    assert block.strip() == benchmark_block("bench.decode", results).strip()


def test_the_photo_set_is_deterministic(tmp_path):
    from bench.decode.photos import make_photos
    make_photos(str(tmp_path / "a"), 6)
    make_photos(str(tmp_path / "b"), 6)
    files = sorted(p.relative_to(tmp_path / "a") for p in (tmp_path / "a").rglob("*.jpg"))
    assert len(files) == 6 and all((tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()
                                   for f in files)
    from PIL import Image
    assert all(300 <= max(Image.open(tmp_path / "a" / f).size) <= 500 for f in files)


@pytest.mark.slow
def test_bench_decode_quick(tmp_path):
    from tests.helpers import positive, run_bench
    from bench.decode.run import table
    (tmp_path / "results").mkdir()  # run_bench's --out: a file in a folder that exists
    proc, report = run_bench("decode", tmp_path)
    assert report["quick"] and report["photos"] == 64
    t = report["teachers"]["mobilenet1.0"]
    assert all(positive(t[k]) for k in ("teacher_alone", "teacher_beside_decoding", "producer_serial",
                                        "producer_workers"))
    assert positive(report["decode"]["kdcache_ms"]) and positive(report["peak"]["gflops"])
    assert report["cpu"]["model_name"] and report["cores"] >= 1 and report["load_before"]
    assert table(report).splitlines()[0] in proc.stdout
