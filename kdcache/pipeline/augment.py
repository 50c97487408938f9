"""Keyed augmentation: view v of sample i is derived from (seed, i, v) alone.

The teacher producer and the student rebuild the identical view with no images stored (the
way FKD and TinyViT store crop parameters or seeds). The parameters come from a counter-based
hash (splitmix64) of the key, vectorised over a batch, so they do not depend on batch
composition, order, process or platform.

NOTE (mixed views). mixup:ALPHA and cutmix:ALPHA mix view v of sample i with view v of a partner
sample j, in proportion λ ~ Beta(ALPHA, ALPHA); j and λ (and cutmix's box) come from (seed, i, v)
alone, each from its own salt, so a view is still a pure function of its key: the producer runs
the teacher on exactly the mixed image, and the student rebuilds it pixel for pixel. The partner's
view is its own key (j, v), made as any other view. The cache holds the teacher's logits of the
mixed image; the student's hard-label term needs both labels and λ, so when mixing is on the
labels a batch carries are float32 [B, 3]: (label, partner's label, λ) (`mixed_labels`), and
[B] ints as before when it is off. Evaluation never mixes (`eval_view`).
"""
import dataclasses
import math
import re

import numpy as np

from kdcache.pipeline.errors import PipelineError

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


# RandomResizedCrop's defaults in torchvision and GluonCV: the crop's area fraction and aspect ratio (w/h).
RRC_SCALE = (0.08, 1.0)
RRC_RATIO = (3 / 4, 4 / 3)
RRC_ATTEMPTS = 10
# center:SIZE resizes the short side to SIZE / 0.875 (224 -> 256), GluonCV's and torchvision's ImageNet habit.
CROP_FRACTION = 0.875
MAX_SIZE = 8192
MIXES = ("mixup", "cutmix")
# The key hash's salts of the mixed views (1, 2 and 16-55 are the crops', flips' and key_rng's).
SALT_PARTNER, SALT_LAMBDA, SALT_BOX_Y, SALT_BOX_X = 8, 9, 10, 11
_HELP = ("use none, crop:PAD, flip, crop:PAD,flip, rrc:SIZE[,scale=A-B][,ratio=A-B][,flip] or center:SIZE / "
         "eval:RESIZE/SIZE (SIZE N or HxW)[,mixup:A|cutmix:A], e.g. crop:4,flip or rrc:224,flip")


