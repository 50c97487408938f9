"""The KD loss: alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y).

The hard term CE may smooth the labels (label_smoothing eps: the target (1 - eps) one-hot + eps / C,
GluonCV's --label-smoothing) and, for mixed views (pipeline.augment NOTE (mixed views)), mixes two
labels: lam * CE(s, y_i) + (1 - lam) * CE(s, y_j), the labels then rows (y_i, y_j, lam).

Targets are the teacher's raw logits (temperature 1, as cached), so one cache serves every
temperature. GluonCV's DistillationSoftmaxCrossEntropyLoss uses T=20 and hard weight 0.5.

NOTE (non-finite losses): one NaN target makes its batch's loss NaN, and the first optimiser
step with it spreads NaN through every weight: the run goes on at loss nan and ends with a
useless student. KDLoss cannot check its own output (it runs inside a hybridized graph, and a
check there would wait for the device at every step), so `check_finite` is the check: call it
where the loop reads the loss anyway, before the optimiser step.

The trainer's loop keeps the check off the critical path (MXNet computes a step while Python
prepares the next; a wait for the loss at every step takes that overlap away): the batch's
targets and images are on the host, so `host_finite` finds a NaN or Inf there before the
optimiser step without waiting for MXNet, and only then does the loop wait for that step's loss
(check_finite, which names the keys and the cause); the loss itself is read one step late
(`LateLoss`), when MXNet has long computed it. A loss that turns non-finite with finite targets
and images (the student diverged) is found one step later than it happens: the run stops there,
before any checkpoint holds the weights it spoiled.
"""
import numpy as np
from mxnet import gluon

from kdcache.args import Temperature
from kdcache.store.format.schema import name_keys
from kdcache.trainer.defaults import DEFAULT_ALPHA, DEFAULT_TEMPERATURE, SMOOTHING
from kdcache.trainer.errors import BadValueError, TrainError


class NonFiniteError(TrainError, ValueError):
    """Teacher targets or a loss hold NaN or Inf; the message names the keys and the likely cause."""


class NonFiniteLossError(NonFiniteError):
    """A loss is NaN or Inf; the message names the step, the keys and the likely cause."""


def check_targets(targets, indices, views, *, cache=None):
    """Raise NonFiniteError naming the keys whose teacher targets [B, C] hold NaN or Inf: a reader
    serves what the file holds, and no teacher writes these (it is checked at write time)."""
    ok = _rows(targets)
    if not ok.all():
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        vs = np.broadcast_to(np.asarray(views, dtype=np.int64), idx.shape)
        raise NonFiniteError(f"the teacher targets of {name_keys(idx[~ok], vs[~ok])} hold NaN or Inf: the cache "
                             f"is damaged; run `kdcache verify {cache or 'PATH'}`, then remove it and rebuild")


def _numpy(a):
    return a.asnumpy() if hasattr(a, "asnumpy") else np.asarray(a)


def _rows(a):
    """Per sample: all values finite. `a`: [B, ...] (an NDArray, an array, or a list of them, one per device)."""
    if isinstance(a, (list, tuple)):
        return np.concatenate([_rows(x) for x in a]) if a else np.ones(0, dtype=bool)
    x = _numpy(a)
    return np.isfinite(x.reshape(len(x), -1)).all(axis=1) if x.ndim else np.isfinite(x).reshape(1)


def check_finite(loss, *, keys=None, targets=None, inputs=None, where="", cache=None):
    """The loss summed, as a float; NonFiniteLossError (one line) when it is NaN or Inf.

    loss: KDLoss's output (an NDArray or array of per-sample losses, or a list of them, one per
    device). keys: the batch's samples, as sample indices or (sample indices, views). targets and
    inputs, the batch's teacher logits and images (optional; targets=() for a loss without a
    teacher): rows of them that are not finite are named as the cause. where: the step, as the
    message should name it ("epoch 2 batch 17"); cache: the cache's path, for the `kdcache verify`
    the message proposes.
    """
    parts = loss if isinstance(loss, (list, tuple)) else [loss]
    with np.errstate(over="ignore", invalid="ignore"):  # an overflowing loss is named below, not warned about
        total = float(sum(float(np.sum(_numpy(x), dtype=np.float64)) for x in parts))
    if np.isfinite(total):
        return total
    idx, views = (keys if isinstance(keys, tuple) else (keys, 0)) if keys is not None else (None, 0)
    if idx is not None:
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        views = np.broadcast_to(np.asarray(views, dtype=np.int64), idx.shape)

    def named(ok):
        if idx is None or ok.size != idx.size:
            return f"{int((~ok).sum())} of {ok.size} samples"
        return name_keys(idx[~ok], views[~ok])
    head = f"{where + ': ' if where else ''}the loss is {total}"
    if targets is not None and not (ok := _rows(targets)).all():
        fix = f"run `kdcache verify {cache}`" if cache else "run `kdcache verify PATH` on the cache"
        raise NonFiniteLossError(f"{head}: the teacher targets of {named(ok)} hold NaN or Inf: the cache is "
                                 f"damaged (no teacher writes these); {fix}, then remove it and rebuild")
    if inputs is not None and not (ok := _rows(inputs)).all():
        raise NonFiniteLossError(f"{head}: the input images of {named(ok)} hold NaN or Inf: the data set or the "
                                 f"augmentation makes them; fix it")
    shown = f" (batch of {name_keys(idx, views)})" if idx is not None else ""
    if targets is None:
        raise NonFiniteLossError(f"{head}{shown}: a damaged cache gives NaN or Inf targets (run `kdcache verify "
                                 f"{cache or 'PATH'}`), or the student diverged (lower the learning rate)")
    finite = "targets and inputs" if inputs is not None else "targets"
    raise NonFiniteLossError(f"{head}{shown}, with finite {finite}: the student diverged; lower the learning "
                             f"rate (--lr) or the temperature, or raise the weight decay")


