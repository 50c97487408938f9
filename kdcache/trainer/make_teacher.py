"""python -m kdcache.trainer.make_teacher: train a teacher on a data set and export it as MXNet checkpoint files.

`make teacher` uses it to build the default teachers that every target needing a teacher falls back
on: teachers/digits-symbol.json / -0000.params for digits, teachers/mnist5k-* for mnist5k. Each data
set has its recipe (network, epochs: RECIPES) and its usual augmentation (pipeline.cachespec.usual_augment:
crop:1 for digits, crop:2 for mnist5k, rrc:HxW,flip for photos); the options override them. Each epoch is one
line (loss, train and test accuracy, seconds), and a teacher whose test accuracy is near chance (NEAR_CHANCE)
is said to be so in one line when it is exported.
"""
if __name__ == "__main__":  # first, before anything heavy is imported: signals at safe points only
    from kdcache import signals as _signals
    _signals.defer()
import copy
import logging
import os
import sys
import time

from kdcache import signals
from kdcache.args import Float, Int, Option, Parser, add_options, fail
from kdcache.errors import as_command
from kdcache.pipeline.options import SHARED_BY_DEST, check_data_applies
from kdcache.threads import fix_threads
from kdcache.trainer.options import Student, zoo_names

# Per data set: the teacher's network and epochs (others get digits' recipe); the augmentation is the data
# set's usual one (--augment auto), crop:1 for digits and crop:2 for mnist5k.
# mnist5k: mnist_teacher, 20 epochs, shifts of up to 2 pixels: 98.0-98.7% test accuracy over seeds
# 0-2 (13-20 errors of 1,000; seed 0: 98.6%), ~68 s with one thread on an AMD EPYC core (two: no faster).
RECIPES = {"digits": {"arch": "digits_teacher", "epochs": 40},
           "mnist5k": {"arch": "mnist_teacher", "epochs": 20}}

# NOTE [near chance]: chance is what guessing the test split's most common class scores (1/classes when the
# classes are balanced). A teacher's test accuracy within NEAR_CHANCE binomial standard errors of it,
# acc <= p0 + NEAR_CHANCE * sqrt(p0 (1 - p0) / n) for n test samples, cannot be told from guessing: such a
# teacher is exported (the command did what it was asked) and said to be near chance in one line, since its
# targets would teach a student nothing. 4 classes, 16 test images: up to 0.47; digits (10, 359): up to 0.13.
NEAR_CHANCE = 2.0


def chance_level(labels, num_classes, accuracy):
    """(near chance?, chance p0, threshold) of a test accuracy over `labels` (NOTE [near chance])."""
    import numpy as np
    labels = np.asarray(labels, dtype=np.int64).reshape(-1)
    n = max(len(labels), 1)
    p0 = max(1.0 / max(int(num_classes), 1), float(np.bincount(labels).max()) / n if len(labels) else 0.0)
    threshold = p0 + NEAR_CHANCE * (p0 * (1.0 - p0) / n) ** 0.5
    return accuracy <= threshold, p0, threshold


