"""ImageNet-style keyed views: rrc:SIZE (RandomResizedCrop) and the evaluation transform (center:SIZE,
eval:RESIZE/SIZE). Their parameters come from the key alone, the producer's pixels are the trainer's
bit for bit, rrc's boxes keep to the scale and ratio ranges, the eval transform is a plain resize and
centre crop, and the specs are canonical."""
import argparse
import json
import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kdcache.pipeline.augment import Augment, _fallback, eval_views, make_views
from kdcache.pipeline.datasets import load_dataset
from tests.helpers import CHILD_ENV, ROOT

SPEC = "synthetic:n=64,classes=4,shape=3x13x10,seed=3"
SEED = (1 << 33) + 7
KEYS_I = np.array([5, 0, 63, 17, 17, 42, 8, 33, 5, 60])
KEYS_V = np.array([0, 1, 2, 0, 3, 1, 1, 2, 4, 0])
BUILT_IN = ["rrc:7x5", "rrc:6,flip", "rrc:5x4,scale=0.35-1,ratio=0.5-2,flip", "center:5x4", "eval:11/9"]


@pytest.fixture(scope="module")
def small():
    return load_dataset(SPEC)


def by_key(ds, indices, views, spec):
    x, _ = make_views(ds, indices, views, seed=SEED, augment=Augment.parse(spec))
    return {(int(i), int(v)): x[k] for k, (i, v) in enumerate(zip(indices, np.broadcast_to(views, len(indices))))}


@pytest.mark.parametrize("spec", BUILT_IN)
def test_a_view_depends_on_its_key_alone(small, spec):
    """The same key gives the same pixels in another batch, in another order, alone."""
    a = by_key(small, KEYS_I, KEYS_V, spec)
    order = np.random.default_rng(0).permutation(len(KEYS_I))
    b = by_key(small, np.concatenate([[1, 2, 50], KEYS_I[order]]), np.concatenate([[0, 3, 1], KEYS_V[order]]), spec)
    for (i, v), x in a.items():
        assert np.array_equal(x, b[(i, v)]) and np.array_equal(x, by_key(small, np.array([i]), v, spec)[(i, v)])
    assert all(x.shape == Augment.parse(spec).out_shape(small.shape) for x in a.values())
    if Augment.parse(spec).varies:  # views of one sample differ, the box too
        assert not np.array_equal(a[(17, 0)], a[(17, 3)]) or not np.array_equal(a[(5, 0)], a[(5, 4)])
    else:
        assert np.array_equal(a[(17, 0)], a[(17, 3)])


def test_rrc_boxes_do_not_depend_on_the_batch():
    aug = Augment.parse("rrc:224,flip")
    r = np.random.default_rng(5)
    idx, v = r.integers(0, 10 ** 6, 300), r.integers(0, 8, 300)
    batch = aug.rrc_params(SEED, idx, v, 300, 450)
    rev = aug.rrc_params(SEED, idx[::-1], v[::-1], 300, 450)
    assert all(np.array_equal(a[::-1], b) for a, b in zip(rev, batch))
    for k in range(0, 300, 17):
        assert [int(p[0]) for p in aug.rrc_params(SEED, [idx[k]], [v[k]], 300, 450)] == [int(p[k]) for p in batch]
    assert len(set(zip(*batch))) > 290  # boxes differ from key to key


def test_another_process_builds_the_same_pixels(small, tmp_path):
    out = tmp_path / "views.npz"
    code = ("import sys, numpy as np\n"
            "from kdcache.pipeline.augment import Augment, make_views\n"
            "from kdcache.pipeline.datasets import load_dataset\n"
            f"ds = load_dataset({SPEC!r})\n"
            f"i, v = np.array({KEYS_I[::-1].tolist()}), np.array({KEYS_V[::-1].tolist()})\n"
            f"np.savez(sys.argv[1], **{{s: make_views(ds, i, v, seed={SEED}, augment=Augment.parse(s))[0] "
            f"for s in {BUILT_IN!r}}})\n")
    subprocess.run([sys.executable, "-c", code, str(out)], cwd=ROOT, check=True, timeout=120, env=CHILD_ENV)
    theirs = np.load(out)
    for spec in BUILT_IN:
        ours, _ = make_views(small, KEYS_I, KEYS_V, seed=SEED, augment=Augment.parse(spec))
        assert np.array_equal(theirs[spec][::-1], ours), spec


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(st.integers(4, 500), st.integers(4, 500), st.floats(0.01, 1.0), st.floats(0.01, 1.0),
       st.floats(0.2, 5.0), st.floats(0.2, 5.0), st.integers(0, 2 ** 64 - 1))
