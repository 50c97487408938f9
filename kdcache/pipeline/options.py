"""Every command-line option, declared once: name, type, default, allowed values, help.

The options the producer and the trainer share (SHARED) name the same cache and the same
schedule, so they are declared here once; both command lines, the producer command line the
trainer builds for its child, and the Makefile's variables (`make` names) derive from them.
Each option's type checks its value where it is parsed: a mistake ends the command with one
line naming the option, the value and what is allowed, and exit status 2. No MXNet here.
"""
import math
import os
import re
import sys
from typing import NamedTuple

from kdcache.args import Allowed, ClassNames, Dir, Floats, Int, Name, Option, Path, Size, fail, option_table
from kdcache.errors import as_command

from .augment import Augment

# The default teachers, by data set: `kdcache teacher --dataset NAME` (make teacher DATASET=NAME) builds them.
DEFAULT_TEACHERS = {name: os.path.join("teachers", name) for name in ("digits", "mnist5k")}
DEFAULT_TEACHER = DEFAULT_TEACHERS["digits"]


class Codec(Allowed):
    """A codec spec, as the store's registry of codecs (kdcache.store.format.codec.CODECS) reads it."""

    def allowed(self):
        from kdcache.store.format.codec import codec_grammar
        return codec_grammar()

    def __call__(self, s):
        from kdcache.store.format.codec import parse_codec
        from kdcache.store.errors import BadInputError
        try:
            return parse_codec(s)
        except BadInputError as e:
            fail(str(e))


class AugmentSpec(Allowed):
    """auto | none | crop:PAD | flip | crop:PAD,flip | rrc:SIZE[,scale=A-B][,ratio=A-B][,flip] | center:SIZE |
    eval:RESIZE/SIZE, each optionally with ,mixup:ALPHA or ,cutmix:ALPHA | MODULE:FUNCTION.

    rrc is torchvision's RandomResizedCrop to SIZE (N or HxW; scale 0.08-1 and ratio 3/4-4/3 by
    default), center:SIZE and eval:RESIZE/SIZE the evaluation transform (short side resized to
    RESIZE, SIZE/0.875 for center, then the centre crop). The value: an Augment, or "auto" (it
    depends on the views and the data set), or the string MODULE:FUNCTION (loading it imports the
    user's module: that waits for the data). mixup:ALPHA and cutmix:ALPHA (ALPHA > 0) mix each view with a
    partner's keyed view (pipeline.augment NOTE (mixed views))."""

    def __call__(self, s):
        from .augment import is_builtin
        from .user_code import is_piece
        if is_piece(str(s)) and not is_builtin(s):
            return str(s).strip()  # MODULE:FUNCTION(image, rng), loaded (and checked) with the data
        v = str(s).strip().lower()
        if v == "auto":
            return v
        try:
            aug = Augment.parse(v)
        except ValueError as e:
            fail(f"{e}; or auto, or MODULE:FUNCTION (your own: FUNCTION(image, rng) -> image)")
        if aug.pad > 64:
            fail(f"{s!r}: crop padding {aug.pad} is more than 64 pixels")
        return aug

    @staticmethod
    def format(v):
        return v.spec if isinstance(v, Augment) else str(v)


class DatasetSpec(Allowed):
    """digits | mnist5k | synthetic[:n=N,classes=K,shape=CxHxW,seed=S] | mnist | fashion-mnist | cifar10 | cifar100 | npz |
    recordio | imagefolder | MODULE:FUNCTION (the files, or the function, are checked when the data set loads)."""

    def __call__(self, s):
        from .datasets import DATASETS, DatasetError, parse_synthetic
        from .user_code import is_piece
        v = str(s).strip()
        if is_piece(v):
            return v  # MODULE:FUNCTION, loaded (and checked) with the data
        base, colon, params = v.partition(":")
        base = base.strip().lower()
        v = base + colon + params  # the data set's name as the default teachers and recipes know it
        if base not in DATASETS:
            fail(f"unknown data set {s!r}: use one of {', '.join(DATASETS)}, or MODULE:FUNCTION (your own)")
        if base != "synthetic" and ":" in v:
            fail(f"{s!r}: only synthetic takes parameters (synthetic:n=N,classes=K,shape=CxHxW,seed=S)")
        if base == "synthetic":
            try:
                kw = parse_synthetic(v)
            except DatasetError as e:
                fail(str(e))
            kw = {"n": 10000, "classes": 10, "shape": (3, 32, 32), "seed": 0, **kw}  # load_synthetic's defaults
            shape = kw["shape"]
            if kw["n"] < 5 or kw["classes"] < 2 or kw["seed"] < 0 or len(shape) != 3 or min(shape) < 1 \
                    or shape[0] not in (1, 3) or kw["n"] * math.prod(shape) > 2 ** 34:
                fail(f"{s!r}: use n >= 5 (the test split has n/5), classes >= 2, seed >= 0, shape CxHxW with C 1 "
                     f"or 3 and H, W >= 1, at most 16 GiB of pixels")
        return v


