"""The producer's images: decoded and augmented in worker processes, in order, ahead of the teacher.

NOTE (decode workers). Decoding a photo and building its view costs 1-3 ms, a light teacher's
forward a few ms: done in series, in the producer's own process, decoding starves the teacher.
A Decoder forks `workers` processes once; each batch is cut into one contiguous chunk per worker,
and every worker serves its chunks first in, first out, so the parent reads chunk j of batch k
from worker j in the order it asked: order holds without sequence numbers. Batches are asked for
ahead (PREFETCH), so the workers decode the next batches while the teacher runs this one. The
images travel through shared memory, not the pipe: one arena (a memfd mapped before the fork) has
SLOTS slots, batch k goes to slot k mod SLOTS, and each worker writes its chunk at its rows' place
there and sends only the chunk's shape and which of its images are finite (judged on the worker's
core). So a batch lies whole in its slot and take() hands the teacher that memory itself, read-only,
with no copy (a pipe cost the parent ~0.4 ms per 224 px image, a copy out of the arena ~0.1 ms: a
few percent of a light teacher's forward). Those images are valid until the next submit(), which
may ask a worker to write the slot again: the producer runs the teacher on them before it asks for
more. A batch read before its turn (its slot about to be reused, or a later one taken first) is
copied out. A worker runs the very function the in-process path runs (views_and_items: the images
augment.make_views makes, and the records of their items) on a slice of the batch: the views are keyed per sample, so the images are bit-identical either way.

Errors travel back as the exception the in-process path would raise (a DatasetError naming the
file), at the batch they belong to: batches before it are written, as without workers. Workers
hold nothing to save: they ignore Ctrl-C and SIGTERM (the parent takes them at its safe points and
then closes the pipes, which ends the workers), and die with the parent (children.worker_of). A
worker that dies (kill -9, out of memory) is one line from the parent, DecodeWorkerError.
"""
import collections
import os
import pickle
import signal

import numpy as np

from kdcache.errors import KdcacheError
from kdcache.store.format.items import unknown

from .augment import mix_views
from .digests import item_records

PREFETCH = 2  # batches asked for ahead of the one the teacher runs
SLOTS = PREFETCH + 2  # results a worker may hold unread: the batches ahead, the one taken, one asked for now
SLOT_BYTES = 256 << 20  # one result's room in a worker's shared arena (virtual: only what is written is memory)
STOP_WAIT_S = 5.0  # a worker gets this long to leave after its pipes close, then SIGKILL


class DecodeWorkerError(KdcacheError, ValueError):
    """A decode worker process died or stopped answering; the message says how and what to do."""


def default_workers(dataset, teacher_threads, cores, producers=1):
    """The decode workers when --decode-workers is not given: none (in-process) for data held in
    RAM, whose views cost little; for image files the cores the teachers' threads leave, none when
    they leave none (decoding then runs in series, as before)."""
    if not getattr(dataset, "decodes", False):
        return 0
    return max(0, cores - teacher_threads * producers)


def views_and_items(dataset, indices, views, *, seed, augment):
    """(images of keys (indices, views) as augment.make_views makes them, the records of the data set
    items they were made from: pipeline.digests NOTE [item digests]). Only view 0's rows get theirs
    (the others' are left unknown): one digest per sample, whatever the view count."""
    x, y = dataset.get_batch(indices)
    first = np.broadcast_to(np.asarray(views) == 0, (len(y),))
    if first.all():  # before the augmentation: it may work in place
        rec = item_records(x, y)
    else:
        rec = unknown(len(y))
        for i in np.flatnonzero(first):
            rec[i] = item_records(x[i:i + 1], np.asarray(y)[i:i + 1])[0]
    x = augment.apply(x, seed, indices, views)
    return mix_views(dataset, x, y, indices, views, seed=seed, augment=augment)[0], rec


def finite_rows(x):
    """bool [B]: which images of a batch x [B, ...] hold no NaN or Inf (a row's max and min are finite
    exactly then: both propagate NaN; two reductions, no array of the batch's size made)."""
    flat = np.reshape(x, (len(x), -1))
    if not np.issubdtype(flat.dtype, np.inexact) or flat.shape[1] == 0:
        return np.ones(len(flat), dtype=bool)
    return np.isfinite(flat.max(axis=1)) & np.isfinite(flat.min(axis=1))


