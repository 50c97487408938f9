"""Values no sound teacher writes: refused at write time, found by verify, stopped by the trainer."""
import json
import subprocess
import sys

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tests.helpers import CHILD_ENV, expected_logits, make_spec, produce, reseal

NAN_AUGMENT = '''
import os

import numpy as np


def nan_images(image, rng):
    return np.full_like(image, np.nan)


def nan_when_asked(image, rng):
    return np.full_like(image, np.nan) if os.environ.get("NAN_IMAGES") else image
'''


def kdcache(cwd, *argv, timeout=300, env=None):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env={**CHILD_ENV, **(env or {})}, cwd=cwd, timeout=timeout)


def one_error_line(r):
    """Exit 2, one `error:` line (the last one on stderr), no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and r.stderr.strip().splitlines()[-1] == errors[0], r.stderr
    return errors[0]


def done_keys(base, n):
    """The sample indices (view 0) whose rows a cache in progress holds."""
    from kdcache.store import CacheReader
    with CacheReader(base) as r:
        return np.setdiff1d(np.arange(n), r.missing(np.arange(n), 0))


# --- at write time ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A folder with an augmentation that gives NaN images, and a teacher that gives NaN for the
    digits whose mean pixel is above the largest of the first 128 (samples 135, 142, ...)."""
    import mxnet as mx
    from kdcache.pipeline import load_dataset
    tmp = tmp_path_factory.mktemp("nonfinite")
    (tmp / "nanaug.py").write_text(NAN_AUGMENT)
    x, _ = load_dataset("digits").get_batch(np.arange(1438))
    mean = x.reshape(len(x), -1).mean(axis=1)
    c = float(mean[:128].max())
    bad = np.flatnonzero(mean > c)
    assert bad[0] == 135 and bad.size > 5, bad  # the digits data set as kdcache ships it
    data = mx.sym.var("data")
    fc = mx.sym.FullyConnected(mx.sym.flatten(data), num_hidden=10, name="fc")
    # sqrt of a negative number: NaN for the bright images only
    gate = mx.sym.sqrt(c - mx.sym.mean(data, axis=(1, 2, 3), keepdims=False)).reshape((-1, 1))
    sym = mx.sym.broadcast_add(fc, gate)
    rng = np.random.default_rng(0)
    args = {"fc_weight": mx.nd.array(rng.normal(0, 0.3, (10, 64))), "fc_bias": mx.nd.zeros(10)}
    mx.model.save_checkpoint(str(tmp / "nanteacher"), 0, sym, args, {})
    # MXNet's relu turns NaN into 0: NaN images give this teacher's bias, a finite row, for every key
    sym = mx.sym.FullyConnected(mx.sym.flatten(mx.sym.Activation(data, act_type="relu")), num_hidden=10, name="fc")
    mx.model.save_checkpoint(str(tmp / "reluteacher"), 0, sym, args, {})
    return {"tmp": tmp, "bad": bad}


@pytest.mark.parametrize("shards", [1, 2])
def test_a_teacher_giving_nan_is_refused_naming_the_keys_and_nothing_of_the_batch_is_kept(world, shards):
    d = world["tmp"] / f"caches-{shards}"
    r = kdcache(world["tmp"], "cache", "--teacher", "nanteacher", "--cache-dir", d, "--batch-size", 64,
                "--shards", shards, "--quiet")
    line = one_error_line(r)
    assert "NaN or Inf" in line and ("sample 135 view 0" in line or "sample 142 view 0" in line), line
    assert "their input images are finite" in line and "nothing of this batch was cached" in line, line
    from kdcache.store.folder.registry import cache_bases, info
    [base] = cache_bases(str(d))
    # Key-order blocks of 64 (of each shard's keys): every block before the one holding 135 (142 for
    # shard 0 of 2) is kept, nothing of that block or after it. (With shards, the first to fail stops
    # the other, perhaps before its first block.)
    done = done_keys(base, 1438).tolist()
    if shards == 1:
        assert done == list(range(128))
    else:
        assert done and max(done) < 128 and all(set(range(s, 128, 2)) <= set(done) for s in {k % 2 for k in done})
    assert info(base)["state"] != "damaged"


