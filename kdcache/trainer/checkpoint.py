"""A run's checkpoints: the student, the optimiser state, and state.json written last.

The student's parameters of the last epoch, of the best (state.json["best"]) and of every
--save-every epoch are kept; the others are removed once state.json names a later epoch.

The optimiser state is kept as plain arrays and JSON, never pickle (MXNet's Trainer.save_states
pickles the Updater, and load_states would run whatever a planted file holds):
- `optimizer-states-NNNN.params`: the Updater's state arrays (Adam: mean and var per parameter),
  in MXNet's own NDArray format (`mx.nd.save`), keys `<param index>` or `<param index>.<i>[.<j>]`;
- `state.json["optimizer"]`: the optimiser's name, learning rate, weight decay, update counters
  (`num_update`, the per-device index->count maps Adam's bias correction uses) and the layout of
  each parameter's state (an array, None, or a tuple/list of those).
"""
import logging
import os

import mxnet as mx

from kdcache.store.osutil import write_json_atomic
from kdcache.trainer.errors import TrainError
from kdcache.trainer.resume import read_state

log = logging.getLogger("kdcache.trainer")

FORMAT = "kdcache-optimizer-1"
LEGACY_STATES = "trainer.states"  # pickle, written by older kdcache: never loaded


def states_name(epoch):
    return f"optimizer-states-{epoch:04d}.params"


def _updaters(trainer):
    """The Updaters that hold the optimiser state on this process ([] when a distributed kvstore
    updates on the server), after the kvstore and parameters are initialised as save/load_states do."""
    if not trainer._kv_initialized:
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    if trainer._update_on_kvstore:
        upd = getattr(trainer._kvstore, "_updater", None)
        return [upd] if upd is not None else []
    return list(trainer._updaters)


def _flatten(key, state, arrays):
    """The layout of one state (JSON), its arrays added to `arrays` under `key`-derived names."""
    if state is None:
        return None
    if isinstance(state, mx.nd.NDArray):
        arrays[key] = state
        return "array"
    if isinstance(state, (tuple, list)):
        kind = "tuple" if isinstance(state, tuple) else "list"
        return {kind: [_flatten(f"{key}.{i}", s, arrays) for i, s in enumerate(state)]}
    raise TypeError(f"optimiser state of type {type(state).__name__} cannot be saved without pickle")


def optimizer_state(trainer, arrays):
    """The optimiser's JSON record; its state arrays go into `arrays`. None if it has no local state."""
    ups = _updaters(trainer)
    if not ups:
        return None
    up = ups[0]
    opt = up.optimizer
    layout = {}
    for idx, st in up.states.items():
        if not isinstance(idx, int):
            raise TypeError(f"optimiser state index {idx!r} is not a parameter number")
        layout[str(idx)] = _flatten(str(idx), st, arrays)
    return {"format": FORMAT, "optimizer": type(opt).__name__.lower(), "learning_rate": float(opt.lr),
            "wd": float(opt.wd), "num_update": int(opt.num_update), "begin_num_update": int(opt.begin_num_update),
            "index_update_counts": {str(dev): {str(i): int(c) for i, c in counts.items()}
                                    for dev, counts in opt._all_index_update_counts.items()},
            "states": layout}


