"""The ring segment's byte layout: header record, version, geometry and offsets, keys and slot lookup."""
# One segment in /dev/shm (a regular file of the user who runs both sides, mode 0o600), all numpy
# views over one buffer:
#   header   one record of _HEADER: magic, layout version, geometry (capacity, num_classes,
#            codec spec, dtype, total size), creator pid, then per side (producer, consumer): pid,
#            process start time (tells a reused pid apart), heartbeat (time.monotonic, system-wide
#            on Linux), state (running / finished / left); the producer's write counter; the
#            targets' fingerprint and whether the creator gave one; and how many sides attached
#            to the ring by its name (0, then 1: the attaching side removes the name).
#   state    uint8 [capacity]: EMPTY or READY. The producer writes row, then key, then READY;
#            the consumer copies a READY row out, then sets EMPTY. x86 keeps stores in order,
#            so the byte written last publishes the row (single producer, single consumer).
#   keys     int64 [capacity, 2]: (sample index, epoch) of each slot.
#   fields   one array [capacity, *shape] per codec field (codec.fields), 64-byte aligned.
# The segment ends where the last field ends (no padding): its size then grows strictly with
# capacity, so a header whose capacity was changed no longer matches its file.
# The producer fills slots in FIFO order from its head (slot write_count % capacity) and waits
# while that slot is not EMPTY; the consumer finds keys wherever they are, so correctness never
# depends on order, but the producer waits on the oldest unread row: read in about the order
# written, within a window of `capacity` rows.
import math

import numpy as np

from ..format.codec import DTYPES, make_codec
from ..errors import BadInputError, StoreError, UnsupportedFormatError

# Bump when a ring written by this code cannot be read by older code (2: fingerprint; 3: the
# fingerprinted and attached fields, the segment's size without end padding).
LAYOUT_VERSION = 3
MAGIC = b"KDCRING1"

EMPTY, READY = 0, 1
RUNNING, FINISHED, LEFT = 0, 1, 2          # a side's state in the header
PRODUCER, CONSUMER = "producer", "consumer"

DEFAULT_CAPACITY = 4096
DEFAULT_CODEC = "full"
DEFAULT_DTYPE = "float16"

# Far above any machine's /dev/shm, far below where a size stops fitting the header's int64:
# a request over it is a mistake (a stray exponent, a wrong field), not a ring to try to map.
MAX_BYTES = 2**40

_HEADER = np.dtype([
    ("magic", "S8"), ("version", "<i8"), ("capacity", "<i8"), ("num_classes", "<i8"),
    ("codec", "S32"), ("dtype", "S16"), ("total_bytes", "<i8"),
    ("creator_pid", "<i8"), ("creator_start", "<i8"),
    ("producer_pid", "<i8"), ("producer_start", "<i8"), ("producer_beat", "<f8"), ("producer_state", "<i8"),
    ("consumer_pid", "<i8"), ("consumer_start", "<i8"), ("consumer_beat", "<f8"), ("consumer_state", "<i8"),
    ("write_count", "<i8"), ("fingerprint", "S32"), ("fingerprinted", "<i8"), ("attached", "<i8"),
])
_ALIGN = 64


# --- geometry -------------------------------------------------------------------------------

def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(capacity, codec):
    """{part: (offset, shape, dtype)} and the total size in bytes: where the last part ends.
    Python ints throughout: numpy's int64 product wraps silently, and a wrapped size maps a
    segment too small for its views."""
    parts, end = {}, _HEADER.itemsize
    for name, shape, dtype in [("state", (), np.uint8), ("keys", (2,), np.int64)] + \
            [("f:" + n, s, d) for n, s, d in codec.fields]:
        shape, off = (int(capacity),) + tuple(int(s) for s in shape), _align(end)
        parts[name] = (off, shape, np.dtype(dtype))
        end = off + math.prod(shape) * np.dtype(dtype).itemsize
    return parts, end


def _sized_layout(name, capacity, num_classes, codec):
    """_layout() of a ring about to be created; BadInputError naming the value when the ring, or
    one row of logits decoded from it, would exceed MAX_BYTES."""
    if 4 * num_classes > MAX_BYTES:
        raise BadInputError(
            f"ring {name}: num_classes={num_classes} is too many: one row of float32 logits would "
            f"take {4 * num_classes} bytes, more than the {MAX_BYTES} bytes (1 TiB) a ring allows: "
            f"pass the teacher's number of classes")
    parts, total = _layout(capacity, codec)
    if total > MAX_BYTES:
        raise BadInputError(
            f"ring {name}: capacity={capacity} rows of num_classes={num_classes} (codec {codec.spec}, "
            f"dtype {codec.dtype.name}) need {total} bytes, more than the {MAX_BYTES} bytes (1 TiB) a "
            f"ring allows: lower capacity, or use codec topk:K")
    return parts, total


