"""Test helpers: deterministic teacher logits by key, and a producer process for crash tests.

`python -m tests.helpers produce --path P --num-samples N ...` writes the cache at P in a
shuffled order, in batches, with an optional delay, and can be killed at any moment.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

from kdcache.store import CacheSpec, CacheWriter

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a test's child process runs with: the clone's packages, one compute thread, MXNet quiet.
CHILD_ENV = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1", "MXNET_SUBGRAPH_VERBOSE": "0"}


def run_bench(module, tmp_path, *args, timeout=600):
    """python -m bench.<module> --quick, its report in tmp_path/results and its scratch files in
    tmp_path/scratch. Asserts a clean exit; returns (the finished process, the JSON report)."""
    out, scratch = tmp_path / "results" / f"{module}.json", tmp_path / "scratch"
    proc = subprocess.run([sys.executable, "-m", f"bench.{module}", "--quick", "--out", str(out), "--tmp", str(scratch),
                           *map(str, args)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc, json.loads(out.read_text())


def positive(v):
    """A measured figure: a finite positive number."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def assert_paired(floors, rounds):
    """Each floor of `floors` ({name: bench.paired.paired(...)}) was decided on rounds[name] paired runs: it
    holds each run's ratio, its median is theirs, and its verdict is theirs against its limit (bench.paired)."""
    import statistics
    from bench.paired import VERDICTS, paired
    for name, n in rounds.items():
        f = floors[name]
        assert len(f["runs"]) == n and all(positive(x) for x in f["runs"]), (name, f)
        assert abs(f["measured"] - statistics.median(f["runs"])) <= 1e-4, (name, f)
        assert f["interval"][0] <= f["measured"] <= f["interval"][1] and f["spread"] >= 0, (name, f)
        op, value = f["limit"].split()
        assert f["verdict"] in VERDICTS
        assert f["verdict"] == paired(f["runs"], float(value), higher_is_better=op == ">=")["verdict"], (name, f)


def expected_logits(keys, num_classes, scale=6.0):
    """The 'teacher output' for flat keys: deterministic, distinct per key, finite, spread."""
    k = np.asarray(keys, dtype=np.float64).reshape(-1, 1)
    c = np.arange(num_classes, dtype=np.float64).reshape(1, -1)
    return (scale * np.sin(0.7389 * k + 1.618 * c + 0.1 * k * c / (1.0 + c))).astype(np.float32)


def gluon_teacher(prefix, classes=10, in_ch=1, seed=0, epoch=0, scale=1.0):
    """A tiny Gluon CNN teacher for 8x8 images, exported as PREFIX-symbol.json / PREFIX-NNNN.params."""
    import mxnet as mx
    from mxnet import gluon
    mx.random.seed(seed)
    net = gluon.nn.HybridSequential(prefix="tch_")
    with net.name_scope():
        net.add(gluon.nn.Conv2D(4, 3, padding=1, activation="relu"), gluon.nn.Flatten(), gluon.nn.Dense(classes))
    net.initialize(mx.init.Xavier(magnitude=2.0 * scale))
    net.hybridize()
    net(mx.nd.zeros((1, in_ch, 8, 8)))
    net.export(prefix, epoch=epoch)
    return net


def make_spec(num_samples=500, num_classes=10, views=1, codec="full", dtype="float32", tag="test"):
    return CacheSpec(num_samples=num_samples, num_classes=num_classes, views=views, codec=codec,
                     dtype=dtype, inputs={"teacher": {"name": tag, "digest": "0" * 16},
                                          "dataset": {"name": "synthetic", "length": num_samples}})


