"""Many hosts: the producer's work as fixed tasks over the key space, each task's rows published as
one immutable part (store.files.parts, NOTE [parts]).

Task j owns the flat keys [j * B, (j + 1) * B) (B: --block-rows) and computes those still owed. Run
by Ray actors (`--engine ray`: each holds the teacher, loaded once; Ray restarts an actor that
dies and the driver gives its task again) or by this process (`--scratch DIR`, with `--shard i/n`
for tasks j with j mod n = i: a loop of commands on many hosts, a Slurm array). Every run ends
with `finish`: the parts checked, damaged ones set aside and computed again, and the cache
compacted once every key is covered.
"""
import json
import logging
import os
import shutil
import socket
import tempfile
import threading
import time

import numpy as np

from kdcache.cache_builder.errors import ProducerError

log = logging.getLogger("kdcache.producer")

DEFAULT_BLOCK_ROWS = 4096
FINISH_ROUNDS = 3  # rounds of recomputing damaged parts before a run gives up


def plan(spec, done, block_rows, shard=(0, 1)):
    """[(a, b, owed keys)] of the blocks j (keys [j*B, (j+1)*B)) with j mod n = i that owe keys."""
    out = []
    i, n = shard
    for j in range(i, -(-spec.num_keys // block_rows), n):
        a, b = j * block_rows, min(spec.num_keys, (j + 1) * block_rows)
        owed = np.flatnonzero(~done[a:b]) + a
        if owed.size:
            out.append((a, b, owed))
    return out


class TaskRunner:
    """A process's side of the tasks: the data set, the teacher (loaded once) and the cache's spec,
    made from the command's options exactly as the driver made them; `run` computes one task's part
    in local scratch and publishes it into the shared parts folder."""

    def __init__(self, args, fingerprint, parts_dir, scratch, *, threads=None):
        from kdcache.threads import fix_threads
        fix_threads(threads)  # before MXNet loads (in a Ray worker: nothing has loaded it yet)
        from kdcache.pipeline.cachespec import spec_from_args
        from kdcache.pipeline.teacher_files import TeacherOptions
        from kdcache.pipeline.datasets import load_from_options
        from kdcache.pipeline.teacher import check_fits, load_teacher
        from kdcache.store.files.parts import host_identity
        self.args = args
        topt = TeacherOptions.from_args(args)
        self.dataset = load_from_options(args, args.split)
        self.spec, self.augment = spec_from_args(args, self.dataset, topt)
        if self.spec.fingerprint != fingerprint:
            raise ProducerError(
                f"on host {socket.gethostname()} these options give the cache {self.spec.fingerprint}, the "
                f"driver's {fingerprint}: this host's data set or teacher files differ from the driver's; give "
                f"every host the same files (--data-root, --teacher)")
        self.teacher = load_teacher(topt, args.batch_size)
        check_fits(self.teacher, self.dataset, self.augment, args.seed)
        self.parts_dir = parts_dir
        self.scratch = scratch
        os.makedirs(scratch, exist_ok=True)
        self.identity = host_identity()

    def run(self, a, b, keys):
        """Compute keys `keys` (owed, ascending, inside [a, b)), publish their part; a dict of what happened."""
        from kdcache.cache_builder.produce import teacher_rows
        from kdcache.pipeline.decode_workers import Decoder
        from kdcache.store.files.parts import part_name, publish, write_part
        from kdcache.store.files.paths import final_path
        t0 = time.perf_counter()
        spec, bs = self.spec, self.args.batch_size
        keys = np.asarray(keys, dtype=np.int64)
        logits, items = [], []
        with Decoder(self.dataset, seed=self.args.seed, augment=self.augment, workers=0) as decoder:
            # batches are fixed blocks of the key space (as the offline producer's): the same rows, bit for bit
            for s in range(a - a % bs, b, bs):
                k = keys[(keys >= s) & (keys < s + bs)]
                if not k.size:
                    continue
                idx, views = k // spec.views, k % spec.views
                images, finite, rec = decoder.take(decoder.submit(idx, views), items=True)
                logits.append(np.asarray(teacher_rows(self.teacher, self.dataset, idx, views, seed=self.args.seed,
                                                      augment=self.augment, images=images, finite=finite)))
                items.append(rec)
        logits = np.concatenate(logits)
        encoded = spec.make_codec().encode(logits, keys=keys)
        local = os.path.join(self.scratch, part_name(a, b, keys))
        t1 = time.perf_counter()
        try:
            write_part(local, spec, a, b, keys, encoded, np.concatenate(items), self.identity)
            t2 = time.perf_counter()
            try:
                outcome = publish(local, self.parts_dir, spec)
            except FileNotFoundError:  # the parts folder went while the copy was written
                if not os.path.exists(final_path(self.parts_dir)):
                    raise
                outcome = "finished"  # another driver (or shard) finished the cache meanwhile: nothing owed
        finally:
            try:
                os.unlink(local)
            except FileNotFoundError:
                pass
        t3 = time.perf_counter()
        return {"a": int(a), "b": int(b), "rows": int(keys.size), "outcome": outcome,
                "host": self.identity["host"], "node": _node(), "seconds": round(t3 - t0, 4),
                "compute_s": round(t1 - t0, 4), "write_s": round(t2 - t1, 4), "publish_s": round(t3 - t2, 4)}


def task_costs(outs):
    """The median seconds of a task and of its steps (compute, write in scratch, publish) over the tasks run,
    and `busy_s`, their sum (against the engine's work time: what scheduling and waiting cost)."""
    if not outs:
        return {}
    out = {k: round(float(np.median([o[k] for o in outs])), 4) for k in ("seconds", "compute_s", "write_s", "publish_s")}
    out["busy_s"] = round(float(sum(o["seconds"] for o in outs)), 3)  # every task's seconds, summed
    return out


def _node():
    try:
        import ray
        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id()
    except ImportError:
        pass
    return socket.gethostname()


class FleetLock:
    """`fleet-<host>-<pid>.lock` in the parts folder, held (flock) while this driver runs, its mtime
    touched every second: readers count the build as alive by it (segment.lock_holders)."""

    def __init__(self, parts_dir, every=1.0):
        import fcntl
        from kdcache.store.osutil import open_regular
        from kdcache.store.files.segment import HOST
        import re
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", HOST)[:64] or "host"
        self.path = os.path.join(parts_dir, f"fleet-{host}-{os.getpid()}.lock")
        fd, _ = open_regular(self.path, mine=True, flags=os.O_RDWR | os.O_CREAT)
        self.fh = os.fdopen(fd, "r+")
        fcntl.flock(self.fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        self.fh.write(json.dumps({"pid": os.getpid(), "host": HOST, "shard": "fleet", "started": time.time()}))
        self.fh.flush()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, args=(every,), name="kdcache-fleet-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self, every):
        while not self._stop.wait(every):
            try:
                os.utime(self.path)
            except OSError:
                pass

    def release(self):
        self._stop.set()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        self.fh.close()


def prepare(path, spec):
    """The cache's parts folder, ready for parts (its manifest written); None when the cache is
    finished already (checked to be this spec's)."""
    from kdcache.store.write.settle import settle
    from kdcache.store.files.paths import final_path
    from kdcache.store.write.writer import check_final_matches, prepare_parts
    settle(path)
    if os.path.lexists(final_path(path)):
        check_final_matches(final_path(path), spec)
        return None
    return prepare_parts(path, spec)


def owed(parts_dir, spec):
    from kdcache.store.files.segment import scan_done
    return scan_done(parts_dir, spec)


def finish(path, spec, parts_dir):
    """Compact the cache when every key is covered: compaction checks every part first and sets a damaged
    one aside (its keys are owed again, NOTE [parts]). Returns (complete, {"damaged": [names set aside]})."""
    from kdcache.store.write.compact import finalize
    from kdcache.store.files.paths import final_path
    if os.path.exists(final_path(path)):
        return True, {"damaged": []}
    try:
        before = set(_set_aside(parts_dir))
        complete = finalize(path, spec)  # counts the committed keys first: a cache not yet covered is left as it is
    except FileNotFoundError:  # another driver compacted it meanwhile
        return os.path.exists(final_path(path)), {"damaged": []}
    damaged = [] if complete else sorted(set(_set_aside(parts_dir)) - before)
    for name in damaged:
        log.warning("part %s is damaged: set aside, its keys are computed again", name)
    return complete, {"damaged": damaged}


def _set_aside(parts_dir):
    from kdcache.store.osutil import listdir
    return [n.split(".h5.")[0].lstrip(".") for n in listdir(parts_dir) if ".h5.damaged-" in n]


class Tally:
    """What an engine's tasks did: counts, every task's result, the work and finish seconds."""

    def __init__(self):
        self.tasks = self.retries = self.duplicates = self.rows_written = self.damaged_parts = 0
        self.outs, self.nodes, self.hosts = [], set(), set()
        self.work_s = self.finish_s = 0.0

    def add(self, out):
        """One task's result (TaskRunner.run); True when the cache was found finished (nothing more owed)."""
        self.tasks += 1
        self.outs.append(out)
        if out["outcome"] == "published":
            self.rows_written += out["rows"]
        else:
            self.duplicates += 1
        self.nodes.add(out["node"])
        self.hosts.add(out["host"])
        return out["outcome"] == "finished"

    def figures(self, seconds, *counts):
        """The result's figures: `counts` (names of the counters) and the rates and times."""
        return {**{k: getattr(self, k) for k in counts},
                "rows_per_s": round(self.rows_written / seconds, 1) if seconds else 0.0,
                "work_rows_per_s": round(self.rows_written / self.work_s, 1) if self.work_s else 0.0,
                "work_s": round(self.work_s, 3), "finish_s": round(self.finish_s, 3),
                "task_costs": task_costs(self.outs), "seconds": round(seconds, 3)}


def fill_rounds(path, spec, parts_dir, tally, run, *, block_rows, shard=(0, 1), desc, quiet):
    """Plan the owed tasks, `run(tasks, tally, bar)` them, finish; again while a damaged part was set aside
    (FINISH_ROUNDS at most). Returns whether the cache is complete."""
    from tqdm import tqdm
    complete = False
    for _ in range(FINISH_ROUNDS):
        tasks = plan(spec, owed(parts_dir, spec), block_rows, shard)
        bar = tqdm(total=sum(t[2].size for t in tasks), unit="row", desc=desc, disable=quiet, dynamic_ncols=True)
        w0 = time.perf_counter()
        try:
            run(tasks, tally, bar)
        finally:
            bar.close()
        f0 = time.perf_counter()
        tally.work_s += f0 - w0
        complete, report = finish(path, spec, parts_dir)
        tally.finish_s += time.perf_counter() - f0
        tally.damaged_parts += len(report["damaged"])
        if complete or not report["damaged"]:
            break
    return complete


def scratch_dir(args):
    """Where this host writes a part before publishing it: --scratch, else a folder in the temp dir."""
    base = args.scratch or os.path.join(tempfile.gettempdir(), "kdcache-scratch")
    return os.path.join(os.path.abspath(base), f"{socket.gethostname()}-{os.getpid()}")


def run_local(args, log, path, spec, result, t0):
    """--scratch (with --shard i/n): this process runs its tasks, publishing each as a part."""
    parts_dir = prepare(path, spec)
    if parts_dir is None:
        result.update(reused=True, complete=True, cache_path=path + ".h5")
        return result
    lock = FleetLock(parts_dir)
    scratch = scratch_dir(args)
    tally = Tally()
    runner = None

    def run(tasks, tally, bar):
        nonlocal runner
        if tasks and runner is None:
            runner = TaskRunner(args, spec.fingerprint, parts_dir, scratch, threads=args.teacher_threads)
        for a, b, keys in tasks:
            out = runner.run(a, b, keys)
            bar.update(out["rows"])
            if tally.add(out):
                break
    try:
        complete = fill_rounds(path, spec, parts_dir, tally, run, block_rows=args.block_rows,
                               shard=tuple(args.shard), desc="teacher (parts)", quiet=args.quiet)
    finally:
        lock.release()
        shutil.rmtree(scratch, ignore_errors=True)
    result.update(tally.figures(time.perf_counter() - t0, "tasks", "duplicates", "rows_written", "damaged_parts"),
                  complete=bool(complete), engine="local", shard=str(args.shard),
                  teacher_forwards=runner.teacher.forwards if runner else 0, reused=runner is None,
                  cache_path=path + (".h5" if complete else ".parts"))
    return result
