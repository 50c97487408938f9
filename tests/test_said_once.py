"""What the code says to users agrees with the code: every docstring, help text and page says the same about
what a MODULE:FUNCTION data set returns, and no error line tells a command's user to pass an option that
command does not take."""
import ast
import os
import re

import pytest

from tests.conftest import ROOT

OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9]*(?:-[a-z0-9]+)*")


def python_files(*dirs):
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.join(base, f)


def strings_of(path):
    """Every string a module holds (docstrings, help texts, messages), f-strings with their literal parts."""
    tree = ast.parse(open(path, encoding="utf-8").read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.value
        elif isinstance(node, ast.JoinedStr):
            yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)


def texts():
    """(where, text) of everything a user reads about kdcache: the code's strings, the pages, the examples."""
    for path in python_files("kdcache", "examples"):
        for s in strings_of(path):
            yield os.path.relpath(path, ROOT), s
    for page in sorted(os.listdir(os.path.join(ROOT, "docs"))) + ["../README.md"]:
        if page.endswith(".md"):
            yield page, open(os.path.join(ROOT, "docs", page), encoding="utf-8").read()


def dataset_claims():
    """Each statement of what a data set's MODULE:FUNCTION returns: from a mention of MODULE:FUNCTION or
    FUNCTION(split) to the end of its sentence, when it speaks of returning (not an augmentation's
    FUNCTION(image, rng) nor a student's FUNCTION(classes))."""
    for where, text in texts():
        flat = re.sub(r"\s+", " ", text.replace("`", ""))
        for m in re.finditer(r"MODULE:FUNCTION|FUNCTION\(split\)", flat):
            window = re.split(r"(?<=[.!?])\s|\|", flat[m.start():m.start() + 400])[0]
            said = re.search(r"(returns?|returning|->)\s+(an? )?(data set|Dataset|list|tuple|images|\()", window)
            if said and not re.search(r"image, rng|\(classes\)|HybridBlock", window):
                yield where, window


def test_every_text_says_the_same_about_what_a_dataset_function_returns():
    claims = list(dataset_claims())
    assert len(claims) >= 4  # the build_cache docstring, --dataset's help, docs/api.md and docs/examples.md
    wrong = [(where, w) for where, w in claims if not re.search(r"\(image\b[^()]*label\)", w)
             or re.search(r"\(images, labels", w)]
    assert not wrong, wrong


def test_the_dataset_function_contract_as_stated_holds(tmp_path, monkeypatch):
    """The stated contract is the code's: FUNCTION(split) returning a list of (image, label) items loads,
    its class count is the largest label + 1 (num_classes when it has one); a tuple (images, labels,
    num_classes) is refused in one line naming what an item must be."""
    import numpy as np
    from kdcache.pipeline.datasets import DatasetError, load_dataset
    (tmp_path / "said_once_data.py").write_text(
        "import numpy as np\n\n"
        "def items(split):\n"
        "    r = np.random.default_rng(0)\n"
        "    return [(r.random((1, 4, 4), dtype=np.float32), k % 3) for k in range(6)]\n\n"
        "def arrays(split):\n"
        "    return np.zeros((6, 1, 4, 4), np.float32), np.arange(6) % 3, 3\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    ds = load_dataset("said_once_data:items")
    assert len(ds) == 6 and ds.num_classes == 3 and ds.shape == (1, 4, 4)
    with pytest.raises(DatasetError, match=r"not \(image, label\)"):
        load_dataset("said_once_data:arrays")
    assert np.isfinite(ds.get_batch([0, 5])[0]).all()


# --- options named in error lines -----------------------------------------------------------
def command_flags():
    """{command: the flags its parser takes} for the commands that load a data set or a cache's inputs."""
    from kdcache.cache_builder.options import PRODUCER
    from kdcache.cache_builder.teacher_check import build_parser
    from kdcache.pipeline.options import SHARED
    from kdcache.trainer.make_teacher import TEACHER
    verify = build_parser()
    return {"teacher": {o.flag for o in TEACHER},
            "cache": {o.flag for o in SHARED + PRODUCER},
            "verify": {f for a in verify._actions for f in a.option_strings}}


# The modules whose error lines each command shows (its own, and the data set loading all three share),
# and the flags that a module's lines name only on another command's path (with why).
REACHES = {
    "teacher": ["kdcache/trainer/make_teacher.py", "kdcache/pipeline/datasets.py", "kdcache/pipeline/images.py",
                "kdcache/pipeline/dataset_base.py", "kdcache/pipeline/digests.py", "kdcache/pipeline/augment.py",
                "kdcache/pipeline/cachespec.py"],
    "verify": ["kdcache/cache_builder/teacher_check.py", "kdcache/pipeline/images.py", "kdcache/pipeline/dataset_base.py",
               "kdcache/pipeline/digests.py"],
    "cache": ["kdcache/cache_builder/command.py", "kdcache/cache_builder/options.py", "kdcache/cache_builder/runs.py", "kdcache/pipeline/datasets.py", "kdcache/pipeline/images.py",
              "kdcache/pipeline/decode_workers.py", "kdcache/pipeline/dataset_base.py", "kdcache/pipeline/digests.py",
              "kdcache/pipeline/augment.py", "kdcache/pipeline/cachespec.py"],
}
ELSEWHERE = {
    # cachespec.resolve_augment refuses --views V > 1 with an augmentation that does not vary; the teacher asks
    # it for one view only
    ("teacher", "kdcache/pipeline/cachespec.py", "--views"),
    # images.py: "for --dataset recordio pass the .rec file" names the data set, which verify reads from the cache
    ("verify", "kdcache/pipeline/images.py", "--dataset"),
    # images.py: "pass --num-classes" is RecordIO's, whose class count verify reads from the cache
    ("verify", "kdcache/pipeline/images.py", "--num-classes"),
    # verify's own record of a TinyViT option it follows, not advice
    ("verify", "kdcache/cache_builder/teacher_check.py", "--check-saved-logits"),
}


def error_strings(path):
    """The strings of a module's error lines: the arguments of raise X(...), fail(...), .error(...) and
    print(..., file=sys.stderr), and the messages logged as warnings."""
    tree = ast.parse(open(os.path.join(ROOT, path), encoding="utf-8").read())
    calls = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
            calls.append(node.exc)
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            if name in ("fail", "error", "warning") or (
                    name == "print" and any(k.arg == "file" for k in node.keywords)):
                calls.append(node)
    for call in calls:
        for arg in call.args:
            for sub in ast.walk(arg):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    yield sub.value
                elif isinstance(sub, ast.JoinedStr):
                    yield "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in sub.values)


@pytest.mark.parametrize("command", sorted(REACHES))
def test_no_error_line_names_an_option_its_command_does_not_take(command):
    flags = command_flags()[command] | {"--help"}
    named = {(path, flag) for path in REACHES[command] for s in error_strings(path) for flag in OPTION.findall(s)}
    assert named  # the scan sees the error lines
    foreign = sorted((path, flag) for path, flag in named
                     if flag not in flags and (command, path, flag) not in ELSEWHERE)
    assert not foreign, f"kdcache {command} would tell its user to pass: {foreign}"
