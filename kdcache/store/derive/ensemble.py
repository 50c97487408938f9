"""EnsembleReader: several teachers' caches of the same data and views, combined per key at read time.

Each member is a cache of the same data set identity, sample count, views, class count,
augmentation and seed (its teacher and codec may differ); the first difference is refused in one
line. Per key, the members' targets are decoded (a top-k member to its full distribution first) and
combined with weights w (normalised to sum 1):

* rule "logits": sum_i w_i * x_i / T_i -- the weighted mean of the (tempered) logits;
* rule "probs":  log(sum_i w_i * softmax(x_i / T_i)) -- the weighted mean of the probabilities at
  each member's temperature, returned as log-probabilities (which a softmax at T = 1 returns
  unchanged; the KD loss's own temperature then applies to them as to any logits).

T_i defaults to 1. Building an ensemble from existing caches runs no teacher. Its identity (the
members' fingerprints, weights, temperatures and the rule) is `identity()`, hashed into
`fingerprint`; a run records it. No MXNet here.
"""
import json
import math
import os
from fractions import Fraction
from typing import NamedTuple

import numpy as np

from kdcache.args import Temperature

from ..format.codec import SAMPLED_FLOOR
from ..errors import StoreError
from ..format.fingerprint import fingerprint as _hash
from ..read.reader import CacheReader

RULES = ("logits", "probs")
# What every member must share, in the order a difference is named: (what, how to read it from a spec)
_SAME = (("class count", lambda s: s.num_classes),
         ("sample count", lambda s: s.num_samples),
         ("views", lambda s: s.views),
         ("data set identity", lambda s: (s.inputs or {}).get("dataset")),
         ("augmentation", lambda s: (s.inputs or {}).get("augment")),
         ("augmentation seed", lambda s: (s.inputs or {}).get("augment_seed")))


class Member(NamedTuple):
    """One teacher of an ensemble: its cache (a path as `kdcache ls` shows it), weight and temperature."""
    cache: str
    weight: float = 1.0
    temperature: float = 1.0

    def __str__(self):
        out = self.cache
        if self.weight != 1.0 or self.temperature != 1.0:
            out += f":{_exact(self.weight)}"
        if self.temperature != 1.0:
            out += f":{_exact(self.temperature)}"
        return out


def _exact(x):
    """A number as a word that parses back to it exactly (2 as "2", 1.0000000000000002 in full)."""
    short = f"{x:g}"
    return short if float(short) == x else repr(float(x))


def _weight(value, item):
    """A member's weight: a finite number > 0 (a string as the command line gives it, or a number)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise StoreError(f"ensemble member {item}: weight {value!r} is not a number: write CACHE[:WEIGHT[:T]], "
                         f"e.g. caches/ab12:2") from None
    if isinstance(value, bool) or not (math.isfinite(v) and v > 0):
        raise StoreError(f"ensemble member {item}: weight must be a positive number, not {value}")
    return v


def _temperature(value, item):
    """A member's temperature, in the range of the KD temperature (kdcache.args.Temperature)."""
    if isinstance(value, bool):
        value = str(value)
    return Temperature().coerce(value, f"ensemble member {item}: temperature", error=StoreError)


def normalised(weights, names=None):
    """The weights divided by their sum, as float64 (exactly rounded): StoreError in one line when the sum
    is past float64's range (1e308 twice) or a weight is 0 once divided by it (1e-300 beside 1e300): the
    combination would silently drop members (all of them, at 1e308 twice: the targets uniform)."""
    names = names or [str(i) for i in range(len(weights))]
    total = sum(Fraction(w) for w in weights)
    shown = ", ".join(f"{w:g}" for w in weights)
    try:
        float(total)
    except OverflowError:
        raise StoreError(f"ensemble weights {shown} sum past the largest float64 number (~1.8e308): only their "
                         f"ratios count; give them on a smaller scale, e.g. 1 and 2") from None
    out = [float(Fraction(w) / total) for w in weights]
    zero = [n for n, w in zip(names, out) if w == 0.0]
    if zero:
        raise StoreError(f"ensemble weights {shown}: member {zero[0]}'s weight is 0 once divided by their sum (a "
                         f"ratio past float64's range): it would count for nothing; give weights on a closer scale "
                         f"or leave the member out")
    return out


