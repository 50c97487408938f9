"""python -m kdcache.cache_builder: run a frozen teacher on the CPU and fill the soft-target cache."""
if __name__ == "__main__":  # first, before anything heavy is imported: signals at safe points only
    from kdcache import signals as _signals
    _signals.defer()
import argparse
import json
import logging
import os
import signal
import sys
import time

from kdcache.args import Address, Dir, Int, Name, Option, OutFile, Parser, add_options
from kdcache.cache_builder.errors import ProducerError
from kdcache.errors import BUG, USER_ERROR, KdcacheError, as_command, bug, refused
from kdcache.pipeline.interrupts import exit_status, stop_word, take_sigterm
from kdcache.pipeline.options import SHARED, Shard, check_applies, check_views, resolve_teacher
from kdcache.threads import fix_threads

DESCRIPTION = """\
Run a frozen MXNet teacher forward on the CPU over a data set and store its raw logits
(temperature 1) in a cache named by the fingerprint of the teacher, the data, the views and the
codec. A complete cache with the same fingerprint is reused: the teacher then runs zero times.
Offline (default) fills every (sample, view); --online follows the training schedule (the same
--seed/--epochs/--batch-size/--views as the trainer) so targets arrive in the order training
reads them. Interrupted runs (Ctrl-C, kill -9) resume where they stopped."""


RING_TIMEOUT = 600.0  # seconds an attaching producer waits for the trainer's ring ($KDCACHE_RING_TIMEOUT)


def ring_timeout():
    """$KDCACHE_RING_TIMEOUT as seconds (> 0), else RING_TIMEOUT; ValueError naming it when it is no number."""
    value = os.environ.get("KDCACHE_RING_TIMEOUT", "")
    try:
        seconds = float(value) if value.strip() else RING_TIMEOUT
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ProducerError(f"KDCACHE_RING_TIMEOUT={value!r}: use a number of seconds > 0, or unset it")
    return seconds


PRODUCER = [
    Option("--split", "which split of the data set to run the teacher on", choices=("train", "test"),
           default="train", group="producing"),
    Option("--online", "follow the training schedule (--seed, --epochs, --batch-size, --views: the trainer's) "
           "instead of key order", action="store_true", group="producing"),
    Option("--threads", "teacher compute threads (default: $KDCACHE_TEACHER_THREADS when set, else all cores but "
           "one, left to the trainer; cores/N with --shards N)", type=Int(1, 1024), metavar="N", group="producing", make="THREADS"),
    Option("--decode-workers", "processes that decode and augment the next batches while the teacher runs this one "
           "(0: in this process; default: the cores the teacher's threads leave for image files (recordio, "
           "imagefolder), 0 for data held in RAM)", type=Int(0, 256), metavar="N", group="producing"),
    Option("--shard", "fill only the keys with key mod n = i (n producers share the work)", type=Shard(),
           default="0/1", metavar="i/n", group="producing"),
    Option("--shards", "fork N shard producers after loading the data set once (each --threads, default "
           "cores/N); the same as N commands with --shard 0/N .. N-1/N, minus N-1 start-ups", type=Int(1, 256),
           default=1, metavar="N", group="producing", make="SHARDS"),
    Option("--engine", "local: this process (with --scratch, it writes immutable parts); ray: Ray actors on the "
           "cluster at --address (a local one on 127.0.0.1 without it) fill the cache as immutable parts, one per "
           "task of --block-rows keys, each published exactly once (needs pip install 'kdcache[ray]')",
           choices=("local", "ray"), default="local", group="many hosts"),
    Option("--address", "with --engine ray: the cluster to run on, auto (the one `ray start` made here) or "
           "HOST:PORT (default: start a local cluster on 127.0.0.1 for this command, stopped after)",
           type=Address(), metavar="ADDRESS", group="many hosts"),
    Option("--actors", "with --engine ray: teacher actors (default: the cluster's CPUs / --actor-cpus)",
           type=Int(1, 4096), metavar="N", group="many hosts"),
    Option("--actor-cpus", "with --engine ray: CPUs (and teacher threads) of each actor", type=Int(1, 256),
           default=1, metavar="N", group="many hosts"),
    Option("--block-rows", "keys per task (one immutable part each); a multiple of --batch-size gives parts bit "
           "for bit equal to a one-host build's rows", type=Int(1, 1 << 30), default=4096, metavar="N",
           group="many hosts"),
    Option("--scratch", "write each part in DIR first (local disk), then publish it into the cache folder; with "
           "the local engine this switches the producer to parts (--shard i/n: tasks j with j mod n = i), so "
           "hosts sharing a network file system never write a file another reads (default for --engine ray: "
           "a folder in the temp directory)", type=Dir(), metavar="DIR", group="many hosts"),
    Option("--ring", "stream to the shared-memory ring NAME instead of a cache file (pure streaming: keys are "
           "(sample, epoch), nothing is persisted; implies --online); it waits $KDCACHE_RING_TIMEOUT seconds (default "
           f"{RING_TIMEOUT:g}) for the trainer to create the ring", type=Name(), metavar="NAME",
           group="producing"),
    Option("--ring-capacity", "create the ring with this many rows (default: attach to the ring the trainer "
           "made)", type=Int(1, 1 << 28), metavar="ROWS", group="producing"),
    Option("--hold", "with --online, as `kdcache train` starts its producer before it knows the cache's name: "
           "load the data set and the teacher, then wait for one JSON line on stdin, {\"cache\": PATH, "
           "\"fingerprint\": FP}, and fill the cache at PATH (FP must be the fingerprint these options give); "
           "end of input ends it with nothing written", action="store_true", group="producing"),
    Option("--timeline", "with --online/--ring: write (time, schedule position, rows) per step to FILE as JSON "
           "when done", type=OutFile(), metavar="FILE", group="output"),
    Option("--json", "end with one JSON line: cache_path, fingerprint, rows_written, teacher_forwards, ...",
           action="store_true", group="output"),
    Option("--result", "write that JSON result to FILE too (atomically), for a program that started this one",
           type=OutFile(), metavar="FILE", group="output"),
    Option("--quiet", "no progress bar", action="store_true", group="output"),
]


