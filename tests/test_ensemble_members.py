"""An ensemble's weights and members, refused in one line where the combination would not be what it says:
weights whose sum leaves float64 (1e308 twice normalised to 0 and trained on uniform targets) or whose
ratio makes one of them 0, weights that are no positive finite number, member temperatures outside the KD
temperature's range; a member that is another member's conversion, or the same teacher in another codec
(one teacher counted twice). Valid weights give the weighted mean they say, whatever their scale."""
import math
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdcache.store import StoreError
from kdcache.store.derive.convert import convert
from kdcache.store.derive.ensemble import EnsembleReader, parse_members
from kdcache.trainer.options import build_parser
from tests.helpers import CHILD_ENV
from tests.test_ensemble import N, TEACHERS, build

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
WEIGHTS = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([1e308, 1.7e308, 9e307, 5e-324, 1e-320, 1e-300, 1e300, 0.0, -0.0, -1.0, 1.0, 2.0]))


def valid(weights):
    """The oracle: every weight a finite number > 0, their exact sum a finite float64, and none of them 0 once
    divided by that sum (float64, rounded to nearest)."""
    if not all(math.isfinite(w) and w > 0 for w in weights):
        return False
    total = sum(Fraction(w) for w in weights)
    try:
        float(total)
    except OverflowError:
        return False
    return all(float(Fraction(w) / total) > 0 for w in weights)


@pytest.fixture(scope="module")
def members(tmp_path_factory):
    d = tmp_path_factory.mktemp("members")
    return build(d, "a"), build(d, "b"), build(d, "c")


def parse_cli(text):
    """`kdcache train --ensemble TEXT` as its parser takes it: the members, or (status, stderr) of its refusal."""
    import contextlib
    import io
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args(["--ensemble", text]).ensemble
    except SystemExit as e:
        return e.code, err.getvalue()


@settings(max_examples=300, **SETTINGS)
@given(st.lists(WEIGHTS, min_size=2, max_size=3))
def test_weights_are_taken_iff_their_combination_is_sound(members, weights):
    paths = members[:len(weights)]
    text = ",".join(f"{p}:{w!r}" for p, w in zip(paths, weights))
    got = parse_cli(text)
    if not valid(weights):
        status, err = got
        assert status == 2 and len(err.strip().splitlines()) == 1 and "weight" in err, (weights, err)
        with pytest.raises(StoreError) as e:
            EnsembleReader(list(paths), weights=list(weights))
        assert "\n" not in str(e.value) and "weight" in str(e.value)
        return
    assert [m.weight for m in got] == list(weights), got
    from kdcache.trainer.options import Ensemble
    assert parse_members(Ensemble().format(got)) == got  # a run records the weights it used, exactly
    keys = np.arange(0, N, 37)
    with EnsembleReader(text) as ens:
        w = np.asarray(ens.weights)
        assert np.all(w > 0) and abs(w.sum() - 1) < 1e-12
        exact = [float(Fraction(x) / sum(Fraction(y) for y in weights)) for x in weights]
        assert np.allclose(w, exact, rtol=1e-12, atol=0)  # the ratios given, at any scale
        want = sum(wi * TEACHERS[t](keys).astype(np.float64) for wi, t in zip(exact, "abc"))
        got_rows = ens.get(keys)
        assert np.all(np.isfinite(got_rows)) and np.allclose(got_rows, want, rtol=1e-5, atol=1e-5)


def test_the_weights_that_were_accepted_are_refused_naming_the_cause(members):
    a, b, _ = members
    for text, word in ((f"{a}:1e308,{b}:1e308", "sum past the largest float64"),
                       (f"{a}:1e300,{b}:1e-300", f"member {b}'s weight is 0"),
                       (f"{a}:1:1e-300,{b}", "would leave no soft target"),
                       (f"{a}:1:5000,{b}", "from 0.01 to 1000"),
                       (f"{a}:inf,{b}", "positive number"), (f"{a}:nan,{b}", "positive number")):
        status, err = parse_cli(text)
        assert status == 2 and len(err.strip().splitlines()) == 1 and word in err, (text, err)


def test_a_member_that_is_another_members_conversion_is_refused(members, tmp_path):
    a, b, _ = members
    conv = convert(a, "int8", cache_dir=str(tmp_path))["cache_path"]
    topk = convert(a, "topk:4", cache_dir=str(tmp_path))["cache_path"]
    other = build(tmp_path, "a", codec="topk:3", dtype="float16")  # the same teacher built in another codec
    for pair, words in (([a, conv], "is a conversion of"), ([conv, a], "is a conversion of"),
                        ([conv, topk], "the same teacher a"), ([other, a], "the same teacher a"),
                        ([b, topk, conv], "the same teacher a")):
        with pytest.raises(StoreError) as e:
            EnsembleReader(pair, rule="probs")
        msg = str(e.value)
        assert "\n" not in msg and "hold one teacher's targets" in msg and words in msg, msg
    with EnsembleReader([b, conv]) as ens:  # two teachers: the conversion stands for its teacher
        assert len(ens.readers) == 2
    with pytest.raises(StoreError, match="same cache"):
        EnsembleReader([b, a, b])  # the same cache twice, not next to the first member


def test_kdcache_train_refuses_them_in_one_line(tmp_path, teacher):
    """From the command line: exit status 2 and one line, before any training."""
    kd = os.path.join(os.path.dirname(sys.executable), "kdcache")

    def run(*argv):
        return subprocess.run([kd, *map(str, argv)], cwd=tmp_path, env=CHILD_ENV, capture_output=True, text=True,
                              timeout=300)
    r = run("cache", "--teacher", teacher, "--dataset", "digits", "--quiet", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    src = r.stdout.strip().splitlines()[-1].split('"cache_path": "')[1].split('"')[0][:-3]
    r = run("convert", src, "--codec", "int8")
    assert r.returncode == 0, r.stderr[-2000:]
    conv = r.stdout.strip()[:-3]
    for ens, word in ((f"{src},{conv}", "is a conversion of"), (f"{src}:1e308,{conv}:1e308", "sum past")):
        r = run("train", "--dataset", "digits", "--epochs", "1", "--quiet", "--ensemble", ens, "--run", "x")
        lines = [ln for ln in r.stderr.strip().splitlines() if not ln.startswith("[trainer")]
        assert r.returncode == 2 and len(lines) == 1 and word in lines[0], r.stderr[-2000:]
        assert not os.path.exists(tmp_path / "runs" / "x" / "metrics.json")
