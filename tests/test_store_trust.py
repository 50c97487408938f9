"""What the store promises about trust: only kdcache's caches are listed as caches and removed (live
processes and crashes: test_compact_crash.py), and a file whose metadata or structure is not what
kdcache writes is refused in one line (exit 2), quickly, before any buffer sized from it is allocated,
never read with another layout."""
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings, strategies as st

from kdcache.store import CacheReader, CacheWriter, FingerprintMismatchError, UnsupportedFormatError, path_for
from kdcache.store.format import schema
from kdcache.store.format.spec import CacheSpec
from tests.conftest import ROOT
from tests.helpers import expected_logits, make_spec, produce, seal_again

ENV = {**os.environ, "PYTHONPATH": ROOT}
DEAD_PID = 2 ** 22 + 1  # above the largest pid_max Linux allows: never a live process
OLD = time.time() - 100 * 86400
# Each drawn edit runs four commands: make test draws a few beside the listed examples, make torture many.
TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"


def cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "kdcache.store", *map(str, args)], capture_output=True, text=True,
                          env=ENV, cwd=ROOT, timeout=timeout)


def py(code, *args, **kw):
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], env=ENV, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def one_line_naming(r, path):
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert len(r.stderr.splitlines()) == 1 and path in r.stderr, r.stderr


def snapshot(d):
    """Every path under d with its bytes (None for a folder): what must survive untouched."""
    paths = [os.path.join(root, n) for root, dirs, files in os.walk(d) for n in dirs + files]
    return {os.path.relpath(p, d): None if os.path.isdir(p) else open(p, "rb").read() for p in paths}


def finished(cache_dir, spec):
    base = path_for(cache_dir, spec.fingerprint)
    assert produce(base, spec)
    return base


