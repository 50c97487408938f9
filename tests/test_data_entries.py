"""A user's data files read as their owner meant: an image folder's train/ and test/ hold the same class
folders (labels are places in the sorted list), a training class is never empty, an entry under an
image's (or a .rec's, an IDX's) name that is no regular file is refused in one line and never read in a
way that can block, and a RecordIO .idx lists every record of its .rec exactly once with labels that are
class indices. Real files: FIFOs made with os.mkfifo, links to /dev/zero, sockets, RecordIO written by
MXNet's own writer. Whatever can hang runs in a child process under a time limit, so a regression fails
instead of hanging."""
import os
import shutil
import socket
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from PIL import Image

from kdcache.pipeline import DatasetError, load_dataset
from tests.datafiles import dataset_error, make_folder, make_mnist, png_bytes, write_rec
from tests.helpers import CHILD_ENV, ROOT

LIMIT_S = 60  # a load of a few files takes ~2 s; a FIFO opened for reading waits forever


def child(code, timeout=LIMIT_S):
    """Run `code` (Python) in a child process under a time limit; (exit status, stdout, stderr)."""
    try:
        r = subprocess.run([sys.executable, "-c", code], env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout} s: a read blocked\n{code}")
    return r.returncode, r.stdout, r.stderr


def load_in_child(name, root, split="train", then=""):
    """load_dataset in a child under LIMIT_S; the DatasetError's message, or 'ok <len>'."""
    code = (f"from kdcache.pipeline import DatasetError, load_dataset\n"
            f"try:\n    ds = load_dataset({name!r}, data_root={str(root)!r}, split={split!r})\n{then}"
            f"    print('ok', len(ds))\nexcept DatasetError as e:\n    print('refused', e)\n")
    code_, out, err = child(code)
    assert code_ == 0 and "Traceback" not in err, err
    lines = out.strip().splitlines()
    assert len(lines) == 1, out  # one line
    return lines[0]


def kdcache_teacher(root, tmp_path):
    """`kdcache teacher` on an image folder (it loads both splits first): (status, stderr)."""
    try:
        r = subprocess.run([sys.executable, "-m", "kdcache", "teacher", "--dataset", "imagefolder", "--data-root",
                            str(root), "--out", str(tmp_path / "t"), "--epochs", "1"], env=CHILD_ENV, cwd=ROOT,
                           capture_output=True, text=True, timeout=LIMIT_S * 2)
    except subprocess.TimeoutExpired:
        pytest.fail("kdcache teacher still running: a read blocked")
    return r.returncode, r.stderr


def split_folder(root, classes=("ant", "moth", "zebra"), test_classes=None, per_class=2, empty=()):
    """root/train/<class>/ and root/test/<class>/ of small PNGs (class c's pixels are all c * 40)."""
    test_classes = classes if test_classes is None else test_classes
    every = sorted(set(classes) | set(test_classes))
    for split, names in (("train", classes), ("test", test_classes)):
        for name in names:
            d = os.path.join(root, split, name)
            os.makedirs(d, exist_ok=True)
            if (split, name) in empty:
                continue
            for k in range(per_class):
                Image.fromarray(np.full((4, 3, 3), (every.index(name) * 40 + k) % 256,
                                        np.uint8)).save(os.path.join(d, f"{k}.png"))
    return str(root)


# --- train/ and test/ hold the same class folders ---------------------------------------------
def test_an_extra_training_class_folder_is_refused_naming_it_for_both_splits_and_the_command(tmp_path):
    """The reproduced case: train/aardvark with one image shifted every training label by one
    against test/ (test accuracy 0.325, no word)."""
    root = split_folder(tmp_path / "d")
    os.makedirs(tmp_path / "d" / "train" / "aardvark")
    shutil.copy(tmp_path / "d" / "train" / "ant" / "0.png", tmp_path / "d" / "train" / "aardvark" / "0.png")
    for split in ("train", "test"):
        msg = dataset_error(lambda: load_dataset("imagefolder", data_root=root, split=split),
                            root, "train/ has aardvark (not in test/)", "give train/ and test/ the same class folders")
        assert "\n" not in msg
    code, err = kdcache_teacher(root, tmp_path)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith("error: ") and "train/ has aardvark (not in test/)" in err


