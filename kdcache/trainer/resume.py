"""What `--resume` compares: the run's record (state.json) with this command, before anything runs.

A resumed run is the run it was. Its checkpoint records every option (state.json["args"]) and,
by content, what the options name (state.json["identity"]: the data set's digest, the teacher's
files, the cache's fingerprint, the student, the augmentation, the validation slice). A resume
compares both with this command and refuses a difference in one line naming the option and both
values, before a producer starts or a file of the run changes. Every option is compared but those
kdcache.trainer.options.MAY_DIFFER lists; those of BY_CONTENT are compared by what they name.

A run recorded by an older kdcache (no "identity", or options it did not know) resumes with the
options it records compared. No MXNet here.
"""
import hashlib
import json
import logging
import os

from kdcache.pipeline.options import SHARED
from kdcache.trainer.errors import TrainError
from kdcache.trainer.options import BY_CONTENT, MAY_DIFFER, TRAINER, epochs_in_schedule, recorded
from kdcache.trainer.recipe import default_steps, val_indices

log = logging.getLogger("kdcache.trainer")

OPTIONS = {o.dest: o for o in SHARED + TRAINER}

# What a run records by content, and the options that name it (the refusal's words).
CONTENT = {"dataset": "the data set (--dataset, --data-root)", "teacher": "the teacher (--teacher)",
           "cache": "the cache (--cache, --cache-dir)", "student": "the student (--student)",
           "augment": "the augmentation (--augment)", "val_slice": "the validation slice (--val-fraction, --seed)"}


def read_state(run_dir):
    """state.json of a run, checked to name a finished epoch."""
    path = os.path.join(run_dir, "state.json")
    if not os.path.exists(path):
        raise TrainError(f"--resume: {run_dir} has no checkpoint (state.json): run without --resume")
    try:
        with open(path) as fh:
            state = json.load(fh)
    except (OSError, ValueError) as e:
        raise TrainError(f"--resume: {path} is not readable JSON ({e}): start the run again") from None
    if not isinstance(state, dict) or type(state.get("epoch")) is not int or state["epoch"] < 0:
        raise TrainError(f"--resume: {path} names no finished epoch: start the run again")
    return state


def identity(args, plan):
    """What this run's options name, by content (JSON): recorded with every checkpoint."""
    from kdcache.trainer.models import model_identity
    val = val_indices(len(plan.train), args.val_fraction, args.seed)
    spec = plan.spec
    return _json({"dataset": plan.train.identity(), "teacher": spec.inputs["teacher"] if spec else None,
                  "cache": spec.fingerprint if spec else None, "student": model_identity(args.student),
                  "augment": getattr(plan.augment, "spec", None),
                  "val_slice": {"items": int(len(val)), "sha256": hashlib.sha256(val.tobytes()).hexdigest()}})


def _json(v):
    return json.loads(json.dumps(v))


def _ignored(dest, now):
    """Options this command's other options make no use of (those are compared themselves)."""
    mode, ensemble = now.get("teacher_mode"), now.get("ensemble")
    return (dest == "momentum" and now.get("optimizer") == "adam"
            or dest == "lr_factor" and now.get("lr_mode") != "step"
            or dest in ("temperature", "alpha") and mode == "none"
            or dest in ("codec", "dtype") and (mode != "cache" or bool(ensemble))
            or dest == "ensemble_rule" and not ensemble)


def option_differences(state, args):
    """[(dest, the run's value, this command's value, why)] for the options the run records."""
    run, now = state.get("args"), _json(recorded(args))
    if not isinstance(run, dict):
        return []
    by_content = isinstance(state.get("identity"), dict)
    out = []
    for dest in OPTIONS:
        if dest in MAY_DIFFER or dest not in run or (by_content and dest in BY_CONTENT) or _ignored(dest, now):
            continue
        mine, theirs = now.get(dest), run[dest]
        why = None
        if dest == "epochs":
            if not epochs_in_schedule(now.get("lr_mode"), now.get("lr_steps")):
                continue  # the schedule does not depend on it: the run trains on to this --epochs
            why = f"its {now.get('lr_mode')} schedule ends at epoch {theirs}"
        if dest == "lr_steps" and mine is not None and theirs is None and run.get("lr_mode") == "step" \
                and type(run.get("epochs")) is int:
            theirs = list(default_steps(run["epochs"]))  # the steps the run took from its --epochs
        if mine != theirs:
            out.append((dest, theirs, mine, why))
    return out


def content_differences(state, ident):
    """[(what, the run's, this command's)] for what the run records by content."""
    run = state.get("identity")
    if not isinstance(run, dict):
        return []
    return [(k, run[k], ident.get(k)) for k in CONTENT if k in run and run[k] != ident.get(k)]


def word(dest, v):
    """A recorded value as the command line writes it."""
    o = OPTIONS[dest]
    if o.action:
        return "given" if v else "not given"
    if v is None:
        return "not given"
    if isinstance(v, str):
        return v
    try:
        return o.format(tuple(v) if isinstance(v, list) else v)
    except (TypeError, ValueError, AttributeError, IndexError):
        return json.dumps(v)


def fix(dest, v):
    flag = OPTIONS[dest].flag
    if v is None or v is False:
        return f"without {flag}"
    return flag if v is True else f"{flag} {word(dest, v)}"


def _short(v):
    s = v if isinstance(v, str) else json.dumps(v)
    return s[:12] if len(s) == 64 and all(c in "0123456789abcdef" for c in s) else s[:60]


def _first_difference(a, b):
    """The first field where two records differ, with both values: 'digest 1a2b..., not 9f8e...'."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b), key=lambda k: (k not in ("digest", "sha256", "name"), k)):
            if a.get(k) != b.get(k):
                return f"{k} {_short(a.get(k))}, not {_short(b.get(k))}"
    return f"{_short(a)}, not {_short(b)}"


def check_options(state, args, run_dir):
    """Refuse (TrainError, one line) a resume whose options differ from the run's record."""
    if not isinstance(state.get("args"), dict):
        log.warning("%s records no options (an older kdcache): only its optimiser is compared on resume", run_dir)
        return
    diffs = option_differences(state, args)
    if diffs:
        said = ", and ".join(f"{OPTIONS[d].flag} {word(d, run)}, not {word(d, now)}" + (f" ({why})" if why else "")
                             for d, run, now, why in diffs)
        raise TrainError(f"--resume: {run_dir} was trained with {said}: resume with "
                         f"{' '.join(fix(d, run) for d, run, _, _ in diffs)}, or start another --run")


def check_content(state, ident, run_dir):
    """Refuse (TrainError, one line) a resume whose data, teacher, cache, student, augmentation or
    validation slice are not the run's; say once that a run recorded without them is not compared."""
    if not isinstance(state.get("identity"), dict):
        log.warning("%s was recorded by an older kdcache: its options are compared by value, not the content of "
                    "its data set, teacher and cache", run_dir)
        return
    diffs = content_differences(state, ident)
    if diffs:
        said = ", and ".join(f"{CONTENT[k]}: {_first_difference(run, now)}" for k, run, now in diffs)
        raise TrainError(f"--resume: {run_dir} was trained on other content than this command names: {said}: "
                         f"resume with what the run was trained on, or start another --run")


def check(run_dir, args, ident=None):
    """Read the run's record and compare it with this command (and `ident`, when given); returns it."""
    state = read_state(run_dir)
    check_options(state, args, run_dir)
    if ident is not None:
        check_content(state, ident, run_dir)
    return state
