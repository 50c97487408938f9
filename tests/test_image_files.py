"""The user's files end to end: a data set written out as PNG files (kdcache.pipeline.export), packed into
RecordIO by MXNet's own im2rec, read back pixel for pixel, and trained on with a resize, keyed views and a
model-zoo student; docs/images.md's walk-through runs as written from a folder outside the clone."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from tests.helpers import CHILD_ENV, ROOT

FASHION = "/usr/share/datasets/fashion-mnist"
HAVE_FASHION = os.path.exists(os.path.join(FASHION, "train-images-idx3-ubyte.gz"))
# Without the Debian package dataset-fashion-mnist the tests use the embedded mnist5k digits instead.
SOURCE = (["--dataset", "fashion-mnist", "--data-root", FASHION] if HAVE_FASHION else ["--dataset", "mnist5k"])
VENV_BIN = os.path.dirname(sys.executable)
ENV = {k: v for k, v in CHILD_ENV.items() if k != "PYTHONPATH"}  # the installed package, as a user has it
ENV["PATH"] = VENV_BIN + os.pathsep + ENV.get("PATH", "")


def have_cv2():
    try:
        import cv2  # noqa: F401
        return True
    except ImportError:
        return False


needs_cv2 = pytest.mark.skipif(not have_cv2(), reason="MXNet's im2rec imports OpenCV: install the test extra "
                                                      "(opencv-python-headless)")


def im2rec():
    import mxnet
    return os.path.join(os.path.dirname(mxnet.__file__), "tools", "im2rec.py")


def run(args, cwd, timeout=600):
    r = subprocess.run(args, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def export(out, per_class):
    return run([sys.executable, "-m", "kdcache.pipeline.export", *SOURCE, "--out", str(out), "--per-class",
                str(per_class)], cwd=os.path.dirname(str(out)))


def pack(folder, rec_dir):
    """im2rec: the .lst in the folders' sorted order (the image folder's labels), then the .rec with the
    files' own bytes."""
    os.makedirs(rec_dir, exist_ok=True)
    for split in ("train", "test"):
        prefix = os.path.join(rec_dir, split)
        run([sys.executable, im2rec(), "--list", "--recursive", "--no-shuffle", prefix, os.path.join(folder, split)],
            cwd=rec_dir)
        run([sys.executable, im2rec(), "--pass-through", prefix, os.path.join(folder, split)], cwd=rec_dir)


def source(split):
    from kdcache.pipeline.datasets import load_dataset
    return load_dataset(SOURCE[1], data_root=SOURCE[3] if HAVE_FASHION else None, split=split)


def test_the_export_holds_the_data_sets_pixels_and_labels(tmp_path):
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.pipeline.export import chosen
    out = tmp_path / "fm"
    export(out, 5)
    for split in ("train", "test"):
        src = source(split)
        idx = chosen(src.labels, 5)
        want_x, want_y = src.get_batch(idx)
        got = load_dataset("imagefolder", data_root=str(out), split=split)
        assert len(got) == len(idx) == 5 * src.num_classes and got.num_classes == src.num_classes
        x, y = got.get_batch(np.arange(len(got)))
        # Folder order is class, then index: the export's order sorted by (label, index).
        order = np.lexsort((idx, want_y))
        assert np.array_equal(y, want_y[order])
        assert np.array_equal(np.rint(x * 255), np.repeat(np.rint(want_x[order] * 255), 3, axis=1))  # grey as RGB


@needs_cv2
def test_im2rec_packs_the_export_into_the_same_images(tmp_path):
    from kdcache.pipeline.datasets import load_dataset
    export(tmp_path / "fm", 5)
    pack(str(tmp_path / "fm"), str(tmp_path / "rec"))
    for split in ("train", "test"):
        folder = load_dataset("imagefolder", data_root=str(tmp_path / "fm"), split=split)
        rec = load_dataset("recordio", data_root=str(tmp_path / "rec"), split=split)
        a, b = folder.get_batch(np.arange(len(folder))), rec.get_batch(np.arange(len(rec)))
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def walkthrough():
    """The ```sh blocks of docs/images.md's walk-through, in order."""
    text = open(os.path.join(ROOT, "docs", "images.md")).read()
    part = text.split("<!-- walkthrough -->")[1]
    return re.findall(r"```sh\n(.*?)```", part, re.S)


@pytest.mark.slow
def test_the_docs_walkthrough_trains_on_files_from_a_folder_outside_the_clone(tmp_path):
    """Export -> image folder -> kdcache train (--image-size, rrc views, mobilenet0.25); export -> im2rec
    -> kdcache train --dataset recordio (resnet18_v1): as docs/images.md shows them, with 30 images
    per class instead of 200 (seconds, not minutes), and mnist5k where Fashion-MNIST is not installed."""
    if not have_cv2():
        pytest.skip("MXNet's im2rec imports OpenCV: install the test extra (opencv-python-headless)")
    script = "set -euo pipefail\n" + "\n".join(walkthrough())
    assert "--per-class 200" in script and "kdcache train --dataset recordio" in script
    script = script.replace("--per-class 200", "--per-class 30")
    if not HAVE_FASHION:
        script = script.replace(f"--dataset fashion-mnist --data-root {FASHION}", "--dataset mnist5k")
    r = run(["bash", "-c", script], cwd=str(tmp_path), timeout=1200)
    runs = [json.loads(line) for line in r.stdout.splitlines() if line.startswith("{")]
    assert [(m["dataset"], m["student"]) for m in runs] == [("imagefolder", "mobilenet0.25"),
                                                             ("recordio", "resnet18_v1")], r.stdout[-2000:]
    for m in runs:
        assert m["teacher_forwards"] == 300 and m["epochs"] == 1 and 0 <= m["test_acc"] <= 1
    assert not os.path.exists(os.path.join(ROOT, "fm"))  # nothing written into the clone
