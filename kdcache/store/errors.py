"""Typed errors of the soft-target store; every message names the cause and the fix."""
from kdcache.errors import KdcacheError


class StoreError(KdcacheError):
    """Base class: anything a user can cause when building or reading a cache."""


class BadInputError(StoreError, ValueError):
    """Logits or keys handed to a writer are unusable (NaN/Inf, shape, range)."""


class FingerprintMismatchError(StoreError):
    """A cache exists at the path but was built from other inputs."""


class UnsupportedFormatError(StoreError):
    """A file is not a kdcache cache, or was written by a newer format version."""


class DamagedFileError(UnsupportedFormatError):
    """A kdcache file that changed after it was written: its seal or its structure does not match
    (store.format.seal). `kdcache verify` reports it NOT sound; `gc` removes it as damaged. `ours`: known to be
    kdcache's (sealed, or its kdcache metadata was read); False for an unsealed file no one could read."""

    def __init__(self, message, *, ours=True):
        super().__init__(message)
        self.ours = ours


class DamagedRowsError(UnsupportedFormatError):
    """Stored rows that cannot be what a writer wrote (a class index past the class count): the file was
    changed after it was written. `rows`: their positions in the batch being decoded."""

    def __init__(self, message, rows=None):
        super().__init__(message)
        self.rows = rows


class NewerFormatError(UnsupportedFormatError):
    """A file written by a newer kdcache (a higher format version): refused, never removed as damaged."""


class WriterBusyError(StoreError):
    """Another producer holds the lock on this cache (or shard)."""


class CacheNotFoundError(StoreError, FileNotFoundError):
    """No cache (complete or in progress) exists at the path."""


class ProducerGoneError(StoreError):
    """Targets are missing and no producer is alive to write them."""


class MissingTargetsError(StoreError, TimeoutError):
    """Targets did not appear within the timeout although a producer is alive."""

    def __init__(self, message, missing=None):
        super().__init__(message)
        self.missing = missing


class ConsumerGoneError(StoreError):
    """The ring buffer's reader died or left; a writer would block forever."""


class NoSpaceError(StoreError):
    """The file system has no room for what must be written (ENOSPC, EDQUOT); nothing written
    before is lost."""


class CacheChangedError(StoreError):
    """A cache file changed under an open reader: it shrank (truncated) or was replaced."""
