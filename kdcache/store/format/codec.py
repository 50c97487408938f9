"""Codecs: how a row of raw teacher logits is stored, and how a reader turns it back into logits.

* ``full``    -- the raw logits, float16 or float32 (2C or 4C bytes per row).
* ``topk:K``  -- the K largest logits (float16), their class indices (uint16 when C <= 65536),
  the log-sum-exp of all C logits and the log of the probability mass of the C-K classes not
  stored (both float32, computed from the float32 logits): 4K + 8 bytes per row at float16.
  Top-k alone is biased (it drops the tail mass): decode() spreads the tail mass evenly over
  the other C-K classes, so the rebuilt logits give a proper distribution whose top-k part is
  exact. The tail is stored as a logarithm computed from the tail's own logits: no rounding of
  the stored top values can make it negative, and a tail of 1e-30 keeps its size (it decides
  the soft targets at a high temperature).
* ``int8``    -- every logit in 8 bits: codes q = round((x - lo) / scale) (uint8) with the row's
  offset lo = min(x) and step scale = (max(x) - min(x)) / 255 (both float32): C + 8 bytes per
  row, each logit decoded as lo + q * scale to within scale / 2. The codes are 8-bit whatever
  the dtype: int8 takes the default dtype, float16, only (float32 would name a second cache of
  the same bytes); unlike float16 it never overflows.

* ``sampled:K`` -- Sparse Logit Sampling (Anshumann et al., ACL 2025): K classes drawn with
  replacement from the teacher's distribution at temperature 1, stored as the distinct classes
  drawn and their counts: 3K bytes per row (K <= 255; 4K above). The estimate count / K is
  unbiased: its expectation over draws is the teacher's distribution p. The draws are keyed by
  (flat key, the cache's seed), so a rebuild stores the same rows whatever the batch order or
  sharding. decode() gives log(count / K), and SAMPLED_FLOOR for the classes not drawn: at T = 1
  the KD loss is then the student's cross-entropy against the sparse estimate (up to a constant),
  as in the paper; at T != 1 the student sees the estimate tempered (count^(1/T)), which is no
  longer unbiased.

Codec versions: ``topk`` version 1 (files written before the log-tail existed) stored no tail;
its reader rebuilds the tail as 1 - (the stored top values' mass), in float64, for the rows
where float16 rounding leaves that difference known to within 25%; a file with other rows is
refused with one line (rebuild it). Writers always write the current version.
"""
import re
from typing import NamedTuple, Optional

import numpy as np

from . import schema
from ..errors import BadInputError, DamagedRowsError, NewerFormatError, StoreError

DTYPES = ("float16", "float32")
VERSIONS = {"full": 1, "topk": 2, "int8": 1, "sampled": 1}  # the version of each codec that writers write
SAMPLED_FLOOR = -1.0e4  # decoded logit of a class no draw gave: finite (0 * log 0 would make the KD loss NaN), exp() 0
LOGTAIL_NONE = -1.0e4  # topk_logtail of a row without a tail (K = C): exp() of it is 0 at any temperature
# Relative rounding of a stored value (half an ulp): float16, float32.
_ROUNDING = {np.dtype(np.float16): 2.0 ** -11, np.dtype(np.float32): 2.0 ** -24}


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
    version = 1

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

    def unrecoverable(self, fields):
        return np.zeros(len(fields[schema.LOGITS]), dtype=bool)