# --- the header -----------------------------------------------------------------------------

def _read_header(buf):
    """The header's fields as Python values (bytes with trailing NULs dropped): a copy, so no view
    keeps the mapping busy, and a peer cannot change a value between its check and its use."""
    return dict(zip(_HEADER.names, np.ndarray((), _HEADER, buffer=buf).item()))


# Fields a side rewrites while the ring runs (all others are fixed once the magic is set), and
# the bounds of any value kdcache writes into them.
_COUNTERS = ("creator_start", "producer_pid", "producer_start", "consumer_pid", "consumer_start", "write_count")
_BEATS = ("producer_beat", "consumer_beat")
_STATES = ("producer_state", "consumer_state")
MAX_CLASSES = MAX_BYTES // 4   # one row of float32 logits decoded from the ring fits MAX_BYTES


def _damaged(name, field, value, rule):
    return UnsupportedFormatError(f"ring {name} has {field}={value!r} in its header ({rule}): it is damaged "
                                  f"or not kdcache's; pass the right ring name, or remove it once no process "
                                  f"uses it (cleanup_stale() does when its creator is dead)")


def _check_header(name, h, size):
    """The geometry of a peer's header (_read_header) as {capacity, num_classes, codec (a codec
    object), dtype, fingerprint (None: created without one), parts}, after checking every field
    against what a kdcache creator writes and the header against the file's `size` in bytes:
    UnsupportedFormatError naming the ring and the field otherwise (damaged, or not kdcache's)."""
    if h["magic"] != MAGIC:
        raise UnsupportedFormatError(
            f"ring {name} is not a kdcache ring: it starts with {h['magic']!r}, not {MAGIC!r}; pass the "
            f"name the creating side reports as .name, or remove the file if nothing of yours uses it")
    if h["version"] != LAYOUT_VERSION:
        raise UnsupportedFormatError(
            f"ring {name} has layout version {h['version']}, this kdcache reads "
            f"{LAYOUT_VERSION}: run the same kdcache version on both sides")
    if h["creator_pid"] < 1:
        raise _damaged(name, "creator_pid", h["creator_pid"], "the pid of the process that created it")
    for field in _COUNTERS:
        if h[field] < 0:
            raise _damaged(name, field, h[field], "a pid, start time or counter, never negative")
    for field in _BEATS:
        if not (math.isfinite(h[field]) and h[field] >= 0):
            raise _damaged(name, field, h[field], "a time.monotonic() reading")
    for field in _STATES:
        if h[field] not in (RUNNING, FINISHED, LEFT):
            raise _damaged(name, field, h[field], f"{RUNNING} running, {FINISHED} finished or {LEFT} left")
    if h["attached"] not in (0, 1):
        raise _damaged(name, "attached", h["attached"], "0, or 1 once the second side attached")
    if h["fingerprinted"] not in (0, 1):
        raise _damaged(name, "fingerprinted", h["fingerprinted"], "1 with a fingerprint, 0 without")
    # Bounds before any product: the header's int64s may hold anything.
    if not 1 <= h["capacity"] <= MAX_BYTES:
        raise _damaged(name, "capacity", h["capacity"], f"a ring holds 1 to {MAX_BYTES} rows")
    if not 1 <= h["num_classes"] <= MAX_CLASSES:
        raise _damaged(name, "num_classes", h["num_classes"], f"a ring holds 1 to {MAX_CLASSES} classes")
    out = {"capacity": h["capacity"], "num_classes": h["num_classes"]}
    for field in ("codec", "dtype", "fingerprint"):
        try:
            out[field] = h[field].decode()
        except UnicodeDecodeError:
            raise _damaged(name, field, h[field], "not text") from None
    fp = out["fingerprint"]
    if fp and not fp.isalnum():
        raise _damaged(name, "fingerprint", fp, "letters and digits")
    if bool(fp) != bool(h["fingerprinted"]):
        raise _damaged(name, "fingerprint", fp, f"fingerprinted={h['fingerprinted']}: a ring created with a "
                                                f"fingerprint names it, one created without leaves it empty")
    out["fingerprint"] = fp or None
    if out["dtype"] not in DTYPES:
        raise _damaged(name, "dtype", out["dtype"], f"one of {', '.join(DTYPES)}")
    try:
        codec = make_codec(out["codec"], out["num_classes"], out["dtype"])
    except StoreError:
        raise _damaged(name, "codec", out["codec"], "full, or topk:K with 1 <= K <= num_classes") from None
    if codec.spec != out["codec"]:
        raise _damaged(name, "codec", out["codec"], f"kdcache writes {codec.spec!r}")
    parts, total = _layout(out["capacity"], codec)
    if total > MAX_BYTES:
        raise _damaged(name, "capacity", out["capacity"], f"with num_classes={out['num_classes']} and codec "
                                                          f"{codec.spec} the ring would take {total} bytes, "
                                                          f"over the {MAX_BYTES} a ring allows")
    if h["total_bytes"] != total:
        raise _damaged(name, "total_bytes", h["total_bytes"], f"its geometry takes {total} bytes")
    if size != total:
        raise UnsupportedFormatError(f"ring {name} is {size} bytes, its header says {total} bytes: it is "
                                     f"damaged or not kdcache's; pass the right ring name, or remove it once no "
                                     f"process uses it")
    out.update(codec=codec, parts=parts)
    return out


