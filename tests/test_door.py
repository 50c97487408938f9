"""Every command checks its options at the door: drawn option values end in exit 0 with a sound
result, or in exit 2 with one error line and no traceback, and never change a cache."""
import hashlib
import json
import math
import os
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MXNET_SUBGRAPH_VERBOSE": "0", "KDCACHE_RING_TIMEOUT": "60"}

BAD_INT = ["0", "-1", "-3", "x", "1.5", "", "99999999999999"]
BAD_FLOAT = ["-1", "nan", "inf", "-inf", "x", ""]

# flag -> (values that are fine, values that are not); which is which is the command's to decide
SHARED = {
    "--dataset": (["digits"], ["nosuch", "mnist", "synthetic:n=0", "synthetic:shape=2x8x8", "digits:x=1"]),
    "--data-root": ([], ["/nonexistent", "."]),
    "--image-size": ([], ["0x0", "8", "8x8"]),
    "--num-classes": ([], ["1", "0", "10"]),
    "--views": (["1", "2"], BAD_INT),
    "--augment": (["auto", "crop:1", "flip", "crop:1,flip"], ["crop:-1", "crop:x", "bogus", "crop:1000"]),
    "--seed": (["0", "7"], ["-1", "x", "1e3"]),
    "--codec": (["full", "topk:3", "topk:10"], ["topk:0", "topk:x", "topk:-1", "topk:11", "bogus", ""]),
    "--dtype": (["float16", "float32"], ["float64", ""]),
    "--epochs": (["1", "2"], BAD_INT),
    "--batch-size": (["16", "500", "5000"], BAD_INT),
    "--teacher-mean": (["0.5", "0.1"], ["0.1,0.2,0.3", "x", "nan", ""]),
    "--teacher-std": (["0.5", "2"], ["0", "0.1,0.2", "inf"]),
    "--teacher-size": (["8x8"], ["0x0", "8", "16x16", "4x4"]),
    "--teacher-input": ([], ["nosuch", "../x"]),
    "--cache": ([], ["{tmp}/not-a-dir/x"]),
}
TRAIN = {
    **SHARED,
    "--temperature": (["1", "4", "20"], ["0", *BAD_FLOAT]),
    "--alpha": (["0", "0.5", "1"], ["-0.1", "1.5", "nan"]),
    "--lr": (["0.01", "0.001"], ["0", *BAD_FLOAT]),
    "--wd": (["0", "1e-4"], BAD_FLOAT),
    "--student": (["mlp", "small_cnn"], ["foo", ""]),
    "--ctx": (["cpu", "auto"], ["tpu", "cpu:0,0", "gpu:9", "gpu:x"]),
    "--teacher-mode": (["cache", "inline", "none"], ["x"]),
    "--store": (["cache", "ring"], ["disk"]),
    "--ring-capacity": (["64", "4096"], BAD_INT),
    "--wait-timeout": (["60"], ["0", *BAD_FLOAT]),
    "--producer-threads": (["1"], BAD_INT),
    "--threads": (["1"], BAD_INT),
    "--kvstore": (["local"], ["bogus", "dist_sync"]),
    "--run": (["{run}"], ["../x", "a/b", "", "."]),
    "--resume": ([], [""]),
    "--no-producer": ([""], []),
}
CACHE = {
    **SHARED,
    "--split": (["train", "test"], ["val"]),
    "--online": ([""], []),
    "--threads": (["1"], BAD_INT),
    "--shard": (["0/1", "1/2"], ["2/2", "-1/2", "0/0", "x", "1"]),
    "--shards": (["1", "2"], BAD_INT),
    "--ring": ([], ["a/b", ""]),
    "--ring-capacity": ([], BAD_INT),
    "--timeline": ([], ["{tmp}/timeline.json"]),
}
TEACHER = {
    "--dataset": (["synthetic:n=60,classes=3,shape=1x8x8"], ["nosuch", "mnist", "synthetic:classes=1"]),
    "--arch": (["mlp", "small_cnn"], ["foo"]),
    "--epochs": (["1"], BAD_INT),
    "--lr": (["0.01"], ["0", *BAD_FLOAT]),
    "--schedule": (["cosine", "constant"], ["linear"]),
    "--augment": (["crop:1", "none"], ["crop:-1", "bogus"]),
    "--seed": (["0"], ["-1"]),
    "--threads": (["1"], BAD_INT),
}
LAUNCH = {
    "--workers": (["1"], BAD_INT),
    "--servers": (["1"], BAD_INT),
    "--kvstore": (["dist_sync"], ["local", "bogus"]),
    "--port": ([], ["0", "70000", "x"]),
    "--threads": (["1"], BAD_INT),
}
LAUNCH_WORKER = {k: TRAIN[k] for k in ("--temperature", "--alpha", "--batch-size", "--student", "--store")}
STORE = {
    "--older-than": (["0", "30"], BAD_FLOAT),
    "--max-size": (["20G", "500M", "0"], ["x", "-1G", "20X"]),
    "--min-age": (["60"], BAD_FLOAT),
}


def draw(table, max_options=4):
    """A strategy of option lists: a few options of `table`, each with a fine or a bad value."""
    flags = sorted(table)
    pick = st.lists(st.sampled_from(flags), max_size=max_options, unique=True)
    return pick.flatmap(lambda fs: st.tuples(*[st.sampled_from(table[f][0] + table[f][1]).map(
        lambda v, f=f: (f, v)) for f in fs]) if fs else st.just(()))


def argv_of(pairs, tmp, run):
    out = []
    for flag, value in pairs:
        value = value.format(tmp=tmp, run=run)
        out += [flag] if value == "" and flag in ("--online", "--no-producer", "--resume") else [f"{flag}={value}"]
    return out


