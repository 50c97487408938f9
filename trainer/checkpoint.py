"""Per-epoch checkpoints of a run: the student, the optimiser state, and state.json written last."""
import json
import logging
import os

import mxnet as mx

from trainer.targets import TrainError

log = logging.getLogger("kdcache.trainer")


def save_checkpoint(run_dir, net, trainer, epoch, state):
    """Export the student and the optimiser state; state.json, written last and atomically,
    says which epoch is complete, so an interrupted save is never resumed from."""
    tmp = os.path.join(run_dir, f".tmp-{os.getpid()}")
    net.export(tmp + "-student", epoch=epoch)
    os.replace(f"{tmp}-student-{epoch:04d}.params", os.path.join(run_dir, f"student-{epoch:04d}.params"))
    os.replace(f"{tmp}-student-symbol.json", os.path.join(run_dir, "student-symbol.json"))
    if state.get("kvstore") != "dist_async":  # dist_async keeps the optimiser state on the server
        trainer.save_states(tmp + ".states")
        os.replace(tmp + ".states", os.path.join(run_dir, "trainer.states"))
    with open(tmp + ".json", "w") as fh:
        json.dump({**state, "epoch": epoch}, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp + ".json", os.path.join(run_dir, "state.json"))


def load_checkpoint(run_dir, net, trainer):
    path = os.path.join(run_dir, "state.json")
    if not os.path.exists(path):
        raise TrainError(f"--resume: {run_dir} has no checkpoint (state.json): run without --resume")
    with open(path) as fh:
        state = json.load(fh)
    e = state["epoch"]
    saved = mx.nd.load(os.path.join(run_dir, f"student-{e:04d}.params"))
    params = net.collect_params()
    for k, v in saved.items():
        name = k.split(":", 1)[1] if ":" in k else k
        params[name].set_data(v)
    states = os.path.join(run_dir, "trainer.states")
    if os.path.exists(states):
        trainer.load_states(states)
    else:
        log.warning("no optimiser state in %s (distributed run): the optimiser restarts from its defaults", run_dir)
    return state
