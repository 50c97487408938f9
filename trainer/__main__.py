"""python -m trainer: train a student on cached soft targets (or inline KD, or hard labels)."""
import json
import logging
import os
import sys


def cache_complete(args):
    """Whether the cache these options name is already complete (then no producer will run).
    Decided without MXNet for array data sets; False when that cannot be known cheaply."""
    if args.store != "cache":
        return False
    try:
        import os.path
        from pipeline.cachespec import TeacherOptions, spec_from_args
        from store import path_for, registry
        from trainer.targets import load_train
        from trainer.options import DEFAULT_TEACHER
        if args.dataset.split(":")[0] in ("recordio", "imagefolder"):
            return False  # decoding them loads MXNet: keep the split
        train = load_train(args)
        spec, _ = spec_from_args(args, train, TeacherOptions.from_args(args, args.teacher or DEFAULT_TEACHER))
        base = registry.base_path(args.cache) if args.cache != "auto" else path_for(args.cache_dir, spec.fingerprint)
        return os.path.exists(registry.final_path(base))
    except Exception:
        return False  # the run itself reports what is wrong


def split_threads(args, cores):
    """Trainer threads: all cores when no producer runs beside it (no teacher, inline, a complete
    cache, --no-producer), else the cores the producer leaves."""
    if args.threads:
        return args.threads
    if args.teacher_mode != "cache" or args.no_producer or cache_complete(args):
        return cores
    return max(1, cores - (args.producer_threads or 1))


def summary(m):
    rows = [("teacher test accuracy", "-" if m["teacher_test_acc"] is None else f"{m['teacher_test_acc']:.4f}"),
            ("student test accuracy", f"{m['test_acc']:.4f}" if m["test_acc"] is not None else "-"),
            ("samples/s (training)", f"{m['samples_per_s']}"),
            ("stall (waiting for targets/data)", f"{m['stall_s']:.2f} s"),
            ("teacher forwards (training)", f"{m['teacher_forwards']}"),
            ("teacher mode", f"{m['teacher_mode']}" + (f" ({m['store']})" if m["store"] else "")),
            ("cache", m["cache_path"] or "-"), ("fingerprint", m["fingerprint"] or "-"),
            ("wall time", f"{m['wall_s']:.1f} s")]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def main(argv=None):
    from trainer.options import build_parser
    args = build_parser().parse_args(argv)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = split_threads(args, cores)
    # Fixed before MXNet loads: only OMP_NUM_THREADS limits its compute threads, and a trainer
    # and a producer that both use every core run several times slower.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    os.environ.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    logging.basicConfig(level=logging.INFO, format="[trainer %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    from pipeline.cachespec import TeacherError
    from pipeline.datasets import DatasetError
    from store import StoreError
    from trainer.targets import TrainError, start_early
    early = None
    try:
        # The producer starts now, before this process imports MXNet: its start-up overlaps ours.
        early = args.early = start_early(args, cores, threads)
        from trainer.train import run
        m, run_dir = run(args, threads, cores)
    except (TrainError, StoreError, DatasetError, TeacherError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last finished epoch is checkpointed; continue with --resume --run NAME",
              file=sys.stderr)
        return 130
    finally:
        if early is not None:
            early.close()
    print(f"\nrun {m['run']} finished:\n{summary(m)}\nmetrics: {os.path.join(run_dir, 'metrics.json')}")
    if args.json:
        print(json.dumps({k: v for k, v in m.items() if k != "history"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