def partial(cache_dir, spec, rows=10):
    """A cache in progress left by a producer that stopped after its first `rows` flat keys."""
    base = path_for(cache_dir, spec.fingerprint)
    w, keys = CacheWriter(base, spec), np.arange(rows)
    w.write(keys // spec.views, expected_logits(keys, spec.num_classes), views=keys % spec.views)
    w.abort()
    return base


def age(*paths):
    for p in paths:
        os.utime(p, (OLD, OLD))


# --- what is not kdcache's ---------------------------------------------------------------------
def test_ls_and_gc_leave_alone_everything_that_is_not_a_kdcache_cache(cache_dir, tmp_path):
    d = cache_dir
    fp = make_spec(tag="foreign").fingerprint
    with h5py.File(os.path.join(d, "model_weights.h5"), "w") as f:
        f["conv0_weight"] = np.ones((4, 3), dtype=np.float32)
    os.makedirs(os.path.join(d, "experiment.parts"))
    open(os.path.join(d, "experiment.parts", "notes.txt"), "w").write("lr 0.1 was better\n")
    open(os.path.join(d, fp[:-1] + "1.h5"), "wb").write(b"\0" * 4096)             # zero-filled
    open(os.path.join(d, fp[:-1] + "2.h5"), "wb").write(os.urandom(4096))         # random bytes
    with h5py.File(os.path.join(d, fp[:-1] + "3.h5"), "w") as f:                  # HDF5, no kdcache metadata
        f["x"] = np.arange(10)
    os.makedirs(os.path.join(d, fp[:-1] + "4.parts"))                              # no manifest, a user's file
    open(os.path.join(d, fp[:-1] + "4.parts", "notes.txt"), "w").write("mine\n")
    open(tmp_path / "elsewhere.bin", "wb").write(b"precious")
    os.symlink(tmp_path / "elsewhere.bin", os.path.join(d, fp[:-1] + "5.h5"))     # a link named like a cache
    open(os.path.join(d, "model.h5.tmp-%d" % DEAD_PID), "w").write("not a compaction's\n")
    for root, dirs, files in os.walk(d):
        age(*(os.path.join(root, n) for n in dirs + files if not os.path.islink(os.path.join(root, n))))
    before = snapshot(d)
    r = cli("ls", "--cache-dir", d)
    assert r.returncode == 0 and "no caches" in r.stdout and "Traceback" not in r.stderr, r.stdout + r.stderr
    listed = [line for line in r.stderr.splitlines() if line.startswith("not a cache, left alone")]
    assert len(listed) == 7, r.stderr  # model_weights.h5, experiment.parts and the five named like caches
    r = cli("gc", "--cache-dir", d, "--min-age", "0", "--older-than", "0", "--max-size", "0")
    assert r.returncode == 0 and "nothing to remove" in r.stdout, r.stdout + r.stderr
    assert snapshot(d) == before and open(tmp_path / "elsewhere.bin", "rb").read() == b"precious"


def test_gc_never_deletes_a_users_file_inside_a_kdcache_parts_folder(cache_dir):
    spec = make_spec(tag="with-notes")
    base = partial(cache_dir, spec)
    notes = os.path.join(base + ".parts", "notes.txt")
    open(notes, "w").write("mine\n")
    age(base + ".parts", *(os.path.join(base + ".parts", n) for n in os.listdir(base + ".parts")))
    r = cli("gc", "--cache-dir", cache_dir, "--min-age", "0")
    assert r.returncode == 0 and f"kept {base}" in r.stdout and "notes.txt" in r.stdout, r.stdout + r.stderr
    assert open(notes).read() == "mine\n" and os.path.exists(os.path.join(base + ".parts", schema.MANIFEST))
    # beside a finished file the segments go, but not a folder holding a user's file
    done = finished(cache_dir, make_spec(tag="finished-with-notes"))
    os.makedirs(done + ".parts")
    open(os.path.join(done + ".parts", "notes.txt"), "w").write("mine too\n")
    for tool in (("ls", "--cache-dir", cache_dir), ("verify", done), ("gc", "--cache-dir", cache_dir)):
        assert cli(*tool).returncode == 0
    assert open(os.path.join(done + ".parts", "notes.txt")).read() == "mine too\n"
    # a removal that died left an entry aside that holds a user's file: kdcache's files go, not that
    aside = os.path.join(cache_dir, f".{make_spec(tag='aside').fingerprint}.parts.gc-{DEAD_PID}")
    os.makedirs(aside)
    for n in ("notes.txt", schema.MANIFEST):
        open(os.path.join(aside, n), "w").write("{}")
    assert cli("gc", "--cache-dir", cache_dir, "--min-age", "0").returncode == 0
    assert os.listdir(aside) == ["notes.txt"]


# --- malformed metadata -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def template(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("template"))
    spec = make_spec(num_samples=20, views=2, tag="malformed")
    return finished(d, spec) + ".h5", spec


class Deleted:
    def __repr__(self):
        return "DELETE"


DELETE = Deleted()  # the attribute removed
CHECKED = (schema.A_FORMAT, schema.A_FINGERPRINT, schema.A_INPUTS, schema.A_NUM_SAMPLES, schema.A_VIEWS,
           schema.A_NUM_CLASSES, schema.A_CODEC, schema.A_DTYPE, schema.A_COMPLETE)
SET = st.one_of(
    st.integers(1, 64).map(np.int64),                     # a plausible size edited, fingerprint unchanged
    st.integers(-2 ** 63, 2 ** 63 - 1).map(np.int64), st.just(np.uint64(2 ** 64 - 1)),
    st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
    st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12),
    st.booleans().map(np.bool_),
    st.lists(st.integers(0, 50), min_size=1, max_size=3).map(lambda x: np.array(x, dtype=np.int64)),
    st.binary(min_size=1, max_size=12).map(np.void))
EXAMPLES = ([(a, DELETE) for a in CHECKED]
            + [(schema.A_NUM_SAMPLES, np.float64("nan")), (schema.A_NUM_SAMPLES, np.int64(2 ** 62)),
               (schema.A_NUM_SAMPLES, np.int64(40)), (schema.A_VIEWS, np.int64(1)), (schema.A_NUM_CLASSES, "ten"),
               (schema.A_NUM_CLASSES, np.int64(5)), (schema.A_COMPLETE, np.int64(0)), (schema.A_COMPLETE, "yes"),
               (schema.A_COMPLETE, np.float64("nan")), (schema.A_FORMAT, np.int64(2)),
               (schema.A_FORMAT, np.float64("inf")), (schema.A_INPUTS, "{not json"), (schema.A_CODEC, "topk:3")])


