"""Shared fixtures: a private cache directory per test and deterministic 'teacher' logits."""
import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers import expected_logits, make_spec  # noqa: E402

# Tests stop commands with SIGINT, as Ctrl-C would. A test run started with SIGINT ignored (a
# background job of a shell script) would pass that on to every command it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "caches"
    d.mkdir()
    return str(d)


@pytest.fixture
def spec_factory():
    return make_spec


@pytest.fixture
def logits_for():
    return expected_logits
