"""kdcache's soft-target store: HDF5 caches with live readers, a shared-memory ring, fingerprints.

Imports no deep-learning framework: any program with numpy and h5py can read a cache.
"""
from .format.codec import make_codec
from .errors import (BadInputError, CacheChangedError, CacheNotFoundError, ConsumerGoneError, DamagedFileError,
                     DamagedRowsError, FingerprintMismatchError, MissingTargetsError, NewerFormatError, NoSpaceError,
                     ProducerGoneError, StoreError, UnsupportedFormatError, WriterBusyError)
from .osutil import NotTrusted
from .files.parts import PartConflictError
from .format.fingerprint import file_digest, fingerprint
from .read.reader import CacheReader
from .derive.ensemble import EnsembleReader
from .folder.registry import path_for, resolve_cache_dir
from .format.schema import FORMAT_VERSION
from .format.spec import CacheSpec
from .write.writer import CacheWriter, finalize

__all__ = ["CacheSpec", "CacheWriter", "CacheReader", "EnsembleReader", "finalize", "make_codec", "fingerprint",
           "file_digest", "path_for", "resolve_cache_dir", "FORMAT_VERSION", "StoreError",
           "BadInputError", "CacheNotFoundError", "ConsumerGoneError", "DamagedFileError", "FingerprintMismatchError",
           "MissingTargetsError", "ProducerGoneError", "UnsupportedFormatError", "WriterBusyError",
           "CacheChangedError", "DamagedRowsError", "NewerFormatError", "NoSpaceError", "NotTrusted",
           "PartConflictError"]
