"""What names a cache: the teacher's files and preprocessing, the data set, the views, the codec.

Both sides compute the same CacheSpec from the same options without running anything: the
producer to write the cache, the trainer to find it (and to refuse a cache built from others).
"""
import dataclasses
import glob
import os
import re

from store import CacheSpec, file_digest

from .augment import Augment

# Bump when the producer's output for the same inputs changes (it is part of every fingerprint).
PRODUCER_VERSION = 1

# Augmentation used when --views > 1 and none is named.
DEFAULT_AUGMENT = {"digits": "crop:1", "mnist": "crop:2", "fashion-mnist": "crop:2,flip"}
DEFAULT_AUGMENT_IMAGES = "crop:4,flip"


class TeacherError(ValueError):
    """The teacher cannot be used; the message names the cause and the fix."""


def parse_teacher_arg(arg):
    """'PREFIX' or 'PREFIX:EPOCH' (or 'PREFIX-symbol.json') -> (prefix, epoch or None)."""
    m = re.fullmatch(r"(.+?)(?::(\d+))?", str(arg))
    prefix, epoch = m.group(1), m.group(2)
    if prefix.endswith("-symbol.json"):
        prefix = prefix[: -len("-symbol.json")]
    return prefix, (int(epoch) if epoch is not None else None)


def checkpoint_files(prefix, epoch=None):
    """(symbol file, params file, epoch) of an MXNet checkpoint; the latest epoch when none is given."""
    sym = f"{prefix}-symbol.json"
    if not os.path.isfile(sym):
        raise TeacherError(f"teacher symbol file {sym} not found: pass --teacher PREFIX[:EPOCH] where "
                           f"PREFIX-symbol.json and PREFIX-NNNN.params exist (as HybridBlock.export or "
                           f"Module.save_checkpoint write them)")
    if epoch is None:
        found = sorted(glob.glob(glob.escape(prefix) + "-[0-9][0-9][0-9][0-9].params"))
        if not found:
            raise TeacherError(f"no parameter file {prefix}-NNNN.params next to {sym}: export the teacher's "
                               f"weights too, or pass PREFIX:EPOCH")
        params = found[-1]
        epoch = int(params[-11:-7])
    else:
        params = f"{prefix}-{epoch:04d}.params"
        if not os.path.isfile(params):
            raise TeacherError(f"teacher parameter file {params} not found: check the epoch in "
                               f"--teacher {prefix}:{epoch}")
    return sym, params, epoch


def teacher_identity(prefix, epoch=None, *, input_name=None, mean=None, std=None, size=None):
    """The teacher as the fingerprint sees it: digests of both files plus its preprocessing."""
    sym, params, epoch = checkpoint_files(prefix, epoch)
    return {"name": os.path.basename(prefix), "epoch": epoch, "symbol_sha256": file_digest(sym),
            "params_sha256": file_digest(params), "input": input_name,
            "mean": None if mean is None else [float(v) for v in mean],
            "std": None if std is None else [float(v) for v in std],
            "size": None if not size else [int(v) for v in size]}


def resolve_augment(spec, dataset_name, views):
    """--augment auto: none for one view, the data set's usual augmentation for several."""
    if spec in (None, "", "auto"):
        if views == 1:
            return Augment()
        return Augment.parse(DEFAULT_AUGMENT.get(dataset_name, DEFAULT_AUGMENT_IMAGES))
    aug = Augment.parse(spec)
    if views > 1 and not aug.active:
        raise ValueError(f"--views {views} with --augment {spec}: every view would be the same image; "
                         f"name an augmentation (e.g. --augment crop:4,flip) or use --views 1")
    return aug


def build_spec(teacher_id, dataset, *, views=1, augment=None, seed=0, codec="full", dtype="float16"):
    """The CacheSpec for these inputs. The seed matters only when views are augmented."""
    aug = augment if augment is not None else Augment()
    inputs = {"teacher": teacher_id, "dataset": dataset.identity(), "producer": PRODUCER_VERSION,
              "augment": aug.spec if aug.active else None, "augment_seed": int(seed) if aug.active else None}
    return CacheSpec(num_samples=len(dataset), num_classes=int(dataset.num_classes), views=int(views),
                     codec=codec, dtype=dtype, inputs=inputs)


def parse_floats(s, what):
    """'0.485,0.456,0.406' -> [floats]; None stays None."""
    if s is None:
        return None
    try:
        return [float(v) for v in str(s).split(",")]
    except ValueError:
        raise ValueError(f"{what} {s!r}: use numbers separated by commas, e.g. 0.485,0.456,0.406") from None


def parse_hw(s, what):
    """'224x224' -> (224, 224); empty stays None."""
    if not s:
        return None
    try:
        h, w = (int(v) for v in str(s).lower().split("x"))
        return h, w
    except ValueError:
        raise ValueError(f"{what} {s!r}: use HxW, e.g. 224x224") from None


@dataclasses.dataclass(frozen=True)
class TeacherOptions:
    """The teacher as both command lines name it: checkpoint and preprocessing."""
    prefix: str
    epoch: object = None
    input_name: object = None
    mean: object = None
    std: object = None
    size: object = None

    @classmethod
    def from_args(cls, args, teacher=None):
        """From --teacher PREFIX[:EPOCH] (or `teacher`), --teacher-input/-mean/-std/-size."""
        prefix, epoch = parse_teacher_arg(teacher or args.teacher)
        return cls(prefix, epoch, args.teacher_input, parse_floats(args.teacher_mean, "--teacher-mean"),
                   parse_floats(args.teacher_std, "--teacher-std"), parse_hw(args.teacher_size, "--teacher-size"))

    def identity(self):
        return teacher_identity(self.prefix, self.epoch, input_name=self.input_name, mean=self.mean,
                                std=self.std, size=self.size)

    def load(self, batch_size=128):
        """The runnable teacher (imports MXNet)."""
        from .teacher import Teacher
        return Teacher(self.prefix, self.epoch, input_name=self.input_name, mean=self.mean, std=self.std,
                       size=self.size, batch_size=batch_size)


def spec_from_args(args, dataset, teacher):
    """(CacheSpec, Augment) for the shared options (--views, --augment, --seed, --codec, --dtype)."""
    augment = resolve_augment(args.augment, dataset.name, args.views)
    spec = build_spec(teacher.identity(), dataset, views=args.views, augment=augment, seed=args.seed,
                      codec=args.codec, dtype=args.dtype)
    return spec, augment
