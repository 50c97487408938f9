"""The seal of a finished cache (store.format.seal): no bit of a cache file outside its rows can hang, crash or
mislead a tool. Every bit outside the rows is flipped through the one door every tool opens a finished
file by (segment.open_final); thousands of them through every tool, in a child process under a time
limit; the HDF5 library is never handed a damaged sealed file. Files written before seals are read
by a child process first (store.files.probe), so a damaged old file cannot take a tool down either."""
import json
import os
import re
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader, path_for
from kdcache.store.format import schema, seal
from kdcache.store.errors import DamagedFileError
from kdcache.store.files.segment import open_final
from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, as_format_1, flip, make_spec, produce

TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"
CODECS = [("full", "float16"), ("topk:3", "float16"), ("int8", "float16"), ("sampled:4", "float16")]
TOOL_FLIPS = 2500 if TORTURE else 250  # per codec, through every tool (and 40 of the user block's unread zeros)


def finished(folder, codec, dtype, samples=60, views=2):
    spec = make_spec(num_samples=samples, num_classes=12, views=views, codec=codec, dtype=dtype, tag="seal")
    folder.mkdir(parents=True, exist_ok=True)
    p = path_for(str(folder), spec.fingerprint)
    assert produce(p, spec)
    return p, spec


def outside_rows(fin):
    """[(offset, harmless)] of every byte the seal covers or that lies in the user block: all but the
    ranges it leaves out. `harmless`: the user block's zeros after the seal's record, which nothing reads."""
    fd = os.open(fin, os.O_RDONLY)
    try:
        rec = seal.check(fd, fin)
        head = os.pread(fd, seal.SEAL_BYTES, 0)
    finally:
        os.close(fd)
    record_end = 24 + int.from_bytes(head[16:20], "little")
    skip = np.zeros(rec["size"], dtype=bool)
    for off, n in rec["skip"]:
        skip[off:off + n] = True
    return [(at, seal.SEAL_BYTES > at >= record_end) for at in np.flatnonzero(~skip).tolist()]


@pytest.mark.parametrize("codec, dtype", CODECS)
def test_every_flipped_bit_outside_the_rows_is_refused_before_hdf5_reads_the_file(tmp_path, codec, dtype):
    """4,000 random bits of the bytes HDF5 would parse, per codec (every bit of every such byte in `make
    torture`: about 154,000), and 512 bits of the user block's unread zeros."""
    p, _ = finished(tmp_path / "c", codec, dtype)
    fin = p + ".h5"
    places = outside_rows(fin)
    assert len(places) > 4096 and sum(h for _, h in places) < seal.SEAL_BYTES
    rng = np.random.default_rng(7)
    zeros = [pl for pl in places if pl[1]]
    read = [pl for pl in places if not pl[1]]
    every = TORTURE
    flips = [(at, bit, False) for at, _ in read for bit in range(8)] if every else \
        [(read[i][0], int(rng.integers(8)), False) for i in rng.choice(len(read), 4000, replace=False)]
    flips += [(zeros[i][0], bit, True) for i in rng.choice(len(zeros), 64, replace=False) for bit in range(8)]
    counts = {"refused": 0, "harmless": 0}
    opened = []
    real_file = h5py.File

    def watch(*a, **k):  # the HDF5 library is handed the file only once its seal matched
        opened.append(a[0])
        return real_file(*a, **k)
    h5py.File = watch
    try:
        for at, bit, harmless in flips:
            flip(fin, at, bit)
            try:
                if harmless:
                    open_final(fin).close()  # zeros after the seal's record: read by nobody
                    counts["harmless"] += 1
                else:
                    n = len(opened)
                    with pytest.raises(DamagedFileError):
                        open_final(fin).close()
                    assert len(opened) == n, f"bit {bit} of byte {at}: HDF5 opened a file whose seal failed"
                    counts["refused"] += 1
            finally:
                flip(fin, at, bit)
    finally:
        h5py.File = real_file
    open_final(fin).close()
    print(f"{codec}/{dtype}: {counts} of {len(read):,} bytes HDF5 would read")
    assert counts["refused"] == sum(not h for _, _, h in flips) and counts["harmless"] == 512


