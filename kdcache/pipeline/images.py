"""Image data sets MXNet decodes on demand: RecordIO (.rec + .idx) and image folders (root/<class>/<image>).

Decoding is lazy (per sample, when a batch asks for it), except the first image, decoded at load
time for the shape. A file or record that cannot be read or decoded raises DatasetError naming it,
wherever that happens. What a file declares is checked before it is acted on: the .idx offsets and
each record's length against the .rec's size before MXNet reads a record, an image's dimensions
(its header) against MAX_PIXELS before it is decoded. The identity digests every byte of the .rec,
the .idx and every image (pipeline/digests.py remembers the digests).
"""
import io
import math
import os
import re
import struct
import warnings

import numpy as np

from .dataset_base import Dataset, DatasetError
from .digests import files_digest, unreadable
from .quiet import decoder_output

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"  # the last chunk of every PNG, always these 12 bytes
FOLDER_FIX = "remove or replace it"
FOLDER_READ_FIX = "make it readable, or remove or replace it"
MAX_PIXELS = 64_000_000  # one decoded image: 64 megapixels is 192 MB of RGB bytes, 768 MB as float32
JPEG_FRAMES = (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)  # SOFn markers
RECORD_MAGIC = 0xCED7230A  # every RecordIO record starts with it, then its length (29 bits) and a 3-bit flag


def image_defect(buf):
    """Why `buf` is not a whole image, or None. MXNet's decoder does not say: a cut-off JPEG decodes
    to an image filled with gray, and a PNG cut inside its header to zeros or to a garbage shape.
    Formats other than PNG and JPEG are left to the decoder."""
    if len(buf) == 0:
        return "it is empty (0 bytes)"
    if PNG_SIGNATURE.startswith(buf[:8]):  # the signature, or a file cut inside it
        if buf.endswith(PNG_IEND) or _png_complete(buf):
            return None
        return "truncated or damaged PNG (its chunks do not reach the IEND chunk)"
    if buf.startswith(b"\xff\xd8"):
        # Trailing zeros after the end-of-image marker are common padding, not damage.
        if buf.rstrip(b"\0").endswith(b"\xff\xd9"):
            return None
        scan = _jpeg_first_scan(buf)
        if scan is None:
            return None  # headers this walk does not follow: the decoder judges
        if scan < 0 or buf.find(b"\xff\xd9", scan) < 0:
            return "truncated JPEG (no end-of-image marker after its image data)"
    return None


def _png_complete(buf):
    """Whether the chunks, walked from the signature, reach an IEND chunk (data may follow it)."""
    pos = len(PNG_SIGNATURE)
    while pos + 12 <= len(buf):
        size = int.from_bytes(buf[pos:pos + 4], "big")
        kind = buf[pos + 4:pos + 8]
        pos += 12 + size
        if pos > len(buf):
            return False
        if kind == b"IEND":
            return True
    return False


def _jpeg_first_scan(buf):
    """Offset where the first scan's data starts; -1 when the file ends inside the headers; None
    when the headers do not parse. In scan data a 0xFF byte is followed by 0x00 or a restart
    marker, so an FF D9 after this offset can only be the end-of-image marker."""
    found = _jpeg_segment(buf, (0xDA,))
    if not isinstance(found, tuple):
        return found
    end = found[1] + 2 + int.from_bytes(buf[found[1] + 2:found[1] + 4], "big")
    return end if end <= len(buf) else -1


