"""`kdcache train` (python -m kdcache.trainer): the trainer's entry point: checks, threads, the early producer,
the plan, then train.run (or inline KD, or hard labels); errors end it as every command ends (kdcache.errors)."""
import json
import logging
import os
import sys
import time
import traceback

from kdcache.errors import as_command
from kdcache.trainer.errors import TrainError


def recipe_line(r):
    """The optimiser and its schedule in one line: sgd lr 0.1 momentum 0.9 wd 0.0001, cosine, warm-up 1 epoch(s)."""
    if not r:
        return "-"
    mode = r["lr_mode"] + (f" at epochs {','.join(map(str, r['lr_steps']))} x{r['lr_factor']:g}" if r["lr_steps"] else "")
    return (f"{r['optimizer']} lr {r['lr']:g}" + (f" momentum {r['momentum']:g}" if r["momentum"] is not None else "") +
            f" wd {r['wd']:g}, {mode}, warm-up {r['warmup_epochs']} epoch(s), validation {r['val_items']} items")


def summary(m):
    rows = [("teacher test accuracy", "-" if m["teacher_test_acc"] is None else f"{m['teacher_test_acc']:.4f}"),
            ("student test accuracy", f"{m['test_acc']:.4f}" if m["test_acc"] is not None else "-"),
            ("samples/s (training)", f"{m['samples_per_s']}"),
            ("stall (waiting for targets/data)", f"{m['stall_s']:.2f} s"),
            ("teacher forwards (training)", f"{m['teacher_forwards']}"),
            ("teacher mode", f"{m['teacher_mode']}" + (f" ({m['store']})" if m["store"] else "")),
            ("student", f"{m['student']}, T {m['temperature']:g}, alpha {m['alpha']:g}, batch size "
                        f"{m.get('batch_size', '-')}"),
            ("cache", m["cache_path"] or "-"), ("fingerprint", m["fingerprint"] or "-"),
            ("recipe", recipe_line(m.get("recipe"))),
            ("best epoch (validation top-1)", "-" if m.get("best_epoch") is None else
             f"{m['best_epoch']} ({m['best_val_top1']:.4f}): {m['best_checkpoint']}"),
            ("wall time", f"{m['wall_s']:.1f} s")]
    w = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def main(argv=None, prog="python -m kdcache.trainer"):
    if os.environ.get("DMLC_ROLE") != "worker":
        return train_main(argv, prog)
    # A distributed worker: MXNet's kvstore, destroyed at exit, waits at a barrier for every worker, so a
    # worker that ended on an error would wait there for ever (and its job with it). It leaves without
    # running destructors instead, and its launcher stops the others.
    try:
        code = train_main(argv, prog)
    except SystemExit as e:  # argparse's errors
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    if code:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


@as_command  # a KdcacheError is one line and exit 2; anything else shows as the bug it is
def train_main(argv=None, prog="python -m kdcache.trainer"):
    from kdcache.trainer.options import parse_args
    args = parse_args(argv, prog)
    args.run_name = args.run or time.strftime("%Y%m%d-%H%M%S")
    run_dir = os.path.join(args.runs_dir, args.run_name)
    if not (args.kvstore or "").startswith("dist"):  # a worker checks its own folder once it knows its rank
        if os.path.exists(os.path.join(run_dir, "state.json")) and not args.resume:
            raise TrainError(f"argument --run: run {run_dir} exists: pass --resume to continue it or another "
                             f"--run name")
        if args.resume and not os.path.exists(os.path.join(run_dir, "state.json")):
            raise TrainError(f"argument --resume: {run_dir} has no checkpoint (state.json): run without --resume")
    if not (args.kvstore or "").startswith("dist"):  # a distributed worker blocks in the kvstore: SIGTERM ends it
        from kdcache.pipeline.interrupts import take_sigterm
        take_sigterm()
    from kdcache import signals
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    logging.basicConfig(level=logging.INFO, format="[trainer %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    from kdcache.trainer.options import sampled_warning
    note = sampled_warning(args.codec, args.temperature) if args.teacher_mode == "cache" and not args.ensemble \
        else None
    if note:
        logging.getLogger("kdcache.trainer").warning(note)
    from kdcache.trainer.run_plan import MXNET_DATASETS, make_plan
    from kdcache.trainer.targets import Targets, split_threads
    from kdcache.threads import fix_threads
    targets = state = None
    try:
        if args.resume and not (args.kvstore or "").startswith("dist"):
            # A resumed run is the run it was: its options are compared now, before any process starts,
            # and what they name once the plan is made, before a producer writes into the run's folder.
            from kdcache.trainer import resume
            state = resume.check(run_dir, args)
        # The producer starts first, before this process loads its data or imports MXNet: its own
        # start-up (MXNet, data, teacher) overlaps ours. Into a cache it waits for the plan to name it.
        signals.check()  # a stop during the start so far: before any process is started
        targets = Targets() if state is not None else \
            Targets.start(args, run_dir, split_threads(args, cores, None), cores)
        # The data, the teacher's identity and the cache's fingerprint, once; for data sets MXNet
        # decodes, after the threads are fixed.
        from kdcache.pipeline.user_code import is_piece  # a user's MODULE may import MXNet: after the threads too
        mxnet_data = args.dataset.split(":")[0] in MXNET_DATASETS or is_piece(args.dataset)
        plan = None if mxnet_data else make_plan(args)
        threads = split_threads(args, cores, plan)
        # Fixed before MXNet loads: only OMP_NUM_THREADS limits its compute threads, and a trainer
        # and a producer that both use every core run several times slower.
        fix_threads(threads)
        if args.ctx.kind == "gpu":  # GPUs MXNet cannot see: say so before the producer writes
            from kdcache.trainer.train import resolve_ctx
            resolve_ctx(args.ctx)
        plan = plan or make_plan(args)
        if state is not None:
            resume.check_content(state, resume.identity(args, plan), run_dir)
            targets = Targets.start(args, run_dir, split_threads(args, cores, None), cores)
        signals.check()  # before a held producer is sent on
        targets.settle(args, plan)
        from kdcache.trainer.train import run
        m, run_dir = run(args, plan, targets, threads, cores)
    except KeyboardInterrupt as e:
        from kdcache.pipeline.interrupts import exit_status, stop_word
        print(f"{stop_word(e)}: the last finished epoch is checkpointed; continue with the same command and "
              f"--resume --run {args.run_name}", file=sys.stderr)
        return exit_status(e)
    finally:
        if targets is not None:
            targets.close()
    print(f"\nrun {m['run']} finished:\n{summary(m)}\nmetrics: {os.path.join(run_dir, 'metrics.json')}")
    if args.json:
        print(json.dumps({k: v for k, v in m.items() if k != "history"}))
    return 0

