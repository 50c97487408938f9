"""Publishing and pulling a cache: the measurements, the report and its tables (python -m bench.publish)."""
import os
import sys

from bench.common import limit_threads

limit_threads(os.environ, force=False)  # before numpy loads: one BLAS/OpenMP thread

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

from bench.cli import RUN, out_option, quick_option, tmp_option  # noqa: E402
from bench.common import BenchError, heading, machine_line, md_table, section  # noqa: E402
from bench.paired import floors_table, paired, verdicts_line  # noqa: E402
from bench.publish.nginx import Nginx, binary  # noqa: E402
from kdcache.args import Int, Option  # noqa: E402
from kdcache.store import CacheSpec, CacheWriter, path_for  # noqa: E402

DEFAULT_OUT = os.path.join("bench", "results", "publish.json")
IMAGENET = 1_281_167
CLASSES = 1000
FLOOR_RATE = 0.9
ROUNDS, QUICK_ROUNDS = 9, 3
OPTIONS = [
    quick_option("20 MB files and a 50,000-row cache instead of 200 MB and ImageNet-1k's 1,281,167 rows: seconds"),
    out_option(DEFAULT_OUT),
    tmp_option("work directory (default: a new temporary directory on disk, removed at the end; a directory given "
               "here is kept); it needs about 4 x 2.56 GB free for the full run"),
    Option("--rows", "rows of the cache the rate and the resume are measured on (default 100,000: 200 MB; --quick "
                     "10,000)", type=Int(1000), metavar="N", group=RUN),
    Option("--imagenet-rows", "rows of the large cache published and pulled (default 1,281,167; --quick 50,000)",
           type=Int(1000), metavar="N", group=RUN),
]


def log(msg):
    print(f"[bench.publish] {msg}", file=sys.stderr, flush=True)


def build(root, rows, tag):
    """A finished cache of rows x 1000 full float16 written by the store's writer (simulated targets: each row a
    spread of logits with its key in the first columns), compacted as a producer's is. (path, seconds)."""
    spec = CacheSpec(num_samples=rows, num_classes=CLASSES, dtype="float16",
                     inputs={"bench": f"bench.publish {tag}", "num_samples": rows})
    pool = (np.random.default_rng(0).standard_normal((4096, CLASSES), dtype=np.float32) * 3).astype(np.float32)
    path = path_for(os.path.join(root, tag), spec.fingerprint)
    t0 = time.perf_counter()
    w = CacheWriter(path, spec)
    for a in range(0, rows, 16384):
        k = np.arange(a, min(rows, a + 16384))
        x = pool[k % len(pool)]
        x[:, 0], x[:, 1] = (k & 1023) / 64.0, (k >> 10) / 64.0
        w.write(k, x)
    if not w.close():
        raise BenchError(f"the cache at {path} did not finish")
    return path + ".h5", time.perf_counter() - t0


