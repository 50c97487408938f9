"""Every command checks its options at the door. Whether a drawn command line is valid is decided
from the drawn options alone (expected_ok), never from the command's answer: a valid one must end in
exit 0 with a sound result, an invalid one in exit 2 with one error line and no traceback; a refused
valid value is a failure. No command changes an existing cache."""
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MXNET_SUBGRAPH_VERBOSE": "0", "KDCACHE_RING_TIMEOUT": "60"}
# Each example is a command run (seconds): make test draws a short series, make torture a longer one.
TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"

BAD_INT = ["0", "-1", "-3", "x", "1.5", "", "99999999999999"]
BAD_FLOAT = ["-1", "nan", "inf", "-inf", "x", ""]

# Built-in views that give 8x8 images whatever the data set's size (the teachers take 8x8), and whether
# views of one sample differ (the evaluation transform gives every view the same image).
VIEW_SIZE = {"rrc:8": True, "rrc:8,flip": True, "rrc:8,scale=0.5-1,ratio=3/4-4/3": True, "center:8": False,
             "eval:9/8": False}

# flag -> (values valid on their own, values invalid whatever else is given); expected_ok decides
# what a valid value needs of the rest of the command line
SHARED = {
    "--dataset": (["digits", "DIGITS", "imagefolder", "recordio"],
                  ["nosuch", "mnist", "synthetic:n=0", "synthetic:shape=2x8x8", "digits:x=1"]),
    "--data-root": (["{folder}", "{rec}"], ["/nonexistent"]),
    "--image-size": (["8x8", "32x32", "8X8"], ["0x0", "8", "x8"]),
    "--num-classes": (["3", "10"], ["1", "0"]),
    # the image files' classes: folders ant, moth, zebra (tests.datafiles.FOLDER_CLASSES), recordio labels 0-2
    "--classes": (["ant,moth,zebra", "zebra, ant ,moth", "2,1,0", "moth,ant", "0,2"], ["ant", "ant,ant", "a/b,c", ""]),
    "--views": (["1", "2"], BAD_INT),
    "--augment": (["auto", "none", "crop:1", "flip", "crop:1,flip", "door_aug:shift", *VIEW_SIZE],
                  ["crop:-1", "crop:x", "bogus", "crop:1000", "nosuch_module:f", "rrc:0", "rrc:8,scale=0-1",
                   "rrc:8,scale=0.9-0.5", "rrc:8,ratio=0-1", "rrc:8,foo=1", "center:8,flip"]),
    "--seed": (["0", "7"], ["-1", "x", "1e3"]),
    "--codec": (["full", "topk:3", "topk:10", "TOPK:2", "int8"], ["topk:0", "topk:x", "topk:-1", "topk:11", "bogus", ""]),
    "--dtype": (["float16", "float32"], ["float64", ""]),
    "--epochs": (["1", "2"], BAD_INT),
    "--batch-size": (["16", "500", "5000"], BAD_INT),
    "--teacher-mean": (["0.5", "0.1", "0.1,0.2,0.3"], ["0.1,0.2", "x", "nan", ""]),
    "--teacher-std": (["0.5", "2", "0.5,1,2"], ["0", "0.1,0.2", "inf"]),
    "--teacher-size": (["8x8", "16x16"], ["0x0", "8"]),
    "--teacher-input": (["data"], ["nosuch", "../x"]),
    "--cache": (["{tmp}/mine/{run}", "{tmp}/mine/{run}.h5"], ["{tmp}", "{tmp}/mine/x.h5.h5", ".h5"]),
}
# Drawn first, as a whole: a data set and its files (the teacher is chosen to fit it).
DATA = [(), (("--dataset", "imagefolder"), ("--data-root", "{folder}")),
        (("--dataset", "recordio"), ("--data-root", "{rec}")),
        (("--dataset", "synthetic:n=40,classes=10,shape=1x8x8"),)]
