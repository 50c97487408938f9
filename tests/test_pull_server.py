"""kdcache pull from a real web server: nginx (the distribution's package; .ci/run installs it), started here as a
plain process on a free loopback port with its own configuration, serving a published cache. Each fault ends with
the published cache installed bit for bit, or with nothing installed and one line.

KDCACHE_TORTURE=1 (make torture) kills the pull 20 times at random moments instead of 3."""
import json
import re
import os
import random
import signal
import socket
import subprocess
import sys
import time

import pytest

import kdcache
from bench.publish.nginx import Nginx, binary
from kdcache.share.pull import STAGE_PREFIX
from kdcache.share.remote import CHUNK
from tests.share_helpers import (big_spec, cli, copy_publication, env, finished, flip_byte, nothing_installed,
                                 one_line, rows_offset, sha)

TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"
pytestmark = pytest.mark.skipif(binary() is None, reason="nginx is not installed (apt-get install nginx-light; .ci/run "
                                                         "installs it): these tests need a real web server")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(nginx, the published cache's file, its manifest sha256, the folder nginx serves): a 16 MB cache published
    into www/pub."""
    root = tmp_path_factory.mktemp("served")
    fin = finished(root / "caches", big_spec())
    www = root / "www"
    out = kdcache.publish(fin, str(www / "pub"))
    server = Nginx(www, root / "nginx", slow_rate="16m")
    server.start()
    yield server, fin, out["manifest_sha256"], str(www)
    server.stop()


def pull(url, dest, *extra, timeout=300):
    return cli("pull", url, "--cache-dir", dest, "--quiet", *extra, timeout=timeout)


def equal_installed(dest, fin):
    """The published file is installed, bit for bit, and nothing else is left in the cache directory."""
    assert sorted(os.listdir(dest)) == [os.path.basename(fin)], os.listdir(dest)
    assert sha(os.path.join(dest, os.path.basename(fin))) == sha(fin)


def test_pull_over_http_installs_the_published_file_bit_for_bit(served, tmp_path):
    server, fin, digest, _ = served
    r = pull(f"{server.url}/pub/", tmp_path / "c", "--expect-sha256", digest, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1])["fetched"] == os.path.getsize(fin)
    equal_installed(tmp_path / "c", fin)


def stage_part(dest, fin):
    fp = os.path.basename(fin)[:-3]
    return os.path.join(dest, STAGE_PREFIX + fp, os.path.basename(fin) + ".part")


def test_an_interrupted_pull_resumes_with_a_range_request_and_fetches_again_at_most_a_chunk(served, tmp_path):
    server, fin, _, _ = served
    size, dest = os.path.getsize(fin), tmp_path / "c"
    part = stage_part(dest, fin)
    before = len(server.requests())
    p = subprocess.Popen([sys.executable, "-m", "kdcache", "pull", f"{server.url}/slow/pub", "--cache-dir", str(dest),
                          "--quiet"], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and (not os.path.exists(part) or os.path.getsize(part) < size // 2):
            time.sleep(0.005)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    kept = os.path.getsize(part)
    assert size // 2 <= kept < size
    nothing_installed(dest, staged=True)
    time.sleep(0.3)  # nginx logs the dropped request once it notices
    first = [r for r in server.requests()[before:] if r[0] == "GET" and r[1].endswith(".h5")]
    r = pull(f"{server.url}/pub", dest)
    assert r.returncode == 0, r.stderr
    equal_installed(dest, fin)
    second = [r for r in server.requests()[before:] if r[0] == "GET" and r[1].endswith(".h5")][len(first):]
    assert [(s, n) for _, _, s, n in second] == [(206, size - kept)]  # one range request, from where it stopped
    again = sum(n for *_, n in first) - kept  # sent before the kill and not kept
    assert 0 <= again <= CHUNK


def test_kill_9_at_random_moments_then_the_same_command_installs_the_published_file(served, tmp_path):
    server, fin, _, _ = served
    dest = tmp_path / "c"
    rng = random.Random(34)
    kills = 20 if TORTURE else 3
    landed = {"before the file": 0, "mid-transfer": 0, "staged whole, not installed": 0, "installed": 0}
    for _ in range(kills):
        p = subprocess.Popen([sys.executable, "-m", "kdcache", "pull", f"{server.url}/slow/pub", "--cache-dir",
                              str(dest), "--quiet"], env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.05, 2.5))
        p.send_signal(signal.SIGKILL)
        p.wait()
        part = stage_part(dest, fin)
        installed = os.path.join(dest, os.path.basename(fin))
        if os.path.exists(installed):  # the kill came after the link: it must be the published file, whole
            assert sha(installed) == sha(fin)
            landed["installed"] += 1
            os.unlink(installed)  # for the next round
            continue
        n = os.path.getsize(part) if os.path.exists(part) else None
        whole = os.path.exists(part[: -len(".part")])  # fetched and hashed, checks or install under way
        landed["staged whole, not installed" if whole else "before the file" if not n else "mid-transfer"] += 1
    r = pull(f"{server.url}/pub", dest)
    assert r.returncode == 0, r.stderr
    equal_installed(dest, fin)
    print(f"kill -9 of kdcache pull: {kills} kills landed {landed}")


def test_a_truncated_file_is_refused_and_nothing_installed(served, tmp_path):
    server, fin, _, www = served

    def truncate(d, m):
        with open(os.path.join(d, os.path.basename(fin)), "r+b") as fh:
            fh.truncate(os.path.getsize(fin) // 3)
    copy_publication(os.path.join(www, "pub"), os.path.join(www, "truncated"), change=truncate)
    one_line(pull(f"{server.url}/truncated", tmp_path / "c"), "truncated", "ask its publisher")
    nothing_installed(tmp_path / "c")


def test_a_file_with_one_flipped_byte_is_refused_by_its_sha256_before_hdf5_reads_it(served, tmp_path):
    server, fin, _, www = served
    for name, offset in (("rows", rows_offset(fin)), ("metadata", 4096 + 64)):
        copy_publication(os.path.join(www, "pub"), os.path.join(www, f"flip-{name}"),
                         change=lambda d, m: flip_byte(os.path.join(d, os.path.basename(fin)), offset))
        one_line(pull(f"{server.url}/flip-{name}", tmp_path / "c"), "its sha256", "is not the manifest's",
                 "nothing installed")
        nothing_installed(tmp_path / "c")


def test_a_manifest_naming_a_missing_file_is_refused_before_any_byte_is_fetched(served, tmp_path):
    server, fin, _, www = served
    copy_publication(os.path.join(www, "pub"), os.path.join(www, "missing"),
                     change=lambda d, m: os.unlink(os.path.join(d, os.path.basename(fin))))
    one_line(pull(f"{server.url}/missing", tmp_path / "c"), "the manifest names this file and the server has none")
    nothing_installed(tmp_path / "c")


def test_a_redirect_loop_is_one_line(served, tmp_path):
    server, _, _, _ = served
    one_line(pull(f"{server.url}/loop/pub", tmp_path / "c"), "too many redirects")
    nothing_installed(tmp_path / "c")


def test_a_server_that_stalls_times_out_in_one_line(tmp_path):
    with socket.socket() as s:  # accepts connections (the kernel does), never answers
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        t0 = time.monotonic()
        r = pull(f"http://127.0.0.1:{s.getsockname()[1]}/pub", tmp_path / "c", "--timeout", "1", timeout=60)
        took = time.monotonic() - t0
    one_line(r, "no answer within 1 s", "--timeout")
    assert took < 20, took
    nothing_installed(tmp_path / "c")


@pytest.fixture(scope="module")
def trained_origin(tmp_path_factory, teacher):
    """A clone's cache folder after `kdcache train`: the training split's cache and the test split's."""
    home = tmp_path_factory.mktemp("origin-clone")
    r = cli("train", "--teacher", teacher, "--dataset", "digits", "--epochs", "1", "--json", cwd=home, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["teacher_forwards"] > 0
    return home / "caches", m


def test_a_cache_published_from_one_folder_trains_a_student_in_a_fresh_one_with_0_teacher_forwards(
        served, trained_origin, teacher, tmp_path):
    server, _, _, www = served
    caches, first = trained_origin
    fresh = tmp_path / "fresh-clone"
    fresh.mkdir()
    names = sorted(os.listdir(caches))
    assert len(names) == 2  # the training split's targets and the test split's (the teacher's test accuracy)
    for i, name in enumerate(names):
        r = cli("publish", caches / name, os.path.join(www, f"digits-{i}"))
        assert r.returncode == 0, r.stderr
        r = cli("pull", f"{server.url}/digits-{i}", "--quiet", cwd=fresh)  # into ./caches, as train looks there
        assert r.returncode == 0, r.stderr
    assert sorted(os.listdir(fresh / "caches")) == names
    r = cli("train", "--teacher", teacher, "--dataset", "digits", "--epochs", "1", "--json", cwd=fresh, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["teacher_forwards"] == 0 and m["producer_started"] is False and "starting producer" not in r.stderr
    assert m["fingerprint"] == first["fingerprint"] and m["teacher_test_acc"] == first["teacher_test_acc"]
    assert sorted(os.listdir(fresh / "caches")) == names  # nothing built: the teacher never ran here


def page_blocks():
    """docs/publish.md's shell blocks: [[command line, ...], ...] (comments after '  #' dropped)."""
    import re
    from tests.conftest import ROOT
    text = open(os.path.join(ROOT, "docs", "publish.md"), encoding="utf-8").read()
    return [[ln.split("  #")[0].strip() for ln in b.splitlines() if ln.strip()]
            for b in re.findall(r"```sh\n(.*?)```", text, re.S)]


def test_the_publish_page_s_commands_run_outside_the_clone(tmp_path):
    """Every command docs/publish.md shows, run by a shell in a folder outside the clone with the installed kdcache;
    its web server is a real nginx serving the folder the page publishes into."""
    from tests.test_install import clean_env
    blocks = page_blocks()
    assert len(blocks) == 2 and len(blocks[0]) == 4 and len(blocks[1]) == 3
    shell_env = clean_env(os.path.dirname(sys.executable))
    (tmp_path / "www").mkdir()
    values, outputs = {}, []
    with Nginx(tmp_path / "www", tmp_path / "nginx") as server:
        for line in blocks[0] + blocks[1]:
            for key, value in values.items():
                line = line.replace(key, value)
            line = line.replace("http://127.0.0.1:8080", server.url)
            r = subprocess.run(["bash", "-c", line], cwd=tmp_path, env=shell_env, capture_output=True, text=True,
                               timeout=600)
            assert r.returncode == 0, f"{line}: {r.stderr[-3000:]}"
            if line.startswith("kdcache cache"):
                values["<fingerprint>"] = json.loads(r.stdout.strip().splitlines()[-1])["fingerprint"]
            if line.startswith("kdcache publish") and "<sha256>" not in values:
                values["<sha256>"] = r.stdout.split("manifest sha256 ")[1].split()[0]
            outputs.append((line, r.stdout))
    fp = values["<fingerprint>"]
    assert sorted(os.listdir(tmp_path / "bucket" / "digits")) == sorted([f"{fp}.h5", "manifest.json", "README.md"])
    assert sha(tmp_path / "received" / f"{fp}.h5") == sha(tmp_path / "caches" / f"{fp}.h5")
    assert "nothing fetched" in outputs[-2][1]
    card = (tmp_path / "www" / "digits" / "README.md").read_text()
    assert re.search(r"the teacher's test accuracy: \d+\.\d\d% on digits, test split", card), card
    assert re.search(r"teacher forwards \(training\)\s+0\n", outputs[-1][1]), outputs[-1][1]
