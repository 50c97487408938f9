"""Set-up for the child processes kdcache's commands start: forked shards, the trainer's producer,
the launcher's scheduler, servers and workers."""
import os
import signal

from kdcache import signals


def die_with_parent(parent):
    """In a forked child: take SIGINT and SIGTERM at safe points (the parent's deferral, kept or
    installed), and get SIGTERM when `parent` (the pid that started it) dies, even by kill -9 (Linux).

    SIGINT is how a parent stops its child cleanly (the child commits what it wrote and leaves).
    A process started with SIGINT ignored (a background job of a shell script: `make train &`)
    would pass that on to its children, which would then only stop at the kill that follows."""
    for sig in signals.SIGNALS:
        if signal.getsignal(sig) is not signals._handler:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    signals.defer()
    _death_signal(parent)


def before_exec(parent):
    """In Popen's preexec_fn: the program about to run gets SIGINT again (a Python handler, unlike
    SIG_IGN, is reset to the default at exec), SIGTERM when `parent` dies, and both blocked until
    its first line takes them over (kdcache.signals.defer or plain): a signal that comes while the
    interpreter starts stays pending instead of raising KeyboardInterrupt in whatever runs then."""
    signal.pthread_sigmask(signal.SIG_BLOCK, signals.SIGNALS)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _death_signal(parent)


def _death_signal(parent, sig=signal.SIGTERM):
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, sig)  # PR_SET_PDEATHSIG
    except Exception:
        pass
    if os.getppid() != parent:  # it died before prctl took effect
        os._exit(143)


def worker_of(parent):
    """In a forked helper that holds nothing to save (a decode worker): Ctrl-C and SIGTERM are left
    to `parent`, which stops it by closing its pipes at its own safe point (a worker that took the
    terminal's Ctrl-C itself would look to the parent like one that died); it is killed (SIGKILL)
    when `parent` dies, even by kill -9 (Linux)."""
    for sig in signals.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, signals.SIGNALS)
    _death_signal(parent, signal.SIGKILL)