FILES = {"imagefolder": "{folder}", "recordio": "{rec}"}  # their images: 3x5x4, 3 classes
TRAIN = {
    **SHARED,
    "--temperature": (["1", "4", "20"], ["0", *BAD_FLOAT]),
    "--alpha": (["0", "0.5", "1"], ["-0.1", "1.5", "nan"]),
    "--lr": (["0.01", "0.001"], ["0", *BAD_FLOAT]),
    "--wd": (["0", "1e-4"], BAD_FLOAT),
    "--optimizer": (["sgd", "nag", "adam"], ["foo", ""]),
    "--momentum": (["0", "0.9"], ["-0.1", "1.5", "nan"]),
    "--lr-mode": (["constant", "step", "cosine"], ["linear"]),
    "--lr-steps": (["1"], ["5,3", "x", "0", "1,1", ""]),
    "--lr-factor": (["0.1", "0.5"], ["0", "2", "nan"]),
    "--warmup-epochs": (["0", "1"], ["-1", "x"]),
    "--val-fraction": (["0", "0.1"], ["0.9", "-0.1", "nan"]),
    "--save-every": (["1", "2"], BAD_INT),
    "--student": (["mlp", "small_cnn"], ["foo", ""]),
    "--ctx": (["cpu", "auto", "CPU:0", "cpu:0,1"], ["tpu", "cpu:0,0", "gpu:9", "gpu:x"]),
    "--teacher-mode": (["cache", "inline", "none"], ["x"]),
    "--store": (["cache", "ring"], ["disk"]),
    "--ring-capacity": (["64", "4096"], BAD_INT),
    "--wait-timeout": (["60"], ["0", *BAD_FLOAT]),
    "--producer-threads": (["1"], BAD_INT),
    "--threads": (["1"], BAD_INT),
    "--kvstore": (["local"], ["bogus", "dist_sync"]),
    "--run": (["{run}"], ["../x", "a/b", "", "."]),
    "--resume": ([""], []),
    "--no-producer": ([""], []),
}
CACHE = {
    **SHARED,
    "--split": (["train", "test"], ["val"]),
    "--online": ([""], []),
    "--threads": (["1"], BAD_INT),
    "--shard": (["0/1", "1/2", "00/1"], ["2/2", "-1/2", "0/0", "x", "1"]),
    "--shards": (["1", "2"], BAD_INT),
    "--ring": ([], ["a/b", ""]),
    "--ring-capacity": (["64"], BAD_INT),
    "--timeline": (["{tmp}/timeline.json"], ["{tmp}"]),
}
TEACHER = {
    "--dataset": (["synthetic:n=60,classes=3,shape=1x8x8"], ["nosuch", "mnist", "synthetic:classes=1"]),
    "--arch": (["mlp", "small_cnn"], ["foo"]),
    "--epochs": (["1"], BAD_INT),
    "--lr": (["0.01"], ["0", *BAD_FLOAT]),
    "--schedule": (["cosine", "constant"], ["linear"]),
    "--augment": (["crop:1", "none", "door_aug:shift"], ["crop:-1", "bogus"]),
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
TABLES = {"train": TRAIN, "cache": CACHE, "teacher": TEACHER, "launch": {**LAUNCH, **LAUNCH_WORKER}, "gc": STORE}
# The options that name a cache, and their defaults: the module's cache is the one of all defaults.
NAMING_DEFAULTS = {"--dataset": ("digits",), "--views": ("1",), "--augment": ("auto", "none"),
                   "--codec": ("full",), "--dtype": ("float16",)}
NAMING = ("--data-root", "--image-size", "--num-classes", "--classes", "--teacher-input", "--teacher-mean", "--teacher-std",
          "--teacher-size", "--cache")


def data_kind(d):
    return d.get("--dataset", "digits").lower().split(":")[0]


def expected_ok(cmd, pairs):
    """Is this command line valid? Decided from the drawn (flag, value) pairs alone."""
    table, d = TABLES[cmd], dict(pairs)
    if any(v in table[f][1] for f, v in pairs):
        return False
    if cmd == "launch":
        return d.get("--store") != "ring"  # the workers read one cache
    if cmd not in ("train", "cache"):
        return True
    epochs = int(d.get("--epochs", 1))
    if cmd == "train" and ("--lr-steps" in d and (d.get("--lr-mode") != "step" or int(d["--lr-steps"]) >= epochs)
                           or int(d.get("--warmup-epochs", 0)) >= epochs):
        return False  # steps only for the step mode, and within the epochs; an epoch after the warm-up
    kind = data_kind(d)
    if d.get("--data-root") != FILES.get(kind):  # files only for the data sets that read them, the right ones
        return False
    if "--image-size" in d and kind not in FILES or "--num-classes" in d and kind != "recordio":
        return False
    channels, classes = (3, int(d.get("--num-classes", 3))) if kind in FILES else (1, 10)
    if "--classes" in d:  # only the image files choose classes: folder names, or the .rec's label numbers
        names = {x.strip() for x in d["--classes"].split(",")}
        if kind not in FILES or not names <= ({"ant", "moth", "zebra"} if kind == "imagefolder" else {"0", "1", "2"}):
            return False
        classes = len(names)
    if int(d.get("--views", 1)) > 1 and (d.get("--augment") == "none" or VIEW_SIZE.get(d.get("--augment")) is False):
        return False
    if d.get("--codec") == "int8" and d.get("--dtype", "float16") != "float16":
        return False
    mode = d.get("--teacher-mode", "cache")
    if mode == "none":  # no teacher: nothing of the teacher may be named
        return not any(f in d for f in ("--teacher-input", "--teacher-mean", "--teacher-std", "--teacher-size",
                                        "--cache", "--producer-threads"))
    if (d.get("--teacher-size") or ("8x8" if d.get("--augment") in VIEW_SIZE else None) or d.get("--image-size")
            or ("5x4" if kind in FILES else "8x8")).lower() != "8x8":
        return False  # the teachers take 8x8 images (rrc:8 and center:8 views are 8x8)
    if any(f in d and len(d[f].split(",")) not in (1, channels) for f in ("--teacher-mean", "--teacher-std")):
        return False
    if classes != 3 and kind in FILES:  # the image teacher predicts 3 classes
        return False
    if d.get("--codec", "").lower().startswith("topk:") and int(d["--codec"].split(":")[1]) > classes:
        return False
    if cmd == "cache":
        shard = d.get("--shard", "0/1")
        if int(d.get("--shards", 1)) > 1 and not shard.endswith("/1"):
            return False
        if d.get("--split") == "test" and "--online" in d or "--timeline" in d and "--online" not in d:
            return False
        return "--ring-capacity" not in d  # it sizes a ring, and none is named
    if d.get("--store") == "ring" and ("--no-producer" in d or mode != "cache") or "--resume" in d:
        return False  # a ring is filled by the producer the trainer starts; every run is a new one
    if "--no-producer" in d and mode == "cache":  # then only the module's cache can be read
        return not any(f in d for f in NAMING) and \
            all(d.get(f, dflt[0]).lower() in dflt for f, dflt in NAMING_DEFAULTS.items())
    return True


def draw(table, max_options=4, data=False):
    """A strategy of option lists: with `data`, one of DATA first; then a few other options of `table`,
    each with a value valid on its own or not."""
    def rest(block):
        flags = sorted(set(table) - {f for f, _ in block})
        pick = st.lists(st.sampled_from(flags), max_size=max_options, unique=True)
        return pick.flatmap(lambda fs: st.tuples(*[st.sampled_from(table[f][0] + table[f][1]).map(
            lambda v, f=f: (f, v)) for f in fs]) if fs else st.just(())).map(lambda r: block + r)
    return st.sampled_from(DATA).flatmap(rest) if data else rest(())


def argv_of(pairs, world, run):
    out = []
    for flag, value in pairs:
        value = value.format(tmp=world["tmp"], run=run, folder=world["folder"], rec=world["rec"])
        out += [flag] if value == "" and flag in ("--online", "--no-producer", "--resume") else [f"{flag}={value}"]
    return out


def teacher_for(world, pairs):
    """The teacher that fits the drawn data set: the image teacher (3x8x8, 3 classes) for the image files."""
    return world["rgb"] if data_kind(dict(pairs)) in FILES else world["teacher"]


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
    """Tiny teachers (digits: 1x8x8, 10 classes; images: 3x8x8, 3 classes), an image folder and a
    RecordIO file of 5x4 colour images, a user augmentation, and the complete cache of the defaults."""
    from tests.datafiles import make_folder, make_rec, write_rec
    from tests.helpers import gluon_teacher
    tmp = tmp_path_factory.mktemp("door")
    teacher, rgb = str(tmp / "teacher"), str(tmp / "rgb")
    gluon_teacher(teacher)
    gluon_teacher(rgb, classes=3, in_ch=3)
    folder, rec = str(tmp / "folder"), str(tmp / "rec")
    make_folder(os.path.join(folder, "train"))
    make_folder(os.path.join(folder, "test"))
    _, x, y = make_rec(rec)
    write_rec(os.path.join(rec, "test.rec"), x, y)
    (tmp / "door_aug.py").write_text("def shift(image, rng):\n    return image[:, :, ::-1] if rng.integers(2) "
                                     "else image\n")
    os.makedirs(tmp / "mine")
    caches = str(tmp / "caches")
    r = run_cmd(tmp, "cache", "--teacher", teacher, "--cache-dir", caches, "--quiet", "--json")
    assert r.returncode == 0, r.stderr
    return {"tmp": tmp, "teacher": teacher, "rgb": rgb, "folder": folder, "rec": rec, "caches": caches,
            "count": [0], "cache": json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]}


