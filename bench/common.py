"""What every benchmark shares: the machine, tables and verdicts, JSON reports, child processes, CPU and memory."""
import datetime
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

# No numpy or h5py at module level: a benchmark imports this module before it fixes its threads,
# and numpy's BLAS reads the thread count once, when it loads.

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OPENCV_FOR_THREADS_NUM")
BUSY_CORES = 0.25  # other processes' average CPU use above which a report warns


class BenchError(RuntimeError):
    """A step of a benchmark failed; the message names it and quotes the tool's error."""


def make_log(name):
    """log(msg): progress on stderr, so that stdout holds only the report's tables."""
    def log(msg):
        print(f"[{name} {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
    return log


# -- threads and the environment of child processes ----------------------------------------------
def limit_threads(env, threads=1, *, force=True):
    """Fix the BLAS/OpenMP/OpenCV thread counts in env (os.environ before numpy or MXNet loads: both read
    them once, at import; OMP_NUM_THREADS limits MXNet's compute threads, OPENCV_FOR_THREADS_NUM the
    pool of the OpenCV inside it, as kdcache.threads does). force=False keeps the user's."""
    for var in THREAD_VARS:
        env[var] = str(threads) if force or var not in env else env[var]
    env.setdefault("MXNET_SUBGRAPH_VERBOSE", "0")
    return env


def child_env(threads=1, **extra):
    """Every child's environment: `threads` compute threads, no variable that changes a tool behind its options."""
    env = dict(os.environ)
    # Until the project is installed (pip install -e .) children find its packages through
    # PYTHONPATH. This is the one place it is set: drop it here once installing is the rule.
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    limit_threads(env, threads)
    for var in ("KDCACHE_TEACHER_THREADS", "KDCACHE_DIR", "MXNET_CPU_WORKER_NTHREADS"):
        env.pop(var, None)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.update({k: str(v) for k, v in extra.items()})
    return env


def python_m(module, *args):
    """argv of `python -m module args...` with this interpreter."""
    return [sys.executable, "-m", module, *map(str, args)]


def last_json(stdout, what):
    """The last line of an output that is a JSON object: a child's result, after any progress lines."""
    for line in reversed(stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise BenchError(f"bench: {what} printed no JSON line; its output ended with:\n{stdout[-2000:]}")


# -- running child processes -----------------------------------------------------------------------
class _Child:
    """One started process: its output files, its timeout, its memory sampler, where finish() measures from."""

    def __init__(self, argv, what, *, env, cwd, log_dir, rss, timeout):
        self.reading = threading.Lock()  # output(): the reaping thread and stop_all may both call it
        self.what, self.argv, self.timeout, self.timed_out, self.poller = what, argv, timeout, False, None
        if log_dir:
            tag = what.replace(" ", "_").replace("/", "_")
            self.out, self.err = (open(os.path.join(log_dir, tag + ext), "w+") for ext in (".out", ".err"))
        else:
            self.out, self.err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
        self.snapshot, self.load0 = cpu_snapshot(), os.getloadavg()
        self.launched, self.t0 = time.time(), time.perf_counter()
        try:
            self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self.out, stderr=self.err,
                                         start_new_session=True)
        except BaseException:
            self.output()
            raise
        if rss is not None:
            self.poller = PeakPoller(self.proc.pid, **rss)
            self.poller.start()
        self.timer = threading.Timer(timeout, self.kill, kwargs={"timed_out": True})
        self.timer.daemon = True
        self.timer.start()

    def kill(self, timed_out=False):
        self.timed_out = self.timed_out or timed_out
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the child's own session: it and what it started
        except OSError:
            pass

    def halt(self):
        """Stop the timer and the memory sampler (before the process is reaped or killed)."""
        self.timer.cancel()
        if self.poller is not None:
            self.poller.stop()

    def output(self):
        """(stdout, stderr) of the finished process; closes its files (a second call, from stop_all racing
        the thread that reaped it, gets empty texts)."""
        texts = []
        with self.reading:
            for fh in (self.out, self.err):
                if fh.closed:
                    texts.append("")
                    continue
                fh.seek(0)
                texts.append(fh.read())
                fh.close()
        return texts


class Children:
    """The processes a benchmark starts. Each runs in a session of its own, so that its timeout or
    stop_all() stops it together with what it started, by its own process group (never by name)."""

    def __init__(self):
        self.live = {}  # pid -> _Child, until reaped
        # start() and stop_all() take turns: a child a thread starts while the run is being stopped (a
        # SIGTERM, a failure) is either in `live` when stop_all looks, or never started
        self.lock, self.stopped = threading.Lock(), False

    def start(self, argv, what, *, env=None, cwd=ROOT, log_dir=None, rss=None, timeout=900):
        """Start argv (env: child_env() by default); its output to log_dir/<what>.out, .err (kept for
        inspection), else to unnamed temporary files. rss: PeakPoller's keywords, to sample its memory."""
        with self.lock:
            if self.stopped:
                raise BenchError(f"bench: {what} not started: the run is being stopped")
            c = _Child(argv, what, env=child_env() if env is None else env, cwd=cwd, log_dir=log_dir, rss=rss,
                       timeout=timeout)
            self.live[c.proc.pid] = c
        return c

    def finish(self, c, *, json_line=True):
        """Its last JSON line (json_line; else {}) plus _wall_s, _launched (time.time() at the start), _cpu
        (cpu_between, the CPU time of its process tree per wall second, the 1-min load average at both
        ends) and, if sampled, _peak_rss_mib. BenchError if it failed or ran over its timeout."""
        try:
            _, status, ru = os.wait4(c.proc.pid, 0)  # not Popen.wait(): wait4 also gives the tree's CPU time
        finally:
            c.halt()
        self.live.pop(c.proc.pid, None)  # stop_all may have taken it already
        c.proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - c.t0
        cpu = cpu_between(c.snapshot, cpu_snapshot())
        stdout, stderr = c.output()
        if c.proc.returncode != 0:
            why = f"ran over {c.timeout} s and was stopped" if c.timed_out else f"exited with {c.proc.returncode}"
            raise BenchError(f"bench: {c.what} {why}: {' '.join(map(str, c.argv))}\n{stderr[-3000:]}")
        res = last_json(stdout, c.what) if json_line else {}
        res.update(_wall_s=wall, _launched=c.launched, _cpu={
            **cpu, "tree_cores": (ru.ru_utime + ru.ru_stime) / wall if wall else None,
            "loadavg_1m_start": round(c.load0[0], 2), "loadavg_1m_end": round(os.getloadavg()[0], 2)})
        if c.poller is not None:
            res["_peak_rss_mib"] = c.poller.peaks_mib()
        return res

    def run(self, argv, what, *, json_line=True, **kw):
        """start() then finish()."""
        return self.finish(self.start(argv, what, **kw), json_line=json_line)

    def stop_all(self):
        """Kill every child not yet reaped, with what it started, and reap it; start no other after it."""
        with self.lock:
            self.stopped = True
            children = list(self.live.values())
        for c in children:
            c.halt()
            c.kill()
            c.proc.wait()
            c.output()
        self.live.clear()


def finished_tasks(journal):
    """{repr(key): result} of the tasks a journal (JSON lines, see run_tasks) holds; {} without one. A last
    line cut short by a crash is left out: that task runs again."""
    out = {}
    try:
        with open(journal) as fh:
            for line in fh:
                try:
                    row = json.loads(line)
                except ValueError:
                    continue
                out[row["key"]] = row["result"]
    except FileNotFoundError:
        pass
    return out


def run_tasks(kids, jobs, tasks, log, journal=None):
    """{key: result} of tasks run `jobs` at a time: each time a slot is free, the first task in the order given
    whose "after" tasks have all finished starts (a task waiting for another holds no slot). A task is a dict:
    key, argv, what, timeout, and optionally after (keys of earlier tasks), json_line (False: the child prints
    no JSON line), then (a function of the result, run before scratch is removed, whose return is the result)
    and scratch (the task's own folder: removed before it starts, as a run stopped by a kill may have left it,
    and once it ends). The first failure stops the others and is raised; so
    does a Ctrl-C, the children then stopped by the caller (Children.stop_all).

    journal: a file each finished task's result is appended to (one JSON line, flushed to disk) and read back
    first: a task it holds is not run again, so a long benchmark stopped half way resumes where it was."""
    keys = {t["key"] for t in tasks}
    for t in tasks:
        missing = [k for k in t.get("after", ()) if k not in keys]
        if missing:
            raise BenchError(f"bench: {t['what']} waits for {missing}, which is not among the tasks")
    pending, done, results, errors, running, threads = list(tasks), set(), {}, [], [0], []
    if journal:
        old = finished_tasks(journal)
        for t in [t for t in pending if repr(t["key"]) in old]:
            pending.remove(t)
            done.add(t["key"])
            results[t["key"]] = old[repr(t["key"])]
        if done:
            log(f"{len(done)} task(s) already finished in {journal}: not run again")
    cond = threading.Condition()

    def one(t):
        try:
            if t.get("scratch"):  # what a run stopped by a kill left of this task: it starts afresh
                shutil.rmtree(t["scratch"], ignore_errors=True)
            res = kids.run(t["argv"], t["what"], timeout=t["timeout"], json_line=t.get("json_line", True))
            results[t["key"]] = t["then"](res) if t.get("then") else res
            if journal:
                with cond, open(journal, "a") as fh:
                    fh.write(json.dumps({"key": repr(t["key"]), "result": results[t["key"]]}) + "\n")
                    fh.flush()
                    os.fsync(fh.fileno())
            log(f"{t['what']}: done in {res['_wall_s']:.0f} s")
        except BaseException as e:
            errors.append(e)
            for c in list(kids.live.values()):
                c.kill()
        finally:
            if t.get("scratch"):
                shutil.rmtree(t["scratch"], ignore_errors=True)  # a student's checkpoints: its metrics are kept
            with cond:
                done.add(t["key"])
                running[0] -= 1
                cond.notify_all()

    with cond:
        while pending and not errors:
            ready = next((t for t in pending if all(k in done for k in t.get("after", ()))), None)
            if ready is None or running[0] >= jobs:
                cond.wait()
                continue
            pending.remove(ready)
            running[0] += 1
            threads.append(threading.Thread(target=one, args=(ready,), daemon=True))
            threads[-1].start()
    for th in threads:
        th.join()
    if errors:
        raise errors[0]
    return results


# -- how busy the machine was ----------------------------------------------------------------------
_CLK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_snapshot():
    """(time, busy CPU s of the machine, steal s, CPU s of this process and its reaped children)."""
    try:
        with open("/proc/stat") as fh:
            f = [int(v) for v in fh.readline().split()[1:]]
        busy, steal = (f[0] + f[1] + f[2] + f[5] + f[6]) / _CLK, (f[7] if len(f) > 7 else 0) / _CLK
    except (OSError, ValueError, IndexError):
        return None
    own = sum(getattr(resource.getrusage(w), a) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for a in ("ru_utime", "ru_stime"))
    return time.perf_counter(), busy, steal, own


def cpu_between(a, b):
    """Average cores this benchmark's processes used, cores other processes used, and steal."""
    if a is None or b is None or b[0] <= a[0]:
        return {"own_cores": None, "other_cores": None, "steal_cores": None}
    wall, own = b[0] - a[0], b[3] - a[3]
    return {"own_cores": own / wall, "other_cores": max(0.0, (b[1] - a[1]) - own) / wall,
            "steal_cores": (b[2] - a[2]) / wall}


def busy_warning(worst, during):
    """The warning a report prints when other processes kept more than BUSY_CORES busy ("" if not)."""
    if worst is None or worst <= BUSY_CORES:
        return ""
    return (f"Warning: other processes kept up to {worst:.2f} of {os.cpu_count()} cores busy on average during "
            f"{during}; its figures understate this machine.\n")


# -- peak memory -------------------------------------------------------------------------------------
def _ppid_map():
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    s = fh.read()
                out[int(d)] = int(s[s.rindex(")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                pass
    return out


def _status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


class PeakPoller(threading.Thread):
    """Every `every` s, the peak resident set (VmHWM) of a process and its descendants per role: `role` for
    the process; for a descendant, the first of `roles` ({role: word}) its command line holds, else "other"."""

    def __init__(self, pid, role="main", roles=None, every=0.2):
        super().__init__(daemon=True)
        self.pid, self.role, self.words, self.every = pid, role, dict(roles or {}), every
        self.peak_kib, self.roles = {}, {}
        self._halt = threading.Event()

    def run(self):
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.every)

    def role_of(self, pid):
        if pid == self.pid:
            return self.role
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            return None
        return next((r for r, word in self.words.items() if word.encode() in cmd), "other")

    def sample(self):
        parents = _ppid_map()
        family, frontier = {self.pid}, [self.pid]
        while frontier:
            kids = [p for p, pp in parents.items() if pp in frontier and p not in family]
            family.update(kids)
            frontier = kids
        for pid in family:
            hwm = _status_kib(pid, "VmHWM") or _status_kib(pid, "VmRSS")
            if hwm is None:
                continue
            if self.roles.get(pid, "other") == "other":  # again until exec'd: a fork shows its parent's cmdline
                role = self.role_of(pid)
                if role is None:
                    continue
                if role != self.roles.get(pid, role):
                    self.peak_kib.pop(pid, None)  # exec'd: the fork's pages were its parent's
                self.roles[pid] = role
            self.peak_kib[pid] = max(self.peak_kib.get(pid, 0), hwm)

    def stop(self):
        self._halt.set()
        self.join()

    def peaks_mib(self):
        out = {}
        for pid, kib in self.peak_kib.items():
            role = self.roles[pid]
            out[role] = max(out.get(role, 0.0), kib / 1024)
        return {k: round(v, 1) for k, v in out.items()}


# -- statistics --------------------------------------------------------------------------------------
def spread(values):
    """Centre and spread of repeated measurements (None ones, not measured, left out): n, mean,
    median, std (0.0 for one value), min and max; None for each when nothing was measured."""
    v = [x for x in values if x is not None]
    if not v:
        return {"n": 0, "mean": None, "median": None, "std": None, "min": None, "max": None}
    return {"n": len(v), "mean": statistics.fmean(v), "median": statistics.median(v),
            "std": statistics.stdev(v) if len(v) > 1 else 0.0, "min": min(v), "max": max(v)}


# -- the machine ---------------------------------------------------------------------------------------
def machine(mxnet=False, omp_num_threads=None):
    """What the figures were measured on. mxnet=True adds MXNet's version (read from its package
    metadata: this process need not import it); omp_num_threads: what the MXNet children run with."""
    import h5py
    import numpy as np
    try:
        with open("/proc/cpuinfo") as fh:
            model = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), "")
    except OSError:
        model = ""
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "processor": platform.processor() or platform.machine(), "cpu_model": model, "machine": platform.machine(),
        "system": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "numpy": np.__version__, "h5py": h5py.__version__, "hdf5": h5py.version.hdf5_version,
        "omp_num_threads": str(omp_num_threads) if omp_num_threads else os.environ.get("OMP_NUM_THREADS"),
        **({"mxnet": _mxnet_version()} if mxnet else {}),
    }


