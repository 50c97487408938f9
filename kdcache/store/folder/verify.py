"""verify: check one cache's metadata, structure, values and completeness."""
import json
import os

import numpy as np

from ..format import checksums, schema
from ..errors import DamagedFileError, StoreError, UnsupportedFormatError
from ..write.settle import settle
from ..files.paths import base_path, final_path, parts_path
from ..files.parts import PART, read_part
from ..files.segment import committed_rows, list_segments, open_final, open_swmr, read_manifest, read_segment_rows
from ..format.validate import check_final, read_meta, spec_from_meta


NO_CHECKSUMS = "no checksums (written before kdcache stored them): verify checks its values, not its bytes"


def _differs(rows, row):
    """Whether any of `rows` [n, m] differs from `row` [m], byte for byte: a few rows first (a real
    cache differs there at once), then all of them as unsigned integers (float16 compares slowly)."""
    probe = rows[::max(1, len(rows) // 16)]
    if (probe != row).any():
        return True
    u = np.dtype(f"u{rows.dtype.itemsize}")
    return bool((np.ascontiguousarray(rows).view(u) != np.ascontiguousarray(row).view(u)).any())


class ValueScan:
    """Every stored value of a cache, block by block: the first key holding a value no teacher
    writes (NaN or Inf, in any float field of any codec), and whether every row is the same one
    (what a teacher gives when all its inputs are alike: NaN or blank images, say)."""

    def __init__(self, views):
        self.views = views
        self.first_bad = None  # (where, flat key, [fields])
        self.bad_keys = 0
        self.first_row = None  # {field: the first row's values}
        self.varied = False

    def add(self, fields, keys, where):
        """Fields {name: [rows, ...]} of the rows of flat keys `keys` [rows], from file `where`."""
        rows = keys.size
        if not rows:
            return
        flat = {name: arr.reshape(rows, -1) for name, arr in fields.items()}
        # one flat pass per field; the per-row pass only for a block that holds a bad value
        bad = {name: ~np.isfinite(a).all(axis=1) for name, a in flat.items()
               if a.dtype.kind == "f" and not np.isfinite(a).all()}
        if bad:
            any_bad = np.logical_or.reduce(list(bad.values()))
            self.bad_keys += int(any_bad.sum())
            if self.first_bad is None:
                i = int(np.flatnonzero(any_bad)[0])
                self.first_bad = (where, int(keys[i]), [name for name, b in bad.items() if b[i]])
        if self.first_row is None:
            self.first_row = {name: a[0].copy() for name, a in flat.items()}
        if not self.varied:  # until two rows differ
            self.varied = any(_differs(a, self.first_row[name]) for name, a in flat.items())

    def problem(self):
        if self.first_bad is None:
            return None
        where, key, names = self.first_bad
        v = self.views
        return (f"{where}: {' and '.join(names)} hold{'s' if len(names) == 1 else ''} NaN or Inf at "
                f"{schema.name_keys([key // v], [key % v])} (the first of {self.bad_keys} such key(s)): no "
                f"teacher writes these, the file was damaged after it was written; remove it and rebuild")

    def suspect(self, where, rows, so_far=""):
        """The suspicion a cache of `rows` distinct keys raises, or None."""
        if self.varied or rows < 2 or self.first_row is None:
            return None
        return (f"{where}: all {rows} rows{so_far} hold the same values: the teacher saw the same input for every key, "
                f"most likely NaN or blank images from the data set or the augmentation (a teacher can turn "
                f"NaN images into one finite row); check them, then remove the cache and rebuild")


def verify(path, *, block_rows=65536, values=True):
    """Check a cache: metadata, links, shapes, flags, finite values, key ranges, completeness.

    Returns (report dict, [problems]); the cache is sound exactly when problems is empty. A sound
    cache whose every row is the same is suspect: report["suspect"] says why (empty otherwise). A
    file that is not a well-formed kdcache cache raises UnsupportedFormatError (one line) instead.
    values=False checks a finished file's seal, metadata, flags and checksums but not its values one by one
    (a copy whose bytes are known to be those of a verified file: kdcache pull)."""
    base = base_path(path)
    fin, parts = final_path(base), parts_path(base)
    name = os.path.basename(base)
    settle(base)  # a crash may have left every key committed and the compaction undone
    problems = []
    report = {"path": fin if os.path.exists(fin) else parts, "suspect": []}

    def check_rows(fields, where, c):
        if schema.TOPK_INDICES in fields:
            ix = fields[schema.TOPK_INDICES]
            if ix.size and (ix.min() < 0 or ix.max() >= c):
                problems.append(f"{where}: {schema.TOPK_INDICES} has class indices outside [0, {c})")

    try:
        if os.path.exists(fin):
            try:
                f = open_final(fin)
            except DamagedFileError as e:  # kdcache's file, changed since it was written: NOT sound
                if not e.ours:
                    raise
                problems.append(str(e).splitlines()[0])
                return report, problems
            with f:
                meta = read_meta(f, fin)
                spec = spec_from_meta(meta, fin, name=name)
                check_final(f, fin, spec)
                codec = spec.make_codec()
                n, v = spec.num_samples, spec.views
                report.update(fingerprint=spec.fingerprint, num_keys=spec.num_keys, kind=meta.get(schema.A_KIND))
                step = max(1, block_rows // v)
                sums = checksums.load(f, fin, spec)
                report["checksums"] = sums.describe() if sums else NO_CHECKSUMS
                if sums:  # blocks of whole chunks
                    step = max(1, step // sums.samples) * sums.samples
                for a in range(0, n, step):
                    if not np.all(f[schema.DONE][a:a + step] == 1):
                        problems.append(f"{fin}: some rows are not marked done")
                        break
                scan = ValueScan(v)
                first_bad, bad_chunks = None, 0
                for a in range(0, n, step):
                    fields = {fname: f[fname][a:a + step] for fname, _, _ in codec.fields}
                    if sums:
                        for c in range(a // sums.samples, -(-min(n, a + step) // sums.samples)):
                            lo, hi = (s - a for s in sums.rows(c))
                            names = sums.bad_fields_of(c, {k: x[lo:hi] for k, x in fields.items()})
                            if names:
                                bad_chunks += 1
                                first_bad = first_bad or (c, names)
                    if not values:
                        continue
                    check_rows(fields, f"{fin} samples [{a}, {min(n, a + step)})", spec.num_classes)
                    b = min(n, a + step)
                    scan.add(fields, np.arange(a * v, b * v, dtype=np.int64), fin)
                if first_bad:  # first: the other problems a damaged chunk raises are its consequences
                    more = f"the first of {bad_chunks} bad chunks; " if bad_chunks > 1 else ""
                    problems.insert(0, sums.damage(*first_bad, f"{more}remove it (kdcache gc) and rebuild it, "
                                                               f"or copy it again from its source"))
                problems += [p for p in (scan.problem(),) if p]
                report["suspect"] += [p for p in (scan.suspect(fin, spec.num_keys),) if p and not problems]
                report["done"] = 1.0
        elif os.path.isdir(parts):
            meta = read_manifest(parts)
            if meta is None:
                raise UnsupportedFormatError(f"{parts}: no {schema.MANIFEST}: it is not a kdcache cache in "
                                             f"progress, or its producer died before starting; remove it")
            spec = spec_from_meta(meta, os.path.join(parts, schema.MANIFEST), name=name)
            codec = spec.make_codec()
            seen = []
            scan = ValueScan(spec.views)
            for seg in list_segments(parts):
                if PART.match(os.path.basename(seg)):  # an immutable part: its checksums, name and range first
                    try:
                        read_part(seg, spec)
                    except DamagedFileError as e:
                        problems.append(str(e).splitlines()[0])
                        continue
                with open_swmr(seg, retry_s=1.0) as f:
                    rows, _ = committed_rows(f, spec)
                    for a in range(0, rows, block_rows):
                        keys, fields = read_segment_rows(f, codec, a, min(rows, a + block_rows), spec.num_keys)
                        check_rows(fields, f"{seg} rows [{a}, {a + keys.size})", spec.num_classes)
                        scan.add(fields, keys, seg)
                        seen.append(np.unique(keys))
            done = int(np.unique(np.concatenate(seen)).size) if seen else 0
            problems += [p for p in (scan.problem(),) if p]
            report["suspect"] += [p for p in (scan.suspect(parts, done, " committed so far"),) if p and not problems]
            report.update(fingerprint=spec.fingerprint, num_keys=spec.num_keys, done=done / spec.num_keys)
            if done < spec.num_keys:
                problems.append(f"{parts}: incomplete: {spec.num_keys - done} of {spec.num_keys} keys not done "
                                f"yet (run the producer to finish it)")
            else:
                problems.append(f"{parts}: every key is committed but not compacted yet (kdcache ls or the "
                                f"producer finishes it)")
        else:
            problems.append(f"no cache at {base}")
    except StoreError:
        raise
    except (OSError, KeyError, ValueError, TypeError, json.JSONDecodeError) as e:
        raise UnsupportedFormatError(f"{report['path']}: unreadable ({type(e).__name__}: "
                                     f"{str(e).splitlines()[0][:160]}): remove it and rebuild") from None
    return report, problems


def verdict(report):
    """The first line's word: sound, NOT sound, or suspect (well formed, every row the same)."""
    if report["problems"]:
        return "NOT sound"
    return "suspect: well formed, but see below" if report["suspect"] else "sound"
