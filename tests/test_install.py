"""kdcache as a user gets it: installed with pip, its examples run from a directory outside the clone."""
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

pytestmark = pytest.mark.slow


def readme_examples():
    """The README's Python files (blocks starting '# NAME.py:') and its walk-through's shell lines."""
    text = open(os.path.join(ROOT, "README.md")).read()
    files = {m.group(2): m.group(1) for m in re.finditer(r"```python\n(# (\w+\.py):.*?\n)```", text, re.S)}
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "python train_student.py" in b)
    lines = [ln.split("  #")[0].strip() for ln in block.splitlines()]
    return files, [ln for ln in lines if ln]


def clean_env(bin_dir):
    """A user's shell: the environment's bin first on PATH, no PYTHONPATH, one thread each."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PATH=bin_dir + os.pathsep + env["PATH"], OMP_NUM_THREADS="1", MXNET_SUBGRAPH_VERBOSE="0")
    return env


def walk_through(work, bin_dir):
    """Run the README's walk-through in `work` with the installed kdcache; returns the outputs."""
    files, lines = readme_examples()
    assert set(files) >= {"train_student.py", "store_example.py"}
    for name, code in files.items():
        (work / name).write_text(code)
    env, cache, out = clean_env(bin_dir), None, {}
    for line in lines:
        argv = shlex.split(line.replace("caches/<fingerprint>.h5", cache or "?"))
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{line}: {r.stderr[-3000:]}"
        if argv[:2] == ["kdcache", "cache"]:
            cache = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
        out[argv[1]] = r.stdout  # by script or kdcache command
    return out


def check_outputs(out):
    acc = float(re.search(r"student test accuracy ([\d.]+)", out["train_student.py"]).group(1))
    assert acc > 0.8  # 10 classes: chance is 0.1
    assert "complete: True" in out["store_example.py"]


def test_the_readme_walk_through_runs_outside_the_clone_with_the_installed_package(tmp_path):
    bin_dir = os.path.dirname(sys.executable)
    assert os.path.exists(os.path.join(bin_dir, "kdcache")), "make setup installs the kdcache command"
    work = tmp_path / "my-project"
    work.mkdir()
    assert not str(work).startswith(ROOT)
    check_outputs(walk_through(work, bin_dir))


def test_pip_install_into_a_fresh_environment(tmp_path):
    """`pip install .` (not editable) into a new virtual environment: the packages and the command
    come from that environment alone, and the walk-through runs with them."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # pip builds in the source tree (build/, *.egg-info): from a copy, so the clone keeps no build
    # output and no earlier build's files can slip into this one.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "caches", "runs", "teachers"))
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          str(src), "numpy==1.23.5"], capture_output=True, text=True, timeout=1800)
    assert pip.returncode == 0, pip.stderr[-3000:]
    env = clean_env(str(venv / "bin"))
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import kdcache.store, kdcache.pipeline, "
                            "kdcache.trainer, kdcache.cache_builder, kdcache.store.ring, numpy; "
                            "print(kdcache.store.__file__, numpy.__version__)"],
                           cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert where.returncode == 0, where.stderr
    path, numpy_version = where.stdout.split()
    assert path.startswith(str(venv)) and numpy_version == "1.23.5"
    # one name at the top of site-packages: kdcache's own records list only it, and no other of its
    # packages is importable by a bare name
    records = glob.glob(str(venv / "lib" / "python*" / "site-packages" / "kdcache-*.dist-info" / "RECORD"))
    assert len(records) == 1
    top = {line.split(",")[0].split("/")[0] for line in open(records[0]) if line.strip()}
    assert {t for t in top if not t.endswith(".dist-info") and t != ".." and not t.startswith("__editable")} \
        == {"kdcache"}, top
    bare = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u; print([n for n in "
                           "('store', 'pipeline', 'trainer', 'cache_builder', 'bench') if u.find_spec(n)])"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert bare.stdout.strip() == "[]", bare.stdout + bare.stderr
    helped = subprocess.run(["kdcache", "--help"], cwd=tmp_path, env=env, capture_output=True, text=True)
    for cmd in ("teacher", "cache", "train", "launch", "ls", "inspect", "verify", "gc"):
        assert re.search(rf"^  {cmd} ", helped.stdout, re.M), cmd
    work = tmp_path / "work"
    work.mkdir()
    check_outputs(walk_through(work, str(venv / "bin")))


def test_the_readme_error_example_is_what_the_command_prints(tmp_path):
    text = open(os.path.join(ROOT, "README.md")).read()
    cmd, line = re.search(r"```\n\$ (kdcache [^\n]+)\n(error: [^\n]+)\n```", text).groups()
    r = subprocess.run(shlex.split(cmd), cwd=tmp_path, env=clean_env(os.path.dirname(sys.executable)),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == line