def _mxnet_version():
    try:
        from importlib.metadata import version
        return version("mxnet")
    except Exception:  # the report still names everything else
        return "?"


def machine_line(m):
    cpu = f"{m['cpu_model']}, " if m["cpu_model"] else ""
    return (f"machine: {m['cpus']} CPUs ({m['cpus_usable']} usable), {cpu}{m['processor']}/{m['machine']}, "
            f"{m['system']}, Python {m['python']}, numpy {m['numpy']}, h5py {m['h5py']} "
            f"(HDF5 {m['hdf5']}), OMP_NUM_THREADS={m['omp_num_threads']}"
            + (f", MXNet {m['mxnet']}" if "mxnet" in m else ""))


# -- what a report prints --------------------------------------------------------------------------------
def md_table(headers, rows, pad=True):
    """A markdown table; pad=False leaves the cells unaligned (an empty cell is then one space)."""
    cells = [[str(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if pad else 1 for i, h in enumerate(headers)]

    def line(r):
        texts = [x.ljust(w) if pad else x for x, w in zip(r, widths)]
        return "|" + "|".join(f" {t} " if t else " " for t in texts) + "|"
    return "\n".join([line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
                     + [line(r) for r in cells])


def rate(x):
    """Rows per second, human-readable."""
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def verdict(value, floor, higher_is_better=True):
    ok = value >= floor if higher_is_better else value <= floor
    return "PASS" if ok else "MISS"


def floors_line(missed):
    return "All floors met." if not missed else f"Floors missed: {', '.join(missed)}."


def heading(title, quick, runtime_s):
    return f"# {title} ({'quick' if quick else 'full'} run, {runtime_s:.0f} s)\n"


def section(title, table, note):
    return f"## {title}\n\n{table}\n\n{note}\n"


# NOTE (generated tables): a benchmark's tables in docs/benchmarks.md are render(report) of its module,
# a pure function of its JSON report; its main prints the same render(report), and bench.docs writes
# it into the manual, so that what a run prints and what the manual shows cannot drift apart.
def rendered(tables):
    """The (title, markdown table) pairs of a render(report) as markdown, each table under its title."""
    return "\n\n".join(f"{title}\n\n{table}" if title else table for title, table in tables)


def for_the_manual(tables):
    """What a benchmark's main prints last: its render(report), as docs/benchmarks.md shows it."""
    return "The manual's tables (docs/benchmarks.md; python -m bench.docs writes them from the JSON report):\n\n" \
        + rendered(tables) + "\n"


def run_line(report, other_cores=None):
    """The line that dates a report's figures: its day, run time, machine and the other processes' load."""
    m = report.get("machine") or {}
    where = ", ".join(x for x in (m.get("cpu_model"), f"{m['cpus']} vCPUs" if m.get("cpus") else "") if x)
    parts = [f"{report['runtime_s']:.0f} s" if report.get("runtime_s") is not None else "", where,
             "" if other_cores is None else f"other processes used at most {other_cores:.2f} cores"]
    quick = " (quick)" if report.get("quick") else ""
    return f"Run of {str(report.get('date', '?'))[:10]}{quick}: " + "; ".join(x for x in parts if x) + "."


# -- where a run writes ------------------------------------------------------------------------------------
def scratch_dir(tmp, prefix):
    """A new directory for a run's files, in tmp (made if need be) or the system's; absolute: children run elsewhere."""
    if tmp:
        os.makedirs(tmp, exist_ok=True)
    return os.path.abspath(tempfile.mkdtemp(prefix=prefix, dir=tmp))


def run_in_scratch(args, prefix, run, *params):
    """run(kids, args, *params, work) in a scratch folder (args.tmp, else a temporary one removed after),
    every child process stopped whatever happens; a BenchError is printed as one line and gives None."""
    tmp = getattr(args, "tmp", None)  # a benchmark without --tmp works in a temporary folder
    work = scratch_dir(tmp, prefix)
    kids = Children()
    # A SIGTERM (kill, a CI's time limit) ends the run as Ctrl-C does: through the finally below, so the children
    # (each in its own session, which a signal to this process's group does not reach) are stopped too.
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return run(kids, args, *params, work)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    finally:
        kids.stop_all()
        signal.signal(signal.SIGTERM, previous)
        if not tmp:
            shutil.rmtree(work, ignore_errors=True)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def command_line(prog, argv):
    """The command a report was made by: prog and its arguments (sys.argv's when argv is None)."""
    rest = list(sys.argv[1:] if argv is None else argv)
    return " ".join([prog, *map(str, rest)])


def utc_now():
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_report(path, report):
    """The JSON report, written under a temporary name and renamed into place."""
    from kdcache.store.osutil import write_json_atomic
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_json_atomic(path, report, indent=1, default=_json_default, end="\n", fsync=False)


def _json_default(x):
    import numpy as np
    if isinstance(x, np.generic):
        return x.item()
    raise TypeError(f"{type(x).__name__} is not JSON serializable")