class CachePath(Allowed):
    """A cache's path: P, P.h5 or P.parts (not a folder of its own)."""

    def __call__(self, s):
        from kdcache.store.files.paths import base_path  # the store's own reading of P, P.h5 and P.parts
        if str(s).strip() == "auto":
            return None
        v = base_path(str(s).strip())
        if not v.rstrip("/"):
            fail(f"{s!r}: an empty path: name the cache, P or P.h5")
        if base_path(v) != v:  # the store reads P.h5.h5 as P.h5, which is P: one name, one cache
            fail(f"{s!r}: name the cache P, P.h5 or P.parts with P not ending in .h5 or .parts")
        if os.path.isdir(v):
            fail(f"{s!r} is a folder: name the cache inside it (P: the files are P.h5 and P.parts), or pass "
                 f"--cache-dir {s}")
        return v

    @staticmethod
    def format(v):
        return v + ".h5"  # P.h5 names P even when P is "auto"


class ShardOf(NamedTuple):
    """Shard `index` of `count`: the keys with key mod count = index. Written i/n."""
    index: int
    count: int

    def __str__(self):
        return f"{self.index}/{self.count}"


class Shard(Allowed):
    """i/n with 0 <= i < n."""

    def __call__(self, s):
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(s))
        if not m or int(m.group(2)) < 1 or int(m.group(1)) >= int(m.group(2)):
            fail(f"{s!r}: use i/n with 0 <= i < n, e.g. 0/2")
        return ShardOf(int(m.group(1)), int(m.group(2)))


TEACHER, DATA, CACHE, SCHEDULE = "teacher", "data", "cache", "schedule (the same for the producer and the trainer)"