def examples(pairs):
    """Hypothesis examples for each (attribute, value): every checked attribute deleted, and the edits
    the store is known for, besides the ones drawn at random."""
    def wrap(fn):
        for attr, value in reversed(pairs):
            fn = example(attr=attr, value=value)(fn)
        return fn
    return wrap


def read_as(value):
    """The value as the store reads an attribute (schema.meta_from_attrs)."""
    return schema.meta_from_attrs({"x": value})["x"]


def version(value):
    """The format version an attribute value reads as (versions are read as integers), or None."""
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None


def same_meaning(attr, value, meta):
    """True when the edit leaves the attribute meaning what it meant: not a malformation."""
    v = read_as(value)
    if attr == schema.A_FORMAT:  # any version this kdcache reads, of a file whose seal matches
        return version(value) is not None and 1 <= version(value) <= schema.FORMAT_VERSION
    if attr == schema.A_CODEC:
        return isinstance(v, str) and v.strip().lower() == "full"  # another spelling of the same codec
    if attr == schema.A_INPUTS and isinstance(v, str):
        try:
            return json.loads(v) == meta["inputs"]
        except ValueError:
            return False
    return type(v) is type(meta[attr]) and v == meta[attr]


def edited_copy(template, tmp_path, attr, value):
    fin = os.path.join(tempfile.mkdtemp(dir=tmp_path), os.path.basename(template[0]))
    shutil.copy(template[0], fin)
    with h5py.File(fin, "r+") as f:
        if value is DELETE:
            del f.attrs[attr]
        else:
            f.attrs[attr] = value
    seal_again(fin)  # the checks behind the seal, as if a writer had written the file so (test_seal.py: unsealed)
    return fin, os.path.dirname(fin)


