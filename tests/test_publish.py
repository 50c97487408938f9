"""kdcache publish and kdcache pull between folders (and file:// URLs through fsspec): what a publication holds,
what is refused in one line, and that a refused pull installs nothing and keeps the cache directory as it was.
The same against a real web server: tests/test_pull_server.py."""
import json
import os
import subprocess
import sys
import time

import h5py
import pytest

import kdcache
from kdcache.share import ShareError
from kdcache.share.manifest import parse
from kdcache.store.format import schema
from kdcache.store.format.fingerprint import fingerprint
from tests.conftest import ROOT
from tests.helpers import make_spec, seal_again
from tests.share_helpers import (copy_publication, env, cli, finished, flip_byte, nothing_installed, one_line,
                                 rows_offset, sha)


SPEC = dict(num_samples=700, num_classes=12, views=2, dtype="float16", tag="publish")
# A producer of the same cache: a few rows, then it waits (as a teacher still running would) until killed.
PRODUCER = """
import sys, time
import numpy as np
from kdcache.store import CacheWriter
from tests.helpers import expected_logits, make_spec
spec = make_spec(**%r)
with CacheWriter(sys.argv[1], spec) as w:
    k = np.arange(32)
    w.write(k // spec.views, expected_logits(k, spec.num_classes), views=k %% spec.views)
    print("started", flush=True)
    time.sleep(600)
""" % SPEC


@pytest.fixture(scope="module")
def origin(tmp_path_factory):
    """A finished cache in its builder's cache folder, and its publication in a folder: (P.h5, publication)."""
    root = tmp_path_factory.mktemp("origin")
    fin = finished(root / "caches", make_spec(**SPEC))
    r = cli("publish", fin, root / "pub", "--json")
    assert r.returncode == 0, r.stderr
    return fin, str(root / "pub"), json.loads(r.stdout.strip().splitlines()[-1])


def test_a_publication_is_the_file_unchanged_a_manifest_of_its_identity_and_a_card(origin):
    fin, pub, out = origin
    fp = os.path.basename(fin)[:-3]
    assert sorted(os.listdir(pub)) == sorted([f"{fp}.h5", "manifest.json", "README.md"])
    assert open(os.path.join(pub, f"{fp}.h5"), "rb").read() == open(fin, "rb").read()
    raw = open(os.path.join(pub, "manifest.json"), "rb").read()
    assert out["manifest_sha256"] == __import__("hashlib").sha256(raw).hexdigest()
    m = parse(raw, "manifest.json")
    assert m["fingerprint"] == fp == out["fingerprint"]
    assert m["files"] == [{"path": f"{fp}.h5", "size": os.path.getsize(fin), "sha256": sha(fin)}]
    c = m["cache"]
    assert fingerprint(c["fingerprint_inputs"]) == fp  # every input behind the fingerprint
    with h5py.File(fin, "r") as f:
        assert json.loads(f.attrs[schema.A_INPUTS]) == c["fingerprint_inputs"]["inputs"]
        assert m["build"]["date"] == f.attrs[schema.A_CREATED].decode()
    assert (c["num_samples"], c["views"], c["num_classes"], c["codec"], c["dtype"]) == (700, 2, 12, "full", "float16")
    assert c["teacher"] == {"name": "publish", "digest": "0" * 16} and c["dataset"]["name"] == "synthetic"
    assert c["format_version"] == schema.FORMAT_VERSION and c["checksums"].startswith("crc32")
    assert m["build"]["kdcache_version"] == kdcache.__version__ and m["build"]["command"].startswith("kdcache cache")
    assert m["published"]["command"].startswith("kdcache publish")
    card = open(os.path.join(pub, "README.md")).read()
    for text in (fp, "teacher: publish", "synthetic", "700 samples", "views per sample: 2", f"{os.path.getsize(fin):,} bytes",
                 f"kdcache pull {pub} --expect-sha256 {out['manifest_sha256']}", "not recorded (the cache does not hold it"):
        assert text in card, text
    assert out["pull"] == f"kdcache pull {pub} --expect-sha256 {out['manifest_sha256']}"


