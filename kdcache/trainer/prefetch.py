"""Batches built ahead of the training loop, in a thread."""
import queue
import threading
import time

from kdcache.pipeline.augment import make_views


class Prefetcher:
    """Builds batches (student inputs, labels, teacher targets) ahead of the loop in a thread, so
    cache gathers and input preparation overlap the student's compute (MXNet releases the GIL)."""

    def __init__(self, steps, dataset, *, seed, augment, targets, depth=3, poll=lambda: None):
        self.q = queue.Queue(maxsize=depth)
        self._poll = poll  # called every 0.1 s while the loop waits for a batch
        self._stop = threading.Event()
        self.error = None
        self.stall_s = 0.0
        self._t = threading.Thread(target=self._run, args=(steps, dataset, seed, augment, targets), daemon=True)
        self._t.start()

    def _run(self, steps, dataset, seed, augment, targets):
        try:
            for st in steps:
                x, y = make_views(dataset, st.indices, st.view, seed=seed, augment=augment)
                t = targets(st) if targets is not None else None
                while not self._stop.is_set():
                    try:
                        self.q.put((st, x, y, t), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # handed to the loop, which raises it
            self.error = e
        finally:
            self.q.put(None)

    def __iter__(self):
        while True:
            t0 = time.perf_counter()
            while True:
                try:
                    item = self.q.get(timeout=0.1)
                    break
                except queue.Empty:
                    self._poll()
            self.stall_s += time.perf_counter() - t0
            if item is None:
                if self.error is not None:
                    raise self.error
                return
            yield item

    def close(self):
        self._stop.set()
        try:
            while True:
                self.q.get_nowait()
        except queue.Empty:
            pass
