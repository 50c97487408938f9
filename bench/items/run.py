"""What checking a user's own data set item by item costs: the run, its report and its tables (python -m bench.items)."""
import os
import sys

from bench.common import limit_threads

limit_threads(os.environ, force=False)  # before numpy loads: one BLAS/OpenMP thread

import time  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402

from bench.cli import RUN, out_option, quick_option, tmp_option  # noqa: E402
from bench.common import heading, machine, machine_line, md_table, section  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402
from kdcache.pipeline.digests import item_digest, item_records  # noqa: E402
from kdcache.store import CacheSpec, CacheWriter, path_for  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "items.json")
SHAPE = (3, 224, 224)
CLASSES = 1000
OPTIONS = [
    quick_option("128 items instead of 512: a few seconds"),
    out_option(DEFAULT_OUT),
    tmp_option("work directory for the caches (default: a new temporary directory, removed at the end; a directory "
               "given here is kept)"),
    Option("--items", "items in each data set (default 512; --quick 128)", type=Int(16), metavar="N", group=RUN),
    Option("--repeats", "timed repeats of each measurement; the best is kept", type=Int(1), default=3, metavar="R",
           group=RUN),
]


def log(msg):
    print(f"[bench.items] {msg}", file=sys.stderr, flush=True)


def params(ap, args):
    return {"items": args.items or (128 if args.quick else 512), "repeats": args.repeats}


class Items:
    """A plain data set: (image, label) items from arrays, as a user's own Gluon Dataset gives them."""

    def __init__(self, data, labels):
        self.data, self.labels = data, labels

    def __getitem__(self, i):
        return self.data[i], int(self.labels[i])

    def __len__(self):
        return len(self.data)


def build(root, data, labels, tag):
    """A finished cache of these items, recording each (as the producer does)."""
    n = len(data)
    spec = CacheSpec(num_samples=n, num_classes=CLASSES, dtype="float16", inputs={"bench": "bench.items", "tag": tag})
    path = path_for(root, spec.fingerprint)
    rng = np.random.default_rng(1)
    with CacheWriter(path, spec) as w:
        for a in range(0, n, 64):
            k = np.arange(a, min(n, a + 64))
            w.write(k, rng.normal(0, 4, (k.size, CLASSES)).astype(np.float32),
                    items=item_records(data[k].astype(np.float32), labels[k]))
    return path


def digest_s(item, repeats, reps=50):
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(reps):
            item_digest(np.asarray(item, dtype=np.float32))
        best = min(best, (time.perf_counter() - t0) / reps)
    return best


def epoch_s(ds, n):
    t0 = time.perf_counter()
    for i in range(n):
        ds[i]
    return (time.perf_counter() - t0) / n


def measure(p, root):
    from kdcache.trainer import SoftTargetDataset
    n, repeats = p["items"], p["repeats"]
    rng = np.random.default_rng(0)
    labels = rng.integers(0, CLASSES, n)
    out = {}
    for kind in ("uint8", "float32"):
        data = rng.integers(0, 256, (n,) + SHAPE, dtype=np.uint8)
        if kind == "float32":
            data = data.astype(np.float32) / np.float32(255)
        log(f"{kind}: a cache of {n} items of {SHAPE}")
        path = build(root, data, labels, kind)
        items = Items(data, labels)
        first, following, made = [], [], []
        for _ in range(repeats):  # a data set made anew each time: its first epoch checks every item again
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ds = SoftTargetDataset(items, path)
            made.append(time.perf_counter() - t0)
            first.append(epoch_s(ds, n))
            following.append(epoch_s(ds, n))
        out[kind] = {"digest_s": digest_s(data[0], repeats), "first_epoch_s_per_item": min(first),
                     "next_epoch_s_per_item": min(following), "construction_s": min(made),
                     "item_bytes": int(data[0].nbytes)}
        r = out[kind]
        r["check_s_per_item"] = r["first_epoch_s_per_item"] - r["next_epoch_s_per_item"]
        r["first_over_next"] = r["first_epoch_s_per_item"] / r["next_epoch_s_per_item"]
    return out


def run(kids, args, p, work):
    res = measure(p, work)
    return {"results": res, "items": p["items"], "shape": list(SHAPE), "classes": CLASSES, "machine": machine(),
            "quick": bool(args.quick)}


def tables(report):
    res = report["results"]
    ms = lambda s: f"{s * 1e3:.2f} ms"  # noqa: E731
    rows = []
    for kind in ("uint8", "float32"):
        r = res[kind]
        rows.append([f"3x224x224 {kind} ({r['item_bytes']:,} bytes)", ms(r["digest_s"]), ms(r["first_epoch_s_per_item"]),
                     ms(r["next_epoch_s_per_item"]), ms(r["check_s_per_item"]), f"{r['first_over_next']:.2f}x",
                     ms(r["construction_s"])])
    return [("Per item, one process, page cache warm", md_table(
        ["items", "digest", "first epoch", "next epoch (plain read)", "check (first - next)", "first / next",
         "construction"], rows),
        "SoftTargetDataset reads each item, its teacher target and, the first time, compares the item with the "
        "cache's record of it; later epochs (and other DataLoader workers) skip the check. The digest hashes "
        "the float32 values (602,112 bytes) whatever the item's own type.")]


def show(report):
    print(heading("kdcache: what checking a user's own data set item by item costs", report["quick"],
                  report["runtime_s"]))
    print(machine_line(report["machine"]) + "\n")
    for title, table, note in tables(report):
        print(section(title, table, note))
