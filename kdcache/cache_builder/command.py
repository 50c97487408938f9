"""`kdcache cache` (python -m kdcache.cache_builder): the producer's entry point, threads fixed before MXNet
loads, then the run (kdcache.cache_builder.runs); errors end it as every command ends (kdcache.errors)."""
import logging
import os
import sys

from kdcache.cache_builder.errors import ProducerError
from kdcache.cache_builder.options import parse_args
from kdcache.cache_builder.runs import run
from kdcache.errors import USER_ERROR, as_command, refused
from kdcache.pipeline.interrupts import exit_status, stop_word, take_sigterm
from kdcache.threads import fix_threads


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
        raise ProducerError(f"KDCACHE_TEACHER_THREADS={env_threads!r}: use an integer from 1 to 1024, or unset it")
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
