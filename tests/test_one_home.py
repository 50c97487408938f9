"""Each fact has one home, and a second copy cannot come back unnoticed: the codec grammar (the store's
registry, asked by the --codec option), the KD loss's defaults, the comma lists, the teachers' networks, the
atomic JSON write and the typed --image-size."""
import ast
import hashlib
import inspect
import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.conftest import ROOT

CLASSES = 1 << 24  # more than any K below: topk's bound against the class count never decides here


# --- one codec grammar ----------------------------------------------------------------------------
def codec_words():
    """Codec names, near misses and noise: the two readers must agree on every one."""
    name = st.sampled_from(["full", "topk", "int8", "sampled", "TopK", "SAMPLED", "gzip", "", "top k"])
    k = st.one_of(st.integers(0, 70000).map(str), st.sampled_from(["", "x", "-1", "+5", "05", " 5", "1.0", "٥"]))
    shaped = st.builds(lambda pad, n, colon, kk: f"{pad}{n}{colon}{kk}{pad}", st.sampled_from(["", " ", "\t"]),
                       name, st.sampled_from(["", ":", "::"]), k)
    return st.one_of(shaped, st.text(max_size=12))


def is_valid_codec(word):
    """The grammar as the documentation states it, written here apart from the code: full | int8 | topk:K |
    sampled:K, K in ASCII digits, topk's K >= 1, sampled's from 1 to 65535; case and surrounding space aside."""
    import re
    w = word.strip().lower()
    if w in ("full", "int8"):
        return True
    m = re.fullmatch(r"(topk|sampled):([0-9]+)", w)
    return bool(m) and 1 <= int(m.group(2)) <= (65535 if m.group(1) == "sampled" else CLASSES)


@settings(max_examples=400, deadline=None)
@given(codec_words())
def test_the_option_and_make_codec_accept_and_refuse_the_same_codecs(word):
    import argparse
    from kdcache.pipeline.options import Codec
    from kdcache.store import make_codec
    from kdcache.store.format.codec import codecs_allowed
    from kdcache.store.errors import BadInputError
    try:
        option = Codec()(word)
    except argparse.ArgumentTypeError as e:
        assert not is_valid_codec(word), f"a valid codec refused: {word!r}: {e}"  # a refusal is no pass by itself
        with pytest.raises(BadInputError) as stored:
            make_codec(word, CLASSES)
        allowed = f": use {codecs_allowed()}"  # one list of what is allowed, said by the registry
        assert str(e) == f"{word!r}{allowed}"
        assert str(stored.value) == f"codec {word.strip().lower()!r} is unknown{allowed}"
        return
    assert is_valid_codec(word), f"an invalid codec accepted: {word!r} -> {option!r}"
    assert make_codec(word, CLASSES).spec == option


@pytest.mark.parametrize("word,spec", [("full", "full"), (" INT8 ", "int8"), ("topk:5", "topk:5"), ("TopK:05", "topk:5"),
                                       ("sampled:1", "sampled:1"), ("sampled:65535", "sampled:65535")])
def test_every_valid_codec_is_taken_by_both_readers(word, spec):
    """The oracle's valid side, named: both readers take these and agree on their canonical form."""
    from kdcache.pipeline.options import Codec
    from kdcache.store import make_codec
    assert is_valid_codec(word) and Codec()(word) == make_codec(word, CLASSES).spec == spec


def test_the_allowed_codecs_are_the_registrys():
    from kdcache.pipeline.options import SHARED_BY_DEST
    from kdcache.store.format.codec import CODECS, codec_grammar
    allowed = SHARED_BY_DEST["codec"].type.allowed()
    assert allowed == codec_grammar() == \
        "full | topk:K with K from 1 to the class count | int8 | sampled:K with K draws from 1 to 65535"
    assert [w.split(":")[0] for w in allowed.split(" | ")] == list(CODECS)


# --- one home for the KD defaults -------------------------------------------------------------------
def test_the_kd_defaults_are_one_constant():
    from kdcache.trainer.dataiter import kd_symbol
    from kdcache.trainer.defaults import DEFAULT_ALPHA, DEFAULT_TEMPERATURE
    from kdcache.trainer.loss import KDLoss
    from kdcache.trainer.options import TRAINER
    assert (DEFAULT_TEMPERATURE, DEFAULT_ALPHA) == (20.0, 0.5)  # GluonCV's
    for fn in (KDLoss.__init__, kd_symbol):
        params = inspect.signature(fn).parameters
        assert params["temperature"].default is DEFAULT_TEMPERATURE and params["alpha"].default is DEFAULT_ALPHA
    flags = {o.flag: o.default for o in TRAINER}
    assert flags["--temperature"] is DEFAULT_TEMPERATURE and flags["--alpha"] is DEFAULT_ALPHA
    assert KDLoss().temperature == DEFAULT_TEMPERATURE and KDLoss().alpha == DEFAULT_ALPHA


