"""One error root: every error kdcache raises on purpose is a kdcache.KdcacheError, which a command prints
as one line `error: ...` with exit status 2; anything else is a bug in kdcache, shown as one (its
traceback and a line saying so, exit status kdcache.errors.BUG), never as the user's mistake."""
import importlib
import inspect
import pkgutil
import subprocess
import sys

import pytest

import kdcache
from kdcache import errors
from kdcache.errors import BUG, USER_ERROR, KdcacheError
from tests.helpers import CHILD_ENV, ROOT

BUG_LINE = "kdcache: internal error (a bug in kdcache, not in your input)"

# A command run with one deep function replaced by one that fails as a bug would (a ValueError nobody
# raised on purpose): sys.argv[1] is "module:function", the rest the `kdcache` command's arguments.
WRAPPER = """
import importlib, sys
module, name = sys.argv[1].split(":")
def broken(*a, **k):
    raise ValueError("a value no user gave")
setattr(importlib.import_module(module), name, broken)
from kdcache.cli import main
sys.exit(main(sys.argv[2:]))
"""


def kdcache_with(broken, *argv, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", WRAPPER, broken, *map(str, argv)], capture_output=True, text=True,
                          env=CHILD_ENV, cwd=cwd, timeout=300)


def kdcache_cmd(*argv, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "kdcache", *map(str, argv)], capture_output=True, text=True,
                          env={**CHILD_ENV, **(env or {})}, cwd=cwd, timeout=300)


def assert_bug(code, err):
    lines = err.strip().splitlines()
    assert code == BUG and code != USER_ERROR, (code, err[-3000:])
    assert "Traceback (most recent call last)" in err and "ValueError: a value no user gave" in err, err[-3000:]
    assert lines[-1].startswith(BUG_LINE) and "please report it" in lines[-1], err[-3000:]
    assert not any(ln.startswith("error:") for ln in lines), err[-3000:]


def assert_one_line(code, err, word=""):
    lines = err.strip().splitlines()
    assert code == USER_ERROR and len(lines) == 1 and lines[0].startswith("error: "), (code, err[-3000:])
    assert word in lines[0] and "Traceback" not in err and BUG_LINE not in err, err


# --- (a) a bug deep inside a command shows as one -------------------------------------------------
def test_a_valueerror_deep_in_the_trainer_is_a_bug_not_the_users_mistake(tmp_path):
    # the trainer caught every ValueError and printed it as the user's one line, exit 2
    r = kdcache_with("kdcache.pipeline.datasets:load_dataset", "train", "--teacher-mode", "none", "--dataset",
                     "synthetic:n=100", "--runs-dir", tmp_path / "runs", "--epochs", 1, cwd=tmp_path)
    assert_bug(r.returncode, r.stderr)


def test_a_valueerror_deep_in_the_producer_is_a_bug_not_the_users_mistake(tmp_path, teacher):
    r = kdcache_with("kdcache.pipeline.datasets:load_dataset", "cache", "--teacher", teacher, "--dataset",
                     "synthetic:n=100,classes=10,shape=1x8x8", "--cache-dir", tmp_path / "caches", cwd=tmp_path)
    assert_bug(r.returncode, r.stderr)


@pytest.mark.parametrize("command", ["ls", "verify"])
def test_a_valueerror_deep_in_the_store_commands_is_a_bug(tmp_path, monkeypatch, capsys, command):
    from kdcache.cli import main
    from kdcache.store.folder import registry

    def broken(*a, **k):
        raise ValueError("a value no user gave")
    if command == "ls":
        monkeypatch.setattr(registry, "cache_bases", broken)
        argv = ["ls", "--cache-dir", str(tmp_path)]
    else:  # verify's statuses are a verdict (1: NOT sound, 2: could not check): a crash is neither
        monkeypatch.setattr(registry, "exists", lambda base: True)
        monkeypatch.setattr(registry, "verify", broken)
        argv = ["verify", str(tmp_path / "c")]
    code = main(argv)
    assert_bug(code, capsys.readouterr().err)


