"""A user's own data set, augmentation and student by name (MODULE:FUNCTION), from a folder outside
the clone: they train end to end, verify against the teacher, name the cache by their source, and
every way a piece can fail is one line naming it, exit 2."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tests.helpers import gluon_teacher

ENV = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
ENV.update(OMP_NUM_THREADS="1", MXNET_SUBGRAPH_VERBOSE="0")
KDCACHE = [sys.executable, "-m", "kdcache"]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The user's module: examples/own_pieces.py (a data set, a jitter, a student) and pieces that fail.
PIECES = open(os.path.join(ROOT, "examples", "own_pieces.py")).read() + textwrap.dedent('''


    def broken(split):
        raise RuntimeError("the disk is gone")


    def not_pairs(split):
        return [np.zeros((1, 8, 8), np.float32)] * 4


    def shrink(image, rng):
        return image[:, :4]


    def not_a_block(classes):
        return "a string"


    def exits(split):
        import sys
        sys.exit(0)


    class Huge:
        def __len__(self):
            return 10 ** 11

        def __getitem__(self, i):
            return np.zeros((1, 8, 8), np.float32), 0


    def huge(split):
        return Huge()


    def in_place(image, rng):
        image *= 0.5  # no return: None


    def too_wide(classes):
        from mxnet import gluon
        net = gluon.nn.HybridSequential(prefix="wide_")
        with net.name_scope():
            net.add(gluon.nn.Dense(classes + 3))
        return net
''')


@pytest.fixture(scope="module")
def user(tmp_path_factory):
    """A folder outside the clone with the user's module and a teacher for 8x8 digits."""
    work = tmp_path_factory.mktemp("user")
    (work / "mine.py").write_text(PIECES)
    gluon_teacher(str(work / "teacher"), classes=10, seed=4)
    return work


def run(work, *args, timeout=600):
    return subprocess.run([*KDCACHE, *map(str, args)], cwd=work, env=ENV, capture_output=True, text=True,
                          timeout=timeout)