def host_finite(*arrays):
    """True when every value of these host arrays (numpy; None skipped) is finite: one float64 sum each, which
    NaN or Inf anywhere makes non-finite and no float32 values can overflow. No copy, no wait for a device."""
    return all(a is None or np.isfinite(np.sum(a, dtype=np.float64)) for a in arrays)


class LateLoss:
    """A loop's losses read one step late (NOTE above): add() holds this step's loss and returns the step
    before's, checked by check_finite with that step's keys, targets and images; flush() returns the last
    one. Reading a loss MXNet computed a step ago does not wait, so the device stays busy."""

    def __init__(self, cache=None):
        self.cache = cache
        self._held = None

    def add(self, losses, **kw):
        """This step's losses (and check_finite's keys, targets, inputs, where); the step before's sum, 0.0 at first."""
        held, self._held = self._held, (losses, kw)
        return 0.0 if held is None else check_finite(held[0], cache=self.cache, **held[1])

    def flush(self):
        """The held step's sum (0.0 when none), checked; nothing is held after it."""
        held, self._held = self._held, None
        return 0.0 if held is None else check_finite(held[0], cache=self.cache, **held[1])


class KDLoss(gluon.loss.Loss):
    """Per-sample KD loss from student logits, teacher logits and hard labels.

    alpha=0 gives plain cross-entropy on the labels (no teacher); alpha=1 the soft term only.
    label_smoothing: eps in [0, 1) of the hard term (0: none). mixed: the labels are rows (label,
    partner's label, λ) of mixed views (SoftTargetDataset.mixes, pipeline.augment.mixes), the hard
    term λ CE(y_i) + (1 - λ) CE(y_j).
    """

    def __init__(self, temperature=DEFAULT_TEMPERATURE, alpha=DEFAULT_ALPHA, *, label_smoothing=0.0, mixed=False,
                 **kw):
        super().__init__(weight=None, batch_axis=0, **kw)
        self.temperature = temperature_of(temperature)
        self.alpha = float(alpha)
        self.label_smoothing = smoothing_of(label_smoothing)
        self.mixed = bool(mixed)

    def hybrid_forward(self, F, student, teacher, label):
        # alpha=0: no teacher term at all (0 * a NaN target would still be NaN)
        return kd_formula(F, student, teacher if self.alpha else None, label, temperature=self.temperature,
                          alpha=self.alpha, label_smoothing=self.label_smoothing, mixed=self.mixed)


def temperature_of(value):
    """The KD temperature as a float, checked as the command line checks --temperature (kdcache.args.Temperature):
    ValueError in one line outside 0.01 to 1000."""
    return Temperature().coerce(value, "temperature", error=BadValueError)


def smoothing_of(value):
    """Label smoothing as a float in [0, 1), checked as the command line checks --label-smoothing."""
    return SMOOTHING.coerce(value, "label_smoothing", error=BadValueError)


def hard_term(F, student, label, *, label_smoothing=0.0, mixed=False):
    """The per-sample cross-entropy with the labels: -log p_y, or with smoothing eps
    -(1 - eps) log p_y - eps * mean_c log p_c (the target (1 - eps) one-hot + eps / C); with `mixed`
    labels (rows y_i, y_j, λ) λ CE(y_i) + (1 - λ) CE(y_j)."""
    eps = float(label_smoothing)
    log_p = F.log_softmax(student, axis=1)

    def ce(y):
        if not eps:
            return -F.pick(log_p, y, axis=1)  # as before smoothing existed: the same graph
        return -(1.0 - eps) * F.pick(log_p, y, axis=1) - eps * F.mean(log_p, axis=1)
    if not mixed:
        return ce(label)
    y_i, y_j, lam = F.split(label, num_outputs=3, axis=1, squeeze_axis=True)
    return lam * ce(y_i) + (1.0 - lam) * ce(y_j)


def kd_formula(F, student, teacher, label, *, temperature, alpha, label_smoothing=0.0, mixed=False):
    """The per-sample KD loss, written once for Gluon (F=mx.nd, or the hybridized F) and the Module
    API (F=mx.sym): alpha * T^2 * KL(softmax(t/T) || softmax(s/T)) + (1 - alpha) * CE(s, y), the KL
    summed over classes. The T^2 keeps the soft term's gradients on the scale of the hard term's
    whatever T is (Hinton et al. 2015). teacher=None gives the cross-entropy alone. CE is hard_term:
    smoothed by `label_smoothing`, and over two labels mixed by λ for `mixed` labels."""
    t, alpha = float(temperature), float(alpha)
    ce = hard_term(F, student, label, label_smoothing=label_smoothing, mixed=mixed)
    if teacher is None:
        return ce
    log_ps = F.log_softmax(student / t, axis=1)
    log_pt = F.log_softmax(teacher / t, axis=1)
    kl = F.sum(F.exp(log_pt) * (log_pt - log_ps), axis=1)
    return alpha * t * t * kl + (1.0 - alpha) * ce
