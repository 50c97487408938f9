"""Doors that must not mislead: abbreviated options, Make variables that name nothing, what a run records."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from kdcache.cli import COMMANDS
from tests.conftest import ROOT
from tests.test_hints import parsers_of

KDCACHE = os.path.join(os.path.dirname(sys.executable), "kdcache")
MAKE = shutil.which("make")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_no_command_takes_an_abbreviated_option(name):
    for parser in parsers_of(name):
        assert parser.allow_abbrev is False, f"kdcache {name}: {parser.prog} takes abbreviations"


@pytest.mark.parametrize("argv, typo", [(["cache", "--dataset", "digits", "--view", "2"], "--view"),
                                        (["train", "--temp", "4"], "--temp"),
                                        (["ls", "--jso"], "--jso")])
def test_an_abbreviation_is_one_line_and_status_2(tmp_path, argv, typo):
    r = subprocess.run([KDCACHE, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert typo in line and "unrecognized arguments" in line, line


def make(*args):
    return subprocess.run([MAKE, "-s", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_a_make_variable_that_names_no_option_is_an_error_naming_those_that_exist():
    r = make("-n", "train", "TEMPERATURE=4")
    assert r.returncode != 0 and r.stdout == ""
    assert "TEMPERATURE: no such variable; use one of" in r.stderr and " T " in r.stderr and "ALPHA" in r.stderr
    r = make("-n", "train", "T=4", "ALPHA=0.3")
    assert r.returncode == 0, r.stderr  # the values reach the tool as they are: tests/test_make.py
    assert '${T:+--temperature="$T"} ${ALPHA:+--alpha="$ALPHA"}' in r.stdout


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_every_declared_make_variable_is_one_the_makefile_takes():
    from kdcache.cache_builder.options import PRODUCER
    from kdcache.pipeline.options import SHARED
    from kdcache.trainer.options import TRAINER
    r = make("--eval", "print-variables: ; @echo $(VARIABLES)", "print-variables")
    assert r.returncode == 0, r.stderr
    known = set(r.stdout.split())
    declared = {o.make for o in SHARED + PRODUCER + TRAINER if o.make}
    assert declared and declared <= known, declared - known


def test_ls_shows_the_augmentation_and_seed_and_inspect_prints_dates(tmp_path):
    import json
    import numpy as np
    from kdcache.store import CacheSpec, CacheWriter, path_for
    spec = CacheSpec(num_samples=4, num_classes=3, views=2, dtype="float32",
                     inputs={"teacher": "t", "augment": "crop:1", "augment_seed": 7})
    p = path_for(str(tmp_path), spec.fingerprint)
    with CacheWriter(p, spec) as w:
        for view in (0, 1):
            w.write(np.arange(4), np.zeros((4, 3), np.float32), views=view)
    r = subprocess.run([KDCACHE, "ls", "--cache-dir", str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    head, row = r.stdout.splitlines()[1:3]
    assert "augment" in head.split() and "crop:1 seed 7" in row
    old = os.stat(p + ".h5")
    os.utime(p + ".h5", (old.st_atime - 10 * 86400, old.st_mtime))  # last used 10 days ago
    r = subprocess.run([KDCACHE, "inspect", p, "--json"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert abs(os.stat(p + ".h5").st_atime - (old.st_atime - 10 * 86400)) < 1  # looking is not using: gc ages by it
    meta = json.loads(r.stdout)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", meta["last_used"]), meta["last_used"]
    r = subprocess.run([KDCACHE, "inspect", p], capture_output=True, text=True, timeout=60)
    (line,) = [ln for ln in r.stdout.splitlines() if ln.startswith("last_used ")]
    assert re.search(r" \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00$", line), line


@pytest.mark.slow
def test_a_run_records_its_recipe_and_a_stop_names_the_run_to_resume(tmp_path, teacher):
    import json
    import signal
    import time
    import kdcache
    caches = str(tmp_path / "caches")
    path = kdcache.build_cache(teacher, "digits", cache_dir=caches, dtype="float32")
    kdcache.build_cache(teacher, "digits", cache_dir=caches, dtype="float32", split="test")  # the test accuracy's
    common = [KDCACHE, "train", "--teacher", teacher, "--dataset", "digits", "--cache-dir", caches,
              "--dtype", "float32", "--batch-size", "32", "-T", "3", "--alpha", "0.25", "--threads", "1"]
    r = subprocess.run(common + ["--epochs", "1", "--run", "done"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "starting producer" not in r.stderr, r.stderr  # both caches are complete: no producer runs
    assert re.search(r"student +mlp128, T 3, alpha 0.25, batch size 32", r.stdout), r.stdout
    assert path in r.stdout
    m = json.load(open(tmp_path / "runs" / "done" / "metrics.json"))
    assert (m["student"], m["temperature"], m["alpha"], m["batch_size"], m["cache_path"]) == \
        ("mlp128", 3.0, 0.25, 32, path)
    assert m["recipe"]["lr"] > 0
    p = subprocess.Popen(common + ["--epochs", "500", "--run", "stopped"], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    t = time.monotonic()
    while not (tmp_path / "runs" / "stopped" / "state.json").exists() and time.monotonic() - t < 120:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=120)
    assert p.returncode == 130 and "continue with the same command and --resume --run stopped" in err, err[-2000:]


def said_strings(path):
    """(line, text) of the strings a program says: in raise statements, print/warn/error calls and log calls."""
    import ast
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    says = ("print", "warn", "error", "info", "warning", "exit", "fail")
    for node in ast.walk(tree):
        call = isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in says
        if isinstance(node, ast.Raise) or call:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    yield sub.lineno, sub.value


def test_messages_suggest_the_kdcache_command_not_make_or_python_m():
    import glob
    phony = re.search(r"^\.PHONY:(.*)$", open(os.path.join(ROOT, "Makefile")).read(), re.M).group(1).split()
    hint = re.compile(r"\bmake (?:%s)\b|python -m kdcache" % "|".join(map(re.escape, phony)))
    bad = []
    for path in glob.glob(os.path.join(ROOT, "kdcache", "**", "*.py"), recursive=True):
        for line, text in said_strings(path):
            if hint.search(text):
                bad.append(f"{os.path.relpath(path, ROOT)}:{line}: {text.strip()[:80]}")
    assert not bad, "\n".join(bad)


def test_every_environment_variable_is_shown_beside_the_options_and_a_bad_one_is_one_line(tmp_path, teacher):
    import glob
    names = set()
    for path in glob.glob(os.path.join(ROOT, "kdcache", "**", "*.py"), recursive=True):
        names |= set(re.findall(r"\bKDCACHE_[A-Z_]+\b", open(path, encoding="utf-8").read()))
    assert {"KDCACHE_DIR", "KDCACHE_TEACHER_THREADS", "KDCACHE_RING_TIMEOUT", "KDCACHE_DIGEST_MEMO"} <= names
    shown = "".join(subprocess.run([KDCACHE, name, "--help"], capture_output=True, text=True, timeout=60).stdout
                    for name in ("cache", "train"))
    assert not {n for n in names if f"${n}" not in shown}, names
    r = subprocess.run([KDCACHE, "cache", "--dataset", "digits", "--teacher", teacher, "--ring", "r"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=60,
                       env={**os.environ, "KDCACHE_RING_TIMEOUT": "soon"})
    assert r.returncode == 2 and "KDCACHE_RING_TIMEOUT='soon'" in r.stderr and len(r.stderr.splitlines()) == 1