def test_pull_from_a_folder_installs_the_same_bytes_under_the_fingerprint_and_fetches_nothing_twice(origin, tmp_path):
    fin, pub, out = origin
    dest = tmp_path / "mine"
    r = cli("pull", pub, "--cache-dir", dest, "--expect-sha256", out["manifest_sha256"])
    assert r.returncode == 0, r.stderr
    assert os.listdir(dest) == [os.path.basename(fin)]  # nothing staged is left
    assert open(dest / os.path.basename(fin), "rb").read() == open(fin, "rb").read()
    again = kdcache.pull(pub, cache_dir=str(dest))
    assert again["installed"] is False and again["fetched"] == 0 and again["path"] == str(dest / os.path.basename(fin))
    r = cli("ls", "--cache-dir", dest)  # the store sees it as its own: complete, its fingerprint
    assert r.returncode == 0 and "complete" in r.stdout and out["fingerprint"] in r.stdout


def test_a_file_url_goes_through_fsspec_both_ways(origin, tmp_path):
    pytest.importorskip("fsspec")
    fin, _, _ = origin
    url = f"file://{tmp_path}/pub"
    out = kdcache.publish(fin, url)
    assert sorted(os.listdir(tmp_path / "pub")) == sorted([os.path.basename(fin), "manifest.json", "README.md"])
    got = kdcache.pull(url, cache_dir=str(tmp_path / "c"), expect_sha256=out["manifest_sha256"])
    assert got["installed"] and sha(got["path"]) == sha(fin)


def test_expect_sha256_pins_the_manifest(origin, tmp_path):
    _, pub, out = origin
    other = "0" * 64
    r = cli("pull", pub, "--cache-dir", tmp_path / "c", "--expect-sha256", other)
    one_line(r, "not the " + other, "nothing fetched")
    nothing_installed(tmp_path / "c")
    # a publication replaced by whoever can write to the server: files and manifest changed together
    forged = copy_publication(pub, str(tmp_path / "forged"), change=lambda d, m: m["published"].update(date="later"))
    with pytest.raises(ShareError, match="not the .* you pinned"):
        kdcache.pull(forged, cache_dir=str(tmp_path / "c"), expect_sha256=out["manifest_sha256"])
    nothing_installed(tmp_path / "c")


def test_publish_refuses_a_cache_being_built_damaged_or_failing_verify(tmp_path):
    from kdcache.store import CacheWriter, path_for
    from tests.helpers import expected_logits
    import numpy as np
    spec = make_spec(num_samples=300, tag="building")
    base = path_for(str(tmp_path / "c"), spec.fingerprint)
    w = CacheWriter(base, spec)
    w.write(np.arange(100), expected_logits(np.arange(100), spec.num_classes))
    w.close()  # a third of the keys: the cache is incomplete, in P.parts
    r = cli("publish", base, tmp_path / "pub1")
    one_line(r, "still being built", "incomplete")
    assert not os.path.exists(tmp_path / "pub1" / "manifest.json")

    good = finished(tmp_path / "d", make_spec(num_samples=300, tag="damaged"))
    flip_byte(good, rows_offset(good))  # one bit of its rows
    r = cli("publish", good, tmp_path / "pub2")
    one_line(r, "fails kdcache verify", "do not match their crc32 checksum", "nothing published")
    assert not os.path.exists(tmp_path / "pub2" / "manifest.json")

    sealed = finished(tmp_path / "e", make_spec(num_samples=300, tag="seal"))
    flip_byte(sealed, 5000)  # a byte HDF5 reads: the seal names it
    r = cli("publish", sealed, tmp_path / "pub3")
    one_line(r, "seal")
    assert not os.path.exists(tmp_path / "pub3" / "manifest.json")
    with pytest.raises(ShareError):
        kdcache.publish(sealed, str(tmp_path / "pub3"))


