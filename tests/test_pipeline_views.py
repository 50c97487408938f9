"""What the teacher's and the student's sides must agree on: keyed augmentation views and the schedule."""
import os
import subprocess
import sys

import numpy as np
import pytest

from kdcache.pipeline import Augment, epoch_batches, epoch_permutation, load_dataset, make_views, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# --- keyed augmentation views ------------------------------------------------------------
SPEC = "synthetic:n=64,classes=4,shape=3x12x10,seed=3"  # H != W: flips must reverse W
SEED = (1 << 33) + 7
KEYS_I = np.array([5, 0, 63, 17, 17, 42, 8, 33, 5, 60])
KEYS_V = np.array([0, 1, 2, 0, 3, 1, 1, 2, 4, 0])


@pytest.fixture(scope="module")
def small():
    return load_dataset(SPEC)


def views_by_key(ds, indices, views, augment, seed=SEED):
    x, _ = make_views(ds, indices, views, seed=seed, augment=augment)
    return {(int(i), int(v)): x[k] for k, (i, v) in enumerate(zip(indices, np.broadcast_to(views, len(indices))))}


def test_same_key_same_view_whatever_the_batch(small):
    aug = Augment.parse("crop:3,flip")
    a = views_by_key(small, KEYS_I, KEYS_V, aug)
    order = np.random.default_rng(0).permutation(len(KEYS_I))
    others = np.array([1, 2, 3, 50])  # another batch: other samples around, another order
    b = views_by_key(small, np.concatenate([others, KEYS_I[order]]),
                     np.concatenate([np.array([0, 3, 2, 1]), KEYS_V[order]]), aug)
    for key in a:
        assert np.array_equal(a[key], b[key]), key
    for i, v in a:  # one at a time, a scalar view as the schedule passes it
        assert np.array_equal(views_by_key(small, np.array([i]), v, aug)[(i, v)], a[(i, v)])


def test_same_key_same_view_in_another_process(small, tmp_path):
    out = tmp_path / "views.npy"
    code = ("import sys, numpy as np\n"
            "from kdcache.pipeline import Augment, load_dataset, make_views\n"
            f"x, _ = make_views(load_dataset({SPEC!r}), np.array({KEYS_I[::-1].tolist()}), "
            f"np.array({KEYS_V[::-1].tolist()}), seed={SEED}, augment=Augment.parse('crop:3,flip'))\n"
            "np.save(sys.argv[1], x)\n")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"})
    theirs = np.load(out)
    ours, _ = make_views(small, KEYS_I, KEYS_V, seed=SEED, augment=Augment.parse("crop:3,flip"))
    assert np.array_equal(theirs[::-1], ours)


