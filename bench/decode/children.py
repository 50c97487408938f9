"""The decode benchmark's measurements, each in a process of its own with the threads its parent gives it.

    python -m bench.decode.children decode ROOT N     decode ms per image (JSON line)
    python -m bench.decode.children teacher PREFIX B  the teacher alone on pre-decoded tensors (JSON line)
    python -m bench.decode.children burn ROOT         make views until killed (prints "decoding" first)
    python -m bench.decode.children export NAME PREFIX  a model-zoo architecture exported with random weights
    python -m bench.decode.children peak REPEATS      this core's float32 peak (bench.flops, JSON line)
"""
import json
import sys

import numpy as np

BATCH, VIEW = 32, "center:224"


def export_teacher(name, prefix, classes=10):
    """A model-zoo architecture with random weights, exported as prefix-symbol.json / -0000.params."""
    import mxnet as mx
    from mxnet.gluon.model_zoo import vision
    mx.random.seed(0)
    net = vision.get_model(name, classes=classes, prefix="teacher_")
    net.initialize(mx.init.Xavier())
    net.hybridize()
    net(mx.nd.zeros((1, 3, 224, 224)))
    net.export(prefix, 0)
    return prefix


def decode_ms(root, n, repeats=1):
    """ms per image on this one process: the producer's own path (MXNet decode, --image-size, the view)
    and PIL's decode + resize + centre crop, for reference."""
    import time
    from PIL import Image
    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.images import ImageFolderDataset
    ds = ImageFolderDataset(root, "train", (256, 256))
    aug = Augment.parse(VIEW)
    n = min(n, len(ds))
    make_views(ds, np.arange(4), 0, seed=0, augment=aug)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(0, n, BATCH):
            make_views(ds, np.arange(i, min(n, i + BATCH)), 0, seed=0, augment=aug)
        best = min(best, (time.perf_counter() - t0) / n * 1e3)
    paths = [p for p, _ in ds.items[:n]]
    t0 = time.perf_counter()
    for p in paths:
        with Image.open(p) as im:
            im = im.convert("RGB")
            w, h = im.size
            s = 256 / min(w, h)
            im = im.resize((max(256, round(w * s)), max(256, round(h * s))), Image.BILINEAR)
            w, h = im.size
            a = np.asarray(im.crop(((w - 224) // 2, (h - 224) // 2, (w - 224) // 2 + 224, (h - 224) // 2 + 224)),
                           dtype=np.float32)
    pil = (time.perf_counter() - t0) / n * 1e3
    return {"kdcache_ms": best, "pil_ms": pil, "images": n, "shape": list(a.shape)}


def teacher_alone(prefix, batches):
    """The teacher's images/s on pre-decoded tensors (OMP_NUM_THREADS set by the parent), timed as the
    producer's rows/s is: after a forward of 2 samples (its fit check), over every batch, the first (which
    binds the executor for the batch's shape) included."""
    import time
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.pipeline.teacher import load_teacher
    t = load_teacher(TeacherOptions(prefix=prefix, epoch=0), BATCH)
    x = np.random.default_rng(0).uniform(0, 1, (BATCH, 3, 224, 224)).astype(np.float32)
    t.forward(x[:2])  # as check_fits
    t0 = time.perf_counter()
    for _ in range(batches):
        t.forward(x)
    return {"images_per_s": batches * BATCH / (time.perf_counter() - t0), "batches": batches}


def decode_forever(root):
    """Make views of the photos until killed: the load one decode worker puts on the machine."""
    from kdcache.pipeline.augment import Augment, make_views
    from kdcache.pipeline.images import ImageFolderDataset
    ds = ImageFolderDataset(root, "train", (256, 256))
    aug = Augment.parse(VIEW)
    print("decoding", flush=True)
    while True:
        for i in range(0, len(ds), BATCH):
            make_views(ds, np.arange(i, min(len(ds), i + BATCH)), 0, seed=0, augment=aug)


def main(argv=None):
    what, *rest = sys.argv[1:] if argv is None else argv
    if what == "burn":
        decode_forever(rest[0])
    elif what == "peak":
        from bench.flops import measure_peak
        print(json.dumps(measure_peak(repeats=int(rest[0]))))
    elif what == "export":
        print(json.dumps({"prefix": export_teacher(rest[0], rest[1])}))
    else:
        print(json.dumps(decode_ms(rest[0], int(rest[1])) if what == "decode" else teacher_alone(rest[0], int(rest[1]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
