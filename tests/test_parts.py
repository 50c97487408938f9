"""Immutable parts (store.files.parts, NOTE [parts]): published exactly once, checked at finish, the same cache
as one host's build; `kdcache cache --scratch` with `--shard i/n` as a loop of commands (a Slurm array)."""
import glob
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from kdcache.store import CacheReader
from kdcache.store.errors import DamagedFileError
from kdcache.store.files.parts import PartConflictError, check_parts, part_name, publish, read_part, write_part
from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, assert_same_cache, make_spec


def encoded(spec, keys, seed=0):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(keys.size, spec.num_classes)).astype(np.float32)
    return spec.make_codec().encode(logits, keys=keys)


def part(tmp_path, spec, a, b, keys, seed=0, where="scratch"):
    d = tmp_path / where
    d.mkdir(exist_ok=True)
    p = str(d / part_name(a, b, keys))
    return write_part(p, spec, a, b, keys, encoded(spec, keys, seed))


def rows_offset(path):
    """Where a part's logits lie in its file (contiguous, as in a finished file)."""
    with h5py.File(path, "r") as f:
        return f["logits"].id.get_offset()


def flip(path, offset, bit=4):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ (1 << bit)]))


def test_a_part_is_published_once_an_equal_retry_is_dropped_and_a_different_one_refused(tmp_path):
    spec = make_spec(num_samples=100, num_classes=10)
    shared = tmp_path / "P.parts"
    shared.mkdir()
    keys = np.arange(32, 64)
    first = part(tmp_path, spec, 32, 64, keys, seed=0, where="host-a")
    assert publish(first, str(shared), spec) == "published"
    name = os.path.basename(first)
    before = open(shared / name, "rb").read()
    again = part(tmp_path, spec, 32, 64, keys, seed=0, where="host-b")
    assert publish(again, str(shared), spec) == "duplicate"
    other = part(tmp_path, spec, 32, 64, keys, seed=1, where="host-c")
    with pytest.raises(PartConflictError, match="different rows"):
        publish(other, str(shared), spec)
    assert open(shared / name, "rb").read() == before  # the first publish is what stays
    assert sorted(os.listdir(shared)) == [name]  # no temporary copy left behind
    got_keys, data = read_part(str(shared / name), spec)
    assert np.array_equal(got_keys, keys)


def test_a_damaged_part_is_named_and_set_aside_a_key_in_two_parts_must_agree(tmp_path):
    spec = make_spec(num_samples=64, num_classes=10)
    shared = tmp_path / "P.parts"
    shared.mkdir()
    for a in (0, 32):
        publish(part(tmp_path, spec, a, a + 32, np.arange(a, a + 32), seed=a), str(shared), spec)
    victim = sorted(glob.glob(str(shared / "part-*.h5")))[1]
    flip(victim, rows_offset(victim) + 100)  # one flipped bit in the rows
    with pytest.raises(DamagedFileError, match="CRC-32"):
        read_part(victim, spec)
    report = check_parts(str(shared), spec)
    assert [n for n, _ in report["damaged"]] == [os.path.basename(victim)]
    assert report["parts"] == 1 and report["keys"] == 32
    assert not os.path.exists(victim)  # set aside: its keys are owed again
    # a part over [0, 64) that repeats keys 0..31 with other rows: two computations disagree
    publish(part(tmp_path, spec, 0, 64, np.arange(0, 64), seed=7, where="other"), str(shared), spec)
    with pytest.raises(PartConflictError, match="both hold key 0"):
        check_parts(str(shared), spec)


