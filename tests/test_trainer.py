"""trainer: the KD loss, cache vs inline parity, reuse, online producer, resume, Module API, errors."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.conftest import ROOT

ENV = {**os.environ, "PYTHONPATH": ROOT, "MXNET_SUBGRAPH_VERBOSE": "0"}


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A small digits teacher trained for a few epochs (real, if weak, soft targets)."""
    prefix = str(tmp_path_factory.mktemp("teacher") / "digits")
    r = subprocess.run([sys.executable, "-m", "kdcache.trainer.make_teacher", "--out", prefix, "--epochs", "3", "--quiet",
                        "--threads", "1"], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return prefix


def train(tmp_path, *args, check=True, timeout=600):
    r = subprocess.run([sys.executable, "-m", "kdcache.trainer", "--quiet", "--json", "--runs-dir", str(tmp_path / "runs"),
                        "--cache-dir", str(tmp_path / "caches"), *map(str, args)],
                       env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


def params(run_dir, epoch):
    import mxnet as mx
    return {k: v.asnumpy() for k, v in mx.nd.load(os.path.join(run_dir, f"student-{epoch:04d}.params")).items()}


# --- the loss --------------------------------------------------------------------------------
def test_kd_loss_matches_the_formula():
    import mxnet as mx
    from kdcache.trainer.loss import KDLoss
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(5, 7)).astype(np.float32), rng.normal(size=(5, 7)).astype(np.float32) * 3
    y = rng.integers(0, 7, 5)
    T, a = 4.0, 0.7

    def logsm(z):
        z = z - z.max(1, keepdims=True)
        return z - np.log(np.exp(z).sum(1, keepdims=True))
    kl = (np.exp(logsm(t / T)) * (logsm(t / T) - logsm(s / T))).sum(1)
    ce = -logsm(s)[np.arange(5), y]
    got = KDLoss(T, a)(mx.nd.array(s), mx.nd.array(t), mx.nd.array(y)).asnumpy()
    assert np.allclose(got, a * T * T * kl + (1 - a) * ce, rtol=1e-4)
    assert np.allclose(KDLoss(T, 0.0)(mx.nd.array(s), mx.nd.array(t), mx.nd.array(y)).asnumpy(), ce, rtol=1e-5)
    # the teacher's own logits as the student's: the soft term vanishes
    assert np.allclose(KDLoss(T, 1.0)(mx.nd.array(t), mx.nd.array(t), mx.nd.array(y)).asnumpy(), 0, atol=1e-5)


def test_ctrl_c_in_the_epochs_is_kept_and_raised_at_a_safe_point():
    """SIGINT during the epochs is recorded, not raised where the main thread happens to be (an
    MXNet destructor would swallow it, a queue's lock would stay held), and raised by the next
    check: at a step, or while the loop waits for a batch. A second SIGINT is raised at once.
    Afterwards Python's own handler is back; a trainer started with SIGINT ignored keeps ignoring it."""
    import threading
    from kdcache.pipeline.interrupts import Interrupts
    from kdcache.trainer.prefetch import Prefetcher
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    stop = Interrupts().install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)  # the handler has run: nothing was raised
        assert stop.requested
        with pytest.raises(KeyboardInterrupt):
            stop.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.5)
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler

    # a loop waiting for a batch that never comes is stopped by the check it polls
    never = threading.Event()

    def steps():  # a batch that is not ready: the thread waits, and so does the loop
        never.wait(10)
        yield from ()
    stop = Interrupts().install()
    pf = Prefetcher(steps(), None, seed=0, augment=None, targets=None, poll=stop.check)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        t = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            next(iter(pf))
        assert 0.2 < time.monotonic() - t < 5
    finally:
        stop.restore()
        never.set()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        stop = Interrupts().install()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        stop.restore()
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


