"""examples/ as a user runs them: each file's own "Run" lines, in a folder outside the clone, with
the installed kdcache (no PYTHONPATH); the manual (docs/examples.md) shows the same lines."""
import glob
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.test_install import clean_env

pytestmark = pytest.mark.slow
EXAMPLES = sorted(glob.glob(os.path.join(ROOT, "examples", "*.py")))


def run_lines(path):
    """The indented command lines under "Run" in an example's docstring."""
    doc = re.match(r'"""(.*?)"""', open(path).read(), re.S).group(1)
    block = re.search(r"\nRun[^\n]*:\n((?: {4}\S[^\n]*\n)+)", doc).group(1)
    return [ln.strip() for ln in block.splitlines()]


def test_every_example_says_how_to_run_it_and_the_manual_shows_it():
    readme = open(os.path.join(ROOT, "docs", "examples.md")).read()
    assert {os.path.basename(p) for p in EXAMPLES} == {"gluon_loop.py", "module_fit.py", "own_pieces.py"}
    for p in EXAMPLES:
        lines = run_lines(p)
        assert lines and any(os.path.basename(p).split(".")[0] in ln for ln in lines)
        for ln in lines:
            assert ln in readme, f"docs/examples.md lacks the line {ln!r} of {os.path.basename(p)}"


@pytest.mark.parametrize("example", [os.path.basename(p) for p in EXAMPLES])
def test_each_example_runs_outside_the_clone(tmp_path, example):
    work = tmp_path / "mine"
    work.mkdir()
    shutil.copy(os.path.join(ROOT, "examples", example), work)
    env, cache = clean_env(os.path.dirname(sys.executable)), None
    outputs = []
    for line in run_lines(os.path.join(ROOT, "examples", example)):
        argv = shlex.split(line.replace("CACHE", cache or "CACHE"))
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{line}: {r.stderr[-3000:]}"
        if argv[:2] == ["kdcache", "cache"]:
            cache = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
        outputs.append(r.stdout)
    if example == "own_pieces.py":
        (metrics,) = glob.glob(str(work / "runs" / "*" / "metrics.json"))
        m = json.load(open(metrics))
        assert m["dataset"] == "own_pieces:load" and m["student"] == "own_pieces:student"
        assert m["teacher_forwards"] > 0 and m["test_acc"] > 0.85
    else:
        acc = float(re.search(r"student test accuracy ([\d.]+)", outputs[-1]).group(1))
        assert acc > 0.85  # 10 classes: chance is 0.1