def save_checkpoint(run_dir, net, trainer, epoch, state, keep=None):
    """Export the student and the optimiser state; state.json, written last and atomically,
    says which epoch is complete, so an interrupted save is never resumed from. `keep`: the
    epochs whose parameters stay (None: all); the others go after state.json is in place."""
    tmp = os.path.join(run_dir, f".tmp-{os.getpid()}")
    net.export(tmp + "-student", epoch=epoch)
    os.replace(f"{tmp}-student-{epoch:04d}.params", os.path.join(run_dir, f"student-{epoch:04d}.params"))
    os.replace(f"{tmp}-student-symbol.json", os.path.join(run_dir, "student-symbol.json"))
    record = None
    if state.get("kvstore") != "dist_async":  # dist_async keeps the optimiser state on the server
        arrays = {}
        record = optimizer_state(trainer, arrays)
        if record is not None:
            mx.nd.save(tmp + "-optimizer.params", {k: v.as_in_context(mx.cpu()) for k, v in arrays.items()})
            os.replace(tmp + "-optimizer.params", os.path.join(run_dir, states_name(epoch)))
    # the epoch is complete once this is on disk: fsynced, and its rename too
    write_json_atomic(os.path.join(run_dir, "state.json"), {**state, "epoch": epoch, "optimizer": record}, indent=1)
    for e in range(epoch):  # the previous epochs' optimiser state is no longer resumed from
        old = os.path.join(run_dir, states_name(e))
        if os.path.exists(old):
            os.remove(old)
    if keep is not None:
        for e in range(epoch):
            old = os.path.join(run_dir, f"student-{e:04d}.params")
            if e not in keep and os.path.exists(old):
                os.remove(old)


def _count(v, what, bad):
    if type(v) is not int or v < 0:
        raise bad(f"{what} is not a count")
    return v


def _index(k, what, bad):
    if not isinstance(k, str) or not k.isdigit() or str(int(k)) != k:
        raise bad(f"{what} key {k!r} is not a number")
    return int(k)


def _rebuild(layout, key, arrays, used, bad):
    if layout is None:
        return None
    if layout == "array":
        if key not in arrays:
            raise bad(f"array {key!r} is missing")
        used.add(key)
        return arrays[key]
    if isinstance(layout, dict) and len(layout) == 1 and next(iter(layout)) in ("tuple", "list"):
        kind, items = next(iter(layout.items()))
        if not isinstance(items, list):
            raise bad(f"state {key!r} has a malformed layout")
        out = [_rebuild(s, f"{key}.{i}", arrays, used, bad) for i, s in enumerate(items)]
        return tuple(out) if kind == "tuple" else out
    raise bad(f"state {key!r} has a malformed layout")


def _same_shape(got, fresh, key, bad):
    """A loaded state matches, in structure, shape and dtype, the state the optimiser would create."""
    if fresh is None or isinstance(fresh, mx.nd.NDArray):
        ok = (got is None) if fresh is None else (isinstance(got, mx.nd.NDArray) and got.shape == fresh.shape
                                                   and got.dtype == fresh.dtype)
        if not ok:
            raise bad(f"state {key!r} does not fit parameter {key.split('.')[0]} of this student")
        return
    if not isinstance(got, (tuple, list)) or type(got) is not type(fresh) or len(got) != len(fresh):
        raise bad(f"state {key!r} does not fit parameter {key.split('.')[0]} of this student")
    for i, (g, f) in enumerate(zip(got, fresh)):
        _same_shape(g, f, f"{key}.{i}", bad)


