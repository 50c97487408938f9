"""python -m cache_builder: run a frozen teacher on the CPU and fill the soft-target cache."""
import argparse
import json
import logging
import os
import signal
import sys
import time

DESCRIPTION = """\
Run a frozen MXNet teacher forward on the CPU over a data set and store its raw logits
(temperature 1) in a cache named by the fingerprint of the teacher, the data, the views and the
codec. A complete cache with the same fingerprint is reused: the teacher then runs zero times.
Offline (default) fills every (sample, view); --online follows the training schedule (the same
--seed/--epochs/--batch-size/--views as the trainer) so targets arrive in the order training
reads them. Interrupted runs (Ctrl-C, kill -9) resume where they stopped."""


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m cache_builder", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("teacher")
    g.add_argument("--teacher", required=True, metavar="PREFIX[:EPOCH]",
                   help="MXNet checkpoint: PREFIX-symbol.json + PREFIX-NNNN.params (latest epoch if none)")
    g.add_argument("--teacher-input", metavar="NAME", help="the teacher's image input (found when there is one)")
    g.add_argument("--teacher-mean", metavar="M[,M,M]", help="per-channel mean subtracted from [0,1] images")
    g.add_argument("--teacher-std", metavar="S[,S,S]", help="per-channel std the images are divided by")
    g.add_argument("--teacher-size", metavar="HxW", help="resize images to this size for the teacher")
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="digits",
                   help="digits (default, embedded) | synthetic[:n=..,classes=..,shape=CxHxW,seed=..] | mnist | "
                        "fashion-mnist | cifar10 | cifar100 | npz | recordio | imagefolder")
    g.add_argument("--data-root", metavar="PATH", help="local files of the data set (nothing is downloaded)")
    g.add_argument("--split", default="train", choices=["train", "test"])
    g.add_argument("--image-size", metavar="HxW", help="resize decoded images (recordio, imagefolder)")
    g.add_argument("--num-classes", type=int, help="class count when the files do not say (npz, recordio)")
    g.add_argument("--views", type=int, default=1, help="augmented views per sample; epoch e uses view e mod V (default 1)")
    g.add_argument("--augment", default="auto",
                   help="none | crop:PAD | flip | crop:PAD,flip; auto = none for 1 view, else the data set's usual")
    g.add_argument("--seed", type=int, default=0, help="seed of the schedule and of the augmentation (default 0)")
    g = p.add_argument_group("cache")
    g.add_argument("--cache-dir", help="cache directory (default: $KDCACHE_DIR, else ./caches)")
    g.add_argument("--cache", metavar="PATH", help="explicit cache path instead of <cache-dir>/<fingerprint>")
    g.add_argument("--codec", default="full", help="full (raw logits) | topk:K (default full)")
    g.add_argument("--dtype", default="float16", choices=["float16", "float32"], help="storage type (default float16)")
    g = p.add_argument_group("producing")
    g.add_argument("--online", action="store_true", help="follow the training schedule instead of key order")
    g.add_argument("--epochs", type=int, default=1, help="epochs of the schedule to follow with --online (default 1)")
    g.add_argument("--batch-size", type=int, default=128, help="teacher batch = training batch (default 128)")
    g.add_argument("--threads", type=int, help="teacher compute threads (default: all cores but one, left to the trainer)")
    g.add_argument("--shard", default="0/1", metavar="i/n", help="fill only keys with key mod n = i (n producers)")
    g.add_argument("--shards", type=int, default=1, metavar="N",
                   help="fork N shard producers after loading the data set once (each --threads, default "
                        "cores/N); the same as N commands with --shard 0/N .. N-1/N, minus N-1 start-ups")
    g.add_argument("--ring", metavar="NAME", help="stream to the shared-memory ring NAME instead of a cache file "
                   "(pure streaming: keys are (sample, epoch), nothing is persisted; implies --online)")
    g.add_argument("--ring-capacity", type=int, metavar="ROWS",
                   help="create the ring with this many rows (default: attach to the ring the trainer made)")
    p.add_argument("--timeline", metavar="FILE", help="with --online/--ring: write (time, schedule position, rows) "
                   "per step to FILE as JSON when done")
    p.add_argument("--json", action="store_true", help="end with one JSON line: cache_path, fingerprint, rows_written, ...")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def _shard(s):
    try:
        i, n = (int(v) for v in s.split("/"))
    except ValueError:
        raise ValueError(f"--shard {s!r}: use i/n, e.g. 0/2") from None
    return i, n


