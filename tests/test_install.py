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
    """`pip install '.[datasets,images]'` (not editable) into a new virtual environment: the packages and the command
    come from that environment alone, and the walk-through runs with them."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    # pip builds in the source tree (build/, *.egg-info): from a copy, so the clone keeps no build
    # output and no earlier build's files can slip into this one.
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "caches", "runs", "teachers"))
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          f"{src}[datasets,images]", "numpy==1.23.5"], capture_output=True, text=True, timeout=1800)
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


# Other versions than constraints.txt's, inside pyproject.toml's ranges: a user's project as it might be.
USERS_H5PY, USERS_PILLOW, USERS_SKLEARN = "3.11.0", "10.4.0", "1.4.2"
NOT_DEPENDENCIES = ("pandas", "matplotlib", "sklearn", "mlxtend", "PIL", "scipy")


def _pip(venv, *args):
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                        *args], capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]


def _versions(venv, *dists):
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(d):\n    try:\n        return m.version(d)\n    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({d: v(d) for d in sys.argv[1:]}))")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code, *dists], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_kdcache_keeps_a_users_versions_and_needs_only_its_four_dependencies(tmp_path):
    """pip install kdcache into an environment that has its own h5py: that h5py stays, and kdcache builds and reads
    a cache from the user's .npz with nothing but mxnet, numpy, h5py and tqdm; a demo data set names its extra.
    Then the user's Pillow and scikit-learn stay too when the extras are installed."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    src = tmp_path / "src"
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__",
                                                             "caches", "runs", "teachers"))
    _pip(venv, "numpy==1.23.5", f"h5py=={USERS_H5PY}")
    _pip(venv, str(src))
    got = _versions(venv, "numpy", "h5py", "mxnet", "tqdm", "pandas", "matplotlib", "scikit-learn", "mlxtend", "pillow",
                    "scipy")
    assert got["numpy"] == "1.23.5" and got["h5py"] == USERS_H5PY, got
    assert got["mxnet"] and got["tqdm"], got
    assert all(got[d] is None for d in ("pandas", "matplotlib", "scikit-learn", "mlxtend", "pillow", "scipy")), got
    env = clean_env(str(venv / "bin"))
    work = tmp_path / "project"
    work.mkdir()
    make = ("import numpy as np\nrng = np.random.default_rng(0)\ny = rng.integers(0, 4, 400)\n"
            "x = (rng.random((400, 1, 8, 8)) * 64 + y[:, None, None, None] * 48).astype(np.uint8)\n"
            "np.savez('mine.npz', x_train=x, y_train=y, x_test=x[:80], y_test=y[:80])\n")
    subprocess.run([str(venv / "bin" / "python"), "-c", make], cwd=work, env=env, check=True, timeout=120)
    data = ["--dataset", "npz", "--data-root", "mine.npz"]
    for argv in (["kdcache", "teacher", *data, "--epochs", "2", "--out", "teachers/mine", "--quiet"],
                 ["kdcache", "cache", *data, "--teacher", "teachers/mine", "--json", "--quiet"]):
        r = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, f"{argv}: {r.stderr[-3000:]}"
    cache = json.loads(r.stdout.strip().splitlines()[-1])["cache_path"]
    read = ("import sys, kdcache\nr = kdcache.CacheReader(sys.argv[1])\nt = r.get(list(range(400)))\n"
            "print(r.complete, t.shape, int((t.argmax(1) >= 0).sum()))\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", read, cache], cwd=work, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["True", "(400,", "4)", "400"], r.stdout + r.stderr
    gone = subprocess.run([str(venv / "bin" / "python"), "-c", "import importlib.util as u, sys; "
                           f"print([n for n in {NOT_DEPENDENCIES!r} if u.find_spec(n)])"],
                          cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert gone.stdout.strip() == "[]", gone.stdout + gone.stderr
    for name in ("digits", "mnist5k"):
        r = subprocess.run(["kdcache", "cache", "--dataset", name, "--teacher", "teachers/mine", "--quiet"], cwd=work, env=env,
                           capture_output=True, text=True, timeout=300)
        errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
        assert r.returncode == 2 and len(errors) == 1 and "pip install 'kdcache[datasets]'" in errors[0], r.stderr
    # the extras beside the user's own Pillow and scikit-learn: theirs stay, mlxtend comes
    _pip(venv, "numpy==1.23.5", f"pillow=={USERS_PILLOW}", f"scikit-learn=={USERS_SKLEARN}")
    _pip(venv, f"{src}[datasets,images]")
    got = _versions(venv, "numpy", "h5py", "pillow", "scikit-learn", "mlxtend")
    assert got == {"numpy": "1.23.5", "h5py": USERS_H5PY, "pillow": USERS_PILLOW, "scikit-learn": USERS_SKLEARN,
                   "mlxtend": got["mlxtend"]} and got["mlxtend"].startswith("0.23."), got
    r = subprocess.run([str(venv / "bin" / "python"), "-c", "from kdcache.pipeline.datasets import load_dataset; "
                        "print(len(load_dataset('digits')), len(load_dataset('mnist5k')))"],
                       cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.split() == ["1438", "4000"], r.stdout + r.stderr
