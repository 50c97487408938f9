"""Operating-system helpers of the store: OS errors as one line, directory fsync, free memory, quiet stderr."""
import contextlib
import os
import re
import sys

from .errors import StoreError


def fs_error(e, where, fix):
    """One line naming the operating system's reason (h5py's messages hold it as 'error message')."""
    reason = getattr(e, "strerror", None)
    if not reason:
        text = str(e)
        m = re.search(r"error message = '([^']+)'", text)
        reason = m.group(1) if m else text.splitlines()[0][:160]
    return StoreError(f"{where}: {reason} ({type(e).__name__}): {fix}")


@contextlib.contextmanager
def stderr_silenced(active):
    """Closing a segment after a failed write makes HDF5 retry its flushes, and h5py prints each
    failure from a deallocator, straight to file descriptor 2. The writer has already raised one
    clear error; keep those echoes off the terminal."""
    if not active:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def fsync_dir(d):
    """Make a rename in directory `d` durable (best effort: some file systems refuse it)."""
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def available_memory():
    """MemAvailable from /proc/meminfo in bytes (a conservative 1 GiB if unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 30
