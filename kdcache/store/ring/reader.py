"""RingReader: the trainer's side of the ring, reading float32 logits by (sample index, epoch) key."""
import numpy as np

from ..format import schema
from ..errors import MissingTargetsError, ProducerGoneError
from .base import _Side, _Waiter
from .layout import CONSUMER, EMPTY, LEFT, READY, _as_keys, _show


class RingReader(_Side):
    """The trainer's side: reads rows by (sample index, epoch) key as float32 logits.

    Same options as RingWriter (create=False by default: attach to the producer's ring).
    get() blocks until every requested key is present and frees their slots; `timeout` counts
    seconds without progress, `liveness_timeout` how long the producer may go without a heartbeat.
    """

    role, _PEER_GONE, _CLEAN_EXIT = CONSUMER, ProducerGoneError, LEFT

    def __init__(self, name=None, *, create=False, **options):
        super().__init__(name, create, **options)
        self.stall_s = 0.0  # total seconds get() spent waiting for rows
        self._guess = 0

    def get(self, indices, epochs, *, timeout=None):
        """float32 [B, num_classes] logits of keys (indices[i], epochs[i]) (`epochs` may be one
        integer); blocks until every key is present, copies the rows out and frees their slots.
        Rows are consumed as they arrive (so B may exceed the capacity): if get() raises, rows it
        already took are gone. Raises ProducerGoneError when the producer died, hung or closed
        without writing them, MissingTargetsError (.missing: [n, 2] keys) after `timeout` seconds
        without a new row."""
        r = self._ring
        r.check_open()
        idx, ep = _as_keys(indices, epochs)
        q = np.stack([idx, ep], axis=1)
        out = np.empty((idx.size, self.num_classes), np.float32)
        timeout = r.timeout if timeout is None else float(timeout)
        with self._lock:
            r.beat()
            waiter = _Waiter(timeout)
            pending = np.arange(idx.size)
            seen = None
            try:
                while pending.size:
                    count = int(r.hdr["write_count"])
                    if count != seen:  # nothing can have appeared unless the counter moved
                        seen = count
                        if self._take(q, pending, out):
                            pending = pending[self._left]
                            waiter.progress()
                            continue
                    if waiter.check_due():
                        r.beat()
                        status = r.peer_status()
                        if status not in (None, "absent"):
                            # The producer stopped; what it wrote before that is visible now.
                            if self._take(q, pending, out):
                                pending = pending[self._left]
                            if pending.size:
                                self._producer_gone(status, q[pending], idx.size)
                            break
                        if waiter.expired():
                            self._timed_out(status, q[pending], idx.size, timeout)
                    waiter.sleep()
            finally:
                self.stall_s += waiter.waited
        return out

    def _take(self, q, pending, out):
        """Copy out the pending rows present now and free their slots; sets self._left (mask of
        pending rows still missing). Returns whether any row was taken."""
        r = self._ring
        slots, self._guess = r.find(q[pending], self._guess)
        hit = slots >= 0
        self._left = ~hit
        if not hit.any():
            return False
        s = slots[hit]
        if hit.all() and pending.size == len(out):
            if r.fast_take:
                np.take(r.fields[schema.LOGITS], s, axis=0, out=out, mode="clip")
            else:
                r.codec.decode({name: arr[s] for name, arr in r.fields.items()}, out=out)
        else:
            out[pending[hit]] = r.codec.decode({name: arr[s] for name, arr in r.fields.items()})
        r.state[s] = EMPTY  # after the copy: the producer may overwrite from here on
        return True

    def _producer_gone(self, status, missing, n):
        fix = {"finished": "the producer and the trainer disagree on the keys: check both use the "
                           "same schedule (seed, epochs, views) and data set, and that the producer "
                           "was not stopped early",
               "left": "see the producer's log for its error, fix it and restart the producer",
               "dead": "see the producer's log (or the kernel log: out of memory is common), then "
                       "restart the producer",
               "hung": "see what the producer is doing (py-spy dump), or raise liveness_timeout "
                       "if its steps are that slow"}[status]
        self._peer_gone(status, f"{len(missing)} of the {n} requested keys were never written "
                                f"(first: {_show(missing)}): {fix}")

    def _timed_out(self, status, missing, n, timeout):
        r = self._ring
        if status == "absent":
            why = (f"no producer has attached: start the producer (cache builder) writing to ring "
                   f"{self.name}, or raise timeout=")
        else:
            why = (f"the producer (pid {int(r.hdr['producer_pid'])}) is alive but slower than the "
                   f"trainer, stuck, or producing other keys: check both sides use the same "
                   f"schedule, give the producer more cores, or raise timeout=")
            if np.count_nonzero(r.state == READY) == r.capacity:
                why += (f". The ring is full of rows the trainer did not ask for: read about in the "
                        f"order written, or raise capacity (now {r.capacity})")
        raise MissingTargetsError(
            f"ring {self.name}: {len(missing)} of {n} requested keys (first: {_show(missing)}) did "
            f"not appear within {timeout:g} s; {why}", missing=missing)

    def missing(self, indices, epochs):
        """Boolean mask, one per key: True where (indices[i], epochs[i]) is not in the ring now.
        Does not wait and frees nothing."""
        r = self._ring
        r.check_open()
        idx, ep = _as_keys(indices, epochs)
        slots, _ = r.find(np.stack([idx, ep], axis=1), self._guess)
        return slots < 0

    producer_alive = _Side._peer_alive

    def close(self):
        """Mark the consumer gone, stop the heartbeat, unmap, and remove the segment if this side
        created it. Idempotent."""
        self._close(LEFT)