@pytest.mark.slow
@pytest.mark.parametrize("codec, dtype", CODECS)
def test_thousands_of_flipped_bits_through_every_tool_never_hang_crash_or_pass(tmp_path, codec, dtype):
    p, spec = finished(tmp_path / "c", codec, dtype)
    fin = p + ".h5"
    with CacheReader(p) as r:
        rows = np.stack([r.get(np.arange(spec.num_samples), v) for v in range(spec.views)])
    np.savez(tmp_path / "rows.npz", rows=rows)
    places = outside_rows(fin)
    read, zeros = [pl for pl in places if not pl[1]], [pl for pl in places if pl[1]]
    rng = np.random.default_rng(sum(map(ord, codec)))
    bits = [[read[i][0], int(rng.integers(8)), False] for i in rng.choice(len(read), TOOL_FLIPS, replace=False)]
    bits += [[zeros[i][0], int(rng.integers(8)), True] for i in rng.choice(len(zeros), 40, replace=False)]
    (tmp_path / "bits.json").write_text(json.dumps(bits))
    out = tmp_path / "out.json"
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "tests.flipsweep", fin, tmp_path / "rows.npz", tmp_path / "bits.json",
                        out], cwd=ROOT, env=CHILD_ENV, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]  # a signal (SIGSEGV) or a hang (timeout) fails here
    res = json.loads(out.read_text())
    print(f"{codec}/{dtype}: {res['flips']} flips in {time.monotonic() - t0:.0f} s: {json.dumps(res['counts'])}")
    assert res["baseline"] == {"ls": "listed complete", "inspect": "ok", "verify": "sound", "gc": "keeps",
                               "reader": "same rows", "reuse": "complete"}
    assert res["failures"] == [], res["failures"][:5]
    damaged = sum(not h for _, _, h in bits)
    assert res["counts"]["verify"].get("NOT sound", 0) == damaged
    assert res["counts"]["gc"].get("would remove", 0) == damaged  # a damaged cache goes; gc itself survives


def kdcache(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=ROOT, timeout=timeout)