def test_as_command_ends_a_kdcache_error_in_one_line_and_lets_stops_through(capsys):
    def refuse():
        raise kdcache.StoreError("no cache at 'x': pass a path that `kdcache ls` shows")
    assert errors.as_command(refuse)() == USER_ERROR
    assert capsys.readouterr().err == "error: no cache at 'x': pass a path that `kdcache ls` shows\n"
    for stop in (KeyboardInterrupt, SystemExit):
        def stopped():
            raise stop(2)
        with pytest.raises(stop):
            errors.as_command(stopped)()
    assert errors.as_command(lambda: 0)() == 0


def test_build_cache_says_a_bug_in_its_producer_is_one(monkeypatch):
    from kdcache import api
    out = subprocess.CompletedProcess([], BUG, "", f"Traceback (most recent call last):\nValueError: x\n{BUG_LINE}: x")
    monkeypatch.setattr(api.subprocess, "run", lambda *a, **k: out)
    with pytest.raises(RuntimeError, match="a bug in kdcache") as e:
        api.build_cache("teacher", "digits")
    assert not isinstance(e.value, KdcacheError) and "Traceback" in str(e.value)


# --- (b) a mistake of the user's is still one line and exit 2 -----------------------------------
def test_a_users_mistake_is_still_one_line_and_exit_2(tmp_path, capsys, teacher):
    from kdcache.cli import main
    assert main(["inspect", str(tmp_path / "nothing")]) == USER_ERROR
    assert_one_line(USER_ERROR, capsys.readouterr().err, "no cache at")
    r = kdcache_cmd("train", "--teacher-mode", "none", "--dataset", "synthetic:n=100,colour=red", "--runs-dir",
                    tmp_path / "runs", "--epochs", 1, cwd=tmp_path)
    assert_one_line(r.returncode, r.stderr, "synthetic:n=100,colour=red")
    r = kdcache_cmd("cache", "--teacher", teacher, "--ring", "r", env={"KDCACHE_RING_TIMEOUT": "soon"}, cwd=tmp_path)
    assert_one_line(r.returncode, r.stderr, "KDCACHE_RING_TIMEOUT")
    # the refusals a command makes itself, before its work, go through the same ending
    r = kdcache_cmd("cache", "--teacher", teacher, env={"KDCACHE_TEACHER_THREADS": "many"}, cwd=tmp_path)
    assert_one_line(r.returncode, r.stderr, "KDCACHE_TEACHER_THREADS='many': use an integer from 1 to 1024")
    r = kdcache_cmd("train", "--teacher-mode", "none", "--runs-dir", tmp_path / "runs", "--run", "r", "--resume",
                    cwd=tmp_path)
    assert_one_line(r.returncode, r.stderr, "argument --resume:")
    assert "has no checkpoint (state.json): run without --resume" in r.stderr


def test_an_unknown_option_is_still_argparses_one_line():
    r = kdcache_cmd("ls", "--jso")
    assert_one_line(r.returncode, r.stderr, "unrecognized arguments")


def test_the_python_api_raises_kdcache_errors_that_are_still_the_builtins_callers_catch():
    from kdcache.pipeline.augment import Augment
    from kdcache.store import fingerprint
    with pytest.raises(kdcache.PipelineError) as e:
        Augment.parse("crop:x")
    assert isinstance(e.value, ValueError)
    with pytest.raises(KdcacheError) as e:
        fingerprint({"teacher": object()})
    assert isinstance(e.value, TypeError)
    with pytest.raises(kdcache.TrainError) as e:
        from kdcache.trainer.loss import temperature_of
        temperature_of(0)
    assert isinstance(e.value, ValueError)
    from kdcache.api import _argv
    with pytest.raises(KdcacheError) as e:
        _argv("t", "digits", {"view": 2})
    assert isinstance(e.value, TypeError)


# --- (c) every error class kdcache defines is under KdcacheError ---------------------------------
# Exceptions that never leave the function that catches them (control flow), by class name: they
# must not be caught as a KdcacheError by anyone.
INTERNAL = {
    "_Full": "store.write.compact: the disk filled during compaction; caught there and said as NoSpaceError",
    "MapUnavailable": "store.read.mapped: this file cannot be memory-mapped; the reader falls back to HDF5 reads",
    "_BadRecord": "pipeline.images: a RecordIO record that cannot be read; said as a DatasetError naming it",
    "NotOurs": "store.osutil: an entry under kdcache's names that is not its file (an OSError); skipped, or "
               "said by the caller as a StoreError",
}
# Modules that import a package of an extra (kdcache.extras.EXTRAS) at their top: skipped when it is absent.
EXTRA_PACKAGES = ("ray", "PIL", "sklearn", "mlxtend", "fsspec", "aiohttp")


