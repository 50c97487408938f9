"""python -m kdcache.trainer.launch: distributed student training on MXNet's kvstore, on this machine.

Starts a scheduler, a server and --workers workers with the real DMLC_* environment, each
worker running `python -m kdcache.trainer --kvstore dist_sync ...` on its part of every batch and
reading its targets from the shared cache (worker 0 starts the producer when one is needed).
A process that dies ends the whole run with a clear error instead of leaving the others
blocked in the kvstore. Across hosts, start the same processes by hand: see the README.

Every kvstore process listens on --host only (default 127.0.0.1): ps-lite has no
authentication, so whoever reaches a server's or a worker's port can push into the parameters
or stop the job. ps-lite binds a server's and a worker's socket to DMLC_NODE_HOST, and without
it to the first non-loopback interface it finds; the scheduler binds to DMLC_PS_ROOT_URI.
"""
if __name__ == "__main__":  # first, before anything heavy is imported: signals at safe points only
    from kdcache import signals as _signals
    _signals.defer()
import functools
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time

from kdcache import signals
from kdcache.args import Allowed, Int, Option, Parser, add_options, fail
from kdcache.errors import BUG, USER_ERROR, as_command
from kdcache.pipeline.child_setup import before_exec

# The folder that holds the kdcache package: a checkout that is not installed finds it through this.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port(host="127.0.0.1"):
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class Address(Allowed):
    """An IPv4 address of this machine (127.0.0.1: this machine only)."""

    def __call__(self, s):
        s = str(s).strip()
        try:
            ip = ipaddress.ip_address(s)
        except ValueError:
            fail(f"{s!r} is not an IPv4 address: name an address of this machine, e.g. 127.0.0.1")
        if ip.version != 4 or ip.is_unspecified or ip.is_multicast:
            fail(f"{s!r}: name one IPv4 address of this machine (not 0.0.0.0, not IPv6): every process "
                 f"listens on it and tells the others to connect to it")
        with socket.socket() as sock:
            try:
                sock.bind((s, 0))
            except OSError as e:
                fail(f"{s} is not an address of this machine ({e.strerror})")
        return s


LAUNCHER = [
    Option("--workers", "worker processes", type=Int(1, 256), default=2, metavar="N", group="launch",
           make="WORKERS"),
    Option("--servers", "kvstore server processes", type=Int(1, 256), default=1, metavar="N", group="launch"),
    Option("--kvstore", "how the workers combine their gradients", choices=("dist_sync", "dist_async"),
           default="dist_sync", group="launch"),
    Option("--port", "scheduler port (default: a free one)", type=Int(1024, 65535), metavar="PORT", group="launch"),
    Option("--threads", "compute threads per worker (default: cores / workers)", type=Int(1, 1024), metavar="N",
           group="launch"),
    Option("--host", "the address every kvstore process (scheduler, servers, workers) listens on; ps-lite has "
           "no authentication: whoever reaches these ports can change the parameters or stop the job, so "
           "use another address only on a trusted network", type=Address(), default="127.0.0.1",
           metavar="ADDRESS", group="launch"),
]


def parse_args(argv=None, prog="python -m kdcache.trainer.launch"):
    """The launcher's options, and the workers' trainer options after them, both checked here: a
    mistake in either ends the command with one line before any process starts."""
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0],
               epilog="Everything after the launcher's options (and an optional --) is passed to each worker's "
                      "trainer (e.g. -- --student mlp --epochs 5 --run NAME): see kdcache train --help.")
    add_options(p, LAUNCHER)
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        i = argv.index("--")
        args, rest = p.parse_args(argv[:i]), argv[i + 1:]
    else:
        args, rest = p.parse_known_args(argv)
    from kdcache.trainer.options import parse_args as trainer_args
    worker = trainer_args(rest, prog=f"{prog} -- (worker options)", launched=True)
    if worker.kvstore is not None or worker.threads is not None:
        p.error("the worker options set --kvstore or --threads: the launcher sets them for every worker; give them "
                "before --, as the launcher's own options")
    if worker.store == "ring":
        p.error("argument --store: distributed workers read a cache; drop --store ring")
    return args, rest


