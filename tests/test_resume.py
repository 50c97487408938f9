"""--resume continues the run it was: every option that shapes training, and what the options name
(data, teacher, cache, student, validation slice), is compared with the run's record; a
difference is one line naming the option and both values, exit 2, before any file of the run changes."""
import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kdcache.trainer.errors import TrainError
from kdcache.trainer.options import BY_CONTENT, MAY_DIFFER, build_parser, epochs_in_schedule, parse_args, recorded
from kdcache.trainer import resume
from tests.helpers import CHILD_ENV, ROOT, gluon_teacher


def train(tmp_path, *args, check=True):
    r = subprocess.run([sys.executable, "-m", "kdcache.trainer", "--quiet", "--json", "--runs-dir",
                        str(tmp_path / "runs"), "--cache-dir", str(tmp_path / "caches"), "--threads", "1",
                        "--student", "mlp", *map(str, args)], env=CHILD_ENV, cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])
    return r


def snapshot(folder):
    """Every file of a folder, by its bytes' digest (and its mode and time: a rewrite shows)."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(d, f)
            st_ = os.stat(p)
            out[os.path.relpath(p, folder)] = (hashlib.sha256(open(p, "rb").read()).hexdigest(), st_.st_mode,
                                               st_.st_mtime_ns)
    return out


def refused(r, *words):
    """Exit 2, one line, no traceback, naming `words`; the line."""
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert all(w in errors[0] for w in words), (words, errors[0])
    return errors[0]


def epochs_csv(run):
    return [ln.split(",")[0] for ln in open(os.path.join(run, "epochs.csv")).read().splitlines()[1:]]


# --- from the command line ------------------------------------------------------------------------
@pytest.mark.slow
def test_a_resume_with_another_validation_slice_temperature_or_alpha_is_refused_and_changes_nothing(
        tmp_path, teacher):
    """The reproduced case: --epochs 2 --val-fraction 0, then --epochs 4 --resume trained epochs 3-4 holding out
    a slice the student had trained on, and picked the best epoch from it."""
    base = ["--teacher", teacher, "--run", "X"]
    train(tmp_path, *base, "--epochs", 2, "--val-fraction", 0)
    run = tmp_path / "runs" / "X"
    before = snapshot(run)
    line = refused(train(tmp_path, *base, "--epochs", 4, "--resume", check=False),
                   "--val-fraction 0.0, not 0.1", "--epochs 2, not 4", "cosine")
    assert line.startswith("error: --resume: ") and "resume with --epochs 2 --val-fraction 0.0" in line, line
    assert snapshot(run) == before
    for extra, words in ((["-T", 4], ["--temperature 20.0, not 4.0"]), (["--alpha", 0.9], ["--alpha 0.5, not 0.9"]),
                         (["-T", 4, "--alpha", 0.9], ["--temperature 20.0, not 4.0", "--alpha 0.5, not 0.9"]),
                         (["--teacher-mode", "inline"], ["--teacher-mode cache, not inline"]),
                         (["--batch-size", 32], ["--batch-size 64, not 32"]),
                         (["--seed", 1], ["--seed 0, not 1"])):
        refused(train(tmp_path, *base, "--epochs", 2, "--val-fraction", 0, "--resume", *extra, check=False), *words)
        assert snapshot(run) == before


@pytest.mark.slow
def test_a_resume_with_the_same_options_continues_the_run(tmp_path, teacher):
    """A constant rate does not depend on --epochs: the run trains on to a larger one, from its cache,
    and options that may differ (threads, ctx, output) do; then the run finishes as an uninterrupted one would."""
    base = ["--teacher", teacher, "--lr-mode", "constant", "--lr", 0.05, "--val-fraction", 0.2, "-T", 4,
            "--alpha", 0.7, "--seed", 3, "--run", "r"]
    train(tmp_path, *base, "--epochs", 2)
    state = json.load(open(tmp_path / "runs" / "r" / "state.json"))
    assert state["identity"]["val_slice"]["items"] == round(1438 * 0.2)
    assert state["identity"]["teacher"]["params_sha256"] and state["identity"]["cache"]
    m = train(tmp_path, *base, "--epochs", 4, "--resume", "--ctx", "cpu", "--wait-timeout", 30, "--save-every", 1)
    history = json.load(open(tmp_path / "runs" / "r" / "metrics.json"))["history"]
    assert [h["epoch"] for h in history] == [0, 1, 2, 3] and m["teacher_forwards"] == 0
    assert epochs_csv(tmp_path / "runs" / "r") == ["1", "2", "3", "4"]
    assert m["recipe"]["val_items"] == round(1438 * 0.2) and m["temperature"] == 4 and m["alpha"] == 0.7


@pytest.mark.slow
def test_a_resume_over_other_files_is_refused_naming_what_changed(tmp_path, teacher):
    """The options can be the same and what they name not: the data set's files and the teacher's are
    compared by content (a moved folder still resumes)."""
    data = tmp_path / "data"
    data.mkdir()

    def write_npz(path, seed):
        r = np.random.default_rng(seed)
        np.savez(path, x_train=r.integers(0, 256, (60, 8, 8, 1), dtype=np.uint8), y_train=np.arange(60) % 3,
                 x_test=r.integers(0, 256, (20, 8, 8, 1), dtype=np.uint8), y_test=np.arange(20) % 3)

    write_npz(data / "d.npz", 0)
    base = ["--teacher-mode", "none", "--dataset", "npz", "--lr-mode", "constant", "--run", "n"]
    train(tmp_path, *base, "--data-root", data / "d.npz", "--epochs", 1)
    run = tmp_path / "runs" / "n"
    before = snapshot(run)
    moved = tmp_path / "moved"
    os.rename(data, moved)  # the same file in another folder: the same run
    data.mkdir()
    write_npz(data / "d.npz", 1)  # other bytes at the run's path: another data set
    line = refused(train(tmp_path, *base, "--data-root", data / "d.npz", "--epochs", 2, "--resume", check=False),
                   "the data set (--dataset, --data-root)", "digest")
    assert snapshot(run) == before, line
    train(tmp_path, *base, "--data-root", moved / "d.npz", "--epochs", 2, "--resume")
    assert epochs_csv(run) == ["1", "2"]

    # the teacher's files replaced at the same path: its digest differs
    t = tmp_path / "teacher" / "t"
    t.parent.mkdir()
    gluon_teacher(str(t), seed=1)
    tbase = ["--teacher", t, "--lr-mode", "constant", "--run", "t"]
    train(tmp_path, *tbase, "--epochs", 1)
    before = snapshot(tmp_path / "runs" / "t")
    gluon_teacher(str(t), seed=2)
    refused(train(tmp_path, *tbase, "--epochs", 2, "--resume", check=False), "the teacher (--teacher)",
            "params_sha256")
    assert snapshot(tmp_path / "runs" / "t") == before


@pytest.mark.slow
def test_a_run_recorded_by_an_older_kdcache_resumes_with_what_it_records_compared(tmp_path):
    base = ["--teacher-mode", "none", "--lr-mode", "constant", "--run", "old"]
    train(tmp_path, *base, "--epochs", 1)
    path = tmp_path / "runs" / "old" / "state.json"
    state = json.load(open(path))
    path.write_text(json.dumps({k: v for k, v in state.items() if k != "identity"}))  # no content recorded
    refused(train(tmp_path, *base, "--epochs", 2, "--val-fraction", 0.3, "--resume", check=False),
            "--val-fraction 0.1, not 0.3")
    r = train(tmp_path, *base, "--epochs", 2, "--resume", check=False)
    assert r.returncode == 0 and "older kdcache" in r.stderr, r.stderr[-2000:]
    assert "identity" in json.load(open(path))  # recorded from the resumed epochs on
    state = json.load(open(path))
    path.write_text(json.dumps({k: v for k, v in state.items() if k not in ("identity", "args")}))  # no options
    r = train(tmp_path, *base, "--epochs", 3, "--resume", check=False)
    assert r.returncode == 0 and "records no options" in r.stderr, r.stderr[-2000:]
    assert epochs_csv(tmp_path / "runs" / "old") == ["1", "2", "3"]


# --- every option: compared, or listed as one that may differ ----------------------------------------
def bases(teacher):
    """Command lines under which each option matters (momentum with sgd, the factor with step, T and alpha
    with a teacher, the rule with an ensemble)."""
    return [["--teacher", teacher, "--lr-mode", "step", "--lr-steps", "1", "--epochs", "3"],
            ["--teacher", teacher, "--epochs", "3"],
            ["--ensemble", "a.h5:1,b.h5:2", "--ensemble-rule", "probs", "--epochs", "3"]]


def state_of(args, content=True):
    return {"epoch": 0, "args": json.loads(json.dumps(recorded(args))), **({"identity": {}} if content else {})}


def other(v):
    """Another JSON value of the same kind."""
    if isinstance(v, bool):
        return not v
    if isinstance(v, (int, float)):
        return v + 1 if isinstance(v, int) else v + 0.125
    if isinstance(v, list):
        return [other(x) for x in v]
    return "other" if v is None else v + "-other"


def test_every_option_is_compared_or_listed_as_one_that_may_differ(teacher):
    """The parser's options are the declared ones; each is either named in MAY_DIFFER, compared by content
    (BY_CONTENT: by value when the run records no content), or refused when the run's value differs."""
    dests = {a.dest for a in build_parser()._actions if a.dest != "help"}
    assert dests == set(resume.OPTIONS)
    assert set(MAY_DIFFER) <= dests and set(BY_CONTENT) <= dests and not set(MAY_DIFFER) & set(BY_CONTENT)
    assert set(BY_CONTENT.values()) <= set(resume.CONTENT)
    cwd = os.getcwd()
    compared = set()
    for argv in bases(teacher):
        args = parse_args(argv)
        args.run_name = "r"
        for dest in dests:
            for content in (True, False):
                state = state_of(args, content)
                state["args"][dest] = other(state["args"][dest])
                named = [d for d, *_ in resume.option_differences(state, args)]
                assert named in ([], [dest]), (dest, named)
                if dest in MAY_DIFFER or content and dest in BY_CONTENT:
                    assert not named, f"{dest} may differ, and was compared"
                if named:
                    compared.add(dest)
                    with pytest.raises(TrainError) as e:
                        resume.check_options(state, args, "runs/r")
                    msg = str(e.value)
                    flag = resume.OPTIONS[dest].flag
                    assert "\n" not in msg and msg.startswith("--resume: runs/r was trained with " + flag), msg
        assert resume.option_differences(state_of(args), args) == []  # the run's own options: no difference
    assert os.getcwd() == cwd
    assert compared == dests - set(MAY_DIFFER), sorted(dests - set(MAY_DIFFER) - compared)


