"""The Python doors to the producer: build_cache, cache_path and load_dataset, as `kdcache cache` sees them.

NOTE [one producer]: build_cache runs `python -m kdcache.cache_builder` in a child process, with the
command line it would be given, rather than calling the producer's functions here: the producer fixes
OMP_NUM_THREADS before MXNet loads (a caller's process has usually loaded it already, with all its
threads), takes signals at safe points, and is the one code path that writes caches. Its fingerprint
is therefore the command line's by construction. cache_path computes the same spec in this process
(the producer's own parse_args and spec_from_args) without running any teacher.
"""
import contextlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Optional, Sequence, Union

from kdcache.errors import BUG, BadTypeError, KdcacheError

# The keyword arguments build_cache and cache_path turn into the producer's options (the flag is
# the keyword with '_' as '-'); the values are checked by the options' own types.
_OPTION_KEYWORDS = ("views", "augment", "codec", "dtype", "cache_dir", "cache", "seed", "data_root", "image_size",
                    "num_classes", "classes", "split", "teacher_input", "teacher_mean", "teacher_std", "teacher_size",
                    "batch_size", "threads", "engine", "address", "actors", "actor_cpus", "block_rows", "scratch")


class BuildError(KdcacheError, ValueError):
    """The producer refused its inputs or failed; the message is its one line (cause and fix)."""


def load_dataset(name: str, *, data_root: Optional[str] = None, split: str = "train",
                 image_size: Union[str, tuple, None] = None, num_classes: Optional[int] = None,
                 classes: Union[str, Sequence[str], None] = None):
    """A kdcache data set by name, as `kdcache cache --dataset NAME` loads it: digits | mnist5k |
    synthetic[:n=..] | mnist | fashion-mnist | cifar10 | cifar100 | npz | recordio | imagefolder |
    MODULE:FUNCTION. Items are (image float32 [C, H, W] in [0, 1], label); `num_classes`, `shape`
    and `identity()` (what a cache's fingerprint records of it) come with it. `image_size`: "HxW" or
    (H, W), read as --image-size reads it; `classes`: "cat,dog" or ["cat", "dog"] (recordio: label numbers),
    read as --classes reads it. Loading imports no MXNet."""
    from kdcache.args import ClassNames, Size
    from kdcache.pipeline.datasets import DatasetError, load_dataset as load
    size = None if image_size is None else Size().coerce(image_size, "--image-size", DatasetError)
    chosen = None if classes is None else ClassNames().coerce(classes, "--classes", DatasetError)
    return load(name, data_root=data_root, split=split, image_size=size, num_classes=num_classes, classes=chosen)


def _dataset_name(dataset) -> str:
    if isinstance(dataset, str):
        return dataset
    raise BuildError(f"dataset {type(dataset).__name__!r}: pass the data set's name as `kdcache cache --dataset` "
                     f"takes it (with data_root=... for files), or your own loader as 'MODULE:FUNCTION'; the "
                     f"producer loads it in its own process")


@contextlib.contextmanager
def _teacher_prefix(teacher, name):
    """The --teacher value for `teacher`: a checkpoint prefix as is, a Gluon HybridBlock exported (epoch 0)
    to a temporary folder as `name` (the fingerprint records the files' digests and this name, so
    `kdcache cache --teacher DIR/NAME` over the same export names the same cache)."""
    if isinstance(teacher, (str, os.PathLike)):
        yield os.fspath(teacher)
        return
    if not hasattr(teacher, "export"):
        raise BuildError(f"teacher {type(teacher).__name__!r}: pass a checkpoint prefix (PREFIX-symbol.json + "
                         f"PREFIX-NNNN.params) or a hybridized gluon HybridBlock")
    with tempfile.TemporaryDirectory(prefix="kdcache-teacher-") as tmp:
        prefix = os.path.join(tmp, name)
        try:
            teacher.export(prefix, epoch=0)
        except Exception as e:  # not hybridized, or never run: MXNet's own message is long
            raise BuildError(f"teacher {type(teacher).__name__}: cannot be exported ({str(e).splitlines()[0]}): "
                             f"call .hybridize() and run it forward once first") from None
        _check_export(teacher, prefix)
        yield prefix


def _check_export(teacher, prefix):
    """A block that exports its symbol but none of its parameters (a SymbolBlock, e.g. from SymbolBlock.imports,
    writes them only once hybridized and run) is refused here, in one line saying what to pass instead."""
    import mxnet as mx
    if not teacher.collect_params().keys():
        return  # nothing to export: the symbol alone is the teacher
    saved = mx.nd.load(f"{prefix}-0000.params")
    if isinstance(saved, dict) and saved:
        return
    raise BuildError(f"teacher {type(teacher).__name__}: its export holds none of its parameters (a SymbolBlock, "
                     f"e.g. from SymbolBlock.imports, exports them only after .hybridize() and one forward): pass the "
                     f"checkpoint prefix it was imported from (PREFIX of PREFIX-symbol.json and PREFIX-NNNN.params), "
                     f"or call .hybridize() and run it forward once first")


