"""Section 4 of the many-hosts benchmark: the two ways to finish a cache built from parts, at ImageNet-1k size.

A cache whose keys are all published as parts can be finished two ways:

* compaction (what kdcache does): every part checked, then its rows copied in key order into one contiguous
  `P.h5` (store.write.compact.finalize), which a reader maps at once (store.read.mapped) and gathers a batch from in
  one numpy indexing;
* a part index (measured here only): every part checked, then an index written (which part and row holds each
  key, where each part's fields start in its file); a reader maps every part (parts keep their codec fields
  contiguous, as P.h5 does) and gathers a batch part by part, with no copy of the rows ever made.

Both start from the same published parts (ImageNet-1k: 1,281,167 rows x 1,000 float16 logits, random values,
parts of 4,096 rows). Timed: the finish, the bytes it writes, a reader's open, and one epoch of batches of 256
in shuffled order, first with the page cache dropped (where this process may drop it) and then warm.
"""
import os
import shutil
import time

import numpy as np

from bench.common import make_log

log = make_log("bench.fleet")
BATCH = 256
INDEX = "index.npz"


class PartIndex:
    """The alternative finish: an index over checked parts, and a reader that maps them without copying."""

    @staticmethod
    def build(parts_dir, spec):
        """Write `parts_dir/index.npz`: per key its part and row; per part its name and each field's offset."""
        import h5py
        from kdcache.store.format import schema
        from kdcache.store.files.parts import list_parts
        nk = spec.num_keys
        loc_part = np.full(nk, -1, dtype=np.int32)
        loc_row = np.zeros(nk, dtype=np.int32)
        names, offsets = [], []
        fields = [n for n, _, _ in spec.make_codec().fields]
        for j, p in enumerate(list_parts(parts_dir)):
            with h5py.File(p, "r") as f:
                keys = f[schema.SEG_KEYS][...]
                offs = [f[n].id.get_offset() for n in fields]
            if any(o is None for o in offs):
                raise RuntimeError(f"{p}: a field without contiguous storage")
            fresh = loc_part[keys] < 0
            loc_part[keys[fresh]] = j
            loc_row[keys[fresh]] = np.flatnonzero(fresh).astype(np.int32)
            names.append(os.path.basename(p))
            offsets.append([int(o) for o in offs])
        if (loc_part < 0).any():
            raise RuntimeError(f"{int((loc_part < 0).sum())} keys in no part")
        path = os.path.join(parts_dir, INDEX)
        np.savez(path, loc_part=loc_part, loc_row=loc_row, names=np.array(names), offsets=np.array(offsets))
        return path

    def __init__(self, parts_dir, spec):
        import mmap
        z = np.load(os.path.join(parts_dir, INDEX))
        self.loc_part, self.loc_row = z["loc_part"], z["loc_row"]
        counts = np.bincount(self.loc_part, minlength=len(z["names"]))
        (name, shape, dtype), = [x for x in spec.make_codec().fields]  # the full codec: one field
        self.width = int(np.prod(shape))
        self.arrays, self._maps = [], []
        for n, offs, rows in zip(z["names"], z["offsets"], counts):
            with open(os.path.join(parts_dir, str(n)), "rb") as fh:
                mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps.append(mm)
            self.arrays.append(np.frombuffer(mm, dtype=dtype, count=int(rows) * self.width,
                                             offset=int(offs[0])).reshape(int(rows), self.width))

    def get(self, keys):
        """float32 rows of `keys`: one gather per part the batch touches."""
        p, r = self.loc_part[keys], self.loc_row[keys]
        order = np.argsort(p, kind="stable")
        cuts = np.flatnonzero(np.diff(p[order])) + 1
        out = np.empty((keys.size, self.width), dtype=np.float32)
        for grp in np.split(order, cuts):
            out[grp] = self.arrays[p[grp[0]]][r[grp]]
        return out

    def close(self):
        self.arrays = []
        for mm in self._maps:
            try:
                mm.close()
            except BufferError:  # an array over it still alive: it closes with its last reference
                pass
        self._maps = []


