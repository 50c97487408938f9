"""Set-up for the child processes kdcache's commands start: forked shards, the trainer's producer,
the launcher's scheduler, servers and workers."""
import os
import signal


def die_with_parent(parent):
    """In a child, forked or in Popen's preexec_fn before exec: take SIGINT again, and get SIGTERM
    when `parent` (the pid that started it) dies, even by kill -9 (Linux).

    SIGINT is how a parent stops its child cleanly (the child commits what it wrote and leaves).
    A process started with SIGINT ignored (a background job of a shell script: `make train &`)
    would pass that on to its children, which would then only stop at the kill that follows. A
    Python handler, unlike SIG_IGN, is reset to the default at exec, where Python installs its
    own again: the child gets KeyboardInterrupt either way."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(143)
