"""A finished cache file without a seal, read first by a child process under a time limit.

Files written before seals existed (format version 1, NOTE [the seal]) have nothing that checks their
HDF5 metadata before the HDF5 library parses it, and one flipped bit there has made HDF5 hang with
signals ignored or crash. So the first time a process opens such a file, a child process
(`python -m kdcache.store.files.probe_child PATH`) reads everything a reader reads of it -- its metadata, the
structure check, the checksum table -- and the parent waits at most LIMIT_S seconds: a child that
hangs is killed, one that dies of a signal is reported, and either way the file is DamagedFileError in
the parent, one line, which never touched it. A file the child read cleanly is opened in the parent:
the same bytes through the same library. The verdict is remembered per file (device, inode, size,
modification time) for the life of the process.
"""
import os
import signal
import subprocess
import sys

from ..errors import DamagedFileError, NewerFormatError

LIMIT_S = 60.0
CHILD = False  # True in the child (probe_child): its own opens read the file directly
OK = 0
REFUSED = 3
REFUSED_OURS = 4  # refused after its kdcache metadata was found: a kdcache cache, damaged
_seen = {}


def in_child():
    return CHILD


def check(path, st, *, limit_s=None):
    """Raise DamagedFileError (or the child's own refusal) unless a child process reads the unsealed
    finished file at `path` (whose fstat is `st`) within the time limit."""
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
    if key in _seen:
        if _seen[key] is not None:
            raise _seen[key]
        return
    limit = LIMIT_S if limit_s is None else limit_s
    try:
        r = subprocess.run([sys.executable, "-m", "kdcache.store.files.probe_child", os.fspath(path)],
                           stdin=subprocess.DEVNULL, capture_output=True, timeout=limit)
    except subprocess.TimeoutExpired:
        err = DamagedFileError(f"{path}: the HDF5 library did not finish reading this file's metadata in {limit:.0f} s "
                               f"(a file kdcache wrote before it sealed its files, damaged so that HDF5 loops): "
                               f"remove it (kdcache gc removes damaged caches) and rebuild it", ours=False)
    else:
        line = (r.stderr.decode("utf-8", "replace").strip().splitlines() or [""])[-1]
        if r.returncode == OK:
            err = None
        elif r.returncode == REFUSED and line.startswith("newer:"):
            err = NewerFormatError(line[len("newer:"):].strip())
        elif r.returncode in (REFUSED, REFUSED_OURS):
            err = DamagedFileError(line, ours=r.returncode == REFUSED_OURS)
        elif r.returncode < 0:
            name = signal.Signals(-r.returncode).name if -r.returncode in signal.Signals._value2member_map_ else \
                f"signal {-r.returncode}"
            err = DamagedFileError(f"{path}: the HDF5 library crashed ({name}) reading this file's metadata (a file "
                                   f"kdcache wrote before it sealed its files, damaged): remove it (kdcache gc "
                                   f"removes damaged caches) and rebuild it", ours=False)
        else:
            err = DamagedFileError(f"{path}: could not be read ({line[:200] or f'exit status {r.returncode}'}): "
                                   f"remove it (kdcache gc removes damaged caches) and rebuild it", ours=False)
    _seen[key] = err
    if err is not None:
        raise err