# What the producer and the trainer share: these name the cache and the schedule.
SHARED = [
    Option("--teacher", "MXNet checkpoint: PREFIX-symbol.json + PREFIX-NNNN.params (latest epoch if none); "
           f"for --dataset digits the default is {DEFAULT_TEACHER}, for mnist5k {DEFAULT_TEACHERS['mnist5k']}, "
           f"built by `kdcache teacher --dataset NAME`",
           metavar="PREFIX[:EPOCH]", group=TEACHER, make="TEACHER"),
    Option("--teacher-input", "the teacher's image input (found when there is one)", metavar="NAME",
           type=Name(), group=TEACHER),
    Option("--teacher-mean", "per-channel mean subtracted from the [0,1] images (one value, or one per channel)",
           type=Floats(), metavar="M[,M,M]", group=TEACHER),
    Option("--teacher-std", "per-channel std the images are divided by (> 0)", type=Floats(positive=True),
           metavar="S[,S,S]", group=TEACHER),
    Option("--teacher-size", "resize images to HxW for the teacher", type=Size(), metavar="HxW", group=TEACHER),
    Option("--dataset", "digits | mnist5k (embedded) | synthetic[:n=..,classes=..,shape=CxHxW,seed=..] | mnist | "
           "fashion-mnist | cifar10 | cifar100 | npz | recordio | imagefolder | MODULE:FUNCTION (your own: "
           "FUNCTION(split) returns a data set of (image, label))", type=DatasetSpec(),
           default="digits", metavar="NAME", group=DATA, make="DATASET"),
    Option("--data-root", "local files of the data set (nothing is downloaded); their digests are remembered in "
           "$KDCACHE_DIGEST_MEMO (default ~/.cache/kdcache/digests.json), so a rerun reads nothing", type=Path(exists=True),
           metavar="PATH", group=DATA, make="DATA_ROOT"),
    Option("--image-size", "resize decoded images to HxW (recordio, imagefolder)", type=Size(), metavar="HxW",
           group=DATA),
    Option("--num-classes", "class count when the files do not say (npz, recordio)", type=Int(2, 1 << 24),
           metavar="N", group=DATA),
    Option("--classes", "train on these classes only, labelled 0, 1, ... in the order given: class folder names "
           "(imagefolder) or label numbers (recordio), e.g. cat,dog or 0,3,7; part of the data set's identity, so "
           "its cache is its own", type=ClassNames(), metavar="C,C,...", group=DATA),
    Option("--views", "augmented views per sample; epoch e uses view e mod V", type=Int(1, 10000), default=1,
           metavar="V", group=DATA, make="VIEWS"),
    Option("--augment", "auto | none | crop:PAD | flip | crop:PAD,flip | rrc:SIZE[,scale=A-B][,ratio=A-B][,flip] "
           "(RandomResizedCrop to SIZE = N or HxW) | center:SIZE | eval:RESIZE/SIZE (short side to RESIZE, "
           "SIZE/0.875 for center, then the centre crop: every view the same), each optionally with ,mixup:ALPHA or "
           ",cutmix:ALPHA (ALPHA > 0: each view mixed with a keyed partner's view, λ ~ Beta(ALPHA, ALPHA); the teacher "
           "sees the mixed image, the student's hard labels are mixed by λ; e.g. crop:4,flip,mixup:0.2) | "
           "MODULE:FUNCTION (your own: "
           "FUNCTION(image, rng) -> image, rng seeded by (seed, sample, view)); auto = none for 1 view, else the "
           "data set's usual (crop:1 digits, crop:2 mnist5k and mnist, crop:2,flip fashion-mnist, rrc:HxW,flip "
           "photos at their size, crop:4,flip others)", type=AugmentSpec(), default="auto", metavar="SPEC", group=DATA, make="AUGMENT"),
    Option("--seed", "seed of the schedule and of the augmentation", type=Int(0, 2 ** 32 - 1), default=0,
           metavar="S", group=DATA, make="SEED"),
    Option("--cache-dir", "cache directory (default: $KDCACHE_DIR, else ./caches); a cache file or folder another "
                          "user owns or can write is refused unless $KDCACHE_TRUST_OTHERS is 1 (kdcache --trust-others)", type=Dir(), metavar="DIR",
           group=CACHE, make="CACHE_DIR"),
    Option("--cache", "explicit cache path instead of <cache-dir>/<fingerprint>", type=CachePath(), metavar="PATH",
           group=CACHE),
    Option("--codec", "full (raw logits) | topk:K (the K largest logits and the tail's mass) | int8 (every logit "
           "in 8 bits over the row's range) | sampled:K (K draws from the teacher's distribution at T = 1, an unbiased "
           "sparse estimate)", type=Codec(), default="full", metavar="CODEC", group=CACHE,
           make="CODEC"),
    Option("--dtype", "storage type of the logits (full, topk:K; int8 stores 8-bit codes and takes float16 only)",
           choices=("float16", "float32"), default="float16", group=CACHE),
    Option("--epochs", "epochs of the training schedule", type=Int(1, 100000), default=30, metavar="E",
           group=SCHEDULE, make="EPOCHS"),
    Option("--batch-size", "training batch = teacher batch", type=Int(1, 1 << 20), default=64, metavar="B",
           group=SCHEDULE, make="BATCH_SIZE"),
]
SHARED_BY_DEST = {o.dest: o for o in SHARED}


def shared_argv(args, **values):
    """The shared options of `args` (with `values` replacing some) as command-line words, for a
    child producer: it then names the same cache and follows the same schedule."""
    out = []
    for o in SHARED:
        out += o.argv(values.get(o.dest, getattr(args, o.dest)))
    return out


