"""The KD temperature is parsed once, with its range (kdcache.args.Temperature, 0.01 to 1000): on the command
line (`--temperature`), by the Python API (`KDLoss`, `kd_symbol`) and for an ensemble member. A valid T
trains: the loss and its gradients are finite even on the most extreme logits a float16 cache holds. Any
other T is one line naming the range and why (T = 1e-300 made every logit / T infinite, and the run ended
blaming the cache or the learning rate), exit status 2 from the command line."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import CHILD_ENV

SETTINGS = dict(deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
TEMPERATURES = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                         st.floats(min_value=1e-4, max_value=1e5),
                         st.sampled_from([1e-300, 5e-324, 0.0, -0.0, -1.0, 0.01, 0.00999, 1000.0, 1000.0001, 1.0, 20.0]))


def valid(t):
    return math.isfinite(t) and 0.01 <= t <= 1000


def parse(value):
    import contextlib
    import io
    from kdcache.trainer.options import build_parser
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return build_parser().parse_args([f"--temperature={value}"]).temperature
    except SystemExit as e:
        return e.code, err.getvalue()


def extreme_batch():
    """Teacher logits at float16's extremes (what a full float16 cache can hold), and an ordinary student."""
    rng = np.random.default_rng(0)
    t = rng.normal(0, 5, (6, 10)).astype(np.float32)
    t[0, :] = 65504.0
    t[1, ::2], t[1, 1::2] = 65504.0, -65504.0
    t[2, :] = -65504.0
    t[3, 3] = 65504.0
    s = rng.normal(0, 3, (6, 10)).astype(np.float32)
    return s, t, (np.arange(6) % 10).astype(np.float32)


@settings(max_examples=250, **SETTINGS)
@given(TEMPERATURES)
def test_a_temperature_is_taken_iff_it_trains(t):
    import mxnet as mx
    from mxnet import autograd
    from kdcache import KDLoss
    got = parse(repr(t))
    if not valid(t):
        status, err = got
        assert status == 2 and len(err.strip().splitlines()) == 1 and "from 0.01 to 1000" in err, (t, err)
        with pytest.raises(ValueError, match="from 0.01 to 1000"):
            KDLoss(temperature=t)
        return
    assert got == t
    s, teacher, y = extreme_batch()
    student = mx.nd.array(s)
    student.attach_grad()
    with autograd.record():
        loss = KDLoss(temperature=t, alpha=0.5)(student, mx.nd.array(teacher), mx.nd.array(y))
    loss.backward()
    assert np.all(np.isfinite(loss.asnumpy())) and np.all(np.isfinite(student.grad.asnumpy())), t


def test_the_module_api_and_an_ensemble_member_take_the_same_range(tmp_path):
    import mxnet as mx
    from kdcache import kd_symbol
    from kdcache.store import StoreError
    from kdcache.store.derive.ensemble import parse_members
    with pytest.raises(ValueError, match="from 0.01 to 1000"):
        kd_symbol(mx.sym.var("x"), temperature=1e-300)
    assert kd_symbol(mx.sym.var("x"), temperature=4) is not None
    with pytest.raises(StoreError, match="from 0.01 to 1000"):
        parse_members("a:1:1e-300,b")
    assert parse_members("a:1:0.01,b:1:1000")[1].temperature == 1000


def test_kdcache_train_refuses_a_tiny_temperature_in_one_line(tmp_path):
    kd = os.path.join(os.path.dirname(sys.executable), "kdcache")
    for value in ("1e-300", "0", "-1", "inf", "1e6"):
        r = subprocess.run([kd, "train", "--dataset", "digits", f"--temperature={value}"], cwd=tmp_path, env=CHILD_ENV,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and r.stdout == "", r.stderr
        (line,) = r.stderr.strip().splitlines()
        assert line.startswith("error: argument --temperature/-T: ") and "use a temperature from 0.01 to 1000" in line
