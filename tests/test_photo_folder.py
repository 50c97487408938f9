"""A photo-folder user's first hour, through the real commands: a teacher trained on photos of different sizes
(--image-size, the keyed views, a line per epoch, a word when it is near chance), verify --teacher reading what
the cache records, and the PNG decoder's warnings kept off the terminal."""
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import CHILD_ENV

EPOCH_LINE = re.compile(r"epoch (\d+)/(\d+)  loss [\d.]+  train acc [01]\.\d{4}  test acc [01]\.\d{4}  [\d.]+ s$")


def kdcache(cwd, *argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=cwd, timeout=timeout)


def one_error_line(r):
    """Exit 2 with exactly one line, an error naming the cause, and no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr[-3000:])
    lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("[")]  # the log's own lines
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


def teacher_flags():
    from kdcache.trainer.make_teacher import TEACHER
    return {o.flag for o in TEACHER} | {"--help"}


@pytest.fixture(scope="module")
def photos(tmp_path_factory):
    """Real colour photos of 300-500 px, no two alike in size (bench.decode's set, from opencv-doc's and
    scikit-learn's photographs), in 3 classes drawn at random: root/train/<class> (24) and root/test (12)."""
    from bench.decode.photos import make_photos
    d = tmp_path_factory.mktemp("photos")
    make_photos(str(d / "raw"), 36)
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(d / "raw") for f in fs)
    labels = np.random.default_rng(5).permutation(np.arange(36) % 3)
    for k, (path, lab) in enumerate(zip(files, labels)):
        split = "test" if k % 3 == 0 else "train"
        os.makedirs(d / "folder" / split / f"class{lab}", exist_ok=True)
        shutil.copy(path, d / "folder" / split / f"class{lab}" / os.path.basename(path))
    return d


def test_teacher_trains_on_photos_of_different_sizes_through_the_keyed_views(photos):
    root = photos / "folder"
    r = kdcache(photos, "teacher", "--dataset", "imagefolder", "--data-root", root, "--epochs", 1, "--out", "t/x")
    line = one_error_line(r)
    assert "--image-size" in line  # the fix it names is an option the command takes
    assert set(re.findall(r"--[a-z][a-z0-9-]*", line)) <= teacher_flags(), line
    assert len(line) < 400, line  # one readable line, not every size of the folder

    r = kdcache(photos, "teacher", "--dataset", "imagefolder", "--data-root", root, "--image-size", "16x16",
                "--epochs", 3, "--arch", "small_cnn", "--out", "t/photos")
    assert r.returncode == 0, r.stderr[-3000:]
    epochs = [EPOCH_LINE.search(ln) for ln in r.stderr.splitlines()]
    assert [(int(m.group(1)), int(m.group(2))) for m in epochs if m] == [(1, 3), (2, 3), (3, 3)], r.stderr
    info = json.loads((photos / "t" / "photos-info.json").read_text())
    assert info["augment"] == "rrc:16,flip" and info["image_size"] == [16, 16]  # the data set's usual views
    # Random classes: the teacher cannot beat guessing, and says so in one line (and in its info file).
    near = [ln for ln in r.stderr.splitlines() if "near chance" in ln]
    assert len(near) == 1 and info["near_chance"] is True, r.stderr
    assert f"{info['test_acc']:.4f}" in near[0] and "--epochs" in near[0]
    assert set(re.findall(r"--[a-z][a-z0-9-]*", near[0])) <= teacher_flags()
    # The teacher takes the images the cache and the student see: 3x16x16.
    r = kdcache(photos, "cache", "--dataset", "imagefolder", "--data-root", root, "--image-size", "16x16",
                "--teacher", "t/photos", "--cache-dir", "caches", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_teacher_above_chance_is_not_called_near_it_and_quiet_has_no_epoch_lines(tmp_path):
    r = kdcache(tmp_path, "teacher", "--epochs", 3, "--quiet", "--out", "t/digits")
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads((tmp_path / "t" / "digits-info.json").read_text())
    assert info["test_acc"] > 0.5 and info["near_chance"] is False and info["augment"] == "crop:1"
    assert "near chance" not in r.stderr and not any(EPOCH_LINE.search(ln) for ln in r.stderr.splitlines())


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=400), st.integers(10, 12))
def test_near_chance_is_within_two_standard_errors_of_the_most_common_class(labels, classes):
    from kdcache.trainer.make_teacher import NEAR_CHANCE, chance_level
    n = len(labels)
    p0 = max(1 / classes, max(labels.count(c) for c in set(labels)) / n)
    se = (p0 * (1 - p0) / n) ** 0.5
    for acc in (0.0, p0 / 2, p0):  # guessing the most common class, or worse
        assert chance_level(labels, classes, acc)[0]
    near, chance, threshold = chance_level(labels, classes, min(1.0, p0 + NEAR_CHANCE * se + 1e-9))
    assert chance == pytest.approx(p0) and threshold == pytest.approx(p0 + NEAR_CHANCE * se)
    assert not near or p0 + NEAR_CHANCE * se + 1e-9 > 1.0
    if threshold < 1.0:
        assert not chance_level(labels, classes, 1.0)[0]  # a perfect teacher is never near chance