def test_content_is_compared_field_by_field():
    ident = {"dataset": {"name": "npz", "digest": "a" * 64}, "teacher": None, "cache": "f1", "student": "mlp",
             "augment": "none", "val_slice": {"items": 6, "sha256": "b" * 64}}
    for key in resume.CONTENT:
        now = json.loads(json.dumps(ident))
        now[key] = other(now[key]) if not isinstance(now[key], dict) else {**now[key], "digest": "c" * 64}
        with pytest.raises(TrainError) as e:
            resume.check_content({"identity": ident}, now, "runs/r")
        assert resume.CONTENT[key] in str(e.value) and "\n" not in str(e.value)
    resume.check_content({"identity": ident}, ident, "runs/r")


FLOATS = {"--val-fraction": st.sampled_from([0.0, 0.1, 0.25, 0.5]) | st.floats(0, 0.5),
          "--temperature": st.sampled_from([1.0, 4.0, 20.0]) | st.floats(0.01, 1000),  # the range it takes
          "--alpha": st.sampled_from([0.0, 0.5, 1.0]) | st.floats(0, 1),
          "--lr": st.sampled_from([0.01, 0.3]) | st.floats(1e-6, 10),
          "--momentum": st.sampled_from([0.0, 0.9]) | st.floats(0, 1),
          "--wd": st.sampled_from([0.0, 1e-4]) | st.floats(0, 1)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_recipe_value_resumes_exactly_when_it_is_the_runs(teacher, data):
    """Oracle: the same value resumes; another is refused in one line naming the option and both values."""
    flag = data.draw(st.sampled_from(sorted(FLOATS)))
    a = data.draw(FLOATS[flag])
    b = data.draw(st.just(a) | FLOATS[flag])
    base = ["--teacher", teacher, "--epochs", "3"]
    run, now = parse_args(base + [f"{flag}={a!r}"]), parse_args(base + [f"{flag}={b!r}"])
    state = state_of(run)
    if a == b:
        resume.check_options(state, now, "runs/r")
        return
    with pytest.raises(TrainError) as e:
        resume.check_options(state, now, "runs/r")
    assert str(e.value).count("\n") == 0 and f"{flag} {a!r}, not {b!r}" in str(e.value), str(e.value)
    assert f"resume with {flag} {a!r}," in str(e.value)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mode=st.sampled_from(["constant", "step", "cosine"]), steps=st.booleans(), e1=st.integers(2, 40),
       e2=st.integers(2, 40))
