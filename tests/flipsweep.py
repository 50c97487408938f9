"""Flip bits of a finished cache file outside its rows and run every tool on each damaged file.

`python -m tests.flipsweep FILE EXPECTED.npz BITS.json OUT.json` (a child of tests/test_seal.py, which
kills it at its time limit: a tool that hangs fails the test instead of hanging it). For each bit in
BITS.json, the bit is flipped in FILE (a finished cache alone in its folder) and each tool runs in this
process, its output captured: `ls`, `inspect`, `verify`, `gc --dry-run` (the store's command line, by
its own main), `reader` (CacheReader, every row: what `kdcache train` and a user's loop read) and
`reuse` (CacheWriter on the finished cache: what `kdcache cache` does with a cache it finds). Then the
bit is flipped back. OUT.json receives, per tool, how often each outcome happened, and every flip
whose outcome was not one of those allowed (a traceback, a changed row served, a damaged file said
sound), with its offset and bit.
"""
import contextlib
import io
import json
import os
import sys
import traceback

import numpy as np

from kdcache.store import CacheReader, CacheWriter, StoreError
from kdcache.store.command import main as store_main
from kdcache.store.errors import DamagedFileError
from kdcache.store.files.segment import final_spec
from tests.helpers import flip


def run_cli(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = store_main(argv)
        except SystemExit as e:
            code = e.code
        except BaseException:  # noqa: BLE001 -- a traceback is an outcome to count, not to die of
            traceback.print_exc()
            code = "raised"
    return code, out.getvalue(), err.getvalue()


def tool_outcomes(fin, base, expected):
    """{tool: outcome} for the file as it stands."""
    d = os.path.dirname(fin)
    res = {}
    code, out, err = run_cli(["--cache-dir", d, "ls", "--json"])
    if code != 0 or "Traceback" in err:
        res["ls"] = f"bad: exit {code} {err[-300:]}"
    else:
        states = {e["name"]: e["state"] for e in json.loads(out)}
        res["ls"] = f"listed {states.get(os.path.basename(base))}"
    for tool in ("inspect", "verify"):
        code, out, err = run_cli([tool, fin])
        lines = err.strip().splitlines()
        if "Traceback" in err or code not in (0, 1, 2) or (code == 2 and len(lines) != 1):
            res[tool] = f"bad: exit {code} {err[-300:]}"
        elif tool == "verify" and code == 0:
            res[tool] = "sound"
        elif tool == "verify" and code == 1:
            res[tool] = "NOT sound" if "NOT sound" in out else f"bad: exit 1 without NOT sound: {out[-200:]}"
        else:
            res[tool] = "ok" if code == 0 else "refused"
    code, out, err = run_cli(["--cache-dir", d, "gc", "--dry-run", "--json"])
    if code != 0 or "Traceback" in err:
        res["gc"] = f"bad: exit {code} {err[-300:]}"
    else:
        res["gc"] = "would remove" if json.loads(out)["caches"] else "keeps"
    try:
        with CacheReader(base) as r:
            n = r.spec.num_samples
            got = [r.get(np.arange(n), v) for v in range(r.spec.views)]
        same = all(np.array_equal(g, e) for g, e in zip(got, expected))
        res["reader"] = "same rows" if same else "bad: changed rows served"
    except DamagedFileError:
        res["reader"] = "refused: damaged"
    except StoreError:
        res["reader"] = "refused"
    except BaseException as e:  # noqa: BLE001
        res["reader"] = f"bad: {type(e).__name__}: {str(e)[:200]}"
    try:
        spec, _ = final_spec(fin, os.path.basename(base))
    except StoreError:
        spec = None
    if spec is None:
        res["reuse"] = "refused"
    else:
        try:
            with CacheWriter(base, spec) as w:
                res["reuse"] = "complete" if w.complete else "bad: reopened as incomplete"
        except StoreError:
            res["reuse"] = "refused"
        except BaseException as e:  # noqa: BLE001
            res["reuse"] = f"bad: {type(e).__name__}: {str(e)[:200]}"
    return res


def allowed(res, harmless):
    """The outcomes a damaged file may have: refused or said damaged everywhere; or, for a flip that
    changes nothing anyone reads (`harmless`), exactly the sound file's outcomes."""
    if any(v.startswith("bad") for v in res.values()):
        return False
    if harmless:
        return res["verify"] == "sound" and res["reader"] == "same rows" and res["ls"] == "listed complete"
    return (res["verify"] == "NOT sound" and res["reader"].startswith("refused") and res["ls"] == "listed damaged"
            and res["inspect"] == "refused" and res["reuse"] == "refused")


def main(argv=None):
    fin, expected_npz, bits_json, out_json = (argv or sys.argv[1:])[:4]
    base = fin[:-3]
    expected = list(np.load(expected_npz)["rows"])
    bits = json.load(open(bits_json))
    counts, failures = {}, []
    baseline = tool_outcomes(fin, base, expected)
    for at, bit, harmless in bits:
        flip(fin, at, bit)
        try:
            res = tool_outcomes(fin, base, expected)
        finally:
            flip(fin, at, bit)
        for tool, outcome in res.items():
            key = outcome.split(":")[0] if outcome.startswith("bad") else outcome
            counts.setdefault(tool, {}).setdefault(key, 0)
            counts[tool][key] += 1
        if not allowed(res, harmless):
            failures.append({"at": at, "bit": bit, "harmless": harmless, "outcomes": res})
    json.dump({"baseline": baseline, "counts": counts, "failures": failures, "flips": len(bits)}, open(out_json, "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