@dataclasses.dataclass(frozen=True)
class Augment:
    """A built-in augmentation, from its spec string (`parse`; `spec` is its canonical form).

    crop:PAD   random crop after zero padding by PAD pixels (the image keeps its size)
    flip       horizontal flip with probability 1/2 (after the crop)
    rrc:SIZE   random resized crop to SIZE (N or HxW): torchvision's RandomResizedCrop, with area
               fraction scale=A-B (default 0.08-1) and aspect ratio w/h ratio=A-B (default 3/4-4/3)
    eval:RESIZE/SIZE  the evaluation transform: resize the short side to RESIZE, centre-crop SIZE;
               the same image for every view (center:SIZE is eval:ceil(SIZE/0.875)/SIZE)
    mixup:ALPHA  mix each view with a keyed partner's view, λ ~ Beta(ALPHA, ALPHA) (Zhang et al. 2018)
    cutmix:ALPHA paste a box of the partner's view, of area fraction 1 - λ (Yun et al. 2019); λ is then
               the exact fraction of pixels kept (module NOTE (mixed views))
    Resizing is bilinear with half-pixel centres (OpenCV's INTER_LINEAR, MXNet's imresize; no
    antialiasing), in float32 numpy, so every process computes the same pixels.
    """
    pad: int = 0
    flip: bool = False
    size: tuple = None  # rrc's output (H, W)
    scale: tuple = RRC_SCALE
    ratio: tuple = RRC_RATIO
    resize: int = 0  # eval: the short side's length before the centre crop
    center: tuple = None  # eval: the centre crop (H, W)
    mix: str = None  # "mixup" or "cutmix" (module NOTE (mixed views))
    mix_alpha: float = 0.0  # the Beta(ALPHA, ALPHA) parameter of the mixing proportion

    @classmethod
    def parse(cls, spec):
        """The Augment of a spec string; ValueError (one line: the part, what is allowed) if not one."""
        text = (spec or "none").strip().lower()
        if text in ("none", ""):
            return cls()
        kw, params = {}, {}
        for part in (p.strip() for p in text.split(",")):
            head, colon, value = part.partition(":")
            key, eq, pval = part.partition("=")
            if part == "flip":
                kw["flip"] = True
            elif head in MIXES:
                if "mix" in kw:
                    raise PipelineError(f"augmentation {spec!r}: one of mixup:ALPHA and cutmix:ALPHA at a time; "
                                        f"drop one, e.g. crop:4,flip,mixup:0.2")
                kw["mix"] = (head, _alpha(head, value if colon else None, spec))
            elif colon and head in ("crop", "rrc", "center", "eval"):
                if {"crop", "rrc", "eval"} & set(kw):
                    raise PipelineError(f"augmentation {spec!r}: one of crop:PAD, rrc:SIZE, center:SIZE and "
                                        f"eval:RESIZE/SIZE at a time; {_HELP}")
                if head == "crop":
                    kw["crop"] = _integer(value, 0, None, spec, "crop padding")
                elif head == "rrc":
                    kw["rrc"] = _size(value, spec, "rrc's SIZE")
                elif head == "center":
                    size = _size(value, spec, "center's SIZE")
                    kw["eval"] = (-(-min(size) * 8 // 7), size)  # ceil(short / 0.875), in integers
                else:
                    resize, slash, crop = value.partition("/")
                    if not slash:
                        raise PipelineError(f"augmentation {spec!r}: write eval:RESIZE/SIZE, e.g. eval:256/224 "
                                            f"(resize the short side to 256, centre-crop 224x224)")
                    size = _size(crop, spec, "eval's SIZE")
                    r = _integer(resize, min(size), MAX_SIZE, spec, "eval's RESIZE (the short side, at least "
                                 "the crop's short side)")
                    kw["eval"] = (r, size)
            elif eq and key.strip() in ("scale", "ratio"):
                params[key.strip()] = _range(key.strip(), pval, spec)
            else:
                raise PipelineError(f"augmentation {spec!r}: {part!r} is not understood; {_HELP}")
        if params and "rrc" not in kw:
            verb = "belong" if len(params) > 1 else "belongs"
            raise PipelineError(f"augmentation {spec!r}: {' and '.join(params)} {verb} to rrc:SIZE (e.g. "
                                f"rrc:224,scale=0.35-1)")
        if "eval" in kw and kw.get("flip"):
            raise PipelineError(f"augmentation {spec!r}: the evaluation transform is the same for every view; "
                                f"use it alone, or rrc:SIZE,flip for random views")
        resize, center = kw.get("eval", (0, None))
        mix, alpha = kw.get("mix", (None, 0.0))
        return cls(pad=kw.get("crop", 0), flip=kw.get("flip", False), size=kw.get("rrc"),
                   scale=params.get("scale", RRC_SCALE), ratio=params.get("ratio", RRC_RATIO), resize=resize,
                   center=center, mix=mix, mix_alpha=alpha)

    @property
    def spec(self):
        """The canonical spec: the same augmentation, the same string (defaults left out)."""
        parts = [f"crop:{self.pad}"] if self.pad else []
        if self.size:
            parts.append(f"rrc:{_size_word(self.size)}")
            parts += [f"{k}={_num(v[0])}-{_num(v[1])}" for k, v, d in
                      (("scale", self.scale, RRC_SCALE), ("ratio", self.ratio, RRC_RATIO)) if tuple(v) != d]
        if self.center:
            parts.append(f"eval:{self.resize}/{_size_word(self.center)}")
        parts += ["flip"] if self.flip else []
        parts += [f"{self.mix}:{_num(self.mix_alpha)}"] if self.mix else []  # last: specs without it keep their form
        return ",".join(parts) or "none"

    @property
    def transforms(self):
        """Whether each image's own view differs from the image (mixing aside)."""
        return self.pad > 0 or self.flip or bool(self.size) or bool(self.center)

    @property
    def active(self):
        """Whether it changes images at all."""
        return self.transforms or bool(self.mix)

    @property
    def varies(self):
        """Whether views differ: the evaluation transform gives every view the same image; a mixed view
        varies with its partner and λ."""
        return self.pad > 0 or self.flip or bool(self.size) or bool(self.mix)

    @property
    def unmixed(self):
        """The same views without the mixing."""
        return dataclasses.replace(self, mix=None, mix_alpha=0.0)

    def out_shape(self, shape):
        """The shape of a view of an image of `shape` (C, H, W)."""
        hw = self.size or self.center
        return tuple(shape) if not hw else (shape[0], *hw)

    def eval_view(self):
        """The augmentation that evaluates a model trained on these views: for rrc:SIZE the centre crop
        center:SIZE (GluonCV's and torchvision's ImageNet evaluation), for the others none; the
        evaluation transform is its own."""
        if self.size:
            return Augment.parse(f"center:{_size_word(self.size)}")
        return self.unmixed if self.center else Augment()  # evaluation never mixes

    def params(self, seed, indices, views):
        """(dy, dx, flip) per key: the crop offset in the padded image and the flip bit."""
        n = np.asarray(indices).size
        if not self.varies:
            z = np.zeros(n, dtype=np.int64)
            return z, z, np.zeros(n, dtype=bool)
        h = key_hash(seed, indices, views, 1)
        span = np.uint64(2 * self.pad + 1)
        dy = (h % span).astype(np.int64)
        dx = ((h >> np.uint64(16)) % span).astype(np.int64)
        flip = ((h >> np.uint64(40)) & np.uint64(1)).astype(bool) if self.flip else np.zeros(n, dtype=bool)
        return dy, dx, flip

    def rrc_params(self, seed, indices, views, height, width):
        """(top, left, h, w) int64 per key: the box of rrc's crop in a height x width image.

        torchvision's RandomResizedCrop.get_params step for step (10 attempts, then the centre crop
        of the whole image clamped to the ratio range), with each attempt's random numbers drawn from
        the key's hashes instead of a generator's stream."""
        n = np.asarray(indices).size
        area = height * width
        lr0, lr1 = math.log(self.ratio[0]), math.log(self.ratio[1])
        draws = [[_uniform(key_hash(seed, indices, views, 16 + 4 * a + k)) if k < 2 else
                  key_hash(seed, indices, views, 16 + 4 * a + k) for k in range(4)] for a in range(RRC_ATTEMPTS)]
        out = np.empty((4, n), dtype=np.int64)
        for q in range(n):
            for us, ur, hi, hj in draws:
                # Python floats and math (correctly rounded sqrt, round half to even): torchvision's arithmetic
                target = area * (self.scale[0] + float(us[q]) * (self.scale[1] - self.scale[0]))
                aspect = math.exp(lr0 + float(ur[q]) * (lr1 - lr0))
                w = int(round(math.sqrt(target * aspect)))
                h = int(round(math.sqrt(target / aspect)))
                if 0 < w <= width and 0 < h <= height:
                    out[:, q] = int(hi[q]) % (height - h + 1), int(hj[q]) % (width - w + 1), h, w
                    break
            else:
                out[:, q] = _fallback(height, width, self.ratio)
        return tuple(out)

    def apply(self, x, seed, indices, views):
        """Augmented copy of a batch x [B, C, H, W] for keys (indices, views); rrc and eval give
        [B, C, *SIZE]. The dtype is kept (integer images are rounded after resizing). Each image's own
        view only: mixing it with its partner's needs the data set (make_views, mix_views)."""
        if not self.transforms:
            return x
        b, c, h, w = x.shape
        if self.size:
            boxes = np.stack(self.rrc_params(seed, indices, views, h, w), axis=1)
            flip = self.params(seed, indices, views)[2]
            out = np.empty((b, c, *self.size), dtype=x.dtype)
            for k in range(b):
                out[k] = resized_crop(x[k], *boxes[k], self.size, flip=flip[k])
            return out
        if self.center:
            return center_view(x, self.resize, self.center)
        dy, dx, flip = self.params(seed, indices, views)
        p = self.pad
        padded = np.zeros((b, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
        padded[:, :, p:p + h, p:p + w] = x
        out = np.empty_like(x)
        for k in range(b):
            crop = padded[k, :, dy[k]:dy[k] + h, dx[k]:dx[k] + w]
            out[k] = crop[:, :, ::-1] if flip[k] else crop
        return out

    def partners(self, seed, indices, views, n):
        """(j int64 [B], λ float64 [B]) per key (indices, views): the partner sample, uniform over the
        data set's n indices (it may be the sample itself), and the mixing proportion ~ Beta(ALPHA, ALPHA),
        drawn by numpy's Generator seeded with the key's hash (one per key: no batch, order or process
        changes it)."""
        j = (key_hash(seed, indices, views, SALT_PARTNER) % np.uint64(max(1, int(n)))).astype(np.int64)
        a = float(self.mix_alpha)
        lam = np.array([np.random.default_rng(int(h)).beta(a, a)
                        for h in np.ravel(key_hash(seed, indices, views, SALT_LAMBDA))], dtype=np.float64)
        return j.reshape(-1), lam

    def mix_images(self, x, xj, seed, indices, views, lam):
        """(mixed views float32 [B, ...], λ float32 [B]) of views x and their partners' views xj (both
        [B, C, H, W]). mixup: λ x + (1 - λ) xj in float32. cutmix: x with the box of area fraction 1 - λ
        (Yun et al. 2019's rand_bbox: side sqrt(1 - λ) of each dimension, centre uniform, clipped) taken
        from xj, and λ the fraction of pixels kept."""
        lam = np.asarray(lam, dtype=np.float64).reshape(-1)
        if self.mix == "mixup":
            lam32 = lam.astype(np.float32)
            w = lam32.reshape((-1,) + (1,) * (np.ndim(x) - 1))
            out = _lerp(np.asarray(xj, dtype=np.float32), np.asarray(x, dtype=np.float32), w)
            return _as_dtype(out, np.asarray(x).dtype), lam32
        out = np.array(x, copy=True)
        b, _, height, width = out.shape
        cy = (key_hash(seed, indices, views, SALT_BOX_Y) % np.uint64(height)).astype(np.int64).reshape(-1)
        cx = (key_hash(seed, indices, views, SALT_BOX_X) % np.uint64(width)).astype(np.int64).reshape(-1)
        kept = np.empty(b, dtype=np.float32)
        for k in range(b):
            cut = math.sqrt(1.0 - float(lam[k]))
            ch, cw = int(height * cut), int(width * cut)
            y1, y2 = min(max(cy[k] - ch // 2, 0), height), min(max(cy[k] + ch // 2, 0), height)
            x1, x2 = min(max(cx[k] - cw // 2, 0), width), min(max(cx[k] + cw // 2, 0), width)
            out[k, :, y1:y2, x1:x2] = xj[k, :, y1:y2, x1:x2]
            kept[k] = 1.0 - (y2 - y1) * (x2 - x1) / (height * width)
        return out, kept


def mixed_labels(labels, partner_labels, lam):
    """The labels a mixed batch carries: float32 [B, 3] rows (label, partner's label, λ)."""
    return np.stack([np.asarray(labels, dtype=np.float32).reshape(-1),
                     np.asarray(partner_labels, dtype=np.float32).reshape(-1),
                     np.asarray(lam, dtype=np.float32).reshape(-1)], axis=1)


def mixes(augment):
    """Whether an augmentation (an Augment, a UserAugment, None) mixes views: its labels are then
    (label, partner's label, λ) rows (module NOTE (mixed views))."""
    return bool(getattr(augment, "mix", None))


def is_builtin(spec):
    """Whether a spec names a built-in augmentation (crop:x is a mistake in one, not MODULE crop's x)."""
    return str(spec).strip().lower().partition(":")[0] in ("crop", "rrc", "center", "eval") + MIXES


def _uniform(h):
    """[0, 1) floats from 64-bit hashes: their top 53 bits, as torch's uniform_ and numpy's random()."""
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def _fallback(height, width, ratio):
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _axis(start, length, out, limit):
    """Bilinear sampling of `out` pixels over source pixels [start, start + length) (half-pixel
    centres, clamped to that span): (lower index, upper index, float32 weight of the upper)."""
    src = start + (np.arange(out, dtype=np.float64) + 0.5) * (length / out) - 0.5
    src = np.clip(src, start, start + length - 1)
    lo = np.floor(src).astype(np.int64)
    hi = np.minimum(lo + 1, min(start + length, limit) - 1)
    return lo, hi, (src - lo).astype(np.float32)


def _lerp(a, b, f):
    # float32 throughout, two products and a sum: no fused or reordered arithmetic to differ between processes
    return a * (np.float32(1) - f) + b * f


def _resample(img, ys, xs):
    """img [C, H, W] sampled at rows ys and columns xs (each (lo, hi, weight)), as float32."""
    img = img.astype(np.float32, copy=False)
    (y0, y1, fy), (x0, x1, fx) = ys, xs
    rows = _lerp(img[:, y0, :], img[:, y1, :], fy[:, None])
    return _lerp(rows[:, :, x0], rows[:, :, x1], fx)


def _as_dtype(out, dtype):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return np.clip(np.rint(out), info.min, info.max).astype(dtype)
    return out.astype(dtype, copy=False)


def resized_crop(img, top, left, h, w, size, flip=False):
    """The box (top, left, h, w) of img [C, H, W], resized bilinearly to size (H', W'), flipped
    horizontally if `flip` (its columns sampled right to left: the same pixels as a flip after)."""
    _, height, width = img.shape
    xs = _axis(int(left), int(w), size[1], width)
    out = _resample(img, _axis(int(top), int(h), size[0], height), tuple(a[::-1] for a in xs) if flip else xs)
    return _as_dtype(out, img.dtype)


def center_view(x, resize, crop):
    """The evaluation transform of a batch x [B, C, H, W]: the short side resized to `resize`
    (the long side to int(long * resize / short), as torchvision's Resize), then the centre crop (H', W'); a crop larger
    than the resized image is zero-padded (torchvision's CenterCrop)."""
    b, c, height, width = x.shape
    if height <= width:
        rh, rw = resize, int(resize * width / height)
    else:
        rh, rw = int(resize * height / width), resize
    top, left = int(round((rh - crop[0]) / 2.0)), int(round((rw - crop[1]) / 2.0))  # torchvision's offsets
    # output pixel (i, j) is pixel (top + i, left + j) of the resized image, where it exists
    oy, ox = np.arange(max(0, -top), min(crop[0], rh - top)), np.arange(max(0, -left), min(crop[1], rw - left))
    whole = oy.size == crop[0] and ox.size == crop[1]  # every output pixel is written: no zero padding
    out = (np.empty if whole else np.zeros)((b, c, *crop), dtype=x.dtype)
    if b and oy.size and ox.size and (rh, rw) == (height, width):
        # no resize (the short side is `resize` already, as after --image-size): the crop alone. The
        # same pixels as resampling (each output pixel is its source pixel times weight 1 plus its
        # neighbour times 0) for finite images, and ~2x faster than making the view by resampling.
        out[:, :, oy[0]:oy[-1] + 1, ox[0]:ox[-1] + 1] = \
            x[:, :, top + oy[0]:top + oy[-1] + 1, left + ox[0]:left + ox[-1] + 1]
    elif b and oy.size and ox.size:
        ys, xs = _resized_axis(top + oy, rh, height), _resized_axis(left + ox, rw, width)
        for k in range(b):
            out[k][:, oy[0]:oy[-1] + 1, ox[0]:ox[-1] + 1] = _as_dtype(_resample(x[k], ys, xs), x.dtype)
    return out


def _resized_axis(positions, resized, source):
    """Bilinear sampling for pixels `positions` of an axis of `source` pixels resized to `resized`."""
    src = np.clip((positions.astype(np.float64) + 0.5) * (source / resized) - 0.5, 0, source - 1)
    lo = np.floor(src).astype(np.int64)
    return lo, np.minimum(lo + 1, source - 1), (src - lo).astype(np.float32)


def _integer(word, lo, hi, spec, what):
    try:
        v = int(word.strip())
    except ValueError:
        v = None
    if v is None or v < lo or hi is not None and v > hi:
        raise PipelineError(f"augmentation {spec!r}: {what} must be an integer from {lo}"
                            f"{f' to {hi}' if hi is not None else ' up'}, not {word.strip()!r}; {_HELP}")
    return v


def _alpha(head, word, spec):
    """mixup's or cutmix's ALPHA: a finite number > 0."""
    example = f"{head}:{'0.2' if head == 'mixup' else '1.0'}"
    if word is None:
        raise PipelineError(f"augmentation {spec!r}: {head} needs its ALPHA (the Beta(ALPHA, ALPHA) parameter): "
                            f"write {head}:ALPHA, e.g. {example}")
    v = _number(word.strip())
    if v is None or not math.isfinite(v) or v <= 0:
        raise PipelineError(f"augmentation {spec!r}: {head}'s ALPHA must be a number > 0 (the Beta(ALPHA, ALPHA) "
                            f"parameter), not {word.strip()!r}; e.g. {example}")
    return v


def _size(word, spec, what):
    """N or HxW, each from 1 to MAX_SIZE, as (H, W)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:x\s*(\d+)\s*)?", word)
    size = (int(m.group(1)), int(m.group(2) or m.group(1))) if m else None
    if size is None or not all(1 <= v <= MAX_SIZE for v in size):
        raise PipelineError(f"augmentation {spec!r}: {what} must be N or HxW with integers from 1 to {MAX_SIZE}, "
                            f"not {word.strip()!r} (e.g. rrc:224 or rrc:224x192)")
    return size


def _size_word(size):
    return str(size[0]) if size[0] == size[1] else f"{size[0]}x{size[1]}"


def _range(key, word, spec):
    """scale=A-B (0 < A <= B <= 1) or ratio=A-B (0 < A <= B); A and B numbers or fractions (3/4)."""
    m = re.fullmatch(r"\s*([0-9.e+/]+)\s*-\s*([0-9.e+/]+)\s*", word)
    vals = [_number(g) for g in m.groups()] if m else [None]
    top = 1.0 if key == "scale" else float("inf")
    if None in vals or not (0 < vals[0] <= vals[1] <= top) or not math.isfinite(vals[1]):
        what = "0 < A <= B <= 1 (the crop's fraction of the image's area)" if key == "scale" else \
            "0 < A <= B (the crop's width / height)"
        raise PipelineError(f"augmentation {spec!r}: {key}={word.strip()} must be A-B with {what}, e.g. "
                            f"{key}={'0.35-1' if key == 'scale' else '3/4-4/3'}")
    return tuple(vals)


def _number(word):
    try:
        a, slash, b = word.partition("/")
        return float(a) / float(b) if slash else float(a)
    except (ValueError, ZeroDivisionError):
        return None


def _num(v):
    """A float as the shortest word that reads back to it (1.0 -> 1)."""
    return str(int(v)) if float(v).is_integer() else repr(float(v))


def make_views(dataset, indices, views, *, seed, augment):
    """The inputs of keys (indices, views): the data set's samples, augmented per key.

    The one function the teacher producer and the student both call for a batch.
    Returns (x float32 [B, C, H, W], labels int64 [B]); with mixing (module NOTE (mixed views)) the
    labels are float32 [B, 3] rows (label, partner's label, λ).
    """
    x, y = dataset.get_batch(indices)
    return mix_views(dataset, augment.apply(x, seed, indices, views), y, indices, views, seed=seed, augment=augment)


def mix_views(dataset, x, y, indices, views, *, seed, augment):
    """(x, y) of keys (indices, views) after mixing: views x and labels y unchanged when `augment` does
    not mix; else each view mixed with its partner's view (key (j, v), made from `dataset` the way x
    was) and the labels as mixed_labels rows. The one mixing step of make_views and the producer's
    decode workers."""
    if not mixes(augment):
        return x, y
    j, lam = augment.partners(seed, indices, views, len(dataset))
    vs = np.broadcast_to(np.asarray(views), np.shape(indices)).reshape(-1)
    xj, yj = dataset.get_batch(j)
    out, lam = augment.mix_images(x, augment.apply(xj, seed, j, vs), seed, indices, views, lam)
    return out, mixed_labels(y, yj, lam)


class EvalViews:
    """A data set seen through a deterministic view (the evaluation transform): get_batch gives the
    transformed images, everything else (len, labels, identity, ...) is the data set's own."""

    def __init__(self, dataset, augment):
        self.dataset, self.augment = dataset, augment

    def __getattr__(self, name):
        return getattr(self.dataset, name)

    def __len__(self):
        return len(self.dataset)

    @property
    def shape(self):
        return self.augment.out_shape(self.dataset.shape)

    def get_batch(self, indices):
        x, y = self.dataset.get_batch(indices)
        return self.augment.apply(x, 0, indices, 0), y


def eval_views(dataset, augment):
    """The test split as a model trained on `augment`'s views is evaluated: rrc:SIZE's centre crop
    center:SIZE (the images' size the model was trained at), the data set itself for the others."""
    view = augment.eval_view()
    return EvalViews(dataset, view) if view.active else dataset


def key_rng(seed, index, view):
    """The numpy Generator of key (seed, index, view): the same in every process and on every run."""
    return np.random.default_rng(int(key_hash(seed, [int(index)], [int(view)], 2)[0]))


class AugmentError(PipelineError):
    """A user's augmentation misbehaved; the message names it."""


class UserAugment:
    """A user's augmentation FUNCTION(image, rng) -> image, for image float32 [C, H, W] in [0, 1] and
    rng the Generator of the key (key_rng), so every process rebuilds the same view. Its identity
    (`spec`, recorded in the fingerprint) is its qualified name and a digest of its source."""
    active = varies = True

    @staticmethod
    def out_shape(shape):
        return tuple(shape)  # it must keep the shape (one)

    def eval_view(self):
        return Augment()  # evaluation sees the images as they are

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
        from .user_code import USER_ERRORS, raised
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
        from .user_code import is_piece, load_piece
        if is_piece(augment) and not is_builtin(augment):  # MODULE:FUNCTION, as on the command line
            return UserAugment(load_piece(augment, "--augment"), name=augment.strip())
        return Augment.parse(augment)
    return UserAugment(augment)


def apply_one(augment, image, seed, index, view):
    """View `view` of sample `index`'s image [C, H, W] under `augment` (an Augment or UserAugment),
    before any mixing (mix_one)."""
    if not augment.active:
        return image
    if isinstance(augment, UserAugment):
        return augment.one(image, seed, index, view)
    return augment.apply(image[None], seed, [index], [view])[0]


def mix_one(augment, image, label, partner, seed, index, view, n):
    """(mixed image, float32 [3] (label, partner's label, λ)) of key (index, view) for one item: `image`
    its view (apply_one), `partner(j)` the (image, label) of sample j before augmentation, n the data
    set's length. The same pixels as mix_views gives the key in any batch."""
    j, lam = augment.partners(seed, [index], [view], n)
    pimage, plabel = partner(int(j[0]))
    pview = apply_one(augment, np.asarray(pimage), seed, int(j[0]), view)
    out, lam = augment.mix_images(image[None], pview[None], seed, [index], [view], lam)
    return out[0], mixed_labels([label], [plabel], lam)[0]
