"""Ctrl-C and SIGTERM deferred from a process's first line and raised at its safe points (stdlib only).

Python raises KeyboardInterrupt wherever the main thread happens to be. During start-up that is
often inside an import: MXNet's takes about a second and runs destructors and weak-reference
callbacks, where the exception is swallowed ("Exception ignored in ...", a traceback on stderr)
and the process goes on as if nothing had happened; SIGTERM's default action ends a process
mid-write. Every process kdcache starts therefore calls defer() as its first line, before
anything heavy is imported: a signal is recorded, and raised as Stopped (a KeyboardInterrupt)
by check() at the next safe point, or at once while the process waits inside interruptible()
(for a child, a pipe, a lock, a sleep), where nothing is half done. Later signals are recorded
once: a parent that passes a stop on to a child that got it from the terminal too does not cut
the child's clean-up short (kill -9, or Ctrl-\\, ends a process at once).

This module imports nothing heavy: it must be usable before anything else is imported.
"""
import contextlib
import signal
import threading
import time

SIGNALS = (signal.SIGINT, signal.SIGTERM)
_requested = None  # the first signal received while deferred
_immediate = 0  # > 0 inside interruptible(): the handler raises at once
_installed = {}  # signal -> the handler defer() replaced


class Stopped(KeyboardInterrupt):
    """The stop a signal asked for (SIGINT: Ctrl-C, or SIGTERM), raised at a safe point."""

    def __init__(self, signum=signal.SIGINT):
        super().__init__(signal.Signals(signum).name)
        self.signum = int(signum)


def exit_status(stop):
    """128 + the signal's number, as a shell reports a process the signal ended (130 for Ctrl-C)."""
    return 128 + getattr(stop, "signum", signal.SIGINT)


def stop_word(stop):
    """How a command says it stopped: 'interrupted' (Ctrl-C) or 'stopped by SIGTERM'."""
    return "interrupted" if exit_status(stop) == 128 + signal.SIGINT else "stopped by SIGTERM"


def _handler(signum, frame):
    global _requested
    if _requested is None:
        _requested = signum
    if _immediate:
        raise Stopped(_requested)


def _ours(sig, handler):
    """May defer() take this signal over? Not when the process was started with it ignored (a
    background job of a shell script keeps ignoring Ctrl-C), nor from a handler of someone else's."""
    if sig == signal.SIGINT:
        return handler is signal.default_int_handler
    return handler in (signal.SIG_DFL, None) or getattr(handler, "__name__", "") == "raise_stopped"


def defer():
    """Record SIGINT and SIGTERM from now on, for check() to raise; returns the signals this call
    took over (empty: both were deferred already, or are ignored). Each signal is taken on its own:
    a forked child whose parent was started with SIGINT ignored gets SIGINT back
    (children.die_with_parent) while SIGTERM is deferred already, and its SIGINT must be deferred
    too, or Python raises it wherever the child is (inside a destructor it is swallowed, and the
    child goes on as if never stopped). A parent that starts kdcache processes blocks both signals
    across the exec (children.before_exec): they are unblocked here, once handled, and one that
    came in between is taken now."""
    taken = set()
    for sig in SIGNALS:
        old = signal.getsignal(sig)
        if old is not _handler and _ours(sig, old):
            _installed[sig] = old
            signal.signal(sig, _handler)
            taken.add(sig)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    return taken


def active():
    return any(signal.getsignal(s) is _handler for s in SIGNALS)


def restore(sigs=None):
    """The handlers defer() replaced (of `sigs`, default all), back; a signal recorded and not
    raised is forgotten once no signal is deferred any more."""
    global _requested
    for sig in list(_installed) if sigs is None else sigs:
        old = _installed.pop(sig, None)
        if old is not None and signal.getsignal(sig) is _handler:
            signal.signal(sig, old)
    if not active():
        _requested = None


@contextlib.contextmanager
def deferred():
    """defer() for the block; the handlers this block replaced are back after it (a command's
    main() may run inside another program, a test's)."""
    taken = defer()
    try:
        yield
    finally:
        if taken:
            restore(taken)


def requested():
    """The signal recorded and not raised yet, or None."""
    return _requested


def check():
    """A safe point: raise the recorded signal as Stopped."""
    if _requested is not None:
        raise Stopped(_requested)


@contextlib.contextmanager
def interruptible():
    """A wait where a signal is raised at once: blocked in a system call (a child's exit, a pipe, a
    sleep, a lock) the main thread holds nothing half done. Elsewhere than in the main thread
    (where Python runs its handlers) it changes nothing."""
    global _immediate
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _immediate += 1  # before the check: a signal between the two is raised by one or the other
    try:
        check()
        yield
    finally:
        _immediate -= 1


def sleep(seconds):
    """time.sleep, interruptible: a polling wait that ends at a signal."""
    with interruptible():
        time.sleep(seconds)


def release(sig):
    """From now on `sig` takes its default action (ends the process at once): for a process that
    blocks in code that never returns to Python (a distributed worker in MXNet's kvstore). One
    recorded before is raised here first."""
    if signal.getsignal(sig) is _handler:
        check()
        signal.signal(sig, _installed.pop(sig, signal.SIG_DFL))


def plain():
    """For a process that holds nothing to save (a kvstore scheduler or server, which runs inside
    `import mxnet` until its job ends and never returns to Python): SIGINT and SIGTERM end it
    at once, by their default action, from its first line; one received before that is taken now."""
    for sig in SIGNALS:
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
