"""The ring segment's byte layout: header record, version, geometry and offsets, keys and slot lookup."""
# One segment in /dev/shm (POSIX shared memory, mode 0o600), all numpy views over one buffer:
#   header   one record of _HEADER: magic, layout version, geometry (capacity, num_classes,
#            codec spec, dtype), creator pid, then per side (producer, consumer): pid, process
#            start time (tells a reused pid apart), heartbeat (time.monotonic, system-wide on
#            Linux), state (running / finished / left); and the producer's write counter.
#   state    uint8 [capacity]: EMPTY or READY. The producer writes row, then key, then READY;
#            the consumer copies a READY row out, then sets EMPTY. x86 keeps stores in order,
#            so the byte written last publishes the row (single producer, single consumer).
#   keys     int64 [capacity, 2]: (sample index, epoch) of each slot.
#   fields   one array [capacity, *shape] per codec field (codec.fields), 64-byte aligned.
# The producer fills slots in FIFO order from its head (slot write_count % capacity) and waits
# while that slot is not EMPTY; the consumer finds keys wherever they are, so correctness never
# depends on order, but the producer waits on the oldest unread row: read in about the order
# written, within a window of `capacity` rows.
import math

import numpy as np

from ..errors import BadInputError, UnsupportedFormatError

LAYOUT_VERSION = 2     # bump when a ring written by this code cannot be read by older code (2: fingerprint)
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
    ("write_count", "<i8"), ("fingerprint", "S32"),
])
_ALIGN = 64


# --- geometry -------------------------------------------------------------------------------

def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _layout(capacity, codec):
    """{part: (offset, shape, dtype)} and the total size in bytes. Python ints throughout: numpy's
    int64 product wraps silently, and a wrapped size maps a segment too small for its views."""
    parts, off = {}, _align(_HEADER.itemsize)
    for name, shape, dtype in [("state", (), np.uint8), ("keys", (2,), np.int64)] + \
            [("f:" + n, s, d) for n, s, d in codec.fields]:
        shape = (int(capacity),) + tuple(int(s) for s in shape)
        parts[name] = (off, shape, np.dtype(dtype))
        off = _align(off + math.prod(shape) * np.dtype(dtype).itemsize)
    return parts, off


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
    """The header's fields as Python values: a copy, so no view keeps the mapping busy."""
    return dict(zip(_HEADER.names, np.ndarray((), _HEADER, buffer=buf).item()))


def _check_header(name, h):
    """The geometry of a peer's header (_read_header) as {capacity, num_classes, codec, dtype,
    fingerprint}, text decoded; UnsupportedFormatError naming the ring and the field when the
    version differs or a field cannot be a ring's (a damaged segment, or not kdcache's).
    An empty fingerprint is a ring created without one: no check, as documented."""
    version = h["version"]
    if version != LAYOUT_VERSION:
        raise UnsupportedFormatError(
            f"ring {name} has layout version {version}, this kdcache reads "
            f"{LAYOUT_VERSION}: run the same kdcache version on both sides")

    def damaged(field, value, rule):
        return UnsupportedFormatError(f"ring {name} has {field}={value!r} in its header ({rule}): it is "
                                      f"damaged; remove it with cleanup_stale()")
    if h["capacity"] < 1:
        raise damaged("capacity", h["capacity"], "a ring holds at least 1 row")
    if h["num_classes"] < 1:
        raise damaged("num_classes", h["num_classes"], "a ring holds at least 1 class")
    out = {"capacity": h["capacity"], "num_classes": h["num_classes"]}
    for field in ("codec", "dtype", "fingerprint"):
        try:
            out[field] = h[field].decode()
        except UnicodeDecodeError:
            raise damaged(field, h[field], "not text") from None
    if out["fingerprint"] and not out["fingerprint"].isalnum():
        raise damaged("fingerprint", out["fingerprint"], "letters and digits, or empty for none")
    return out


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