def build_parser(prog="python -m kdcache.cache_builder"):
    p = Parser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, SHARED + PRODUCER, cache={"help": "explicit cache path instead of <cache-dir>/<fingerprint>"})
    return p


def parse_args(argv=None, prog="python -m kdcache.cache_builder"):
    """The options, checked: a mistake exits here with one line and status 2, before anything runs."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.cache == "auto":
        args.cache = None
    resolve_teacher(args, p)
    check_views(args, p)
    check_applies(args, p)
    if args.ring and (args.shards > 1 or args.shard.count > 1):
        p.error("argument --ring: a ring streams from one producer; drop --shard/--shards")
    if args.shards > 1 and args.shard.count > 1:
        p.error(f"argument --shards: --shards {args.shards} forks shards 0/{args.shards} .. "
                f"{args.shards - 1}/{args.shards} itself; drop --shard")
    if args.timeline and not (args.online or args.ring):
        p.error("argument --timeline: an offline build follows no schedule; add --online (or drop --timeline)")
    if args.ring:
        try:
            ring_timeout()
        except ValueError as e:
            p.error(str(e))
    if args.ring_capacity is not None and not args.ring:
        p.error("argument --ring-capacity: it sizes a ring; add --ring NAME (or drop --ring-capacity)")
    if args.hold and (not args.online or args.ring or args.shards > 1 or args.cache):
        p.error("argument --hold: it holds an --online producer until its cache is named on stdin; add --online, "
                "drop --ring, --shards and --cache")
    parts = args.engine == "ray" or args.scratch
    if parts and (args.online or args.ring or args.hold or args.shards > 1):
        p.error(f"argument {'--engine ray' if args.engine == 'ray' else '--scratch'}: parts are filled offline, in "
                f"key order; drop --online, --ring, --hold and --shards (use --actors, or --shard i/n per host)")
    if args.engine == "ray" and args.shard.count > 1:
        p.error("argument --shard: with --engine ray the driver gives every task to the cluster's actors; drop --shard")
    for name in ("address", "actors"):
        if getattr(args, name) is not None and args.engine != "ray":
            p.error(f"argument --{name}: it applies to --engine ray; add it (or drop --{name})")
    if args.split == "test" and (args.online or args.ring):
        p.error("argument --split: the test split is filled offline; drop --online/--ring")
    return args


@as_command  # a KdcacheError is one line and exit 2; anything else shows as the bug it is
def main(argv=None, prog="python -m kdcache.cache_builder"):
    args = parse_args(argv, prog)
    take_sigterm()  # SIGTERM stops like Ctrl-C: at a safe point, rows kept, exit 143
    # Threads must be fixed before MXNet is imported: only OMP_NUM_THREADS limits its compute.
    from kdcache.cache_builder.produce import default_threads
    default, cores = default_threads()
    if args.shards > 1:
        default = max(1, cores // args.shards)
    env_threads = os.environ.get("KDCACHE_TEACHER_THREADS", "")
    if env_threads and not (env_threads.isdigit() and 1 <= int(env_threads) <= 1024):
        print(f"error: KDCACHE_TEACHER_THREADS={env_threads!r}: use an integer from 1 to 1024, or unset it",
              file=sys.stderr)
        return 2
    threads = args.threads or int(env_threads or 0) or default
    args.cores, args.teacher_threads = cores, threads  # for the decode workers' default (decode_workers)
    fix_threads(threads)  # its decode workers inherit one OpenCV thread each (kdcache.threads)
    logging.basicConfig(level=logging.INFO, format="[producer %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("kdcache.producer")
    log.info("teacher uses %d thread(s) of %d core(s); %d left to the trainer (OMP_NUM_THREADS=%d)",
             threads, cores, max(0, cores - threads), threads)
    from kdcache.store import StoreError
    try:
        return run(args, log)
    except StoreError as e:  # the others: as_command
        refused(e)
        from kdcache.store.osutil import exit_at_once
        exit_at_once(USER_ERROR)  # HDF5's clean-up after a failed write (a full disk) can crash at exit
    except KeyboardInterrupt as e:
        print(f"{stop_word(e)}: every row written so far is kept; run the same command again to resume",
              file=sys.stderr)
        return exit_status(e)


def write_timeline(path, timeline):
    if path and timeline is not None:
        from kdcache.store.osutil import write_json_atomic
        # a diagnostic: not fsynced
        write_json_atomic(path, {"columns": ["time", "position", "rows"], "steps": timeline}, fsync=False)


def run(args, log):
    from kdcache.pipeline.cachespec import spec_from_args
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.store import path_for

    shard = tuple(args.shard)  # (index, count), as --shard parsed it
    topt = TeacherOptions.from_args(args)
    t0 = time.perf_counter()
    dataset = load_dataset(args.dataset, data_root=args.data_root, split=args.split,
                           image_size=args.image_size, num_classes=args.num_classes)
    spec, augment = spec_from_args(args, dataset, topt)
    path = args.cache or path_for(args.cache_dir, spec.fingerprint)
    log.info("data set %s/%s: %d samples, %d classes; %d view(s), augment %s; codec %s/%s",
             dataset.name, dataset.split, len(dataset), dataset.num_classes, spec.views, augment.spec,
             spec.codec, spec.dtype)
    result = {"cache_path": path + ".h5", "fingerprint": spec.fingerprint, "rows_written": 0,
              "teacher_forwards": 0, "reused": False, "complete": False, "shard": str(args.shard)}
    timeline = [] if args.timeline else None
    if args.hold:
        from kdcache.pipeline.teacher import check_fits, load_teacher
        teacher = load_teacher(topt, args.batch_size)
        check_fits(teacher, dataset, augment, args.seed)
        path = await_cache(log, spec)
        if path is None:
            return 0
        result["cache_path"] = path + ".h5"
        return report(args, log, spec, fill(args, log, shard, path, spec, dataset, augment, topt, result, t0,
                                            timeline, teacher))
    if args.ring:
        try:
            return run_ring(args, log, topt, dataset, augment, spec, result, timeline)
        finally:
            write_timeline(args.timeline, timeline)
    if args.engine == "ray":
        from kdcache.cache_builder.ray_engine import run_ray
        return report(args, log, spec, run_ray(args, log, path, spec, result, t0))
    if args.scratch:
        from kdcache.cache_builder.fleet import run_local
        return report(args, log, spec, run_local(args, log, path, spec, result, t0))
    if args.shards > 1:
        return run_shards(args, log, path, spec, result, t0,
                          lambda i: fill(args, log, (i, args.shards), path, spec, dataset, augment, topt,
                                         dict(result, shard=f"{i}/{args.shards}"), t0, None))
    return report(args, log, spec, fill(args, log, shard, path, spec, dataset, augment, topt, result, t0,
                                        timeline))


# The --hold line names a path and a fingerprint: longer than this is not the trainer's line.
HOLD_LINE_MAX = 65536


def await_cache(log, spec, stream=None):
    """--hold: the cache's name, from one JSON line on stdin; None at end of input (the trainer
    found the cache complete, or another producer filling it, or is gone)."""
    log.info("loaded; waiting for the trainer to name the cache")
    from kdcache import signals
    with signals.interruptible():  # a stop while waiting: nothing is open yet
        line = (stream or sys.stdin).readline(HOLD_LINE_MAX + 1)
    if not line.strip():
        log.info("the trainer needs no producer: nothing written")
        return None
    want = '{"cache": PATH, "fingerprint": FP}'
    if len(line) > HOLD_LINE_MAX:
        raise ProducerError(f"--hold: stdin gave a line longer than {HOLD_LINE_MAX} characters, not one JSON line "
                            f"{want}; nothing written")
    try:
        go = json.loads(line)  # a deeply nested line raises RecursionError: refused like any other
        path, fingerprint = go["cache"], go["fingerprint"]
        if not (isinstance(path, str) and path and isinstance(fingerprint, str)):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise ProducerError(f"--hold: stdin gave {line.strip()[:100]!r}, not one JSON line {want}; "
                            f"nothing written") from None
    if fingerprint != spec.fingerprint:
        raise ProducerError(f"--hold: the trainer names cache {fingerprint}, these options give {spec.fingerprint}: "
                            f"the two disagree on the teacher, the data set or the shared options; nothing written")
    from kdcache.store.files.paths import base_path
    return base_path(path)  # P, P.h5 or P.parts name the same cache: its base, as `fill` takes it


def report(args, log, spec, result):
    log.info("%s: %s (fingerprint %s); %d rows written, teacher ran on %d samples",
             "complete" if result["complete"] else "in progress", result["cache_path"], spec.fingerprint,
             result["rows_written"], result["teacher_forwards"])
    print(result["cache_path"])
    emit(args, result)
    return 0


def emit(args, result):
    """The result as one JSON line (--json) and as a file (--result) the parent process reads."""
    if args.json:
        print(json.dumps(result), flush=True)
    if args.result:
        from kdcache.store.osutil import write_json_atomic
        write_json_atomic(args.result, result, fsync=False)  # read by the parent once this process ends


def run_shards(args, log, path, spec, result, t0, fill_shard):
    """Fork one producer per shard after the data set is loaded once; gather their results.

    A shard that fails or dies stops the others at once (SIGINT: each commits what it wrote and
    leaves), so a trainer reading behind them gets a clear error instead of waiting for rows
    that no shard will write; running the same command again resumes every shard. A stop of the
    command (Ctrl-C, SIGTERM) stops every shard the same way before the command leaves."""
    from kdcache import signals
    from kdcache.pipeline.child_setup import die_with_parent
    parent = os.getpid()
    children = {}
    results, errors, stopped, signalled = [], [], False, set()

    def stop_others():
        for other in set(children) - signalled:  # once each: SIGINT is taken at the shard's next safe point
            signalled.add(other)
            try:
                os.kill(other, signal.SIGINT)
            except ProcessLookupError:
                pass

    try:
        for i in range(args.shards):
            signals.check()  # a stop before every shard has started: none more is started
            r, w = os.pipe()
            pid = os.fork()
            if pid == 0:  # the shard: fill, hand the result back, leave without the parent's clean-up
                os.close(r)
                die_with_parent(parent)
                code = 0
                try:
                    out = fill_shard(i)
                except KeyboardInterrupt as e:
                    out, code = {"error": "interrupted"}, exit_status(e)
                except KdcacheError as e:  # reported by the parent as one line
                    out, code = {"error": str(e)}, USER_ERROR
                except Exception as e:  # a bug: its traceback here, the parent says so
                    bug(e)
                    out, code = {"error": f"{type(e).__name__}: {e}", "bug": True}, BUG
                try:
                    with os.fdopen(w, "w") as fh:
                        json.dump(out, fh)
                except OSError:  # the command is gone (kill -9): nobody reads the result
                    pass
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
            os.close(w)
            children[pid] = (i, r)
        while children:
            with signals.interruptible():  # a stop while the shards work: passed on to them below
                pid, status = os.wait()
            if pid not in children:
                continue
            i, r = children.pop(pid)
            with os.fdopen(r) as fh:
                raw = fh.read()
            if raw:
                out = json.loads(raw)
            elif os.WIFSIGNALED(status):
                out = {"error": f"killed by signal {os.WTERMSIG(status)} ({signal.Signals(os.WTERMSIG(status)).name})"}
            else:
                out = {"error": f"died with status {os.waitstatus_to_exitcode(status)}"}
            if "error" in out:
                if stopped and out["error"] == "interrupted":
                    out["stopped"] = True
                elif not stopped:
                    stopped = True
                    log.error("shard %d/%d: %s; stopping the other shards (their rows are kept)", i, args.shards,
                              out["error"])
                stop_others()
                errors.append((i, out))
            else:
                results.append((i, out))
    except KeyboardInterrupt:
        stop_others()
        for pid, (i, r) in children.items():  # each commits what it wrote and leaves; then this command
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            os.close(r)
        raise
    if errors:
        first = [(i, o) for i, o in errors if not o.get("stopped")]
        rest = [i for i, o in errors if o.get("stopped")]
        crashed = any(o.get("bug") for _, o in first)  # a bug in a shard is one in this command (its traceback above)
        raise (RuntimeError if crashed else ProducerError)(
            "; ".join(f"shard {i}/{args.shards}: {o['error']}" for i, o in first)
            + (f" (shard(s) {', '.join(map(str, sorted(rest)))} stopped with it)" if rest else "")
            + ": every row written so far is kept; run the same command again to finish the cache")
    from kdcache.store.folder.registry import final_path
    complete = os.path.exists(final_path(path))
    result.update(shard=f"0..{args.shards - 1}/{args.shards}", complete=complete,
                  cache_path=final_path(path) if complete else path + ".parts",
                  rows_written=sum(o["rows_written"] for _, o in results),
                  teacher_forwards=sum(o["teacher_forwards"] for _, o in results),
                  reused=all(o["reused"] for _, o in results),
                  rows_per_s=round(sum(o.get("rows_per_s", 0) for _, o in results), 1),
                  seconds=round(time.perf_counter() - t0, 3), shards=[o for _, o in sorted(results)])
    return report(args, log, spec, result)


def decode_workers(args, log, dataset):
    """--decode-workers, or its default for this data set and the cores the teachers leave (logged)."""
    from kdcache.pipeline.decode_workers import default_workers
    n = args.decode_workers
    if n is None:
        n = default_workers(dataset, getattr(args, "teacher_threads", 1), getattr(args, "cores", 1),
                            producers=args.shards)
    log.info("images made %s", f"by {n} decode worker process(es), ahead of the teacher" if n
             else "in this process, one batch at a time")
    return n


def fill(args, log, shard, path, spec, dataset, augment, topt, result, t0, timeline, teacher=None):
    """Fill this shard of the cache (offline or following the schedule); returns the result dict.
    `teacher`: already loaded and checked against the data (--hold), else loaded here when needed."""
    from kdcache.cache_builder.produce import CacheSink, produce_offline, produce_online
    from kdcache.pipeline.schedule import EpochDigests
    from kdcache.pipeline.teacher import check_fits, load_teacher
    from kdcache.store import CacheWriter, FingerprintMismatchError
    from kdcache.store.folder.registry import final_path
    args_shard = f"{shard[0]}/{shard[1]}"
    if teacher is None and not os.path.exists(final_path(path)):
        # The teacher must fit the data before anything is written: a mistake leaves no cache behind.
        teacher = load_teacher(topt, args.batch_size)
        check_fits(teacher, dataset, augment, args.seed)
    try:
        writer = CacheWriter(path, spec, shard=shard)
    except FingerprintMismatchError as e:
        raise other_items(e, path, spec, dataset) from None
    try:
        if writer.complete or writer.remaining == 0:
            log.info("cache %s is already %s for this shard: reused, the teacher ran 0 times",
                     spec.fingerprint, "complete" if writer.complete else "filled")
            result["reused"] = True
        else:
            log.info("cache %s: %d of %d rows to compute (shard %s)", spec.fingerprint, writer.remaining,
                     spec.num_keys, args_shard)
            if args.online:
                digests = EpochDigests(len(dataset), args.batch_size)
                stats = produce_online(teacher, dataset, CacheSink(writer), seed=args.seed, augment=augment,
                                       batch_size=args.batch_size, epochs=args.epochs, progress=not args.quiet,
                                       timeline=timeline, digests=digests,
                                       decode_workers=decode_workers(args, log, dataset))
                result["schedule_sha256"] = digests.complete()
            else:
                stats = produce_offline(teacher, dataset, writer, seed=args.seed, augment=augment,
                                        batch_size=args.batch_size, progress=not args.quiet,
                                        decode_workers=decode_workers(args, log, dataset))
            result.update(rows_written=stats.rows_written, teacher_forwards=teacher.forwards,
                          rows_per_s=round(stats.rows_per_s, 1), teacher_s=round(stats.teacher_seconds, 3),
                          demand_rows=stats.demand_rows)
    except BaseException:
        writer.abort()  # committed rows stay; nothing half-written is ever marked done
        raise
    finally:
        write_timeline(args.timeline, timeline)
    complete = writer.close()
    result.update(complete=bool(complete), seconds=round(time.perf_counter() - t0, 3),
                  cache_path=path + ".h5" if complete else path + ".parts")
    return result


def other_items(error, path, spec, dataset, block=256):
    """A cache at `path` (an explicit --cache) built for other inputs: when only the data set's content
    differs and that cache records its items (store.format.items), the error names the first item that differs."""
    import numpy as np
    from kdcache.pipeline.digests import item_records
    from kdcache.store import CacheReader, StoreError
    from kdcache.store.format.items import known
    try:
        with CacheReader(path, timeout=0) as other:
            theirs = dict(other.spec.inputs)
            if {k: v for k, v in theirs.items() if k != "dataset"} != \
                    {k: v for k, v in spec.inputs.items() if k != "dataset"}:
                return error  # another teacher, codec or option: the fingerprints say so
            if other.spec.num_samples != spec.num_samples:
                return error
            for a in range(0, spec.num_samples, block):
                idx = np.arange(a, min(spec.num_samples, a + block))
                rec = other.items(idx)
                if not known(rec).any():
                    continue
                mine = item_records(*dataset.get_batch(idx))
                differ = known(rec) & ((mine["digest"] != rec["digest"]).any(axis=1) | (mine["label"] != rec["label"]))
                if differ.any():
                    j = int(np.flatnonzero(differ)[0])
                    what = [w for w, same in (("image", (mine["digest"][j] == rec["digest"][j]).all()),
                                              (f"label ({int(mine['label'][j])} here, {int(rec['label'][j])} in the "
                                               f"cache)", mine["label"][j] == rec["label"][j])) if not same]
                    return StoreError(f"{path} was built from another data set of the same length: item {a + j} "
                                      f"(the first that differs) has another {' and '.join(what)}: pass the data set "
                                      f"it was built from, or another cache path (--cache, build_cache's cache=), "
                                      f"or none: the cache directory names each data set's cache by its content")
    except StoreError:
        pass
    return error


def run_ring(args, log, topt, dataset, augment, spec, result, timeline):
    """Stream the schedule's targets into a shared-memory ring (the trainer reads and frees them)."""
    from kdcache.cache_builder.produce import RingSink, produce_online
    from kdcache.pipeline.teacher import check_fits, load_teacher
    from kdcache.store.ring import RingWriter
    create = args.ring_capacity is not None
    timeout = ring_timeout()
    if not create:
        log.info("attaching to ring %s: waiting up to %g s for the trainer to create it (--ring-capacity ROWS "
                 "creates it here instead)", args.ring, timeout)
    ring = RingWriter(args.ring, create=create, capacity=args.ring_capacity, num_classes=spec.num_classes,
                      codec=spec.codec, dtype=spec.dtype, timeout=timeout,
                      fingerprint=spec.fingerprint, seed=args.seed)
    log.info("%s ring %s (%d rows): streaming %d epoch(s) of the schedule", "created" if create else "attached to",
             ring.name, ring.capacity, args.epochs)
    ok = False
    try:
        # Loaded once attached: the trainer's ring has both sides then, and a teacher that fails
        # closes it as failed, which the trainer reports at once.
        teacher = load_teacher(topt, args.batch_size)
        check_fits(teacher, dataset, augment, args.seed)
        stats = produce_online(teacher, dataset, RingSink(ring, spec), seed=args.seed, augment=augment,
                               batch_size=args.batch_size, epochs=args.epochs, progress=not args.quiet,
                               timeline=timeline, decode_workers=decode_workers(args, log, dataset))
        ok = True
    finally:
        ring.close(finished=ok)
    result.update(cache_path=None, ring=ring.name, rows_written=stats.rows_written, teacher_forwards=teacher.forwards,
                  rows_per_s=round(stats.rows_per_s, 1), complete=True)
    log.info("ring %s: streamed %d rows", ring.name, stats.rows_written)
    print(ring.name)
    emit(args, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
