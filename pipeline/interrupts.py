"""Ctrl-C taken at safe points of the work loops (the trainer's epochs, the producer's batches)."""
import signal


class Interrupts:
    """Ctrl-C (SIGINT) during a work loop, raised where it is safe.

    Python raises KeyboardInterrupt wherever the main thread happens to be: inside an MXNet
    destructor or a weak reference's callback it is swallowed ("Exception ignored in ...") and the
    work goes on (a trainer trained on, a producer filled its whole cache and exited 0); between a
    lock's acquire and its release (a queue's, in the batch wait) it can leave the lock held, and
    a trainer was once seen hanging after a Ctrl-C. While installed, the first SIGINT is recorded
    and raised by check(), at the loop's next step (the trainer also checks while it waits for a
    batch); a second one is raised at once."""

    def __init__(self):
        self.requested = False
        self._old = None

    def install(self):
        # only over Python's own handler: not when the process was started with SIGINT ignored
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._old = signal.signal(signal.SIGINT, self._handler)
        return self

    def _handler(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True

    def check(self):
        if self.requested:
            raise KeyboardInterrupt

    def restore(self):
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