def test_rrc_boxes_keep_to_the_scale_and_ratio_ranges(height, width, s0, s1, r0, r1, seed):
    """Every box lies in the image; its area fraction and aspect ratio are in the ranges up to the
    rounding of w and h to whole pixels, or it is torchvision's fallback centre crop."""
    scale, ratio = (min(s0, s1), max(s0, s1)), (min(r0, r1), max(r0, r1))
    aug = Augment(size=(8, 8), scale=scale, ratio=ratio)
    top, left, h, w = aug.rrc_params(seed, np.arange(200), 3, height, width)
    assert (h >= 1).all() and (w >= 1).all() and (top >= 0).all() and (left >= 0).all()
    assert (top + h <= height).all() and (left + w <= width).all()
    fallback = _fallback(height, width, ratio)
    area = height * width
    for t, l, hh, ww in zip(top, left, h, w):
        if (t, l, hh, ww) == fallback:
            continue
        # w = round(sqrt(T a)), h = round(sqrt(T / a)) for T in area * scale, a in ratio
        assert (ww - 0.5) * (hh - 0.5) <= scale[1] * area + 1e-9 and (ww + 0.5) * (hh + 0.5) >= scale[0] * area - 1e-9
        assert (ww - 0.5) / (hh + 0.5) <= ratio[1] + 1e-12 and (ww + 0.5) / (hh - 0.5 if hh > 0.5 else 1e-9) >= \
            ratio[0] - 1e-12