@pytest.mark.slow
@settings(max_examples=200 if TORTURE else 6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(attr=st.sampled_from(CHECKED), value=st.one_of(st.just(DELETE), SET))
@examples(EXAMPLES)
def test_a_finished_cache_with_malformed_metadata_is_refused_in_one_line(template, tmp_path, attr, value):
    with h5py.File(template[0], "r") as f:
        meta = schema.meta_from_attrs(f.attrs)
    if value is not DELETE and same_meaning(attr, value, meta):
        event("an edit to the same meaning: skipped")
        return
    event(f"{attr} {'deleted' if value is DELETE else 'set to ' + type(value).__name__}")
    fin, d = edited_copy(template, tmp_path, attr, value)
    r = cli("ls", "--cache-dir", d)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stdout + r.stderr
    for tool in ("inspect", "verify"):
        one_line_naming(cli(tool, fin), fin)
    with pytest.raises(UnsupportedFormatError):
        CacheReader(fin)
    gc = cli("gc", "--cache-dir", d)
    assert gc.returncode == 0 and "Traceback" not in gc.stderr, gc.stdout + gc.stderr
    if attr == schema.A_FORMAT and value is DELETE:  # without its version it is not known as kdcache's
        assert "not a cache, left alone" in r.stderr and os.path.exists(fin)
    elif attr == schema.A_FORMAT and (version(value) or 0) > schema.FORMAT_VERSION:  # a newer kdcache's: kept
        assert "newer format" in r.stdout and os.path.exists(fin), r.stdout
    else:
        assert "damaged" in r.stdout and not os.path.exists(fin), (r.stdout, gc.stdout)


@settings(max_examples=15, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(attr=st.sampled_from([schema.A_CREATED, schema.A_TOOL_VERSION, schema.A_KIND, schema.A_KEY_LAYOUT,
                             "a_users_note"]), value=SET)
@example(attr=schema.A_CREATED, value=np.float64("nan")).via("ls printed a traceback")
@example(attr=schema.A_CREATED, value=np.int64(10 ** 15)).via("ls printed a traceback")
def test_odd_informational_attributes_do_not_break_ls_inspect_or_verify(template, tmp_path, attr, value):
    fin, d = edited_copy(template, tmp_path, attr, value)
    for args in (("ls", "--cache-dir", d), ("ls", "--cache-dir", d, "--json"), ("inspect", fin), ("verify", fin)):
        r = cli(*args)
        assert r.returncode == 0 and not r.stderr and "damaged" not in r.stdout, r.stdout + r.stderr


def test_odd_but_consistent_inputs_are_listed(cache_dir):
    spec = CacheSpec(num_samples=10, num_classes=3, dtype="float32",
                     inputs={"teacher": {"name": ["a", 1], "digest": 12345}, "dataset": 7})
    finished(cache_dir, spec)
    r = cli("ls", "--cache-dir", cache_dir)
    assert r.returncode == 0 and "complete" in r.stdout and "['a', 1]@12345" in r.stdout, r.stdout + r.stderr


# --- structure: links, storage, sizes -----------------------------------------------------------
def external_link(f, d):
    with h5py.File(os.path.join(d, "ext.h5"), "w") as e:
        e["logits"] = f["logits"][...]
    del f["logits"]
    f["logits"] = h5py.ExternalLink("ext.h5", "/logits")


def soft_link(f, d):
    f.move("logits", "real")
    f["logits"] = h5py.SoftLink("/real")


def virtual(f, d):
    shape, dtype = f["logits"].shape, f["logits"].dtype
    external_link(f, d)
    del f["logits"]
    layout = h5py.VirtualLayout(shape, dtype)
    layout[...] = h5py.VirtualSource(os.path.join(d, "ext.h5"), "logits", shape)
    f.create_virtual_dataset("logits", layout)


def external_storage(f, d):
    data = f["logits"][...]
    data.tofile(os.path.join(d, "raw.bin"))
    del f["logits"]
    f.create_dataset("logits", data.shape, data.dtype, external=[(os.path.join(d, "raw.bin"), 0, data.nbytes)])


def never_written(f, d):  # would read as zeros; the deleted data's space keeps the file large enough
    shape, dtype = f["logits"].shape, f["logits"].dtype
    del f["logits"]
    f.create_dataset("logits", shape, dtype)


def compressed(f, d):
    data = f["logits"][...]
    del f["logits"]
    f.create_dataset("logits", data=data, compression="gzip")


def a_group(f, d):
    del f["logits"]
    f.create_group("logits")


def declaring_1e11_rows(d):
    """A ~7 KB file, named and signed as kdcache would, declaring 10^11 rows of 10 classes."""
    spec = make_spec(num_samples=10 ** 11, tag="huge")
    fin = path_for(d, spec.fingerprint) + ".h5"
    with h5py.File(fin, "w", userblock_size=4096) as f:
        for k, v in {**spec.meta(), schema.A_KIND: schema.KIND_CACHE, schema.A_COMPLETE: 1}.items():
            f.attrs[k] = v
        f.create_dataset("logits", (10 ** 11, 1, 10), np.float32)
        f.create_dataset("done", (10 ** 11, 1), np.uint8)
        f.create_dataset(schema.CHECKSUMS, data=np.zeros((1, 1), np.uint32))
    seal_again(fin)
    return fin


# Each tool on one file in a fresh process: its exit code, its stderr, its time and how far the
# process's peak memory grew past what it held after importing the store.
MEASURE = """
import contextlib, io, json, resource, sys, time
from kdcache.store import CacheReader, StoreError
from kdcache.store.command import main
peak = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
out, rss0 = {}, peak()
for tool in ("verify", "inspect", "reader"):
    t0, err = time.monotonic(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main([tool, sys.argv[1]]) if tool != "reader" else CacheReader(sys.argv[1]).close()
        except StoreError as e:
            print(f"error: {e}", file=sys.stderr)
            code = 2
    out[tool] = {"code": code, "stderr": err.getvalue(), "s": time.monotonic() - t0}
out["rss_growth_mib"] = peak() - rss0
print(json.dumps(out))
"""


@pytest.mark.parametrize("damage", [external_link, soft_link, virtual, external_storage, never_written, compressed,
                                    a_group, declaring_1e11_rows], ids=lambda f: f.__name__)
def test_a_file_not_stored_as_kdcache_stores_it_is_refused_fast_in_one_line(cache_dir, damage):
    if damage is declaring_1e11_rows:
        fin = damage(cache_dir)
        assert os.path.getsize(fin) < 16 * 1024
    else:
        fin = finished(cache_dir, make_spec(num_samples=200, tag="structure")) + ".h5"
        with h5py.File(fin, "r+") as f:
            damage(f, cache_dir)
        seal_again(fin)  # sealed as it is: the structure checks behind the seal refuse it
    p = py(MEASURE, fin)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0 and not err, err
    res = json.loads(out)
    for tool in ("verify", "inspect", "reader"):
        r = res[tool]
        assert r["code"] == 2 and len(r["stderr"].splitlines()) == 1 and fin in r["stderr"], (tool, r)
        assert r["s"] < 10, (tool, r)
    assert res["rss_growth_mib"] < 200, res
    assert "damaged" in cli("ls", "--cache-dir", cache_dir).stdout
    before = {n for n in os.listdir(cache_dir) if not n.endswith(".h5") or n == "ext.h5"}
    assert cli("gc", "--cache-dir", cache_dir).returncode == 0
    assert set(os.listdir(cache_dir)) == before, "the damaged cache goes; files it pointed to stay"


# --- one sample's rows served for another -------------------------------------------------------
def test_metadata_edited_to_another_key_layout_is_refused(cache_dir, tmp_path):
    """views 2 -> 1 and num_samples N -> 2N keep the number of keys: read that way, sample 1 would get
    sample 0's second view. The fingerprint recomputed from the metadata refuses the edit in a finished
    file, a manifest and a segment; the name refuses a file or a segment of another cache."""
    relayout = {schema.A_VIEWS: 1, schema.A_NUM_SAMPLES: 40}
    spec, other = make_spec(num_samples=20, views=2, tag="layout"), make_spec(num_samples=20, views=2, tag="other")
    fin = finished(cache_dir, spec) + ".h5"
    shutil.copy(fin, tmp_path / "sound.h5")
    with h5py.File(fin, "r+") as f:
        f.attrs.update(relayout)
    with pytest.raises(UnsupportedFormatError, match="seal"):  # an edit: the seal refuses it first
        CacheReader(fin)
    seal_again(fin)  # and written so, the fingerprint recomputed from the metadata refuses it
    with pytest.raises(UnsupportedFormatError, match="does not match"):
        CacheReader(fin)
    one_line_naming(cli("verify", fin), fin)
    base = partial(cache_dir, other, rows=6)
    manifest = os.path.join(base + ".parts", schema.MANIFEST)
    m = json.load(open(manifest))
    json.dump({**m, **relayout}, open(manifest, "w"))
    with pytest.raises(UnsupportedFormatError, match="does not match"):
        CacheReader(base)
    one_line_naming(cli("verify", base), manifest)
    json.dump(m, open(manifest, "w"))
    with CacheReader(base, spec=other) as r:  # restored: its rows read as written
        assert np.array_equal(r.get([1, 2], views=[1, 0], wait=False), expected_logits([3, 4], 10))
    seg = glob.glob(os.path.join(base + ".parts", "seg-*.h5"))[0]
    shutil.copy(seg, tmp_path / "seg.h5")
    with h5py.File(seg, "r+") as f:
        f.attrs.update(relayout)
    with pytest.raises(UnsupportedFormatError, match="does not match"):
        CacheReader(base)
    # another cache's segment among this one's; another cache's finished file under this one's name
    produce(path_for(tmp_path, spec.fingerprint), spec, shard=(0, 2))  # half of `spec`: segments only
    shutil.copy(glob.glob(str(tmp_path / "*.parts" / "seg-*.h5"))[0], seg)
    with pytest.raises(FingerprintMismatchError, match="belongs to the cache"):
        CacheReader(base)
    shutil.rmtree(base + ".parts")
    shutil.copy(tmp_path / "sound.h5", base + ".h5")
    with pytest.raises(FingerprintMismatchError, match="is named for the cache"):
        CacheReader(base, spec=other)
    one_line_naming(cli("verify", base + ".h5"), base + ".h5")
