"""Keyed augmentation: view v of sample i is derived from (seed, i, v) alone.

The teacher producer and the student rebuild the identical view with no images stored (the
way FKD and TinyViT store crop parameters or seeds). The parameters come from a counter-based
hash (splitmix64) of the key, vectorised over a batch, so they do not depend on batch
composition, order, process or platform.
"""
import dataclasses

import numpy as np

_M64 = (1 << 64) - 1


def _splitmix64(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(_M64)
    x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & np.uint64(_M64)
    x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & np.uint64(_M64)
    return x ^ (x >> np.uint64(31))


def key_hash(seed, indices, views, salt):
    """64-bit hash per key, independent of everything but (seed, index, view, salt)."""
    with np.errstate(over="ignore"):
        i = np.asarray(indices, dtype=np.uint64)
        v = np.broadcast_to(np.asarray(views, dtype=np.uint64), i.shape)
        h = _splitmix64(np.uint64(int(seed) & _M64) ^ np.uint64(0x5851F42D4C957F2D))
        h = _splitmix64(h ^ i)
        h = _splitmix64(h ^ (v * np.uint64(0x2545F4914F6CDD1D)))
        return _splitmix64(h ^ np.uint64(salt))


@dataclasses.dataclass(frozen=True)
class Augment:
    """Random crop after zero padding by `pad` pixels, and horizontal flip with probability 1/2.

    Spec strings: "none", "crop:4", "flip", "crop:4,flip".
    """
    pad: int = 0
    flip: bool = False

    @classmethod
    def parse(cls, spec):
        spec = (spec or "none").strip().lower()
        if spec in ("none", ""):
            return cls()
        pad, flip = 0, False
        for part in spec.split(","):
            part = part.strip()
            if part == "flip":
                flip = True
            elif part.startswith("crop:"):
                try:
                    pad = int(part[5:])
                except ValueError:
                    pad = -1
                if pad < 0:
                    raise ValueError(f"augmentation {spec!r}: crop padding must be an integer >= 0; use none, "
                                     f"crop:PAD, flip or crop:PAD,flip, e.g. crop:4,flip")
            else:
                raise ValueError(f"augmentation {spec!r} not understood: use none, crop:PAD, flip or crop:PAD,flip")
        return cls(pad, flip)

    @property
    def spec(self):
        parts = ([f"crop:{self.pad}"] if self.pad else []) + (["flip"] if self.flip else [])
        return ",".join(parts) or "none"

    @property
    def active(self):
        return self.pad > 0 or self.flip

    def params(self, seed, indices, views):
        """(dy, dx, flip) per key: the crop offset in the padded image and the flip bit."""
        n = np.asarray(indices).size
        if not self.active:
            z = np.zeros(n, dtype=np.int64)
            return z, z, np.zeros(n, dtype=bool)
        h = key_hash(seed, indices, views, 1)
        span = np.uint64(2 * self.pad + 1)
        dy = (h % span).astype(np.int64)
        dx = ((h >> np.uint64(16)) % span).astype(np.int64)
        flip = ((h >> np.uint64(40)) & np.uint64(1)).astype(bool) if self.flip else np.zeros(n, dtype=bool)
        return dy, dx, flip

    def apply(self, x, seed, indices, views):
        """Augmented copy of a batch x [B, C, H, W] for keys (indices, views)."""
        if not self.active:
            return x
        dy, dx, flip = self.params(seed, indices, views)
        b, c, h, w = x.shape
        p = self.pad
        padded = np.zeros((b, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
        padded[:, :, p:p + h, p:p + w] = x
        out = np.empty_like(x)
        for k in range(b):
            crop = padded[k, :, dy[k]:dy[k] + h, dx[k]:dx[k] + w]
            out[k] = crop[:, :, ::-1] if flip[k] else crop
        return out


def make_views(dataset, indices, views, *, seed, augment):
    """The inputs of keys (indices, views): the data set's samples, augmented per key.

    The one function the teacher producer and the student both call for a batch.
    Returns (x float32 [B, C, H, W], labels int64 [B]).
    """
    x, y = dataset.get_batch(indices)
    return augment.apply(x, seed, indices, views), y


def key_rng(seed, index, view):
    """The numpy Generator of key (seed, index, view): the same in every process and on every run."""
    return np.random.default_rng(int(key_hash(seed, [int(index)], [int(view)], 2)[0]))


class AugmentError(ValueError):
    """A user's augmentation misbehaved; the message names it."""


class UserAugment:
    """A user's augmentation FUNCTION(image, rng) -> image, for image float32 [C, H, W] in [0, 1] and
    rng the Generator of the key (key_rng), so every process rebuilds the same view. Its identity
    (`spec`, recorded in the fingerprint) is its qualified name and a digest of its source."""
    active = True

    def __init__(self, fn, name=None):
        import hashlib
        import inspect
        if not callable(fn):
            raise AugmentError(f"augmentation {fn!r} is not callable: pass FUNCTION(image, rng) -> image")
        self.fn = fn
        self.name = name or f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            raise AugmentError(f"augmentation {self.name}: its source cannot be read (it names the cache): define it "
                               f"with def in a module file") from None
        self.spec = f"{self.name}@{hashlib.sha256(source.encode()).hexdigest()[:16]}"

    def one(self, image, seed, index, view):
        """The augmented copy of one image for key (index, view)."""
        from .pieces import USER_ERRORS, raised
        try:
            out = self.fn(image.copy(), key_rng(seed, index, view))
        except USER_ERRORS as e:
            raise AugmentError(f"augmentation {self.name} {raised(e)}") from e
        if out is None:
            raise AugmentError(f"augmentation {self.name} returned None: return the augmented image (the "
                               f"function must `return image`, not change it in place only)")
        kind = type(out).__name__
        try:
            out = np.asarray(out.asnumpy() if hasattr(out, "asnumpy") else out)
        except (ValueError, TypeError):  # ragged lists and the like: not an image
            out = np.asarray(None)
        if not (np.issubdtype(out.dtype, np.number) or out.dtype == bool):
            raise AugmentError(f"augmentation {self.name} returned a {kind} of {out.dtype}, not an image: return "
                               f"a float32 array of the image's shape {image.shape}")
        if out.shape != image.shape:
            raise AugmentError(f"augmentation {self.name} turned an image of shape {image.shape} into {out.shape}: "
                               f"it must keep the shape (crop after padding, flip, jitter)")
        return out.astype(np.float32, copy=False)

    def check(self, dataset, seed):
        """Run once on sample 0's first view: a function that fails or returns no image of the same
        shape is refused (AugmentError) before anything is written or started, not at the first batch
        (by then a producer has made its cache's folder)."""
        if len(dataset):
            self.one(dataset.get_batch([0])[0][0], seed, 0, 0)

    def apply(self, x, seed, indices, views):
        vs = np.broadcast_to(np.asarray(views), np.shape(indices))
        return np.stack([self.one(x[k], seed, i, v) for k, (i, v) in enumerate(zip(np.ravel(indices), np.ravel(vs)))]) \
            if len(x) else x


def as_augment(augment):
    """An Augment or a UserAugment from what a caller passes: None (no augmentation), a spec string
    ("crop:4,flip"), "MODULE:FUNCTION", an Augment, or a callable FUNCTION(image, rng)."""
    if augment is None or isinstance(augment, (Augment, UserAugment)):
        return augment if augment is not None else Augment()
    if isinstance(augment, str):
        from .pieces import is_piece, load_piece
        if is_piece(augment):  # MODULE:FUNCTION, as on the command line
            return UserAugment(load_piece(augment, "--augment"), name=augment.strip())
        return Augment.parse(augment)
    return UserAugment(augment)


def apply_one(augment, image, seed, index, view):
    """View `view` of sample `index`'s image [C, H, W] under `augment` (an Augment or UserAugment)."""
    if not augment.active:
        return image
    if isinstance(augment, UserAugment):
        return augment.one(image, seed, index, view)
    return augment.apply(image[None], seed, [index], [view])[0]
