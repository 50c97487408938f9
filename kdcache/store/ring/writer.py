"""RingWriter: the producer's side of the ring, writing teacher logits by (sample index, epoch) key."""
import numpy as np

from ..format.codec import _finite_or_raise, stream_keys
from ..errors import BadInputError, ConsumerGoneError, MissingTargetsError
from .base import _Side, _Waiter
from .layout import EMPTY, FINISHED, LEFT, PRODUCER, READY, RUNNING, _as_keys, _show


class RingWriter(_Side):
    """The producer's side: writes rows of teacher logits by (sample index, epoch) key.

    create=True makes the segment (capacity rows of num_classes logits stored with codec/dtype;
    defaults 4096, "full", "float16"); create=False attaches to `name`, waiting up to `timeout`
    seconds for it to appear, and takes the geometry from its header (num_classes, codec, dtype or
    capacity passed here must agree, else StoreError). `fingerprint` (the cache fingerprint of the
    targets: teacher, data, views, codec) is stored by the creator; an attaching side that passes
    another one, or passes one to a ring created without, is refused (FingerprintMismatchError);
    passing None skips the check. Attaching checks everything found in /dev/shm first (a regular
    file of this user that no one else may write, every header field, the file's size, the slots),
    refusing anything else at once with one StoreError line. A ring takes one producer and one
    consumer: its name is removed as soon as the second side attaches, so a crash of both leaves
    nothing behind (before that, the creator's resource tracker or cleanup_stale() removes it).
    The creator removes the name when it closes before a peer attached. write() blocks while the
    ring is full; `timeout` counts seconds without progress and `liveness_timeout` how long the
    consumer may go without a heartbeat before it counts as dead.
    Options (keyword only): capacity=None, num_classes=None, codec=None, dtype=None,
    timeout=60.0, liveness_timeout=5.0, fingerprint=None, seed=0.
    `seed` (the run's --seed) keys a `sampled:K` ring's draws, with each row's sample, view and epoch
    (codec.stream_keys): every epoch draws anew, and another seed draws otherwise.
    """

    role, _PEER_GONE, _CLEAN_EXIT = PRODUCER, ConsumerGoneError, FINISHED

    def __init__(self, name=None, *, create=True, seed=0, **options):
        super().__init__(name, create, **options)
        self.seed = int(seed)
        self._count = int(self._ring.hdr["write_count"])

    @property
    def written(self):
        """Rows this ring has received from producers so far."""
        return self._count

    def write(self, indices, epochs, logits, *, views=0, timeout=None):
        """Write rows logits[i] (float [B, num_classes]) under keys (indices[i], epochs[i]);
        `epochs` may be one integer for the whole batch, and `views` (the rows' views: one integer or one
        per index) joins the draw keys of a sampled codec. Blocks while the ring is full.
        Raises BadInputError (nothing written) for NaN/Inf or bad shapes, ConsumerGoneError if
        the consumer died or left, MissingTargetsError (a TimeoutError; .missing holds the
        [n, 2] keys not written) after `timeout` seconds without a free slot. Returns B."""
        r = self._ring
        r.check_open()
        idx, ep = _as_keys(indices, epochs)
        x = np.asarray(logits)
        if x.ndim != 2 or x.shape != (idx.size, self.num_classes):
            raise BadInputError(f"logits must be [batch, num_classes] = [{idx.size}, {self.num_classes}], "
                                f"got shape {x.shape}")
        if x.dtype.kind != "f":
            x = x.astype(np.float32)
        _finite_or_raise(x, idx, f"RingWriter.write to ring {self.name}")
        enc = r.codec.encode(x, keys=stream_keys(self.seed, idx, views, ep))
        timeout = r.timeout if timeout is None else float(timeout)
        with self._lock:
            r.beat()
            state = int(r.hdr["consumer_state"]) if int(r.hdr["consumer_pid"]) else RUNNING
            if state != RUNNING:  # header flags only: a pid check per call costs a /proc read
                self._consumer_gone("finished" if state == FINISHED else "left", idx.size)
            self._write_encoded(idx, ep, enc, timeout)
        return idx.size

    def _write_encoded(self, idx, ep, enc, timeout):
        r, cap, n, done = self._ring, self._ring.capacity, idx.size, 0
        waiter = _Waiter(timeout)
        while done < n:
            m = min(n - done, cap)
            slots = (self._count + np.arange(m)) % cap
            free = r.state[slots] == EMPTY
            k = m if free.all() else int(np.argmin(free))  # free slots from the head on
            if k:
                sl, src = slots[:k], slice(done, done + k)
                for name in r.fields:  # no loop variable holding a view: close() must unmap
                    r.fields[name][sl] = enc[name][src]  # the one copy into shared memory
                r.keys[sl, 0] = idx[src]
                r.keys[sl, 1] = ep[src]
                r.state[sl] = READY                 # last: publishes the rows
                self._count += k
                r.hdr["write_count"] = self._count
                done += k
                waiter.progress()
                continue
            if waiter.check_due():
                r.beat()
                status = r.peer_status()
                if status not in (None, "absent"):
                    self._consumer_gone(status, n - done)
                if waiter.expired():
                    missing = np.stack([idx[done:], ep[done:]], axis=1)
                    if status == "absent":
                        why = (f"no consumer has attached within {timeout:g} s: start the trainer "
                               f"reading ring {self.name}, or raise timeout=")
                    else:
                        why = (f"the consumer (pid {int(r.hdr['consumer_pid'])}) is alive but freed "
                               f"no slot for {timeout:g} s. The producer fills slots in order and "
                               f"waits for the oldest unread row, so the trainer must read about in "
                               f"the order written, within capacity={cap} rows: check both sides use "
                               f"the same schedule, raise capacity, or raise timeout=")
                    raise MissingTargetsError(
                        f"ring {self.name} is full ({cap} rows); {n - done} of {n} rows not written "
                        f"(first: {_show(missing)}): {why}", missing=missing)
            waiter.sleep()

    def _consumer_gone(self, status, left):
        self._peer_gone(status, f"{left} row(s) of this batch were not written and nobody will read "
                                f"them. Look at the trainer's log for why it stopped, then restart the "
                                f"trainer and the producer together")

    consumer_alive = _Side._peer_alive

    def close(self, finished=True):
        """Mark the producer finished (finished=True) or gone without finishing (False), stop the
        heartbeat, unmap, and remove the segment if this side created it. Idempotent."""
        self._close(FINISHED if finished else LEFT)