def parse_members(text):
    """`CACHE[:WEIGHT[:T]],CACHE[:WEIGHT[:T]]...` -> a tuple of Member (at least two). The numbers are
    taken from the end of each item, so a path holding ':' stays whole when it is followed by none."""
    items = [s.strip() for s in str(text).split(",")]
    if any(not s for s in items):
        raise StoreError(f"ensemble {text!r}: an empty member; write CACHE[:WEIGHT[:T]],CACHE[:WEIGHT[:T]]...")
    out = []
    for item in items:
        parts = item.split(":")
        nums = []
        while len(parts) > 1 and len(nums) < 2 and _numberish(parts[-1]):
            nums.insert(0, parts.pop())
        path = ":".join(parts)
        weight = _weight(nums[0], repr(item)) if nums else 1.0
        temp = _temperature(nums[1], repr(item)) if len(nums) > 1 else 1.0
        out.append(Member(path, weight, temp))
    if len(out) < 2:
        raise StoreError(f"ensemble {text!r} names one cache: name two or more, separated by commas")
    normalised([m.weight for m in out], [m.cache for m in out])
    return tuple(out)


def _numberish(s):
    try:
        float(s)
        return True
    except ValueError:
        return False


def as_members(members, weights=None, temperatures=None):
    """Members from a parsed tuple, a string, or paths/readers (with optional weights and temperatures)."""
    if isinstance(members, str):
        return parse_members(members)
    members = list(members)
    if weights is not None and len(weights) != len(members):
        raise StoreError(f"{len(weights)} weights for {len(members)} ensemble members: give one per member")
    if temperatures is not None and len(temperatures) != len(members):
        raise StoreError(f"{len(temperatures)} temperatures for {len(members)} ensemble members: give one per member")
    out = []
    for i, m in enumerate(members):
        if isinstance(m, Member):
            w, t = m.weight, m.temperature
            m = m.cache
        else:
            w, t = 1.0, 1.0
        w = _weight(w if weights is None else weights[i], i)
        t = _temperature(t if temperatures is None else temperatures[i], i)
        out.append(Member(m if isinstance(m, CacheReader) else os.fspath(m), w, t))
    if len(out) < 2:
        raise StoreError("an ensemble needs two or more caches")
    normalised([m.weight for m in out])
    return tuple(out)


class EnsembleReader:
    """Combined soft targets (float32 [B, C]) of several caches, by (sample index, view), as CacheReader.get.

    `members`: "CACHE[:WEIGHT[:T]],..." or a list of paths, CacheReaders or Member; `weights` and
    `temperatures` (one per member) override theirs. `rule`: "logits" or "probs" (module docstring).
    `reader_options` go to each member's CacheReader. `spec` is the first member's: the shape and
    inputs every member shares (the teacher apart).
    """

    def __init__(self, members, *, weights=None, temperatures=None, rule="logits", fingerprints=None,
                 **reader_options):
        self.rule = str(rule).strip().lower()
        if self.rule not in RULES:
            raise StoreError(f"ensemble rule {rule!r} is unknown: use logits (the mean of the logits) or probs (the "
                             f"mean of the probabilities, as log-probabilities)")
        members = as_members(members, weights, temperatures)
        self._options = reader_options
        self.readers = []
        try:
            for i, m in enumerate(members):
                want = fingerprints[i] if fingerprints is not None else None
                self.readers.append(m.cache if isinstance(m.cache, CacheReader)
                                    else CacheReader(m.cache, fingerprint=want, **reader_options))
            self._check()
        except BaseException:
            self.close()
            raise
        self.weights = normalised([m.weight for m in members])
        self.temperatures = [m.temperature for m in members]
        self.members = tuple(Member(r.base, m.weight, m.temperature) for r, m in zip(self.readers, members))
        self.spec = self.readers[0].spec
        self.base = None  # no one cache: nothing to record a read position in, no producer to start
        self.fingerprint = _hash(self.identity())

    def _check(self):
        first = self.readers[0]
        for r in self.readers[1:]:
            for what, get in _SAME:
                a, b = get(first.spec), get(r.spec)
                if a != b:
                    raise StoreError(f"ensemble member {r.base} differs from {first.base} in {what} ({_shown(b)} vs "
                                     f"{_shown(a)}): an ensemble combines caches of the same data, views, seed and "
                                     f"augmentation; build the member with the first one's options")
        for j, r in enumerate(self.readers):
            for q in self.readers[:j]:
                if r.fingerprint == q.fingerprint:
                    raise StoreError(f"ensemble member {r.base} is the same cache as {q.base} (fingerprint "
                                     f"{r.fingerprint}): weight one member instead (CACHE:WEIGHT)")
                how = one_teacher(q.spec, r.spec)
                if how:
                    raise StoreError(f"ensemble members {q.base} and {r.base} hold one teacher's targets ({how}): "
                                     f"the ensemble would count that teacher twice; keep one of them (give it more "
                                     f"weight with CACHE:WEIGHT)")
        if self.rule == "logits":
            for r in self.readers:
                if r.codec.name == "sampled":
                    raise StoreError(f"ensemble member {r.base} is codec {r.codec.spec}, an estimate of the "
                                     f"distribution without logits: combine with rule probs (--ensemble-rule probs)")

    def identity(self):
        """The combination, as a run records it: members' fingerprints and codecs, weights, temperatures, rule."""
        return {"rule": self.rule,
                "members": [{"fingerprint": r.fingerprint, "codec": r.codec.spec, "weight": w, "temperature": t}
                            for r, w, t in zip(self.readers, self.weights, self.temperatures)]}

    def recipe(self):
        """Plain values that open the same ensemble in another process (EnsembleReader(**recipe))."""
        return {"members": [str(m.cache) for m in self.members], "weights": self.weights,
                "temperatures": self.temperatures, "rule": self.rule,
                "fingerprints": [r.fingerprint for r in self.readers], **self._options}

    # -- the CacheReader interface the trainer and the data sets use --------------------------------
    def get(self, indices, views=0, *, wait=True, timeout=None):
        """float32 [B, C]: the members' targets for these keys, combined."""
        rows = [np.asarray(r.get(indices, views, wait=wait, timeout=timeout), dtype=np.float64)
                for r in self.readers]
        return combine(rows, self.weights, self.temperatures, self.rule).astype(np.float32)

    @property
    def num_classes(self):
        return self.spec.num_classes

    @property
    def complete(self):
        return all(r.complete for r in self.readers)

    @property
    def progress(self):
        return min(r.progress for r in self.readers)

    @property
    def stall_s(self):
        return sum(r.stall_s for r in self.readers)

    @property
    def waits(self):
        return sum(r.waits for r in self.readers)

    def refresh(self):
        for r in self.readers:
            r.refresh()

    def flat_keys(self, indices, views=0):
        return self.readers[0].flat_keys(indices, views)

    def items(self, indices):
        """The data set's item records (CacheReader.items): every member was built from the same data; a
        record one member lacks (built before records existed) is taken from another."""
        from ..format.items import known
        out = self.readers[0].items(indices)
        for r in self.readers[1:]:
            lack = ~known(out)
            if not lack.any():
                break
            got = r.items(indices)
            out[lack] = got[lack]
        return out

    def missing(self, indices, views=0):
        """Flat keys among these that some member does not hold yet."""
        out = [r.missing(indices, views) for r in self.readers]
        return np.unique(np.concatenate(out)) if out else np.empty(0, dtype=np.int64)

    def announce(self, indices, views=0):
        return any([r.announce(indices, views) for r in self.readers])

    def producer_alive(self):
        return any(r.producer_alive() for r in self.readers)

    def close(self):
        for r in self.readers:
            r.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _source(spec):
    """The fingerprint of the cache `spec`'s cache was converted from (kdcache convert), or None."""
    src = (spec.inputs or {}).get("converted_from")
    return src.get("fingerprint") if isinstance(src, dict) else None


