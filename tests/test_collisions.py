"""A user's folder holding its own pipeline.py, trainer.py, store.py and bench.py: kdcache's commands, the
children they start and a user's script run from there take kdcache's own modules, never these."""
import os
import subprocess
import sys

import pytest

from tests.test_install import clean_env

pytestmark = pytest.mark.slow
NAMES = ("pipeline", "trainer", "store", "bench", "cache_builder")

SCRIPT = """\
import sys
from kdcache import CacheReader, KDLoss, SoftTargetDataset, load_dataset
import mxnet as mx
data = SoftTargetDataset(load_dataset("digits"), sys.argv[1])
x, y, soft = data[3]
loss = KDLoss(temperature=4, alpha=0.5)(mx.nd.array(soft[None]), mx.nd.array(soft[None]), mx.nd.array([y]))
print("read", soft.shape, float(loss.asscalar()) >= 0)
"""


def test_commands_children_and_scripts_ignore_same_named_modules_in_the_working_folder(tmp_path, teacher):
    work = tmp_path / "mine"
    work.mkdir()
    for name in NAMES:
        (work / f"{name}.py").write_text(f"raise ImportError('the folder\\'s own {name}.py was imported')\n")
    (work / "user_script.py").write_text(SCRIPT)
    env = clean_env(os.path.dirname(sys.executable))
    run = lambda *argv: subprocess.run(list(argv), cwd=work, env=env, capture_output=True, text=True, timeout=600)
    common = ["--teacher", teacher, "--dataset", "digits", "--cache-dir", "caches", "--dtype", "float32"]
    r = run("kdcache", "cache", *common, "--json", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "the folder's own" not in r.stderr
    # train's children: the test split's producer (a new cache) from this folder too
    r = run("kdcache", "train", *common, "--epochs", "1", "--run", "one", "--threads", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    for log in (work / "runs" / "one").glob("*.log"):
        assert "the folder's own" not in log.read_text()
    cache = [f for f in os.listdir(work / "caches") if f.endswith(".h5")]
    assert len(cache) == 2  # the training split's and the test split's
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", *common, "--json", "--quiet"], cwd=work,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and '"reused": true' in r.stdout, r.stderr[-3000:]
    train_cache = r.stdout.strip().splitlines()[-1].split('"cache_path": "')[1].split('"')[0]
    r = run(sys.executable, "user_script.py", train_cache)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().endswith("read (10,) True"), r.stdout