class TopKCodec:
    name = "topk"

    def __init__(self, num_classes, k, dtype="float16", version=VERSIONS["topk"]):
        self.num_classes = int(num_classes)
        self.k = int(k)
        self.version = int(version)
        if self.version not in (1, 2):
            raise NewerFormatError(f"codec topk version {version} is unknown to this kdcache (it reads 1 and 2): "
                                   f"upgrade kdcache, or rebuild the cache")
        if not 1 <= self.k <= self.num_classes:
            raise StoreError(f"codec topk:{k} needs 1 <= K <= number of classes ({num_classes}): "
                             f"pick K in that range or use --codec full")
        self.dtype = np.dtype(dtype)
        self.index_dtype = np.dtype(np.uint16 if self.num_classes <= 65536 else np.int32)
        self.spec = f"topk:{self.k}"

    @property
    def fields(self):
        fields = [(schema.TOPK_VALUES, (self.k,), self.dtype),
                  (schema.TOPK_INDICES, (self.k,), self.index_dtype),
                  (schema.TOPK_LSE, (), np.dtype(np.float32))]
        if self.version >= 2:
            fields.append((schema.TOPK_LOGTAIL, (), np.dtype(np.float32)))
        return fields

    @property
    def bytes_per_row(self):
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.fields)

    def encode(self, logits, keys=None):
        logits = np.asarray(logits, dtype=np.float32)
        k, c = self.k, self.num_classes
        if k < c:
            idx = np.argpartition(-logits, k - 1, axis=1)[:, :k]
        else:
            idx = np.broadcast_to(np.arange(k), logits.shape).copy()
        vals = np.take_along_axis(logits, idx, axis=1)
        order = np.argsort(-vals, axis=1, kind="stable")
        idx = np.take_along_axis(idx, order, axis=1)
        vals = np.take_along_axis(vals, order, axis=1)
        lse = _logsumexp(logits)
        v = vals.astype(self.dtype)
        if self.dtype == np.float16:
            _finite_or_raise(v, keys, "logits overflow float16 (|x| > 65504); use --dtype float32")
        out = {schema.TOPK_VALUES: v, schema.TOPK_INDICES: idx.astype(self.index_dtype),
               schema.TOPK_LSE: lse.astype(np.float32)}
        if self.version >= 2:
            out[schema.TOPK_LOGTAIL] = log_tail_mass(logits, idx, lse).astype(np.float32)
        return out

    def decode(self, fields, out=None):
        vals = fields[schema.TOPK_VALUES].astype(np.float32)
        idx = fields[schema.TOPK_INDICES].astype(np.int64)
        lse = fields[schema.TOPK_LSE].astype(np.float32)
        n, c, k = vals.shape[0], self.num_classes, self.k
        wrong = (idx < 0) | (idx >= c)
        if wrong.any():  # a writer never stores these: the file changed since (not the caller's indices)
            rows = np.flatnonzero(wrong.any(axis=1))
            raise DamagedRowsError(f"{schema.TOPK_INDICES} holds class index {int(idx[wrong][0])}, outside [0, {c}), "
                                   f"in {rows.size} row(s): the cache is damaged", rows=rows)
        if out is None:
            out = np.empty((n, c), dtype=np.float32)
        if k < c:
            if self.version >= 2:
                logtail = fields[schema.TOPK_LOGTAIL].astype(np.float32)
            else:
                logtail = np.log(self._legacy_tail(fields)).astype(np.float32)
            # The tail mass (at temperature 1), spread evenly over the C-K classes not stored.
            out[...] = (lse + logtail - np.float32(np.log(c - k)))[:, None]
        np.put_along_axis(out, idx, vals, axis=1)
        return out

    def _legacy_tail(self, fields):
        """Version 1: the tail mass as 1 - the stored top values' mass, in float64 (tiny where unknown)."""
        vals = fields[schema.TOPK_VALUES].astype(np.float64)
        head = np.exp(vals - fields[schema.TOPK_LSE].astype(np.float64)[:, None]).sum(axis=1)
        return np.clip(1.0 - head, 1e-30, None)

    def unrecoverable(self, fields):
        """Rows whose tail mass cannot be rebuilt to within 25% (version 1 files only): rounding the
        stored values moves their mass by more than a quarter of what is left for the tail."""
        if self.version >= 2 or self.k >= self.num_classes:
            return np.zeros(len(fields[schema.TOPK_LSE]), dtype=bool)
        vals = fields[schema.TOPK_VALUES].astype(np.float64)
        lse = fields[schema.TOPK_LSE].astype(np.float64)
        p = np.exp(vals - lse[:, None])
        slack = (p * (np.abs(vals) * _ROUNDING[self.dtype] + np.abs(lse)[:, None] * 2.0 ** -24)).sum(axis=1)
        return 1.0 - p.sum(axis=1) <= 4.0 * slack


