"""cache_builder: teacher loading, cache contents, reuse, resume after kill -9, shards, bad input."""
import json
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, gluon_teacher

ENV = CHILD_ENV


def module_teacher(prefix, classes=10, epoch=1):
    """A Module API checkpoint ending in SoftmaxOutput (save_checkpoint)."""
    import mxnet as mx
    data = mx.sym.var("data")
    fc = mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=classes, name="fc")
    mod = mx.mod.Module(mx.sym.SoftmaxOutput(fc, name="softmax"), data_names=["data"], label_names=["softmax_label"])
    mod.bind(data_shapes=[("data", (2, 1, 8, 8))], label_shapes=[("softmax_label", (2,))])
    mod.init_params(mx.init.Xavier())
    mod.save_checkpoint(prefix, epoch)
    arg, _ = mod.get_params()
    return arg["fc_weight"].asnumpy(), arg["fc_bias"].asnumpy()


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    d = tmp_path_factory.mktemp("teachers")
    out = {"gluon": str(d / "g"), "module": str(d / "m"), "other": str(d / "o"), "c3": str(d / "c3"),
           "nan": str(d / "nan"), "vec": str(d / "vec")}
    out["net"] = gluon_teacher(out["gluon"])
    out["fc"] = module_teacher(out["module"])
    gluon_teacher(out["other"], seed=1)
    gluon_teacher(out["c3"], classes=3)
    import mxnet as mx
    # a teacher whose output is NaN: log of a negative number
    x = mx.sym.var("data")
    fc = mx.sym.FullyConnected(mx.sym.flatten(x), num_hidden=10, name="fc")
    mx.sym.log(fc * 0 - 1).save(out["nan"] + "-symbol.json")
    mx.nd.save(out["nan"] + "-0000.params", {"arg:fc_weight": mx.nd.ones((10, 64)), "arg:fc_bias": mx.nd.zeros(10)})
    # a teacher whose output is not [batch, classes]
    conv = mx.sym.Convolution(x, num_filter=2, kernel=(3, 3), name="cv")
    conv.save(out["vec"] + "-symbol.json")
    mx.nd.save(out["vec"] + "-0000.params", {"arg:cv_weight": mx.nd.ones((2, 1, 3, 3)), "arg:cv_bias": mx.nd.zeros(2)})
    return out


def cli(*args, check=True):
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--json", *map(str, args)],
                       capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    if check:
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


# --- teacher -----------------------------------------------------------------------------
def test_gluon_export_round_trip(teachers):
    import mxnet as mx
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline import load_dataset
    x, _ = load_dataset("digits").get_batch(np.arange(16))
    t = Teacher(teachers["gluon"])
    assert t.epoch == 0 and t.input_name == "data"
    assert np.allclose(t.forward(x), teachers["net"](mx.nd.array(x)).asnumpy(), atol=1e-5)


def test_module_checkpoint_round_trip_gives_logits_not_softmax(teachers):
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline import load_dataset
    x, _ = load_dataset("digits").get_batch(np.arange(16))
    t = Teacher(teachers["module"])  # latest epoch found: 1
    w, b = teachers["fc"]
    assert t.epoch == 1 and "SoftmaxOutput" in t.output_note
    assert np.allclose(t.forward(x), x.reshape(16, -1) @ w.T + b, atol=1e-4)


def test_teacher_preprocessing_is_applied_and_part_of_the_identity(teachers):
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.pipeline.teacher import load_teacher
    from kdcache.pipeline import load_dataset
    x, _ = load_dataset("digits").get_batch(np.arange(4))
    p_opt, n_opt = TeacherOptions(teachers["gluon"]), TeacherOptions(teachers["gluon"], mean=[0.5], std=[0.25])
    plain, norm = load_teacher(p_opt, 4), load_teacher(n_opt, 4)
    assert np.allclose(norm.forward(x), plain.forward((x - 0.5) / 0.25), atol=1e-5)
    assert p_opt.identity() != n_opt.identity()