def run_cmd(cwd, *argv, timeout=300):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env=ENV, cwd=cwd, timeout=timeout)


def check(world, r, before, ok, success, caches=None):
    """The property: a valid command line (ok) ends in exit 0 and a sound result, an invalid one in
    exit 2 with one error line; no cache changed (in `caches`, world's cache folder by default)."""
    err = r.stderr
    assert "Traceback" not in err and "Exception ignored" not in err, err[-3000:]
    after = snapshot(caches or world["caches"])
    if not ok:
        assert r.returncode == 2, ("an invalid command line was not refused", r.returncode, err[-3000:])
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and err.strip().splitlines()[-1] == errors[0], err[-3000:]
        assert len(errors[0]) < 600
        assert after == before, "a refused command changed the cache directory"
    else:
        assert r.returncode == 0, ("a valid command line was refused", r.returncode, err[-3000:])
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


# No shrinking: every example is a command run (seconds); the failing one is reported as drawn.
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                phases=[Phase.explicit, Phase.reuse, Phase.generate],
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.data_too_large])


@settings(max_examples=90 if TORTURE else 20, **SETTINGS)
@given(draw(TRAIN, data=True))
def test_train(world, pairs):
    tmp, run = world["tmp"], next_run(world)
    caches = world["caches"]
    if ("--no-producer", "") in pairs:
        # --no-producer reads what is cached: a folder holding the module's cache alone, so that what the
        # oracle expects does not hang on the caches earlier examples happened to build
        caches = str(tmp / "the-default-cache-alone")
        if not os.path.isdir(caches):
            os.makedirs(caches)
            shutil.copy(world["cache"], caches)
    before = snapshot(caches)
    argv = ["train", "--cache-dir", caches, "--runs-dir", tmp / "runs", "--quiet", "--json",
            *argv_of(pairs, world, run)]
    if ("--teacher-mode", "none") not in pairs:  # with none there is no teacher to name
        argv[1:1] = ["--teacher", teacher_for(world, pairs)]
    argv += [f"{f}={v}" for f, v in (("--epochs", "1"), ("--run", run)) if f not in dict(pairs)]
    check(world, run_cmd(tmp, *argv), before, expected_ok("train", pairs), sound_training, caches)