def test_the_command_line_on_a_damaged_cache_one_line_each_and_verify_exits_1(tmp_path):
    p, _ = finished(tmp_path / "c", "full", "float16")
    fin, d = p + ".h5", str(tmp_path / "c")
    places = [at for at, harmless in outside_rows(fin) if not harmless]
    for at in (places[0], places[len(places) // 2], places[-1]):  # the seal, the superblock area, the end
        flip(fin, at, 2)
        try:
            r = kdcache("verify", fin)
            assert r.returncode == 1 and "NOT sound" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
            r = kdcache("inspect", fin)
            assert r.returncode == 2 and len(r.stderr.splitlines()) == 1 and "damaged" in r.stderr or \
                "seal" in r.stderr, r.stderr
            r = kdcache("ls", "--cache-dir", d)
            assert r.returncode == 0 and "damaged" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
        finally:
            flip(fin, at, 2)
    r = kdcache("verify", fin)
    assert r.returncode == 0 and "sound" in r.stdout
    r = kdcache("verify", str(tmp_path / "nothing"))  # could not check
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    flip(fin, places[len(places) // 2], 5)
    r = kdcache("gc", "--cache-dir", d)
    assert r.returncode == 0 and not os.path.exists(fin), r.stdout + r.stderr  # removed as damaged


def test_a_renamed_checksum_table_cannot_switch_checking_off(tmp_path):
    """Renaming `checksums` in the file (a flipped bit in its name) once made verify say "sound, no
    checksums" and the reader serve changed rows; now the seal refuses the rename, and a sealed file
    without the table is refused even when its seal is made to match."""
    p, spec = finished(tmp_path / "c", "full", "float16")
    fin = p + ".h5"
    with h5py.File(fin, "r+") as f:
        f.move(schema.CHECKSUMS, "checksumz")
    with pytest.raises(DamagedFileError, match="seal"):
        CacheReader(p)
    from tests.helpers import seal_again
    seal_again(fin)
    with pytest.raises(DamagedFileError, match="without its checksums"):
        CacheReader(p)
    from kdcache.store.folder.verify import verify
    assert "without its checksums" in verify(p)[1][0]


def test_a_file_of_a_sealed_format_without_its_seal_is_refused(tmp_path):
    p, _ = finished(tmp_path / "c", "full", "float16")
    fin = p + ".h5"
    with open(fin, "r+b") as fh:  # the seal's magic gone: the file would read as an unsealed one...
        fh.write(b"\0" * 16)
    with pytest.raises(DamagedFileError, match="seal"):
        CacheReader(p)
    as_format_1(fin)
    with h5py.File(fin, "r+") as f:  # ...and an unsealed file that claims the sealed format is refused
        f.attrs[schema.A_FORMAT] = schema.SEALED_SINCE
    with pytest.raises(DamagedFileError, match="promises a seal"):
        CacheReader(p)


def test_an_unsealed_file_is_read_in_a_child_first_and_a_hang_there_is_one_line(tmp_path, monkeypatch):
    """A file written before seals is read by a child process first. In such a file, one flipped bit of
    the global heap's collection size makes HDF5 loop forever (seen with h5py 3.16's HDF5: bits 1-4 of the
    heap's 10th byte): the child is killed at the time limit, the file is DamagedFileError, and this
    process goes on."""
    p, spec = finished(tmp_path / "c", "full", "float16")
    fin = p + ".h5"
    as_format_1(fin)
    from kdcache.store.files import probe
    with CacheReader(p) as r:  # read through the child, then here
        assert r.spec.fingerprint == spec.fingerprint
    assert probe._seen, "the child's verdict is kept for the life of the process"
    heap = open(fin, "rb").read().find(b"GCOL")
    assert heap > 0, "the text attributes of an unsealed file sit in HDF5's global heap"
    flip(fin, heap + 9, 1)
    monkeypatch.setattr(probe, "LIMIT_S", 5.0)
    t0 = time.monotonic()
    with pytest.raises(DamagedFileError, match="did not finish reading"):
        CacheReader(p)
    took = time.monotonic() - t0
    assert 5.0 <= took < 15, took
    # the folder is listed past it: `kdcache ls` in a process of its own, its child's limit 5 s as above
    ls = ("import sys; from kdcache.store.files import probe; probe.LIMIT_S = 5.0; from kdcache.cli import main; "
          "sys.exit(main(sys.argv[1:]))")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", ls, "ls", "--cache-dir", str(tmp_path / "c")], capture_output=True,
                       text=True, env=CHILD_ENV, cwd=ROOT, timeout=200)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert os.path.basename(fin) in r.stderr and time.monotonic() - t0 < 60, r.stdout + r.stderr  # named, skipped


def test_only_the_seal_check_opens_a_finished_file_with_hdf5():
    """Every h5py.File that opens an existing file is in segment.py (segments, parts and open_final); the
    others create a new file ("w": compaction, a new segment, a new part): a new tool that opened a finished
    file another way would skip the seal."""
    hits, creating = [], []
    for d, _, files in os.walk(os.path.join(ROOT, "kdcache")):
        for n in files:
            if n.endswith(".py"):
                text = open(os.path.join(d, n)).read()
                for m in re.finditer(r"h5py\.File\(([^,)]*)(?:,\s*([^,)]*))?", text):
                    where = os.path.relpath(os.path.join(d, n), ROOT)
                    (creating if (m.group(2) or "").strip() == '"w"' else hits).append(where)
    assert hits and set(hits) <= {"kdcache/store/files/segment.py"}, hits
    assert set(creating) <= {"kdcache/store/files/segment.py", "kdcache/store/write/compact.py", "kdcache/store/files/parts.py"}, creating
