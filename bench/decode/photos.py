"""The benchmark's photos: JPEGs of 300-500 px made, byte for byte the same every time, from real photographs."""
import glob
import io
import os

import numpy as np

OPENCV_DATA = "/usr/share/doc/opencv-doc/examples/data"
PHOTOS, QUICK_PHOTOS = 1024, 64
SEED, QUALITY = 0, 90
SIDE = (300, 500)


def sources():
    """[(name, RGB PIL image)]: opencv-doc's colour JPEGs (when the package is installed), then
    scikit-learn's china.jpg and flower.jpg; always in this order."""
    from PIL import Image
    out = []
    for p in sorted(glob.glob(os.path.join(OPENCV_DATA, "*.jpg"))):
        with Image.open(p) as im:
            if im.mode == "RGB" and min(im.size) >= 192:  # photographs in colour, not the grey calibration shots
                out.append((os.path.basename(p), im.convert("RGB")))
    from sklearn.datasets import load_sample_images
    s = load_sample_images()
    for name, a in zip(s.filenames, s.images):
        out.append((os.path.basename(name), Image.fromarray(a)))
    return out


def make_photos(root, n=PHOTOS, *, seed=SEED, quality=QUALITY, classes=10):
    """Write n JPEGs under root/train/c<k>/ (see the module's text); returns the source names."""
    from PIL import Image
    src = sources()
    classes = min(classes, len(src))
    for k in range(classes):
        os.makedirs(os.path.join(root, "train", f"c{k}"), exist_ok=True)
    for i in range(n):
        s = i % len(src)
        im = src[s][1]
        rng = np.random.default_rng([seed, i])
        w, h = im.size
        area = rng.uniform(0.3, 1.0) * w * h
        aspect = np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3)))
        cw = int(min(w, round(np.sqrt(area * aspect))))
        ch = int(min(h, round(np.sqrt(area / aspect))))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        longer = int(rng.integers(SIDE[0], SIDE[1] + 1))
        scale = longer / max(cw, ch)
        crop = im.crop((x0, y0, x0 + cw, y0 + ch)).resize(
            (max(1, round(cw * scale)), max(1, round(ch * scale))), Image.LANCZOS)
        buf = io.BytesIO()
        crop.save(buf, "JPEG", quality=quality)
        with open(os.path.join(root, "train", f"c{s % classes}", f"{i:05d}.jpg"), "wb") as fh:
            fh.write(buf.getvalue())
    return [name for name, _ in src]
