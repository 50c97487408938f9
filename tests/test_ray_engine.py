"""--engine ray on a real local Ray cluster of two nodes (each its own raylet and CPU, one shared cache
folder, each actor its own scratch): the cache equals one host's build, bit for bit; a trainer reads
behind the actors; an actor killed with -9, a node removed, the driver killed with -9 and run again and
two drivers on one cache lose nothing; every node listens on loopback only."""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT
from tests.helpers import CHILD_ENV, assert_same_cache, is_loopback, listening

# 30,000 keys in 59 tasks of 512 (a multiple of the batch of 128: bit for bit one host's batches): a few seconds
# of work for two one-CPU actors, long enough to kill something mid-run
DATA = "synthetic:n=30000,classes=10,shape=1x8x8"
N = 30000
BLOCK = 512
pytestmark = pytest.mark.slow


class ClusterProcess:
    """tests/ray_cluster.py's two-node cluster, in a process of its own (Ray's threads stay out of this one)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.ray_cluster"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=ENV, cwd=ROOT)
        self.address = self._reply()["address"]

    def _reply(self):
        line = self.proc.stdout.readline()
        assert line, "the Ray cluster's process ended"
        return json.loads(line)

    def command(self, cmd):
        self.proc.stdin.write(cmd + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def close(self):
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


@pytest.fixture(scope="module")
def cluster():
    """Two nodes on 127.0.0.1, one CPU each, token authentication on (Ray's default for local clusters)."""
    c = ClusterProcess()
    yield c
    c.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, teacher):
    """One host's build of the same cache (one teacher thread, as each actor's)."""
    d = tmp_path_factory.mktemp("one-host")
    out = run("--teacher", teacher, "--dataset", DATA, "--threads", "1", "--cache-dir", d)
    return out["cache_path"]


def command(*args):
    return [sys.executable, "-m", "kdcache.cache_builder", "--quiet", "--json", *map(str, args)]


ENV = {**CHILD_ENV, "RAY_ADDRESS": ""}


