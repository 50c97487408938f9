"""Doors that must not mislead: abbreviated options, Make variables that name nothing, what a run records."""
import os
import shutil
import subprocess
import sys

import pytest

from kdcache.cli import COMMANDS
from tests.conftest import ROOT
from tests.test_hints import parsers_of

KDCACHE = os.path.join(os.path.dirname(sys.executable), "kdcache")
MAKE = shutil.which("make")


@pytest.mark.parametrize("name", list(COMMANDS))
def test_no_command_takes_an_abbreviated_option(name):
    for parser in parsers_of(name):
        assert parser.allow_abbrev is False, f"kdcache {name}: {parser.prog} takes abbreviations"


@pytest.mark.parametrize("argv, typo", [(["cache", "--dataset", "digits", "--view", "2"], "--view"),
                                        (["train", "--temp", "4"], "--temp"),
                                        (["ls", "--jso"], "--jso")])
def test_an_abbreviation_is_one_line_and_status_2(tmp_path, argv, typo):
    r = subprocess.run([KDCACHE, *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert typo in line and "unrecognized arguments" in line, line


def make(*args):
    return subprocess.run([MAKE, "-s", "-C", ROOT, *args], capture_output=True, text=True, timeout=60)


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_a_make_variable_that_names_no_option_is_an_error_naming_those_that_exist():
    r = make("-n", "train", "TEMPERATURE=4")
    assert r.returncode != 0 and r.stdout == ""
    assert "TEMPERATURE: no such variable; use one of" in r.stderr and " T " in r.stderr and "ALPHA" in r.stderr
    r = make("-n", "train", "T=4", "ALPHA=0.3")
    assert r.returncode == 0, r.stderr
    assert "--temperature 4 --alpha 0.3" in " ".join(r.stdout.split())


@pytest.mark.skipif(MAKE is None, reason="no make")
def test_every_declared_make_variable_is_one_the_makefile_takes():
    from kdcache.cache_builder.__main__ import PRODUCER
    from kdcache.pipeline.options import SHARED
    from kdcache.trainer.options import TRAINER
    r = make("--eval", "print-variables: ; @echo $(VARIABLES)", "print-variables")
    assert r.returncode == 0, r.stderr
    known = set(r.stdout.split())
    declared = {o.make for o in SHARED + PRODUCER + TRAINER if o.make}
    assert declared and declared <= known, declared - known