def resolve_teacher(args, parser=None):
    """--teacher, or the data set's default teacher; the checkpoint's files must be there and readable.
    Sets args.teacher; errors go through parser.error (one line, exit 2) when a parser is given."""
    from .teacher_files import TeacherError, checkpoint_files, parse_teacher_arg
    teacher = args.teacher
    try:
        if teacher is None:
            if args.dataset not in DEFAULT_TEACHERS:
                raise TeacherError(f"--dataset {args.dataset} needs --teacher PREFIX[:EPOCH] (the default "
                                   f"teachers are for {' and '.join(DEFAULT_TEACHERS)})")
            teacher = DEFAULT_TEACHERS[args.dataset]
            if not os.path.exists(teacher + "-symbol.json"):
                build = "" if args.dataset == "digits" else f" --dataset {args.dataset}"
                raise TeacherError(f"the default {args.dataset} teacher {teacher}-symbol.json is missing here "
                                   f"({os.getcwd()}): build it with `kdcache teacher{build}` "
                                   f"or pass --teacher PREFIX")
        checkpoint_files(*parse_teacher_arg(teacher))
    except TeacherError as e:
        if parser is None:
            raise
        parser.error(f"argument --teacher: {e}")
    args.teacher = teacher
    return teacher


def check_applies(args, parser):
    """An option the data set (or the codec) would ignore is a mistake, not a silent no-op."""
    check_data_applies(args, parser)
    if args.codec == "int8" and args.dtype != "float16":
        parser.error(f"argument --dtype: codec int8 stores 8-bit codes (with a float32 offset and scale per row) "
                     f"whatever the dtype; drop --dtype {args.dtype}, or use --codec full --dtype {args.dtype}")
    if str(args.codec).startswith("sampled:") and args.dtype != "float16":
        parser.error(f"argument --dtype: codec {args.codec} stores classes and counts whatever the dtype; drop "
                     f"--dtype {args.dtype}, or use --codec full --dtype {args.dtype}")


def check_data_applies(args, parser):
    """--data-root, --image-size or --num-classes where the data set would ignore it: a mistake, not a
    silent no-op (every command that loads a data set: cache, train, teacher)."""
    from .user_code import is_piece
    base = "MODULE:FUNCTION" if is_piece(args.dataset) else args.dataset.split(":", 1)[0].lower()
    for dest, flag, where, fix in (
            ("data_root", "--data-root", ("mnist", "fashion-mnist", "cifar10", "cifar100", "npz", "recordio",
                                          "imagefolder"), f"--dataset {base} is built in and reads no files"),
            ("image_size", "--image-size", ("recordio", "imagefolder"),
             "only decoded images (recordio, imagefolder) are resized" +
             ("; --teacher-size resizes for the teacher" if hasattr(args, "teacher_size") else "")),
            ("num_classes", "--num-classes", ("npz", "recordio"),
             f"--dataset {base} knows its classes"),
            ("classes", "--classes", ("recordio", "imagefolder"),
             "only the image files (recordio, imagefolder) choose classes")):
        if getattr(args, dest, None) is not None and base not in where:
            parser.error(f"argument {flag}: {fix}; drop {flag}")


def check_views(args, parser):
    """--views V > 1 needs an augmentation: V copies of the same image would be V identical views."""
    if args.views > 1 and isinstance(args.augment, Augment) and not args.augment.varies:
        parser.error(f"argument --views: with --augment {args.augment.spec} every view would be the same image "
                     f"({args.views} copies); name a random augmentation (--augment crop:4,flip) or use --views 1")


@as_command
def main(argv=None, prog="python -m kdcache.pipeline.options"):
    """Print the shared options: flag, default, Make variable, allowed values."""
    from kdcache.args import Parser
    Parser(prog=prog, description="The options the producer (kdcache cache) and the trainer (kdcache train) "
           "share, declared once: flag, default, Make variable, allowed values.").parse_args(argv)
    rows = [("option", "default", "allowed", "make")] + option_table(SHARED)
    for flag, default, allowed, make in rows:
        print(f"{flag:16} {default:9} {make:11} {allowed}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
