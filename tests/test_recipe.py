"""The student recipe: optimiser and lr schedule options, epochs.csv, last/best checkpoints, the validation slice."""
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import CHILD_ENV, ROOT

SPE = 23  # digits: 1438 training items in batches of 64 (the schedule covers every item)


def train(tmp_path, *args, check=True, timeout=300):
    r = subprocess.run([sys.executable, "-m", "kdcache.trainer", "--quiet", "--json", "--runs-dir", str(tmp_path / "runs"),
                        "--cache-dir", str(tmp_path / "caches"), "--threads", "1", "--student", "mlp",
                        *map(str, args)], env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


def rows(run_dir):
    with open(os.path.join(run_dir, "epochs.csv"), newline="") as fh:
        return list(csv.DictReader(fh))


def expected_lr(base, mode, epoch, *, epochs, warmup=0, steps=(), factor=0.1):
    """The rate of epoch `epoch`'s (0-based) first update, as docs/recipe.md states it."""
    u = epoch * SPE + 1
    if u <= warmup * SPE:
        return base * u / (warmup * SPE)
    t = (u - 1) / SPE
    if mode == "step":
        return base * factor ** len([s for s in steps if t >= s])
    if mode == "cosine":
        return base * (1 + math.cos(math.pi * (t - warmup) / (epochs - warmup))) / 2
    return base


@pytest.mark.parametrize("mode,extra", [("constant", ()), ("step", ("--lr-steps", "2", "--lr-factor", "0.2")),
                                        ("cosine", ())])
def test_lr_of_each_epoch_is_the_formula_with_warmup(tmp_path, mode, extra):
    m = train(tmp_path, "--teacher-mode", "none", "--epochs", 4, "--lr", 0.05, "--lr-mode", mode,
              "--warmup-epochs", 1, *extra, "--run", "r")
    got = [float(r["lr"]) for r in rows(tmp_path / "runs" / "r")]
    want = [expected_lr(0.05, mode, e, epochs=4, warmup=1, steps=(2,), factor=0.2) for e in range(4)]
    assert np.allclose(got, want, rtol=1e-5), (got, want)
    assert got[0] < 0.05 / 10  # the warm-up starts near 0
    assert m["recipe"]["lr_mode"] == mode and m["recipe"]["warmup_epochs"] == 1


@pytest.mark.parametrize("bad,says", [(("--lr-steps", "5,3", "--lr-mode", "step"), "increasing"),
                                      (("--lr-steps", "x", "--lr-mode", "step"), "comma"),
                                      (("--lr-steps", "9", "--lr-mode", "step"), "never reached"),
                                      (("--lr-steps", "1"), "--lr-mode step"),
                                      (("--warmup-epochs", "-1"), "at least 0"),
                                      (("--warmup-epochs", "3"), "--warmup-epochs"),
                                      (("--optimizer", "foo"), "sgd, nag, adam"),
                                      (("--lr-mode", "linear"), "constant, step, cosine"),
                                      (("--val-fraction", "0.9"), "--val-fraction"),
                                      (("--save-every", "0"), "--save-every")])
def test_bad_recipe_values_are_one_line_and_status_2(bad, says, capsys):
    from kdcache.trainer.options import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--teacher-mode", "none", "--epochs", "3", *bad])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


def test_bad_recipe_value_from_the_command_line(tmp_path):
    r = train(tmp_path, "--teacher-mode", "none", "--lr-steps", "5,3", "--lr-mode", "step", check=False)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr


def test_epochs_csv_has_a_row_per_epoch_and_only_last_and_best_parameters_stay(tmp_path):
    m = train(tmp_path, "--teacher-mode", "none", "--epochs", 3, "--run", "r")
    run = tmp_path / "runs" / "r"
    rs = rows(run)
    assert list(rs[0]) == ["epoch", "loss", "top1", "top5", "val_top1", "agreement", "lr", "samples_per_s", "stall_s"]
    assert [r["epoch"] for r in rs] == ["1", "2", "3"]
    for r in rs:
        assert 0 <= float(r["top1"]) <= float(r["top5"]) <= 1 and float(r["samples_per_s"]) > 0
        assert r["agreement"] == ""  # hard labels: no teacher to agree with
    assert float(rs[-1]["top1"]) == pytest.approx(m["test_acc"], abs=1e-6)
    best = max(range(3), key=lambda e: (float(rs[e]["val_top1"]), -e))
    assert m["best_epoch"] == best + 1 and m["best_val_top1"] == pytest.approx(float(rs[best]["val_top1"]), abs=1e-6)
    kept = sorted(f for f in os.listdir(run) if f.startswith("student-") and f.endswith(".params"))
    assert kept == sorted({f"student-{best:04d}.params", "student-0002.params"})
    assert m["best_checkpoint"] == str(run / f"student-{best:04d}.params")


def test_save_every_keeps_those_epochs_too(tmp_path):
    m = train(tmp_path, "--teacher-mode", "none", "--epochs", 5, "--save-every", 2, "--run", "r")
    kept = {f for f in os.listdir(tmp_path / "runs" / "r") if f.startswith("student-") and f.endswith(".params")}
    want = {"student-0001.params", "student-0003.params", "student-0004.params",
            f"student-{m['best_epoch'] - 1:04d}.params"}
    assert kept == want


def test_best_is_chosen_on_a_validation_slice_of_the_training_split_never_trained_on(tmp_path):
    import mxnet as mx
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.trainer.recipe import val_indices
    m = train(tmp_path, "--teacher-mode", "none", "--epochs", 3, "--seed", 4, "--run", "r")
    train_split, test_split = load_dataset("digits"), load_dataset("digits", split="test")
    idx = val_indices(len(train_split), 0.1, 4)
    assert len(idx) == 144 and len(set(idx.tolist())) == 144 and idx.max() < len(train_split)
    assert not np.array_equal(val_indices(len(train_split), 0.1, 5), idx)  # by the seed
    # the validation items are skipped by training: each epoch trains on the rest only
    history = json.load(open(tmp_path / "runs" / "r" / "metrics.json"))["history"]
    assert [h["samples"] for h in history] == [len(train_split) - 144] * 3
    # the best epoch's recorded validation top-1 is its parameters' top-1 on exactly these items
    run = tmp_path / "runs" / "r"
    net = mx.gluon.SymbolBlock.imports(str(run / "student-symbol.json"), ["data"], m["best_checkpoint"])
    x, y = train_split.get_batch(idx)
    val_top1 = float((net(mx.nd.array(x)).asnumpy().argmax(1) == y).mean())
    assert val_top1 == pytest.approx(m["best_val_top1"], abs=1e-9)
    xt, yt = test_split.get_batch(np.arange(len(test_split)))
    best_row = rows(run)[m["best_epoch"] - 1]
    assert float((net(mx.nd.array(xt)).asnumpy().argmax(1) == yt).mean()) == pytest.approx(float(best_row["top1"]),
                                                                                          abs=1e-6)
    n0 = train(tmp_path, "--teacher-mode", "none", "--epochs", 1, "--val-fraction", 0, "--run", "all")
    history = json.load(open(tmp_path / "runs" / "all" / "metrics.json"))["history"]
    assert history[0]["samples"] == len(train_split) and n0["best_epoch"] is None


def test_agreement_is_the_same_from_the_cache_and_from_an_inline_teacher(tmp_path):
    from tests.helpers import gluon_teacher
    teacher = str(tmp_path / "t")
    gluon_teacher(teacher)
    common = ["--teacher", teacher, "--epochs", 2, "--dtype", "float32", "--producer-threads", 1]
    m = train(tmp_path, *common, "--teacher-mode", "inline", "--run", "inline")
    ag = [float(r["agreement"]) for r in rows(tmp_path / "runs" / "inline")]
    assert len(ag) == 2 and all(0 < a <= 1 for a in ag)
    history = json.load(open(tmp_path / "runs" / "inline" / "metrics.json"))["history"]
    assert [h["agreement"] for h in history] == pytest.approx(ag, abs=1e-6)
    assert m["teacher_forwards"] == 2 * (1438 - 144)  # the agreement's forwards are not training's
    train(tmp_path, *common, "--run", "cached")
    assert [float(r["agreement"]) for r in rows(tmp_path / "runs" / "cached")] == pytest.approx(ag, abs=1e-9)


TORTURE = os.environ.get("KDCACHE_TORTURE") == "1"


def test_kill_keeps_finished_rows_and_resume_continues_them_with_the_same_lr(tmp_path):
    """SIGKILL at a random moment after the first row (between a row and its checkpoint too):
    the finished rows stay whole, and the resumed run's rows equal an uninterrupted run's."""
    common = ["--teacher-mode", "none", "--epochs", 6, "--batch-size", 2, "--lr", 0.02, "--lr-mode", "step",
              "--lr-steps", "2,4", "--warmup-epochs", 1]
    train(tmp_path, *common, "--run", "full")
    full = rows(tmp_path / "runs" / "full")
    rng = np.random.default_rng(0)
    killed = 0
    for i in range(12 if TORTURE else 1):
        run = tmp_path / "runs" / f"cut{i}"
        p = subprocess.Popen([sys.executable, "-m", "kdcache.trainer", "--quiet", "--runs-dir", str(tmp_path / "runs"),
                              "--threads", "1", "--student", "mlp", *map(str, common), "--run", f"cut{i}"],
                             env=CHILD_ENV, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:
            if os.path.exists(run / "epochs.csv") and len(rows(run)) >= 1:
                break
            time.sleep(0.01)
        time.sleep(0.3 + rng.uniform(0, 2.0) if i else 0.6)  # the first kill: within the second epoch
        p.send_signal(signal.SIGKILL)
        p.wait()
        if p.returncode == -signal.SIGKILL:
            killed += 1
            before = rows(run)
            assert 1 <= len(before) <= 6 and all(r["lr"] and r["stall_s"] for r in before)  # whole rows only
            assert [r["epoch"] for r in before] == [str(e) for e in range(1, len(before) + 1)]
        train(tmp_path, *common, "--run", f"cut{i}", "--resume")
        after = rows(run)
        assert [r["epoch"] for r in after] == [str(e) for e in range(1, 7)]  # no row twice, none missing
        assert [r["lr"] for r in after] == [r["lr"] for r in full]
        assert [r["top1"] for r in after] == [r["top1"] for r in full]  # the same run, resumed
    assert killed >= 1, "every run ended before it was killed"


def test_recipe_sweep_quick_writes_its_table(tmp_path):
    """The sweep distils as make train does (KD from the cache at the trainer's T and alpha) and chooses on the
    validation slice."""
    from kdcache.trainer.options import TRAINER
    default = {o.dest: o.default for o in TRAINER}
    out = tmp_path / "sweep.json"
    r = subprocess.run([sys.executable, "-m", "bench.recipe", "--quick", "--out", str(out), "--tmp", str(tmp_path)],
                       env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert rep["quick"] and rep["loss"] == "kd" and rep["datasets"] == ["digits"]
    assert len(rep["runs"]) == 2 and len(rep["table"]) == 2 and len(rep["ranking"]) == 2
    assert {(t["optimizer"], t["lr_mode"]) for t in rep["table"]} == {("adam", "constant"), ("sgd", "cosine")}
    assert all(0.5 < t["test_top1"] <= 1 and 0.5 < t["val_top1"] <= 1 for t in rep["table"])
    assert all(x["temperature"] == default["temperature"] and x["alpha"] == default["alpha"] and
               x["student"] == default["student"] and x["epochs"] == 2 for x in rep["runs"])
    best = max(rep["table"], key=lambda t: t["val_top1"])
    assert rep["choice"] == {k: best[k] for k in ("optimizer", "lr_mode", "lr")}
    assert "| sgd " in r.stdout and "| adam " in r.stdout and "**chosen**" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.recipe", "--epochs", "0"], env=CHILD_ENV, cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_resume_with_another_optimizer_names_the_one_to_use(tmp_path):
    # a constant rate: the run may train on to more epochs (a cosine schedule ends at its --epochs)
    train(tmp_path, "--teacher-mode", "none", "--epochs", 1, "--optimizer", "adam", "--lr", 0.01, "--lr-mode",
          "constant", "--run", "r")
    r = train(tmp_path, "--teacher-mode", "none", "--epochs", 2, "--lr-mode", "constant", "--run", "r", "--resume",
              check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --resume: ") and "--optimizer adam" in r.stderr
    train(tmp_path, "--teacher-mode", "none", "--epochs", 2, "--optimizer", "adam", "--lr", 0.01, "--lr-mode",
          "constant", "--run", "r", "--resume")
    assert [r["epoch"] for r in rows(tmp_path / "runs" / "r")] == ["1", "2"]


@pytest.mark.slow
def test_dist_async_workers_train_on_the_schedule(tmp_path):
    """dist_async sends the optimiser, its schedule inside, to the server when the kvstore starts
    (MXNet refused every first step before: the optimiser went without the step's normalisation)."""
    r = subprocess.run([sys.executable, "-m", "kdcache.trainer.launch", "--workers", "2", "--kvstore", "dist_async",
                        "--", "--teacher-mode", "none", "--epochs", "2", "--quiet", "--run", "a", "--runs-dir",
                        str(tmp_path / "runs"), "--student", "mlp", "--lr-mode", "step", "--lr-steps", "1"],
                       env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    from kdcache.trainer.options import TRAINER
    lr = next(o.default for o in TRAINER if o.dest == "lr")  # the default optimiser at its default rate
    for w in (0, 1):
        rs = rows(tmp_path / "runs" / "a" / f"worker-{w}")
        assert [float(x["lr"]) for x in rs] == pytest.approx([lr, lr / 10]) and float(rs[-1]["top1"]) > 0.5