@pytest.mark.parametrize("case,match", [
    ("missing", "not found"), ("no-params", "no parameter file"), ("bad-epoch", "not found"),
    ("corrupt-json", "not a readable MXNet symbol"), ("corrupt-params", "not a readable MXNet parameter"),
])
def test_bad_teacher_files(teachers, tmp_path, case, match):
    import shutil
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline.teacher_files import TeacherError
    p = str(tmp_path / "t")
    if case != "missing":
        shutil.copy(teachers["gluon"] + "-symbol.json", p + "-symbol.json")
        if case != "no-params":
            shutil.copy(teachers["gluon"] + "-0000.params", p + "-0000.params")
    if case == "corrupt-json":
        open(p + "-symbol.json", "w").write("{ not json")
    if case == "corrupt-params":
        with open(p + "-0000.params", "r+b") as fh:
            fh.truncate(40)
    with pytest.raises(TeacherError, match=match):
        Teacher(p, 7 if case == "bad-epoch" else None)
    r = cli("--teacher", p + (":7" if case == "bad-epoch" else ""), "--cache-dir", tmp_path / "c", check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and "Traceback" not in r.stderr


@pytest.mark.parametrize("which,match", [("c3", "predicts 3 classes"), ("nan", "NaN or Inf"),
                                         ("vec", r"not \[batch, classes\]")])
def test_unusable_teacher_outputs_are_refused_and_nothing_is_cached(teachers, tmp_path, which, match):
    r = cli("--teacher", teachers[which], "--cache-dir", tmp_path, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()[-1]) > 20
    import re
    assert re.search(match, r.stderr), r.stderr
    from kdcache.store.folder.registry import cache_bases, info
    for b in cache_bases(str(tmp_path)):
        assert info(b)["done"] == 0.0


# --- producing ---------------------------------------------------------------------------
def test_cache_equals_the_teacher_outputs_and_is_reused(teachers, tmp_path):
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline import load_dataset
    from kdcache.store import CacheReader
    out = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, "--dtype", "float32", "--batch-size", 100)
    ds = load_dataset("digits")
    assert out["complete"] and out["rows_written"] == len(ds) == out["teacher_forwards"]
    direct = Teacher(teachers["gluon"]).forward(ds.get_batch(np.arange(len(ds)))[0])
    with CacheReader(out["cache_path"]) as r:
        assert r.fingerprint == out["fingerprint"]
        assert np.allclose(r.get(np.arange(len(ds))), direct, atol=1e-5)
    again = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, "--dtype", "float32")
    assert again["reused"] and again["teacher_forwards"] == 0 and again["fingerprint"] == out["fingerprint"]


def test_views_hold_the_teacher_output_of_each_augmented_view(teachers, tmp_path):
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline import Augment, load_dataset, make_views
    from kdcache.store import CacheReader
    out = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, "--views", 3, "--augment", "crop:2,flip",
              "--seed", 5, "--dtype", "float32")
    ds, t = load_dataset("digits"), Teacher(teachers["gluon"])
    idx = np.array([0, 7, 100, 1437])
    with CacheReader(out["cache_path"]) as r:
        for v in range(3):
            x, _ = make_views(ds, idx, v, seed=5, augment=Augment.parse("crop:2,flip"))
            assert np.allclose(r.get(idx, v), t.forward(x), atol=1e-5)
        assert not np.allclose(r.get(idx, 0), r.get(idx, 1))


@pytest.mark.slow
def test_fingerprint_follows_teacher_data_views_codec_not_seed_or_schedule(teachers, tmp_path):
    fp = lambda *a: cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, *a)["fingerprint"]
    base = fp()
    assert fp("--seed", 3, "--batch-size", 7) == base, "views=1 without augmentation ignores seed and batch"
    assert fp("--online", "--epochs", 2) == base
    others = {fp("--views", 2), fp("--codec", "topk:3"), fp("--dtype", "float32"),
              cli("--teacher", teachers["other"], "--cache-dir", tmp_path)["fingerprint"],
              fp("--dataset", "synthetic:n=300,classes=10,shape=1x8x8"), fp("--views", 2, "--seed", 1)}
    assert base not in others and len(others) == 6


def test_online_follows_the_schedule_and_stops_when_complete(teachers, tmp_path):
    """With 2 views, epochs 0 and 1 fill the cache; the rows appear in schedule order."""
    out = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, "--online", "--views", 2, "--epochs", 5,
              "--batch-size", 64, "--seed", 3)
    assert out["complete"] and out["rows_written"] == 2 * 1438 == out["teacher_forwards"]


def test_online_writes_in_training_order(teachers, tmp_path):
    from kdcache.cache_builder.produce import CacheSink, produce_online
    from kdcache.pipeline.teacher import Teacher
    from kdcache.pipeline import load_dataset
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.pipeline.teacher_files import teacher_identity
    from kdcache.pipeline.schedule import schedule
    from kdcache.store import CacheWriter, path_for
    ds = load_dataset("digits")
    spec = build_spec(teacher_identity(teachers["gluon"]), ds)
    w = CacheWriter(path_for(str(tmp_path), spec.fingerprint), spec)
    from kdcache.pipeline import Augment
    produce_online(Teacher(teachers["gluon"]), ds, CacheSink(w), seed=9, augment=Augment(), batch_size=50,
                   epochs=1, progress=False)
    with h5py.File(w.segment_path, "r", swmr=True) as f:
        written = f["keys"][:len(ds)]
    w.close()
    steps = [s.indices for s in schedule(9, 1, len(ds), 50)]
    # batch by batch in the schedule's order (a batch is committed whole, sorted by key)
    got = [written[a:a + len(s)] for a, s in zip(np.cumsum([0] + [len(s) for s in steps[:-1]]), steps)]
    assert all(np.array_equal(g, np.sort(s)) for g, s in zip(got, steps))


