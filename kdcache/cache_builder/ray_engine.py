"""--engine ray: the producer's tasks (cache_builder.fleet) run by Ray actors on any number of hosts.

The driver (this process) plans the owed blocks, starts actors that each load the data set and the
teacher once (with --actor-cpus threads, the CPUs Ray gives it), and hands each actor one task at a
time. An actor whose process dies is restarted by Ray (max_restarts=-1: on another node when its
node is gone) and the driver gives the task again (counted as a retry); a task published twice is
dropped the second time (NOTE [parts]). Without --address the driver starts a local Ray cluster on
127.0.0.1 for its own lifetime and stops it after.
"""
import collections
import logging
import os
import time

from kdcache.cache_builder.errors import ProducerError
from kdcache.cache_builder.fleet import FleetLock, Tally, TaskRunner, fill_rounds, prepare

TASK_RETRIES = 5  # gives of one task to actors that died before the driver gives up on it
STALL_S = 300.0   # seconds with tasks owed and no actor able to take one before the driver gives up


def import_ray():
    from kdcache.extras import require
    return require("ray", "--engine ray", ProducerError)


class PartActor:
    """A Ray actor: one TaskRunner, loaded once; `run` computes and publishes one task's part."""

    def __init__(self, args, fingerprint, parts_dir, threads):
        from kdcache.cache_builder.fleet import scratch_dir
        self.runner = TaskRunner(args, fingerprint, parts_dir, scratch_dir(args), threads=threads)

    def ready(self):
        return os.getpid()

    def run(self, a, b, keys):
        return self.runner.run(a, b, keys)

    def forwards(self):
        return self.runner.teacher.forwards


def start(ray, args, log):
    """Connect to the cluster at --address, or start a local one on 127.0.0.1; True when started here."""
    quiet = dict(log_to_driver=False, logging_level=logging.WARNING, include_dashboard=False)
    if args.address:
        log.info("connecting to the Ray cluster at %s", args.address)
        local = {"_node_ip_address": "127.0.0.1"} if _loopback(args.address) else {}
        ray.init(address=args.address, log_to_driver=False, logging_level=logging.WARNING, **local)
        return False
    cpus = args.cores
    log.info("starting a local Ray cluster on 127.0.0.1 with %d CPU(s) for this command", cpus)
    ray.init(address="local", num_cpus=cpus, _node_ip_address="127.0.0.1", **quiet)
    return True


