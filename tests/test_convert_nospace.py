"""`kdcache convert` onto a full disk (a small tmpfs mounted by the test, as root): exit status 2 with one
line naming the bytes needed and free, never a signal (HDF5's clean-up after a failed write can crash the
process) or a traceback, and nothing of the conversion left in the folder, whatever room there was; the
same with the disk filling up only once the conversion writes (its space check bypassed); once space is
freed the conversion succeeds and reads back as one on a roomy disk."""
import os
import subprocess
import sys

import numpy as np

from kdcache.store import CacheReader
from kdcache.store.derive.convert import convert
from tests.helpers import CHILD_ENV, ROOT
from tests.test_compact_nospace import fill, small_disk  # noqa: F401 (small_disk: the fixture)
from tests.test_convert import built

# The conversion in its own process; "racing" leaves out its space check, as when another process fills the
# disk after it: the writer then meets the full disk inside HDF5.
TOOL = """
import sys
import kdcache.store.derive.convert as convert
if sys.argv[1] == "racing":
    convert.reserve = lambda path, size: None
sys.exit(convert.main(sys.argv[2:]))
"""
# bytes left free on the 6 MiB disk: none, a few blocks, and up to just below what the conversion needs
LEAVE = (0, 4096, 12_000, 24_000, 40_000, 64_000, 200_000, 600_000, 1_200_000, 1_700_000)


def run(how, *argv):
    return subprocess.run([sys.executable, "-c", TOOL, how, *map(str, argv)], cwd=ROOT, env=CHILD_ENV,
                          capture_output=True, text=True, timeout=120)


def test_convert_onto_a_full_disk_is_one_line_and_leaves_nothing(small_disk, tmp_path):
    src, spec = built(tmp_path / "src", "full", "float32", samples=10_000, views=2, classes=20)  # 1.6 MB of rows
    want = convert(src, "full", "float16", cache_dir=str(tmp_path / "roomy"))
    outcomes, bad = [], []
    for how in ("checked", "racing"):
        for leave in LEAVE:
            filler = fill(small_disk, leave)
            r = run(how, src, "--codec", "full", "--dtype", "float16", "--cache-dir", small_disk)
            left = sorted(set(os.listdir(small_disk)) - {"filler"})
            os.unlink(filler)
            line = r.stderr.strip()
            outcomes.append((how, leave, r.returncode, line, left))
            sound = (r.returncode == 2 and not left and r.stdout == "" and "\n" not in line
                     and line.startswith(f"error: {small_disk}: ") and ("no space left" in line or "filled up" in line))
            if not sound:  # -11 is SIGSEGV
                bad.append(f"{how}, {leave:,} bytes free: exit {r.returncode}, left {left}: {line[-600:]}")
    assert not bad, "\n".join(bad)
    checked = [o for o in outcomes if o[0] == "checked"]
    assert all("nothing was written" in o[3] and "bytes there" in o[3] for o in checked), checked
    # with the space freed: the conversion runs, and its rows are those of the conversion on a roomy disk
    r = run("checked", src, "--codec", "full", "--dtype", "float16", "--cache-dir", small_disk)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == os.path.join(small_disk, os.path.basename(want["cache_path"]))
    keys = np.arange(spec.num_samples)
    with CacheReader(r.stdout.strip()) as a, CacheReader(want["cache_path"]) as b:
        assert a.complete and np.array_equal(a.get(keys, 1), b.get(keys, 1))


PRODUCER = """
import json, sys
from kdcache.store import CacheWriter, StoreError
from kdcache.store.osutil import exit_at_once
from tests.helpers import expected_logits, make_spec
spec = make_spec(num_samples=10_000, num_classes=20, tag="nospace-producer")
try:
    with CacheWriter(sys.argv[1], spec) as w:
        for a in range(0, spec.num_keys, 500):
            keys = w.missing()[:500]
            w.write(keys, expected_logits(keys, spec.num_classes))
except StoreError as e:
    print(f"error: {e}", file=sys.stderr)
    exit_at_once(2)  # as the producer's command line does
"""


def test_a_producer_on_a_full_disk_is_one_line_wherever_the_disk_fills(small_disk):
    """The writer all producers (and conversions) write through: a full disk met at its lock file, while
    it creates a segment, or inside HDF5's writes is one line naming the file system's reason, never a
    traceback."""
    bad = []
    for leave in LEAVE:
        filler = fill(small_disk, leave)
        r = subprocess.run([sys.executable, "-c", PRODUCER, os.path.join(small_disk, "c")], cwd=ROOT, env=CHILD_ENV,
                           capture_output=True, text=True, timeout=120)
        os.unlink(filler)
        line = r.stderr.strip()
        if not (r.returncode == 2 and "\n" not in line and line.startswith("error: ") and
                ("No space left on device" in line or "no space left" in line)):
            bad.append(f"{leave:,} bytes free: exit {r.returncode}: {line[-600:]}")
        subprocess.run(["rm", "-rf", os.path.join(small_disk, "c.parts")])
    assert not bad, "\n".join(bad)