def kdcache(*args, timeout=3600):
    r = subprocess.run([sys.executable, "-m", "kdcache", *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        raise BenchError(f"kdcache {args[0]} failed: {r.stderr.strip().splitlines()[-1:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def curl(url, dest):
    """curl's download alone, and then the fsync that makes its bytes durable (a pull fsyncs before it installs):
    (seconds of curl, seconds of the fsync)."""
    t0 = time.perf_counter()
    subprocess.run(["curl", "-sS", "--fail", "-o", dest, url], check=True, timeout=3600)
    t1 = time.perf_counter()
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return t1 - t0, time.perf_counter() - t1


def fetch_once(url, dest_dir):
    """kdcache pull's transfer alone, as it runs inside the command: the file fetched into the staging folder,
    hashed as it arrives, fsynced. Seconds."""
    from tqdm import tqdm
    from kdcache.share.manifest import MANIFEST, MANIFEST_LIMIT, parse
    from kdcache.share.pull import Stage, fetch
    from kdcache.share.remote import place
    src = place(url)
    m = parse(src.read_small(MANIFEST, MANIFEST_LIMIT), url)
    os.makedirs(dest_dir, exist_ok=True)
    with Stage(dest_dir, m["fingerprint"]) as stage, tqdm(disable=True) as bar:
        t0 = time.perf_counter()
        fetch(src, m["files"][0], stage, bar)
        return time.perf_counter() - t0


def fresh(path):
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)


def measure_rate(server, name, size, work, rounds):
    """Rounds of curl, kdcache pull's transfer and the whole kdcache pull command on the same file from the same
    nginx, each into a fresh folder of the same file system; the side going first rotates."""
    url = f"{server.url}/pub"
    sides = {
        "curl": lambda d: curl(f"{url}/{name}", os.path.join(d, name)),
        "fetch": lambda d: fetch_once(url, d),
        "command": lambda d: kdcache("pull", url, "--cache-dir", d, "--quiet", "--json"),
    }
    times = {k: [] for k in list(sides) + ["curl_fsync"]}
    order = list(sides)
    for r in range(rounds):
        for side in order[r % 3:] + order[:r % 3]:
            d = os.path.join(work, f"dl-{side}")
            fresh(d)
            t0 = time.perf_counter()
            took = sides[side](d)
            if side == "curl":
                times["curl"].append(took[0])
                times["curl_fsync"].append(took[0] + took[1])
            else:
                times[side].append(took if side == "fetch" else time.perf_counter() - t0)
            shutil.rmtree(d)
        log(f"rate round {r + 1}/{rounds}: " + ", ".join(f"{k} {size / v[-1] / 1e6:.0f} MB/s" for k, v in times.items()))
    med = {k: float(np.median(v)) for k, v in times.items()}
    return {"file_bytes": size, "rounds": rounds, "seconds": times,
            "mb_per_s": {k: size / v / 1e6 for k, v in med.items()},
            "fetch_vs_curl_runs": [c / f for c, f in zip(times["curl"], times["fetch"])],
            "fetch_vs_curl_fsync_runs": [c / f for c, f in zip(times["curl_fsync"], times["fetch"])],
            "command_vs_curl_runs": [c / f for c, f in zip(times["curl"], times["command"])]}


def measure_resume(server, name, size, work):
    """A pull killed (SIGKILL) once half the file is staged, then the same command again: what nginx sent for the
    file each time, and how much of it was fetched twice."""
    from kdcache.share.pull import PART, STAGE_PREFIX
    dest = os.path.join(work, "resume")
    fresh(dest)
    part = os.path.join(dest, STAGE_PREFIX + name[:-3], name + PART)
    before = len(server.requests())
    p = subprocess.Popen([sys.executable, "-m", "kdcache", "pull", f"{server.url}/slow/pub", "--cache-dir", dest,
                          "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (not os.path.exists(part) or os.path.getsize(part) < size // 2):
            time.sleep(0.002)
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    kept = os.path.getsize(part)
    time.sleep(0.5)  # nginx logs the broken request once it sees the connection gone

    def gets():
        return [(s, n) for m, path, s, n in server.requests()[before:] if m == "GET" and path.endswith(name)]
    first = gets()
    out = kdcache("pull", f"{server.url}/pub", "--cache-dir", dest, "--quiet", "--json")
    second = gets()[len(first):]
    if not out["installed"]:
        raise BenchError("the resumed pull installed nothing")
    sent_first = sum(n for _, n in first)
    from kdcache.share.remote import CHUNK
    shutil.rmtree(dest)
    return {"file_bytes": size, "killed_at_bytes": kept, "killed_at": kept / size, "sent_before_kill": sent_first,
            "resumed_requests": [{"status": s, "bytes": n} for s, n in second],
            "fetched_again": sent_first - kept, "fetched_by_resume": out["fetched"], "chunk": CHUNK}


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for b in iter(lambda: fh.read(8 << 20), b""):
            h.update(b)
    return h.hexdigest()


def measure_large(server, fin, www, work):
    """The large cache published into the served folder, then pulled over HTTP into a fresh cache directory by the
    command as a user runs it."""
    t0 = time.perf_counter()
    out = kdcache("publish", fin, os.path.join(www, "large"), "--quiet", "--json")
    publish_s = time.perf_counter() - t0
    size = out["files"][0]["size"]
    dest = os.path.join(work, "large-pulled")
    fresh(dest)
    t0 = time.perf_counter()
    got = kdcache("pull", f"{server.url}/large", "--cache-dir", dest, "--quiet", "--json",
                  "--expect-sha256", out["manifest_sha256"])
    pull_s = time.perf_counter() - t0
    same = sha256(got["path"]) == sha256(fin)
    if not same:
        raise BenchError(f"the pulled {got['path']} differs from {fin}")
    shutil.rmtree(dest)
    shutil.rmtree(os.path.join(www, "large"))
    return {"file_bytes": size, "publish_s": publish_s, "pull_s": pull_s, "publish_mb_per_s": size / publish_s / 1e6,
            "pull_mb_per_s": size / pull_s / 1e6, "bitwise_equal": same}


def params(ap, args):
    return {"rows": args.rows or (10_000 if args.quick else 100_000),
            "imagenet_rows": args.imagenet_rows or (50_000 if args.quick else IMAGENET),
            "rounds": QUICK_ROUNDS if args.quick else ROUNDS}


def versions():
    out = {}
    for name, argv in (("nginx", [binary(), "-v"]), ("curl", ["curl", "--version"])):
        try:
            r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
            out[name] = (r.stderr or r.stdout).strip().splitlines()[0]
        except (OSError, subprocess.SubprocessError, IndexError, TypeError):
            out[name] = None
    import aiohttp
    import fsspec
    out.update(fsspec=fsspec.__version__, aiohttp=aiohttp.__version__)
    return out


def run(kids, args, p, work):
    if binary() is None:
        raise BenchError("nginx is not installed: apt-get install nginx-light")
    if shutil.which("curl") is None:
        raise BenchError("curl is not installed: apt-get install curl")
    www = os.path.join(work, "www")
    log(f"building a {p['rows']:,}-row cache")
    small, _ = build(work, p["rows"], "rate")
    out = kdcache("publish", small, os.path.join(www, "pub"), "--quiet", "--json")
    name, size = out["files"][0]["path"], out["files"][0]["size"]
    log(f"building a {p['imagenet_rows']:,}-row cache")
    large, build_s = build(work, p["imagenet_rows"], "large")
    server = Nginx(www, os.path.join(work, "nginx"), slow_rate="64m" if not args.quick else "16m")
    server.start()
    try:
        rate = measure_rate(server, name, size, work, p["rounds"])
        log("resume after a kill at 50%")
        resume = measure_resume(server, name, size, work)
        log(f"publish and pull {os.path.getsize(large) / 1e9:.2f} GB")
        big = measure_large(server, large, www, work)
        big.update(rows=p["imagenet_rows"], classes=CLASSES, build_s=build_s)
    finally:
        server.stop()
    floors = {"fetch_vs_curl": paired(rate["fetch_vs_curl_runs"], FLOOR_RATE)}
    resume_ok = "PASS" if 0 <= resume["fetched_again"] <= resume["chunk"] else "MISS"
    verdicts = {"fetch_vs_curl": floors["fetch_vs_curl"]["verdict"], "resume_fetched_again": resume_ok}
    return {"rate": rate, "resume": resume, "large": big, "paired": floors, "verdicts": verdicts,
            "floors": {"fetch_vs_curl": {"op": ">=", "value": FLOOR_RATE},
                       "resume_fetched_again": {"op": "<=", "value": resume["chunk"]}},
            "rows": p["rows"], "imagenet_rows": IMAGENET, "versions": versions(), "quick": bool(args.quick)}


def mb(x):
    return f"{x:,.0f} MB/s"


def tables(r):
    rate, res, big = r["rate"], r["resume"], r["large"]
    s = []
    s.append(("1. Pull rate against curl, same file, same nginx on loopback", md_table(
        ["", f"{rate['file_bytes'] / 1e6:,.0f} MB file, median of {rate['rounds']} rounds", "against curl"],
        [["curl -o FILE", mb(rate["mb_per_s"]["curl"]), "1.00x"],
         *([["curl -o FILE, then fsync FILE", mb(rate["mb_per_s"]["curl_fsync"]),
             f"{float(np.median([c / f for c, f in zip(rate['seconds']['curl'], rate['seconds']['curl_fsync'])])):.2f}x"]]
           if "curl_fsync" in rate["mb_per_s"] else []),
         ["kdcache pull's transfer (sha256 as it arrives, fsync)", mb(rate["mb_per_s"]["fetch"]),
          f"{r['paired']['fetch_vs_curl']['measured']:.2f}x"
          + (f" ({float(np.median(rate['fetch_vs_curl_fsync_runs'])):.2f}x curl then fsync)"
             if "fetch_vs_curl_fsync_runs" in rate else "")],
         ["the whole `kdcache pull` command (start-up, manifest, transfer, the cache's checks, install)",
          mb(rate["mb_per_s"]["command"]), f"{float(np.median(rate['command_vs_curl_runs'])):.2f}x"]]),
        "Each round fetches the file once each way into a fresh folder on the same file system, the side going first "
        "rotating (curl's fsync is timed after it, on the same download: a pull makes its bytes durable before it "
        "checks and installs them, curl does not); the transfer is what `kdcache pull` spends fetching the file, the command adds Python's start-up, "
        "the manifest and the cache's own checks (seal, metadata, every chunk's CRC-32), a fixed cost that a large "
        "file (table 3) spreads thin."))
    s.append(("2. Resume after a kill -9 at 50%", md_table(
        ["file", "killed with", "sent before the kill", "resumed with", "fetched twice", "limit (one read)"],
        [[f"{res['file_bytes']:,} bytes", f"{res['killed_at_bytes']:,} bytes staged ({res['killed_at']:.0%})",
          f"{res['sent_before_kill']:,} bytes",
          ", ".join(f"{q['status']}: {q['bytes']:,} bytes" for q in res["resumed_requests"]),
          f"{res['fetched_again']:,} bytes", f"{res['chunk']:,} bytes"]]),
        "nginx's access log counts the bytes it sent; the pull was served at a limited rate so that the kill lands "
        "mid-transfer, then the same command ran again: one range request (status 206) for the rest."))
    what = "ImageNet-1k's size" if big["rows"] == IMAGENET else f"{big['rows']:,} rows (ImageNet-1k: {IMAGENET:,})"
    s.append((f"3. Publish and pull a cache of {what}: {big['rows']:,} rows x {big['classes']} classes, full float16",
              md_table(
        ["file", "written by the store (simulated targets)", "kdcache publish (verify, copy, sha256)",
         "kdcache pull over HTTP (transfer, checks, install)", "bitwise equal"],
        [[f"{big['file_bytes'] / 1e9:.2f} GB", f"{big['build_s']:.0f} s",
          f"{big['publish_s']:.1f} s ({mb(big['publish_mb_per_s'])})", f"{big['pull_s']:.1f} s ({mb(big['pull_mb_per_s'])})",
          "yes" if big["bitwise_equal"] else "NO"]]),
        "Publish into a folder the same nginx serves, pull from it into a fresh cache directory on the same disk, as "
        "a user runs the commands (--expect-sha256 given)."))
    s.append(("4. Floors", floors_table(r["paired"], {"fetch_vs_curl": "pull's transfer / curl (paired rounds)"})
              + f"\n| bytes fetched twice after a kill at 50% | {res['fetched_again']:,} | <= {res['chunk']:,} | "
                f"{r['verdicts']['resume_fetched_again']} |",
              "The rate's floor is decided on the round-by-round ratios (bench.paired)."))
    return s


def render(report):
    """[(title, markdown table)] of a report: what main prints, for bench.docs."""
    return [(title, table) for title, table, _ in tables(report)]


def show(report):
    print(heading("kdcache: publishing and pulling a cache", report["quick"], report["runtime_s"]))
    print(machine_line(report["machine"]))
    v = report.get("versions", {})
    print(f"server {v.get('nginx')}; client {v.get('curl')}; fsspec {v.get('fsspec')}, aiohttp {v.get('aiohttp')}\n")
    for title, table, note in tables(report):
        print(section(title, table, note))
    print(verdicts_line(report["verdicts"]))