def test_epochs_may_change_only_where_the_schedule_does_not_depend_on_them(mode, steps, e1, e2):
    """--epochs is part of a cosine schedule and of step's default steps (half and three quarters of it):
    a resume keeps it; with a constant rate, or step at given epochs, the run trains on to another."""
    given_steps = ["--lr-steps", "1"] if mode == "step" and steps else []
    base = ["--teacher-mode", "none", "--lr-mode", mode, *given_steps]
    run, now = parse_args(base + ["--epochs", str(e1)]), parse_args(base + ["--epochs", str(e2)])
    named = [d for d, *_ in resume.option_differences(state_of(run), now)]
    fixed = mode == "cosine" or mode == "step" and not steps
    assert epochs_in_schedule(now.lr_mode, now.lr_steps) == fixed
    assert named == (["epochs"] if fixed and e1 != e2 else []), (mode, steps, e1, e2, named)


def test_step_at_the_runs_own_steps_may_train_on_to_more_epochs():
    """A step run that took its steps from --epochs 8 (4 and 6) resumes with --epochs 12 when it names those
    steps: the rates of its updates are the run's; naming other steps is refused."""
    run = parse_args(["--teacher-mode", "none", "--lr-mode", "step", "--epochs", "8"])
    ok = parse_args(["--teacher-mode", "none", "--lr-mode", "step", "--lr-steps", "4,6", "--epochs", "12"])
    assert resume.option_differences(state_of(run), ok) == []
    bad = parse_args(["--teacher-mode", "none", "--lr-mode", "step", "--lr-steps", "4,9", "--epochs", "12"])
    with pytest.raises(TrainError, match="--lr-steps 4,6, not 4,9"):
        resume.check_options(state_of(run), bad, "runs/r")
