"""Shared fixtures: a private cache directory per test and deterministic 'teacher' logits."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers import expected_logits, make_spec  # noqa: E402


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
