"""python -m trainer.launch: distributed student training on MXNet's kvstore, on this machine.

Starts a scheduler, a server and --workers workers with the real DMLC_* environment, each
worker running `python -m trainer --kvstore dist_sync ...` on its part of every batch and
reading its targets from the shared cache (worker 0 starts the producer when one is needed).
A process that dies ends the whole run with a clear error instead of leaving the others
blocked in the kvstore. Across hosts, start the same processes by hand: see the README.
"""
import argparse
import functools
import os
import signal
import socket
import subprocess
import sys
import time

from pipeline.children import die_with_parent

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m trainer.launch", description=__doc__.split("\n\n")[0],
                                epilog="Everything after the launcher's options is passed to each worker's "
                                       "python -m trainer (e.g. --student mlp --epochs 5 --run NAME).")
    p.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    p.add_argument("--servers", type=int, default=1, help="kvstore server processes (default 1)")
    p.add_argument("--kvstore", default="dist_sync", choices=["dist_sync", "dist_async"])
    p.add_argument("--port", type=int, help="scheduler port (default: a free one)")
    p.add_argument("--threads", type=int, help="compute threads per worker (default: cores / workers)")
    args, rest = p.parse_known_args(argv)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if args.workers < 1 or args.servers < 1:
        print("error: --workers and --servers must be at least 1", file=sys.stderr)
        return 2
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cores // args.workers)
    port = args.port or free_port()
    base = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
            "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(args.workers),
            "OMP_NUM_THREADS": "1", "MXNET_SUBGRAPH_VERBOSE": "0", "PS_VERBOSE": "0"}
    procs = []

    def spawn(role, cmd, extra=None):
        env = {**base, "DMLC_ROLE": role, **(extra or {})}
        proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), start_new_session=False,
                                preexec_fn=functools.partial(die_with_parent, os.getpid()))
        procs.append((role, proc))
        return proc

    # Importing MXNet with DMLC_ROLE=scheduler/server runs that role until the job ends.
    ps = [sys.executable, "-c", "import mxnet"]
    spawn("scheduler", ps)
    for _ in range(args.servers):
        spawn("server", ps)
    workers = []
    for i in range(args.workers):
        cmd = [sys.executable, "-m", "trainer", "--kvstore", args.kvstore, "--threads", str(threads), *rest]
        workers.append(spawn("worker", cmd, {"OMP_NUM_THREADS": str(threads)}))
    print(f"[launch] scheduler on 127.0.0.1:{port}, {args.servers} server(s), {args.workers} worker(s) "
          f"({args.kvstore}, {threads} thread(s) each)", flush=True)

    def stop_all(sig=signal.SIGTERM):
        for _, pr in procs:
            if pr.poll() is None:
                try:
                    pr.send_signal(sig)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for _, pr in procs:
            try:
                pr.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pr.kill()
                pr.wait()

    try:
        while True:
            codes = [w.poll() for w in workers]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            dead_ps = [(r, pr.returncode) for r, pr in procs if r != "worker" and pr.poll() not in (None, 0)]
            if failed or dead_ps:
                what = ", ".join([f"worker {i} exited with status {c}" for i, c in failed] +
                                 [f"{r} exited with status {c}" for r, c in dead_ps])
                stop_all()
                print(f"error: {what}; the other processes were stopped (a dist_sync job cannot go on without "
                      f"every worker). Fix the cause and run again (--resume --run NAME continues from the last "
                      f"finished epoch)", file=sys.stderr)
                return 2
            if all(c == 0 for c in codes):
                break
            time.sleep(0.2)
    except KeyboardInterrupt:
        stop_all(signal.SIGINT)
        print("interrupted: every process was stopped", file=sys.stderr)
        return 130
    stop_all()
    print(f"[launch] {args.workers} worker(s) finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