def kdcache_modules():
    names = []
    for m in pkgutil.walk_packages(kdcache.__path__, "kdcache."):
        if m.name.rsplit(".", 1)[-1] == "__main__":  # a command, run on import (kdcache.__main__)
            continue
        names.append(m.name)
    return names


def defined_exceptions():
    found = {}
    for name in kdcache_modules():
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            if (getattr(e, "name", None) or "").partition(".")[0] in EXTRA_PACKAGES:
                continue
            raise
        for obj in vars(module).values():
            if inspect.isclass(obj) and issubclass(obj, Exception) and obj.__module__ == name:
                found[f"{name}.{obj.__qualname__}"] = obj
    return found


def test_every_error_kdcache_defines_is_a_kdcache_error():
    found = defined_exceptions()
    assert len(found) >= 30, sorted(found)  # the walk found the packages' errors
    outside = sorted(k for k, c in found.items() if not issubclass(c, KdcacheError) and c.__name__ not in INTERNAL)
    assert not outside, f"not under KdcacheError (nor internal, with a reason, in INTERNAL): {outside}"
    internal = sorted(k for k, c in found.items() if c.__name__ in INTERNAL)
    assert len(internal) == len(INTERNAL) and not any(issubclass(found[k], KdcacheError) for k in internal), internal


def test_the_errors_keep_the_builtin_bases_callers_rely_on():
    from kdcache.api import BuildError
    from kdcache.cache_builder.errors import ProducerError
    from kdcache.pipeline.decode_workers import DecodeWorkerError
    from kdcache.store import BadInputError, CacheNotFoundError, MissingTargetsError
    from kdcache.trainer.errors import BadValueError
    from kdcache.trainer.loss import NonFiniteError
    for cls, base in [(BuildError, ValueError), (ProducerError, ValueError), (kdcache.PipelineError, ValueError),
                      (DecodeWorkerError, ValueError), (BadInputError, ValueError), (NonFiniteError, ValueError),
                      (BadValueError, ValueError), (errors.BadTypeError, TypeError),
                      (CacheNotFoundError, FileNotFoundError), (MissingTargetsError, TimeoutError)]:
        assert issubclass(cls, KdcacheError) and issubclass(cls, base), cls
    assert issubclass(kdcache.ShareError, kdcache.StoreError) and issubclass(kdcache.TrainError, KdcacheError)


def test_the_root_imports_nothing_of_the_project():
    code = "import sys, kdcache.errors; print(' '.join(sorted(m for m in sys.modules if m.startswith('kdcache'))))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=CHILD_ENV, timeout=60)
    assert r.stdout.split() == ["kdcache", "kdcache.errors"], r.stdout + r.stderr


# --- (d) what the packages export ---------------------------------------------------------------
@pytest.mark.parametrize("package", ["kdcache", "kdcache.store"])
def test_everything_in_all_imports(package):
    module = importlib.import_module(package)
    for name in module.__all__:
        assert getattr(module, name) is not None, name
    if package == "kdcache.store":
        for name in ("NoSpaceError", "CacheChangedError", "NewerFormatError", "DamagedRowsError", "NotTrusted"):
            assert name in module.__all__ and issubclass(getattr(module, name), module.StoreError), name


def test_import_kdcache_stays_light_and_names_the_root():
    code = ("import sys, kdcache; e = kdcache.KdcacheError; "
            "print(e.__module__, sorted(m for m in ('mxnet', 'h5py', 'numpy') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=CHILD_ENV, timeout=60)
    assert r.returncode == 0 and r.stdout.split() == ["kdcache.errors", "[]"], r.stdout + r.stderr
    assert "KdcacheError" in kdcache.__all__ and "KdcacheError" in dir(kdcache)

