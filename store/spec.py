"""CacheSpec: what a cache holds (shape, codec) and the inputs that name it."""
import dataclasses
import datetime
import json

from . import schema
from .codec import make_codec
from .errors import StoreError
from .fingerprint import fingerprint

TOOL_VERSION = "0.1.0"


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

    def __post_init__(self):
        for name in ("num_samples", "num_classes", "views"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise StoreError(f"{name} must be a positive integer, got {v!r}")
        self.make_codec()  # validates codec and dtype

    def make_codec(self):
        return make_codec(self.codec, self.num_classes, self.dtype)

    @property
    def num_keys(self):
        return self.num_samples * self.views

    def fingerprint_inputs(self):
        return {"inputs": self.inputs, "num_samples": self.num_samples, "views": self.views,
                "num_classes": self.num_classes, "codec": self.make_codec().spec, "dtype": self.dtype}

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
            schema.A_DTYPE: self.dtype,
            schema.A_TOOL_VERSION: TOOL_VERSION,
            schema.A_CREATED: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            schema.A_KEY_LAYOUT: schema.KEY_LAYOUT,
        }

    @classmethod
    def from_meta(cls, meta):
        inputs = meta.get("inputs")
        if inputs is None:
            inputs = json.loads(meta[schema.A_INPUTS])
        return cls(num_samples=int(meta[schema.A_NUM_SAMPLES]), num_classes=int(meta[schema.A_NUM_CLASSES]),
                   views=int(meta[schema.A_VIEWS]), codec=str(meta[schema.A_CODEC]),
                   dtype=str(meta[schema.A_DTYPE]), inputs=inputs)