def cli(*args, check=True, timeout=300):
    r = subprocess.run([sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--json", *map(str, args)],
                       capture_output=True, text=True, env=CHILD_ENV, cwd=ROOT, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


def test_shards_by_hand_write_parts_and_the_cache_equals_one_hosts_build(tmp_path, teacher):
    common = ["--teacher", teacher, "--dataset", "digits", "--threads", "1"]
    one = cli(*common, "--cache-dir", tmp_path / "one")
    assert one["complete"]
    shared = tmp_path / "shared"
    outs = []
    for i in range(3):  # as a Slurm array would: one command per host, each with its own local scratch
        outs.append(cli(*common, "--cache-dir", shared, "--shard", f"{i}/3", "--scratch", tmp_path / f"scratch{i}",
                        "--block-rows", 256))
        parts = glob.glob(str(shared / "*.parts" / "*"))
        assert not [p for p in parts if "seg-" in os.path.basename(p)]  # parts only: no SWMR segment
    assert [o["complete"] for o in outs] == [False, False, True]  # the last one finishes
    n = one["rows_written"]  # digits' training split: 1,438 keys, 6 tasks of 256 keys
    assert sum(o["rows_written"] for o in outs) == n and sum(o["tasks"] for o in outs) == -(-n // 256)
    assert outs[-1]["cache_path"].endswith(".h5") and not glob.glob(str(shared / "*.parts"))
    assert_same_cache(one["cache_path"], outs[-1]["cache_path"])
    for i in range(3):
        assert not os.listdir(tmp_path / f"scratch{i}")  # every part left scratch once published
    again = cli(*common, "--cache-dir", shared, "--shard", "0/3", "--scratch", tmp_path / "scratch0")
    assert again["reused"] and again["rows_written"] == 0


def test_a_damaged_part_is_caught_at_finish_and_computed_again(tmp_path, teacher):
    common = ["--teacher", teacher, "--dataset", "digits", "--threads", "1", "--block-rows", "512",
              "--cache-dir", tmp_path / "c"]
    one = cli("--teacher", teacher, "--dataset", "digits", "--threads", "1", "--cache-dir", tmp_path / "one")
    first = cli(*common, "--shard", "0/2", "--scratch", tmp_path / "s0")
    assert not first["complete"]
    mine = sorted(glob.glob(str(tmp_path / "c" / "*.parts" / "part-*.h5")))
    assert len(mine) == 2
    flip(mine[0], rows_offset(mine[0]) + 7)
    r = cli(*common, "--shard", "1/2", "--scratch", tmp_path / "s1", check=False)
    assert r.returncode == 0, r.stderr
    assert os.path.basename(mine[0]) in r.stderr and "damaged" in r.stderr  # named, set aside
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert not out["complete"] and out["damaged_parts"] == 1
    last = cli(*common, "--shard", "0/2", "--scratch", tmp_path / "s0")
    assert last["complete"] and last["rows_written"] == 512  # only the damaged part's keys, once more
    assert_same_cache(one["cache_path"], last["cache_path"])


def test_a_reader_follows_parts_as_they_are_published(tmp_path):
    spec = make_spec(num_samples=64, num_classes=10)
    base = str(tmp_path / spec.fingerprint)
    from kdcache.store.write.writer import prepare_parts
    parts = prepare_parts(base, spec)
    keys = np.arange(0, 32)
    publish(part(tmp_path, spec, 0, 32, keys), parts, spec)
    with CacheReader(base, spec=spec, timeout=0) as r:
        assert r.progress == 0.5
        assert np.array_equal(r.missing(np.arange(64)), np.arange(32, 64))
        publish(part(tmp_path, spec, 32, 64, np.arange(32, 64), seed=3), parts, spec)
        r.refresh()
        assert r.complete
        want = spec.make_codec().decode(encoded(spec, np.arange(32, 64), 3))
        assert np.allclose(r.get(np.arange(32, 64)), want)


def test_the_options_of_many_hosts_are_checked(tmp_path, teacher):
    for bad, says in [(["--engine", "ray", "--online"], "parts are filled offline"),
                      (["--scratch", str(tmp_path), "--shards", "2"], "drop --online, --ring, --hold and --shards"),
                      (["--address", "auto"], "applies to --engine ray"),
                      (["--engine", "ray", "--address", "nohost"], "HOST:PORT"),
                      (["--engine", "ray", "--shard", "0/2"], "drop --shard"),
                      (["--block-rows", "0"], "--block-rows")]:
        r = cli("--teacher", teacher, "--dataset", "digits", *bad, check=False)
        assert r.returncode == 2 and says in r.stderr, (bad, r.stderr)
        assert len(r.stderr.strip().splitlines()) <= 3, r.stderr


def test_verify_names_a_damaged_part_and_compaction_never_takes_one_in(tmp_path):
    spec = make_spec(num_samples=64, num_classes=10)
    base = str(tmp_path / spec.fingerprint)
    from kdcache.store.write.writer import prepare_parts
    parts = prepare_parts(base, spec)
    publish(part(tmp_path, spec, 0, 32, np.arange(0, 32)), parts, spec)

    def verify():
        return subprocess.run([sys.executable, "-m", "kdcache.store", "verify", base], capture_output=True,
                              text=True, env=CHILD_ENV, cwd=ROOT, timeout=120)
    r = verify()
    assert r.returncode == 1 and "incomplete: 32 of 64 keys" in r.stdout and "CRC-32" not in r.stdout, r.stdout
    victim = glob.glob(os.path.join(parts, "part-*.h5"))[0]
    flip(victim, rows_offset(victim) + 3)
    r = verify()
    assert r.returncode == 1 and os.path.basename(victim) in r.stdout and "CRC-32" in r.stdout, r.stdout + r.stderr
    # every key covered, one part damaged: the compaction any tool starts sets it aside, never compacts it
    publish(part(tmp_path, spec, 32, 64, np.arange(32, 64), seed=2), parts, spec)
    r = verify()
    assert r.returncode == 1 and "incomplete: 32 of 64 keys" in r.stdout, r.stdout + r.stderr
    assert not os.path.exists(base + ".h5") and not os.path.exists(victim)


def scaling_command(marker):
    """The command docs/scaling.md shows in the indented block holding `marker`, as one line."""
    import re
    text = open(os.path.join(ROOT, "docs", "scaling.md")).read()
    for block in re.findall(r"\n\n((?:    .*\S.*\n)+)", text):
        if marker in block:
            return " ".join(ln.strip().rstrip("\\").strip() for ln in block.splitlines())
    raise AssertionError(f"docs/scaling.md shows no command with {marker}")


def test_the_slurm_array_the_scaling_page_shows_runs_outside_the_clone(tmp_path, teacher):
    import shlex
    line = scaling_command("$SLURM_ARRAY_TASK_ID")
    bin_dir = os.path.dirname(sys.executable)
    env = {**CHILD_ENV, "PATH": bin_dir + os.pathsep + CHILD_ENV["PATH"]}
    env.pop("PYTHONPATH", None)  # the installed command, as a user runs it
    outs = []
    for i in range(3):  # the array's three tasks, one after another, each with its own local scratch
        cmd = (line.replace("PREFIX", teacher).replace("NAME", "digits")
               .replace("/shared/caches", str(tmp_path / "shared")).replace("/local/scratch", str(tmp_path / f"s{i}"))
               .replace("$SLURM_ARRAY_TASK_ID", str(i)).replace("$SLURM_ARRAY_TASK_COUNT", "3"))
        r = subprocess.run(shlex.split(cmd) + ["--json", "--quiet", "--block-rows", "512"], capture_output=True,
                           text=True, env=env, cwd=tmp_path, timeout=300)
        assert r.returncode == 0, r.stderr
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert [o["complete"] for o in outs] == [False, False, True]
    assert os.path.exists(outs[-1]["cache_path"])