def test_a_class_folder_only_in_test_is_named_too(tmp_path):
    root = split_folder(tmp_path / "d", test_classes=("ant", "bee", "moth", "zebra"))
    dataset_error(lambda: load_dataset("imagefolder", data_root=root), "test/ has bee (not in train/)")


def test_an_empty_training_class_folder_is_refused_and_an_empty_test_one_said(tmp_path, caplog):
    root = split_folder(tmp_path / "d", empty=(("train", "moth"),))
    dataset_error(lambda: load_dataset("imagefolder", data_root=root), os.path.join(root, "train", "moth"),
                  "a class folder with no images", "put its images in it, or remove that class")
    shutil.rmtree(tmp_path / "d")
    root = split_folder(tmp_path / "d", empty=(("test", "moth"),))
    caplog.set_level("WARNING", logger="kdcache.pipeline")
    test = load_dataset("imagefolder", data_root=root, split="test")
    assert sorted(set(test.labels.tolist())) == [0, 2] and test.num_classes == 3
    assert any("moth holds no images" in r.getMessage() for r in caplog.records), caplog.text


NAMES = ("ant", "bee", "cat", "dog", "eel")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(train=st.sets(st.sampled_from(NAMES), min_size=1), test=st.sets(st.sampled_from(NAMES), min_size=1),
       empty=st.sets(st.tuples(st.sampled_from(("train", "test")), st.sampled_from(NAMES))))
def test_labels_agree_between_splits_or_the_folder_is_refused(tmp_path_factory, train, test, empty):
    """Oracle from the layout: sound when both splits hold the same class folders and no training
    class is empty; then every image's label is its class's place in the shared sorted list, in both
    splits (class c's pixels say which class it is). Otherwise refused in one line naming a folder."""
    root = split_folder(tmp_path_factory.mktemp("f"), sorted(train), sorted(test), per_class=1, empty=empty)
    every = sorted(train | test)
    for split, names in (("train", train), ("test", test)):
        refused = (train != test or all((split, c) in empty for c in names)
                   or (split == "train" and any(("train", c) in empty for c in train)))
        if refused:
            msg = dataset_error(lambda: load_dataset("imagefolder", data_root=root, split=split))
            assert "\n" not in msg and "folder" in msg, msg
            continue
        ds = load_dataset("imagefolder", data_root=root, split=split)
        assert ds.num_classes == len(train) and ds.identity()["classes"] == sorted(train)
        x, y = ds.get_batch(np.arange(len(ds)))
        for xi, yi in zip(x, y):  # the class whose pixels the file holds is the class its label names
            assert int(round(xi.flat[0] * 255)) // 40 == every.index(sorted(train)[yi])


# --- entries that are not regular files --------------------------------------------------------
def plant(path, kind, target=None):
    """A FIFO, socket, link to /dev/zero, dangling link, folder, or link to a regular file at `path`."""
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(path))
        s.close()
    elif kind == "zero":
        os.symlink("/dev/zero", path)
    elif kind == "dangling":
        os.symlink(os.path.join(os.path.dirname(path), "gone.png"), path)
    elif kind == "folder":
        os.mkdir(path)
    elif kind == "link":
        os.symlink(target, path)


WHAT = {"fifo": "a FIFO", "socket": "a socket", "zero": "a symbolic link to /dev/zero, a character device",
        "dangling": "a dangling symbolic link", "folder": "a folder"}


@pytest.mark.parametrize("kind", list(WHAT))
def test_an_image_entry_that_is_no_regular_file_is_refused_in_one_line_never_read(tmp_path, kind):
    make_folder(tmp_path / "d")
    bad = tmp_path / "d" / "moth" / "x.png"
    plant(bad, kind)
    line = load_in_child("imagefolder", tmp_path / "d")
    assert line.startswith("refused ") and str(bad) in line and WHAT[kind] in line and "remove it" in line, line
    code, err = kdcache_teacher(tmp_path / "d", tmp_path)
    assert code == 2 and "Traceback" not in err and WHAT[kind] in err.strip().splitlines()[-1], err