def run(*args, check=True, timeout=600):
    r = subprocess.run(command(*args), capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


def start(*args):
    return subprocess.Popen(command(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV,
                            cwd=ROOT)


def ray_args(c, teacher, cache_dir, *more):
    return ("--engine", "ray", "--address", c.address, "--teacher", teacher, "--dataset", DATA,
            "--block-rows", BLOCK, "--cache-dir", cache_dir, *more)


def parts_of(cache_dir):
    return glob.glob(os.path.join(str(cache_dir), "*.parts", "part-*.h5"))


def wait_for(cond, what, timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"{what} did not happen within {timeout} s")


def ray_pids():
    out = set()
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = open(f"/proc/{p}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "site-packages/ray/" in cmd or cmd.startswith("ray::"):
            out.add(int(p))
    return out


def actor_pids():
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                if open(f"/proc/{p}/cmdline", "rb").read().startswith(b"ray::PartActor"):
                    out.append(int(p))
            except OSError:
                pass
    return out


def finish(p, timeout=600):
    out, err = p.communicate(timeout=timeout)
    assert p.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def test_two_nodes_fill_the_cache_one_host_builds_and_a_trainer_reads_behind_them(cluster, teacher, reference,
                                                                                 tmp_path):
    shared = tmp_path / "shared"
    p = start(*ray_args(cluster, teacher, shared))
    # the trainer reads behind the actors: the parts folder exists once the driver has planned the work
    wait_for(lambda: glob.glob(str(shared / "*.parts" / "fleet-*.lock")), "the driver's lock")
    trainer = subprocess.run([sys.executable, "-m", "kdcache.trainer", "--teacher", teacher, "--dataset", DATA,
                              "--cache-dir", str(shared), "--no-producer", "--epochs", "1", "--run", "behind",
                              "--runs-dir", str(tmp_path / "runs"), "--quiet"], capture_output=True, text=True, env=ENV, cwd=ROOT,
                             timeout=600)
    listeners = listening(ray_pids())
    out, _ = finish(p)
    assert trainer.returncode == 0, trainer.stderr[-3000:]
    metrics = json.load(open(tmp_path / "runs" / "behind" / "metrics.json"))
    assert metrics["teacher_forwards"] == 0 and metrics["fingerprint"] == out["fingerprint"]
    assert out["complete"] and out["nodes"] == 2 and out["actors"] == 2
    assert out["tasks"] == -(-N // BLOCK) and out["rows_written"] == N and out["retries"] == 0
    assert_same_cache(reference, out["cache_path"])
    assert listeners and all(is_loopback(h) for _, h in listeners), listeners
    again = run(*ray_args(cluster, teacher, shared))
    assert again["reused"] and again["rows_written"] == 0


def test_an_actor_killed_with_minus_9_mid_task_loses_nothing(cluster, teacher, reference, tmp_path):
    shared = tmp_path / "shared"
    p = start(*ray_args(cluster, teacher, shared))
    wait_for(lambda: len(parts_of(shared)) >= 2, "two published parts")
    victims = wait_for(actor_pids, "an actor")
    os.kill(victims[0], signal.SIGKILL)
    out, err = finish(p)
    assert out["complete"] and out["retries"] >= 1, err[-2000:]
    assert_same_cache(reference, out["cache_path"])


def test_the_driver_killed_with_minus_9_and_run_again_computes_only_missing_parts(cluster, teacher, reference,
                                                                                 tmp_path):
    shared = tmp_path / "shared"
    p = start(*ray_args(cluster, teacher, shared))
    wait_for(lambda: len(parts_of(shared)) >= 4, "four published parts")
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=60)
    kept = len(parts_of(shared))
    out = run(*ray_args(cluster, teacher, shared))
    assert out["complete"] and out["rows_written"] <= N - kept * BLOCK + BLOCK
    assert out["tasks"] <= -(-N // BLOCK) - kept + 1  # a part published after the count is not redone
    assert_same_cache(reference, out["cache_path"])


def test_two_drivers_on_one_cache_both_finish_it_and_every_key_is_there_once(cluster, teacher, reference, tmp_path):
    shared = tmp_path / "shared"
    a = start(*ray_args(cluster, teacher, shared, "--actors", 1))
    b = start(*ray_args(cluster, teacher, shared, "--actors", 1))
    (oa, _), (ob, _) = finish(a), finish(b)
    assert oa["complete"] and ob["complete"]
    assert oa["rows_written"] + ob["rows_written"] >= N
    assert_same_cache(reference, oa["cache_path"])


def test_a_node_removed_mid_run_loses_nothing(cluster, teacher, reference, tmp_path):
    shared = tmp_path / "shared"
    p = start(*ray_args(cluster, teacher, shared))
    wait_for(lambda: len(parts_of(shared)) >= 2, "two published parts")
    assert cluster.command("remove") == {"nodes": 1}
    try:
        out, err = finish(p)
        assert out["complete"] and out["retries"] >= 1, err[-2000:]
        assert_same_cache(reference, out["cache_path"])
    finally:
        assert cluster.command("add") == {"nodes": 2}


def test_without_an_address_the_command_starts_a_local_cluster_and_stops_it(teacher, reference, tmp_path):
    before = ray_pids()
    out = run("--engine", "ray", "--teacher", teacher, "--dataset", DATA, "--block-rows", 4 * BLOCK,
              "--cache-dir", tmp_path / "c")
    assert out["complete"] and out["engine"] == "ray"
    assert_same_cache(reference, out["cache_path"])
    time.sleep(1.0)
    assert not (ray_pids() - before), "Ray processes left running"


def test_without_ray_the_engine_says_which_extra_to_install(teacher, tmp_path):
    fake = tmp_path / "noray"
    (fake / "ray").mkdir(parents=True)
    (fake / "ray" / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    env = {**ENV, "PYTHONPATH": f"{fake}{os.pathsep}{ROOT}"}
    r = subprocess.run(command("--engine", "ray", "--teacher", teacher, "--dataset", DATA, "--cache-dir",
                               tmp_path / "c"), capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert r.returncode == 2 and "pip install 'kdcache[ray]'" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) <= 4, r.stderr


def test_build_cache_takes_the_ray_engine_and_names_the_same_cache(teacher, reference, tmp_path):
    import kdcache
    path = kdcache.build_cache(teacher, DATA, cache_dir=str(tmp_path / "c"), engine="ray", actors=2,
                               block_rows=4 * BLOCK)
    assert os.path.basename(path) == os.path.basename(reference)  # the same fingerprint as one host's build
    assert_same_cache(reference, path)


def test_the_command_the_scaling_page_shows_runs_outside_the_clone(teacher, reference, tmp_path):
    import re
    import shlex
    from tests.test_parts import scaling_command
    line = scaling_command("--engine ray")
    line = re.sub(r"\s*\[[^\]]*\]", "", line)  # the optional parts left out: their defaults
    bin_dir = os.path.dirname(sys.executable)
    env = {**ENV, "PATH": bin_dir + os.pathsep + ENV["PATH"]}
    env.pop("PYTHONPATH", None)
    cmd = shlex.split(line.replace("PREFIX", teacher).replace("NAME", DATA)) + [
        "--cache-dir", str(tmp_path / "c"), "--json", "--quiet"]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["complete"] and out["engine"] == "ray"
    assert_same_cache(reference, out["cache_path"])  # the default tasks, 4,096 rows, are whole batches too
