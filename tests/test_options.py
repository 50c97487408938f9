"""The options the producer and the trainer share are declared once and cannot drift apart."""
import json
import os
import re
import subprocess
import sys
import tempfile
import types

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT

RUNS = tempfile.mkdtemp(prefix="kdcache-options-")
os.makedirs(os.path.join(RUNS, "r"), exist_ok=True)
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MXNET_SUBGRAPH_VERBOSE": "0"}
KDCACHE = [sys.executable, "-m", "kdcache"]


def parsers():
    import kdcache.cache_builder.options as producer
    from kdcache.trainer.options import build_parser
    return producer.build_parser(), build_parser()


def test_every_shared_option_has_the_same_default_on_both_sides():
    from kdcache.pipeline.options import SHARED
    producer, trainer = parsers()
    p, t = producer.parse_args([]), trainer.parse_args([])
    for o in SHARED:
        assert getattr(p, o.dest) == getattr(t, o.dest) == o.default, o.flag
    # the two defaults that once differed (128/1 against 64/30)
    assert (p.batch_size, p.epochs) == (t.batch_size, t.epochs) == (64, 30)


def test_both_command_lines_declare_each_shared_option_alike():
    from kdcache.pipeline.options import SHARED
    for parser in parsers():
        actions = {a.dest: a for a in parser._actions}
        for o in SHARED:
            a = actions[o.dest]
            assert o.flag in a.option_strings and a.type is o.type and a.default == o.default, o.flag


shared_values = st.fixed_dictionaries({}, optional={
    "--dataset": st.sampled_from(["digits", "synthetic", "synthetic:n=40,classes=3,shape=1x8x8,seed=2"]),
    "--data-root": st.just(ROOT),
    "--image-size": st.tuples(st.integers(1, 512), st.integers(1, 512)).map(lambda t: f"{t[0]}x{t[1]}"),
    "--num-classes": st.integers(2, 1000).map(str),
    "--views": st.integers(1, 20).map(str),
    "--augment": st.sampled_from(["auto", "crop:4,flip", "flip", "crop:1", "crop:4,flip,mixup:0.2",
                                  "rrc:8,flip,cutmix:1.0", "mixup:0.4"]),
    "--seed": st.integers(0, 2 ** 32 - 1).map(str),
    "--cache-dir": st.sampled_from(["caches", "/tmp/some caches"]),
    "--codec": st.sampled_from(["full", "topk:5", "TOPK:12"]),
    "--dtype": st.sampled_from(["float16", "float32"]),
    "--epochs": st.integers(1, 500).map(str),
    "--batch-size": st.integers(1, 4096).map(str),
    "--teacher-input": st.sampled_from(["data", "x0"]),
    "--teacher-mean": st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=3).map(
        lambda v: ",".join(map(repr, v))),
    "--teacher-std": st.lists(st.floats(0.01, 10), min_size=1, max_size=3).map(lambda v: ",".join(map(repr, v))),
    "--teacher-size": st.sampled_from(["8x8", "224x224"]),
})


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_values)
def test_the_producer_the_trainer_starts_gets_every_shared_option(values):
    """Whatever the trainer is given, its child producer parses to the same shared values."""
    from kdcache.pipeline.options import SHARED
    from kdcache.trainer.targets import producer_command
    producer, trainer = parsers()
    argv = [f"{k}={v}" for k, v in values.items()]
    args = trainer.parse_args(["--teacher", "t/teach:3", *argv])
    args.run_name, args.runs_dir = "r", RUNS  # the run's folder exists when the trainer starts its producer
    plan = types.SimpleNamespace(topt=types.SimpleNamespace(arg="t/teach:3"), base="caches/abc")
    cmd = producer_command(args, plan, threads=1)
    assert cmd[1:3] == ["-m", "kdcache.cache_builder"]
    child = producer.parse_args(cmd[3:])
    for o in SHARED:
        want = "caches/abc" if o.dest == "cache" else getattr(args, o.dest)
        assert getattr(child, o.dest) == want, o.flag
    assert child.online and child.split == "train"


def makefile_pairs():
    text = open(os.path.join(ROOT, "Makefile")).read()
    return text, dict(re.findall(r"\$\(call opt,([A-Z_]+),(--[a-z-]+)\)", text))


def test_the_makefile_restates_no_default_and_names_each_flag_as_declared():
    import kdcache.cache_builder.options as producer
    from kdcache.pipeline.options import SHARED
    from kdcache.trainer.launch import LAUNCHER
    from kdcache.trainer.options import TRAINER
    text, pairs = makefile_pairs()
    declared = {o.make: o.flag for o in SHARED + TRAINER + producer.PRODUCER + LAUNCHER if o.make}
    assert pairs == declared
    for var in pairs:  # set by the user or empty: never a default of its own
        assert re.search(rf"^{var}\s*\?=\s*$", text, re.M), var


@pytest.mark.slow
def test_a_producer_started_by_hand_writes_the_order_a_trainer_reads(tmp_path):
    """Both with their defaults: the keys of every epoch the producer followed equal, in order,
    the keys the trainer read in that epoch; another seed reads another order."""
    from tests.helpers import gluon_teacher
    teacher = str(tmp_path / "teacher")
    gluon_teacher(teacher)
    common = ["--teacher", teacher, "--cache-dir", str(tmp_path / "caches")]
    prod = subprocess.run([*KDCACHE, "cache", "--online", "--quiet", "--json", *common], capture_output=True,
                          text=True, env=ENV, cwd=tmp_path, timeout=600)
    assert prod.returncode == 0, prod.stderr
    produced = json.loads(prod.stdout.strip().splitlines()[-1])["schedule_sha256"]
    assert list(produced) == ["0"]  # one view: the cache is complete after the first epoch

    def train(*extra):
        r = subprocess.run([*KDCACHE, "train", "--no-producer", "--quiet", "--json", "--runs-dir",
                            str(tmp_path / "runs"), *common, *extra], capture_output=True, text=True, env=ENV,
                           cwd=tmp_path, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])["schedule_sha256"]

    read = train("--epochs", "2")
    assert read["0"] == produced["0"] and read["1"] != read["0"]
    assert train("--epochs", "1", "--seed", "1")["0"] != produced["0"]


def test_the_manuals_options_table_is_the_declaration():
    """The manual's table of the shared options is generated from SHARED, whole, and says what
    `kdcache options` says (tests/test_docs.py checks every generated block the same way)."""
    from bench.docs import blocks_of, options_table
    from kdcache.args import option_table
    from kdcache.pipeline.options import SHARED
    path = os.path.join(ROOT, "docs", "options.md")
    text = open(path, encoding="utf-8").read()
    [block] = [text[start:end] for name, start, end, _ in blocks_of(path, text) if name == "options.shared"]
    assert block.strip() == options_table(SHARED)
    for flag, default, allowed, make in option_table(SHARED):
        row = f"| `{flag}` | {default} | {allowed.replace('|', chr(92) + '|')} | {make or '-'} |"
        assert row in block, row