class Int8Codec:
    """Each row's C logits as uint8 codes over [min, max] of the row (255 steps), with that offset
    and step in float32: the rounding error is at most half a step, for every class."""
    name = "int8"
    version = 1
    LEVELS = 255

    def __init__(self, num_classes, dtype="float16"):
        self.num_classes = int(num_classes)
        if np.dtype(dtype) != np.float16:
            name = np.dtype(dtype).name
            raise StoreError(f"codec int8 stores 8-bit codes with a float32 offset and scale per row, whatever the "
                             f"dtype: dtype {name} does not apply to it; leave the dtype at its default (float16), "
                             f"or use codec full with dtype {name}")
        self.dtype = np.dtype(dtype)  # recorded in the metadata; the rows are uint8 codes
        self.spec = "int8"

    @property
    def fields(self):
        return [(schema.INT8_CODES, (self.num_classes,), np.dtype(np.uint8)),
                (schema.INT8_LO, (), np.dtype(np.float32)),
                (schema.INT8_SCALE, (), np.dtype(np.float32))]

    @property
    def bytes_per_row(self):
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.fields)

    def encode(self, logits, keys=None):
        x = np.asarray(logits, dtype=np.float64)
        _finite_or_raise(x, keys, "codec int8")
        lo = x.min(axis=1).astype(np.float32)
        # the step from the float32 offset, in float64 (max - min of float32 values may overflow float32)
        scale = ((x.max(axis=1) - lo) / self.LEVELS).astype(np.float32)
        step = np.where(scale > 0, scale, 1.0).astype(np.float64)  # a constant row: every code 0, scale 0
        q = np.rint((x - lo[:, None].astype(np.float64)) / step[:, None])
        return {schema.INT8_CODES: np.clip(q, 0, self.LEVELS).astype(np.uint8), schema.INT8_LO: lo,
                schema.INT8_SCALE: scale}

    def decode(self, fields, out=None):
        lo = fields[schema.INT8_LO].astype(np.float64)[:, None]
        scale = fields[schema.INT8_SCALE].astype(np.float64)[:, None]
        x = lo + fields[schema.INT8_CODES] * scale  # in float64: lo + 255 * scale may pass float32's range
        if out is None:
            return x.astype(np.float32)
        out[...] = x
        return out

    def unrecoverable(self, fields):
        return np.zeros(len(fields[schema.INT8_LO]), dtype=bool)


