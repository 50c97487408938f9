"""kdcache verify PATH --teacher: the teacher runs again on sampled keys and must match the stored rows."""
import json
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from tests.helpers import CHILD_ENV, reseal

ENV = CHILD_ENV


def kdcache(cwd, *argv):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=300)


def one_error_line(r):
    """Exit 2 with exactly one line, an error naming the cause, and no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:"), r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A small digits teacher, another one (other weights), and a directory for their caches."""
    from tests.helpers import gluon_teacher
    tmp = tmp_path_factory.mktemp("verify")
    gluon_teacher(str(tmp / "teacher"), scale=4.0)
    gluon_teacher(str(tmp / "other"), seed=1, scale=4.0)
    return {"tmp": tmp, "built": {}}


def cache(world, *options):
    """The path of the complete digits cache `kdcache cache` builds with these options (built once)."""
    if options not in world["built"]:
        r = kdcache(world["tmp"], "cache", "--teacher", "teacher", "--cache-dir", "caches", "--quiet", "--json",
                    *options)
        assert r.returncode == 0, r.stderr[-3000:]
        world["built"][options] = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    return world["built"][options]


def verify(world, path, *options):
    r = kdcache(world["tmp"], "verify", path, "--teacher", "teacher", "--json", *options)
    assert r.returncode in (0, 1), r.stderr[-3000:]
    return r.returncode, json.loads(r.stdout)


CODECS = {"full/float16": (), "full/float32": ("--dtype", "float32"), "topk:3": ("--codec", "topk:3"),
          "2 views, crop and flip": ("--views", "2", "--augment", "crop:1,flip")}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CODECS))
def test_a_sound_cache_matches_its_teacher(world, name):
    path = cache(world, *CODECS[name])
    code, report = verify(world, path)
    t = report["teacher_check"]
    assert code == 0 and report["sound"] and t["match"], report
    assert t["keys_checked"] == 256 and t["top1_agreement"] == 1.0 and t["keys_beyond_tolerance"] == 0
    assert t["max_abs_diff"] <= t["tolerance"]
    if "float32" in name:  # the teacher's own output, up to its last-bit noise
        assert t["max_abs_diff"] <= 1e-4, t
    if "views" in name:  # the check rebuilt each view's own input: the two views' targets differ
        with h5py.File(path, "r") as f:
            logits = f["logits"][...]
        assert np.mean(np.abs(logits[:, 0] - logits[:, 1]).max(axis=1) > 0.01) > 0.5
        code, report = verify(world, path, "--sample", "all", "--quiet")
        assert code == 0 and report["teacher_check"]["keys_checked"] == logits.shape[0] * 2


@pytest.mark.slow
def test_the_report_on_the_terminal(world):
    r = kdcache(world["tmp"], "verify", cache(world), "--teacher", "teacher", "--sample", "50", "--seed", "3")
    assert r.returncode == 0, r.stderr
    assert "sound" in r.stdout and "50 of 1438 keys" in r.stdout and "top-1 agreement         1.0000" in r.stdout
    assert r.stdout.strip().splitlines()[-1].endswith("matches its teacher")


@pytest.mark.slow
@pytest.mark.parametrize("options,field", [((), "logits"), (("--codec", "topk:3"), "topk_values")])
def test_altered_rows_are_found_and_named(world, tmp_path, options, field):
    path = str(tmp_path / "altered.h5")
    shutil.copy(cache(world, *options), path)
    altered = [7, 300, 1201]
    with h5py.File(path, "r+") as f:  # well-formed, finite: the store's own checks cannot tell
        rows = f[field][altered]
        rows[:, 0, 0] += 0.5
        f[field][altered] = rows
    reseal(path)  # rows a teacher run gave wrongly, not damage the checksums would name
    code, report = verify(world, path, "--sample", "all")
    t = report["teacher_check"]
    assert code == 1 and report["sound"] and not t["match"]
    assert t["keys_checked"] == 1438 and t["keys_beyond_tolerance"] == 3
    assert sorted(b["sample"] for b in t["beyond"]) == altered
    assert all(0.4 < b["diff"] < 0.6 for b in t["beyond"]), t["beyond"]
    r = kdcache(world["tmp"], "verify", path, "--teacher", "teacher", "--sample", "all")
    assert r.returncode == 1 and "sample 300 view 0" in r.stdout and "does NOT match its teacher" in r.stdout


@pytest.mark.slow
def test_another_teacher_is_refused_in_one_line(world):
    line = one_error_line(kdcache(world["tmp"], "verify", cache(world), "--teacher", "other"))
    assert "was built by teacher teacher:0@" in line and "you passed other:0@" in line
    assert "pass the right --teacher" in line


@pytest.mark.slow
def test_without_a_teacher_verify_is_the_store_check(world):
    path = cache(world)
    ours = kdcache(world["tmp"], "verify", path, "--json")
    store = subprocess.run([sys.executable, "-m", "kdcache.store", "verify", path, "--json"], capture_output=True,
                           text=True, env=ENV, cwd=world["tmp"], timeout=120)
    assert ours.returncode == store.returncode == 0 and ours.stdout == store.stdout


@pytest.mark.parametrize("value", ["0", "-3", "x", "", "1.5"])
def test_a_bad_sample_is_refused_in_one_line(tmp_path, value):
    line = one_error_line(kdcache(tmp_path, "verify", "x.h5", "--teacher", "t", f"--sample={value}"))
    assert "argument --sample" in line and "all" in line


def test_ties_within_tolerance_count_as_agreement():
    """topk: the stored top-1 may be either of two classes the teacher ties; another class may not."""
    from kdcache.cache_builder.teacher_check import compare_rows
    fresh = np.array([[3.0, 3.0, 1.0, -2.0], [3.0, 3.0, 1.0, -2.0]], np.float32)
    stored = {"topk_values": np.array([[3.0, 3.0], [3.0, 1.0]], np.float16),
              "topk_indices": np.array([[1, 0], [1, 2]], np.uint16),
              "topk_lse": np.log(np.exp(fresh).sum(axis=1)).astype(np.float32)}
    diff, tol, top, want, agree, ok = compare_rows(stored, fresh, "topk", "float16")
    assert agree.all() and ok.tolist() == [True, False]  # row 2 left out class 0, as large as its top-1