def _bad_slot_state(name, state):
    """UnsupportedFormatError when a slot of `state` holds a value no side writes (EMPTY or READY)."""
    bad = np.flatnonzero(state > READY)
    if bad.size:
        return UnsupportedFormatError(
            f"ring {name} has slot {int(bad[0])} in state {int(state[bad[0]])} (a side writes only {EMPTY} "
            f"empty or {READY} ready): it is damaged or not kdcache's; pass the right ring name, or remove it "
            f"once no process uses it")
    return None


def _ready_beyond_count(name, state, write_count):
    """UnsupportedFormatError when the READY slots of `state` cannot be a producer's after
    `write_count` rows: it marks at most write_count of them, below write_count until it wraps."""
    ready = np.flatnonzero(state == READY)
    if ready.size > write_count or (write_count < state.size and ready.size and ready[-1] >= write_count):
        return UnsupportedFormatError(
            f"ring {name} has {ready.size} rows ready (the last in slot {int(ready[-1])}) but write_count="
            f"{write_count} in its header: no producer leaves rows it did not write; it is damaged; pass "
            f"the right ring name, or remove it once no process uses it")
    return None


# --- keys -----------------------------------------------------------------------------------

def _as_keys(indices, epochs):
    idx, ep = np.asarray(indices), np.asarray(epochs)
    if idx.ndim == 0:
        idx = idx.reshape(1)
    if idx.ndim != 1:
        raise BadInputError(f"indices must be a 1-D array of sample indices, got shape {idx.shape}")
    if ep.ndim == 0:
        ep = np.broadcast_to(ep, idx.shape)
    if ep.shape != idx.shape:
        raise BadInputError(f"epochs must be one integer or one per index: got shape {ep.shape} "
                            f"for {idx.shape[0]} indices")
    for what, a in (("indices", idx), ("epochs", ep)):
        if a.size and a.dtype.kind not in "iu":
            raise BadInputError(f"{what} must be integers, got dtype {a.dtype}")
    idx, ep = idx.astype(np.int64), ep.astype(np.int64)
    if idx.size and (idx.min() < 0 or ep.min() < 0):
        raise BadInputError("sample indices and epochs must be >= 0")
    return idx, ep


def _show(keys, limit=3):
    shown = ", ".join(f"({int(i)}, {int(e)})" for i, e in keys[:limit])
    return shown + (" ..." if len(keys) > limit else "")


def _hash(k):
    """64-bit mix of (index, epoch) rows; collisions are resolved by exact comparison."""
    a = k[:, 0].astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    b = k[:, 1].astype(np.uint64) * np.uint64(0xC2B2AE3D27D4EB4F)
    return a ^ (b + (a >> np.uint64(29)))


def _find_slots(state, keys, q, guess):
    """Slot of each key of q [n, 2] among READY slots, -1 where absent; and the next guess.
    In-order reads hit the fast path (the slots right after the last one read); otherwise
    one hash sort of the READY slots, O(R log R), with exact key comparison."""
    n, cap = len(q), len(state)
    cand = (guess + np.arange(n)) % cap
    ok = state[cand] == READY  # state before key: the producer sets READY last
    ok &= (keys[cand] == q).all(axis=1)
    slots = np.where(ok, cand, -1)
    rest = np.flatnonzero(~ok)
    if rest.size:
        ready = np.flatnonzero(state == READY)
        if ready.size:
            k = keys[ready]
            h = _hash(k)
            order = np.argsort(h, kind="stable")
            hs = h[order]
            qr = q[rest]
            qh = _hash(qr)
            pos = np.minimum(np.searchsorted(hs, qh), ready.size - 1)
            same_hash = hs[pos] == qh
            at = order[pos]
            match = same_hash & (k[at] == qr).all(axis=1)
            slots[rest[match]] = ready[at[match]]
            for j in np.flatnonzero(same_hash & ~match):  # a 64-bit hash collision: scan exactly
                hit = np.flatnonzero((k[:, 0] == qr[j, 0]) & (k[:, 1] == qr[j, 1]))
                if hit.size:
                    slots[rest[j]] = ready[hit[0]]
    found = np.flatnonzero(slots >= 0)
    if found.size:
        guess = (int(slots[found[-1]]) + 1) % cap
    return slots, guess