def test_teacher_side_and_student_side_see_the_same_views():
    """The producer fills keys in key order (index = key // V, view = key % V, in batches of 7);
    the student follows the schedule (a scalar view per epoch, batches of 5); each side loads
    the data set and parses the augmentation itself."""
    n, views, seed, spec = 20, 3, 123, "crop:2,flip"
    teacher_ds, student_ds = load_dataset(SPEC.replace("n=64", f"n={n}")), load_dataset(SPEC.replace("n=64", f"n={n}"))
    teacher = {}
    keys = np.arange(n * views)
    for a in range(0, keys.size, 7):
        k = keys[a:a + 7]
        teacher.update(views_by_key(teacher_ds, k // views, k % views, Augment.parse(spec), seed=seed))
    seen = 0
    for st in schedule(seed, views, n, 5, views):
        student = views_by_key(student_ds, st.indices, st.view, Augment.parse(spec), seed=seed)
        for key, x in student.items():
            assert np.array_equal(x, teacher[key]), key
            seen += 1
    assert seen == n * views


def test_views_of_one_sample_differ(small):
    idx = np.arange(64)
    for spec, lo, hi in (("crop:4,flip", 0.9, 1.0), ("flip", 0.25, 0.75), ("crop:2", 0.8, 1.0)):
        aug = Augment.parse(spec)
        v0, _ = make_views(small, idx, 0, seed=SEED, augment=aug)
        v1, _ = make_views(small, idx, 1, seed=SEED, augment=aug)
        differ = np.mean([not np.array_equal(a, b) for a, b in zip(v0, v1)])
        assert lo <= differ <= hi, (spec, differ)
    # another seed gives other views too
    a, _ = make_views(small, idx, 0, seed=SEED, augment=Augment.parse("crop:4,flip"))
    for other in (SEED + 1, SEED + (1 << 32)):  # every bit of a 64-bit seed counts
        b, _ = make_views(small, idx, 0, seed=other, augment=Augment.parse("crop:4,flip"))
        assert np.mean([not np.array_equal(p, q) for p, q in zip(a, b)]) > 0.9


def test_no_augmentation_returns_the_samples_unchanged(small):
    x, y = small.get_batch(KEYS_I)
    for aug in (Augment(), Augment.parse("none"), Augment.parse("")):
        assert aug == Augment() and not aug.active
        for v in (0, 1, 2):
            xv, yv = make_views(small, KEYS_I, v, seed=SEED, augment=aug)
            assert np.array_equal(xv, x) and np.array_equal(yv, y)


def test_crop_is_a_window_of_the_zero_padded_image(small):
    pad = 3
    aug = Augment.parse(f"crop:{pad}")
    idx, v = np.arange(64), np.arange(64) % 5
    x, _ = small.get_batch(idx)
    out, _ = make_views(small, idx, v, seed=SEED, augment=aug)
    assert out.shape == x.shape and out.dtype == np.float32
    dy, dx, flip = aug.params(SEED, idx, v)
    assert not flip.any()
    assert set(dy.tolist()) == set(dx.tolist()) == set(range(2 * pad + 1))  # every offset is used
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    for k in range(64):
        assert np.array_equal(out[k], padded[k, :, dy[k]:dy[k] + 12, dx[k]:dx[k] + 10])


def test_flip_reverses_the_last_axis_exactly(small):
    aug = Augment.parse("flip")
    idx = np.arange(64)
    x, _ = small.get_batch(idx)
    out, _ = make_views(small, idx, 2, seed=SEED, augment=aug)
    _, _, flip = aug.params(SEED, idx, 2)
    assert 0 < flip.sum() < 64
    for k in range(64):
        assert np.array_equal(out[k], x[k][:, :, ::-1] if flip[k] else x[k])


def test_params_of_a_key_do_not_depend_on_the_batch():
    aug = Augment.parse("crop:4,flip")
    r = np.random.default_rng(5)
    idx, v = r.integers(0, 10 ** 6, 200), r.integers(0, 8, 200)
    batch = aug.params(SEED, idx, v)
    for k in range(0, 200, 13):
        alone = aug.params(SEED, [idx[k]], [v[k]])
        assert [p[0] for p in alone] == [p[k] for p in batch]
    rev = aug.params(SEED, idx[::-1], v[::-1])
    assert all(np.array_equal(a[::-1], b) for a, b in zip(rev, batch))


def test_augment_spec_parsing():
    assert Augment.parse("crop:4,flip") == Augment(4, True) and Augment(4, True).spec == "crop:4,flip"
    assert Augment.parse(" Flip ") == Augment(0, True) and Augment.parse("crop:2") == Augment(2, False)
    assert Augment.parse(Augment(3, True).spec) == Augment(3, True) and Augment().spec == "none"
    for bad in ("crop:x", "rotate", "crop:-1", "crop", "crop:4,rotate", "crop:"):
        with pytest.raises(ValueError) as e:
            Augment.parse(bad)
        assert repr(bad.strip().lower()) in str(e.value)
        assert "crop:PAD" in str(e.value) and "flip" in str(e.value), str(e.value)
    for bad in ("mixup:0", "mixup:-1", "mixup:abc", "crop:4,mixup:0.2,cutmix:1", "mixup", "crop:4,flip,cutmix"):
        with pytest.raises(ValueError) as e:
            Augment.parse(bad)
        assert repr(bad) in str(e.value) and ("mixup" in bad) == ("mixup" in str(e.value)), str(e.value)
        assert "ALPHA" in str(e.value) and "e.g." in str(e.value), str(e.value)


# --- the schedule ---------------------------------------------------------------------------
def test_permutation_is_the_same_in_another_process(tmp_path):
    out = tmp_path / "perm.npy"
    code = ("import sys, numpy as np\n"
            "from kdcache.pipeline.schedule import epoch_permutation\n"
            "np.save(sys.argv[1], np.stack([epoch_permutation(7, e, 1000) for e in range(3)]))\n")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, timeout=120,
                   env={**os.environ, "PYTHONPATH": ROOT})
    assert np.array_equal(np.load(out), np.stack([epoch_permutation(7, e, 1000) for e in range(3)]))


def test_permutations_differ_by_epoch_and_seed():
    p = epoch_permutation(7, 0, 1000)
    assert np.array_equal(np.sort(p), np.arange(1000)) and not np.array_equal(p, np.arange(1000))
    assert np.array_equal(p, epoch_permutation(7, 0, 1000))
    assert not np.array_equal(p, epoch_permutation(7, 1, 1000))
    assert not np.array_equal(p, epoch_permutation(8, 0, 1000))


def test_epoch_batches_cover_every_index_once():
    b = epoch_batches(3, 2, 103, 10)
    assert [len(x) for x in b] == [10] * 10 + [3]
    assert np.array_equal(np.concatenate(b), epoch_permutation(3, 2, 103))
    assert np.array_equal(np.sort(np.concatenate(b)), np.arange(103))
    assert [len(x) for x in epoch_batches(3, 2, 100, 10)] == [10] * 10


def test_schedule_steps_positions_and_views():
    n, bs, epochs, views = 23, 5, 7, 3
    steps = list(schedule(11, epochs, n, bs, views))
    assert [s.position for s in steps] == list(range(epochs * 5))
    for e in range(epochs):
        mine = [s for s in steps if s.epoch == e]
        assert [s.step for s in mine] == list(range(5))
        assert all(s.view == e % views for s in mine)
        assert all(np.array_equal(s.indices, b) for s, b in zip(mine, epoch_batches(11, e, n, bs)))
    # resuming at an epoch continues the same steps
    resumed = list(schedule(11, epochs, n, bs, views, start_epoch=4))
    assert [(s.epoch, s.step, s.position, s.view) for s in resumed] == \
        [(s.epoch, s.step, s.position, s.view) for s in steps[20:]]
