"""Every command a message or a help text tells users to run names a command and options that exist.

The hints are collected from the code itself: every string (f-strings with their values left out)
in the packages and the docs that names `kdcache COMMAND`, `python -m kdcache.store COMMAND`, `python -m
cache_builder` or `python -m kdcache.trainer[.launch|.make_teacher]`, with the options that follow it in
the same phrase. Each option must be one that command's parser takes.
"""
import argparse
import ast
import contextlib
import glob
import io
import os
import re

import pytest

from kdcache.cli import COMMANDS, STORE_COMMANDS, TEACHER_VERIFY
from tests.conftest import ROOT

PACKAGES = ("kdcache", "bench")
MODULES = {"cache_builder": "cache", "trainer": "train", "trainer.launch": "launch",
           "trainer.make_teacher": "teacher"}
COMMAND = re.compile(r"\b(?:kdcache|python -m kdcache\.(store|cache_builder|trainer(?:\.launch|\.make_teacher)?))\b"
                     r"(?: ([a-z][a-z-]*))?([^,;()\"'`\n]*)")
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


class Captured(Exception):
    pass


def options_of(name):
    """The option strings the parser of `kdcache NAME` takes (its subcommand's, for the store's)."""
    return {s for p in parsers_of(name) for s in p._option_string_actions}


def parsers_of(name):
    """The parsers `kdcache NAME` parses its arguments with (its subcommand's too, for the store's)."""
    seen = []
    real = argparse.ArgumentParser.parse_known_args  # parse_args calls it: both are caught

    def capture(self, *a, **k):
        seen.append(self)
        raise Captured

    import importlib
    argparse.ArgumentParser.parse_known_args = capture
    try:
        mains = [(COMMANDS[name][0], [name] if name in STORE_COMMANDS else [])]
        if name == "verify":
            mains.append((TEACHER_VERIFY, []))
        parsers = []
        for module, argv in mains:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    importlib.import_module(module).main(argv, prog=f"kdcache {name}")
                except Captured:
                    pass
            parser = seen.pop()
            parsers.append(parser)
            for action in parser._actions:
                if isinstance(action, argparse._SubParsersAction) and name in action.choices:
                    parsers.append(action.choices[name])
    finally:
        argparse.ArgumentParser.parse_known_args = real
    return parsers


def strings(path):
    """Every string constant of a Python file, f-strings with their values as X."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value
        elif isinstance(node, ast.JoinedStr):
            yield node.lineno, "".join(v.value if isinstance(v, ast.Constant) else "X" for v in node.values)


def hints():
    """(where, command name, [options]) of every command named in the code and the docs."""
    sources = [(p, strings(p)) for pkg in PACKAGES for p in sorted(glob.glob(os.path.join(ROOT, pkg, "**", "*.py"),
                                                                           recursive=True))]
    sources += [(p, enumerate(open(p, encoding="utf-8").read().splitlines(), 1))
                for p in sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    for path, texts in sources:
        for line, text in texts:
            for m in COMMAND.finditer(text):
                module, word, rest = m.groups()
                if module == "store" or module is None:
                    if word not in COMMANDS:
                        continue  # "kdcache" as a name, not a command
                    name = word
                else:
                    name, rest = MODULES[module], (f" {word}" if word else "") + rest
                yield f"{os.path.relpath(path, ROOT)}:{line}", name, OPTION.findall(rest)


def test_every_hinted_command_and_option_exists():
    found = list(hints())
    assert len(found) > 20 and any(opts for _, _, opts in found)  # the collector finds the hints
    known = {}
    wrong = []
    for where, name, opts in found:
        if opts and name not in known:
            known[name] = options_of(name)
        wrong += [f"{where}: kdcache {name} {o}" for o in opts if o not in known[name]]
    assert not wrong, "hints name options that do not exist: " + "; ".join(sorted(set(wrong)))


@pytest.mark.parametrize("text,bad", [("remove it (python -m kdcache.store gc --damaged, or rm)", "--damaged"),
                                      ("run kdcache train --resume-from X", "--resume-from")])
def test_the_collector_catches_an_option_that_does_not_exist(text, bad):
    (m,) = COMMAND.finditer(text)
    module, word, rest = m.groups()
    name = word if module in ("store", None) else MODULES[module]
    assert bad in OPTION.findall(rest) and bad not in options_of(name)
