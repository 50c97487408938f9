"""python -m kdcache.pipeline.export: write a data set out as image files, root/<split>/<class>/<index>.png (or .jpg).

The layout `--dataset imagefolder` reads and MXNet's im2rec packs into RecordIO (`im2rec.py --list
--recursive --no-shuffle`, then `im2rec.py --pass-through`): class folders are the class numbers,
zero-padded so that their sorted order (the order both assign labels in) is the numeric one. PNG is
lossless: the files decode to the data set's pixels exactly. Each file is written under a temporary
name and renamed into place, so an interrupted export leaves whole images only; a second run
rewrites the same bytes.
"""
if __name__ == "__main__":  # first, before anything heavy is imported: signals at safe points only
    from kdcache import signals as _signals
    _signals.defer()
import io
import os
import sys

from kdcache.args import Dir, Int, Option, Parser, add_options
from kdcache.errors import as_command
from kdcache.pipeline.errors import PipelineError

DESCRIPTION = __doc__.split("\n\n")[0].split(": ", 1)[1]

OPTIONS = [
    Option("--dataset", "the data set to write out (any --dataset the producer reads: fashion-mnist, mnist5k, ...)",
           metavar="NAME", default="mnist5k", group="data"),
    Option("--data-root", "its local files, as for the producer", metavar="PATH", group="data"),
    Option("--out", "folder to write root/<split>/<class>/<index>.<ext> into (created when missing)", type=Dir(),
           metavar="DIR", group="output"),
    Option("--splits", "the splits to write", choices=("train,test", "train", "test"), default="train,test",
           group="data"),
    Option("--per-class", "at most this many images of each class per split, the first ones in the data set's "
           "order (default: all)", type=Int(1, 1 << 31), metavar="N", group="data"),
    Option("--format", "png (lossless) or jpg", choices=("png", "jpg"), default="png", group="output"),
    Option("--quality", "JPEG quality (with --format jpg)", type=Int(1, 100), default=95, metavar="Q",
           group="output"),
]


def chosen(labels, per_class):
    """Indices of the first `per_class` samples of each class, in the data set's order."""
    import numpy as np
    if per_class is None:
        return np.arange(len(labels))
    keep, seen = [], {}
    for i, lab in enumerate(labels):
        if seen.get(int(lab), 0) < per_class:
            seen[int(lab)] = seen.get(int(lab), 0) + 1
            keep.append(i)
    return np.asarray(keep, dtype=np.int64)


def export(dataset, out, *, per_class=None, fmt="png", quality=95, progress=None):
    """Write `dataset` (a pipeline data set, one split) under out/<split>/; returns the files written."""
    import numpy as np
    from kdcache import signals
    from kdcache.extras import require
    from kdcache.store.osutil import write_atomic
    Image = require("PIL.Image", "exporting a data set as image files", PipelineError)
    idx = chosen(dataset.labels, per_class)
    width = len(str(dataset.num_classes - 1))
    root = os.path.join(out, dataset.split)
    for c in range(dataset.num_classes):
        os.makedirs(os.path.join(root, f"{c:0{width}d}"), exist_ok=True)
    digits = len(str(len(dataset) - 1))
    for a in range(0, len(idx), 256):
        signals.check()  # a stop between whole files
        x, y = dataset.get_batch(idx[a:a + 256])
        pixels = np.clip(np.rint(x * 255.0), 0, 255).astype(np.uint8)
        for i, img, lab in zip(idx[a:a + 256], pixels, y):
            img = img[0] if img.shape[0] == 1 else img.transpose(1, 2, 0)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, "PNG" if fmt == "png" else "JPEG",
                                      **({} if fmt == "png" else {"quality": quality}))
            path = os.path.join(root, f"{int(lab):0{width}d}", f"{int(i):0{digits}d}.{fmt}")
            write_atomic(path, buf.getbuffer(), fsync=False)  # whole images only; a rerun writes them again
        if progress:
            progress(min(a + 256, len(idx)), len(idx))
    return len(idx)


@as_command  # a KdcacheError (a data set's) is one line and exit 2; anything else shows as the bug it is
def main(argv=None):
    p = Parser(prog="python -m kdcache.pipeline.export", description=DESCRIPTION)
    add_options(p, OPTIONS)
    args = p.parse_args(argv)
    if not args.out:
        p.error("argument --out: name the folder to write the images into")
    from kdcache.pipeline.datasets import load_dataset
    from kdcache.signals import exit_status, stop_word
    try:
        for split in args.splits.split(","):
            ds = load_dataset(args.dataset, data_root=args.data_root, split=split)
            n = export(ds, args.out, per_class=args.per_class, fmt=args.format, quality=args.quality)
            print(f"{os.path.join(args.out, split)}: {n} images of {ds.num_classes} classes", flush=True)
    except OSError as e:  # writing the images into --out (a full disk, a folder not writable): the user's to fix
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        print(f"{stop_word(e)}: the images written so far are whole; run the same command again to finish",
              file=sys.stderr)
        return exit_status(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