def main(argv=None):
    args = parse_args(argv)
    # Threads must be fixed before MXNet is imported: only OMP_NUM_THREADS limits its compute.
    from cache_builder.produce import default_threads
    default, cores = default_threads()
    if args.shards > 1:
        default = max(1, cores // args.shards)
    threads = args.threads or int(os.environ.get("KDCACHE_TEACHER_THREADS", 0)) or default
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    logging.basicConfig(level=logging.INFO, format="[producer %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    log = logging.getLogger("kdcache.producer")
    log.info("teacher uses %d thread(s) of %d core(s); %d left to the trainer (OMP_NUM_THREADS=%d)",
             threads, cores, max(0, cores - threads), threads)
    from store import StoreError
    from pipeline.datasets import DatasetError
    from pipeline.cachespec import TeacherError
    try:
        return run(args, log)
    except (StoreError, DatasetError, TeacherError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        if isinstance(e, StoreError):
            # After a failed write (full disk) HDF5's own clean-up at interpreter exit can crash;
            # every committed row is on disk already, so leave without it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(2)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every row written so far is kept; run the same command again to resume",
              file=sys.stderr)
        return 130


def write_timeline(path, timeline):
    if path and timeline is not None:
        with open(path + ".tmp", "w") as fh:
            json.dump({"columns": ["time", "position", "rows"], "steps": timeline}, fh)
        os.replace(path + ".tmp", path)


def run(args, log):
    from pipeline.cachespec import TeacherOptions, spec_from_args
    from pipeline.datasets import load_dataset
    from store import path_for

    if args.batch_size < 1 or args.views < 1 or args.epochs < 1:
        raise ValueError("--batch-size, --views and --epochs must be at least 1")
    shard = _shard(args.shard)
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
              "teacher_forwards": 0, "reused": False, "complete": False, "shard": args.shard}
    timeline = [] if args.timeline else None
    if args.ring:
        if args.shards > 1 or args.shard != "0/1":
            raise ValueError("--ring streams from one producer: drop --shard/--shards")
        try:
            return run_ring(args, log, topt, dataset, augment, spec, result, timeline)
        finally:
            write_timeline(args.timeline, timeline)
    if args.shards < 1:
        raise ValueError("--shards must be at least 1")
    if args.shards > 1:
        return run_shards(args, log, path, spec, result, t0,
                          lambda i: fill(args, log, (i, args.shards), path, spec, dataset, augment, topt,
                                         dict(result, shard=f"{i}/{args.shards}"), t0, None))
    return report(args, log, spec, fill(args, log, shard, path, spec, dataset, augment, topt, result, t0,
                                        timeline))


def report(args, log, spec, result):
    log.info("%s: %s (fingerprint %s); %d rows written, teacher ran on %d samples",
             "complete" if result["complete"] else "in progress", result["cache_path"], spec.fingerprint,
             result["rows_written"], result["teacher_forwards"])
    print(result["cache_path"])
    if args.json:
        print(json.dumps(result))
    return 0


def run_shards(args, log, path, spec, result, t0, fill_shard):
    """Fork one producer per shard after the data set is loaded once; gather their results.

    A shard that fails or dies stops the others at once (SIGINT: each commits what it wrote and
    leaves), so a trainer reading behind them gets a clear error instead of waiting for rows
    that no shard will write; running the same command again resumes every shard."""
    if args.shard != "0/1":
        raise ValueError("--shards N forks shards 0/N .. N-1/N itself: drop --shard")
    from pipeline.children import die_with_parent
    parent = os.getpid()
    children = {}
    for i in range(args.shards):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the shard: fill, hand the result back, leave without the parent's clean-up
            os.close(r)
            die_with_parent(parent)
            code = 0
            try:
                out = fill_shard(i)
            except KeyboardInterrupt:
                out, code = {"error": "interrupted"}, 130
            except Exception as e:  # reported by the parent as one line
                out, code = {"error": str(e)}, 2
            with os.fdopen(w, "w") as fh:
                json.dump(out, fh)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.close(w)
        children[pid] = (i, r)
    results, errors, stopped, signalled = [], [], False, set()
    while children:
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
            for other in set(children) - signalled:  # once each: a second SIGINT could cut its clean-up short
                signalled.add(other)
                try:
                    os.kill(other, signal.SIGINT)
                except ProcessLookupError:
                    pass
            errors.append((i, out))
        else:
            results.append((i, out))
    if errors:
        first = [(i, o) for i, o in errors if not o.get("stopped")]
        rest = [i for i, o in errors if o.get("stopped")]
        raise ValueError("; ".join(f"shard {i}/{args.shards}: {o['error']}" for i, o in first)
                         + (f" (shard(s) {', '.join(map(str, sorted(rest)))} stopped with it)" if rest else "")
                         + ": every row written so far is kept; run the same command again to finish the cache")
    from store.registry import final_path
    complete = os.path.exists(final_path(path))
    result.update(shard=f"0..{args.shards - 1}/{args.shards}", complete=complete,
                  cache_path=final_path(path) if complete else path + ".parts",
                  rows_written=sum(o["rows_written"] for _, o in results),
                  teacher_forwards=sum(o["teacher_forwards"] for _, o in results),
                  reused=all(o["reused"] for _, o in results),
                  rows_per_s=round(sum(o.get("rows_per_s", 0) for _, o in results), 1),
                  seconds=round(time.perf_counter() - t0, 3), shards=[o for _, o in sorted(results)])
    return report(args, log, spec, result)


def fill(args, log, shard, path, spec, dataset, augment, topt, result, t0, timeline):
    """Fill this shard of the cache (offline or following the schedule); returns the result dict."""
    from cache_builder.produce import CacheSink, produce_offline, produce_online
    from store import CacheWriter
    args_shard = f"{shard[0]}/{shard[1]}"
    writer = CacheWriter(path, spec, shard=shard)
    try:
        if writer.complete or writer.remaining == 0:
            log.info("cache %s is already %s for this shard: reused, the teacher ran 0 times",
                     spec.fingerprint, "complete" if writer.complete else "filled")
            result["reused"] = True
        else:
            log.info("cache %s: %d of %d rows to compute (shard %s)", spec.fingerprint, writer.remaining,
                     spec.num_keys, args_shard)
            teacher = topt.load(args.batch_size)
            check_classes(teacher, dataset)
            if args.online:
                stats = produce_online(teacher, dataset, CacheSink(writer), seed=args.seed, augment=augment,
                                       batch_size=args.batch_size, epochs=args.epochs, progress=not args.quiet,
                                       timeline=timeline)
            else:
                stats = produce_offline(teacher, dataset, writer, seed=args.seed, augment=augment,
                                        batch_size=args.batch_size, progress=not args.quiet)
            result.update(rows_written=stats.rows_written, teacher_forwards=teacher.forwards,
                          rows_per_s=round(stats.rows_per_s, 1), teacher_s=round(stats.teacher_seconds, 3))
    except BaseException:
        writer.abort()  # committed rows stay; nothing half-written is ever marked done
        raise
    finally:
        write_timeline(args.timeline, timeline)
    complete = writer.close()
    result.update(complete=bool(complete), seconds=round(time.perf_counter() - t0, 3),
                  cache_path=path + ".h5" if complete else path + ".parts")
    return result


def check_classes(teacher, dataset):
    """Run two samples through the teacher: its output must be [batch, classes of the data set]."""
    from pipeline.cachespec import TeacherError
    x, _ = dataset.get_batch([0, min(1, len(dataset) - 1)])
    classes = teacher.forward(x).shape[1]
    teacher.forwards = 0
    if classes != dataset.num_classes:
        raise TeacherError(f"the teacher predicts {classes} classes, data set {dataset.name} has "
                           f"{dataset.num_classes}: pass the teacher trained for this data set (or --num-classes)")


def run_ring(args, log, topt, dataset, augment, spec, result, timeline):
    """Stream the schedule's targets into a shared-memory ring (the trainer reads and frees them)."""
    from cache_builder.produce import RingSink, produce_online
    from store.ring import RingWriter
    create = args.ring_capacity is not None
    ring = RingWriter(args.ring, create=create, capacity=args.ring_capacity, num_classes=spec.num_classes,
                      codec=spec.codec, dtype=spec.dtype, timeout=float(os.environ.get("KDCACHE_RING_TIMEOUT", 600)),
                      fingerprint=spec.fingerprint)
    log.info("%s ring %s (%d rows): streaming %d epoch(s) of the schedule", "created" if create else "attached to",
             ring.name, ring.capacity, args.epochs)
    ok = False
    try:
        teacher = topt.load(args.batch_size)
        check_classes(teacher, dataset)
        stats = produce_online(teacher, dataset, RingSink(ring, spec), seed=args.seed, augment=augment,
                               batch_size=args.batch_size, epochs=args.epochs, progress=not args.quiet,
                               timeline=timeline)
        ok = True
    finally:
        ring.close(finished=ok)
    result.update(cache_path=None, ring=ring.name, rows_written=stats.rows_written, teacher_forwards=teacher.forwards,
                  rows_per_s=round(stats.rows_per_s, 1), complete=True)
    log.info("ring %s: streamed %d rows", ring.name, stats.rows_written)
    print(ring.name)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