def test_verify_reads_the_data_root_and_image_size_the_cache_records(photos, tmp_path):
    from tests.helpers import gluon_teacher
    root = tmp_path / "folder"
    shutil.copytree(photos / "folder", root)
    gluon_teacher(str(tmp_path / "t8"), classes=3, in_ch=3)
    r = kdcache(tmp_path, "cache", "--dataset", "imagefolder", "--data-root", root, "--image-size", "8x8",
                "--teacher", "t8", "--cache-dir", "caches", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    path = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = kdcache(elsewhere, "verify", path, "--teacher", tmp_path / "t8", "--sample", "all", "--json")  # nothing re-asked
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["teacher_check"]["keys_checked"] == 24
    # An explicit value that disagrees with the record: refused, naming both.
    line = one_error_line(kdcache(tmp_path, "verify", path, "--teacher", "t8", "--image-size", "9x8"))
    assert "--image-size 8x8" in line and "9x8" in line
    shutil.copytree(root, tmp_path / "copy")
    line = one_error_line(kdcache(tmp_path, "verify", path, "--teacher", "t8", "--data-root", "copy"))
    assert str(root) in line and "copy" in line
    # The same values are accepted; a moved folder is named, and read from where it is now.
    r = kdcache(tmp_path, "verify", path, "--teacher", "t8", "--data-root", root, "--image-size", "8x8")
    assert r.returncode == 0, r.stderr[-3000:]
    os.rename(root, tmp_path / "moved")
    line = one_error_line(kdcache(tmp_path, "verify", path, "--teacher", "t8"))
    assert str(root) in line and "gone" in line and "--data-root" in line
    r = kdcache(tmp_path, "verify", path, "--teacher", "t8", "--data-root", "moved")
    assert r.returncode == 0, r.stderr[-3000:]
    # What the cache records: where, and the size; a conversion of it records the same.
    import h5py
    r = kdcache(tmp_path, "convert", path, "--codec", "topk:2", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    converted = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    for p in (path, converted):
        with h5py.File(p, "r") as f:
            assert json.loads(f.attrs["sources_json"]) == {"data_root": str(root), "image_size": [8, 8]}


@pytest.fixture(scope="module")
def iccp_pngs(tmp_path_factory):
    """PNGs carrying an ICC profile libpng rejects (`libpng warning: iCCP: too short` at every decode)."""
    from PIL import Image
    d = tmp_path_factory.mktemp("iccp")
    rng = np.random.default_rng(0)
    for split, n in (("train", 12), ("test", 4)):
        for c in "ab":
            os.makedirs(d / "pngs" / split / c)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(
                    d / "pngs" / split / c / f"{i}.png", icc_profile=b"abc")
    return d


def test_the_png_decoder_s_warnings_never_reach_the_terminal(iccp_pngs, tmp_path):
    from tests.helpers import gluon_teacher
    root = iccp_pngs / "pngs"
    # The files do make libpng warn, in a plain MXNet decode.
    code = f"import mxnet as mx; mx.image.imread({str(root / 'train' / 'a' / '0.png')!r}).asnumpy()"
    plain = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=CHILD_ENV, timeout=120)
    assert "libpng warning: iCCP" in plain.stderr
    gluon_teacher(str(tmp_path / "t8"), classes=2, in_ch=3)
    runs = {"teacher": kdcache(tmp_path, "teacher", "--dataset", "imagefolder", "--data-root", root, "--epochs", 2,
                               "--arch", "small_cnn", "--out", "t/png")}
    for workers in (0, 1):
        runs[f"cache, {workers} decode workers"] = kdcache(
            tmp_path, "cache", "--dataset", "imagefolder", "--data-root", root, "--teacher", "t8", "--cache-dir",
            f"c{workers}", "--decode-workers", workers, "--json")
    runs["train"] = kdcache(tmp_path, "train", "--dataset", "imagefolder", "--data-root", root, "--teacher", "t8",
                            "--cache-dir", "c0", "--student", "mlp", "--epochs", 1, "--run", "r", "--quiet")
    for what, r in runs.items():
        assert r.returncode == 0, (what, r.stderr[-3000:])
        assert "libpng" not in r.stderr, (what, r.stderr[-3000:])
        assert re.search(r"\[(teacher|producer|trainer)", r.stderr), (what, r.stderr)  # the tools' own lines stay


def test_other_output_during_a_decode_still_reaches_stderr():
    code = ("import os, sys\n"
            "from kdcache.pipeline.quiet import decoder_output\n"
            "print('before', file=sys.stderr)\n"
            "with decoder_output():\n"
            "    os.write(2, b'libpng warning: iCCP: too short\\nkept 1\\n')\n"
            "    with decoder_output():\n"
            "        print('kept 2', file=sys.stderr)\n"
            "        os.write(2, b'Corrupt JPEG data: 3 extraneous bytes before marker 0xd9\\n')\n"
            "    os.write(2, b'kept 3\\n')\n"
            "print('after', file=sys.stderr)\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    with decoder_output():\n"
            "        os.write(2, b'libpng warning: child\\nchild kept\\n')\n"
            "    os._exit(0)\n"
            "os.waitpid(pid, 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=CHILD_ENV, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stderr.splitlines() == ["before", "kept 1", "kept 2", "kept 3", "after", "child kept"], r.stderr


@pytest.mark.slow
def test_the_images_page_s_teacher_line_runs_on_a_photo_folder(photos, tmp_path):
    """docs/images.md's `kdcache teacher` line for photos, as written (one epoch instead of 30), on real photos."""
    import shlex
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "images.md")).read()
    section = text.split("## Your photos: a teacher, its cache, its check")[1].split("\n## ")[0]
    first = re.findall(r"```sh\n(.*?)```", section, re.S)[0]  # the next one is --classes' (test_classes.py)
    (line,) = [ln for ln in first.splitlines() if ln.strip()]
    assert "--epochs 30" in line and "--image-size" in line
    os.symlink(photos / "folder", tmp_path / "photos")
    argv = shlex.split(line.replace("--epochs 30", "--epochs 1"))
    assert argv[0] == "kdcache"
    r = kdcache(tmp_path, *argv[1:])
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m for m in map(EPOCH_LINE.search, r.stderr.splitlines()) if m]
    assert json.loads((tmp_path / "teachers" / "photos-info.json").read_text())["augment"] == "rrc:64,flip"
