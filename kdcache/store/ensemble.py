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
from typing import NamedTuple

import numpy as np

from .codec import SAMPLED_FLOOR
from .errors import StoreError
from .fingerprint import fingerprint as _hash
from .reader import CacheReader

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
            out += f":{self.weight:g}"
        if self.temperature != 1.0:
            out += f":{self.temperature:g}"
        return out


def _positive(text, what, item):
    try:
        v = float(text)
    except ValueError:
        raise StoreError(f"ensemble member {item!r}: {what} {text!r} is not a number: write CACHE[:WEIGHT[:T]], "
                         f"e.g. caches/ab12:2") from None
    if not (math.isfinite(v) and v > 0):
        raise StoreError(f"ensemble member {item!r}: {what} must be a positive number, not {text}")
    return v


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
        weight = _positive(nums[0], "weight", item) if nums else 1.0
        temp = _positive(nums[1], "temperature", item) if len(nums) > 1 else 1.0
        out.append(Member(path, weight, temp))
    if len(out) < 2:
        raise StoreError(f"ensemble {text!r} names one cache: name two or more, separated by commas")
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
        w = w if weights is None else weights[i]
        t = t if temperatures is None else temperatures[i]
        for what, v in (("weight", w), ("temperature", t)):
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise StoreError(f"ensemble member {i}: {what} must be a positive number, not {v!r}")
        out.append(Member(m if isinstance(m, CacheReader) else os.fspath(m), float(w), float(t)))
    if len(out) < 2:
        raise StoreError("an ensemble needs two or more caches")
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
        total = sum(m.weight for m in members)
        self.weights = [m.weight / total for m in members]
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
            if r.fingerprint == first.fingerprint:
                raise StoreError(f"ensemble member {r.base} is the same cache as {first.base} (fingerprint "
                                 f"{r.fingerprint}): weight one member instead (CACHE:WEIGHT)")
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
        from .items import known
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