def load_optimizer_state(run_dir, trainer, record, epoch):
    """Rebuild the Updaters' state and the optimiser's counters from the checkpoint's files."""
    path = os.path.join(run_dir, states_name(epoch))
    json_path = os.path.join(run_dir, "state.json")

    def bad(why, where=json_path):
        return TrainError(f"--resume: {where}: the optimiser state is malformed ({why}): start the run again")

    ups = _updaters(trainer)
    if not ups:
        log.warning("the optimiser state of %s is kept by the kvstore's server: it restarts from its defaults",
                    run_dir)
        return
    opt = ups[0].optimizer
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise bad("unknown format")
    if record.get("optimizer") in ("sgd", "nag", "adam") and record["optimizer"] != type(opt).__name__.lower():
        # a run started before --optimizer's default changed, or with another --optimizer
        raise TrainError(f"--resume: {run_dir} was trained with --optimizer {record['optimizer']}, not "
                         f"{type(opt).__name__.lower()}: resume with --optimizer {record['optimizer']} (and its "
                         f"--lr and --lr-mode)")
    if record.get("optimizer") != type(opt).__name__.lower():
        raise bad(f"it is for optimiser {record.get('optimizer')!r}, this run uses {type(opt).__name__.lower()!r}")
    for k in ("learning_rate", "wd"):
        if type(record.get(k)) not in (int, float):
            raise bad(f"{k} is not a number")
    num_update = _count(record.get("num_update"), "num_update", bad)
    begin = _count(record.get("begin_num_update"), "begin_num_update", bad)
    counts = record.get("index_update_counts")
    layout = record.get("states")
    if not isinstance(counts, dict) or not isinstance(layout, dict):
        raise bad("index_update_counts or states is not a map")
    n_params = len(trainer._params)
    all_counts = {}
    for dev, c in counts.items():
        if not isinstance(c, dict):
            raise bad("index_update_counts is not a map of maps")
        d = {}
        for i, v in c.items():
            d[_index(i, "index_update_counts", bad)] = _count(v, "an index_update_count", bad)
        all_counts[_index(dev, "index_update_counts", bad)] = d
    if not os.path.exists(path):
        raise TrainError(f"--resume: {path} is missing (the optimiser state of epoch {epoch}): start the run again")
    try:
        arrays = mx.nd.load(path)
    except mx.base.MXNetError as e:
        raise bad(f"not an MXNet NDArray file: {str(e).strip().splitlines()[-1].replace('MXNetError: ', '')[:160]}",
                  path) from None
    if not isinstance(arrays, dict):
        raise bad("its arrays are not named", path)
    states, used = {}, set()
    for k, lay in layout.items():
        idx = _index(k, "states", bad)
        if idx >= n_params:
            raise bad(f"state {k!r} is for a parameter this student does not have")
        st = _rebuild(lay, k, arrays, used, bad)
        weight = trainer._params[idx].list_data()[0]
        _same_shape(st, opt.create_state_multi_precision(idx, weight), k, bad)
        states[idx] = st
    if set(arrays) - used:
        raise bad(f"arrays {sorted(set(arrays) - used)[:3]} are not in state.json's layout", path)

    def copy(s):
        if isinstance(s, mx.nd.NDArray):
            return s.copy()
        return None if s is None else type(s)(copy(x) for x in s)

    for n, up in enumerate(ups):  # each device's Updater its own copy, moved to its device at its first update
        up.states = states if n == 0 else {i: copy(s) for i, s in states.items()}
        up.states_synced = dict.fromkeys(up.states, False)
    for o in {id(up.optimizer): up.optimizer for up in ups}.values():
        o.lr, o.wd = float(record["learning_rate"]), float(record["wd"])
        o.num_update, o.begin_num_update = num_update, begin
        o._all_index_update_counts = {dev: dict(c) for dev, c in all_counts.items()} or {0: {}}
        o._index_update_count = o._all_index_update_counts.setdefault(0, {})


def load_checkpoint(run_dir, net, trainer):
    """The student's parameters and the optimiser state of the run's last finished epoch; its
    record (state.json) was compared with the command before (kdcache.trainer.resume)."""
    state = read_state(run_dir)
    e = state["epoch"]
    saved = mx.nd.load(os.path.join(run_dir, f"student-{e:04d}.params"))
    params = net.collect_params()
    for k, v in saved.items():
        name = k.split(":", 1)[1] if ":" in k else k
        params[name].set_data(v)
    legacy = os.path.join(run_dir, LEGACY_STATES)
    if state.get("optimizer") is not None:
        load_optimizer_state(run_dir, trainer, state["optimizer"], e)
    elif "optimizer" not in state and os.path.exists(legacy):  # an older kdcache's checkpoint
        raise TrainError(f"--resume: {legacy} was written by an older kdcache with pickle, which is not loaded: "
                         f"start the run again, or resume without optimizer state by deleting {legacy}")
    else:
        log.warning("no optimiser state in %s (distributed run, or an older run's state deleted): "
                    "the optimiser restarts from its defaults", run_dir)
    return state