# --- one comma-list type ----------------------------------------------------------------------------
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(1, 10 ** 6), min_size=1, max_size=6, unique=True))
def test_every_comma_list_is_the_one_type(epochs):
    from kdcache.args import Commas, Floats
    from kdcache.trainer.options import Steps
    assert isinstance(Steps(), Commas) and isinstance(Floats(), Commas)
    steps = tuple(sorted(epochs))
    assert Steps()(Steps().format(steps)) == steps
    assert Floats()(Floats().format(list(steps))) == [float(x) for x in steps]


# --- each network defined once ----------------------------------------------------------------------
# The node lists of the default teachers' exported symbols (MXNet 1.9): a changed network changes every
# default teacher's files, hence its caches' fingerprints.
SYMBOLS = {"digits_teacher": ((1, 1, 8, 8), "06fa1a73b339"), "mnist_teacher": ((1, 1, 28, 28), "36b122a1c6b3")}


def symbol_nodes(arch, shape, tmp_path):
    import mxnet as mx
    from kdcache.trainer import models
    net = (models.TEACHER_NETS.get(arch) or models.BUILTIN[arch])(10, prefix="teacher_")
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros(shape))
    net.export(str(tmp_path / arch), epoch=0)
    with open(tmp_path / f"{arch}-symbol.json") as fh:
        nodes = json.load(fh)["nodes"]
    return hashlib.sha256(json.dumps(nodes, sort_keys=True).encode()).hexdigest()


def test_the_teacher_networks_live_in_models_only(tmp_path):
    from kdcache.trainer import make_teacher, models
    assert set(make_teacher.TEACHER_ARCHS) == set(models.TEACHER_NETS)
    tree = ast.parse(open(os.path.join(ROOT, "kdcache", "trainer", "make_teacher.py"), encoding="utf-8").read())
    made = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    assert not made & {"nn", "HybridSequential", "Conv2D", "Dense"}  # no layer is made there
    for arch, (shape, digest) in SYMBOLS.items():
        assert symbol_nodes(arch, shape, tmp_path).startswith(digest), arch


# --- one atomic JSON write --------------------------------------------------------------------------
def python_files(*dirs):
    for d in dirs:
        for base, _, files in os.walk(os.path.join(ROOT, d)):
            yield from (os.path.join(base, f) for f in sorted(files) if f.endswith(".py"))


def test_no_function_but_the_stores_renames_a_json_file_into_place():
    """A function that both writes JSON and renames a file is a second copy of osutil.write_json_atomic."""
    copies = []
    for path in python_files("kdcache", "bench"):
        tree = ast.parse(open(path, encoding="utf-8").read())
        for fn in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            calls = {(c.func.value.id, c.func.attr) for c in ast.walk(fn) if isinstance(c, ast.Call)
                     and isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)}
            if calls & {("json", "dump"), ("json", "dumps")} and calls & {("os", "replace"), ("os", "rename")}:
                copies.append(f"{os.path.relpath(path, ROOT)}:{fn.name}")
    assert not copies, copies


def test_write_json_atomic_replaces_whole_and_leaves_what_is_not_ours(tmp_path):
    from kdcache.store.osutil import NotOurs, write_json_atomic
    p = tmp_path / "a.json"
    write_json_atomic(str(p), {"b": 1, "a": [2]}, indent=1, sort_keys=True)
    assert p.read_text() == json.dumps({"a": [2], "b": 1}, indent=1, sort_keys=True)
    write_json_atomic(str(p), [3], fsync=False, end="\n")
    assert p.read_text() == "[3]\n" and os.listdir(tmp_path) == ["a.json"]
    link = tmp_path / "link.json"
    link.symlink_to(p)
    with pytest.raises(NotOurs):
        write_json_atomic(str(link), {})
    assert link.is_symlink() and p.read_text() == "[3]\n" and sorted(os.listdir(tmp_path)) == ["a.json", "link.json"]


# --- --image-size parsed once -----------------------------------------------------------------------
def test_the_image_size_is_parsed_at_the_door_only(tmp_path):
    import kdcache
    from kdcache.pipeline.datasets import load_dataset
    from tests.datafiles import make_rec
    rec, _, _ = make_rec(tmp_path / "r")
    assert kdcache.load_dataset("recordio", data_root=rec, image_size="3x2").shape == \
        kdcache.load_dataset("recordio", data_root=rec, image_size=(3, 2)).shape == \
        load_dataset("recordio", data_root=rec, image_size=(3, 2)).shape == (3, 3, 2)
    for size in ("3x2", [3, 2], (3.0, 2)):  # inside, (H, W) only: nothing parses it a second time
        with pytest.raises(TypeError, match=r"pass \(H, W\)"):
            load_dataset("recordio", data_root=rec, image_size=size)