@as_command  # a KdcacheError is one line and exit 2; anything else shows as the bug it is
def main(argv=None, prog="python -m kdcache.trainer.launch"):
    args, rest = parse_args(argv, prog)
    cores = len(os.sched_getaffinity(0))
    threads = args.threads or max(1, cores // args.workers)
    port = args.port or free_port(args.host)
    base = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            # ps-lite (MXNet 1.9.1): the scheduler binds tcp://DMLC_PS_ROOT_URI:port; a server or a
            # worker binds tcp://DMLC_NODE_HOST:port, and without DMLC_NODE_HOST the address of
            # DMLC_INTERFACE, or else of the first non-loopback interface (the external one).
            # DMLC_USE_KUBERNETES=1 (inherited) would bind the scheduler to 0.0.0.0: off.
            "DMLC_PS_ROOT_URI": args.host, "DMLC_PS_ROOT_PORT": str(port), "DMLC_NODE_HOST": args.host,
            **({"DMLC_INTERFACE": "lo"} if ipaddress.ip_address(args.host).is_loopback else {}),
            "DMLC_USE_KUBERNETES": "0",
            "DMLC_NUM_SERVER": str(args.servers), "DMLC_NUM_WORKER": str(args.workers),
            "OMP_NUM_THREADS": "1", "MXNET_SUBGRAPH_VERBOSE": "0", "PS_VERBOSE": "0"}
    procs = []

    def spawn(role, cmd, extra=None):
        env = {**base, "DMLC_ROLE": role, **(extra or {})}
        proc = subprocess.Popen(cmd, env=env, cwd=os.getcwd(), start_new_session=False,
                                preexec_fn=functools.partial(before_exec, os.getpid()))
        procs.append((role, proc))
        return proc

    # Importing MXNet with DMLC_ROLE=scheduler/server runs that role until the job ends, in C: such a
    # process never runs Python again and holds nothing to save, so a signal ends it at once.
    ps = [sys.executable, "-c", "from kdcache import signals; signals.plain(); import mxnet"]
    workers = []

    def stop_all(sig=signal.SIGTERM):
        """The workers first (each stops at a safe point), then the scheduler and the servers they
        talk to; one that has not left after 10 s is killed."""
        for group, how in (([pr for r, pr in procs if r == "worker"], sig),
                           ([pr for r, pr in procs if r != "worker"], signal.SIGTERM)):
            for pr in group:
                if pr.poll() is None:
                    try:
                        pr.send_signal(how)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + 10
            for pr in group:
                try:
                    pr.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pr.kill()
                    pr.wait()

    try:
        signals.check()  # a stop during the start so far: no process is started
        spawn("scheduler", ps)
        for _ in range(args.servers):
            signals.check()
            spawn("server", ps)
        for i in range(args.workers):
            signals.check()
            cmd = [sys.executable, "-m", "kdcache.trainer", "--kvstore", args.kvstore, "--threads", str(threads), *rest]
            # Without oneDNN (MKL-DNN): it keeps convolution weights in a layout of its own that MXNet 1.9's
            # kvstore cannot send ("can't generate TBlob for MKLDNN data"), so a convolutional student failed
            # at its first broadcast. Worker 0's producer inherits this (its teacher runs without oneDNN).
            workers.append(spawn("worker", cmd, {"OMP_NUM_THREADS": str(threads), "MXNET_MKLDNN_ENABLED": "0",
                                                 "MXNET_STORAGE_FALLBACK_LOG_VERBOSE": "0"}))
        print(f"[launch] scheduler on {args.host}:{port}, {args.servers} server(s), {args.workers} worker(s) "
              f"({args.kvstore}, {threads} thread(s) each)", flush=True)
        while True:
            codes = [w.poll() for w in workers]
            failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
            dead_ps = [(r, pr.returncode) for r, pr in procs if r != "worker" and pr.poll() not in (None, 0)]
            if failed or dead_ps:
                signals.check()  # a Ctrl-C that reached every process (they left because of it) is a stop
                # by pid: the kvstore ranks workers in the order they join, not the order they were started
                what = ", ".join([f"the worker with pid {workers[i].pid} exited with status {c}" for i, c in failed] +
                                 [f"{r} exited with status {c}" for r, c in dead_ps])
                stop_all()
                print(f"error: {what}; the other processes were stopped (a dist_sync job cannot go on without "
                      f"every worker). Fix the cause and run again (--resume --run NAME continues from the last "
                      f"finished epoch)", file=sys.stderr)
                return BUG if BUG in codes else USER_ERROR  # a worker's bug (its traceback above) is one here too
            if all(c == 0 for c in codes):
                break
            signals.sleep(0.2)
    except KeyboardInterrupt as e:
        stop_all(signal.SIGINT)
        print(f"{signals.stop_word(e)}: every process was stopped", file=sys.stderr)
        return signals.exit_status(e)
    stop_all()
    print(f"[launch] {args.workers} worker(s) finished", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