def train_teacher(dataset, test, *, arch="digits_teacher", epochs=40, batch_size=64, lr=2e-3, seed=0,
                  augment="crop:1", schedule="cosine", progress=True):
    """Train `arch` with Adam on hard labels; returns (net, test accuracy).

    Regularised to be a strong teacher (KD needs one): dropout in the net, a fresh keyed view of each
    sample every epoch (view = epoch: the pipeline's keyed augmentation of (seed, sample, view), as the
    producer and the trainer make views; `augment="none"` turns it off), and a cosine learning-rate decay
    from `lr` to 0 (`schedule="constant"` keeps `lr`). The test split is seen as a model trained on these
    views is evaluated (rrc:SIZE's centre crop). With `progress`, each epoch logs one line: its mean
    loss, the accuracy on the epoch's training views, the test accuracy and its seconds.
    On digits this takes the default teacher from 97.5% (constant lr, one shift per batch,
    global average pooling) to 99.4-99.7% over seeds 0-2 (1-2 errors of 359), ~45 s on one core.
    """
    import math

    import mxnet as mx
    import numpy as np
    from mxnet import autograd, gluon

    from kdcache.pipeline.augment import as_augment, eval_views, mixes
    from kdcache.trainer.errors import BadValueError
    from kdcache.trainer.models import TEACHER_NETS, get_model
    if schedule not in ("cosine", "constant"):
        raise BadValueError(f"learning-rate schedule {schedule!r}: use cosine or constant")
    aug = as_augment(augment)  # an Augment as --augment parsed it, or its spec string
    if mixes(aug):
        raise BadValueError(f"augmentation {aug.spec}: the teacher trains on single images with hard labels; mixing "
                            f"(mixup, cutmix) is for the student's views: drop {aug.mix}:{aug.mix_alpha:g}")
    test = eval_views(test, aug)
    mx.random.seed(seed)
    np.random.seed(seed)
    net = (TEACHER_NETS[arch](dataset.num_classes, prefix="teacher_") if arch in TEACHER_NETS
           else get_model(arch, dataset.num_classes, prefix="teacher_"))
    net.initialize(mx.init.Xavier(), ctx=mx.cpu())
    net.hybridize(static_alloc=True)
    trainer = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": lr, "wd": 1e-4})
    loss_fn = gluon.loss.SoftmaxCrossEntropyLoss()
    rng = np.random.default_rng(seed)
    n = len(dataset)
    total = epochs * -(-n // batch_size)
    step = 0
    acc = None
    for epoch in range(epochs):
        t0 = time.perf_counter()
        perm = rng.permutation(n)
        loss_sum, correct = 0.0, 0
        for a in range(0, n, batch_size):
            signals.check()  # Ctrl-C and SIGTERM stop here, between steps (a no-op unless deferred)
            if schedule == "cosine":
                trainer.set_learning_rate(lr * 0.5 * (1.0 + math.cos(math.pi * step / total)))
            idx = perm[a:a + batch_size]
            x, y = dataset.get_batch(idx)
            x = aug.apply(x, seed, idx, epoch)  # view = epoch: a new view of each sample every epoch
            label = mx.nd.array(y)
            with autograd.record():
                out = net(mx.nd.array(x))
                loss = loss_fn(out, label)
            loss.backward()
            trainer.step(x.shape[0])
            if progress:
                loss_sum += float(loss.sum().asscalar())
                correct += int((out.argmax(axis=1).asnumpy() == y).sum())
            step += 1
        if progress or epoch == epochs - 1:
            acc = accuracy(net, test)
        if progress:
            logging.info("epoch %d/%d  loss %.4f  train acc %.4f  test acc %.4f  %.1f s", epoch + 1, epochs,
                         loss_sum / n, correct / n, acc, time.perf_counter() - t0)
    return net, acc


# The names of models.TEACHER_NETS (the networks are defined there), for the command line: models imports MXNet.
TEACHER_ARCHS = ("mnist_teacher",)


class Arch(Student):
    """A teacher network: digits_teacher, mnist_teacher, small_cnn, mlp, mlp128 or a Gluon model-zoo name."""

    def __call__(self, s):
        zoo = zoo_names()
        if s not in TEACHER_ARCHS and s not in self.BUILTIN and zoo is not None and s not in zoo:
            fail(f"{s!r} is not a known network: use digits_teacher, mnist_teacher, small_cnn, mlp or a Gluon "
                 f"model-zoo name such as resnet18_v1")
        return s


def accuracy(net, dataset, batch_size=256):
    import mxnet as mx
    import numpy as np
    correct = 0
    for a in range(0, len(dataset), batch_size):
        x, y = dataset.get_batch(np.arange(a, min(len(dataset), a + batch_size)))
        correct += int((net(mx.nd.array(x)).asnumpy().argmax(axis=1) == y).sum())
    return correct / len(dataset)


# The shared --augment (its type, default and values), as the teacher reads it: every epoch is a new view.
AUGMENT_HELP = ("the keyed augmentation each epoch's view of a sample is made with (view = epoch), as the "
                "producer's and the trainer's --augment: auto = the data set's usual one, crop:1 for digits, "
                "crop:2 for mnist5k, rrc:HxW,flip for photos (imagefolder, recordio; HxW the images' size after "
                "--image-size), crop:4,flip for others; none turns it off")


def _as_teacher(option, help):
    """A shared option with the teacher's own help (and no Make variable: `make teacher` does not pass it)."""
    o = copy.copy(option)
    o.help, o.make = help, None
    return o


TEACHER = [
    SHARED_BY_DEST["dataset"], SHARED_BY_DEST["data_root"], SHARED_BY_DEST["image_size"], SHARED_BY_DEST["num_classes"],
    SHARED_BY_DEST["classes"],
    Option("--arch", "network: digits_teacher, mnist_teacher, small_cnn, mlp, or a Gluon model-zoo name "
           "(default: the data set's, digits_teacher for digits and others, mnist_teacher for mnist5k)",
           type=Arch(), metavar="ARCH", group="teacher"),
    Option("--out", "checkpoint prefix: writes PREFIX-symbol.json, PREFIX-0000.params, PREFIX-info.json "
           "(default teachers/NAME: teachers/digits, teachers/mnist5k, ...)", metavar="PREFIX", group="teacher"),
    Option("--epochs", "training epochs (default: the data set's, 40 for digits and others, 20 for mnist5k)",
           type=Int(1, 100000), metavar="E", group="teacher"),
    Option("--lr", "Adam learning rate at the start", type=Float(0, 10, gt=True), default=2e-3, metavar="LR",
           group="teacher"),
    Option("--schedule", "learning-rate schedule (cosine decays to 0 over the epochs)",
           choices=("cosine", "constant"), default="cosine", group="teacher"),
    _as_teacher(SHARED_BY_DEST["augment"], AUGMENT_HELP),
    Option("--seed", "seed of the initialisation and the augmentation", type=Int(0, 2 ** 32 - 1), default=0,
           metavar="S", group="teacher"),
    Option("--threads", "compute threads (default: all cores)", type=Int(1, 1024), metavar="N", group="teacher"),
    Option("--quiet", "no line per epoch (the test split is then evaluated once, at the end)", action="store_true",
           group="teacher"),
]
@as_command  # a KdcacheError (a data set's, an augmentation's) is one line and exit 2; anything else shows as a bug
def main(argv=None, prog="python -m kdcache.trainer.make_teacher"):
    p = Parser(prog=prog, description=__doc__.split("\n\n")[0])
    add_options(p, TEACHER)
    args = p.parse_args(argv)
    check_data_applies(args, p)
    if getattr(args.augment, "mix", None):
        p.error(f"argument --augment: {args.augment.spec}: the teacher trains on single images with hard "
                f"labels; mixing (mixup, cutmix) is for the student's views: drop {args.augment.mix}")
    base = args.dataset.split(":", 1)[0].lower()
    for dest, value in RECIPES.get(base, RECIPES["digits"]).items():
        if getattr(args, dest) is None:
            setattr(args, dest, value)
    if args.out is None:
        args.out = os.path.join("teachers", base)
    if not args.out.strip() or args.out.endswith(os.sep) or os.path.isdir(args.out):
        p.error(f"argument --out: {args.out!r} names a folder: give a prefix, e.g. teachers/digits")
    parent = os.path.dirname(os.path.abspath(args.out))
    while not os.path.exists(parent):  # the folders are created; none of them may be a file
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        p.error(f"argument --out: {parent} is a file, not a folder: give a prefix in a folder")
    fix_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="[teacher %(asctime)s] %(message)s", datefmt="%H:%M:%S")
    try:
        from kdcache.pipeline.cachespec import resolve_augment, usual_augment
        from kdcache.pipeline.datasets import load_from_options
        train, test = load_from_options(args, "train"), load_from_options(args, "test")
        if args.augment == "auto":
            args.augment = usual_augment(train)
        elif isinstance(args.augment, str):  # MODULE:FUNCTION: loaded, and run once, before any training
            args.augment = resolve_augment(args.augment, train, 1)
            args.augment.check(train, args.seed)
        if train.num_classes != test.num_classes:
            from kdcache.pipeline.dataset_base import DatasetError
            raise DatasetError(f"the train split has {train.num_classes} classes, the test split "
                               f"{test.num_classes}: the two splits must have the same classes")
        logging.info("teacher %s on %s (%d train, %d test samples, %d classes, images %s), %d epochs, augment %s",
                     args.arch, args.dataset, len(train), len(test), train.num_classes,
                     "x".join(map(str, train.shape)), args.epochs, args.augment.spec)
        t0 = time.perf_counter()
        net, acc = train_teacher(train, test, arch=args.arch, epochs=args.epochs, lr=args.lr, seed=args.seed,
                                 augment=args.augment, schedule=args.schedule, progress=not args.quiet)
        signals.check()  # the last stop before the export
    except KeyboardInterrupt as e:
        print(f"{signals.stop_word(e)}: no teacher was written; run the same command again", file=sys.stderr)
        return signals.exit_status(e)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    # Export under a temporary prefix, then rename: a half-written teacher is never picked up.
    tmp = f"{args.out}.tmp{os.getpid()}"
    net.export(tmp, epoch=0)
    os.replace(f"{tmp}-0000.params", f"{args.out}-0000.params")
    os.replace(f"{tmp}-symbol.json", f"{args.out}-symbol.json")
    info = {"dataset": args.dataset, "arch": args.arch, "epochs": args.epochs, "lr": args.lr,
            "schedule": args.schedule, "augment": args.augment.spec, "seed": args.seed,
            "image_size": list(args.image_size) if args.image_size else None,
            "classes": list(args.classes) if args.classes else None, "test_acc": acc,
            "seconds": round(time.perf_counter() - t0, 1)}
    near, chance, threshold = chance_level(test.labels, test.num_classes, acc)
    info.update(chance=round(chance, 6), near_chance=bool(near))
    from kdcache.store.osutil import write_json_atomic
    write_json_atomic(f"{args.out}-info.json", info, indent=1)
    logging.info("teacher %s: test accuracy %.4f on %s (%d samples), exported to %s-symbol.json / -0000.params",
                 args.arch, acc, args.dataset, len(test), args.out)
    if near:
        logging.warning("warning: the teacher's test accuracy %.4f is near chance (%.4f, the test split's most common "
                        "class; anything up to %.4f cannot be told from guessing on %d test samples): its targets "
                        "would teach a student nothing; train longer (--epochs), try another --arch or --lr, or "
                        "give it more images", acc, chance, threshold, len(test))
    return 0


if __name__ == "__main__":
    sys.exit(main())