def test_nan_from_an_online_producer_is_refused_before_the_write(tmp_path):
    """The online path (the trainer's producer) goes through the same check."""
    from kdcache.cache_builder.produce import CacheSink, produce_online
    from kdcache.pipeline import load_dataset
    from kdcache.pipeline.augment import Augment
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.pipeline.teacher_files import TeacherError
    from kdcache.store import CacheWriter

    class Teacher:  # Inf in row 5 of its third batch
        calls = 0

        def forward(self, x):
            Teacher.calls += 1
            out = np.tile(np.arange(10, dtype=np.float32), (len(x), 1)) + x.reshape(len(x), -1)[:, :10]
            if Teacher.calls == 3:
                out[5, 2] = np.inf
            return out

    data = load_dataset("synthetic:n=200,classes=10,shape=1x8x8")
    spec = build_spec({"name": "fake"}, data, codec="full", dtype="float32")
    base = str(tmp_path / "c")
    w = CacheWriter(base, spec)
    with pytest.raises(TeacherError) as e:
        produce_online(Teacher(), data, CacheSink(w), seed=0, augment=Augment(), batch_size=32, epochs=1,
                       progress=False)
    w.abort()
    assert "NaN or Inf" in str(e.value) and "view 0" in str(e.value) and "\n" not in str(e.value)
    from kdcache.pipeline.schedule import epoch_batches
    third = epoch_batches(0, 0, 200, 32)[2]
    assert f"sample {third[5]} view 0" in str(e.value)
    assert sorted(done_keys(base, 200).tolist()) == sorted(np.concatenate(epoch_batches(0, 0, 200, 32)[:2]).tolist())


def test_nan_images_are_refused_before_the_teacher_sees_them(world):
    """An augmentation giving NaN images: a teacher can turn them into one finite row for every key
    (a cache of identical rows); the producer refuses them first, naming the key and the augmentation."""
    d = world["tmp"] / "caches-aug"
    r = kdcache(world["tmp"], "cache", "--teacher", "reluteacher", "--cache-dir", d, "--augment", "nanaug:nan_images",
                "--views", 2, "--quiet")
    line = one_error_line(r)
    assert "input images of a batch hold NaN or Inf" in line and "sample 0 view 0" in line, line
    assert "the augmentation nanaug:nan_images" in line and "nothing of this batch was cached" in line, line
    from kdcache.store.folder.registry import cache_bases, info
    assert all(info(b)["done"] == 0.0 for b in cache_bases(str(d)))


