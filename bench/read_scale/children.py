"""A reader process of bench.read_scale: open a finished cache, gather one random epoch, wait to be measured.

    python -m bench.read_scale.children --path P --mode map|ram --sync DIR [--seed S] [--memory-budget BYTES] [--view V]

It opens CacheReader(P) (mode map: the default, memory-mapped; ram: mmap=False, the cache read
into RAM within --memory-budget), gathers every key once in a random order (--view: every sample
in that view, a training epoch), in batches of 256,
prints one JSON line, then creates DIR/<pid>.ready and waits until DIR/release exists, so that
the parent can read the memory of every reader while all of them are alive. It imports numpy,
h5py and store only, never MXNet: what a data-loading process of a trainer holds.
"""
import json
import os
import sys
import time

from bench.cli import RUN, parse_args
from kdcache.args import Choice, Dir, Float, Int, Option

BATCH = 256


def smaps_rollup(pid="self"):
    """{field: bytes} of /proc/PID/smaps_rollup (Rss, Pss, Pss_Anon, Pss_File, ...); {} where there is none."""
    out = {}
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                f = line.split()
                if len(f) == 3 and f[2] == "kB":
                    out[f[0].rstrip(":")] = int(f[1]) * 1024
    except OSError:
        pass
    return out


def mapping_pss(pid, path):
    """Bytes of Pss (and Rss) of the process's mappings of the file `path` (/proc/PID/smaps)."""
    pss = rss = 0
    mine = False
    real = os.path.realpath(path)
    try:
        with open(f"/proc/{pid}/smaps") as fh:
            for line in fh:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):  # a mapping's header line
                    mine = len(head) == 6 and head[5].strip() == real
                elif mine and head and head[0] in ("Pss:", "Rss:"):
                    kb = int(head[1]) * 1024
                    if head[0] == "Pss:":
                        pss += kb
                    else:
                        rss += kb
    except OSError:
        pass
    return {"pss": pss, "rss": rss}


def gather_epoch(reader, seed, view=None):
    """Every key of the cache once (view given: every sample once in that view, a training epoch), in a random
    order, in batches of BATCH. Returns (rows, seconds)."""
    import numpy as np
    nv = reader.spec.views
    keys = np.random.default_rng(seed).permutation(reader.spec.num_samples if view is not None else reader.spec.num_keys)
    t0 = time.perf_counter()
    for a in range(0, keys.size, BATCH):
        k = keys[a:a + BATCH]
        if view is not None:
            reader.get(k, views=view)
        elif nv == 1:
            reader.get(k)
        else:
            reader.get(k // nv, views=k % nv)
    return keys.size, time.perf_counter() - t0


def child(path, mode, sync, seed, memory_budget, wait_s, view):
    from kdcache.store import CacheReader  # numpy and h5py with it
    before = smaps_rollup()  # the interpreter, numpy, h5py and store: what any reader process holds anyway
    t0 = time.perf_counter()
    reader = CacheReader(path, mmap=(mode == "map"), memory_budget=memory_budget)
    open_s = time.perf_counter() - t0
    after_open = smaps_rollup()
    rows, epoch_s = gather_epoch(reader, seed, view)
    held = reader._hot.dtype.str if reader._hot is not None else None  # the array a batch is gathered from
    print(json.dumps({"pid": os.getpid(), "mode": mode, "source": reader.source, "held_dtype": held,
                      "open_s": open_s, "rows": rows, "epoch_s": epoch_s, "rows_per_s": rows / epoch_s,
                      "pss_before_open": before.get("Pss"), "pss_after_open": after_open.get("Pss"),
                      "mxnet_loaded": any(m == "mxnet" or m.startswith("mxnet.") for m in sys.modules)}),
          flush=True)
    with open(os.path.join(sync, f"{os.getpid()}.ready"), "w"):
        pass
    deadline = time.monotonic() + wait_s
    release = os.path.join(sync, "release")
    while not os.path.exists(release):  # the reader stays open: the parent reads our memory now
        if time.monotonic() > deadline:
            print(f"bench.read_scale.children: no {release} after {wait_s:.0f} s; giving up", file=sys.stderr)
            return 1
        time.sleep(0.02)
    reader.close()
    return 0


OPTIONS = [
    Option("--path", "the cache (its base path or .h5 file)", metavar="P", group=RUN),
    Option("--mode", "map: CacheReader's default (memory-mapped); ram: mmap=False", type=Choice("map", "ram"),
           default="map", group=RUN),
    Option("--sync", "folder of the ready and release files", type=Dir(), metavar="DIR", group=RUN),
    Option("--seed", "seed of the epoch's order", type=Int(0), default=0, metavar="S", group=RUN),
    Option("--memory-budget", "CacheReader's memory_budget in bytes (default: its own)", type=Int(0),
           metavar="BYTES", group=RUN),
    Option("--view", "gather every sample once in this view (default: every key of every view)", type=Int(0),
           metavar="V", group=RUN),
    Option("--wait-s", "longest wait for the release file", type=Float(0), default=900.0, metavar="S", group=RUN),
]


def main(argv=None):
    p, args = parse_args("python -m bench.read_scale.children", __doc__.split("\n\n")[0], OPTIONS, argv)
    for flag, v in (("--path", args.path), ("--sync", args.sync)):
        if v is None:
            p.error(f"argument {flag}: required")
    return child(args.path, args.mode, args.sync, args.seed, args.memory_budget, args.wait_s, args.view)


if __name__ == "__main__":
    sys.exit(main())
