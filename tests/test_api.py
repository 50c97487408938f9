"""The public Python API (kdcache.build_cache, cache_path, SoftTargetDataset, SoftTargetIter, ...) as user code calls it."""
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

import kdcache
from kdcache.store import StoreError
from tests.conftest import ROOT
from tests.helpers import gluon_teacher

PY = sys.executable


def test_import_kdcache_is_light_and_help_shows_the_public_api(tmp_path):
    code = ("import sys, pydoc, kdcache\n"
            "heavy = [m for m in ('mxnet', 'numpy', 'h5py') if m in sys.modules]\n"
            "print(heavy)\n"
            "print(pydoc.render_doc(kdcache, renderer=pydoc.plaintext))\n")
    r = subprocess.run([PY, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    first, _, doc = r.stdout.partition("\n")
    assert first == "[]"
    for name in ("build_cache", "cache_path", "load_dataset", "CacheReader", "SoftTargetDataset", "KDLoss",
                 "SoftTargetIter", "kd_symbol"):
        assert name in kdcache.__all__ and (f"\n    {name}(" in doc or f"\n    class {name}(" in doc), name


def test_caches_record_the_package_version(tmp_path, teacher):
    import h5py
    path = kdcache.build_cache(teacher, "digits", cache_dir=str(tmp_path / "c"))
    with h5py.File(path, "r") as f:
        assert f.attrs["tool_version"].decode() == kdcache.__version__  # text attributes are fixed-length bytes


@pytest.fixture(scope="module")
def built(tmp_path_factory, teacher):
    """A digits cache built from Python, and the path cache_path said it would have before."""
    d = str(tmp_path_factory.mktemp("api") / "caches")
    before = kdcache.cache_path(teacher, "digits", cache_dir=d, codec="topk:3", dtype="float32")
    assert not os.path.exists(before)
    path = kdcache.build_cache(teacher, "digits", cache_dir=d, codec="topk:3", dtype="float32")
    return d, before, path


def test_build_cache_is_the_command_line_s_cache(built, teacher):
    d, before, path = built
    assert path == before and os.path.exists(path)
    r = subprocess.run([os.path.join(os.path.dirname(PY), "kdcache"), "cache", "--teacher", teacher, "--dataset",
                        "digits", "--cache-dir", d, "--codec", "topk:3", "--dtype", "float32", "--json", "--quiet"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["cache_path"] == path and out["reused"] and out["teacher_forwards"] == 0


def test_a_hybridblock_teacher_names_the_cache_its_export_names(tmp_path, teacher):
    net = gluon_teacher(str(tmp_path / "again"))  # the fixture's teacher, built again (same seed)
    d = str(tmp_path / "c")
    assert kdcache.cache_path(net, "digits", cache_dir=d, teacher_name=os.path.basename(teacher)) == \
        kdcache.cache_path(teacher, "digits", cache_dir=d)


def test_build_cache_refuses_in_one_line(tmp_path, teacher):
    d = str(tmp_path / "c")
    with pytest.raises(kdcache.BuildError, match=r"^argument --codec: 'bogus': use full") as e:
        kdcache.build_cache(teacher, "digits", cache_dir=d, codec="bogus")
    assert "\n" not in str(e.value)
    with pytest.raises(kdcache.BuildError, match="argument --codec"):
        kdcache.cache_path(teacher, "digits", cache_dir=d, codec="bogus")
    with pytest.raises(kdcache.BuildError, match="pass the data set's name"):
        kdcache.build_cache(teacher, kdcache.load_dataset("digits"), cache_dir=d)
    assert not os.listdir(d) if os.path.exists(d) else True


def test_build_cache_explains_a_symbolblock_and_builds_from_one_that_ran(tmp_path, teacher):
    import mxnet as mx
    from mxnet import gluon
    d = str(tmp_path / "c")
    net = gluon.SymbolBlock.imports(teacher + "-symbol.json", ["data"], teacher + "-0000.params")
    with pytest.raises(kdcache.BuildError) as e:  # before its first forward it exports no parameters
        kdcache.build_cache(net, "digits", cache_dir=d)
    msg = str(e.value)
    assert "\n" not in msg and "SymbolBlock" in msg and "prefix it was imported from" in msg, msg
    assert "unnamed list" not in msg
    net.hybridize()
    net(mx.nd.zeros((1, 1, 8, 8)))
    path = kdcache.build_cache(net, "digits", cache_dir=d)
    with kdcache.CacheReader(path) as r, kdcache.CacheReader(kdcache.build_cache(teacher, "digits", cache_dir=d)) as w:
        assert np.array_equal(r.get(np.arange(50), 0), w.get(np.arange(50), 0))  # the same teacher's targets


def resplit_digits(seed):
    """digits' train split drawn with another seed: as long as the real one, other images."""
    from sklearn.datasets import load_digits
    from kdcache.pipeline.dataset_base import ArrayDataset
    raw = load_digits()
    x, y = raw.images.astype(np.uint8)[:, None], raw.target.astype(np.int64)
    idx = np.sort(np.random.default_rng(seed).permutation(len(x))[int(round(len(x) * 0.2)):])
    return ArrayDataset("digits", "train", x[idx], y[idx], 10, scale=16.0)


def test_soft_target_dataset_refuses_other_content_of_the_same_length(built):
    _, _, path = built
    same = resplit_digits(0)
    ds = kdcache.SoftTargetDataset(same, path)  # the cache's own data: accepted
    assert len(ds) == 1438 and ds[5][2].shape == (10,)
    other = resplit_digits(1)
    assert len(other) == len(same) and not np.array_equal(other.data, same.data)
    with pytest.raises(StoreError) as e:
        kdcache.SoftTargetDataset(other, path)
    msg = str(e.value)
    assert "\n" not in msg and "another data set" in msg and "digest" in msg, msg


def test_soft_target_iter_takes_a_gluon_dataset(built):
    from mxnet import gluon
    _, _, path = built
    digits = kdcache.load_dataset("digits")
    items = gluon.data.SimpleDataset([digits[i] for i in range(len(digits))])
    with kdcache.CacheReader(path) as reader:
        it = kdcache.SoftTargetIter(items, reader, batch_size=100)
        batch = it.next()
        assert batch.data[0].shape == (100, 1, 8, 8)
        want = reader.get(batch.index, 0)
        assert np.array_equal(batch.label[1].asnumpy(), want)
        x, y = digits.get_batch(batch.index)
        assert np.array_equal(batch.data[0].asnumpy(), x) and np.array_equal(batch.label[0].asnumpy(), y)
        with pytest.raises(ValueError, match="the data set has 3 items, the cache holds targets for 1438"):
            kdcache.SoftTargetIter(gluon.data.SimpleDataset([digits[i] for i in range(3)]), reader)


def api_examples():
    """docs/api.md's Python files (blocks starting '# NAME.py:') and the shell lines that run them."""
    import re
    text = open(os.path.join(ROOT, "docs", "api.md")).read()
    files = {m.group(2): m.group(1) for m in re.finditer(r"```python\n(# (\w+\.py):.*?\n)```", text, re.S)}
    block = next(b for b in re.findall(r"```sh\n(.*?)```", text, re.S) if "python api_gluon.py" in b)
    return files, [ln.split("  #")[0].strip() for ln in block.splitlines() if ln.strip()]


def test_the_gluon_example_reads_through_dataloader_workers_on_the_net_s_context():
    code = api_examples()[0]["api_gluon.py"]
    loader = re.search(r"gluon\.data\.DataLoader\(train, [^\n]*num_workers=(\d+)", code)
    assert loader and int(loader.group(1)) > 0, "the example's DataLoader has no worker processes"
    assert "net.hybridize()" in code and "x.as_in_context(ctx)" in code and "soft.as_in_context(ctx)" in code
    page = open(os.path.join(ROOT, "docs", "api.md")).read()
    assert "cpu_shared(0)" in page and "CachedOp requires all inputs to live on the same context" in page


@pytest.mark.slow
def test_the_api_page_s_examples_run_outside_the_clone(tmp_path):
    import re
    import shlex
    from tests.test_install import clean_env
    files, lines = api_examples()
    assert set(files) == {"api_gluon.py", "api_module.py"}
    for name, code in files.items():
        (tmp_path / name).write_text(code)
    env = clean_env(os.path.dirname(PY))
    for line in lines:
        r = subprocess.run(shlex.split(line), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, f"{line}: {r.stderr[-3000:]}"
        if line.startswith("python "):
            acc = float(re.search(r"student test accuracy ([\d.]+)", r.stdout).group(1))
            assert acc > 0.9, (line, acc)  # 10 classes: chance is 0.1
    assert len(os.listdir(tmp_path / "caches")) == 1  # both examples read the one cache