@pytest.mark.slow
def test_resume_after_kill_9_equals_an_uninterrupted_build(teachers, tmp_path):
    # The producer writes ~30k rows/s here: 60,000 rows leave work for a rerun after every kill below.
    args = ["--teacher", teachers["gluon"], "--dataset", "synthetic:n=60000,classes=10,shape=1x8x8",
            "--batch-size", 16, "--dtype", "float32"]
    clean = cli(*args, "--cache-dir", tmp_path / "clean")
    d = tmp_path / "killed"
    kills = 0
    for delay in (0.05, 0.2, 0.4):
        p = subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--quiet", *map(str, args), "--cache-dir", str(d)],
                             env=ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        segs = lambda: [f for f in (os.listdir(d / (clean["fingerprint"] + ".parts")) if d.exists() and
                        (d / (clean["fingerprint"] + ".parts")).exists() else []) if f.startswith("seg-")]
        start = len(segs())
        while len(segs()) == start and p.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)  # until this run has started writing
        time.sleep(delay)
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            kills += 1
        p.wait()
    assert kills >= 2
    out = cli(*args, "--cache-dir", d)
    assert out["complete"] and 0 < out["rows_written"] < 60000, out
    with h5py.File(clean["cache_path"]) as a, h5py.File(out["cache_path"]) as b:
        assert a["logits"][...].tobytes() == b["logits"][...].tobytes()


def test_two_shards_fill_one_cache(teachers, tmp_path):
    a = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, "--shard", "1/2")
    assert not a["complete"] and a["rows_written"] == 719
    b = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, "--shard", "0/2")
    assert b["complete"] and b["rows_written"] == 719 and a["fingerprint"] == b["fingerprint"]
    single = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path / "one")
    with h5py.File(single["cache_path"]) as x, h5py.File(b["cache_path"]) as y:
        # other batch compositions: MKL-DNN may differ in the last bit, float16 rounding rarely shows it
        assert np.allclose(x["logits"][...], y["logits"][...], rtol=2e-3, atol=1e-4)


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [int(x) for x in out]


SHARDED_N = 120000  # ~2.5 s a build here: long enough to kill in the middle
SHARDED = f"synthetic:n={SHARDED_N},classes=10,shape=1x8x8"


@pytest.fixture(scope="module")
def sharded_clean(teachers, tmp_path_factory):
    """The cache an uninterrupted --shards 2 build of SHARDED makes (its logits, as bytes)."""
    clean = cli("--teacher", teachers["gluon"], "--dataset", SHARDED, "--batch-size", 16, "--dtype", "float32",
                "--shards", 2, "--cache-dir", tmp_path_factory.mktemp("sharded-clean"))
    assert clean["complete"] and clean["rows_written"] == SHARDED_N
    with h5py.File(clean["cache_path"]) as a:
        return a["logits"][...].tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("victim", ["shard", "command"])
def test_shards_2_a_killed_shard_or_command_stops_every_shard_and_a_rerun_finishes(teachers, sharded_clean, tmp_path,
                                                                                   victim):
    """--shards 2: kill -9 of one forked shard ends the command at once with a clear error (the
    other shard stops too: a trainer behind them must not wait for rows no shard writes); kill -9
    of the command takes its shards with it. A rerun resumes both shards; the cache is bitwise
    the one an uninterrupted --shards 2 build makes. The command is started with SIGINT ignored
    when a shard is the victim (as a background job of a script is): the shards must still stop."""
    args = ["--teacher", teachers["gluon"], "--dataset", SHARDED, "--batch-size", 16, "--dtype", "float32",
            "--shards", 2]
    d = tmp_path / "killed"
    p = subprocess.Popen([sys.executable, "-m", "kdcache.cache_builder", "--quiet", *map(str, args), "--cache-dir", str(d)],
                         env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if victim == "shard" else None)
    deadline = time.monotonic() + 120
    segs = lambda: [f for f in (os.listdir(next(d.glob("*.parts"))) if d.exists() and list(d.glob("*.parts"))
                                else []) if f.startswith("seg-")]
    while (len(segs()) < 2 or len(_children(p.pid)) < 2) and p.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    kids = _children(p.pid)
    assert p.poll() is None and len(kids) == 2, "the shards did not start writing"
    time.sleep(0.5)
    os.kill(kids[1] if victim == "shard" else p.pid, signal.SIGKILL)
    t = time.monotonic()
    out, err = p.communicate(timeout=60)
    if victim == "shard":
        assert time.monotonic() - t < 20 and p.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: shard 1/2: killed by signal 9") and "shard(s) 0 stopped" in last, last
        assert "run the same command again" in last and "Traceback" not in err
    deadline = time.monotonic() + 5
    while any(os.path.exists(f"/proc/{k}") and open(f"/proc/{k}/stat").read().split()[2] != "Z" for k in kids):
        assert time.monotonic() < deadline, "a shard outlived the kill"
        time.sleep(0.1)
    again = cli(*args, "--cache-dir", d)
    assert again["complete"] and 0 < again["rows_written"] < SHARDED_N, again
    with h5py.File(again["cache_path"]) as b:
        assert b["logits"][...].tobytes() == sharded_clean