def test_publish_never_overwrites_another_caches_publication(origin, tmp_path):
    _, pub, _ = origin
    other = finished(tmp_path / "c", make_spec(num_samples=50, tag="other"))
    before = {n: open(os.path.join(pub, n), "rb").read() for n in os.listdir(pub)}
    one_line(cli("publish", other, pub), "holds another publication")
    assert {n: open(os.path.join(pub, n), "rb").read() for n in os.listdir(pub)} == before


def test_a_different_cache_under_the_same_name_is_kept_and_the_pull_refused(origin, tmp_path):
    fin, pub, _ = origin
    mine = finished(tmp_path / "c", make_spec(**SPEC), scale=3.0)  # same inputs, other rows: another build
    assert os.path.basename(mine) == os.path.basename(fin) and sha(mine) != sha(fin)
    before = sha(mine)
    r = cli("pull", pub, "--cache-dir", tmp_path / "c")
    one_line(r, "already holds a different cache under this name", "nothing installed")
    assert sha(mine) == before and os.listdir(tmp_path / "c") == [os.path.basename(mine)]


def test_a_manifest_that_does_not_hold_together_is_refused_before_any_file(origin, tmp_path):
    _, pub, _ = origin
    cases = {
        "not the fingerprint of the inputs": lambda d, m: m["cache"]["fingerprint_inputs"].update(views=3),
        "not one plain file name": lambda d, m: m["files"][0].update(path="../escape.h5"),
        "is not 64 lowercase hex digits": lambda d, m: m["files"][0].update(sha256="x"),
        "format version 3": lambda d, m: m["cache"].update(format_version=schema.FORMAT_VERSION + 1),
    }
    for i, (words, change) in enumerate(cases.items()):
        bad = copy_publication(pub, str(tmp_path / f"bad{i}"), change=change)
        one_line(cli("pull", bad, "--cache-dir", tmp_path / "c"), words)
        nothing_installed(tmp_path / "c")
        with pytest.raises(ShareError, match=words):  # the API's one error type, with the same line
            kdcache.pull(bad, cache_dir=str(tmp_path / "c"))
    assert not os.path.exists(tmp_path / "escape.h5")


def test_a_cache_of_a_newer_format_is_refused_after_its_sha256_before_install(origin, tmp_path):
    fin, pub, _ = origin
    name = os.path.basename(fin)

    def newer(d, m):
        path = os.path.join(d, name)
        with h5py.File(path, "r+") as f:
            f.attrs[schema.A_FORMAT] = schema.FORMAT_VERSION + 1
        seal_again(path)  # as a newer kdcache would have written it
        m["files"][0].update(size=os.path.getsize(path), sha256=sha(path))
    bad = copy_publication(pub, str(tmp_path / "newer"), change=newer)
    one_line(cli("pull", bad, "--cache-dir", tmp_path / "c"), "format version 3", "upgrade kdcache")
    nothing_installed(tmp_path / "c")


def test_without_fsspec_a_url_names_the_extra_and_a_folder_still_works(origin, tmp_path):
    _, pub, _ = origin
    code = ("import sys; sys.modules['fsspec'] = None\n"  # as if it were not installed
            "import kdcache\n"
            "try:\n"
            "    kdcache.pull('https://example.invalid/pub', cache_dir=sys.argv[1])\n"
            "except kdcache.ShareError as e:\n"
            "    print(e)\n"
            "print(kdcache.pull(sys.argv[2], cache_dir=sys.argv[1])['installed'])\n")
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c"), pub], capture_output=True, text=True,
                       env=env(), timeout=120)
    assert r.returncode == 0, r.stderr
    first, second = r.stdout.strip().splitlines()
    assert "pip install 'kdcache[share]'" in first and second == "True"


