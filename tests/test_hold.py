"""The producer's --hold handshake: the one JSON line the trainer sends names the cache; any other line
is one line of refusal before anything is written, and P, P.h5 and P.parts name the same cache."""
import io
import logging
import subprocess
import sys
import types

import pytest

from kdcache.cache_builder.runs import HOLD_LINE_MAX, await_cache
from tests.helpers import CHILD_ENV, gluon_teacher

FP = "0123456789abcdef"
SPEC = types.SimpleNamespace(fingerprint=FP)
LOG = logging.getLogger("test_hold")


def hold(line):
    return await_cache(LOG, SPEC, io.StringIO(line))


@pytest.mark.parametrize("given", ["/c/" + FP, "/c/" + FP + ".h5", "/c/" + FP + ".parts", "/c/" + FP + ".parts/"])
def test_the_cache_is_named_by_its_base_path_whatever_suffix_it_came_with(given):
    assert hold(f'{{"cache": "{given}", "fingerprint": "{FP}"}}\n') == "/c/" + FP


@pytest.mark.parametrize("line,words", [
    ("[" * 200_000 + "]" * 200_000 + "\n", "not one JSON line"),  # deeper than Python's recursion limit
    ('{"cache": "' + "x" * (2 * HOLD_LINE_MAX) + '"}\n', f"longer than {HOLD_LINE_MAX} characters"),
    ("not json\n", "not one JSON line"),
    ('{"cache": 3, "fingerprint": "ab"}\n', "not one JSON line"),
], ids=["deep", "long", "not-json", "not-a-path"])
def test_a_line_that_is_not_the_trainer_s_is_one_line_of_refusal(line, words):
    with pytest.raises(ValueError) as e:
        hold(line)
    msg = str(e.value)
    assert words in msg and "nothing written" in msg and "\n" not in msg and len(msg) < 400, msg[:500]


def test_end_of_input_ends_it_with_nothing_written():
    assert hold("") is None


def test_hold_refuses_a_deep_line_in_one_line_and_writes_nothing(tmp_path):
    """The command: exit 2, one line, no traceback, no cache directory made."""
    gluon_teacher(str(tmp_path / "t"))
    cmd = [sys.executable, "-m", "kdcache.cache_builder", "--teacher", str(tmp_path / "t"), "--dataset", "digits",
           "--online", "--hold", "--quiet", "--cache-dir", str(tmp_path / "caches")]
    r = subprocess.run(cmd, input="[" * 200_000 + "\n", env=CHILD_ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "--hold: stdin gave" in errors[0], r.stderr[-2000:]
    assert not (tmp_path / "caches").exists()
