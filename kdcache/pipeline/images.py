"""Image data sets MXNet decodes on demand: RecordIO (.rec + .idx) and image folders (root/<class>/<image>).

Decoding is lazy (per sample, when a batch asks for it), except the first image, decoded at load
time for the shape. A file or record that cannot be read or decoded raises DatasetError naming it,
wherever that happens. What a file declares is checked before it is acted on: the .idx offsets and
each record's length against the .rec's size before MXNet reads a record, an image's dimensions
(its header) against MAX_PIXELS before it is decoded. The identity digests every byte of the .rec,
the .idx and every image (pipeline/digests.py remembers the digests).
"""
import io
import logging
import math
import os
import re
import struct
import warnings

import numpy as np

from .dataset_base import Dataset, DatasetError
from .digests import READ_FIX, files_digest, open_data, unreadable
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
        try:
            from PIL import Image
        except ImportError:  # no header check, no decode: refused with the extra that checks it
            from kdcache.extras import missing
            return f"its format is neither PNG nor JPEG, and reading its header needs {missing('PIL')}"
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
    """The bytes of one image file; DatasetError naming it when it cannot be read or is not a
    regular file (a FIFO, a link to a device: never opened in a way that can block)."""
    with open_data(path, fix) as fh:
        try:
            return fh.read()
        except OSError as e:
            raise unreadable(path, e, fix) from None


def _opened_path(fh):
    """A name by which MXNet opens the very file `fh` holds (checked regular), not whatever the
    path names by then: /proc/self/fd/N; None where /proc is not mounted."""
    p = f"/proc/self/fd/{fh.fileno()}"
    return p if os.path.exists(p) else None


class DecodedDataset(Dataset):
    """Images decoded by MXNet on demand, resized to `size`; the file handle opens lazily per
    process (as MXRecordIO does after a fork)."""

    decodes = True  # costly per image: the producer makes its images in decode workers (pipeline.decode_workers)

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


MAX_CLASSES = 1 << 24  # --num-classes' bound: a label past it is not a class index


class _BadRecord(Exception):
    """Why the record at an offset cannot be read (RecordIODataset names the file and the record)."""


def _pad4(n):
    return (n + 3) & ~3


def read_record(fd, offset, size):
    """(bytes of the record starting at `offset` of the .rec open as `fd`, the offset after it). A
    record is written in parts where its data holds RecordIO's magic at a 4-byte boundary (flags 1,
    2 ... 3): the parts are joined with the magic between them, as MXNet's reader joins them. Read
    with pread: threads may share the descriptor."""
    chunks, pos = [], offset
    while True:
        magic, length, part = _part_at(fd, pos, size)
        if magic != RECORD_MAGIC:
            raise _BadRecord("no RecordIO record starts there" if pos == offset else
                             f"its part at offset {pos} is no RecordIO record")
        if (part in (0, 1)) != (pos == offset):
            raise _BadRecord("no RecordIO record starts there (the middle of a record written in parts)"
                             if pos == offset else f"its part at offset {pos} starts another record")
        chunks.append(os.pread(fd, length, pos + 8))
        pos += 8 + _pad4(length)
        if part in (0, 3):
            return struct.pack("<I", RECORD_MAGIC).join(chunks), pos


def _part_at(fd, pos, size):
    """(magic, length, part flag) of the record part whose header is at `pos`, its length checked
    against the file's size."""
    return _part_header(os.pread(fd, 8, pos), pos, size)


def _part_header(head, pos, size):
    """_part_at from the bytes read at `pos` (at least the 8 of the header, when the file has them)."""
    if len(head) < 8:
        raise _BadRecord(f"the file ends inside the record header at offset {pos}")
    magic, lrec = struct.unpack_from("<II", head)
    length, part = lrec & ((1 << 29) - 1), lrec >> 29
    if magic == RECORD_MAGIC and pos + 8 + length > size:
        raise _BadRecord(f"it declares {length} bytes, past the end of the file ({size} bytes)")
    return magic, length, part