# --- end to end ------------------------------------------------------------------------------
@pytest.mark.slow
def test_cache_and_inline_give_the_same_student_and_the_cache_is_reused(teacher, tmp_path):
    common = ["--teacher", teacher, "--epochs", 2, "--seed", 3, "--dtype", "float32", "--threads", 1,
              "--producer-threads", 1, "--temperature", 4, "--alpha", 0.7, "--val-fraction", 0]
    cached = train(tmp_path, *common, "--run", "cached")
    assert cached["producer_started"] and cached["teacher_forwards"] == 1438
    inline = train(tmp_path, *common, "--teacher-mode", "inline", "--run", "inline")
    assert inline["teacher_forwards"] == 2 * 1438
    a, b = params(tmp_path / "runs" / "cached", 1), params(tmp_path / "runs" / "inline", 1)
    assert a.keys() == b.keys()
    for k in a:
        assert np.abs(a[k] - b[k]).max() <= 1e-6, k
    assert cached["test_acc"] == inline["test_acc"]
    assert cached["teacher_test_acc"] == pytest.approx(inline["teacher_test_acc"])
    # another experiment (student, temperature, alpha) reuses the cache: the teacher runs zero times
    again = train(tmp_path, "--teacher", teacher, "--epochs", 1, "--dtype", "float32", "--student", "small_cnn",
                  "--temperature", 2, "--alpha", 0.9, "--run", "again")
    assert again["fingerprint"] == cached["fingerprint"] and again["cache_path"] == cached["cache_path"]
    assert again["teacher_forwards"] == 0 and not again["producer_started"]
    m = json.load(open(tmp_path / "runs" / "again" / "metrics.json"))
    for k in ("test_acc", "samples_per_s", "teacher_forwards", "stall_s", "cache_path", "fingerprint"):
        assert k in m


@pytest.mark.slow
def test_views_topk_and_ring(teacher, tmp_path):
    """Two augmented views from a topk cache, and the same run streamed through the ring."""
    m = train(tmp_path, "--teacher", teacher, "--epochs", 3, "--views", 2, "--codec", "topk:3", "--run", "v")
    assert m["teacher_forwards"] == 2 * 1438 and 0 <= m["test_acc"] <= 1
    r = train(tmp_path, "--teacher", teacher, "--epochs", 2, "--store", "ring", "--ring-capacity", 256, "--run", "ring")
    assert r["cache_path"] is None and r["teacher_forwards"] == 2 * 1438
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("kdcache-ring-") and "-ring" in f and
                f.endswith("-ring")], "the ring is removed after the run"


@pytest.mark.slow
def test_resume_continues_an_interrupted_run_to_the_same_student(teacher, tmp_path):
    # no teacher: none is named; a fixed rate: the cut run's --epochs 2 would end a cosine schedule early
    base = ["--teacher-mode", "none", "--seed", 1, "--threads", 1, "--lr-mode", "constant"]
    train(tmp_path, *base, "--epochs", 4, "--run", "full")
    first = train(tmp_path, *base, "--epochs", 2, "--run", "cut")
    assert len(first["history"] if "history" in first else json.load(open(tmp_path / "runs/cut/metrics.json"))["history"]) == 2
    r = train(tmp_path, *base, "--epochs", 4, "--run", "cut", check=False)
    assert r.returncode == 2 and "--resume" in r.stderr
    train(tmp_path, *base, "--epochs", 4, "--run", "cut", "--resume")
    hist = json.load(open(tmp_path / "runs/cut/metrics.json"))["history"]
    assert [h["epoch"] for h in hist] == [0, 1, 2, 3]
    a, b = params(tmp_path / "runs" / "full", 3), params(tmp_path / "runs" / "cut", 3)
    for k in a:
        assert np.abs(a[k] - b[k]).max() <= 1e-6, k


class _Planted:
    """A pickle payload: unpickling it creates the marker file."""
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_resume_never_unpickles_the_optimizer_state(tmp_path):
    """The optimiser state is MXNet arrays plus JSON: a pickle planted where MXNet's
    Trainer.save_states writes (trainer.states) or in place of the state arrays is never run;
    an older run's pickled trainer.states is refused with one error line, not loaded."""
    import pickle
    base = ["--teacher-mode", "none", "--seed", 1, "--threads", 1, "--lr-mode", "constant", "--run", "r"]
    train(tmp_path, *base, "--epochs", 1)
    run = tmp_path / "runs" / "r"
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Planted(marker))

    def refused(r, *words):
        assert r.returncode == 2, r.stderr[-2000:]
        lines = [l for l in r.stderr.splitlines() if l.startswith("error:")]
        assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
        assert all(w in lines[0] for w in words), lines[0]
        assert not marker.exists()

    # a planted trainer.states is not read: a clean resume
    (run / "trainer.states").write_bytes(payload)
    train(tmp_path, *base, "--epochs", 2, "--resume")
    assert not marker.exists(), "the planted pickle ran"
    state = json.load(open(run / "state.json"))
    assert state["epoch"] == 1 and state["optimizer"]["num_update"] > 0
    assert sorted(f for f in os.listdir(run) if f.startswith("optimizer-states-")) == ["optimizer-states-0001.params"]
    good = (run / "optimizer-states-0001.params").read_bytes()
    # a pickle in place of the state arrays is refused
    (run / "optimizer-states-0001.params").write_bytes(payload)
    refused(train(tmp_path, *base, "--epochs", 3, "--resume", check=False), "optimizer-states-0001.params")
    (run / "optimizer-states-0001.params").write_bytes(good)
    # an older kdcache's run (no optimiser record in state.json, a pickled trainer.states): refused
    (run / "state.json").write_text(json.dumps({k: v for k, v in state.items() if k != "optimizer"}))
    refused(train(tmp_path, *base, "--epochs", 3, "--resume", check=False), "trainer.states", "older kdcache",
            "pickle")
    # a malformed record names state.json
    (run / "state.json").write_text(json.dumps({**state, "optimizer": {**state["optimizer"], "num_update": "x"}}))
    refused(train(tmp_path, *base, "--epochs", 3, "--resume", check=False), "state.json", "num_update")
    (run / "state.json").write_text(json.dumps(state))
    train(tmp_path, *base, "--epochs", 3, "--resume")
    assert not marker.exists()
    assert [h["epoch"] for h in json.load(open(run / "metrics.json"))["history"]] == [0, 1, 2]
    assert json.load(open(run / "state.json"))["optimizer"]["num_update"] > state["optimizer"]["num_update"]