def torchvision_rrc(height, width, rng, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)):
    """torchvision's RandomResizedCrop.get_params with an ordinary generator: (area fraction, w / h)."""
    area, lr = height * width, (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target, aspect = area * rng.uniform(*scale), math.exp(rng.uniform(*lr))
        w, h = int(round(math.sqrt(target * aspect))), int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return h * w / area, w / h
    return None


def test_rrc_statistics_are_torchvisions():
    """Over many keys of a 300x450 image the area fractions and aspect ratios are distributed as
    torchvision's own RandomResizedCrop draws them (its algorithm with Python's generator)."""
    import random
    aug = Augment.parse("rrc:224")
    top, left, h, w = aug.rrc_params(SEED, np.arange(4000), 0, 300, 450)
    frac, ar = h * w / (300 * 450), w / h
    rng = random.Random(0)
    ref = [r for r in (torchvision_rrc(300, 450, rng) for _ in range(20000)) if r is not None]
    ref_frac, ref_ar = np.array([r[0] for r in ref]), np.array([r[1] for r in ref])
    assert 0.0795 <= frac.min() < 0.1 and frac.max() > 0.85  # at most 400x300 of 450x300 within ratio 4/3
    assert ar.min() < 0.76 and ar.max() > 1.32 and ((ar > 0.74) & (ar < 1.35)).all()
    qs = np.linspace(0.05, 0.95, 19)
    assert np.abs(np.quantile(frac, qs) - np.quantile(ref_frac, qs)).max() < 0.03
    assert np.abs(np.quantile(np.log(ar), qs) - np.quantile(np.log(ref_ar), qs)).max() < 0.03
    assert np.mean((top == 0) & (left == 25) & (h == 300) & (w == 400)) < 0.01  # the fallback is rare
    assert left.max() > 200 and top.max() > 100 and left.min() == 0 and top.min() == 0


def bilinear_reference(img, out_h, out_w, box=None):
    """Per-pixel bilinear resize (half-pixel centres, clamped to the box), float64, loops: the definition."""
    c, height, width = img.shape
    top, left, bh, bw = box or (0, 0, height, width)
    out = np.zeros((c, out_h, out_w))
    p = img[:, top:top + bh, left:left + bw].astype(np.float64)
    for i in range(out_h):
        sy = min(max((i + 0.5) * bh / out_h - 0.5, 0), bh - 1)
        y0 = int(math.floor(sy))
        y1, fy = min(y0 + 1, bh - 1), sy - math.floor(sy)
        for j in range(out_w):
            sx = min(max((j + 0.5) * bw / out_w - 0.5, 0), bw - 1)
            x0 = int(math.floor(sx))
            x1, fx = min(x0 + 1, bw - 1), sx - math.floor(sx)
            out[:, i, j] = (p[:, y0, x0] * (1 - fy) * (1 - fx) + p[:, y0, x1] * (1 - fy) * fx
                            + p[:, y1, x0] * fy * (1 - fx) + p[:, y1, x1] * fy * fx)
    return out


def eval_reference(img, resize, crop):
    """torchvision's Resize(resize) (short side; long = int(resize * long / short)) then CenterCrop(crop)
    (zero padding where the crop is larger), with the bilinear of the definition."""
    _, height, width = img.shape
    rh, rw = (resize, int(resize * width / height)) if height <= width else (int(resize * height / width), resize)
    big = bilinear_reference(img, rh, rw)
    pad_y, pad_x = max(0, crop[0] - rh), max(0, crop[1] - rw)
    big = np.pad(big, ((0, 0), (pad_y // 2, pad_y - pad_y // 2), (pad_x // 2, pad_x - pad_x // 2)))
    top, left = int(round((big.shape[1] - crop[0]) / 2.0)), int(round((big.shape[2] - crop[1]) / 2.0))
    return big[:, top:top + crop[0], left:left + crop[1]]


@pytest.mark.parametrize("spec,resize,crop,shape", [
    ("center:224", 256, (224, 224), (3, 300, 450)), ("eval:256/224", 256, (224, 224), (3, 450, 300)),
    ("eval:9/8x6", 9, (8, 6), (1, 13, 10)), ("center:7x5", 6, (7, 5), (3, 5, 4)),
    ("eval:20/20x28", 20, (20, 28), (3, 20, 22))])  # a crop wider than the resized image is padded
def test_the_eval_transform_is_a_resize_and_centre_crop(spec, resize, crop, shape):
    aug = Augment.parse(spec)
    assert (aug.resize, aug.center) == (resize, crop) and not aug.varies
    x = np.random.default_rng(1).random((2, *shape), dtype=np.float32)
    out = aug.apply(x, 0, [0, 1], [0, 5])
    assert out.shape == (2, shape[0], *crop) and out.dtype == np.float32
    np.testing.assert_allclose(out[0], eval_reference(x[0], resize, crop), rtol=0, atol=2e-6)
    u8 = (x * 255).astype(np.uint8)  # integer images: computed in float32, rounded to the nearest
    out8 = aug.apply(u8, 0, [0, 1], 0)
    assert out8.dtype == np.uint8
    assert np.abs(out8[1].astype(float) - eval_reference(u8[1], resize, crop)).max() <= 0.5 + 1e-4


def test_rrc_is_the_box_resized_then_flipped():
    aug = Augment.parse("rrc:12x9,flip")
    x = np.random.default_rng(2).random((6, 3, 30, 45), dtype=np.float32)
    idx = np.arange(6) * 11
    out = aug.apply(x, SEED, idx, 2)
    boxes = np.stack(aug.rrc_params(SEED, idx, 2, 30, 45), axis=1)
    flip = aug.params(SEED, idx, 2)[2]
    assert 0 < flip.sum() < 6
    for k in range(6):
        ref = bilinear_reference(x[k], 12, 9, tuple(int(b) for b in boxes[k]))
        np.testing.assert_allclose(out[k], ref[:, :, ::-1] if flip[k] else ref, rtol=0, atol=2e-6)


def test_a_model_trained_on_rrc_is_evaluated_on_the_centre_crop(small):
    test = eval_views(small, Augment.parse("rrc:7x5,flip"))
    x, y = test.get_batch(np.arange(4))
    assert x.shape == (4, 3, 7, 5) and test.shape == (3, 7, 5) and len(test) == len(small)
    assert np.array_equal(x, Augment.parse("center:7x5").apply(small.get_batch(np.arange(4))[0], 0, [0] * 4, 0))
    assert eval_views(small, Augment.parse("crop:2,flip")) is small


# --- specs: canonical, checked at the door -----------------------------------------------------
@pytest.mark.parametrize("a,b", [
    ("rrc:224", "RRC:224x224, scale=0.08-1.0, ratio=3/4-4/3"), ("rrc:224,flip", "flip,rrc:224"),
    ("rrc:224,scale=0.35-1,ratio=0.75-1.33", "rrc:224,ratio=.75-1.33,scale=0.35-1.0"),
    ("center:224", "eval:256/224"), ("center:7x5", "eval:6/7x5")])
def test_two_spellings_name_one_cache(a, b):
    from kdcache.pipeline.cachespec import build_spec
    from kdcache.pipeline.datasets import load_dataset as load
    ds = load("synthetic:n=10,classes=3,shape=1x8x8")
    pa, pb = Augment.parse(a), Augment.parse(b)
    assert pa == pb and pa.spec == pb.spec and Augment.parse(pa.spec) == pa
    assert build_spec("t", ds, views=1, augment=pa, seed=3).fingerprint == \
        build_spec("t", ds, views=1, augment=pb, seed=3).fingerprint
    assert "0.08" not in pa.spec and "3/4" not in pa.spec  # defaults are left out


def test_the_eval_transform_does_not_depend_on_the_seed():
    from kdcache.pipeline.cachespec import build_spec
    ds = load_dataset("synthetic:n=10,classes=3,shape=1x8x8")
    fp = {build_spec("t", ds, augment=Augment.parse("center:8"), seed=s).fingerprint for s in (0, 1, 99)}
    rrc = {build_spec("t", ds, augment=Augment.parse("rrc:8"), seed=s).fingerprint for s in (0, 1, 99)}
    assert len(fp) == 1 and len(rrc) == 3


@pytest.mark.parametrize("bad", ["rrc:0", "rrc:0x5", "rrc:x", "rrc:224,scale=0-1", "rrc:224,scale=0.2-1.5",
                                 "rrc:224,scale=0.9-0.5", "rrc:224,ratio=0-1", "rrc:224,ratio=2-1",
                                 "rrc:224,ratio=-1-1", "rrc:224,foo=1", "scale=0.5-1", "rrc:8,crop:2",
                                 "center:0", "center:8,flip", "eval:256", "eval:100/224", "rrc:99999"])
def test_bad_specs_are_one_line_at_the_door(bad):
    from kdcache.pipeline.options import AugmentSpec
    with pytest.raises(argparse.ArgumentTypeError) as e:
        AugmentSpec()(bad)
    assert "\n" not in str(e.value) and len(str(e.value)) < 400


def test_bad_spec_on_the_command_line_exits_2_with_one_line(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kdcache", "cache", "--augment", "rrc:224,scale=0.9-0.5"],
                       capture_output=True, text=True, env=CHILD_ENV, cwd=tmp_path, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "scale" in r.stderr and "Traceback" not in r.stderr


# --- the producer's pixels are the trainer's ---------------------------------------------------
def identity_teacher(prefix, size):
    """A teacher whose logits are its input image, flattened: a cache of it holds the producer's pixels."""
    import mxnet as mx
    from mxnet import gluon
    net = gluon.nn.HybridSequential(prefix="id_")
    with net.name_scope():
        net.add(gluon.nn.Flatten(), gluon.nn.Dense(size, in_units=size))
    net.initialize()
    net[1].weight.set_data(mx.nd.array(np.eye(size, dtype=np.float32)))
    net[1].bias.set_data(mx.nd.zeros(size))
    net.hybridize()
    net(mx.nd.zeros((1, size)))
    net.export(prefix, epoch=0)


@pytest.mark.slow
@pytest.mark.parametrize("spec,views", [("rrc:6x5,flip", 3), ("rrc:6x5,scale=0.2-0.6,ratio=0.5-2", 2),
                                        ("center:6x5", 1), ("crop:2,flip", 2)])
def test_the_trainers_pixels_are_the_producers(tmp_path, spec, views):
    """kdcache cache runs a teacher whose logits are its input's pixels: the cache holds what the
    producer saw. SoftTargetDataset in a Gluon DataLoader with 2 worker processes rebuilds each
    item's view: its pixels equal the cached ones bit for bit, every view."""
    from mxnet import gluon

    from kdcache.trainer import SoftTargetDataset
    shape = Augment.parse(spec).out_shape((3, 13, 10))
    size = int(np.prod(shape))
    data = f"synthetic:n=40,classes={size},shape=3x13x10,seed=4"
    prefix = str(tmp_path / "identity")
    identity_teacher(prefix, size)
    r = subprocess.run([sys.executable, "-m", "kdcache", "cache", "--teacher", prefix, "--dataset", data,
                        "--views", str(views), "--augment", spec, "--seed", "11", "--dtype", "float32",
                        "--cache-dir", str(tmp_path / "caches"), "--threads", "1", "--quiet", "--json"],
                       env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    cache = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    ds = SoftTargetDataset(load_dataset(data), cache, seed=11, views=views, augment=spec)
    loader = gluon.data.DataLoader(ds, batch_size=7, shuffle=True, num_workers=2, last_batch="keep")
    for epoch in range(views):
        ds.set_epoch(epoch)
        seen = 0
        for x, _, soft in loader:
            x, soft = x.asnumpy(), soft.asnumpy()
            assert x.shape[1:] == shape
            assert np.array_equal(x.reshape(len(x), -1), soft), (spec, epoch)  # bit for bit
            seen += len(x)
        assert seen == 40


def resampled_view(x, resize, crop):
    """center_view by resampling always (its general path): the reference for its crop-alone path."""
    from kdcache.pipeline.augment import _as_dtype, _resample, _resized_axis
    b, c, height, width = x.shape
    rh, rw = (resize, int(resize * width / height)) if height <= width else (int(resize * height / width), resize)
    top, left = int(round((rh - crop[0]) / 2.0)), int(round((rw - crop[1]) / 2.0))
    out = np.zeros((b, c, *crop), dtype=x.dtype)
    oy, ox = np.arange(max(0, -top), min(crop[0], rh - top)), np.arange(max(0, -left), min(crop[1], rw - left))
    if oy.size and ox.size:
        ys, xs = _resized_axis(top + oy, rh, height), _resized_axis(left + ox, rw, width)
        for k in range(b):
            out[k][:, oy[0]:oy[-1] + 1, ox[0]:ox[-1] + 1] = _as_dtype(_resample(x[k], ys, xs), x.dtype)
    return out


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(h=st.integers(1, 24), w=st.integers(1, 24), ch=st.integers(1, 40), cw=st.integers(1, 40),
       dtype=st.sampled_from(["float32", "uint8"]), seed=st.integers(0, 2 ** 16))
def test_the_eval_transform_of_an_image_already_at_its_size_is_the_resampled_one_bit_for_bit(h, w, ch, cw, dtype,
                                                                                              seed):
    """When the short side is RESIZE already (as after --image-size), the view is made by cropping
    alone: the same bytes as resampling it, for every size, crops larger than the image included."""
    from kdcache.pipeline.augment import center_view
    r = np.random.default_rng(seed)
    x = r.random((2, 3, h, w), dtype=np.float32) * 2 - 0.5
    x = x if dtype == "float32" else (r.random((2, 3, h, w)) * 255).astype(np.uint8)
    got = center_view(x, min(h, w), (ch, cw))
    assert got.dtype == x.dtype and got.tobytes() == resampled_view(x, min(h, w), (ch, cw)).tobytes()