def test_own_data_augmentation_and_student_train_and_verify(user):
    r = run(user, "train", "--teacher", "teacher", "--dataset", "mine:load", "--augment", "mine:jitter",
            "--views", "2", "--student", "mine:student", "--epochs", "3", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["student"] == "mine:student" and res["test_acc"] > 0.5 and res["teacher_forwards"] > 0
    assert res["student_identity"].startswith("mine:student@") and len(res["student_identity"]) == 29
    cache = res["cache_path"]
    assert os.path.exists(cache if cache.endswith(".h5") else cache + ".h5")
    v = run(user, "verify", cache, "--teacher", "teacher", "--sample", "all")
    assert v.returncode == 0, v.stdout[-2000:] + v.stderr[-2000:]
    # the cache is named by the pieces' source: another jitter is another cache
    src = (user / "mine.py").read_text()
    (user / "mine.py").write_text(src.replace("rng.uniform(0.9, 1.1)", "rng.uniform(0.8, 1.2)"))
    try:
        r2 = run(user, "cache", "--teacher", "teacher", "--dataset", "mine:load", "--augment", "mine:jitter",
                 "--views", "2", "--quiet", "--json")
        assert r2.returncode == 0, r2.stderr[-2000:]
        other = json.loads(r2.stdout.strip().splitlines()[-1])
        assert other["cache_path"].split(".")[0] != cache.split(".")[0] and other["teacher_forwards"] > 0
        v2 = run(user, "verify", cache, "--teacher", "teacher", "--sample", "5")
        assert v2.returncode == 2 and "source changed" in v2.stderr
    finally:
        (user / "mine.py").write_text(src)


@pytest.mark.parametrize("args,words", [
    (["--dataset", "nosuch:load"], "--dataset nosuch:load: no module named 'nosuch'"),
    (["--dataset", "mine:nothing"], "--dataset mine:nothing: mine has no 'nothing'"),
    (["--dataset", "mine:broken"], "--dataset mine:broken: mine:broken('train') raised RuntimeError: the disk is gone"),
    (["--dataset", "mine:not_pairs"], "--dataset mine:not_pairs: item 0 is ndarray, not (image, label)"),
    (["--dataset", "mine:load", "--augment", "mine:shrink", "--views", "2"],
     "augmentation mine:shrink turned an image of shape (1, 8, 8) into (1, 4, 8)"),
    (["--dataset", "mine:exits"], "--dataset mine:exits: mine:exits('train') called sys.exit(0)"),
    (["--dataset", "mine:huge"], "the train split says it has 100000000000 items, more than the limit of 1073741824"),
    (["--dataset", "mine:load", "--augment", "mine:in_place", "--views", "2"], "augmentation mine:in_place returned None"),
])
def test_each_failing_piece_is_one_line_naming_it(user, tmp_path, args, words):
    r = run(user, "cache", "--teacher", "teacher", *args, "--quiet", "--cache-dir", tmp_path / "caches")
    assert r.returncode == 2, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and words in errors[0], r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    # a mistake changes no cache directory: nothing made, not even an empty folder
    assert not (tmp_path / "caches").exists() or os.listdir(tmp_path / "caches") == []


def test_a_student_that_is_not_a_block_is_one_line(user):
    r = run(user, "train", "--teacher", "teacher", "--dataset", "mine:load", "--student", "mine:not_a_block",
             "--epochs", "1", "--quiet")
    assert r.returncode == 2
    assert "--student mine:not_a_block: mine:not_a_block(10) returned a str, not a Gluon HybridBlock" in r.stderr


def test_a_student_of_another_width_is_one_line_before_training(user):
    r = run(user, "train", "--teacher", "teacher", "--dataset", "mine:load", "--student", "mine:too_wide",
            "--epochs", "1", "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1, r.stderr[-2000:]
    for words in ("--student mine:too_wide", "outputs 13 logits", "10 classes", "gluon.nn.Dense(classes)"):
        assert words in errors[0], errors[0]
    assert "epoch 1" not in r.stderr


def test_user_augment_views_are_keyed():
    from kdcache.pipeline.augment import UserAugment, key_rng

    def jitter(image, rng):
        return image + np.float32(rng.uniform())
    aug = UserAugment(jitter)
    x = np.zeros((3, 1, 2, 2), np.float32)
    a = aug.apply(x, 7, [0, 1, 2], 1)
    b = aug.apply(x[::-1], 7, [2, 1, 0], 1)  # another batch composition, the same keys
    assert np.array_equal(a, b[::-1]) and len({float(v) for v in a[:, 0, 0, 0]}) == 3
    assert key_rng(7, 1, 1).uniform() == key_rng(7, 1, 1).uniform() != key_rng(7, 1, 0).uniform()
    assert aug.spec.startswith(f"{__name__}:test_user_augment_views_are_keyed.<locals>.jitter@")


def test_soft_target_dataset_over_own_pieces_matches_the_teacher(user, monkeypatch):
    """The same pieces in a Gluon loop: SoftTargetDataset with --augment's MODULE:FUNCTION by name."""
    r = run(user, "cache", "--teacher", "teacher", "--dataset", "mine:load", "--augment", "mine:jitter",
            "--views", "2", "--seed", "3", "--dtype", "float32", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    cache = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    monkeypatch.chdir(user)
    monkeypatch.syspath_prepend(str(user))
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.teacher import Teacher
    from kdcache.trainer import SoftTargetDataset
    ds = SoftTargetDataset(load_dataset("mine:load"), cache, seed=3, views=2, augment="mine:jitter")
    teacher = Teacher(str(user / "teacher"))
    for epoch in (0, 1):
        ds.set_epoch(epoch)
        items = [ds[i] for i in range(0, len(ds), 37)]
        x = np.stack([it[0] for it in items])
        np.testing.assert_allclose(np.stack([it[2] for it in items]), teacher.forward(x), rtol=1e-4, atol=1e-4)
