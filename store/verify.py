"""verify: check one cache's metadata, structure, values and completeness."""
import json
import os

import numpy as np

from . import schema
from .errors import StoreError, UnsupportedFormatError
from .housekeeping import settle
from .paths import base_path, final_path, parts_path
from .segment import committed_rows, list_segments, open_final, open_swmr, read_manifest, read_segment_rows
from .validate import check_final, read_meta, spec_from_meta


def verify(path, *, block_rows=65536):
    """Check a cache: metadata, links, shapes, flags, finite values, key ranges, completeness.

    Returns (report dict, [problems]); the cache is sound exactly when problems is empty. A file
    that is not a well-formed kdcache cache raises UnsupportedFormatError (one line) instead."""
    base = base_path(path)
    fin, parts = final_path(base), parts_path(base)
    name = os.path.basename(base)
    settle(base)  # a crash may have left every key committed and the compaction undone
    problems = []
    report = {"path": fin if os.path.exists(fin) else parts}

    def check_rows(fields, where, c):
        for fname, arr in fields.items():
            if arr.dtype.kind == "f" and not np.isfinite(arr).all():
                problems.append(f"{where}: dataset {fname} holds NaN/Inf values")
        if schema.TOPK_INDICES in fields:
            ix = fields[schema.TOPK_INDICES]
            if ix.size and (ix.min() < 0 or ix.max() >= c):
                problems.append(f"{where}: {schema.TOPK_INDICES} has class indices outside [0, {c})")

    try:
        if os.path.exists(fin):
            with open_final(fin) as f:
                meta = read_meta(f, fin)
                spec = spec_from_meta(meta, fin, name=name)
                check_final(f, fin, spec)
                codec = spec.make_codec()
                n, v = spec.num_samples, spec.views
                report.update(fingerprint=spec.fingerprint, num_keys=spec.num_keys, kind=meta.get(schema.A_KIND))
                step = max(1, block_rows // v)
                for a in range(0, n, step):
                    if not np.all(f[schema.DONE][a:a + step] == 1):
                        problems.append(f"{fin}: some rows are not marked done")
                        break
                for a in range(0, n, step):
                    check_rows({fname: f[fname][a:a + step] for fname, _, _ in codec.fields},
                               f"{fin} samples [{a}, {min(n, a + step)})", spec.num_classes)
                report["done"] = 1.0
        elif os.path.isdir(parts):
            meta = read_manifest(parts)
            if meta is None:
                raise UnsupportedFormatError(f"{parts}: no {schema.MANIFEST}: it is not a kdcache cache in "
                                             f"progress, or its producer died before starting; remove it")
            spec = spec_from_meta(meta, os.path.join(parts, schema.MANIFEST), name=name)
            codec = spec.make_codec()
            seen = []
            for seg in list_segments(parts):
                with open_swmr(seg, retry_s=1.0) as f:
                    rows, _ = committed_rows(f, spec)
                    for a in range(0, rows, block_rows):
                        keys, fields = read_segment_rows(f, codec, a, min(rows, a + block_rows), spec.num_keys)
                        check_rows(fields, f"{seg} rows [{a}, {a + keys.size})", spec.num_classes)
                        seen.append(np.unique(keys))
            done = int(np.unique(np.concatenate(seen)).size) if seen else 0
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
