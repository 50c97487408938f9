"""Ctrl-C and SIGTERM taken at safe points of the work loops (the trainer's epochs, the producer's batches)."""
import signal

from kdcache import signals
from kdcache.signals import Stopped, exit_status, stop_word  # noqa: F401 (the loops' names for them)


class Interrupts:
    """Ctrl-C (SIGINT) and SIGTERM during a work loop, raised where it is safe.

    Python raises KeyboardInterrupt wherever the main thread happens to be: inside an MXNet
    destructor or a weak reference's callback it is swallowed ("Exception ignored in ...") and the
    work goes on (a trainer trained on, a producer filled its whole cache and exited 0); between a
    lock's acquire and its release (a queue's, in the batch wait) it can leave the lock held, and
    a trainer was once seen hanging after a Ctrl-C; SIGTERM's default action ended a process
    mid-batch, skipping its clean close. While installed, the first signal is recorded and raised
    by check() as Stopped (a KeyboardInterrupt), at the loop's next step (the trainer also checks
    while it waits for a batch); a second one is raised at once. In a command's process, which
    defers signals from its first line (kdcache.signals), check() raises what that recorded."""

    def __init__(self, *, term=True):
        self.requested = None  # the signal received, once one is
        self.term = term  # SIGTERM too (not for a distributed worker: it blocks in the kvstore)
        self._old = {}

    def install(self):
        # Each signal on its own, and only over its default handler: one a command's process defers
        # from its first line (kdcache.signals) is raised by check(); one the process was started
        # with ignored stays ignored.
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old[signal.SIGINT] = signal.signal(signal.SIGINT, self._handler)
        if self.term and signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, raise_stopped):
            self._old[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested is not None:
            raise Stopped(signum)
        self.requested = signum

    def check(self):
        if self.requested is not None:
            raise Stopped(self.requested)
        signals.check()

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def raise_stopped(signum, frame):
    """SIGTERM raised as Stopped, as Python raises KeyboardInterrupt for SIGINT: outside the work
    loops a command then leaves through its usual clean-up, with exit status 143."""
    raise Stopped(signum)


def take_sigterm():
    """Handle SIGTERM like Ctrl-C from now on (unless this process was started with it ignored)."""
    if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        signal.signal(signal.SIGTERM, raise_stopped)