class Decoder:
    """make_views(dataset, indices, views) for the producer's batches: submit() a batch ahead,
    take() its images later. A ticket taken before older ones makes the parent read the older ones
    first (the workers answer in order) and keep them, errors included, for their own take().
    With workers=0 the images are made in this process, at take()."""

    def __init__(self, dataset, *, seed, augment, workers=0):
        self.dataset, self.seed, self.augment = dataset, seed, augment
        self.pending = collections.OrderedDict()  # ticket -> (indices, views, chunk bounds), oldest first
        self.ready = {}  # ticket -> images or the exception, read before their turn
        self.next_ticket = 0
        self.workers = []  # (pid, task connection, result connection)
        self.arena = None  # SLOTS slots of SLOT_BYTES, shared with the workers
        if workers > 0:
            self._start(int(workers))

    # --- the parent's side ---------------------------------------------------------------
    def _start(self, n):
        from multiprocessing import Pipe

        from .child_setup import worker_of
        import mmap
        parent = os.getpid()
        fd = os.memfd_create("kdcache-decode")
        try:
            os.ftruncate(fd, SLOTS * SLOT_BYTES)
            self.arena = mmap.mmap(fd, SLOTS * SLOT_BYTES)  # MAP_SHARED: the children write, the parent reads
        finally:
            os.close(fd)
        for _ in range(n):
            task_r, task_w = Pipe(duplex=False)
            res_r, res_w = Pipe(duplex=False)
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    worker_of(parent)
                    for _, t, r in self.workers:  # the other workers' pipes are not this one's
                        t.close()
                        r.close()
                    task_w.close()
                    res_r.close()
                    self._serve(task_r, res_w, self.arena)
                except BaseException:
                    code = 1
                finally:
                    os._exit(code)  # never the parent's clean-up (its HDF5 file, its atexit)
            task_r.close()
            res_w.close()
            self.workers.append((pid, task_w, res_r))

    def submit(self, indices, views):
        """Ask for the images of keys (indices, views); returns the ticket take() wants. The images
        take() returned before are valid no longer (their slot may be written again)."""
        indices = np.asarray(indices, dtype=np.int64)
        views = np.broadcast_to(np.asarray(views, dtype=np.int64), indices.shape).copy()
        while len(self.pending) >= SLOTS and self.workers:  # the oldest result's slot is about to be reused
            t, (old_i, _, old_b) = self.pending.popitem(last=False)
            self.ready[t] = self._read_or_error(old_i, old_b, t % SLOTS, keep=True)
        ticket = self.next_ticket
        self.next_ticket += 1
        bounds = []
        if self.workers:
            cuts = np.linspace(0, len(indices), len(self.workers) + 1).astype(int)
            for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
                if b > a:
                    self._send(j, (indices[a:b], views[a:b], ticket % SLOTS, a))
                    bounds.append((j, a, b))
        self.pending[ticket] = (indices, views, bounds)
        return ticket

    def take(self, ticket, items=False):
        """(images float32 [B, C, H, W], finite bool [B]) of the batch `ticket` asked for: `finite`
        says which images hold no NaN or Inf, judged where they were made (a worker's spare core, not
        the teacher's). From workers the images may be the shared arena itself, read-only and valid
        until the next submit(): copy them to keep them longer. `items`: the records of the data set
        items the images were made from come third (pipeline.digests NOTE [item digests])."""
        if not self.workers:
            indices, views, _ = self.pending.pop(ticket)
            x, rec = views_and_items(self.dataset, indices, views, seed=self.seed, augment=self.augment)
            got = x, finite_rows(x), rec
        else:
            while ticket not in self.ready:
                t, (indices, views, bounds) = self.pending.popitem(last=False)
                self.ready[t] = self._read_or_error(indices, bounds, t % SLOTS, keep=t != ticket)
            got = self.ready.pop(ticket)
            if isinstance(got, BaseException):
                raise got
        return got if items else got[:2]

    def _read_or_error(self, indices, bounds, slot, keep):
        """The batch's images, or its own error (raised at its turn); a dead worker is raised now.
        `keep`: copied out of the arena (it is taken later, after more submits)."""
        try:
            images, finite, rec = self._read(indices, bounds, slot)
            return (images.copy() if keep and images.base is not None else images), finite, rec
        except DecodeWorkerError:
            raise
        except Exception as e:
            return e

    def _read(self, indices, bounds, slot):
        """One batch's chunks, from each worker in turn: a read-only view of its slot when every chunk
        is there (the usual case), else an array of its own."""
        n, shm = len(indices), []
        row, out, finite, error = None, None, np.ones(len(indices), dtype=bool), None
        rec = None
        for j, a, b in bounds:  # every chunk is read, even after an error: the pipes stay in step
            head = self._recv(j)
            if head[0] == "error":
                error = error or head[1]
                continue
            shape, dtype = tuple(head[1]), np.dtype(head[2])
            if row is None:
                row = (shape[1:], dtype)
            if (shape[1:], dtype) != row:
                if head[0] == "ok":
                    self._recv_into(j, np.empty(shape, dtype=dtype))  # read and dropped
                if error is None:
                    from .dataset_base import DatasetError
                    error = DatasetError(
                        f"{self.dataset.name}: images of different sizes {sorted({row[0], shape[1:]})} in "
                        f"one batch: pass --image-size HxW to resize them")
                continue
            finite[a:b] = head[3]
            if rec is None:
                rec = np.empty(n, dtype=head[4].dtype)
            rec[a:b] = head[4]
            if head[0] == "shm":
                shm.append((a, b))
                continue
            if out is None:  # a chunk too large for the arena came through the pipe
                out = np.empty((n,) + shape[1:], dtype=dtype)
            self._recv_into(j, out[a:b])
        if error is not None:
            raise error
        whole = np.frombuffer(self.arena, dtype=row[1], count=n * int(np.prod(row[0], dtype=np.int64)),
                              offset=slot * SLOT_BYTES).reshape((n,) + row[0]) if shm else None
        if out is None:
            whole.flags.writeable = False
            return whole, finite, rec
        for a, b in shm:
            out[a:b] = whole[a:b]
        return out, finite, rec

    def _send(self, j, task):
        try:
            self.workers[j][1].send(task)
        except OSError:
            self._died(j)

    def _recv(self, j):
        from kdcache import signals
        try:
            with signals.interruptible():  # a stop while waiting for a worker: nothing is half done here
                return self.workers[j][2].recv()
        except (EOFError, OSError):
            self._died(j)

    def _recv_into(self, j, arr):
        try:
            n = self.workers[j][2].recv_bytes_into(memoryview(arr).cast("B"))
        except (EOFError, OSError):
            self._died(j)
        if n != arr.nbytes:
            raise DecodeWorkerError(f"decode worker {self.workers[j][0]} sent {n} bytes for a chunk of "
                                    f"{arr.nbytes}: rerun; rows written so far are kept")

    def _died(self, j):
        """Worker j's pipe closed: it died. One line saying how; a stop of this process comes first
        (its signal may have reached the worker's group too)."""
        from kdcache import signals
        signals.check()
        pid = self.workers[j][0]
        try:
            got, status = os.waitpid(pid, 0)
            how = (f"was killed by signal {os.WTERMSIG(status)} ({signal.Signals(os.WTERMSIG(status)).name})"
                   if os.WIFSIGNALED(status) else f"exited with status {os.waitstatus_to_exitcode(status)}")
        except ChildProcessError:
            how = "is gone"
        self.workers[j] = (None,) + self.workers[j][1:]
        raise DecodeWorkerError(f"decode worker process {pid} {how}: every row written so far is kept; run the "
                                f"same command again to resume (--decode-workers 0 decodes in this process)")

    def close(self):
        """End the workers: their pipes close (each leaves after its current chunk, or at once when
        it is blocked writing to the parent), then they are waited for; SIGKILL after STOP_WAIT_S."""
        import time
        workers, self.workers = self.workers, []
        self.pending.clear()
        self.ready.clear()
        for pid, t, r in workers:
            t.close()
            r.close()
        arena, self.arena = self.arena, None
        if arena is not None:
            try:
                arena.close()
            except BufferError:  # images taken from it are still held: unmapped when the last is dropped
                pass
        deadline = time.monotonic() + STOP_WAIT_S
        for pid, _, _ in workers:
            if pid is None:
                continue
            while True:
                try:
                    got, _ = os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    break
                if got:
                    break
                if time.monotonic() > deadline:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    break
                time.sleep(0.005)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- the worker's side ---------------------------------------------------------------
    def _serve(self, tasks, results, arena):
        """Make each chunk's images, in the order asked, into the slot named; an exception goes back in
        place of them."""
        while True:
            try:
                indices, views, slot, first = tasks.recv()
            except (EOFError, OSError):
                return  # the parent closed the pipe: done
            try:
                x, rec = views_and_items(self.dataset, indices, views, seed=self.seed, augment=self.augment)
                x = np.ascontiguousarray(x)
            except Exception as e:
                try:  # the parent raises it as it is, when it can be rebuilt there
                    pickle.loads(pickle.dumps(e))
                except Exception:
                    e = RuntimeError(f"{type(e).__name__}: {e}")
                try:
                    results.send(("error", e))
                except OSError:
                    return
                continue
            try:
                at = first * (x.nbytes // max(1, len(x)))  # this chunk's rows' place in the batch
                if at + x.nbytes <= SLOT_BYTES:
                    np.frombuffer(arena, dtype=x.dtype, count=x.size, offset=slot * SLOT_BYTES + at)[...] = \
                        x.reshape(-1)
                    results.send(("shm", x.shape, x.dtype.str, finite_rows(x), rec))
                else:
                    results.send(("ok", x.shape, x.dtype.str, finite_rows(x), rec))
                    results.send_bytes(memoryview(x).cast("B"))
            except OSError:
                return  # the parent is gone or stopped reading