class SampledCodec:
    """K draws with replacement from softmax(logits) (temperature 1), stored as the distinct classes and
    their counts; the estimate count / K of the teacher's distribution is unbiased (Anshumann et al. 2025)."""
    name = "sampled"
    version = 1
    K_MAX = 65535  # draws: the counts fit uint16

    def __init__(self, num_classes, k, dtype="float16", seed=0):
        self.num_classes = int(num_classes)
        self.k = int(k)
        if not 1 <= self.k <= self.K_MAX:
            raise StoreError(f"codec sampled:{k} needs 1 <= K <= {self.K_MAX} draws: pick K in that range")
        if np.dtype(dtype) != np.float16:  # float32 would name a second cache of the same bytes (as int8)
            raise StoreError(f"codec sampled:{k} stores class indices "
                             f"and counts whatever the dtype: dtype {np.dtype(dtype).name} does not apply to it; "
                             f"leave the dtype at its default (float16), or use codec full with that dtype")
        self.dtype = np.dtype(dtype)  # recorded in the metadata; the rows are class indices and counts
        self.seed = int(seed) & _MASK64
        self.index_dtype = np.dtype(np.uint16 if self.num_classes <= 65536 else np.int32)
        self.count_dtype = np.dtype(np.uint8 if self.k <= 255 else np.uint16)
        self.spec = f"sampled:{self.k}"

    @property
    def fields(self):
        return [(schema.SAMPLED_INDICES, (self.k,), self.index_dtype),
                (schema.SAMPLED_COUNTS, (self.k,), self.count_dtype)]

    @property
    def bytes_per_row(self):
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for _, s, d in self.fields)

    def uniforms(self, keys):
        """[B, K] uniforms in [0, 1) from (the cache's seed, key, draw): counter-based, so a row's draws
        depend on its key alone, not on the batch it was written in. A cache's key is the row's flat key
        (one row per (sample, view), drawn once); a ring's is stream_keys(seed, sample, view, epoch)."""
        keys = np.asarray(keys, dtype=np.int64).reshape(-1).astype(np.uint64)
        base = _splitmix64(keys ^ np.uint64(self.seed))
        ctr = base[:, None] + (np.arange(1, self.k + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15))[None, :]
        return (_splitmix64(ctr) >> np.uint64(11)).astype(np.float64) * 2.0 ** -53

    def encode(self, logits, keys=None):
        x = np.asarray(logits, dtype=np.float64)
        _finite_or_raise(x, keys, f"codec {self.spec}")
        if keys is None:
            raise BadInputError(f"codec {self.spec} draws each row's classes from its key: pass the rows' keys")
        b, c, k = x.shape[0], self.num_classes, self.k
        p = np.exp(x - x.max(axis=1, keepdims=True))
        cdf = np.cumsum(p, axis=1)
        cdf /= cdf[:, -1:]
        # inverse CDF for every row at once: row r's CDF lies in [r, r + 1] of one increasing array
        rows = np.arange(b, dtype=np.float64)[:, None]
        flat = (cdf + rows).reshape(-1)
        u = self.uniforms(keys) + rows
        drawn = np.searchsorted(flat, u.reshape(-1), side="right").reshape(b, k) - np.arange(b)[:, None] * c
        drawn = np.clip(drawn, 0, c - 1)  # rounding at a row's last CDF step
        drawn.sort(axis=1)
        start = np.ones((b, k), dtype=bool)
        start[:, 1:] = drawn[:, 1:] != drawn[:, :-1]
        slot = np.cumsum(start, axis=1) - 1
        r = np.broadcast_to(np.arange(b)[:, None], (b, k))
        counts = np.zeros((b, k), dtype=np.int64)
        np.add.at(counts, (r, slot), 1)
        idx = np.zeros((b, k), dtype=np.int64)
        idx[r[start], slot[start]] = drawn[start]
        return {schema.SAMPLED_INDICES: idx.astype(self.index_dtype),
                schema.SAMPLED_COUNTS: counts.astype(self.count_dtype)}

    def probabilities(self, fields):
        """The estimate count / K of each row's distribution, float64 [B, C] (0 for classes not drawn)."""
        idx = fields[schema.SAMPLED_INDICES].astype(np.int64)
        cnt = fields[schema.SAMPLED_COUNTS].astype(np.int64)
        b, c = idx.shape[0], self.num_classes
        wrong = (idx < 0) | (idx >= c)
        bad = wrong.any(axis=1) | (cnt.sum(axis=1) != self.k)
        if bad.any():  # a writer never stores these: the file changed since
            rows = np.flatnonzero(bad)
            raise DamagedRowsError(f"{rows.size} row(s) of codec {self.spec} hold a class index outside [0, {c}) "
                                   f"or counts that do not sum to {self.k}: the cache is damaged", rows=rows)
        flat = (np.arange(b)[:, None] * c + idx).reshape(-1)
        return np.bincount(flat, weights=cnt.reshape(-1) / self.k, minlength=b * c).reshape(b, c)

    def decode(self, fields, out=None):
        q = self.probabilities(fields)
        with np.errstate(divide="ignore"):
            x = np.where(q > 0, np.log(q), SAMPLED_FLOOR)
        if out is None:
            return x.astype(np.float32)
        out[...] = x
        return out

    def unrecoverable(self, fields):
        return np.zeros(len(fields[schema.SAMPLED_COUNTS]), dtype=bool)


_MASK64 = (1 << 64) - 1


def stream_keys(seed, indices, views, epochs):
    """The draw key of each row a stream (the shared-memory ring) carries: a 64-bit mix of (seed, sample index,
    view, epoch). A ring holds each epoch's rows anew, so `sampled:K` draws new classes every epoch and for every
    --seed, and the same (seed, sample, view, epoch) always draws the same (NOTE in SampledCodec.uniforms)."""
    idx = np.asarray(indices, dtype=np.int64).reshape(-1)
    k = _splitmix64(np.full(idx.shape, int(seed) & _MASK64, dtype=np.uint64))
    for part in (idx, np.broadcast_to(np.asarray(views, dtype=np.int64), idx.shape),
                 np.broadcast_to(np.asarray(epochs, dtype=np.int64), idx.shape)):
        k = _splitmix64(k ^ part.astype(np.uint64))
    return k.astype(np.int64)


def _splitmix64(z):
    """SplitMix64's finaliser, elementwise on uint64 (wrapping arithmetic): well-mixed 64-bit values."""
    z = np.asarray(z, dtype=np.uint64) + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def log_tail_mass(logits, idx, lse=None):
    """log of the probability mass (temperature 1) of the classes not in `idx` [B, K], in float64, from
    their own logits (never the difference of two near-equal sums); LOGTAIL_NONE when there are none."""
    if lse is None:
        lse = _logsumexp(logits)
    if idx.shape[1] >= logits.shape[1]:
        return np.full(logits.shape[0], LOGTAIL_NONE)
    tail = np.array(logits, dtype=np.float64)
    np.put_along_axis(tail, idx, -np.inf, axis=1)
    return np.maximum(_logsumexp(tail) - lse, LOGTAIL_NONE)