def _jpeg_segment(buf, wanted):
    """(marker, offset) of the first marker segment in `wanted`; -1 when the file ends inside the
    headers; None when the headers do not parse or the image ends first."""
    pos, n = 2, len(buf)
    while pos + 4 <= n:
        if buf[pos] != 0xFF:
            return None
        marker = buf[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
        elif marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
        elif marker == 0xD9:  # end of image before any scan
            return None
        elif marker in wanted:
            return marker, pos
        else:
            pos += 2 + int.from_bytes(buf[pos + 2:pos + 4], "big")
    return -1


def image_oversize(buf):
    """Why an image is too large to decode (its header declares over MAX_PIXELS), or None. Read from
    the header alone: PNG's IHDR, JPEG's start-of-frame, else what PIL's header parser finds."""
    size = None
    if buf.startswith(PNG_SIGNATURE) and buf[12:16] == b"IHDR" and len(buf) >= 24:
        size = struct.unpack(">II", buf[16:24])
    elif buf.startswith(b"\xff\xd8"):
        found = _jpeg_segment(buf, JPEG_FRAMES + (0xDA,))
        if isinstance(found, tuple) and found[0] != 0xDA and found[1] + 9 <= len(buf):
            size = struct.unpack(">HH", buf[found[1] + 5:found[1] + 9])[::-1]
    else:
        from PIL import Image
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # judged here
                with Image.open(io.BytesIO(buf)) as im:
                    size = im.size
        except Image.DecompressionBombError as e:
            return f"{e}".rstrip(".")
        except Exception:  # not a format PIL reads: the decoder judges it
            return None
    if size is None or size[0] * size[1] <= MAX_PIXELS:
        return None
    return (f"its header declares {size[0]}x{size[1]} pixels ({size[0] * size[1] / 1e6:.0f} megapixels), over "
            f"the limit of {MAX_PIXELS / 1e6:.0f} megapixels for one image")


def _mxnet_reason(e):
    """The last line of an MXNet error (its traceback is MXNet's, not the user's), without the
    'Check failed: <C++ expression>:' before the reason."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    last = lines[-1] if lines else ""
    if "Check failed:" in last:
        last = last.rsplit(": ", 1)[-1]
    return re.sub(r"^MXNetError: ", "", last)[:160] or type(e).__name__


def read_file(path, fix):
    """The bytes of one image file; DatasetError naming it when it cannot be read."""
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise unreadable(path, e, fix) from None


class DecodedDataset(Dataset):
    """Images decoded by MXNet on demand, resized to `size`; the file handle opens lazily per
    process (as MXRecordIO does after a fork)."""

    decodes = True  # costly per image: the producer makes its images in decode workers (pipeline.decode)

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

    def _image(self, buf, where, fix, path=None, out=None):
        """float32 [C, H, W] in [0, 1] from the encoded bytes of one image; `where` names it in errors.
        With `path` (the file `buf` was read from) MXNet reads the file itself: imdecode would first
        copy the bytes into an NDArray, which costs more than reading the file again. Written into
        `out` (a batch's row) when the shapes agree."""
        import mxnet as mx
        defect = image_defect(buf)
        if defect:
            raise DatasetError(f"{where}: cannot be decoded as an image: {defect}: {fix}")
        oversize = image_oversize(buf)
        if oversize:
            raise DatasetError(f"{where}: not decoded: {oversize}: {fix}")
        try:
            with decoder_output():  # the decoders' warnings stay off the terminal (NOTE [decoder noise])
                nd_img = mx.image.imread(path) if path is not None else mx.image.imdecode(buf)
                if self.size is not None:
                    nd_img = mx.image.imresize(nd_img, self.size[1], self.size[0])
                a = nd_img.asnumpy()  # MXNet decodes asynchronously: its errors surface here
        except mx.base.MXNetError as e:
            raise DatasetError(f"{where}: cannot be decoded as an image ({_mxnet_reason(e)}): {fix}") from None
        if a.ndim == 2:
            a = a[:, :, None]
        chw = a.transpose(2, 0, 1)
        if out is None or out.shape != chw.shape:
            out = np.empty(chw.shape, dtype=np.float32)
        return np.divide(chw, np.float32(255.0), out=out, dtype=np.float32)  # (x as float32) / 255 in float32

    def __getitem__(self, i):
        return self._decode(i), int(self.labels[i])

    def get_batch(self, indices):
        flat = [int(i) for i in np.asarray(indices).reshape(-1)]
        out = np.empty((len(flat),) + tuple(self.shape), dtype=np.float32)  # each image decoded into its row
        with decoder_output():  # one span for the batch: each image's own span is then nested, ~1 us
            xs = [self._decode(i, out=out[k]) for k, i in enumerate(flat)]
        shapes = {x.shape for x in xs}
        if len(shapes) > 1:
            sizes = sorted(f"{h}x{w}" for _, h, w in shapes)  # a photo folder's sizes are many: three are enough
            raise DatasetError(f"{self.name}: images of different sizes in one batch ({len(sizes)} sizes: "
                               f"{', '.join(sizes[:3])}{', ...' if len(sizes) > 3 else ''}): pass --image-size HxW "
                               f"to resize them")
        if shapes and shapes != {out.shape[1:]}:  # all of one size, not the first image's
            out = np.stack(xs)
        return out, self.labels[np.asarray(indices, dtype=np.int64)]

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
        self.keys, labels = self._checked_index()
        if None in labels:  # records written in parts: MXNet joins them
            rec = mx.recordio.MXIndexedRecordIO(idx_path, rec_path, "r")
            for i in [i for i, lab in enumerate(labels) if lab is None]:
                lab = self._record(rec, self.keys[i])[0].label
                labels[i] = int(lab if np.isscalar(lab) else np.asarray(lab).reshape(-1)[0])
            rec.close()
        digest = files_digest([(p, os.path.basename(p)) for p in (rec_path, idx_path)],
                              desc=f"digest of {rec_path}")
        classes = num_classes or (max(labels) + 1 if labels else 0)
        super().__init__("recordio", split, len(self.keys), labels, classes, size,
                         {"digest": digest, "file": os.path.basename(rec_path)})

    def _checked_index(self):
        """(keys, labels) of the .idx's records. Each offset is checked against the .rec's size and the
        record header there (RecordIO's magic, a length within the file) before MXNet reads anything,
        and the label is read from the record's IRHeader: loading reads ~36 bytes a record, not the
        images (the label is None for a record written in parts: MXNet joins them)."""
        try:
            with open(self.idx_path) as fh:
                index = [(int(f[0]), int(f[1])) for f in (line.split("\t") for line in fh if line.strip())]
        except (ValueError, IndexError):
            raise DatasetError(f"{self.idx_path}: not a RecordIO index (lines of <record key><tab><offset>): "
                               f"rebuild it with the .rec (im2rec)") from None
        size = os.path.getsize(self.rec_path)
        labels = []
        with open(self.rec_path, "rb") as fh:
            for k, offset in index:
                if not 0 <= offset <= size - 8:
                    raise DatasetError(f"{self.idx_path}: record {k} at offset {offset} is past the end of "
                                       f"{os.path.basename(self.rec_path)} ({size} bytes): the .rec is truncated "
                                       f"or the index belongs to another file; {self._fix(k)}")
                fh.seek(offset)
                head = fh.read(8 + 28)  # record header, IRHeader (flag, label, id, id2), first label of many
                magic, lrec = struct.unpack("<II", head[:8])
                length, parts = lrec & ((1 << 29) - 1), lrec >> 29  # of the record, or of its first part
                if magic != RECORD_MAGIC:
                    reason = "no RecordIO record starts there"
                elif offset + 8 + length > size:
                    reason = f"it declares {length} bytes, past the end of the file ({size} bytes)"
                elif parts:
                    labels.append(None)
                    continue
                elif length < 24 or (head[8:12] != bytes(4) and length < 28):
                    reason = f"{length} bytes, too short for its header"
                else:
                    flag, label = struct.unpack("<If", head[8:16])
                    label = struct.unpack("<f", head[32:36])[0] if flag else label
                    if math.isfinite(label):
                        labels.append(int(label))
                        continue
                    reason = f"its label is {label}"
                raise DatasetError(f"{self.rec_path}: record {k} (offset {offset}) cannot be read ({reason}): "
                                   f"the file is truncated or damaged, or {os.path.basename(self.idx_path)} "
                                   f"belongs to another file; {self._fix(k)}")
        return [k for k, _ in index], labels

    def _fix(self, k):
        return (f"rebuild {os.path.basename(self.rec_path)} (im2rec), or remove record {k}'s line from "
                f"{os.path.basename(self.idx_path)}")

    def _record(self, rec, k):
        """(header, image bytes) of record k; DatasetError naming the .rec file and the record."""
        import mxnet as mx
        try:
            raw = rec.read_idx(k)
            if raw is None:  # read past the end of the file
                raise EOFError("the .rec file ends before it")
            return mx.recordio.unpack(raw)
        except (mx.base.MXNetError, EOFError, struct.error) as e:
            reason = _mxnet_reason(e) if isinstance(e, mx.base.MXNetError) else str(e)
            raise DatasetError(f"{self.rec_path}: record {k} cannot be read ({reason}): the file is truncated "
                               f"or damaged, or {os.path.basename(self.idx_path)} belongs to another file; "
                               f"{self._fix(k)}") from None

    def _decode(self, i, out=None):
        import mxnet as mx
        if self._pid != os.getpid():
            self._rec = mx.recordio.MXIndexedRecordIO(self.idx_path, self.rec_path, "r")
            self._pid = os.getpid()
        k = self.keys[i]
        _, img = self._record(self._rec, k)
        return self._image(img, f"{self.rec_path}: record {k}", self._fix(k), out=out)


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
        # Every byte of every image: a size limit here once let an image changed in place keep its digest.
        digest = files_digest([(p, f"{os.path.relpath(p, root)}\0{lab}") for p, lab in items],
                              desc=f"digest of {root}", fix=FOLDER_READ_FIX)
        super().__init__("imagefolder", split, len(items), [lab for _, lab in items], len(self._folder.synsets),
                         size, {"digest": digest, "classes": list(self._folder.synsets)})

    def _decode(self, i, out=None):
        path = self._folder.items[i][0]
        return self._image(read_file(path, FOLDER_READ_FIX), path, FOLDER_FIX, path=path, out=out)
