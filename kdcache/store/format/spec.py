"""CacheSpec: what a cache holds (shape, codec) and the inputs that name it."""
import dataclasses
import datetime
import json
import numbers

import numpy as np

from . import schema
from .codec import make_codec
from ..errors import StoreError
from .fingerprint import fingerprint
from kdcache import __version__ as TOOL_VERSION  # the package's one version (not part of any fingerprint)


@dataclasses.dataclass(frozen=True)
class CacheSpec:
    """num_samples x views rows of num_classes logits, stored with `codec`.

    `inputs` holds what the targets were computed from (teacher digest and preprocessing,
    data set identity, augmentation): plain JSON data. Together with the shape and codec it
    makes the fingerprint, so a cache is never reused for other inputs.
    """
    num_samples: int
    num_classes: int
    views: int = 1
    codec: str = "full"
    dtype: str = "float16"
    inputs: dict = dataclasses.field(default_factory=dict)
    codec_version: int = None  # None: the version writers write now; a file's own from its metadata
    # Where the inputs were read from (schema.A_SOURCES): recorded for tools that read them again (kdcache
    # verify --teacher), never part of the fingerprint nor of a comparison of specs.
    sources: dict = dataclasses.field(default_factory=dict, compare=False)

    def __post_init__(self):
        for name in ("num_samples", "num_classes", "views"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise StoreError(f"{name} must be a positive integer, got {v!r}")
        if self.codec_version is None:
            object.__setattr__(self, "codec_version", make_codec(self.codec, self.num_classes, self.dtype).version)
        self.make_codec()  # validates codec, dtype and codec version

    def make_codec(self):
        return make_codec(self.codec, self.num_classes, self.dtype, self.codec_version, seed=self.draw_seed)

    @property
    def draw_seed(self):
        """The cache's seed for codecs that draw (sampled:K): the augmentation's seed, part of the inputs (and
        so of the fingerprint); 0 when the views do not vary. A rebuild or a conversion draws the same."""
        seed = self.inputs.get("augment_seed") if isinstance(self.inputs, dict) else None
        return int(seed) if isinstance(seed, numbers.Integral) else 0

    @property
    def num_keys(self):
        return self.num_samples * self.views

    def fingerprint_inputs(self):
        out = {"inputs": self.inputs, "num_samples": self.num_samples, "views": self.views,
               "num_classes": self.num_classes, "codec": self.make_codec().spec, "dtype": self.dtype}
        if self.codec_version != 1:  # version 1 caches keep the fingerprints they were made with
            out["codec_version"] = self.codec_version
        return out

    @property
    def fingerprint(self):
        return fingerprint(self.fingerprint_inputs())

    def meta(self):
        """The metadata every file of this cache carries (plain JSON types)."""
        return {
            schema.A_FORMAT: schema.FORMAT_VERSION,
            schema.A_FINGERPRINT: self.fingerprint,
            schema.A_INPUTS: json.dumps(self.inputs, sort_keys=True),
            schema.A_NUM_SAMPLES: self.num_samples,
            schema.A_VIEWS: self.views,
            schema.A_NUM_CLASSES: self.num_classes,
            schema.A_CODEC: self.make_codec().spec,
            schema.A_CODEC_VERSION: self.codec_version,
            schema.A_DTYPE: self.dtype,
            schema.A_TOOL_VERSION: TOOL_VERSION,
            schema.A_CREATED: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            schema.A_KEY_LAYOUT: schema.KEY_LAYOUT,
            **({schema.A_SOURCES: json.dumps(self.sources, sort_keys=True)} if self.sources else {}),
        }

    @classmethod
    def from_meta(cls, meta):
        inputs = meta.get("inputs")
        if inputs is None:
            inputs = json.loads(meta[schema.A_INPUTS])
        return cls(num_samples=int(meta[schema.A_NUM_SAMPLES]), num_classes=int(meta[schema.A_NUM_CLASSES]),
                   views=int(meta[schema.A_VIEWS]), codec=str(meta[schema.A_CODEC]),
                   dtype=str(meta[schema.A_DTYPE]), inputs=inputs,
                   codec_version=_version(meta.get(schema.A_CODEC_VERSION, 1)), sources=_sources(meta))


def _sources(meta):
    """The recorded sources (a dict), {} when absent or unreadable: they are a hint for reading the inputs
    again, whose content the fingerprint's digests check."""
    try:
        v = json.loads(meta.get(schema.A_SOURCES) or "{}")
    except (TypeError, ValueError, RecursionError):
        return {}
    return v if isinstance(v, dict) else {}


def _version(v):
    if not isinstance(v, numbers.Integral) or isinstance(v, (bool, np.bool_)) or v < 1:
        raise StoreError(f"attribute {schema.A_CODEC_VERSION} is {v!r}, not a positive integer")
    return int(v)
