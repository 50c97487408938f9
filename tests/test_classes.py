"""--classes on the image files: only the classes named, labelled in the order given, in the data set's
identity (so the cache is its own), through the producer, the trainer's own producer and verify --teacher."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.datafiles import make_folder, make_rec
from tests.helpers import CHILD_ENV, gluon_teacher
from tests.test_photo_folder import one_error_line


def kdcache(cwd, *argv, timeout=600):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=cwd, timeout=timeout)


# --- the option's type: the oracle is the documented grammar ---------------------------------------
WORD = st.text(st.characters(blacklist_characters=",", blacklist_categories=("Cs",)), min_size=0, max_size=6)


@settings(max_examples=300, deadline=None)
@given(st.lists(WORD, min_size=1, max_size=5))
def test_class_names_take_every_valid_list_and_refuse_the_rest(words):
    import argparse
    from kdcache.args import ClassNames
    text = ",".join(words)
    names = [w.strip() for w in words]
    valid = all(names) and len(set(names)) == len(names) >= 2 and \
        not any(c == "/" or ord(c) < 32 or ord(c) == 127 for n in names for c in n)  # the documented grammar
    try:
        got = ClassNames()(text)
    except argparse.ArgumentTypeError as e:
        assert not valid, (text, str(e))  # a valid list refused is a failure
        assert "\n" not in str(e)
        return
    assert valid and got == tuple(names), text
    assert ClassNames()(ClassNames.format(got)) == got  # written back, read the same


@pytest.mark.parametrize("text,names", [("cat,dog", ("cat", "dog")), (" cat , dog ", ("cat", "dog")),
                                        ("0,3,7", ("0", "3", "7")), ("n01440764,n01443537", ("n01440764", "n01443537")),
                                        ("Hund,Katze mit Hut,ñandú", ("Hund", "Katze mit Hut", "ñandú"))])
def test_class_names_a_user_writes_are_taken(text, names):
    from kdcache.args import ClassNames
    assert ClassNames()(text) == names


@pytest.mark.parametrize("text", ["cat", "cat,,dog", "cat,cat", "a/b,c", ",", "", "cat,d\nog"])
def test_class_names_refusals_say_what_to_use(text):
    import argparse
    from kdcache.args import ClassNames
    with pytest.raises(argparse.ArgumentTypeError) as e:
        ClassNames()(text)
    assert "class" in str(e.value)


# --- the data sets ----------------------------------------------------------------------------------
def test_an_image_folder_keeps_the_classes_named_in_their_order(tmp_path):
    from kdcache.pipeline.datasets import load_dataset
    written = make_folder(str(tmp_path))
    every = load_dataset("imagefolder", data_root=str(tmp_path))
    two = load_dataset("imagefolder", data_root=str(tmp_path), classes=("moth", "ant"))
    assert every.classes == ["ant", "moth", "zebra"] and two.classes == ["moth", "ant"]
    assert len(two) == len(written["moth"]) + len(written["ant"]) and two.num_classes == 2
    # each image keeps its pixels and gets its class's place in the list given
    for i in range(len(two)):
        x, y = two[i]
        path = two.items[i][0]
        j = [p for p, _ in every.items].index(path)
        assert np.array_equal(x, every[j][0])
        assert y == ["moth", "ant"].index(os.path.basename(os.path.dirname(path)))
    ids = {c: load_dataset("imagefolder", data_root=str(tmp_path), classes=c).identity()
           for c in (("moth", "ant"), ("ant", "moth"), ("ant", "moth", "zebra"))}
    assert ids[("moth", "ant")]["classes"] == ["moth", "ant"]
    assert len({json.dumps(v, sort_keys=True) for v in ids.values()}) == 3
    assert ids[("ant", "moth", "zebra")] == every.identity()  # all of them, in the folder's order: the same set


def test_a_recordio_file_keeps_the_labels_named_renumbered(tmp_path):
    from kdcache.pipeline.datasets import load_dataset
    rec, x, y = make_rec(str(tmp_path))
    every = load_dataset("recordio", data_root=rec)
    two = load_dataset("recordio", data_root=rec, classes=("2", "0"))
    assert list(y) == [2, 0, 1, 2, 1, 0]
    assert two.num_classes == 2 and list(two.labels) == [0, 1, 0, 1]
    assert [two.keys[i] for i in range(len(two))] == [0, 1, 3, 5]
    for i, k in enumerate(two.keys):
        assert np.array_equal(two[i][0], every[k][0])
    assert two.identity()["classes"] == ["2", "0"] and "classes" not in every.identity()  # older caches keep theirs
    assert two.identity()["digest"] == every.identity()["digest"]


@pytest.mark.parametrize("kind,classes,said", [
    ("imagefolder", ("moth", "cat"), "no class folder cat"),
    ("recordio", ("2", "x"), "'x' is not a label number"),
    ("recordio", ("2", "02"), "'02' is not a label number"),
    ("recordio", ("2", "7"), "has label 7"),
    ("digits", ("0", "1"), "takes all of its own classes"),
])
def test_classes_a_data_set_does_not_have_are_refused(tmp_path, kind, classes, said):
    from kdcache.pipeline.datasets import DatasetError, load_dataset
    root = {"imagefolder": lambda: (make_folder(str(tmp_path)), str(tmp_path))[1],
            "recordio": lambda: make_rec(str(tmp_path))[0], "digits": lambda: None}[kind]()
    with pytest.raises(DatasetError) as e:
        load_dataset(kind, data_root=root, classes=classes)
    assert said in str(e.value) and "\n" not in str(e.value)


def test_the_python_door_reads_classes_as_the_option_does(tmp_path):
    import kdcache
    make_folder(str(tmp_path))
    a = kdcache.load_dataset("imagefolder", data_root=str(tmp_path), classes="moth, ant")
    b = kdcache.load_dataset("imagefolder", data_root=str(tmp_path), classes=["moth", "ant"])
    assert a.identity() == b.identity() and a.classes == ["moth", "ant"]
    with pytest.raises(kdcache.KdcacheError, match="at least two"):
        kdcache.load_dataset("imagefolder", data_root=str(tmp_path), classes="moth")


# --- through the commands ---------------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "photos"
    for split in ("train", "test"):
        make_folder(str(root / split))
    gluon_teacher(str(tmp_path / "t2"), classes=2, in_ch=3)
    return root


def cache(cwd, root, *extra):
    r = kdcache(cwd, "cache", "--dataset", "imagefolder", "--data-root", root, "--image-size", "8x8",
                "--teacher", "t2", "--cache-dir", "caches", "--quiet", "--json", *extra)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_a_cache_of_chosen_classes_is_its_own_and_verify_reads_them_again(folder, tmp_path):
    import h5py
    moth_ant = cache(tmp_path, folder, "--classes", "moth,ant")
    assert moth_ant["rows_written"] == 4
    assert cache(tmp_path, folder, "--classes", "ant,moth")["fingerprint"] != moth_ant["fingerprint"]
    assert cache(tmp_path, folder, "--classes", "moth,ant")["rows_written"] == 0  # the same cache again
    with h5py.File(moth_ant["cache_path"], "r") as f:
        assert json.loads(f.attrs["sources_json"])["classes"] == ["moth", "ant"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    r = kdcache(elsewhere, "verify", moth_ant["cache_path"], "--teacher", tmp_path / "t2", "--sample", "all",
                "--json")  # nothing re-asked: the folder, the size and the classes are the cache's record
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout)["teacher_check"]["keys_checked"] == 4


def test_the_trainer_hands_classes_to_its_own_producer(folder, tmp_path):
    r = kdcache(tmp_path, "train", "--dataset", "imagefolder", "--data-root", folder, "--image-size", "8x8",
                "--classes", "zebra,moth", "--teacher", "t2", "--student", "small_cnn", "--epochs", 1,
                "--batch-size", 2, "--val-fraction", 0, "--cache-dir", "caches", "--runs-dir", "runs", "--json")
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    started = [ln for ln in r.stderr.splitlines() if "starting producer: -m kdcache.cache_builder" in ln]
    assert out["producer_started"] and started and all("--classes=zebra,moth" in ln for ln in started), r.stderr
    # the cache it filled is the one `kdcache cache --classes zebra,moth` names, already whole
    again = cache(tmp_path, folder, "--classes", "zebra,moth")
    assert again["fingerprint"] == out["fingerprint"] and again["rows_written"] == 0


@pytest.mark.parametrize("argv,said", [
    (["--dataset", "digits", "--classes", "0,1"], "--classes"),
    (["--dataset", "imagefolder", "--data-root", "{root}", "--image-size", "8x8", "--classes", "moth,cat"],
     "no class folder cat"),
    (["--dataset", "imagefolder", "--data-root", "{root}", "--classes", "moth"], "at least two"),
])
def test_a_wrong_classes_is_one_line_on_every_command(folder, tmp_path, argv, said):
    argv = [a.replace("{root}", str(folder)) for a in argv]
    for command in (["cache", "--teacher", "t2"], ["train", "--teacher", "t2", "--epochs", "1"],
                    ["teacher", "--epochs", "1", "--out", "t/x"]):
        line = one_error_line(kdcache(tmp_path, *command, *argv))
        assert said in line, (command, line)
    assert not os.path.exists(tmp_path / "caches") or not os.listdir(tmp_path / "caches")


@pytest.mark.slow
def test_the_images_page_s_classes_lines_run_on_a_photo_folder(tmp_path):
    """docs/images.md's two --classes lines, as written (one epoch instead of 30), on real photos in folders
    named as the page names them, from a folder outside the clone."""
    import re
    import shlex
    import shutil
    from bench.decode.photos import make_photos
    text = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                             "images.md")).read()
    section = text.split("## Your photos: a teacher, its cache, its check")[1].split("\n## ")[0]
    (block,) = [b for b in re.findall(r"```sh\n(.*?)```", section, re.S) if "--classes" in b]
    lines = [ln for ln in block.splitlines() if ln.strip()]
    make_photos(str(tmp_path / "raw"), 18)
    files = sorted(os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "raw") for f in fs)
    for k, path in enumerate(files):
        split, cls = ("test" if k % 3 == 0 else "train"), ("ant", "moth", "zebra")[(k // 3) % 3]
        os.makedirs(tmp_path / "photos" / split / cls, exist_ok=True)
        shutil.copy(path, tmp_path / "photos" / split / cls / os.path.basename(path))
    for line in lines:
        argv = shlex.split(line.replace("--epochs 30", "--epochs 1"))
        assert argv[0] == "kdcache"
        r = kdcache(tmp_path, *argv[1:], "--quiet")
        assert r.returncode == 0, (line, r.stderr[-3000:])
    info = json.loads((tmp_path / "teachers" / "moth-ant-info.json").read_text())
    assert info["classes"] == ["moth", "ant"]
    cached = [f for f in os.listdir(tmp_path / "caches") if f.endswith(".h5")]
    assert len(cached) == 1