def teacher_identity(spec):
    """What names the teacher behind a cache, whatever its codec or dtype: the teacher entry of its inputs
    (its files' digests and input preprocessing), which a conversion keeps; without one, the cache a
    conversion came from (or the cache itself)."""
    teacher = (spec.inputs or {}).get("teacher")
    if teacher:
        return json.dumps(teacher, sort_keys=True, default=str)
    return "cache:" + (_source(spec) or spec.fingerprint)


def one_teacher(a, b):
    """How the caches of specs `a` and `b` (of the same data) hold one teacher's targets, in words; None
    when they hold two teachers'."""
    if teacher_identity(a) != teacher_identity(b) and _source(a) != b.fingerprint and _source(b) != a.fingerprint:
        return None
    codecs = f"codec {a.make_codec().spec}/{a.dtype} and {b.make_codec().spec}/{b.dtype}"
    for x, y in ((a, b), (b, a)):
        if _source(y) == x.fingerprint:
            return f"{y.fingerprint} is a conversion of {x.fingerprint}: {codecs}"
    t = (a.inputs or {}).get("teacher")
    name = t.get("name") if isinstance(t, dict) else None
    return f"the same teacher{' ' + str(name) if name else ''} and data in {codecs}"


def combine(rows, weights, temperatures, rule):
    """The members' decoded targets (float [B, C] each) combined per row, in float64 (module docstring)."""
    if rule == "logits":
        return sum(w * x / t for x, w, t in zip(rows, weights, temperatures))
    acc = 0.0
    for x, w, t in zip(rows, weights, temperatures):
        z = x / t
        z = z - z.max(axis=1, keepdims=True)
        p = np.exp(z)
        acc = acc + w * p / p.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        return np.maximum(np.log(acc), SAMPLED_FLOOR)  # a class every member gives 0: finite, as sampled:K's floor


def _shown(v):
    s = json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= 80 else s[:77] + "..."