@pytest.mark.slow
def test_verify_with_the_teacher_counts_keys_whose_rebuilt_inputs_are_nan(world):
    """The teacher check rebuilds each key's input: a NaN image is no match, even where the teacher
    gives the stored row for it (this relu teacher gives its bias for NaN images)."""
    d = world["tmp"] / "caches-verify"
    r = kdcache(world["tmp"], "cache", "--teacher", "reluteacher", "--cache-dir", d, "--augment",
                "nanaug:nan_when_asked", "--views", 2, "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    path = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    r = kdcache(world["tmp"], "verify", path, "--teacher", "reluteacher", "--sample", 40, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["teacher_check"]["keys_with_nonfinite_inputs"] == 0
    r = kdcache(world["tmp"], "verify", path, "--teacher", "reluteacher", "--sample", 40, env={"NAN_IMAGES": "1"})
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "of which 40 have input images holding NaN or Inf" in r.stdout, r.stdout
    assert "does NOT match its teacher" in r.stdout


def test_the_writer_names_the_keys_of_non_finite_rows(cache_dir):
    from kdcache.store import BadInputError, CacheWriter, path_for
    spec = make_spec(num_samples=20, views=2)
    with CacheWriter(path_for(cache_dir, spec.fingerprint), spec) as w:
        x = expected_logits(np.arange(4), 10)
        x[2, 1] = np.nan
        with pytest.raises(BadInputError, match="sample 3 view 1") as e:
            w.write([0, 1, 3, 4], x, views=[0, 1, 1, 0])
        assert "NaN or Inf" in str(e.value) and "nothing of this batch was written" in str(e.value)
        assert w.rows_written == 0


# --- verify --------------------------------------------------------------------------------
CODEC_FIELDS = [("full", "float16", "logits"), ("full", "float32", "logits"),
                ("topk:3", "float16", "topk_values"), ("topk:3", "float16", "topk_lse"),
                ("topk:3", "float16", "topk_logtail"), ("int8", "float16", "int8_lo"),
                ("int8", "float16", "int8_scale")]


@pytest.mark.parametrize("codec,dtype,field", CODEC_FIELDS)
@pytest.mark.parametrize("value", [np.nan, -np.inf])
def test_verify_names_the_first_key_holding_a_non_finite_value(cache_dir, codec, dtype, field, value):
    from kdcache.store import path_for
    from kdcache.store.format import schema
    from kdcache.store.folder.registry import final_path
    from kdcache.store.folder.verify import verify
    assert field in {schema.LOGITS, schema.TOPK_VALUES, schema.TOPK_LSE, schema.TOPK_LOGTAIL, schema.INT8_LO,
                     schema.INT8_SCALE}
    spec = make_spec(num_samples=300, views=2, codec=codec, dtype=dtype, tag=f"{codec}{dtype}{field}")
    base = path_for(cache_dir, spec.fingerprint)
    assert produce(base, spec)
    with h5py.File(final_path(base), "r+") as f:
        d = f[field]
        for s, v in ((211, 0), (37, 1)):
            row = d[s]
            row[v] = value if d.ndim == 2 else np.where(np.arange(d.shape[2]) == 1, value, row[v])
            d[s] = row
    reseal(base)  # NaN written as if the teacher gave it: the checksums match, the values are the problem
    report, problems = verify(base, block_rows=64)  # several blocks: the first bad key, not the first block's
    assert len(problems) == 1, problems
    p = problems[0]
    assert f"{field} holds NaN or Inf at sample 37 view 1" in p and "the first of 2" in p and "rebuild" in p, p
    assert not report["suspect"]


def test_verify_names_a_non_finite_value_in_a_cache_in_progress(cache_dir):
    from kdcache.store import CacheWriter, path_for
    from kdcache.store.files.segment import list_segments
    from kdcache.store.folder.verify import verify
    spec = make_spec(num_samples=100, views=1)
    base = path_for(cache_dir, spec.fingerprint)
    with CacheWriter(base, spec) as w:
        w.write(np.arange(40), expected_logits(np.arange(40), 10))
        parts = w.parts
        w.abort()
    [seg] = list_segments(parts)
    with h5py.File(seg, "r+") as f:
        row = f["logits"][17]
        row[4] = np.nan
        f["logits"][17] = row
    _, problems = verify(base)
    assert any("logits holds NaN or Inf at sample 17 view 0" in p for p in problems), problems


def test_the_store_verify_command_reports_it_and_exits_1(cache_dir, tmp_path):
    from kdcache.store import path_for
    from kdcache.store.folder.registry import final_path
    spec = make_spec(num_samples=50)
    base = path_for(cache_dir, spec.fingerprint)
    assert produce(base, spec)
    with h5py.File(final_path(base), "r+") as f:
        f["logits"][9, 0, 3] = np.nan
    reseal(base)
    r = kdcache(tmp_path, "verify", base)
    assert r.returncode == 1 and "NOT sound" in r.stdout
    assert "logits holds NaN or Inf at sample 9 view 0" in r.stdout, r.stdout


def constant_cache(cache_dir, n, *, rows=None, codec="full", tag="const"):
    from kdcache.store import CacheWriter, path_for
    spec = make_spec(num_samples=n, views=2, codec=codec, dtype="float16", tag=tag)
    base = path_for(cache_dir, spec.fingerprint)
    with CacheWriter(base, spec) as w:
        keys = np.arange(spec.num_keys if rows is None else rows)
        w.write(keys // 2, np.tile(expected_logits([3], 10), (keys.size, 1)), views=keys % 2)
    return base


@pytest.mark.parametrize("codec", ["full", "topk:3", "int8"])
def test_a_cache_whose_every_row_is_the_same_is_suspect(cache_dir, tmp_path, codec):
    from kdcache.store.folder.verify import verify
    base = constant_cache(cache_dir, 150, codec=codec, tag=codec)
    report, problems = verify(base, block_rows=64)
    assert problems == [] and len(report["suspect"]) == 1, report
    s = report["suspect"][0]
    assert "all 300 rows hold the same values" in s and "NaN or blank images" in s and "rebuild" in s, s
    r = kdcache(tmp_path, "verify", base)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.splitlines()[0].endswith("suspect: well formed, but see below"), r.stdout
    assert "all 300 rows hold the same values" in r.stdout
    r = kdcache(tmp_path, "verify", base, "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 1 and out["suspect"] == report["suspect"]


def test_committed_rows_all_the_same_are_suspect_and_one_other_row_is_not(cache_dir):
    from kdcache.store import CacheWriter, path_for
    from kdcache.store.folder.verify import verify
    report, problems = verify(constant_cache(cache_dir, 150, rows=90, tag="partial"))
    assert any("incomplete" in p for p in problems)
    assert len(report["suspect"]) == 1 and "all 90 rows committed so far hold the same values" in report["suspect"][0]
    spec = make_spec(num_samples=150, views=2, dtype="float16", tag="one-differs")
    base = path_for(cache_dir, spec.fingerprint)
    with CacheWriter(base, spec) as w:
        x = np.tile(expected_logits([3], 10), (300, 1))
        x[250, 9] += 1
        w.write(np.arange(300) // 2, x, views=np.arange(300) % 2)
    report, problems = verify(base, block_rows=64)
    assert problems == [] and report["suspect"] == []


# --- the trainer ------------------------------------------------------------------------------
@pytest.mark.slow
def test_the_trainer_stops_at_the_first_non_finite_loss_naming_step_keys_and_cause(teacher, tmp_path):
    from kdcache.pipeline.schedule import epoch_batches
    r = kdcache(tmp_path, "cache", "--teacher", teacher, "--cache-dir", "caches", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    path = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    with h5py.File(path, "r+") as f:
        f["logits"][700, 0, 3] = np.nan
    reseal(path)
    # every item trained on (sample 700 would otherwise be in the validation slice, which is only read)
    r = kdcache(tmp_path, "train", "--teacher", teacher, "--cache-dir", "caches", "--runs-dir", "runs", "--run", "x",
                "--epochs", 2, "--threads", 1, "--quiet", "--json", "--val-fraction", 0)
    line = one_error_line(r)
    step = next(i for i, b in enumerate(epoch_batches(0, 0, 1438, 64)) if 700 in b)
    assert line.startswith(f"error: epoch 1 batch {step + 1} of 23: the loss is nan"), line
    assert "the teacher targets of sample 700 view 0 hold NaN or Inf" in line, line
    assert f"run `kdcache verify {path}`" in line, line
    assert not (tmp_path / "runs" / "x" / "student-0000.params").exists()  # no epoch finished on it


def test_a_student_that_diverges_stops_the_run_naming_the_step_and_the_fix(tmp_path):
    """Finite targets and images, a learning rate that blows the student up: the loss, read one step late (off
    the critical path), stops the run at the first non-finite step, before any checkpoint holds the weights."""
    r = kdcache(tmp_path, "train", "--teacher-mode", "none", "--lr", 10, "--lr-mode", "constant", "--wd", 0.1,
                "--runs-dir", "runs", "--run", "x", "--epochs", 2, "--threads", 1, "--quiet", "--json",
                "--val-fraction", 0)
    line = one_error_line(r)
    assert line.startswith("error: epoch 1 batch ") and " of 23: the loss is " in line, line
    assert "the student diverged; lower the learning rate" in line and "Warning" not in r.stderr, r.stderr
    assert not list((tmp_path / "runs" / "x").glob("student-*.params"))  # no epoch finished on it


@given(st.integers(0, 4), st.sampled_from([np.nan, np.inf, -np.inf]), st.floats(-3e38, 3e38))
@settings(max_examples=200, deadline=None)
def test_host_finite_finds_any_non_finite_value_and_passes_any_finite_batch(where, bad, big):
    from kdcache.trainer.loss import host_finite
    x = np.full((3, 2, 4), big, dtype=np.float32)  # float32's largest values: a float32 sum would overflow
    t = np.ones((3, 5), dtype=np.float32)
    assert host_finite(x, t) and host_finite(x, None) and host_finite(np.zeros((0, 3), np.float32))
    arr = [x, t][where % 2]
    arr.reshape(-1)[where * 3 % arr.size] = bad
    assert not host_finite(x, t)


def test_late_loss_returns_each_step_one_step_late_and_names_the_step_that_was_not_finite():
    import mxnet as mx
    from kdcache.trainer.loss import LateLoss, NonFiniteLossError
    late = LateLoss(cache="/c/abc")
    steps = [mx.nd.array([1.0, 2.0]), mx.nd.array([3.0]), mx.nd.array([np.nan, 1.0])]
    assert late.add([steps[0]], keys=np.array([0, 1]), where="step 1") == 0.0
    assert late.add([steps[1]], keys=np.array([2]), where="step 2") == 3.0
    assert late.add([steps[2]], keys=np.array([3, 4]), targets=np.zeros((2, 3)), where="step 3") == 3.0
    with pytest.raises(NonFiniteLossError) as e:  # step 3's loss, read when the loop is done with it
        late.flush()
    assert str(e.value).startswith("step 3: the loss is nan (batch of sample 3 view 0, sample 4 view 0)"), e.value
    assert late.flush() == 0.0  # nothing held after a flush


# --- a user's own loop -------------------------------------------------------------------------
def test_check_finite_names_the_cause_for_a_users_loop():
    import mxnet as mx
    from kdcache.trainer.loss import KDLoss, NonFiniteLossError, check_finite
    rng = np.random.default_rng(0)
    s, t = rng.normal(size=(6, 10)).astype(np.float32), rng.normal(size=(6, 10)).astype(np.float32)
    y = mx.nd.array(rng.integers(0, 10, 6))
    loss = KDLoss(4.0, 0.5)(mx.nd.array(s), mx.nd.array(t), y)
    assert check_finite(loss) == pytest.approx(float(loss.sum().asscalar()), rel=1e-6)
    assert check_finite([loss[:3], loss[3:]]) == pytest.approx(check_finite(loss), rel=1e-6)  # one per device
    t[4, 7] = np.nan
    loss = KDLoss(4.0, 0.5)(mx.nd.array(s), mx.nd.array(t), y)
    idx = np.array([10, 11, 12, 13, 14, 15])
    with pytest.raises(NonFiniteLossError) as e:
        check_finite(loss, keys=(idx, 1), targets=mx.nd.array(t), where="step 9", cache="/c/abc")
    msg = str(e.value)
    assert msg.startswith("step 9: the loss is nan: the teacher targets of sample 14 view 1 hold NaN or Inf"), msg
    assert "kdcache verify /c/abc" in msg and "\n" not in msg
    # finite targets: the student diverged
    s[0, 0] = np.inf
    t = np.zeros_like(t)
    loss = KDLoss(4.0, 0.5)(mx.nd.array(s), mx.nd.array(t), y)
    with pytest.raises(NonFiniteLossError, match="with finite targets: the student diverged"):
        check_finite(loss, keys=idx, targets=t)
    with pytest.raises(ValueError, match="the loss is nan"):  # without targets: both causes named
        check_finite(loss)


def test_soft_target_iter_refuses_non_finite_targets(tmp_path):
    from kdcache.store import CacheReader
    from kdcache.store.folder.registry import final_path
    from tests.helpers import label_cache
    from kdcache.trainer import SoftTargetIter
    from kdcache.trainer.loss import NonFiniteError
    ds, p = label_cache(tmp_path)
    with h5py.File(final_path(p), "r+") as f:
        f["logits"][500, 0, 2] = np.inf
    reseal(p)
    it = SoftTargetIter(ds, CacheReader(p), batch_size=64, seed=0)
    with pytest.raises(NonFiniteError, match=r"the teacher targets of sample 500 view 0 hold NaN or Inf") as e:
        for _ in it:
            pass
    assert f"kdcache verify {p}" in str(e.value)


def test_soft_target_dataset_refuses_non_finite_targets(tmp_path):
    from kdcache.store.folder.registry import final_path
    from tests.helpers import label_cache
    from kdcache.trainer import SoftTargetDataset
    from kdcache.trainer.loss import NonFiniteError
    ds, p = label_cache(tmp_path)
    with h5py.File(final_path(p), "r+") as f:
        f["logits"][500, 0, 2] = np.nan
    reseal(p)
    soft = SoftTargetDataset(ds, p)
    assert np.isfinite(soft[499][2]).all()  # its neighbours are served
    with pytest.raises(NonFiniteError, match=r"the teacher targets of sample 500 view 0 hold NaN or Inf") as e:
        soft[500]
    assert f"kdcache verify {p}" in str(e.value)
