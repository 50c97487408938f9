"""Bounded shared-memory ring buffer of soft targets: the store's streaming mode, nothing persisted."""
# The package splits along the ring's seams: layout (the bytes of the segment), shm (the segment
# and the processes sharing it), base (what both sides share), writer and reader (the two sides).
# Every name the single module store/ring.py had stays importable from store.ring, private ones
# included (tests and tools reach for them).
from ..format import schema  # noqa: F401
from ..format.codec import _finite_or_raise, make_codec  # noqa: F401
from ..errors import (BadInputError, CacheNotFoundError, ConsumerGoneError,  # noqa: F401
                      FingerprintMismatchError, MissingTargetsError, ProducerGoneError, StoreError,
                      UnsupportedFormatError, WriterBusyError)
from .base import _CHECK_S, _MAX_SLEEP, _MIN_SLEEP, _dtype_name, _Ring, _Side, _Waiter  # noqa: F401
from .layout import (_ALIGN, _HEADER, CONSUMER, DEFAULT_CAPACITY, DEFAULT_CODEC,  # noqa: F401
                     DEFAULT_DTYPE, EMPTY, FINISHED, LAYOUT_VERSION, LEFT, MAGIC, MAX_BYTES, MAX_CLASSES,
                     PRODUCER, READY, RUNNING, _align, _as_keys, _bad_slot_state, _check_header, _find_slots,
                     _hash, _layout, _read_header, _ready_beyond_count, _show, _sized_layout)
from .reader import RingReader
from .shm import (_BEAT_S, _NAME_PID_RE, _NAME_RE, _OPEN, PREFIX, SHM_DIR, _beat_loop,  # noqa: F401
                  _creator_of, _distrust, _kind, _open_trusted, _pid_alive, _proc_stat, _ring_name, _Segment,
                  _start_time, _unlink_if, cleanup_stale)
from .writer import RingWriter