def _loopback(address):
    """True when ADDRESS (HOST:PORT, ray://HOST:PORT, or auto: the cluster `ray start` made here) is on loopback."""
    import ipaddress
    if address == "auto":
        try:
            with open(os.path.join(os.environ.get("RAY_TMPDIR", "/tmp/ray"), "ray_current_cluster")) as fh:
                address = fh.read().strip()
        except OSError:
            return False
    host = address.split("://")[-1].rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_ray(args, log, path, spec, result, t0):
    from kdcache import signals
    if args.address and _loopback(args.address):
        # Ray rewrites a cluster address of 127.0.0.1 to this machine's first non-loopback address (its
        # node address "from the perspective" of the network) and then waits forever for a cluster that
        # listens on loopback only. Its one switch for a loopback node address is this variable, read
        # when ray is imported (ray._private.services.get_node_ip_address).
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = import_ray()
    parts_dir = prepare(path, spec)
    if parts_dir is None:
        result.update(reused=True, complete=True, cache_path=path + ".h5", engine="ray")
        return result
    lock = FleetLock(parts_dir)
    started = False
    tally = Tally()
    ready_s = 0.0
    actors = []
    complete = False
    try:
        started = start(ray, args, log)
        cpus = int(ray.cluster_resources().get("CPU", 1))
        n = args.actors or max(1, cpus // args.actor_cpus)
        env = {"OMP_NUM_THREADS": str(args.actor_cpus), "OPENCV_FOR_THREADS_NUM": str(args.actor_cpus),
               "PYTHONDONTWRITEBYTECODE": "1"}
        Actor = ray.remote(PartActor).options(num_cpus=args.actor_cpus, max_restarts=-1, max_task_retries=0,
                                              runtime_env={"env_vars": env})
        log.info("%d actor(s) of %d CPU(s) each on a cluster of %d CPU(s); tasks of %d rows", n, args.actor_cpus,
                 cpus, args.block_rows)
        actors = [Actor.remote(args, spec.fingerprint, parts_dir, args.actor_cpus) for _ in range(n)]
        _ready(ray, actors, signals)
        ready_s = time.perf_counter() - t0
        complete = fill_rounds(path, spec, parts_dir, tally,
                               lambda tasks, tally, bar: _dispatch(ray, actors, tasks, tally, bar, signals, log),
                               block_rows=args.block_rows, desc="teacher (ray)", quiet=args.quiet)
        forwards = 0
        for a in actors:
            try:
                forwards += ray.get(a.forwards.remote(), timeout=60)
            except Exception:  # an actor restarted since: its forwards are counted in rows written
                pass
    finally:
        lock.release()
        for a in actors:
            try:
                ray.kill(a)
            except Exception:  # the cluster is going down anyway
                pass
        if started:
            ray.shutdown()
    result.update(tally.figures(time.perf_counter() - t0, "tasks", "retries", "duplicates", "rows_written",
                                "damaged_parts"),
                  engine="ray", complete=bool(complete), actors=len(actors), nodes=len(tally.nodes),
                  hosts=sorted(tally.hosts), teacher_forwards=forwards, reused=False, start_s=round(ready_s, 3),
                  cache_path=path + (".h5" if complete else ".parts"))
    return result


def _cause(e):
    return getattr(e, "cause", None) or e


def _ready(ray, actors, signals):
    """Every actor loaded: a data set or teacher that cannot be loaded on a host is one error line."""
    pending = [a.ready.remote() for a in actors]
    while pending:
        signals.check()
        done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                raise ProducerError(f"an actor could not load the teacher or the data set: {_one_line(e)}") from None


def _one_line(e):
    text = str(_cause(e))
    for marker in ("ProducerError: ", "StoreError: ", "TeacherError: ", "DatasetError: "):
        if marker in text:
            text = text.rsplit(marker, 1)[1]
    return text.strip().splitlines()[0][:400] if text.strip() else type(e).__name__


def _dispatch(ray, actors, tasks, tally, bar, signals, log):
    """Give every task to an actor, one at a time per actor, until all are published. An actor whose task
    was lost (its process or node died) is asked `ready()` first: Ray restarts it (on another node when its
    node is gone), and it takes tasks again once that answers; meanwhile the others take the queue."""
    queue = collections.deque(tasks)
    tries = collections.Counter()
    inflight = {}  # ref -> (actor index, task, or None for a readiness probe)
    idle_since = None

    def give(i):
        if queue:
            a, b, keys = task = queue.popleft()
            inflight[actors[i].run.remote(a, b, keys)] = (i, task)

    for i in range(len(actors)):
        give(i)
    lost = tuple(getattr(ray.exceptions, n) for n in ("RayActorError", "WorkerCrashedError", "ObjectLostError",
                                                      "NodeDiedError", "OwnerDiedError") if hasattr(ray.exceptions, n))
    while queue or any(t is not None for _, t in inflight.values()):
        signals.check()
        working = any(t is not None for _, t in inflight.values())
        if working:
            idle_since = None
        elif idle_since is None:
            idle_since = time.monotonic()
        elif time.monotonic() - idle_since > STALL_S:
            raise ProducerError(f"no actor could take a task for {STALL_S:.0f} s ({len(queue)} task(s) owed): the "
                                f"cluster has no free CPUs for an actor of --actor-cpus; every part published so "
                                f"far is kept; add nodes or run the same command again")
        ready, _ = ray.wait(list(inflight), num_returns=1, timeout=1.0)
        for ref in ready:
            i, task = inflight.pop(ref)
            if task is None:  # a probe: the actor is back (or died again: probed again)
                try:
                    ray.get(ref)
                except lost:
                    inflight[actors[i].ready.remote()] = (i, None)
                    continue
                give(i)
                continue
            a, b, keys = task
            try:
                out = ray.get(ref)
            except lost as e:
                tries[a] += 1
                tally.retries += 1
                if tries[a] > TASK_RETRIES:
                    raise ProducerError(f"task [{a}, {b}) was lost {tries[a]} times (its actor died each time: "
                                        f"{_one_line(e)}): every part published so far is kept; run the same "
                                        f"command again") from None
                log.warning("task [%d, %d): its actor died (%s); given again", a, b, type(e).__name__)
                queue.appendleft(task)
                inflight[actors[i].ready.remote()] = (i, None)
                for j in _idle(actors, inflight):  # an actor with nothing to do takes it at once
                    give(j)
                continue
            except ray.exceptions.RayTaskError as e:
                raise ProducerError(f"task [{a}, {b}): {_one_line(e)}") from None
            bar.update(out["rows"])
            if tally.add(out):  # the cache is finished (another driver): nothing more is owed
                queue.clear()
            give(i)


def _idle(actors, inflight):
    busy = {i for i, _ in inflight.values()}
    return [i for i in range(len(actors)) if i not in busy]