@settings(max_examples=70 if TORTURE else 15, **SETTINGS)
@given(draw(CACHE, data=True))
def test_cache(world, pairs):
    tmp = world["tmp"]
    before = snapshot(world["caches"])
    r = run_cmd(tmp, "cache", "--teacher", teacher_for(world, pairs), "--cache-dir", world["caches"], "--quiet",
                "--json", *argv_of(pairs, world, next_run(world)))
    check(world, r, before, expected_ok("cache", pairs), sound_cache)


@settings(max_examples=12, **SETTINGS)
@given(draw(TEACHER, 3))
def test_teacher(world, pairs):
    tmp, run = world["tmp"], next_run(world)
    before = snapshot(world["caches"])
    argv = ["teacher", "--out", tmp / "teachers" / run, "--quiet", *argv_of(pairs, world, run)]
    argv += [f"{f}={v}" for f, v in (("--dataset", TEACHER["--dataset"][0][0]), ("--epochs", "1"))
             if f not in dict(pairs)]

    def exported(r):
        assert os.path.exists(tmp / "teachers" / f"{run}-symbol.json")
    check(world, run_cmd(tmp, *argv), before, expected_ok("teacher", pairs), exported)


@settings(max_examples=8, **SETTINGS)
@given(draw(LAUNCH, 2), draw(LAUNCH_WORKER, 2))
def test_launch(world, pairs, worker):
    tmp, run = world["tmp"], next_run(world)
    before = snapshot(world["caches"])
    argv = ["launch", *argv_of(pairs, world, run), "--", "--teacher", world["teacher"], "--cache-dir",
            world["caches"], "--runs-dir", tmp / "runs", "--run", run, "--epochs", "1", "--quiet",
            *argv_of(worker, world, run)]
    if "--workers" not in dict(pairs):
        argv.insert(1, "--workers=1")

    def finished(r):
        assert os.path.exists(tmp / "runs" / run)
    check(world, run_cmd(tmp, *argv, timeout=400), before, expected_ok("launch", pairs + worker), finished)