def _logsumexp(x):
    """log(sum(exp(x))) over axis 1 in float64, for rows that may hold -inf (not all of them)."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=1)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return m_safe + np.log(np.exp(x - m_safe[:, None]).sum(axis=1))


# --- the codecs by name: the grammar of a codec spec, here once -------------------------------------
class CodecKind(NamedTuple):
    """One codec as a spec names it: NAME, or NAME:K when it takes K."""
    cls: type
    takes_k: bool = False
    k_max: Optional[int] = None  # K's upper bound; None: the class count (checked where it is known)
    k_noun: str = "K"  # what K counts, as the allowed values say it
    example: str = ""  # a spec of this kind, as messages show it
    passes: tuple = ()  # what make_codec hands on besides the class count, K and dtype: "version", "seed"


CODECS = {
    "full": CodecKind(FullCodec),
    "topk": CodecKind(TopKCodec, takes_k=True, example="topk:5", passes=("version",)),
    "int8": CodecKind(Int8Codec),
    "sampled": CodecKind(SampledCodec, takes_k=True, k_max=SampledCodec.K_MAX, k_noun="K draws", example="sampled:16",
                         passes=("seed",)),
}
_SPEC = re.compile(r"([a-z0-9]+)(?::([0-9]+))?", re.ASCII)


def _said(name, kind, examples):
    if not kind.takes_k:
        return name
    top = "the class count" if kind.k_max is None else kind.k_max
    return f"{name}:K with {kind.k_noun} from 1 to {top}" + (f" (e.g. {kind.example})" if examples else "")


def codec_grammar():
    """The codec specs allowed, as the --codec option's allowed values show them."""
    return " | ".join(_said(name, kind, False) for name, kind in CODECS.items())


def codecs_allowed():
    """The codec specs allowed, with an example of each K, as a refusal names them."""
    said = [_said(name, kind, True) for name, kind in CODECS.items()]
    return ", ".join(said[:-1]) + ", or " + said[-1]


def parse_codec(text):
    """The canonical spec of a codec name: 'full', 'topk:K', 'int8' or 'sampled:K' (case and surrounding
    blanks ignored, K without leading zeros). BadInputError in one line naming what is allowed for anything
    else, K out of its bounds included; topk's K against the class count is the codec's own check, where
    the class count is known."""
    v = str(text).strip().lower()
    m = _SPEC.fullmatch(v)
    kind = CODECS.get(m.group(1)) if m else None
    k = None if kind is None or m.group(2) is None else int(m.group(2))
    if kind is None or kind.takes_k != (k is not None) or not _k_fits(kind, k):
        raise BadInputError(f"{text!r}: use {codecs_allowed()}")
    return m.group(1) if k is None else f"{m.group(1)}:{k}"


def _k_fits(kind, k):
    return k is None or k >= 1 and (kind.k_max is None or k <= kind.k_max)


def make_codec(codec, num_classes, dtype="float16", version=None, seed=0):
    """Codec object from its spec string: 'full', 'topk:K', 'int8' or 'sampled:K' (parse_codec); `version`: the
    codec version a file records (None: the version writers write now); `seed`: the cache's seed (sampled:K's
    draws)."""
    if dtype not in DTYPES:
        raise StoreError(f"dtype {dtype!r} is not supported: use one of {', '.join(DTYPES)}")
    try:
        name, _, k = parse_codec(codec).partition(":")
    except BadInputError:
        raise BadInputError(f"codec {str(codec).strip().lower()!r} is unknown: use {codecs_allowed()}") from None
    kind = CODECS[name]
    if version is not None and version not in range(1, VERSIONS[name] + 1):
        reads = " and ".join(str(v) for v in range(1, VERSIONS[name] + 1))
        raise NewerFormatError(f"codec {name} version {version} is unknown to this kdcache (it reads {reads}): "
                               f"upgrade kdcache, or rebuild the cache")
    given = {"version": VERSIONS[name] if version is None else version, "seed": seed}
    return kind.cls(num_classes, *([int(k)] if kind.takes_k else []), dtype=dtype,
                    **{key: given[key] for key in kind.passes})