def _argv(teacher: str, dataset: str, options: dict) -> list:
    """The producer's command line for these inputs, each value written by its option's own type."""
    from kdcache.cache_builder.options import PRODUCER
    from kdcache.pipeline.options import SHARED
    declared = {o.dest: o for o in SHARED + PRODUCER}
    argv = [f"--teacher={teacher}", f"--dataset={dataset}"]
    for key, value in options.items():
        if key not in _OPTION_KEYWORDS:
            raise BadTypeError(f"unexpected keyword {key!r}: use {', '.join(_OPTION_KEYWORDS)}")
        if isinstance(value, str):  # as a user types it: the producer's parser checks it
            argv.append(f"{declared[key].flag}={value}")
        elif value is not None:
            argv += declared[key].argv(value)
    return argv


def _one_line(text, default):
    """The producer's error line, without its pointer to the command's --help."""
    lines = [ln for ln in (text or "").splitlines() if ln.startswith("error: ")]
    return re.sub(r" \(see \S+(?: \S+)* --help\)$", "", lines[-1][len("error: "):]) if lines else default


def build_cache(teacher: Union[str, Any], dataset: str, *, views: int = 1, augment: Optional[str] = None,
                codec: str = "full", dtype: str = "float16", cache_dir: Optional[str] = None, seed: int = 0,
                teacher_name: str = "teacher", quiet: bool = True, **options) -> str:
    """Run the teacher over the data set and return the finished cache's path (P.h5), exactly as
    `kdcache cache` with the same inputs does: same fingerprint, and a complete cache is reused
    (the teacher then runs zero times).

    teacher: a checkpoint prefix ("PREFIX" or "PREFIX:EPOCH"), or a hybridized gluon HybridBlock that has
    run forward once, exported first to a temporary PREFIX named `teacher_name` (export it with an explicit
    prefix of its own: a second instance of a net exports other parameter names, so another cache). A
    SymbolBlock from SymbolBlock.imports: pass the prefix it was imported from (it exports its parameters
    only after .hybridize() and one forward; before, BuildError says so).
    dataset: a name as --dataset takes it ("digits", "mnist" with data_root=..., or "MODULE:FUNCTION" for
    your own: FUNCTION(split), split "train" or "test", returns a data set of (image, label) items, image
    float32 [C, H, W] in [0, 1] and label an integer class; the class count is its `num_classes`
    attribute, else the largest label + 1). A loaded data set object or an
    arbitrary gluon Dataset is refused: the producer loads the data itself, in its own process, so
    that the fingerprint records its files' digests the way the command line does.
    options: cache (an explicit cache path instead of <cache_dir>/<fingerprint>), data_root, image_size,
    num_classes, split, teacher_input, teacher_mean, teacher_std, teacher_size, batch_size, threads, and for
    many hosts engine ("local" or "ray": Ray actors, `pip install 'kdcache[ray]'`), address, actors,
    actor_cpus, block_rows, scratch (the command's options of the same names; docs/scaling.md). A cache at an explicit path built from another data set of the
    same length is refused naming the first item that differs (the cache records each item's digest).
    Raises BuildError with the producer's one line when it refuses (a bad option, a teacher that does
    not fit the data, ...). The producer runs in a child process (NOTE [one producer]).
    """
    opts = dict(views=views, augment=augment, codec=codec, dtype=dtype, cache_dir=cache_dir, seed=seed, **options)
    name = _dataset_name(dataset)
    with _teacher_prefix(teacher, teacher_name) as prefix:
        argv = [sys.executable, "-m", "kdcache.cache_builder", *_argv(prefix, name, opts), "--json"]
        r = subprocess.run(argv + (["--quiet"] if quiet else []), stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE if quiet else None, text=True)
    if r.returncode == BUG:  # a bug in kdcache, not the caller's input: its traceback and line, not a BuildError
        raise RuntimeError(f"the producer failed (exit status {BUG}, a bug in kdcache):\n"
                           f"{(r.stderr or '').strip()[-4000:] or '(its output is above)'}")
    if r.returncode != 0:
        raise BuildError(_one_line(r.stderr, f"the producer ended with status {r.returncode}"))
    result = json.loads(r.stdout.strip().splitlines()[-1])
    return result["cache_path"]


def cache_path(teacher: Union[str, Any], dataset: str, *, views: int = 1, augment: Optional[str] = None,
               codec: str = "full", dtype: str = "float16", cache_dir: Optional[str] = None, seed: int = 0,
               teacher_name: str = "teacher", **options) -> str:
    """The path (P.h5) the cache for these inputs has once built: build_cache's, and `kdcache cache`'s.
    It may not exist yet. Same arguments as build_cache; nothing is run (the data set is loaded and
    the teacher's files are hashed, as the producer does to name the cache)."""
    from kdcache.cache_builder.options import parse_args
    from kdcache.pipeline.cachespec import spec_from_args
    from kdcache.pipeline.datasets import load_from_options
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.store import path_for
    opts = dict(views=views, augment=augment, codec=codec, dtype=dtype, cache_dir=cache_dir, seed=seed, **options)
    name = _dataset_name(dataset)
    with _teacher_prefix(teacher, teacher_name) as prefix:
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = parse_args(_argv(prefix, name, opts))
        except SystemExit:  # the producer's parser said what is wrong in one line
            raise BuildError(_one_line(err.getvalue(), "bad arguments")) from None
        topt = TeacherOptions.from_args(args)
        dataset_obj = load_from_options(args, args.split)
        spec, _ = spec_from_args(args, dataset_obj, topt)
    return (args.cache or path_for(args.cache_dir, spec.fingerprint)) + ".h5"