def test_a_ring_for_other_targets_is_refused(teachers):
    """--ring NAME attaches to a ring whose creator expects another fingerprint: one error line,
    exit 2, nothing written into the ring."""
    from kdcache.store.ring import RingReader
    with RingReader(create=True, num_classes=10, fingerprint="ffff", timeout=5) as r:
        out = cli("--teacher", teachers["gluon"], "--ring", r.name, "--epochs", 1, check=False)
        assert out.returncode == 2, out.stderr
        last = out.stderr.strip().splitlines()[-1]
        assert last.startswith("error: ring") and "fingerprint ffff" in last and "Traceback" not in out.stderr
        assert int(r._ring.hdr["write_count"]) == 0


@pytest.mark.parametrize("args,match", [
    (["--dataset", "nosuch"], "unknown data set"), (["--dataset", "mnist"], "--data-root"),
    (["--views", "2", "--augment", "none"], "every view would be the same"), (["--codec", "topk:x"], "topk"),
    (["--shard", "3/2"], "shard"), (["--augment", "rotate"], "not understood"), (["--batch-size", "0"], "at least 1"),
])
def test_bad_options_give_one_clear_line(teachers, tmp_path, args, match):
    r = cli("--teacher", teachers["gluon"], "--cache-dir", tmp_path, *args, check=False)
    assert r.returncode == 2, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and match in last and "Traceback" not in r.stderr


def test_help_names_every_option():
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--help"], capture_output=True, text=True, env=ENV, cwd=ROOT)
    for opt in ("--teacher", "--dataset", "--data-root", "--cache-dir", "--views", "--codec", "--dtype", "--seed",
                "--epochs", "--batch-size", "--threads", "--shard", "--online", "--json", "--ring"):
        assert opt in r.stdout


def test_a_teacher_for_other_images_is_refused_naming_both_shapes(tmp_path):
    """A teacher exported for 3-channel images, run on 1-channel digits: one line naming the layer's
    parameter, its shape and the shape these images need; nothing cached."""
    from tests.helpers import gluon_teacher
    prefix = str(tmp_path / "t3")
    gluon_teacher(prefix, in_ch=3)
    r = cli("--teacher", prefix, "--cache-dir", tmp_path / "c", check=False)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "1x8x8" in last and "(4, 3, 3, 3)" in last and "(4, 1, 3, 3)" in last, last
    assert not (tmp_path / "c").exists() or not os.listdir(tmp_path / "c")


@pytest.mark.parametrize("online", [False, True])
def test_ctrl_c_that_python_would_swallow_still_stops_the_producer_between_batches(tmp_path, online):
    """Ctrl-C lands where Python swallows KeyboardInterrupt (a weak reference's callback, an MXNet
    destructor: "Exception ignored in ..."). The producer records it and stops at its next batch,
    with every batch before it committed; Python's own handler is back afterwards."""
    import signal
    from kdcache.cache_builder.produce import CacheSink, produce_offline, produce_online
    from kdcache.pipeline import Augment, load_dataset
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.store import CacheReader, CacheWriter

    class Teacher:  # interrupted during its third batch, inside code that swallows the exception
        calls = 0

        def forward(self, x):
            Teacher.calls += 1
            if Teacher.calls == 3:
                try:
                    os.kill(os.getpid(), signal.SIGINT)
                    time.sleep(0.2)
                except KeyboardInterrupt:
                    pass  # what a destructor or a weakref callback does with it
            return np.tile(np.arange(10, dtype=np.float32), (len(x), 1))

    data = load_dataset("synthetic:n=400,classes=10,shape=1x8x8")
    spec = build_spec({"name": "fake"}, data, codec="full", dtype="float32")
    base = str(tmp_path / "c")
    w = CacheWriter(base, spec)
    with pytest.raises(KeyboardInterrupt):
        if online:
            produce_online(Teacher(), data, CacheSink(w), seed=0, augment=Augment(), batch_size=32, epochs=1,
                           progress=False)
        else:
            produce_offline(Teacher(), data, w, seed=0, augment=Augment(), batch_size=32, progress=False)
    w.abort()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with CacheReader(base, spec=spec) as r:
        assert r.missing(np.arange(400), 0).size == 400 - 3 * 32  # the three batches before the stop
