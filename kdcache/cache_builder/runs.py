"""The producer's runs: offline or online into a cache, forked shards, parts (fleet, Ray), a ring, and the
--hold handshake with the trainer; each ends in one report (a line, --json, --result)."""
import json
import os
import signal
import sys
import time

from kdcache.cache_builder.errors import ProducerError
from kdcache.cache_builder.options import ring_timeout
from kdcache.errors import BUG, USER_ERROR, KdcacheError, bug
from kdcache.pipeline.interrupts import exit_status

def write_timeline(path, timeline):
    if path and timeline is not None:
        from kdcache.store.osutil import write_json_atomic
        # a diagnostic: not fsynced
        write_json_atomic(path, {"columns": ["time", "position", "rows"], "steps": timeline}, fsync=False)


def run(args, log):
    from kdcache.pipeline.cachespec import spec_from_args
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.pipeline.datasets import load_from_options
    from kdcache.store import path_for

    shard = tuple(args.shard)  # (index, count), as --shard parsed it
    topt = TeacherOptions.from_args(args)
    t0 = time.perf_counter()
    dataset = load_from_options(args, args.split)
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
