"""The training recipe's pieces without MXNet: the learning-rate schedule, the validation slice, epochs.csv."""
import csv
import io
import math
import os

import numpy as np

EPOCH_COLUMNS = ("epoch", "loss", "top1", "top5", "val_top1", "agreement", "lr", "samples_per_s", "stall_s")


class LRSchedule:
    """The learning rate of every update, a pure function of the update's number.

    MXNet's optimisers call it with their `num_update` (1 for the first update) and set `base_lr`;
    the position in the schedule is therefore the update counter, which the checkpoint restores:
    a resumed run gets the same rate at each step as an uninterrupted one. A plain class (not
    MXNet's LRScheduler), so it pickles to a dist_async server without MXNet state.

    Epoch position t = (update - 1) / steps_per_epoch. Warm-up: base * update / (warmup * spe),
    linear from one update's share to base. After it: constant base; step: base * factor**k, k the
    number of --lr-steps epochs reached (t >= s); cosine: base * (1 + cos(pi * (t - warmup) /
    (epochs - warmup))) / 2.
    """

    def __init__(self, base_lr, *, mode="constant", steps=(), factor=0.1, warmup=0, spe=1, epochs=1):
        self.base_lr, self.mode, self.steps, self.factor = float(base_lr), mode, tuple(steps), float(factor)
        self.warmup, self.spe, self.epochs = int(warmup), int(spe), int(epochs)

    def __call__(self, num_update):
        u = max(1, int(num_update))
        warm = self.warmup * self.spe
        if u <= warm:
            return self.base_lr * u / warm
        t = (u - 1) / self.spe
        if self.mode == "step":
            return self.base_lr * self.factor ** sum(t >= s for s in self.steps)
        if self.mode == "cosine":
            span = max(1e-12, self.epochs - self.warmup)
            return self.base_lr * (1 + math.cos(math.pi * min(1.0, (t - self.warmup) / span))) / 2
        return self.base_lr

    def at_epoch(self, epoch):
        """The rate of epoch `epoch`'s (0-based) first update."""
        return self(epoch * self.spe + 1)


def schedule_of(args, spe):
    """The schedule the options name, for `spe` updates per epoch."""
    steps = args.lr_steps if args.lr_steps is not None else default_steps(args.epochs)
    return LRSchedule(args.lr, mode=args.lr_mode, steps=steps if args.lr_mode == "step" else (),
                      factor=args.lr_factor, warmup=args.warmup_epochs, spe=spe, epochs=args.epochs)


def default_steps(epochs):
    """--lr-mode step without --lr-steps: a tenth of the rate at half and at three quarters of the epochs."""
    return tuple(sorted({max(1, epochs // 2), max(1, (3 * epochs) // 4)}))


def val_indices(n, fraction, seed):
    """The validation slice of the training split: round(n * fraction) items (at least one when
    fraction > 0), drawn by the seed alone, sorted. The same on every run and every worker."""
    if fraction <= 0:
        return np.zeros(0, dtype=np.int64)
    k = min(n - 1, max(1, int(round(n * fraction))))
    # a stream of its own ("val" in the key): not the epochs' permutations
    return np.sort(np.random.default_rng([int(seed), 0x76616C]).permutation(int(n))[:k]).astype(np.int64)


class Subset:
    """Items `indices` of a data set, as a data set (get_batch, len)."""

    def __init__(self, dataset, indices):
        self.dataset, self.indices = dataset, np.asarray(indices, dtype=np.int64)
        self.num_classes = getattr(dataset, "num_classes", None)

    def __len__(self):
        return len(self.indices)

    def get_batch(self, indices):
        return self.dataset.get_batch(self.indices[np.asarray(indices, dtype=np.int64)])


class EpochLog:
    """epochs.csv in the run folder: one row per finished epoch, appended and flushed before the
    epoch's checkpoint. A resume keeps the rows of the epochs its checkpoint holds and drops any
    row written after it (an epoch whose checkpoint a crash cut off runs again)."""

    def __init__(self, run_dir, resume_after=None):
        self.path = os.path.join(run_dir, "epochs.csv")
        rows = []
        if resume_after is not None and os.path.exists(self.path):
            with open(self.path, newline="") as fh:
                rows = [r for r in csv.DictReader(fh)
                        if r.get("epoch", "").isdigit() and int(r["epoch"]) <= resume_after + 1]
        from kdcache.store.osutil import write_atomic
        text = io.StringIO(newline="")
        w = csv.DictWriter(text, EPOCH_COLUMNS, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
        write_atomic(self.path, text.getvalue().encode("utf-8"), fsync=False)  # the rows after it are appended unsynced

    def append(self, row):
        """`row`: epoch (1-based), the rest numbers or None (an empty cell)."""
        with open(self.path, "a", newline="") as fh:
            csv.writer(fh).writerow(["" if row.get(c) is None else
                                     (f"{row[c]:.6g}" if isinstance(row[c], float) else row[c]) for c in EPOCH_COLUMNS])
            fh.flush()
            os.fsync(fh.fileno())