def snapshot(folder):
    """Every file under folder with its size and a digest of its bytes."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = hashlib.sha256(fh.read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny digits teacher and its complete cache (the default options)."""
    from tests.helpers import gluon_teacher
    tmp = tmp_path_factory.mktemp("door")
    teacher = str(tmp / "teacher")
    gluon_teacher(teacher)
    caches = str(tmp / "caches")
    r = run_cmd(tmp, "cache", "--teacher", teacher, "--cache-dir", caches, "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    return {"tmp": tmp, "teacher": teacher, "caches": caches, "count": [0],
            "cache": json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]}


def run_cmd(cwd, *argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout)


def check(world, r, before, success):
    """The property: exit 0 and a sound result, or exit 2 with one error line; no cache changed."""
    err = r.stderr
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    assert r.returncode in (0, 2), (r.returncode, err[-3000:])
    after = snapshot(world["caches"])
    if r.returncode == 2:
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-3000:]
        assert len(errors[0]) < 600
        assert after == before, "a refused command changed the cache directory"
    else:
        assert all(after.get(k) == v for k, v in before.items()), "a run changed an existing cache"
        success(r)


def sound_training(r):
    line = json.loads(r.stdout.strip().splitlines()[-1])
    with open(os.path.join(os.path.dirname(line["checkpoint"]), "metrics.json")) as fh:
        m = json.load(fh)
    assert m["test_acc"] is not None and 0.0 <= m["test_acc"] <= 1.0
    assert all(math.isfinite(h["loss"]) for h in m["history"] or [])
    assert len(m["history"] or []) == m["epochs"]


def sound_cache(r):
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["complete"] or out["shard"] != "0/1", out  # a shard leaves its share done
    if out["complete"] and out.get("cache_path"):
        v = run_cmd(os.path.dirname(out["cache_path"]), "verify", out["cache_path"])
        assert v.returncode == 0, v.stdout + v.stderr


def next_run(world):
    world["count"][0] += 1
    return f"r{world['count'][0]}"


SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@settings(max_examples=45, **SETTINGS)
@given(draw(TRAIN))
def test_train(world, pairs):
    tmp, run = world["tmp"], next_run(world)
    before = snapshot(world["caches"])
    argv = ["train", "--teacher", world["teacher"], "--cache-dir", world["caches"], "--runs-dir", tmp / "runs",
            "--quiet", "--json", *argv_of(pairs, tmp, run)]
    if not any(f == "--epochs" for f, _ in pairs):
        argv.append("--epochs=1")
    if ("--teacher-mode", "none") in pairs:  # no teacher to name
        argv = [a for a in argv if a not in ("--teacher", world["teacher"])]
    check(world, run_cmd(tmp, *argv), before, sound_training)


@settings(max_examples=35, **SETTINGS)
@given(draw(CACHE))
def test_cache(world, pairs):
    tmp = world["tmp"]
    before = snapshot(world["caches"])
    r = run_cmd(tmp, "cache", "--teacher", world["teacher"], "--cache-dir", world["caches"], "--quiet", "--json",
                *argv_of(pairs, tmp, "x"))
    check(world, r, before, sound_cache)


@settings(max_examples=12, **SETTINGS)
@given(draw(TEACHER, 3))
def test_teacher(world, pairs):
    tmp, run = world["tmp"], next_run(world)
    before = snapshot(world["caches"])
    argv = ["teacher", "--out", tmp / "teachers" / run, "--quiet", *argv_of(pairs, tmp, run)]
    if not any(f == "--dataset" for f, _ in pairs):
        argv.append("--dataset=synthetic:n=60,classes=3,shape=1x8x8")
    if not any(f == "--epochs" for f, _ in pairs):
        argv.append("--epochs=1")

    def exported(r):
        assert os.path.exists(tmp / "teachers" / f"{run}-symbol.json")
    check(world, run_cmd(tmp, *argv), before, exported)


@settings(max_examples=8, **SETTINGS)
@given(draw(LAUNCH, 2), draw(LAUNCH_WORKER, 2))
def test_launch(world, pairs, worker):
    tmp, run = world["tmp"], next_run(world)
    before = snapshot(world["caches"])
    argv = ["launch", *argv_of(pairs, tmp, run), "--", "--teacher", world["teacher"], "--cache-dir",
            world["caches"], "--runs-dir", tmp / "runs", "--run", run, "--epochs", "1", "--quiet",
            *argv_of(worker, tmp, run)]
    if "--workers" not in dict(pairs):
        argv.insert(1, "--workers=1")

    def finished(r):
        assert os.path.exists(tmp / "runs" / run)
    check(world, run_cmd(tmp, *argv, timeout=400), before, finished)


@settings(max_examples=25, **SETTINGS)
@given(st.sampled_from(["ls", "inspect", "verify", "gc"]), draw(STORE, 3),
       st.sampled_from(["{cache}", "/nonexistent.h5", "{tmp}", "{teacher}-symbol.json", ""]))
def test_store_commands(world, cmd, pairs, path):
    tmp = world["tmp"]
    before = snapshot(world["caches"])
    argv = [cmd, "--cache-dir", world["caches"]]
    if cmd == "gc":
        argv += ["--dry-run", *argv_of(pairs, tmp, "x")]
    elif cmd in ("inspect", "verify"):
        argv.append(path.format(cache=world["cache"], tmp=tmp, teacher=world["teacher"]))
    r = run_cmd(tmp, *argv)
    check(world, r, before, lambda r: None)
    if cmd == "verify" and path == "{cache}":
        assert r.returncode == 0
