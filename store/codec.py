"""Codecs: how a row of raw teacher logits is stored, and how a reader turns it back into logits.

* ``full``    -- the raw logits, float16 or float32 (2C or 4C bytes per row).
* ``topk:K``  -- the K largest logits (float16), their class indices (uint16 when C <= 65536)
  and the log-sum-exp of all C logits (float32): 4K + 4 bytes per row at float16.
  Top-k alone is biased (it drops the tail mass); the log-sum-exp gives the tail's total
  probability at temperature 1, which decode() spreads evenly over the other C-K classes, so
  the rebuilt logits give a proper distribution whose top-k part is exact.
"""
import numpy as np

from . import schema
from .errors import BadInputError, StoreError

DTYPES = ("float16", "float32")


def _finite_or_raise(logits, keys, what):
    ok = np.isfinite(logits).all(axis=1)
    if not ok.all():
        bad = np.flatnonzero(~ok)
        shown = ", ".join(str(int(keys[i])) if keys is not None else str(int(i)) for i in bad[:5])
        raise BadInputError(
            f"{what}: {len(bad)} row(s) hold NaN or Inf (flat keys {shown}{' ...' if len(bad) > 5 else ''}); "
            "the teacher's output is unusable: check its weights and input preprocessing. "
            "Nothing of this batch was written.")


class FullCodec:
    name = "full"

    def __init__(self, num_classes, dtype="float16"):
        self.num_classes = int(num_classes)
        self.dtype = np.dtype(dtype)
        self.spec = "full"

    @property
    def fields(self):
        """[(dataset name, per-row shape, dtype)]"""
        return [(schema.LOGITS, (self.num_classes,), self.dtype)]

    @property
    def bytes_per_row(self):
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.fields)

    def encode(self, logits, keys=None):
        out = logits.astype(self.dtype, copy=False)
        if self.dtype == np.float16:
            _finite_or_raise(out, keys, "logits overflow float16 (|x| > 65504); use --dtype float32")
        return {schema.LOGITS: out}

    def decode(self, fields, out=None):
        x = fields[schema.LOGITS]
        if out is None:
            return x.astype(np.float32, copy=False)
        out[...] = x
        return out


class TopKCodec:
    name = "topk"

    def __init__(self, num_classes, k, dtype="float16"):
        self.num_classes = int(num_classes)
        self.k = int(k)
        if not 1 <= self.k <= self.num_classes:
            raise StoreError(f"codec topk:{k} needs 1 <= K <= number of classes ({num_classes}): "
                             f"pick K in that range or use --codec full")
        self.dtype = np.dtype(dtype)
        self.index_dtype = np.dtype(np.uint16 if self.num_classes <= 65536 else np.int32)
        self.spec = f"topk:{self.k}"

    @property
    def fields(self):
        return [(schema.TOPK_VALUES, (self.k,), self.dtype),
                (schema.TOPK_INDICES, (self.k,), self.index_dtype),
                (schema.TOPK_LSE, (), np.dtype(np.float32))]

    @property
    def bytes_per_row(self):
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.fields)

    def encode(self, logits, keys=None):
        logits = np.asarray(logits, dtype=np.float32)
        k = self.k
        if k < self.num_classes:
            idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        else:
            idx = np.broadcast_to(np.arange(k), logits.shape).copy()
        vals = np.take_along_axis(logits, idx, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        idx = np.take_along_axis(idx, order, axis=1)
        vals = np.take_along_axis(vals, order, axis=1)
        m = logits.max(axis=1, keepdims=True)
        lse = (m[:, 0] + np.log(np.exp(logits - m).sum(axis=1))).astype(np.float32)
        v = vals.astype(self.dtype)
        if self.dtype == np.float16:
            _finite_or_raise(v, keys, "logits overflow float16 (|x| > 65504); use --dtype float32")
        return {schema.TOPK_VALUES: v, schema.TOPK_INDICES: idx.astype(self.index_dtype),
                schema.TOPK_LSE: lse}

    def decode(self, fields, out=None):
        vals = fields[schema.TOPK_VALUES].astype(np.float32)
        idx = fields[schema.TOPK_INDICES].astype(np.int64)
        lse = fields[schema.TOPK_LSE].astype(np.float32)
        n, c, k = vals.shape[0], self.num_classes, self.k
        if out is None:
            out = np.empty((n, c), dtype=np.float32)
        if k < c:
            # Probability left for the C-K classes not stored, at temperature 1; spread evenly.
            head = np.exp(vals - lse[:, None]).sum(axis=1)
            tail = np.clip(1.0 - head, 1e-12, None) / (c - k)
            out[...] = (lse + np.log(tail))[:, None]
        np.put_along_axis(out, idx, vals, axis=1)
        return out


def make_codec(codec, num_classes, dtype="float16"):
    """Codec object from its spec string: 'full' or 'topk:K'."""
    if dtype not in DTYPES:
        raise StoreError(f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")
    codec = str(codec).strip().lower()
    if codec == "full":
        return FullCodec(num_classes, dtype)
    if codec.startswith("topk:"):
        try:
            k = int(codec.split(":", 1)[1])
        except ValueError:
            raise StoreError(f"codec {codec!r}: K must be an integer, as in topk:5") from None
        return TopKCodec(num_classes, k, dtype)
    raise StoreError(f"codec {codec!r} is unknown: use 'full' or 'topk:K' (for example topk:5)")
