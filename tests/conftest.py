"""Shared fixtures: a private cache directory per test and deterministic 'teacher' logits."""
import os
import signal
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.helpers import expected_logits, gluon_teacher, make_spec  # noqa: E402

# Tests stop commands with SIGINT, as Ctrl-C would. A test run started with SIGINT ignored (a
# background job of a shell script) would pass that on to every command it starts.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture
def cache_dir(tmp_path):
    d = tmp_path / "caches"
    d.mkdir()
    return str(d)


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A small random Gluon teacher's checkpoint (tests.helpers.gluon_teacher): its prefix. Modules that need
    another teacher define their own."""
    p = str(tmp_path_factory.mktemp("t") / "t")
    gluon_teacher(p)
    return p


@pytest.fixture
def spec_factory():
    return make_spec


@pytest.fixture
def logits_for():
    return expected_logits


@pytest.fixture(scope="session", autouse=True)
def private_digest_memo(tmp_path_factory):
    """The tests' data set digests are remembered in a memo of their own, never in the user's
    (~/.cache/kdcache/digests.json); commands the tests start inherit it."""
    old = os.environ.get("KDCACHE_DIGEST_MEMO")
    os.environ["KDCACHE_DIGEST_MEMO"] = str(tmp_path_factory.mktemp("digest-memo") / "digests.json")
    yield
    if old is None:
        os.environ.pop("KDCACHE_DIGEST_MEMO", None)
    else:
        os.environ["KDCACHE_DIGEST_MEMO"] = old