def test_a_link_to_a_regular_photo_is_read_as_the_photo(tmp_path):
    made = make_folder(tmp_path / "d")
    os.symlink(tmp_path / "d" / "ant" / "img0.png", tmp_path / "d" / "moth" / "img9.png")
    ds = load_dataset("imagefolder", data_root=str(tmp_path / "d"))
    assert len(ds) == 7
    i = [p for p, _ in ds.items].index(str(tmp_path / "d" / "moth" / "img9.png"))
    x, y = ds[i]
    assert y == ds.classes.index("moth")
    np.testing.assert_array_equal(np.rint(x * 255).astype(np.uint8), made["ant"][0][1].transpose(2, 0, 1))


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_photo_swapped_for_a_fifo_after_loading_is_refused_where_it_is_decoded(tmp_path, kind):
    """Decoding opens each image again (in the producer, its decode workers, the teacher's trainer):
    the same rule holds there, in a worker process too."""
    make_folder(tmp_path / "d")
    swap = "os.mkfifo(p)" if kind == "fifo" else "os.symlink('/dev/zero', p)"
    code, out, err = child(f"""
import os
from kdcache.pipeline import DatasetError, load_dataset
from kdcache.pipeline.augment import Augment
from kdcache.pipeline.decode_workers import Decoder
ds = load_dataset('imagefolder', data_root={str(tmp_path / 'd')!r})
p = ds.items[3][0]
os.unlink(p)
{swap}
for workers in (0, 1):
    with Decoder(ds, seed=0, augment=Augment(), workers=workers) as d:
        try:
            d.take(d.submit(range(len(ds)), 0))
        except DatasetError as e:
            print('workers', workers, e)
""")
    assert code == 0 and "Traceback" not in err, err
    lines = out.strip().splitlines()
    assert len(lines) == 2, out
    for w, line in zip((0, 1), lines):
        assert line.startswith(f"workers {w} ") and WHAT[kind] in line, out


@pytest.mark.parametrize("kind", ["fifo", "zero"])
def test_a_rec_idx_or_idx_file_that_is_no_regular_file_is_refused(tmp_path, kind):
    img = np.zeros((4, 4, 3), np.uint8)
    os.makedirs(tmp_path / "r")
    rec = write_rec(tmp_path / "r" / "train.rec", [img, img], [0, 1])
    for victim in (rec, rec[:-4] + ".idx"):
        keep = victim + ".keep"
        os.rename(victim, keep)
        plant(victim, kind)
        line = load_in_child("recordio", rec)
        assert line.startswith("refused ") and victim in line and WHAT[kind] in line, line
        os.unlink(victim)
        os.rename(keep, victim)
    assert load_in_child("recordio", rec) == "ok 2"
    make_mnist(tmp_path / "m")
    victim = str(tmp_path / "m" / "train-labels-idx1-ubyte")
    os.unlink(victim)
    plant(victim, kind)
    line = load_in_child("mnist", tmp_path / "m")
    assert line.startswith("refused ") and victim in line and WHAT[kind] in line, line


# --- a RecordIO index covers its records exactly once --------------------------------------------
def rec_of(tmp_path, n=12, labels=None):
    """A .rec of n tiny PNGs written by MXNet's MXIndexedRecordIO; (rec path, [(key, offset)], labels)."""
    r = np.random.default_rng(n)
    labels = list(np.arange(n) % 3) if labels is None else labels
    rec = str(tmp_path / "d.rec")
    w = mx.recordio.MXIndexedRecordIO(rec[:-4] + ".idx", rec, "w")
    for i, lab in enumerate(labels):
        w.write_idx(i, mx.recordio.pack(mx.recordio.IRHeader(0, float(lab), i, 0),
                                        png_bytes(r.integers(0, 256, (3, 2, 3), dtype=np.uint8))))
    w.close()
    index = [tuple(int(v) for v in line.split("\t")) for line in open(rec[:-4] + ".idx").read().splitlines()]
    return rec, index, labels