@pytest.mark.slow
def test_a_producer_that_dies_ends_training_with_a_clear_error(teacher, tmp_path):
    """Kill the producer the trainer started: the trainer stops within seconds, no hang."""
    args = ["--teacher", teacher, "--dataset", "synthetic:n=60000,classes=10,shape=1x8x8", "--epochs", 1,
            "--batch-size", 32, "--threads", 1, "--quiet", "--runs-dir", str(tmp_path / "runs"),
            "--cache-dir", str(tmp_path / "caches"), "--run", "victim"]
    p = subprocess.Popen([sys.executable, "-m", "kdcache.trainer", *map(str, args)], env=ENV, cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    from kdcache.store.files.segment import lock_holders
    deadline = time.monotonic() + 120
    holders = []
    while not holders and time.monotonic() < deadline:
        parts = [os.path.join(tmp_path, "caches", d) for d in os.listdir(tmp_path / "caches")] \
            if (tmp_path / "caches").exists() else []
        # the lock is taken a moment before its holder's record (the pid) is written
        holders = [h for d in parts if d.endswith(".parts") for _, h in lock_holders(d) if "pid" in h]
        time.sleep(0.1)
    assert holders, "the trainer started no producer"
    # wait until the producer gets its first rows out, then kill it
    time.sleep(1.0)
    os.kill(holders[0]["pid"], signal.SIGKILL)
    t = time.monotonic()
    out, err = p.communicate(timeout=60)
    assert p.returncode == 2, err[-2000:]
    assert time.monotonic() - t < 20
    assert "no producer is running" in err and "the producer failed: it was killed (SIGKILL)" in err
    assert "Traceback" not in err


def test_module_api_trains_with_soft_target_iter(tmp_path):
    import mxnet as mx
    from kdcache.store import CacheReader
    from tests.helpers import label_cache
    from kdcache.trainer import SoftTargetIter, kd_symbol
    # soft targets: a one-hot-ish "teacher" from the labels, enough to check the plumbing learns
    ds, p = label_cache(tmp_path)
    it = SoftTargetIter(ds, CacheReader(p), batch_size=64, seed=0)
    b = it.next()
    assert [d.name for d in it.provide_label] == ["softmax_label", "soft_label"]
    assert b.label[1].shape == (64, 10) and np.array_equal(b.label[1].asnumpy().argmax(1), b.label[0].asnumpy())
    data = mx.sym.var("data")
    h = mx.sym.relu(mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=32, name="fc1"))
    sym = kd_symbol(mx.sym.FullyConnected(h, num_hidden=10, name="fc2"), temperature=4.0, alpha=0.7)
    mod = mx.mod.Module(sym, data_names=["data"], label_names=["softmax_label", "soft_label"])

    class Acc(mx.metric.EvalMetric):
        def __init__(self):
            super().__init__("acc")

        def update(self, labels, preds):
            self.sum_metric += float((preds[1].asnumpy().argmax(1) == labels[0].asnumpy()).sum())
            self.num_inst += len(labels[0])
    mx.random.seed(0)
    it.reset()
    mod.fit(it, num_epoch=6, optimizer="adam", optimizer_params={"learning_rate": 5e-3}, eval_metric=Acc(),
            initializer=mx.init.Xavier())
    assert mod.score(it, Acc())[0][1] > 0.9