def test_a_build_of_the_same_cache_in_progress_keeps_the_pull_out_until_it_is_gone(origin, tmp_path):
    """A live producer of the same fingerprint in the destination: the pull is refused (its compaction would race
    the install); once that producer is gone (killed), the pull installs the published file, and the dead
    build's segments are cleared."""
    fin, pub, _ = origin
    dest = tmp_path / "c"
    dest.mkdir()
    base = str(dest / os.path.basename(fin)[:-3])
    producer = subprocess.Popen([sys.executable, "-c", PRODUCER, base], env=env(), cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True)
    try:
        assert producer.stdout.readline().strip() == "started"
        r = cli("pull", pub, "--cache-dir", dest)
        one_line(r, "a build of this cache is in progress", f"pid {producer.pid}", "nothing installed")
        assert not os.path.exists(fin.replace(os.path.dirname(fin), str(dest)))
    finally:
        producer.kill()
        producer.wait()
    r = cli("pull", pub, "--cache-dir", dest, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["fetched"] == 0  # checked and kept when refused: installed now without fetching it again
    assert sha(out["path"]) == sha(fin)
    assert sorted(os.listdir(dest)) == [os.path.basename(fin)]  # the dead build's segments removed


def test_a_pull_staged_halfway_resumes_from_a_server_that_ignores_ranges(origin, tmp_path):
    """Python's own http.server answers a range request with the whole file (200): the pull skips what it has
    staged and installs the published file, where nginx would have sent only the rest (test_pull_server.py)."""
    pytest.importorskip("aiohttp")
    from kdcache.share.pull import PART, STAGE_PREFIX
    from bench.publish.nginx import free_port
    fin, pub, _ = origin
    name, fp = os.path.basename(fin), os.path.basename(fin)[:-3]
    stage = tmp_path / "c" / (STAGE_PREFIX + fp)  # what a pull killed halfway leaves
    stage.mkdir(parents=True)
    (stage / "manifest.json").write_bytes(open(os.path.join(pub, "manifest.json"), "rb").read())
    data = open(fin, "rb").read()
    (stage / (name + PART)).write_bytes(data[:len(data) // 2])
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory",
                               os.path.dirname(pub)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}/{os.path.basename(pub)}"
        deadline = time.monotonic() + 30
        while True:
            try:
                out = kdcache.pull(url, cache_dir=str(tmp_path / "c"))
                break
            except ShareError as e:  # until the server listens
                if "Cannot connect" not in str(e) or time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        server.terminate()
        server.wait()
    assert out["installed"] and out["fetched"] == len(data) - len(data) // 2
    assert sha(out["path"]) == sha(fin) and os.listdir(tmp_path / "c") == [name]


def test_publish_takes_the_teachers_accuracy_only_from_the_teacher_the_cache_records(origin, teacher, tmp_path):
    fin, _, _ = origin  # built from a teacher whose digest is "0" * 16: the fixture's checkpoint is another one
    r = cli("publish", fin, tmp_path / "pub", "--teacher", teacher)
    one_line(r, f"--teacher {teacher}: its files are not those of the teacher the cache was built with")
    assert not os.path.exists(tmp_path / "pub" / "manifest.json")


def test_gc_removes_the_staging_folder_of_a_pull_that_stopped_never_of_one_running(origin, tmp_path):
    from kdcache.share.pull import PART, STAGE_PREFIX, Stage
    fin, pub, _ = origin
    name, fp = os.path.basename(fin), os.path.basename(fin)[:-3]
    cache_dir = tmp_path / "c"
    stage = cache_dir / (STAGE_PREFIX + fp)
    stage.mkdir(parents=True)
    (stage / "manifest.json").write_bytes(open(os.path.join(pub, "manifest.json"), "rb").read())
    (stage / (name + PART)).write_bytes(open(fin, "rb").read()[:1000])
    with Stage(str(cache_dir), fp):  # a pull at work holds its folder's lock
        r = cli("gc", "--cache-dir", cache_dir, "--min-age", "0")
        assert r.returncode == 0 and stage.exists(), r.stdout + r.stderr
    r = cli("gc", "--cache-dir", cache_dir, "--min-age", "3600")  # stopped, but touched a moment ago
    assert r.returncode == 0 and stage.exists(), r.stdout + r.stderr
    r = cli("gc", "--cache-dir", cache_dir, "--min-age", "0")
    assert r.returncode == 0 and "left by a pull that stopped" in r.stdout, r.stdout + r.stderr
    assert os.listdir(cache_dir) == []