def produce(path, spec, *, shard=(0, 1), batch=32, delay=0.0, seed=0, progress_file=None):
    """Fill (this shard of) the cache in a seeded shuffled order. Returns the writer's complete flag."""
    with CacheWriter(path, spec, shard=shard) as w:
        todo = w.missing()
        order = np.random.default_rng(seed).permutation(todo)
        for a in range(0, order.size, batch):
            keys = order[a:a + batch]
            w.write(keys // spec.views, expected_logits(keys, spec.num_classes), views=keys % spec.views)
            if progress_file:
                with open(progress_file, "a") as fh:
                    fh.write(f"{w.rows_written}\n")
            if delay:
                time.sleep(delay)
    return w.complete


def follow(path, spec, *, timeout=60.0):
    """Reader process: verify every row as it appears until the cache is complete.
    Returns (rows verified, rows that differed from the teacher's output)."""
    import json
    from kdcache.store import CacheReader, CacheNotFoundError
    deadline = time.monotonic() + timeout
    while True:
        try:
            r = CacheReader(path, spec=spec)
            break
        except CacheNotFoundError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    checked = np.zeros(spec.num_keys, dtype=bool)
    bad = 0
    while time.monotonic() < deadline:
        r.refresh()
        new = np.flatnonzero(r._done & ~checked) if not r.complete else np.flatnonzero(~checked)
        if new.size:
            got = r.get(new // spec.views, views=new % spec.views, wait=False)
            want = spec.make_codec().decode(spec.make_codec().encode(expected_logits(new, spec.num_classes)))
            bad += int((~np.all(got == want, axis=1)).sum())
            checked[new] = True
        if r.complete and checked.all():
            break
        time.sleep(0.002)
    print(json.dumps({"verified": int(checked.sum()), "mismatched": bad, "complete": r.complete}), flush=True)
    return 0


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["produce", "follow"])
    p.add_argument("--path", required=True)
    p.add_argument("--num-samples", type=int, default=500)
    p.add_argument("--num-classes", type=int, default=10)
    p.add_argument("--views", type=int, default=1)
    p.add_argument("--codec", default="full")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--shard", default="0/1")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--delay", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-file")
    a = p.parse_args(argv)
    spec = make_spec(a.num_samples, a.num_classes, a.views, a.codec, a.dtype)
    if a.cmd == "follow":
        return follow(a.path, spec)
    i, n = (int(x) for x in a.shard.split("/"))
    done = produce(a.path, spec, shard=(i, n), batch=a.batch, delay=a.delay, seed=a.seed,
                   progress_file=a.progress_file)
    print("complete" if done else "partial", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def label_cache(folder):
    """(digits data set, path) of a complete float32 cache whose 'teacher' is the labels (one-hot x 8):
    enough to check the plumbing of a reader or an iterator learns and serves the right rows."""
    from kdcache.pipeline import load_dataset
    from kdcache.store import CacheSpec, CacheWriter, path_for
    ds = load_dataset("digits")
    spec = CacheSpec(num_samples=len(ds), num_classes=10, dtype="float32", inputs={"teacher": "labels"})
    p = path_for(str(folder), spec.fingerprint)
    with CacheWriter(p, spec) as w:
        w.write(np.arange(len(ds)), np.eye(10, dtype=np.float32)[ds.labels] * 8)
    return ds, p


def reseal(path):
    """Rewrite a finished cache's checksums to match its rows as they are now: a file whose rows were already
    wrong when compaction hashed them (a teacher's NaN, a bug upstream), for tests of the checks that look at
    the values themselves. Without it, the checksums name such a planted change first."""
    import h5py
    from kdcache.store.format import checksums, schema
    from kdcache.store.files.segment import final_spec
    from kdcache.store.files.paths import final_path
    fin = final_path(path)
    spec, _ = final_spec(fin, None)
    with h5py.File(fin, "r+") as f:
        d = f[schema.CHECKSUMS]
        tables = {name: f[name][()].reshape((spec.num_keys,) + tuple(shape))
                  for name, shape, _ in spec.make_codec().fields}
        d[...] = checksums.compute(tables, spec, int(d.attrs[schema.CK_SAMPLES]))
    seal_again(fin)


def seal_again(path):
    """Seal a finished cache file again after a test edited it with h5py: what a writer that produced
    exactly this file would have sealed. The tests of the checks behind the seal (metadata, structure,
    checksums) use it; without it the seal refuses every edit first (test_seal.py)."""
    import h5py
    from kdcache.store.format import seal
    from kdcache.store.files.segment import stored_rows
    with h5py.File(path, "r") as f:
        skip = stored_rows(f)
        assert f.userblock_size == seal.SEAL_BYTES, "only a file written with the seal's user block can be sealed"
    fd = os.open(path, os.O_RDWR)
    try:
        seal.write(fd, skip)
    finally:
        os.close(fd)


def as_format_1(path):
    """Rewrite a finished cache file as kdcache wrote it before seals (format version 1): no user block, its
    attributes and datasets as they are (contiguous, in a fresh HDF5 file)."""
    import h5py
    from kdcache.store.format import schema
    tmp = path + ".v1"
    with h5py.File(path, "r") as src, h5py.File(tmp, "w") as out:
        for k, v in src.attrs.items():
            out.attrs[k] = v.decode() if isinstance(v, bytes) else v
        out.attrs[schema.A_FORMAT] = 1
        for k in src:
            d = out.create_dataset(k, data=src[k][()])
            for a, v in src[k].attrs.items():
                d.attrs[a] = v.decode() if isinstance(v, bytes) else v
    os.replace(tmp, path)


def flip(path, at, bit):
    """Flip bit `bit` of byte `at` of the file at `path`, in place (flipping it again restores it)."""
    fd = os.open(path, os.O_RDWR)
    try:
        b = os.pread(fd, 1, at)[0]
        os.pwrite(fd, bytes([b ^ (1 << bit)]), at)
    finally:
        os.close(fd)


def listening(pids):
    """{(pid, local address)} of the TCP sockets that `pids` listen on, from `ss -ltnpH`."""
    import re
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=30).stdout
    found = set()
    for line in out.splitlines():
        cols = line.split()
        if len(cols) < 6:
            continue
        host = cols[3].rsplit(":", 1)[0].strip("[]").split("%")[0]
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                found.add((pid, host))
    return found


def is_loopback(host):
    import ipaddress
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False  # '*' (every address), or a name
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def cache_rows(path):
    """Every dataset of a finished cache file but its checksum table, read whole (h5py, as a user reads it)."""
    import h5py
    with h5py.File(path, "r") as f:
        return {k: f[k][...] for k in f.keys() if k != "checksums"}


def assert_same_cache(a, b):
    """Two finished caches hold the same datasets, bit for bit."""
    x, y = cache_rows(a), cache_rows(b)
    assert sorted(x) == sorted(y)
    for k in x:
        assert np.array_equal(x[k], y[k]), k