def drop_caches():
    """Drop the page cache (root on Linux); False where this process may not."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("1\n")
        return True
    except OSError:
        return False


def epoch(get, nk, seed):
    """Seconds for one epoch of batches of BATCH keys in shuffled order, and a checksum of what was read."""
    order = np.random.default_rng(seed).permutation(nk)
    total = 0.0
    t0 = time.perf_counter()
    for a in range(0, nk, BATCH):
        total += float(get(order[a:a + BATCH])[:, 0].sum())
    return time.perf_counter() - t0, total


def write_parts(parts_dir, spec, block, rng):
    """Every key's part, written where published parts sit (publishing is section 3's figure)."""
    from kdcache.store.files.parts import part_name, write_part
    codec = spec.make_codec()
    t0 = time.perf_counter()
    for a in range(0, spec.num_keys, block):
        keys = np.arange(a, min(spec.num_keys, a + block))
        enc = codec.encode(rng.normal(size=(keys.size, spec.num_classes)).astype(np.float32), keys=keys)
        write_part(os.path.join(parts_dir, part_name(a, keys[-1] + 1, keys)), spec, a, keys[-1] + 1, keys, enc)
    return time.perf_counter() - t0


def finishes(root, rows, classes, block):
    """Both finishes from the same parts; {"part_index": {...}, "compaction": {...}, ...}."""
    from kdcache.store import CacheReader, CacheSpec
    from kdcache.store.write.compact import finalize
    from kdcache.store.files.parts import check_parts, list_parts
    from kdcache.store.folder.registry import final_path
    from kdcache.store.write.writer import prepare_parts
    spec = CacheSpec(num_samples=rows, num_classes=classes, views=1, codec="full", dtype="float16",
                     inputs={"teacher": {"name": "bench.fleet.finish", "digest": "0" * 16},
                             "dataset": {"name": "synthetic", "length": rows}})
    base = os.path.join(root, "finish", spec.fingerprint)
    shutil.rmtree(os.path.dirname(base), ignore_errors=True)
    parts = prepare_parts(base, spec)
    write_s = write_parts(parts, spec, block, np.random.default_rng(1))
    nbytes = sum(os.path.getsize(p) for p in list_parts(parts))
    log(f"  {len(list_parts(parts))} parts, {nbytes / 1e9:.2f} GB written in {write_s:.1f} s")
    can_drop = drop_caches()
    out = {"rows": rows, "classes": classes, "block_rows": block, "parts": len(list_parts(parts)),
           "part_bytes": nbytes, "write_s": round(write_s, 2), "page_cache_dropped": can_drop}

    # B: the part index (first: compaction removes the parts)
    t0 = time.perf_counter()
    chk = check_parts(parts, spec)
    check_s = time.perf_counter() - t0
    assert not chk["damaged"] and chk["keys"] == spec.num_keys, chk
    t0 = time.perf_counter()
    index = PartIndex.build(parts, spec)
    index_s = time.perf_counter() - t0
    drop_caches()
    t0 = time.perf_counter()
    pix = PartIndex(parts, spec)
    open_s = time.perf_counter() - t0
    cold_s, sum_b = epoch(pix.get, spec.num_keys, 7)
    warm_s, _ = epoch(pix.get, spec.num_keys, 8)
    pix.close()
    out["part_index"] = {"check_s": round(check_s, 2), "index_s": round(index_s, 3),
                         "finish_s": round(check_s + index_s, 2), "written_bytes": os.path.getsize(index),
                         "open_s": round(open_s, 4), "cold_epoch_s": round(cold_s, 2), "warm_epoch_s": round(warm_s, 2)}
    log(f"  part index: check {check_s:.1f} s + index {index_s:.2f} s ({os.path.getsize(index) / 1e6:.1f} MB); "
        f"open {open_s:.3f} s; epoch cold {cold_s:.1f} s, warm {warm_s:.1f} s")
    os.unlink(index)

    # A: compaction into P.h5, read through CacheReader's map
    drop_caches()
    t0 = time.perf_counter()
    assert finalize(base, spec)
    fin_s = time.perf_counter() - t0
    final = final_path(base)
    drop_caches()
    t0 = time.perf_counter()
    reader = CacheReader(base, spec=spec)
    copen_s = time.perf_counter() - t0
    assert reader.source == "map", reader.source
    cold_a, sum_a = epoch(reader.get, spec.num_keys, 7)
    warm_a, _ = epoch(reader.get, spec.num_keys, 8)
    reader.close()
    assert np.isclose(sum_a, sum_b, rtol=1e-9), (sum_a, sum_b)  # the same rows, read both ways
    out["compaction"] = {"finish_s": round(fin_s, 2), "written_bytes": os.path.getsize(final),
                         "open_s": round(copen_s, 4), "cold_epoch_s": round(cold_a, 2), "warm_epoch_s": round(warm_a, 2)}
    log(f"  compaction: {fin_s:.1f} s ({os.path.getsize(final) / 1e9:.2f} GB written); open {copen_s:.3f} s; epoch "
        f"cold {cold_a:.1f} s, warm {warm_a:.1f} s")
    shutil.rmtree(os.path.dirname(base), ignore_errors=True)
    return out