class RecordIODataset(DecodedDataset):
    """MXNet RecordIO (`.rec` + `.idx`, as written by im2rec or MXIndexedRecordIO). The .idx must list
    every record of the .rec exactly once (NOTE [a RecordIO index covers its records]); each label
    must be a class index. Records are read by kdcache from a descriptor checked regular, not by
    MXNet from the path."""

    def __init__(self, rec_path, split="train", size=None, num_classes=None, classes=None):
        if not rec_path.endswith(".rec"):
            raise DatasetError(f"--data-root {rec_path!r}: for --dataset recordio pass the .rec file "
                               f"(its .idx beside it)")
        idx_path = rec_path[:-4] + ".idx"
        for p in (rec_path, idx_path):
            if not os.path.lexists(p):
                raise DatasetError(f"missing {p}: RecordIO needs the .rec file and its .idx index (im2rec writes both)")
        self.rec_path, self.idx_path = rec_path, idx_path
        self.keys, self.offsets, labels = self._checked_index(num_classes)
        digest = files_digest([(p, os.path.basename(p)) for p in (rec_path, idx_path)],
                              desc=f"digest of {rec_path}")
        count, params = num_classes or (max(labels) + 1 if labels else 0), {}
        if classes is not None:  # only these labels, renumbered in the order given
            keep = chosen_labels(rec_path, split, classes, labels)
            picked = [k for k, lab in enumerate(labels) if lab in keep]
            self.keys, self.offsets = [self.keys[k] for k in picked], [self.offsets[k] for k in picked]
            labels, count, params = [keep[labels[k]] for k in picked], len(classes), {"classes": list(classes)}
        super().__init__("recordio", split, len(self.keys), labels, count, size,
                         {"digest": digest, "file": os.path.basename(rec_path), **params})

    # NOTE [a RecordIO index covers its records]
    # MXNet reads the record an .idx line points at and nothing else: an index that leaves records
    # out trains on fewer samples without a word, one that lists a record twice weighs it twice, and
    # an offset inside a record reads whatever bytes lie there. So the .rec is walked from its first
    # byte, part header to part header (8 bytes read each, plus the first 28 of each record's own
    # header for its label), and the .idx must name each record start exactly once: keys unique,
    # offsets unique, every offset a record's start, every record listed, the walk ending at the
    # file's last byte. The cost is the one the old check paid: one small read per record.
    def _checked_index(self, num_classes):
        """(keys, offsets, labels) of the .idx's records, in its order; DatasetError naming the record
        when the index does not cover the .rec's records exactly once or a label is not a class."""
        index = self._read_index()
        with open_data(self.rec_path) as fh:
            fd, size = fh.fileno(), os.fstat(fh.fileno()).st_size
            listed = {}
            for k, offset in index:
                if offset in listed:
                    raise DatasetError(f"{self.idx_path}: records {listed[offset]} and {k} both point at offset "
                                       f"{offset}: one record would be read twice; {self._fix(k)}")
                if not 0 <= offset <= size - 8:
                    raise DatasetError(f"{self.idx_path}: record {k} at offset {offset} is past the end of "
                                       f"{os.path.basename(self.rec_path)} ({size} bytes): the .rec is truncated "
                                       f"or the index belongs to another file; {self._fix(k)}")
                listed[offset] = k
            label_of, unlisted, pos, last = {}, [], 0, None
            while pos < size:
                k = listed.get(pos)
                try:
                    head = os.pread(fd, 36, pos)  # the part's header, then its IRHeader: one read a record
                    magic, length, part = _part_header(head, pos, size)
                    if magic != RECORD_MAGIC or part not in (0, 1):
                        raise _BadRecord("no RecordIO record starts there" if magic != RECORD_MAGIC else
                                         "the middle of a record written in parts starts there")
                    if part == 0:
                        head, after = head[8:8 + min(length, 28)], pos + 8 + _pad4(length)
                    else:
                        raw, after = read_record(fd, pos, size)
                        head = raw[:28]
                    label_of[pos] = self._label(head, length if part == 0 else len(raw), k, pos, num_classes)
                except _BadRecord as e:
                    where = f"record {k} (offset {pos})" if k is not None else (
                        f"offset {pos} (after record {last})" if last is not None else f"offset {pos}")
                    raise DatasetError(f"{self.rec_path}: {where} cannot be read ({e}): the file is truncated "
                                       f"or damaged, or {os.path.basename(self.idx_path)} belongs to another "
                                       f"file; {self._fix(k) if k is not None else REBUILD_REC}") from None
                if k is None:
                    unlisted.append(pos)
                last, pos = (k if k is not None else last), after
        inside = [(k, o) for k, o in index if o not in label_of]
        if inside:
            k, o = inside[0]
            raise DatasetError(f"{self.idx_path}: record {k} at offset {o} points inside another record, not at "
                               f"one's start: the index belongs to another file; {self._fix(k)}")
        if unlisted:
            raise DatasetError(f"{self.idx_path}: lists {len(index)} of the {len(label_of)} records in "
                               f"{os.path.basename(self.rec_path)}: {len(unlisted)} left out (the first at offset "
                               f"{unlisted[0]}); a data set read through it would lose them: "
                               f"{REBUILD_REC}")
        return [k for k, _ in index], [o for _, o in index], [label_of[o] for _, o in index]

    def _read_index(self):
        """[(key, offset)] of the .idx's lines, keys unique."""
        with open_data(self.idx_path) as fh:
            try:
                text = fh.read()
            except OSError as e:
                raise unreadable(self.idx_path, e, READ_FIX) from None
        try:
            index = [(int(f[0]), int(f[1])) for f in (line.split(b"\t") for line in text.splitlines()
                                                     if line.strip())]
        except (ValueError, IndexError):
            raise DatasetError(f"{self.idx_path}: not a RecordIO index (lines of <record key><tab><offset>): "
                               f"rebuild it with the .rec (im2rec)") from None
        seen = set()
        for k, _ in index:
            if k in seen:
                raise DatasetError(f"{self.idx_path}: record key {k} is listed twice: keys name one record "
                                   f"each; {REBUILD_REC}")
            seen.add(k)
        return index

    def _label(self, head, length, k, offset, num_classes):
        """The class index in a record's IRHeader (flag, label, id, id2, then `flag` labels when flag > 0:
        the first is the class); _BadRecord or DatasetError naming the record when it is no class."""
        if length < 24 or (head[:4] != bytes(4) and length < 28):
            raise _BadRecord(f"{length} bytes, too short for its header")
        flag, label = struct.unpack("<If", head[:8])
        label = struct.unpack("<f", head[24:28])[0] if flag else label
        limit = num_classes or MAX_CLASSES
        if math.isfinite(label) and label == int(label) and 0 <= label < limit:
            return int(label)
        what = ("not a number" if math.isnan(label) else "not a whole number" if not math.isfinite(label) or
                label != int(label) else "negative" if label < 0 else
                f"not below --num-classes {num_classes}" if num_classes else
                f"past the {MAX_CLASSES:,} classes kdcache takes")
        where = f"record {k}" if k is not None else f"the record at offset {offset}"
        shown = int(label) if math.isfinite(label) and label == int(label) else f"{label:g}"
        raise DatasetError(f"{self.rec_path}: {where}: label {shown} is {what}: a label is a class index, 0 to "
                           f"the class count - 1; write the record with its class index (im2rec's .lst labels)"
                           + ("" if not num_classes or label != int(label) or label < 0 else
                              ", or pass --num-classes to match the labels"))

    def _fix(self, k):
        return (f"rebuild {os.path.basename(self.rec_path)} (im2rec), or remove record {k}'s line from "
                f"{os.path.basename(self.idx_path)}")

    def _record(self, fd, i):
        """(header, image bytes) of the i-th record; DatasetError naming the .rec file and the record."""
        import mxnet as mx
        k = self.keys[i]
        try:
            raw, _ = read_record(fd, self.offsets[i], os.fstat(fd).st_size)
            return mx.recordio.unpack(raw)
        except (_BadRecord, struct.error, OSError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise DatasetError(f"{self.rec_path}: record {k} cannot be read ({reason}): the file is truncated "
                               f"or damaged, or {os.path.basename(self.idx_path)} belongs to another file; "
                               f"{self._fix(k)}") from None

    def _decode(self, i, out=None):
        if self._pid != os.getpid():  # opened once per process, checked regular (a fork's copy is not shared)
            self._rec = open_data(self.rec_path)
            self._pid = os.getpid()
        _, img = self._record(self._rec.fileno(), i)
        k = self.keys[i]
        return self._image(img, f"{self.rec_path}: record {k}", self._fix(k), out=out)


REBUILD_REC = "rebuild the .rec and its .idx together (im2rec, or MXIndexedRecordIO)"


IMAGE_EXTS = (".jpg", ".jpeg", ".png")  # the names gluon's ImageFolderDataset takes for images
SPLITS = ("train", "test")
log = logging.getLogger("kdcache.pipeline")


def list_class_folders(root):
    """(classes, items) of root/<class>/<image>, as gluon's ImageFolderDataset lists them: classes are
    the sorted sub-folders (links to folders too), a class's label its place in that list, items
    (path, label) its files named .jpg, .jpeg or .png in sorted order. Nothing is opened but folders;
    other names are left out (said in one line)."""
    classes, items, other = [], [], []
    for name in sorted(_listdir(root)):
        path = os.path.join(root, name)
        if not os.path.isdir(path):
            other.append(name)
            continue
        label = len(classes)
        classes.append(name)
        for fn in sorted(_listdir(path)):
            if os.path.splitext(fn)[1].lower() in IMAGE_EXTS:
                items.append((os.path.join(path, fn), label))
            else:
                other.append(os.path.join(name, fn))
    if other:
        log.info("%s: %d entr%s not read as images (only class folders of %s files are): %s", root, len(other),
                 "y" if len(other) == 1 else "ies", "/".join(IMAGE_EXTS), ", ".join(other[:5])
                 + (" ..." if len(other) > 5 else ""))
    return classes, items


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError as e:
        raise unreadable(path, e, FOLDER_READ_FIX) from None


def _check_classes(here, split, classes, items):
    """Refuse a training class folder without images (the student would be given a class it is never
    shown); a test class folder without images is said in one line (that class is not evaluated)."""
    empty = sorted(set(classes) - {classes[lab] for _, lab in items})
    if empty and split == "train":
        more = f" (and {len(empty) - 1} more: {', '.join(empty[1:4])}{' ...' if len(empty) > 4 else ''})" \
            if len(empty) > 1 else ""
        raise DatasetError(f"{os.path.join(here, empty[0])}: a class folder with no images "
                           f"({', '.join(IMAGE_EXTS)}){more}: the student would be given a class it is never "
                           f"shown; put its images in it, or remove that class from train/ and test/")
    if empty:
        log.warning("%s: class folder%s %s hold%s no images: %s not evaluated", here, "s" if len(empty) > 1 else "",
                    ", ".join(empty), "" if len(empty) > 1 else "s", "those classes are" if len(empty) > 1
                    else "that class is")


def _compare_splits(base, split, classes):
    """Refuse a split whose class folders are not the other split's: a label is the class folder's
    place in the sorted list, so one extra folder shifts every label after it. `base` holds train/
    and test/."""
    other = SPLITS[1 - SPLITS.index(split)]
    there = os.path.join(base, other)
    if not os.path.isdir(there):
        return
    theirs = [n for n in sorted(_listdir(there)) if os.path.isdir(os.path.join(there, n))]
    if theirs == classes:
        return
    mine = {"train": classes, "test": theirs} if split == "train" else {"train": theirs, "test": classes}
    extra = [f"{s}/ has {_names(sorted(set(mine[s]) - set(mine[t])))} (not in {t}/)"
             for s, t in (("train", "test"), ("test", "train")) if set(mine[s]) - set(mine[t])]
    raise DatasetError(f"{base}: train/ and test/ hold different class folders: {'; '.join(extra)}; a label is "
                       f"the class folder's place in the sorted list, so the splits' labels would not agree: "
                       f"give train/ and test/ the same class folders (an empty one is allowed in test/)")


def chosen_labels(rec_path, split, classes, labels):
    """{label: new label} of --classes on a .rec: a recordio class is named by its label number, so each
    name must be one (0, 1, ...) that a record of the file holds (in the test split, a class without
    records is said in one line, as an empty test folder is)."""
    bad = [c for c in classes if not re.fullmatch(r"0|[1-9][0-9]*", c)]
    if bad:
        raise DatasetError(f"classes {','.join(classes)}: {bad[0]!r} is not a label number: a recordio class "
                           f"is named by its label (0, 1, ...), e.g. 0,3,7")
    keep, present = {int(c): k for k, c in enumerate(classes)}, set(labels)
    absent = [c for c in classes if int(c) not in present]
    if absent and split == "train":
        raise DatasetError(f"classes {','.join(classes)}: no record of {rec_path} has label {_names(absent)} "
                           f"(its labels are {_names([str(v) for v in sorted(present)])}): choose labels the "
                           f"file holds")
    if absent:
        log.warning("%s: no record has label %s: that class is not evaluated", rec_path, _names(absent))
    return keep


def chosen_classes(root, classes, folders, items):
    """(classes, items) of the class folders --classes names, labelled in its order; every name must be
    one of `folders` (the folder's classes, sorted)."""
    unknown = [c for c in classes if c not in folders]
    if unknown:
        raise DatasetError(f"classes {','.join(classes)}: {root} has no class folder {_names(unknown)} (its "
                           f"classes: {_names(folders)}): choose class folders it holds")
    new = {folders.index(c): k for k, c in enumerate(classes)}
    return list(classes), [(p, new[lab]) for p, lab in items if lab in new]


def _names(names, shown=5):
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


class ImageFolderDataset(DecodedDataset):
    """root/<class name>/<image>, classes in sorted order (gluon's ImageFolderDataset). With train/ and
    test/ under root, both splits must hold the same class folders (checked whichever is loaded): the
    class list, recorded in the identity, is then the same for both. Every image must be a regular
    file or a link to one (NOTE [a user's data files are regular files])."""

    def __init__(self, root, split="train", size=None, classes=None):
        base = root
        if os.path.isdir(os.path.join(root, split)):
            root = os.path.join(root, split)
        elif split == "test" or os.path.isdir(os.path.join(root, "test")):
            # never evaluate on the training images, nor train on a 'test' class
            raise DatasetError(f"--data-root {root!r} has no {split}/ folder: lay the images out as "
                               f"root/train/<class>/... and root/test/<class>/...")
        if not os.path.isdir(root):
            raise DatasetError(f"--data-root {root!r} is not a directory of class folders")
        folders, items = list_class_folders(root)
        if not items:
            raise DatasetError(f"{root}: no images found in class sub-folders (root/<class>/<image>.jpg)")
        if root != base:
            _compare_splits(base, split, folders)  # every folder: a selection is the same one in both splits
        if classes is not None:
            classes, items = chosen_classes(root, classes, folders, items)
        else:
            classes = folders
        _check_classes(root, split, classes, items)
        self.items, self.classes = items, classes
        # Every byte of every image: a size limit here once let an image changed in place keep its digest.
        # Each is stat()ed first: a FIFO, a device, a dangling link is refused before anything is read.
        digest = files_digest([(p, f"{os.path.relpath(p, root)}\0{lab}") for p, lab in items],
                              desc=f"digest of {root}", fix=FOLDER_READ_FIX)
        super().__init__("imagefolder", split, len(items), [lab for _, lab in items], len(classes),
                         size, {"digest": digest, "classes": list(classes)})

    def _decode(self, i, out=None):
        path = self.items[i][0]
        with open_data(path, FOLDER_READ_FIX) as fh:
            try:
                buf = fh.read()
            except OSError as e:
                raise unreadable(path, e, FOLDER_READ_FIX) from None
            fh.seek(0)
            return self._image(buf, path, FOLDER_FIX, path=_opened_path(fh), out=out)