@settings(max_examples=25, **SETTINGS)
@given(st.sampled_from(["ls", "inspect", "verify", "gc"]), draw(STORE, 3),
       st.sampled_from(["{cache}", "/nonexistent.h5", "{tmp}", "{teacher}-symbol.json", ""]))
def test_store_commands(world, cmd, pairs, path):
    tmp = world["tmp"]
    before = snapshot(world["caches"])
    argv = [cmd, "--cache-dir", world["caches"]]
    if cmd == "gc":
        argv += ["--dry-run", *argv_of(pairs, world, "x")]
        ok = expected_ok("gc", pairs)
    elif cmd in ("inspect", "verify"):
        argv.append(path.format(cache=world["cache"], tmp=tmp, teacher=world["teacher"]))
        ok = path == "{cache}"
    else:
        ok = True
    check(world, run_cmd(tmp, *argv), before, ok, lambda r: None)


# Words whose parsed value once formatted back to another value.
TRICKY = {"--cache": ["x.h5.parts", "x.parts.h5", "x.h5.h5", "auto.h5", "x/"],
          "--augment": ["CROP:2,FLIP", "crop:0", " flip ", "RRC:8, FLIP", "rrc:8x6,ratio=3/4-4/3", "center:8",
                        "rrc:8,scale=1/3-1", "eval:9/8x8"], "--dataset": ["Synthetic:n=10", " digits"],
          "--teacher-mean": ["-0.5,1e-300", "1e308"], "--image-size": ["08x8", " 8 x 8 "]}


def test_shared_options_round_trip():
    """The producer command line the trainer builds for its child: every shared option's parsed value,
    formatted back to a word and parsed again by the child, is the same value."""
    from hypothesis import given as given_
    from kdcache.pipeline.options import SHARED

    @settings(max_examples=300, derandomize=True, database=None)
    @given_(st.sampled_from([o for o in SHARED if not o.action]), st.data())
    def round_trip(option, data):
        words = TRAIN.get(option.flag, (["x"],))[0] + TRICKY.get(option.flag, [])
        word = data.draw(st.sampled_from(words) | st.text(
            "0123456789xX:,./-abcdefghijklmnopqrstuvwxyz", max_size=12), label="word")
        try:
            value = option.type(word.format(tmp="/tmp", run="r", folder="/tmp", rec="/tmp"))
        except Exception:
            return  # refused at the door: nothing to hand on
        assert option.type(option.format(value)) == value, (option.flag, word, value)
    round_trip()