@pytest.mark.slow
def test_several_contexts_split_each_batch_and_train_the_same_student(teacher, tmp_path):
    """--ctx cpu:0,1 takes the multi-device path of --ctx gpu:0,1 (batch split across contexts,
    gradients summed by the device kvstore): the student equals the one-context student up to
    float rounding, not a different or half-trained one."""
    common = ["--teacher", teacher, "--teacher-mode", "inline", "--epochs", 2, "--seed", 5, "--threads", 1,
              "--save-every", 1]
    one = train(tmp_path, *common, "--ctx", "cpu", "--run", "one")
    two = train(tmp_path, *common, "--ctx", "cpu:0,1", "--run", "two")
    assert two["ctx"] == "[cpu(0), cpu(1)]" and one["ctx"] == "[cpu(0)]"
    a, b = params(tmp_path / "runs" / "one", 1), params(tmp_path / "runs" / "two", 1)
    assert a.keys() == b.keys()
    for k in a:
        assert np.allclose(a[k], b[k], rtol=1e-3, atol=1e-4), (k, np.abs(a[k] - b[k]).max())
    start = params(tmp_path / "runs" / "two", 0)
    assert any(np.abs(start[k] - b[k]).max() > 1e-3 for k in b)  # it trained
    assert abs(one["test_acc"] - two["test_acc"]) <= 2 / 359
    r = train(tmp_path, "--ctx", "cpu:0,x", "--teacher-mode", "none", check=False)
    assert r.returncode == 2 and "cpu:0,1" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("store", ["cache", "ring"])
def test_the_producer_starts_before_the_trainer_imports_mxnet(teacher, tmp_path, store):
    """python -m kdcache.trainer starts the producer (and creates the ring) before its own MXNet import,
    so the producer's start-up overlaps the trainer's instead of stalling the first epoch."""
    code = f"""
import glob, os, sys, time
from kdcache.trainer.options import parse_args
from kdcache.trainer.run_plan import make_plan
from kdcache.trainer.targets import Targets
args = parse_args(["--teacher", {teacher!r}, "--store", {store!r}, "--run", "early",
                   "--runs-dir", {str(tmp_path / "runs")!r}, "--cache-dir", {str(tmp_path / "c")!r}])
args.run_name = args.run
early = Targets.start_settled(args, make_plan(args), os.path.join(args.runs_dir, args.run_name), 1, 2)
assert "mxnet" not in sys.modules, "MXNet was imported before the producer started"
assert early is not None and early.producer is not None and early.producer.poll() is None
assert (early.ring is not None) == ({store!r} == "ring") and args.run_name == "early"
deadline = time.monotonic() + 120
def started():  # the producer has loaded and opened its output (or, digits being small, finished)
    if early.ring is not None:
        return early.ring._ring.hdr["producer_pid"] == early.producer.pid
    return bool(glob.glob({str(tmp_path / "c")!r} + "/*.parts/seg-*") + glob.glob({str(tmp_path / "c")!r} + "/*.h5"))
while not started():
    assert early.producer.poll() in (None, 0), open({str(tmp_path / "runs/early/producer.log")!r}).read()
    assert time.monotonic() < deadline
    time.sleep(0.1)
name = early.ring.name if early.ring is not None else None
early.close()
assert early.producer.poll() is not None
assert name is None or not os.path.exists("/dev/shm/" + name)
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_bad_options(tmp_path):
    r = train(tmp_path, "--run", "../escape", "--teacher-mode", "none", check=False)
    assert r.returncode == 2 and "--run" in r.stderr
    r = train(tmp_path, "--ctx", "gpu:3", "--teacher-mode", "none", check=False)
    assert r.returncode == 2 and "GPU" in r.stderr
    r = train(tmp_path, "--teacher", str(tmp_path / "nothing"), check=False)
    assert r.returncode == 2 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = train(tmp_path, "--dataset", "synthetic:n=100", "--teacher-mode", "inline", check=False)
    assert r.returncode == 2 and "--teacher" in r.stderr


def test_help():
    r = subprocess.run([sys.executable, "-m", "kdcache.trainer", "--help"], capture_output=True, text=True, env=ENV, cwd=ROOT)
    for opt in ("--dataset", "--student", "--teacher", "--cache", "--cache-dir", "--views", "--codec", "--temperature",
                "--alpha", "--epochs", "--batch-size", "--seed", "--ctx", "--threads", "--teacher-mode",
                "--no-producer", "--resume", "--run"):
        assert opt in r.stdout
