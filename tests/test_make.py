"""Make hands every variable to the tools as exactly one argument, never as text of a command line: the
project's Makefile is run for real (each target a user runs) in a copy whose .venv holds stand-ins for
`kdcache` and `python` that record the argv they receive. Values holding ';', '$', backquotes, quotes,
spaces, new lines, globs, and make's own `$(shell ...)`: nothing they hold is ever run (a canary file is
never created) and each arrives whole as FLAG=VALUE; an empty value passes no option (the tool's default)."""
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.helpers import ROOT

MAKE = shutil.which("make")
pytestmark = pytest.mark.skipif(MAKE is None, reason="no make")

# What each of a user's targets passes, found in its recipe as `make -n` prints it.
PASSED = re.compile(r'\$\{([A-Z_]+):\+(--[a-z-]+)="\$\1"\}')
TARGETS = ("cache", "cache-online", "train", "train-dist", "teacher", "caches", "verify", "bench-ensemble",
           "bench-kd", "bench-codecs", "bench-quality", "test", "test-fast")

RECORDER = """#!{python}
import json, os, sys
with open({log!r}, "a") as fh:
    fh.write(json.dumps({{"argv": sys.argv[1:], "PYTEST_ADDOPTS": os.environ.get("PYTEST_ADDOPTS")}}) + "\\n")
"""


def hostile(canary, name):
    """Values that would run `touch canary` if a shell or make read them as code, each naming its variable."""
    c = shlex.quote(canary)
    return {
        "semicolon": f"0;touch${{IFS}}{c};{name}",
        "make-shell": f"$(shell touch {c}){name}",
        "backquotes": f"`touch {c}`{name}",
        "dollar-paren": f"$(touch {c}) $HOME ${{HOME}} {name}",
        "quotes": f"it's \"{name}\" '; touch {c}; '",
        "spaces": f"a  b\tc {name} ",  # (blanks before a value are make's own syntax: it drops them)
        "newline": f"x\ntouch {c}\n{name}",
        "glob-and-more": f"* ? [a] ~ % # \\ | & > {c}.out < /dev/null {name}",
    }


@pytest.fixture
def project(tmp_path):
    """A copy of the Makefile whose .venv is stand-ins recording their argv; the default teachers exist."""
    d = tmp_path / "p"
    (d / ".venv" / "bin").mkdir(parents=True)
    (d / "teachers").mkdir()
    shutil.copy(os.path.join(ROOT, "Makefile"), d / "Makefile")
    for name in ("pyproject.toml", "constraints.txt"):
        shutil.copy(os.path.join(ROOT, name), d / name)
    log = str(tmp_path / "argv.jsonl")
    for tool in ("kdcache", "python"):
        p = d / ".venv" / "bin" / tool
        p.write_text(RECORDER.format(python=sys.executable, log=log))
        p.chmod(0o755)
    for name in ("digits", "mnist5k"):
        (d / "teachers" / f"{name}-symbol.json").write_text("{}")
    (d / ".venv" / ".installed").touch()
    for name in ("pyproject.toml", "constraints.txt"):
        os.utime(d / name, (1, 1))  # older than the stamp: setup has nothing to do
    return d, log


def make(d, *args):
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "PYTEST_ADDOPTS")}
    return subprocess.run([MAKE, "-s", "-C", str(d), *args], capture_output=True, text=True, timeout=60, env=env)


def passed(d, target, assignments):
    """(variable, flag) the target's recipe passes, from `make -n`."""
    r = make(d, "-n", target, *assignments)
    assert r.returncode == 0, r.stderr
    return set(PASSED.findall(r.stdout))


def calls(log):
    if not os.path.exists(log):
        return []
    with open(log) as fh:
        out = [json.loads(line) for line in fh]
    os.unlink(log)
    return out


@pytest.mark.parametrize("kind", list(hostile("c", "V")))
def test_every_value_reaches_the_tool_as_one_argument_and_nothing_it_holds_runs(project, tmp_path, kind):
    d, log = project
    canary = str(tmp_path / "canary")
    variables = ("DATASET DATA_ROOT TEACHER CACHE_DIR VIEWS AUGMENT CODEC SEED EPOCHS BATCH_SIZE THREADS SHARDS "
                 "STUDENT T ALPHA RUN TEACHER_MODE WORKERS CACHE").split()
    values = {v: hostile(canary, v)[kind] for v in variables}
    checked = 0
    for target in TARGETS:
        given = dict(values)
        if target == "teacher":  # names the teacher it builds: the data set must be a built-in one
            given["DATASET"] = "digits"
            os.unlink(d / "teachers" / "digits-symbol.json")
        if target.startswith("test"):
            given = {"PYTEST_ARGS": f"-k 'a b' {shlex.quote(values['SEED'])}"}
        assignments = [f"{k}={v}" for k, v in given.items()]
        expect = passed(d, target, assignments)
        r = make(d, target, *assignments)
        assert r.returncode == 0, (target, r.stderr[-2000:])
        assert not os.path.exists(canary) and not os.path.exists(canary + ".out"), f"make {target} ran a value"
        (call,) = calls(log)
        argv = call["argv"]
        for var, flag in expect:
            words = [a for a in argv if a.startswith(flag + "=")]
            assert words == [f"{flag}={given[var]}"], (target, var, words)
            checked += 1
        if target == "verify":
            assert argv[-2:] == ["--", given["CACHE"]]
            checked += 1
        if target.startswith("test"):  # pytest splits PYTEST_ADDOPTS as a shell would, running nothing
            assert shlex.split(call["PYTEST_ADDOPTS"]) == ["-k", "a b", values["SEED"]]
            checked += 1
        if target == "teacher":
            assert argv[:5] == ["teacher", "--dataset", "digits", "--out", "teachers/digits"]
            (d / "teachers" / "digits-symbol.json").write_text("{}")
    assert checked >= 60  # every shared, producer and trainer variable on the targets that take them


def test_an_empty_value_passes_no_option_and_the_tool_keeps_its_default(project):
    d, log = project
    empty = [f"{v}=" for v in ("DATASET", "SEED", "T", "ALPHA", "RUN", "THREADS", "WORKERS", "CACHE_DIR",
                               "STUDENT", "CODEC")]
    for target in ("cache", "cache-online", "train", "train-dist", "caches", "bench-ensemble"):
        r = make(d, target, *empty)
        assert r.returncode == 0, r.stderr
        (call,) = calls(log)
        assert not any("=" in a for a in call["argv"]), (target, call["argv"])
    r = make(d, "train", "T=4", "ALPHA=0.3", "SEED=")
    (call,) = calls(log)
    assert r.returncode == 0 and call["argv"] == ["train", "--temperature=4", "--alpha=0.3"]
    r = make(d, "verify")  # CACHE is required: one line, nothing runs
    assert r.returncode != 0 and "make verify needs CACHE=PATH" in r.stderr and not calls(log)


def test_a_value_that_would_name_another_variable_is_no_variable(project):
    """A value holding spaces and '=' is one value, not more variables (the unknown-variable check used to
    read the values as words)."""
    d, log = project
    r = make(d, "train", "RUN=a b=c TEMPERATURE=4")
    assert r.returncode == 0, r.stderr
    (call,) = calls(log)
    assert call["argv"] == ["train", "--run=a b=c TEMPERATURE=4"]
    r = make(d, "-n", "train", "TEMPERATURE=4")
    assert r.returncode != 0 and "TEMPERATURE: no such variable" in r.stderr
