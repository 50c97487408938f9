"""Image data sets MXNet decodes on demand: RecordIO (.rec + .idx) and image folders (root/<class>/<image>)."""
import hashlib
import os

import numpy as np

from .dataset_base import Dataset, DatasetError


class DecodedDataset(Dataset):
    """Images decoded by MXNet on demand, resized to `size`; the file handle opens lazily per
    process (as MXRecordIO does after a fork)."""

    def __init__(self, name, split, n, labels, num_classes, size, params):
        self.name, self.split = name, split
        self.labels = np.asarray(labels, dtype=np.int64)
        self.num_classes = int(num_classes)
        self.size = size
        self.params = params
        self._n = n
        self._pid = None
        if n == 0:
            raise DatasetError(f"{name} ({split}): no images: check --data-root")
        if self.labels.min() < 0 or self.labels.max() >= self.num_classes:
            raise DatasetError(f"{name}: labels outside [0, {self.num_classes}): pass --num-classes to match "
                               f"the labels, or fix the labels in the data set")
        first = self._decode(0)
        self.shape = tuple(first.shape)

    def __len__(self):
        return self._n

    def _image(self, nd_img):
        import mxnet as mx
        if self.size is not None:
            nd_img = mx.image.imresize(nd_img, self.size[1], self.size[0])
        a = nd_img.asnumpy()
        if a.ndim == 2:
            a = a[:, :, None]
        return a.transpose(2, 0, 1).astype(np.float32) / np.float32(255.0)

    def __getitem__(self, i):
        return self._decode(i), int(self.labels[i])

    def get_batch(self, indices):
        xs = [self._decode(int(i)) for i in np.asarray(indices).reshape(-1)]
        shapes = {x.shape for x in xs}
        if len(shapes) > 1:
            raise DatasetError(f"{self.name}: images of different sizes {sorted(shapes)} in one batch: "
                               f"pass --image-size HxW to resize them")
        return np.stack(xs), self.labels[np.asarray(indices, dtype=np.int64)]

    def identity(self):
        return {"name": self.name, "split": self.split, "length": len(self), "num_classes": self.num_classes,
                "shape": list(self.shape), **self.params}


class RecordIODataset(DecodedDataset):
    """MXNet RecordIO (`.rec` + `.idx`, as written by im2rec or MXIndexedRecordIO)."""

    def __init__(self, rec_path, split="train", size=None, num_classes=None):
        import mxnet as mx
        if not rec_path.endswith(".rec"):
            raise DatasetError(f"--data-root {rec_path!r}: for --dataset recordio pass the .rec file "
                               f"(its .idx beside it)")
        idx_path = rec_path[:-4] + ".idx"
        for p in (rec_path, idx_path):
            if not os.path.isfile(p):
                raise DatasetError(f"missing {p}: RecordIO needs the .rec file and its .idx index (im2rec writes both)")
        self.rec_path, self.idx_path = rec_path, idx_path
        with open(idx_path) as fh:
            self.keys = [int(line.split("\t")[0]) for line in fh if line.strip()]
        rec = mx.recordio.MXIndexedRecordIO(idx_path, rec_path, "r")
        labels = []
        for k in self.keys:
            header, _ = mx.recordio.unpack(rec.read_idx(k))
            lab = header.label
            labels.append(int(lab if np.isscalar(lab) else np.asarray(lab).reshape(-1)[0]))
        rec.close()
        h = hashlib.sha256(open(idx_path, "rb").read())
        st = os.path.getsize(rec_path)
        with open(rec_path, "rb") as fh:  # head and tail: a full digest of a huge .rec would take minutes
            h.update(fh.read(1 << 20))
            fh.seek(max(0, st - (1 << 20)))
            h.update(fh.read())
        h.update(str(st).encode())
        classes = num_classes or (max(labels) + 1 if labels else 0)
        super().__init__("recordio", split, len(self.keys), labels, classes, size,
                         {"digest": h.hexdigest(), "file": os.path.basename(rec_path)})

    def _decode(self, i):
        import mxnet as mx
        if self._pid != os.getpid():
            self._rec = mx.recordio.MXIndexedRecordIO(self.idx_path, self.rec_path, "r")
            self._pid = os.getpid()
        _, img = mx.recordio.unpack(self._rec.read_idx(self.keys[i]))
        return self._image(mx.image.imdecode(img))


class ImageFolderDataset(DecodedDataset):
    """root/<class name>/<image>, classes in sorted order (gluon's ImageFolderDataset)."""

    def __init__(self, root, split="train", size=None):
        from mxnet.gluon.data.vision import ImageFolderDataset as _IFD
        if os.path.isdir(os.path.join(root, split)):
            root = os.path.join(root, split)
        elif split == "test" or os.path.isdir(os.path.join(root, "test")):
            # never evaluate on the training images, nor train on a 'test' class
            raise DatasetError(f"--data-root {root!r} has no {split}/ folder: lay the images out as "
                               f"root/train/<class>/... and root/test/<class>/...")
        if not os.path.isdir(root):
            raise DatasetError(f"--data-root {root!r} is not a directory of class folders")
        self._folder = _IFD(root)
        if len(self._folder) == 0:
            raise DatasetError(f"{root}: no images found in class sub-folders (root/<class>/<image>.jpg)")
        items = self._folder.items
        h = hashlib.sha256()
        total = sum(os.path.getsize(p) for p, _ in items)
        for p, lab in items:  # full content digest up to 1 GiB of images, else names and sizes
            h.update(f"{os.path.relpath(p, root)}\0{lab}\0{os.path.getsize(p)}\0".encode())
            if total <= (1 << 30):
                with open(p, "rb") as fh:
                    h.update(hashlib.sha256(fh.read()).digest())
        super().__init__("imagefolder", split, len(items), [lab for _, lab in items], len(self._folder.synsets),
                         size, {"digest": h.hexdigest(), "classes": list(self._folder.synsets)})

    def _decode(self, i):
        import mxnet as mx
        return self._image(mx.image.imread(self._folder.items[i][0]))