def write_index(rec, lines):
    with open(rec[:-4] + ".idx", "w") as fh:
        fh.writelines(f"{k}\t{o}\n" for k, o in lines)


def test_the_reproduced_index_missing_five_of_48_records_is_refused(tmp_path):
    rec, index, _ = rec_of(tmp_path, 48)
    write_index(rec, index[:20] + index[25:])
    dataset_error(lambda: load_dataset("recordio", data_root=rec), "lists 43 of the 48 records",
                  f"the first at offset {index[20][1]}", "rebuild the .rec and its .idx together")


@pytest.mark.parametrize("case", ["key twice", "offset twice", "past the end", "inside a record", "garbage after"])
def test_an_index_that_does_not_cover_its_records_exactly_once_is_refused_naming_the_record(tmp_path, case):
    rec, index, _ = rec_of(tmp_path)
    size = os.path.getsize(rec)
    lines, needles = list(index), []
    if case == "key twice":
        lines.append(index[4])
        needles = ["record key 4 is listed twice"]
    elif case == "offset twice":
        lines.append((99, index[4][1]))
        needles = ["records 4 and 99 both point at offset"]
    elif case == "past the end":
        lines[5] = (5, size + 100)
        needles = ["record 5 at offset", "is past the end"]
    elif case == "inside a record":
        lines[5] = (5, index[5][1] + 8)
        needles = ["record 5 at offset", "points inside another record"]
    else:
        with open(rec, "ab") as fh:
            fh.write(b"\x01" * 16)
        needles = [f"offset {size} (after record 11)", "no RecordIO record starts there"]
    write_index(rec, lines)
    msg = dataset_error(lambda: load_dataset("recordio", data_root=rec), *needles)
    assert "\n" not in msg


@pytest.mark.parametrize("label,num_classes,needle", [(1.7, None, "label 1.7 is not a whole number"),
                                                      (-1.0, None, "label -1 is negative"),
                                                      (float("nan"), None, "label nan is not a number"),
                                                      (float(1 << 25), None, "label 33554432 is past the 16,777,216 classes"),
                                                      (3.0, 3, "label 3 is not below --num-classes 3")])
def test_a_label_that_is_no_class_index_is_refused_naming_the_record(tmp_path, label, num_classes, needle):
    rec, _, _ = rec_of(tmp_path, 6, [0, 1, 2, 1, label, 0])
    msg = dataset_error(lambda: load_dataset("recordio", data_root=rec, num_classes=num_classes), rec,
                        f"record 4: {needle}")
    assert "\n" not in msg


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_an_index_is_read_exactly_when_it_names_each_record_once(tmp_path_factory, data):
    """Any .idx drawn from the true one (lines dropped, repeated, shuffled, keys renamed, an offset
    moved): accepted exactly when its offsets are the records' starts, each once, under unique keys,
    and then each key serves the record its offset names; otherwise one line naming the index."""
    tmp = tmp_path_factory.mktemp("r")
    rec, index, labels = rec_of(tmp, 8, [0, 1, 2, 0, 1, 2, 0, 1])
    label_at = {o: labels[k] for k, o in index}
    lines = data.draw(st.lists(st.sampled_from(index), max_size=10), label="lines") if data.draw(
        st.booleans(), label="redraw") else data.draw(st.permutations(index), label="order")
    lines = [(data.draw(st.sampled_from([k, k, k + 100]), label="key"), o + data.draw(
        st.sampled_from([0, 0, 0, 0, 4, -4]), label="shift")) for k, o in lines]
    write_index(rec, lines)
    keys, offsets = [k for k, _ in lines], [o for _, o in lines]
    valid = (len(set(keys)) == len(keys) and sorted(offsets) == sorted(label_at))
    if not valid:
        msg = dataset_error(lambda: load_dataset("recordio", data_root=rec), rec[:-4])
        assert "\n" not in msg
        return
    ds = load_dataset("recordio", data_root=rec)
    assert ds.keys == keys and ds.labels.tolist() == [label_at[o] for o in offsets]
    for i, (k, o) in enumerate(lines):
        assert ds[i][1] == label_at[o]
