"""What names a cache: the teacher's files and preprocessing, the data set, the views, the codec.

Both sides compute the same CacheSpec from the same options without running anything: the
producer to write the cache, the trainer to find it (and to refuse a cache built from others).
"""
import os

from kdcache.store import CacheSpec

from .augment import Augment, UserAugment, is_builtin
from .errors import PipelineError
from .user_code import PieceError, is_piece, load_piece

# Bump when the producer's output for the same inputs changes (it is part of every fingerprint).
PRODUCER_VERSION = 1

# The data set's usual augmentation: what --augment auto gives several views, and what `kdcache teacher`
# trains its teacher on (a new view of every sample each epoch). Photos (PHOTOS) get torchvision's
# RandomResizedCrop at the images' own size with flips, rrc:HxW,flip (HxW after --image-size, so a teacher
# trained on them takes the images the cache and the student see); other data sets not named here crop:4,flip.
DEFAULT_AUGMENT = {"digits": "crop:1", "mnist": "crop:2", "mnist5k": "crop:2", "fashion-mnist": "crop:2,flip"}
DEFAULT_AUGMENT_IMAGES = "crop:4,flip"
PHOTOS = ("imagefolder", "recordio")


def usual_augment(dataset):
    """The data set's usual augmentation (an Augment) for a loaded data set (its `name` and `shape`)."""
    name = getattr(dataset, "name", dataset)
    shape = getattr(dataset, "shape", None)
    if name in PHOTOS and shape is not None and len(shape) == 3:
        return Augment.parse(f"rrc:{int(shape[1])}x{int(shape[2])},flip")
    return Augment.parse(DEFAULT_AUGMENT.get(name, DEFAULT_AUGMENT_IMAGES))


def resolve_augment(spec, dataset, views):
    """--augment auto: none for one view, the data set's usual augmentation (usual_augment) for several;
    MODULE:FUNCTION: the user's FUNCTION(image, rng). `dataset` is the loaded data set (or its name)."""
    if is_piece(spec) and not is_builtin(spec):
        return UserAugment(load_piece(spec, "--augment"), name=spec.strip())
    if spec in (None, "", "auto"):
        if views == 1:
            return Augment()
        return usual_augment(dataset)
    aug = spec if isinstance(spec, Augment) else Augment.parse(spec)  # as --augment parsed it, or its spec
    if views > 1 and not aug.varies:
        raise PipelineError(f"--views {views} with --augment {aug.spec}: every view would be the same image; "
                            f"name an augmentation (e.g. --augment crop:4,flip) or use --views 1")
    return aug


def build_spec(teacher_id, dataset, *, views=1, augment=None, seed=0, codec="full", dtype="float16", sources=None):
    """The CacheSpec for these inputs. The augmentation is named by its canonical spec (defaults left
    out: two spellings, one cache); the seed matters only when views vary (not for eval:...)."""
    aug = augment if augment is not None else Augment()
    varies = getattr(aug, "varies", aug.active)  # a user's augmentation draws from the key's rng
    inputs = {"teacher": teacher_id, "dataset": dataset.identity(), "producer": PRODUCER_VERSION,
              "augment": aug.spec if aug.active else None, "augment_seed": int(seed) if varies else None}
    return CacheSpec(num_samples=len(dataset), num_classes=int(dataset.num_classes), views=int(views),
                     codec=codec, dtype=dtype, inputs=inputs, sources=sources or {})


def spec_from_args(args, dataset, teacher):
    """(CacheSpec, Augment) for the shared options (--views, --augment, --seed, --codec, --dtype)."""
    augment = resolve_augment(args.augment, dataset, args.views)
    if isinstance(augment, UserAugment):
        augment.check(dataset, args.seed)  # a user's augmentation that fails now fails before any cache exists
    spec = build_spec(teacher.identity(), dataset, views=args.views, augment=augment, seed=args.seed,
                      codec=args.codec, dtype=args.dtype, sources=sources_from_args(args))
    return spec, augment


def sources_from_args(args):
    """Where the data set's files are and how they were resized, for a cache to record (store.format.schema.A_SOURCES):
    `kdcache verify --teacher` reads the data again from there without asking. {} for built-in data."""
    root = getattr(args, "data_root", None)
    if not root:
        return {}
    size, classes = getattr(args, "image_size", None), getattr(args, "classes", None)
    return {"data_root": os.path.abspath(root), "image_size": [int(v) for v in size] if size else None,
            **({"classes": list(classes)} if classes else {})}  # no key without --classes: older records stay


def augment_from_inputs(inputs):
    """The augmentation a cache records (its inputs' "augment"): a spec, or MODULE:FUNCTION@digest,
    whose source must still have that digest (else the views would differ from the cached ones)."""
    rec = inputs.get("augment") or "none"
    if "@" not in rec:
        return Augment.parse(rec)
    name, _, digest = rec.rpartition("@")
    aug = UserAugment(load_piece(name, "--augment"), name=name)
    if aug.spec != rec:
        raise PieceError(f"--augment {name}: its source changed since the cache was built (digest "
                         f"{aug.spec.rpartition('@')[2]}, the cache records {digest}): the views would differ")
    return aug
